"""A complete model family added from tests/ alone (tests/gpt2_family.py: its module, KV-cache decoding and Hugging
Face adapter, nothing under jaxtrain/ edited for it): it trains, generates with the cache what the full forward and
transformers generate, exports a trained run that transformers loads with jaxtrain's logits, imports a
transformers-built GPT-2 with transformers' logits and exports it back bitwise."""

import json
import pathlib

import jax
import numpy as np
import pytest

from jaxtrain import hf, models
from jaxtrain import sampling as sampling_lib
from jaxtrain import sharding
from jaxtrain.train import trainer
from tests import gpt2_family  # noqa: F401 - registers the family "gpt2" and its adapter
from tests.test_extensions import gpt2_config
from tests.test_generate import _layout
from tests.test_hf import TOL, _exported_equals_source, _hf_logits, _rel_err, _restore, logit_errors

torch = pytest.importorskip("torch", reason="torch (test-only) is not installed: the comparisons need it")
transformers = pytest.importorskip("transformers", reason="transformers (test-only) is not installed")

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [12, 99, 3, 200, 18, 64, 1], [64, 64, 8, 250, 9, 31, 77]]


def _transformers_gpt2(folder, seed=0):
  """A small random GPT2LMHeadModel saved as safetensors (LayerNorm weights and biases random too)."""
  torch.manual_seed(seed)
  model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
      vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=96, bos_token_id=1,
      eos_token_id=2)).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  model.save_pretrained(folder, safe_serialization=True)
  (pathlib.Path(folder) / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')  # (an export carries one)
  return model


def _loads_cleanly(folder):
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
  assert not any(info.values()), info  # no missing, unexpected or mismatched keys
  assert type(loaded).__name__ == "GPT2LMHeadModel"
  return loaded.eval()


@pytest.mark.slow
def test_gpt2_trains_generates_and_exports_what_transformers_computes(tmp_path):
  cfg = gpt2_config(tmp_path / "run", steps=4, fsdp=8)
  state, history = trainer.train(cfg)
  assert history[-1]["loss"] < history[0]["loss"]
  model = models.Model.from_config(cfg.model)
  mesh, rules = _layout()
  shardings = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  params = jax.device_put(jax.device_get(state.params), shardings)

  # Generation: the KV cache gives the full forward's tokens and logits at every step.
  results = {}
  for use_cache in (True, False):
    gen = sampling_lib.Generator(model, mesh, rules, shardings, rows=3, prompt_len=7, max_new_tokens=8,
                                 use_cache=use_cache, return_logits=True)
    out, produced, logits, _ = jax.device_get(gen(params, gen.batch(PROMPTS)))
    results[use_cache] = out, logits
  np.testing.assert_array_equal(results[True][0], results[False][0])
  # Its decoding writes with attention.write_kv at cache.index: a static batch only (models/core.py's paged_cache).
  with pytest.raises(sampling_lib.GenerateError, match="model.name=gpt2: the model family has no paged KV-cache"):
    sampling_lib.ContinuousGenerator(model, mesh, rules, shardings, requests=3, slots=1, prompt_len=7,
                                     max_new_tokens=8)
  assert np.max(np.abs(results[True][1] - results[False][1])) < 1e-5
  assert np.max(np.abs(results[True][1])) > 0.1  # logits that are not all ~0

  # Export: transformers loads the run and computes jaxtrain's logits, and generates jaxtrain's tokens greedily.
  # A run trained from scratch carries no tokenizer: the export takes one (--tokenizer; without it, it refuses).
  from tests import harness_data
  harness_data.bpe_tokenizer()[0].save(str(tmp_path / "tokenizer.json"))
  with pytest.raises(hf.HFError, match="carries no tokenizer"):
    hf.export_model(cfg.workdir, str(tmp_path / "refused"))
  assert not (tmp_path / "refused").exists()
  info = hf.export_model(cfg.workdir, str(tmp_path / "exported"), tokenizer=str(tmp_path / "tokenizer.json"))
  assert info["dtype"] == "float32" and (tmp_path / "exported" / "tokenizer.json").exists()
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_inner"] == 128
  loaded = _loads_cleanly(tmp_path / "exported")
  tokens = np.random.default_rng(2).integers(0, 256, (2, 32)).astype(np.int32)
  ours = np.asarray(model.apply(params, tokens, np.broadcast_to(np.arange(32, dtype=np.int32), (2, 32)),
                                np.ones((2, 32), np.int32)))
  err = _rel_err(ours, _hf_logits(loaded, tokens))
  print(f"trained gpt2: max relative logit error against transformers {err:.2e}")
  assert err < TOL
  with torch.no_grad():
    theirs = loaded.generate(input_ids=torch.tensor(PROMPTS), attention_mask=torch.ones(3, 7, dtype=torch.long),
                             do_sample=False, max_new_tokens=8, pad_token_id=0).numpy()[:, 7:]
  np.testing.assert_array_equal(results[True][0], theirs)


@pytest.mark.slow
def test_gpt2_imports_from_transformers_and_exports_back(tmp_path):
  ref = _transformers_gpt2(tmp_path / "src")
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  cfg, model, params = _restore(tmp_path / "out")
  assert cfg.model.name == "gpt2" and cfg.model.mlp_dim == 96 and cfg.model.n_positions == 64
  padded_err, packed_err = logit_errors(model, params, ref, vocab=128)
  print(f"imported gpt2: max relative logit error padded {padded_err:.2e}, packed {packed_err:.2e}")
  assert padded_err < TOL and packed_err < TOL
  hf.export_model(str(tmp_path / "out" / "checkpoints"), str(tmp_path / "exported"))
  _exported_equals_source(tmp_path / "src", tmp_path / "exported")
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2  # the source's ids survive
  tokens = np.random.default_rng(1).integers(0, 128, (2, 20))
  np.testing.assert_array_equal(_hf_logits(_loads_cleanly(tmp_path / "exported"), tokens), _hf_logits(ref, tokens))


def test_gpt2_adapter_refuses_what_the_family_does_not_compute(tmp_path):
  """A config.json the family computes otherwise: one HFError line naming the key, and nothing written."""
  base = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=128, n_embd=64, n_layer=2, n_head=4,
              n_positions=64)
  assert hf.model_config(base).n_positions == 64
  for key, value in (("scale_attn_by_inverse_layer_idx", True), ("activation_function", "relu"),
                     ("tie_word_embeddings", False)):
    with pytest.raises(hf.HFError, match=f"config.json: sets {key}="):
      hf.model_config({**base, key: value})
  (tmp_path / "src").mkdir()
  (tmp_path / "src" / "config.json").write_text(json.dumps({**base, "add_cross_attention": True}))
  with pytest.raises(hf.HFError, match="sets add_cross_attention=True"):
    hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()

"""Hugging Face Llama and Mixtral checkpoints in and out (jaxtrain/hf.py, tools/convert_hf.py): jaxtrain's logits on
an imported checkpoint equal transformers' (padded batch, packed row), exports load in transformers with the same
logits, import -> export is bitwise, and bad inputs give one line and exit 2 with nothing written."""

import contextlib
import http.server
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import threading

import jax
import numpy as np
import pytest

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import hf
from jaxtrain import models
from jaxtrain.train.state import TrainState
from tests import forked

torch = pytest.importorskip("torch", reason="torch (test-only, pinned for Python 3.11 in setup.cfg's test extra) "
                            "is not installed: the Hugging Face comparisons need it")
transformers = pytest.importorskip("transformers", reason="transformers (test-only) is not installed: the "
                                   "Hugging Face comparisons need it")
from safetensors.numpy import load_file  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-4  # max |jaxtrain - transformers| / max |logit|

CONFIGS = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500_000.0),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500_000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),  # wavelengths of all three regimes at head_dim 16
    "wide_heads": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),  # 4 x 32 != 64
    # Mixtral: 4 experts, top-2 (the hub's per-expert w1/w2/w3 tensors; transformers fuses them when loading).
    "mixtral": dict(mixtral=True, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, rope_theta=1e6, sliding_window=None),
}


def _hf_model(folder, seed=0, mixtral=False, **overrides):
  """A small random LlamaForCausalLM (or MixtralForCausalLM) saved as safetensors (norm weights random too, so that
  they are tested)."""
  kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5,
            max_position_embeddings=128)
  kw.update(overrides)
  torch.manual_seed(seed)
  if mixtral:
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw)).eval()
  else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  model.save_pretrained(folder, safe_serialization=True)
  (pathlib.Path(folder) / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
  (pathlib.Path(folder) / "tokenizer_config.json").write_text('{"model_max_length": 128}')
  return model


def _load_config(path):
  spec = importlib.util.spec_from_file_location("imported_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _restore(out):
  """The imported config (from OUT/config.py) and params, read as the trainer's restore_from reads them."""
  cfg = _load_config(out / "config.py")
  model = models.Model.from_config(cfg.model)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), model.abstract_params)
  target = TrainState(step=jax.ShapeDtypeStruct((), np.int32, sharding=device), params=abstract, opt_state={})
  restored, step = checkpoint_lib.restore_from(cfg.checkpoint.restore_from, target, params_only=True)
  assert step == 0
  return cfg, model, restored["params"]


def _hf_logits(model, tokens, attention_mask=None):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(np.asarray(tokens)),
                attention_mask=None if attention_mask is None else torch.tensor(np.asarray(attention_mask)))
  return out.logits.numpy()


def _rel_err(a, b):
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_imported_logits_equal_transformers(name, tmp_path):
  ref = _hf_model(tmp_path / "src", **CONFIGS[name])
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  cfg, model, params = _restore(tmp_path / "out")
  assert cfg.checkpoint.restore_mode == "params"
  assert (tmp_path / "out" / "hf" / "tokenizer.json").exists()
  padded_err, packed_err = logit_errors(model, params, ref, vocab=128)
  print(f"{name}: max relative logit error padded {padded_err:.2e}, packed {packed_err:.2e}")
  assert padded_err < TOL and packed_err < TOL


def logit_errors(model, params, ref, vocab=256):
  """(padded batch, packed row): the largest relative logit error against the transformers model ``ref`` on a
  right-padded batch (row 1 has 7 real tokens, then padding: segment 0 in jaxtrain, attention_mask 0 in HF) and on
  a packed row of documents of 9 and 15 tokens (segment ids 1 and 2, positions restarting at 0), each document
  against itself alone in transformers."""
  rng = np.random.default_rng(0)
  t, real = 24, 7
  tokens = rng.integers(0, vocab, (2, t)).astype(np.int32)
  mask = np.ones((2, t), np.int32)
  mask[1, real:] = 0
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (2, t))
  ours = np.asarray(model.apply(params, tokens, positions, mask))
  theirs = _hf_logits(ref, tokens, mask)
  padded = max(_rel_err(ours[0], theirs[0]), _rel_err(ours[1, :real], theirs[1, :real]))
  a, b = tokens[0, :9], tokens[1, :15]
  row = np.concatenate([a, b])[None]
  seg = np.array([[1] * 9 + [2] * 15], np.int32)
  pos = np.array([list(range(9)) + list(range(15))], np.int32)
  packed = np.asarray(model.apply(params, row, pos, seg))[0]
  return padded, max(_rel_err(packed[:9], _hf_logits(ref, a[None])[0]),
                     _rel_err(packed[9:], _hf_logits(ref, b[None])[0]))


def random_hf_model(build, folder, seed=0):
  """``build()`` (a transformers model) made with torch seeded by ``seed``, every parameter (norms too) moved by
  noise of 0.05 and every router's choice bias (``e_score_correction_bias``, a buffer) drawn with a spread of 0.02,
  that of the scores', saved as safetensors in ``folder`` with a stub tokenizer; returned in eval mode."""
  torch.manual_seed(seed)
  model = build().eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
    for n, b in model.named_buffers():
      if n.endswith("e_score_correction_bias"):
        b.copy_(torch.randn_like(b) * 0.02)
  model.save_pretrained(folder, safe_serialization=True)
  (pathlib.Path(folder) / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
  return model


def imported_from(tmp, build):
  """``(tmp, the transformers model build(tmp / "src") saved there, the import's config, model and params)``."""
  ref = build(tmp / "src")
  hf.import_model(str(tmp / "src"), str(tmp / "out"))
  return (tmp, ref, *_restore(tmp / "out"))


def random_builder(model_class, config_class, hf_config: dict):
  """``folder -> the transformers model``: a random ``model_class(config_class(**hf_config))`` saved there."""
  return lambda folder: random_hf_model(lambda: model_class(config_class(**hf_config)), folder)


def set_quantization(folder, quantization: dict) -> None:
  """FOLDER/config.json given ``quantization`` as its ``quantization_config``."""
  config = json.loads((folder / "config.json").read_text())
  config["quantization_config"] = quantization
  (folder / "config.json").write_text(json.dumps(config))


def import_quantized(src, to, quantization: dict):
  """TO/src (its quantized weights saved there already) with ``src``'s config.json, ``quantization`` as its
  ``quantization_config``, and ``src``'s tokenizer, imported into TO/out: the imported model and params."""
  for name in ("config.json", "tokenizer.json"):
    shutil.copy(src / name, to / "src" / name)
  set_quantization(to / "src", quantization)
  hf.import_model(str(to / "src"), str(to / "out"))
  return _restore(to / "out")[1:]


def imported_fixture(name: str, build):
  """A module-scoped fixture ``imported``: :func:`imported_from` a folder named ``name`` and ``build``."""
  @pytest.fixture(scope="module")
  def imported(tmp_path_factory):
    """(folder, the transformers model, the imported config, model and params)."""
    return imported_from(tmp_path_factory.mktemp(name), build)
  return imported


def mis_mapping_errors(model_cfg, params, ref, mis_maps, vocab=256):
  """{name: the largest relative logit error against the transformers model ``ref``} of each ``mis_map(params,
  cfg)`` applied to a copy of an imported model group and its params (a family's own difference mapped wrong on
  purpose), on two rows of 24 tokens."""
  tokens = np.random.default_rng(0).integers(0, vocab, (2, 24)).astype(np.int32)
  theirs = _hf_logits(ref, tokens)
  side = (np.broadcast_to(np.arange(24, dtype=np.int32), (2, 24)), np.ones((2, 24), np.int32))
  errors, forwards = {}, {}  # forwards: a config's jitted forward (the params' mis-mappings share the config's)
  for mis_map in mis_maps:
    cfg, wrong = model_cfg.copy_and_resolve_references(), jax.tree.map(np.array, params)
    mis_map(wrong, cfg)
    forward = forwards.setdefault(str(cfg), jax.jit(models.Model.from_config(cfg).apply))
    errors[mis_map.__name__] = _rel_err(np.asarray(forward(wrong, tokens, *side)), theirs)
  return errors


def assert_export_equals_source(tmp, ref, exported):
  """The import in TMP/out exported to ``exported``: its safetensors are TMP/src's bitwise, its config.json names
  ``ref``'s (the transformers model saved in TMP/src) model_type and class, and transformers loads it with no
  missing, unexpected or mismatched keys, ``ref``'s RoPE parameters and ``ref``'s logits; returns transformers' model
  of it."""
  hf.export_model(str(tmp / "out" / "checkpoints"), str(exported))
  _exported_equals_source(tmp / "src", exported)
  config = json.loads((exported / "config.json").read_text())
  assert (config["model_type"], config["architectures"]) == (ref.config.model_type, [type(ref).__name__])
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(exported), output_loading_info=True)
  assert not any(info.values()), info
  assert loaded.config.rope_parameters == ref.config.rope_parameters
  tokens = np.random.default_rng(1).integers(0, 256, (2, 20))
  np.testing.assert_array_equal(_hf_logits(loaded.eval(), tokens), _hf_logits(ref, tokens))
  return loaded

def assert_greedy_generation_equals(out, ref, overrides=(), new=10):
  """Greedy generation from the import in ``out`` (its config with ``overrides``: left-padded prompts through the KV
  cache, and through continuous batching's paged cache) equals the transformers model ``ref``'s, token for token;
  returns the loaded model (jaxtrain.generate.load's)."""
  from jaxtrain import generate
  from jaxtrain import sampling as sampling_lib
  prompts = [[5, 17, 33, 2, 90, 11, 64], [7, 8, 9], [100, 3, 55, 21]]
  loaded = generate.load(str(out), overrides=list(overrides))
  gen = sampling_lib.Generator(loaded.model, loaded.mesh, loaded.rules, loaded.param_shardings,
                               rows=sampling_lib.padded_rows(len(prompts), loaded.mesh, loaded.rules), prompt_len=7,
                               max_new_tokens=new, eos_ids=())
  ours = gen.generate(loaded.params, prompts)
  queue = sampling_lib.ContinuousGenerator(loaded.model, loaded.mesh, loaded.rules, loaded.param_shardings,
                                           requests=3, slots=sampling_lib.padded_rows(1, loaded.mesh, loaded.rules),
                                           prompt_len=7, max_new_tokens=new, page_size=4)
  assert queue.generate(loaded.params, prompts) == ours
  batch = gen.batch(prompts)
  with torch.no_grad():
    theirs = ref.generate(input_ids=torch.tensor(batch.tokens[:3]), attention_mask=torch.tensor(batch.segment_ids[:3]),
                          do_sample=False, max_new_tokens=new, pad_token_id=0, eos_token_id=None).numpy()[:, 7:]
  assert ours == theirs.tolist()
  return loaded


def lora_fine_tune_exports_what_jaxtrain_computes(tmp_path, sft_data):
  """The LoRA check of a transformers model saved in TMP_PATH/src (vocab 256): imported, LoRA (rank 4 on q, v, o)
  trained 2 steps on ``sft_data`` (tests/test_families.py's fixture) from OUT/config.py, exported merged; the base
  stays as imported, transformers loads the export with no missing or unexpected keys, and its logits are jaxtrain's
  adapted model's."""
  from jaxtrain.train import trainer
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  cfg = _load_config(tmp_path / "out" / "config.py")
  cfg.workdir = str(tmp_path / "run")
  cfg.model.lora.update(rank=4, alpha=8.0, targets="q,v,o")
  cfg.data.update(path=sft_data, seq_len=32, tokenizer="byte")  # (not the import's: the data says which it is)
  cfg.train.update(steps=2, global_batch_size=8, log_every=1)
  cfg.optim.update(lr=1e-2, warmup_steps=1)
  state, _ = trainer.train(cfg)
  params = jax.device_get(state.params)
  _, _, imported = _restore(tmp_path / "out")
  base = {k: v for k, v in params.items() if k != "lora"}
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(jax.device_get(imported))))
  assert any(np.any(b != 0) for b in jax.tree.leaves(params["lora"]))  # B left zero: the adapters trained
  hf.export_model(str(tmp_path / "run"), str(tmp_path / "exported"))
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert not any(info.values()), info
  tokens = np.random.default_rng(2).integers(0, 256, (2, 16)).astype(np.int32)
  ours = np.asarray(models.Model.from_config(cfg.model).apply(
      params, tokens, np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16)), np.ones((2, 16), np.int32)))
  assert _rel_err(ours, _hf_logits(loaded.eval(), tokens)) < TOL


def _exported_equals_source(src, exported):
  ours = load_file(str(exported / "model.safetensors"))
  theirs = load_file(str(src / "model.safetensors"))
  assert ours.keys() == theirs.keys()
  for k in theirs:
    assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
    assert ours[k].tobytes() == theirs[k].tobytes(), k


@pytest.mark.parametrize("name", ["gqa_untied", "mha_tied", "llama3_rope", "mixtral"])
def test_import_export_is_bitwise_and_loads_in_transformers(name, tmp_path):
  ref = _hf_model(tmp_path / "src", **CONFIGS[name])
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  hf.export_model(str(tmp_path / "out" / "checkpoints"), str(tmp_path / "exported"))
  _exported_equals_source(tmp_path / "src", tmp_path / "exported")
  assert (tmp_path / "exported" / "tokenizer.json").read_text() == (tmp_path / "src" / "tokenizer.json").read_text()
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  arch = "MixtralForCausalLM" if name == "mixtral" else "LlamaForCausalLM"
  assert config["architectures"] == [arch] and config["bos_token_id"] == 1
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert not any(info.values()), info  # no missing, unexpected or mismatched keys
  assert loaded.config.rope_parameters["rope_type"] == ref.config.rope_parameters["rope_type"]
  tokens = np.random.default_rng(1).integers(0, 128, (2, 20))
  np.testing.assert_array_equal(_hf_logits(loaded.eval(), tokens), _hf_logits(ref, tokens))


def test_sharded_source_and_sharded_export(tmp_path):
  """A source in several safetensors files with an index; an export past --max_shard_mb is sharded likewise."""
  ref = _hf_model(tmp_path / "one", **CONFIGS["gqa_untied"])
  ref.save_pretrained(tmp_path / "src", safe_serialization=True, max_shard_size="100KB")
  shutil.copy(tmp_path / "one" / "tokenizer.json", tmp_path / "src")
  assert (tmp_path / "src" / "model.safetensors.index.json").exists()
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  info = hf.export_model(str(tmp_path / "out"), str(tmp_path / "exported"), max_shard_mb=0.1)
  assert info["shards"] > 1
  index = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())
  tensors = {}
  for f in set(index["weight_map"].values()):
    tensors.update(load_file(str(tmp_path / "exported" / f)))
  theirs = load_file(str(tmp_path / "one" / "model.safetensors"))
  assert tensors.keys() == theirs.keys() and all(tensors[k].tobytes() == theirs[k].tobytes() for k in theirs)
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert not any(info.values()), info


@pytest.mark.slow
def test_fine_tune_from_import_then_export(tmp_path):
  """OUT/config.py trains (restore_from the import, restore_mode=params); the run's workdir exports, finds the
  import's tokenizer through restore_from, and transformers computes jaxtrain's logits of the trained params."""
  from jaxtrain.train import trainer
  _hf_model(tmp_path / "src", **CONFIGS["llama3_rope"])
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  cfg = _load_config(tmp_path / "out" / "config.py")
  cfg.workdir = str(tmp_path / "run")
  cfg.data.update(source="synthetic", seq_len=16)
  cfg.train.update(steps=2, global_batch_size=8, log_every=1)
  cfg.optim.update(lr=1e-2, warmup_steps=1)
  state, _ = trainer.train(cfg)
  hf.export_model(str(tmp_path / "run"), str(tmp_path / "exported"))
  assert (tmp_path / "exported" / "tokenizer_config.json").exists()
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert not any(info.values()), info
  params = jax.device_get(state.params)
  _, _, imported = _restore(tmp_path / "out")
  assert not np.array_equal(params["layers"]["mlp"]["up"]["kernel"], imported["layers"]["mlp"]["up"]["kernel"])
  tokens = np.random.default_rng(2).integers(0, 128, (2, 16)).astype(np.int32)
  model = models.Model.from_config(cfg.model)
  ours = np.asarray(model.apply(params, tokens, np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16)),
                                np.ones((2, 16), np.int32)))
  assert _rel_err(ours, _hf_logits(loaded.eval(), tokens)) < TOL


def _break(folder, how):
  folder = pathlib.Path(folder)
  if how == "not_llama":
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
  elif how == "shape_mismatch":
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "intermediate_size": 100}))
  elif how == "truncated":
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
  elif how == "missing_config":
    (folder / "config.json").unlink()
  elif how == "biases":
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "attention_bias": True}))
  elif how.startswith("weight_map_"):  # an index naming a whole, readable copy of the weights outside the folder
    outside = folder.parent.parent / f"{folder.parent.name}-outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    file = str(outside / "model.safetensors") if how == "weight_map_absolute" else \
        f"../../{outside.name}/model.safetensors"
    names = sorted(load_file(str(folder / "model.safetensors")))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: file for n in names}}))


BAD = [("not_llama", "is a 'gpt2' model"), ("shape_mismatch", "model.layers.0.mlp.gate_proj.weight is [96, 64], "
                                                              "config.json says [100, 64]"),
       ("truncated", "is not a readable safetensors file"), ("missing_config", "has no config.json"),
       ("biases", "sets attention_bias=true"),
       ("weight_map_parent", "model.safetensors.index.json: maps lm_head.weight to '../../weight_map_parent"),
       ("weight_map_absolute", "/model.safetensors', not a file in the folder; an index names files next to it: "
                               "download the model again")]


@pytest.fixture(scope="module")
def bad_imports(tmp_path_factory):
  """Per BAD case, (its folder, holding the broken model as src/, and ``convert_hf.py import``'s result), the
  commands run as forks of one process (tests/forked.py)."""
  folders = [tmp_path_factory.mktemp(how) for how, _ in BAD]
  for folder, (how, _) in zip(folders, BAD):
    _hf_model(folder / "src", **CONFIGS["gqa_untied"])
    _break(folder / "src", how)
  results = forked.run_many([["tools/convert_hf.py", "import", f"--hf={folder / 'src'}", f"--output={folder / 'out'}"]
                             for folder in folders])
  return list(zip(folders, results))


@pytest.mark.parametrize("case", range(len(BAD)), ids=[b for b, _ in BAD])
def test_bad_input_gives_one_line_and_exit_2(case, bad_imports):
  message, (folder, result) = BAD[case][1], bad_imports[case]
  lines = [line for line in result.stderr.splitlines() if line.startswith("convert_hf: error:")]
  assert result.returncode == 2, result.stderr
  assert len(lines) == 1 and message in lines[0], result.stderr
  assert "Traceback" not in result.stderr
  assert sorted(p.name for p in folder.iterdir()) == ["src"]  # no output, no leftover temporary folder


def test_the_generated_config_names_its_paths_exactly_whatever_they_hold(tmp_path):
  """Folders named with quotes, triple quotes, a newline and (the source's) backslashes: OUT/config.py loads, and
  its SOURCE, CONFIG and checkpoint.restore_from are the paths, character for character. (The output folder has
  no backslash: TensorStore, under Orbax, reads one as a path separator.)"""
  odd = tmp_path / 'it\'s """a\n" '
  source, output = odd / 'src\\"""\\', odd / "out"
  _hf_model(source, **CONFIGS["mha_tied"])
  hf.import_model(str(source), str(output))
  spec = importlib.util.spec_from_file_location("imported_config", output / "config.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert (module.SOURCE, module.CONFIG) == (str(source), str(output / "config.py"))
  config = module.get_config()
  assert config.checkpoint.restore_from == str(output / "checkpoints") and config.workdir == f"runs/{output.name}"
  _, _, params = _restore(output)  # the checkpoint it names restores
  assert params["embed"]["embedding"].shape == (128, 64)


def test_export_refuses_existing_output_and_missing_step(tmp_path):
  _hf_model(tmp_path / "src", **CONFIGS["mha_tied"])
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  with pytest.raises(hf.HFError, match="already exists"):
    hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  with pytest.raises(checkpoint_lib.CheckpointError, match="has no step 7"):
    hf.export_model(str(tmp_path / "out"), str(tmp_path / "exported"), step=7)
  assert not (tmp_path / "exported").exists()


def test_llama3_rope_frequencies_equal_transformers():
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from jaxtrain.models import llama
  config = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_theta=500_000.0,
                                    max_position_embeddings=131072, rope_scaling={
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192})
  theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
  ours = np.asarray(llama.rope_frequencies(128, 500_000.0, (8.0, 1.0, 4.0, 8192)))
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
  assert not np.allclose(ours, np.asarray(llama.rope_frequencies(128, 500_000.0)))


# -- object stores: gs:// and s3:// inputs and outputs (localhost servers, tests/object_store.py)


@pytest.fixture(scope="module")
def servers():
  """Both servers, their settings in os.environ while the module's store tests run."""
  from tests import object_store
  with object_store.serve("gs") as gs, object_store.serve("s3") as s3:
    yield {"gs": gs, "s3": s3}


@contextlib.contextmanager
def _store_settings(monkeypatch, env):
  """The clients of this process reach the stores with ``env`` within, and as before after."""
  from tests import object_store
  saved = {k: os.environ.get(k) for k in env}
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  object_store.forget_clients()
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        monkeypatch.delenv(k, raising=False)
      else:
        monkeypatch.setenv(k, v)
    object_store.forget_clients()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """A small Llama (src/) and its import (out/), on a local disk."""
  folder = tmp_path_factory.mktemp("imported")
  _hf_model(folder / "src", **CONFIGS["gqa_untied"])
  hf.import_model(str(folder / "src"), str(folder / "out"))
  return folder


def _convert(*argv):
  """tools/convert_hf.py's main in this process: its exit code."""
  spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "tools" / "convert_hf.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main(list(argv))


def test_import_from_a_store_to_another_and_export_back_is_bitwise(servers, tmp_path, monkeypatch):
  """A Hugging Face folder on gs:// imported to s3://, and exported from there to gs://: the exported folder is the
  source's weights bitwise, with its tokenizer; the import's config.py names its checkpoint and source on the
  stores; neither output keeps the unfinished marker."""
  import fsspec
  _hf_model(tmp_path / "src", **CONFIGS["mha_tied"])
  gs, s3 = fsspec.filesystem("gs"), fsspec.filesystem("s3")
  src, out, exported = servers["gs"].url("src"), servers["s3"].url("imported/tiny"), servers["gs"].url("exported")
  gs.put(f"{tmp_path / 'src'}/", src.removeprefix("gs://"), recursive=True)
  assert _convert("import", f"--hf={src}", f"--output={out}") == 0
  config_py = s3.cat_file(f"{out}/config.py").decode()
  assert f"SOURCE = {src!r}" in config_py and f"c.checkpoint.restore_from = {out + '/checkpoints'!r}" in config_py
  assert s3.cat_file(f"{out}/hf/tokenizer.json") == (tmp_path / "src" / "tokenizer.json").read_bytes()
  assert _convert("export", f"--checkpoint={out}", f"--output={exported}") == 0
  gs.get(exported.removeprefix("gs://") + "/", f"{tmp_path / 'exported'}/", recursive=True)
  _exported_equals_source(tmp_path / "src", tmp_path / "exported")
  assert sorted(os.listdir(tmp_path / "exported")) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "tokenizer.json", "tokenizer_config.json"]
  assert json.loads((tmp_path / "exported" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
  assert not s3.exists(f"{out}/{hf.UNFINISHED}") and not gs.exists(f"{exported}/{hf.UNFINISHED}")
  # An index on the store naming a file outside its folder (the store holds an object by that very name): refused
  # by its URL before any weight is copied, so nothing is written outside the local copy's temporary folder.
  bad = servers["gs"].url("outside")
  gs.pipe_file(f"{bad}/config.json", (tmp_path / "src" / "config.json").read_bytes())
  gs.pipe_file(f"{bad}/model.safetensors.index.json", b'{"weight_map": {"lm_head.weight": "../x/model.safetensors"}}')
  gs.pipe_file(f"{bad}/../x/model.safetensors", (tmp_path / "src" / "model.safetensors").read_bytes())
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  with pytest.raises(hf.HFError, match=f"^{bad}/model.safetensors.index.json: maps lm_head.weight to "
                                       "'../x/model.safetensors', not a file in the folder"):
    hf.import_model(bad, str(tmp_path / "outside"))
  assert not (tmp_path / "outside").exists() and os.listdir(tmp_path / "tmp") == []


def test_a_store_that_stops_mid_export_leaves_no_complete_looking_output_and_the_same_command_finishes_it(
    servers, imported, tmp_path, monkeypatch, capsys):
  """The store stops answering after the first of eight safetensors files is written: one line, exit 75; what is
  on the store has no config.json (a reader does not take it for a model) and holds the unfinished marker. The same
  command, once the store answers, clears it and writes the whole folder (the source's weights, bitwise)."""
  import fsspec
  from tests import object_store
  proxy = object_store.Proxy(servers["s3"]).start()
  exported = servers["s3"].url("stopped")
  write, written = hf._write_safetensors, []

  def stop_at_the_second_file(*args):
    if len(written) == 1:
      proxy.stop()
    written.append(args[0])
    write(*args)

  monkeypatch.setattr(hf, "_write_safetensors", stop_at_the_second_file)
  argv = ("export", f"--checkpoint={imported / 'out'}", f"--output={exported}", "--max_shard_mb=0.05")
  capsys.readouterr()
  # AWS_MAX_ATTEMPTS=1: botocore gives up on a refused connection at once instead of after ~10 s of retries.
  with _store_settings(monkeypatch, {**proxy.env, "AWS_MAX_ATTEMPTS": "1"}):
    assert _convert(*argv) == 75
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"convert_hf: stopped: {exported}: the object store did not "
                                                   "answer (") and lines[0].endswith(
        "run the same command again once it does (it clears an unfinished output) (exit 75)"), lines
    s3 = fsspec.filesystem("s3", endpoint_url=servers["s3"].endpoint)  # the server itself, not the stopped proxy
    s3.invalidate_cache()
    shards = [f"model-{i:05d}-of-00008.safetensors" for i in range(1, 9)]
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.ls(exported)) == [hf.UNFINISHED, shards[0]]
    proxy.start()
    assert _convert(*argv) == 0 and len(written) == 2 + 8
  s3.invalidate_cache()
  names = sorted(p.rsplit("/", 1)[-1] for p in s3.ls(exported))
  assert names == ["config.json", "generation_config.json", *shards, INDEX := "model.safetensors.index.json",
                   "tokenizer.json", "tokenizer_config.json"], names
  tensors = {}
  for f in set(json.loads(s3.cat_file(f"{exported}/{INDEX}"))["weight_map"].values()):
    s3.get_file(f"{exported}/{f}", str(tmp_path / f))
    tensors.update(load_file(str(tmp_path / f)))
  theirs = load_file(str(imported / "src" / "model.safetensors"))
  assert tensors.keys() == theirs.keys() and all(tensors[k].tobytes() == theirs[k].tobytes() for k in theirs)


class _Refusing(http.server.BaseHTTPRequestHandler):
  """A store that refuses every request (403, as S3 says it: AccessDenied; gcsfs reads the status alone)."""

  def _refuse(self):
    body = b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
    self.send_response(403)
    self.send_header("Content-Type", "application/xml")
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(body)

  do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _refuse

  def log_message(self, *args):  # quiet
    pass


class _RefusingServer(http.server.ThreadingHTTPServer):
  def handle_error(self, request, client_address):
    """Quiet: a client that hangs up on the refusal while still sending its upload (the body is never read) is
    expected, and socketserver's traceback would land in the stderr the test reads."""


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_store_that_refuses_the_credentials_is_one_line_and_exit_2(scheme, imported, tmp_path, monkeypatch,
                                                                     capsys):
  """403 on every request (a missing, wrong or expired credential; no permission on the bucket): the export to the
  store and the import from it are one line naming the URL and the fix, exit 2, with nothing written."""
  server = _RefusingServer(("127.0.0.1", 0), _Refusing)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  endpoint = f"http://127.0.0.1:{server.server_address[1]}"
  env = {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "jaxtrain-test",
         "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"} if scheme == "gs" else {
         "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "wrong", "AWS_SECRET_ACCESS_KEY": "wrong",
         "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
  capsys.readouterr()
  try:
    with _store_settings(monkeypatch, env):
      for argv in (["export", f"--checkpoint={imported / 'out'}", f"--output={scheme}://bucket/exported"],
                   ["import", f"--hf={scheme}://bucket/hf/model", f"--output={tmp_path / 'imported'}"]):
        assert _convert(*argv) == 2, argv
        lines = capsys.readouterr().err.strip().splitlines()
        url = argv[-1 if argv[0] == "export" else 1].split("=", 1)[1]
        assert len(lines) == 1 and lines[0].startswith(f"convert_hf: error: {url}: the object store refused access")
        assert "check the credentials" in lines[0], lines
  finally:
    server.shutdown()
  assert os.listdir(tmp_path) == []  # no local output either


def test_refusals_are_told_apart_from_other_store_failures():
  """What each client raises when a store refuses the caller (jaxtrain.stores.refused: exit 2, fix the credentials)
  and what it raises when the store does not answer (stores.unreachable: exit 75, run again): never both."""
  from gcsfs.retry import HttpError
  from botocore.exceptions import NoCredentialsError
  from google.auth.exceptions import DefaultCredentialsError
  from jaxtrain import stores
  refusals = [
      HttpError({"code": 401, "message": "Anonymous caller does not have storage.objects.list access to the Google "
                                         "Cloud Storage bucket."}),  # gcsfs without credentials
      OSError("Forbidden: b/o/x\nuser does not have storage.objects.create access"),  # gcsfs, 403
      PermissionError(13, "The AWS Access Key Id you provided does not exist in our records."),  # s3fs
      NoCredentialsError(),  # boto3 found no credentials
      DefaultCredentialsError("Your default credentials were not found."),
      ValueError("PERMISSION_DENIED: Error writing \"x\": HTTP response code: 403 with body: ..."),  # TensorStore
  ]
  failures = [ConnectionRefusedError(111, "Connection refused"), HttpError({"code": 503, "message": "Backend Error"}),
              ValueError("UNAVAILABLE: HTTP response code: 503"), FileNotFoundError("b/o/x")]
  for e in refusals:
    assert stores.refused(e) is not None and stores.unreachable(e) is None, e
  wrapped = RuntimeError("save failed")
  wrapped.__cause__ = refusals[0]
  assert stores.refused(wrapped) is refusals[0]
  for e in failures:
    assert stores.refused(e) is None, e

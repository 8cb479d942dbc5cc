"""The open families beyond Llama and Mixtral (jaxtrain/models/{llama,moe}/presets.py): Qwen 2.5, Qwen 3, Qwen 3 MoE,
Mistral.

For each, a random small model built by transformers itself (no download), with its attention variants switched on
(a window smaller than the documents, local and global layers interleaved): imported, its logits equal
transformers' on a padded batch and a packed row; greedy generation equals transformers' token for token; import
-> export is bitwise and loads with no missing or unexpected keys; a deliberate mis-mapping of the family's
difference fails the comparison. Every family trains sharded (fsdp x tensor, and pipeline where its layer pattern
allows) equal to one device."""

import json
import math
import pathlib

import jax
import numpy as np
import pytest

from jaxtrain import hf
from jaxtrain import models
from tests.test_hf import (TOL, _exported_equals_source, _hf_logits, _restore,
                           assert_greedy_generation_equals, logit_errors)
from tests.test_pipeline import _loss_and_grads, _loss_grads_and_params, _packed_batch
from tests.conftest import small_config

from tests.test_hf import torch, transformers  # (skipped there, with why, where they are not installed)

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=128, rope_theta=1e6)


def _zero_biases(params, cfg):
  for x in "qkv":
    params["layers"]["attn"][x]["bias"] = np.zeros_like(params["layers"]["attn"][x]["bias"])


def _unit_qk_norm(params, cfg):
  for x in "qk":
    params["layers"]["attn"][f"{x}_norm"]["scale"] = np.ones_like(params["layers"]["attn"][f"{x}_norm"]["scale"])


def _window_plus_one(params, cfg):
  cfg.sliding_window += 1


def _drop_plus_one(params, cfg):
  cfg.norm_plus_one = False


def _window_minus_one(params, cfg):
  cfg.sliding_window -= 1


def _attn_softcap_off(params, cfg):
  cfg.attn_softcap = 0.0


def _final_softcap_off(params, cfg):
  cfg.final_softcap = 0.0


def _one_rope_theta(params, cfg):
  cfg.rope_local_theta = 0.0


def _flip_topk_normalization(params, cfg):
  cfg.normalize_topk = not cfg.normalize_topk


# name -> (transformers classes, config overrides, jaxtrain family, what the import must set, a mis-mapping)
FAMILIES = {
    # Qwen 2.5 with its optional window: layer 0 local (6 keys), layer 1 global.
    "qwen2": ("Qwen2", dict(use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention",
                                                                                   "full_attention"]),
              "qwen2", dict(qkv_bias=True, sliding_window=6, global_every=2), _zero_biases),
    "qwen3": ("Qwen3", dict(tie_word_embeddings=True), "qwen3", dict(qk_norm="head", tie_embeddings=True),
              _unit_qk_norm),
    "mistral": ("Mistral", dict(sliding_window=5), "mistral", dict(sliding_window=5, global_every=0),
                _window_plus_one),
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                   norm_topk_prob=True), "qwen3_moe",
                  dict(qk_norm="head", num_experts=4, experts_per_token=2, expert_mlp_dim=48, normalize_topk=True),
                  _flip_topk_normalization),
    # OLMoE: QK-norm over the whole q and k projections, top-k weights not renormalized.
    "olmoe": ("Olmoe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=48, norm_topk_prob=False,
                            num_key_value_heads=4), "olmoe",
              dict(qk_norm="full", num_experts=4, experts_per_token=2, expert_mlp_dim=48, normalize_topk=False),
              (_unit_qk_norm, _flip_topk_normalization)),
    # Gemma 2: layers alternate local (window 6) and global; both soft-caps active at these scales (scores reach
    # tens with these weights; the caps are set low so that tanh bends them); query_pre_attn_scalar != head_dim.
    "gemma2": ("Gemma2", dict(sliding_window=6, attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
                              query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh", num_hidden_layers=4),
               "gemma2", dict(norm_plus_one=True, sandwich_norms=True, embed_scale=True, sliding_window=6,
                              global_every=2, attn_softcap=0.5, final_softcap=2.0, mlp_activation="gelu_tanh"),
               (_drop_plus_one, _attn_softcap_off, _final_softcap_off)),
    # Gemma 3 (text): 2 local layers to 1 global, local RoPE theta 10000, global 1e6 with linear scaling x 8.
    "gemma3": ("Gemma3", dict(sliding_window=5, sliding_window_pattern=3, num_hidden_layers=4,
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
               "gemma3", dict(qk_norm="head", sliding_window=5, global_every=3, rope_local_theta=1e4,
                              rope_scaling="linear", rope_scaling_factor=8.0), (_window_minus_one, _one_rope_theta)),
}


def _hf_family(folder, name, seed=0):
  prefix, overrides = FAMILIES[name][:2]
  torch.manual_seed(seed)
  config_class = transformers.Gemma3TextConfig if prefix == "Gemma3" else getattr(transformers, f"{prefix}Config")
  config = config_class(**{**BASE, **overrides})
  model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
  with torch.no_grad():
    for p in model.parameters():  # norms, biases and QK-norms random too, so that they are tested
      p.add_(torch.randn_like(p) * 0.05)
  model.save_pretrained(folder, safe_serialization=True)
  (pathlib.Path(folder) / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
  return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_imported_family_equals_transformers_and_exports_bitwise(name, tmp_path):
  ref = _hf_family(tmp_path / "src", name)
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  cfg, model, params = _restore(tmp_path / "out")
  family, expected, mis_maps = FAMILIES[name][2:]
  assert cfg.model.name == family
  assert {k: cfg.model[k] for k in expected} == expected
  padded, packed = logit_errors(model, params, ref)
  print(f"{name}: max relative logit error padded {padded:.2e}, packed {packed:.2e}")
  assert padded < TOL and packed < TOL
  # The family's own differences, each mapped wrong on purpose: the comparison must see it.
  for mis_map in mis_maps if isinstance(mis_maps, tuple) else (mis_maps,):
    wrong_cfg, wrong_params = cfg.model.copy_and_resolve_references(), jax.tree.map(np.asarray, params)
    mis_map(wrong_params, wrong_cfg)
    wrong = max(logit_errors(models.Model.from_config(wrong_cfg), wrong_params, ref))
    print(f"{name}: mis-mapped ({mis_map.__name__}): {wrong:.2e}")
    assert wrong > 100 * TOL, mis_map.__name__

  # Greedy generation, left-padded prompts, KV cache: token for token transformers' generate.
  assert_greedy_generation_equals(tmp_path / "out", ref)

  hf.export_model(str(tmp_path / "out" / "checkpoints"), str(tmp_path / "exported"))
  _exported_equals_source(tmp_path / "src", tmp_path / "exported")
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert config["model_type"] == ref.config.model_type
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert not any(info.values()), info  # no missing, unexpected or mismatched keys
  assert type(loaded) is type(ref)
  assert getattr(loaded.config, "layer_types", None) == getattr(ref.config, "layer_types", None)
  assert getattr(loaded.config, "sliding_window", None) == getattr(ref.config, "sliding_window", None)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 20))
  np.testing.assert_array_equal(_hf_logits(loaded.eval(), tokens), _hf_logits(ref, tokens))


MIXED_NOT_ALLOWED = ("mistral", "qwen3_moe", "olmoe")  # Mistral's layers are all local; MoE stacks all alike


def _family_config(tmp_path, name, **mesh):
  c = small_config(tmp_path, **mesh)
  m = models.defaults(name)
  m.update(num_layers=4, d_model=64, num_heads=8, num_kv_heads=4, head_dim=16, mlp_dim=128, vocab_size=256)
  if name == "qwen3_moe":
    m.update(num_experts=4, experts_per_token=2, expert_mlp_dim=64)
  if name in ("qwen3_moe", "olmoe"):
    m.update(num_experts=4, experts_per_token=2, expert_mlp_dim=64)
  # Windows shorter than the documents: local and global layers interleaved where the family can, else all local.
  m.update(sliding_window=6, global_every=0 if name in MIXED_NOT_ALLOWED else 2)
  c.model = m
  c.pipeline.schedule = "gpipe"
  return c


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral", "qwen3_moe", "olmoe", "gemma2", "gemma3"])
def test_every_family_trains_sharded_equal_to_one_device(name, tmp_path):
  """fsdp 2 x tensor 2 x (context 2 for Mistral and Gemma 2; else pipeline 2 where the layers are all alike; else
  nothing more, on 4 devices): the loss and every gradient equal one device's within 1e-5 (packed rows, windows
  shorter than the documents); a pipeline of interleaved local and global layers is refused."""
  batch = _packed_batch()
  ref_loss, ref_tokens, ref_grads, _, ref_params = _loss_grads_and_params(_family_config(tmp_path / "one", name),
                                                                          batch, jax.devices()[:1])
  # Every layout is fsdp 2 x tensor 2, with one more axis where the family has one to test: context parallelism
  # (the window masked by position over gathered keys) for an all-local and an interleaved family, the pipeline
  # where the layers are all alike; nothing more for the rest (fsdp already splits the batch, as data would).
  mixed = name not in MIXED_NOT_ALLOWED  # their configs here interleave local and global layers
  layouts = [dict(context=2, fsdp=2, tensor=2)] if name in ("mistral", "gemma2") else []
  if not mixed:
    layouts.append(dict(pipeline=2, fsdp=2, tensor=2))
  if not layouts:
    layouts.append(dict(fsdp=2, tensor=2))
  for mesh in layouts:
    config = _family_config(tmp_path / "x".join(map(str, mesh.values())), name, **mesh)
    config.train.microbatches = 2 if "pipeline" in mesh else 0
    # (From one device's initial params put on the layout's shardings: no init compiled per layout.)
    loss, tokens, grads, _ = _loss_and_grads(config, batch, jax.devices()[:math.prod(mesh.values())], ref_params)
    assert tokens == ref_tokens
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=str(mesh))
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
      err = np.max(np.abs(g - r)) / np.max(np.abs(r))
      assert err < 1e-5, f"{mesh} {jax.tree_util.keystr(path)}: relative gradient error {err:.2e}"
  if mixed:
    from jaxtrain.errors import ConfigError
    config = _family_config(tmp_path / "pp", name, pipeline=2)
    with pytest.raises(ConfigError, match="interleave local and global attention"):
      _loss_and_grads(config, batch, jax.devices()[:2])


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
  """Prompt/response and chat records prepared with the byte tokenizer (vocab 256, the test models')."""
  from jaxtrain.data import prepare
  from tests.test_sft import _sft_records, _write_jsonl
  tmp = tmp_path_factory.mktemp("sft")
  src = _write_jsonl(tmp / "in" / "sft.jsonl", _sft_records(40))
  manifest = prepare.prepare(prepare.Options(inputs=[str(src)], output=str(tmp / "out"), eval_fraction=0.0,
                                             progress=False))
  assert manifest["format"] == prepare.FORMAT_SFT
  return str(tmp / "out")


# LoRA adapts q, v and o, so the families that differ there: biases on q and v (qwen2), Gemma's query scale,
# soft-caps and sandwich norms (gemma2), QK-norm beside experts (qwen3_moe). The others share one of these paths.
LORA_FAMILIES = ["qwen2", "gemma2", "qwen3_moe"]


@pytest.mark.slow
@pytest.mark.parametrize("name", LORA_FAMILIES)
def test_lora_sft_fine_tune_of_an_import_exports_what_jaxtrain_computes(name, tmp_path, sft_data):
  """Import, LoRA (rank 4 on q, v, o) on SFT data (prompt tokens masked) for 2 steps from OUT/config.py, export:
  the base weights stay as imported, transformers loads the merged export with no missing or unexpected keys, and
  its logits are those of jaxtrain's adapted model."""
  from tests.test_hf import lora_fine_tune_exports_what_jaxtrain_computes
  _hf_family(tmp_path / "src", name)
  lora_fine_tune_exports_what_jaxtrain_computes(tmp_path, sft_data)


# The shipped configs of the published sizes: jaxtrain's parameter count is the published one, and transformers'
# count for the config.json jaxtrain would export (the same shapes, built on the meta device: no memory).
PUBLISHED = {"qwen2_5_7b": 7_615_616_512, "qwen3_8b": 8_190_735_360, "qwen3_30b_a3b": 30_532_122_624,
             "mistral_7b": 7_241_732_096, "gemma2_9b": 9_241_705_984, "gemma3_1b": 999_885_952,
             "olmoe_1b_7b": 6_919_161_856}


@pytest.mark.parametrize("config", list(PUBLISHED))
def test_published_sizes_have_the_published_parameter_counts(config):
  import importlib
  model_cfg = importlib.import_module(f"configs.{config}").get_config().model
  ours = models.Model.from_config(model_cfg).num_params()
  hf_cfg = transformers.AutoConfig.for_model(**hf.hf_config(model_cfg))
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
  assert ours == theirs == PUBLISHED[config]

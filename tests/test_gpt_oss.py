"""GPT-OSS (jaxtrain/models/gpt_oss; its attention sinks in each backend: tests/test_attention.py): a random small
GptOssForCausalLM built by transformers itself (sinks, a window shorter than the text, local and global layers
alternating, 4 experts top-2 with biases and a clamp that bites, YaRN): imported, its logits equal transformers' on a
padded batch and a packed row; each of its features mapped wrong on purpose fails that comparison; greedy generation
(the KV cache, with the sinks) equals transformers' token for token; import -> export is bitwise; MXFP4 experts
dequantize as transformers' do. Sharded training equals one device; the published sizes have the published parameter
counts and the estimator's sizes; sinks on a kernel without them and another quantization are one line, exit 2."""

import copy
import json
import math
import pathlib
import re

import jax
import numpy as np
import pytest

from jaxtrain import hf
from jaxtrain import models
from tests import forked
from tests.conftest import small_config
from tests.test_families import sft_data  # noqa: F401 (a fixture)
from tests.test_hf import (TOL, _exported_equals_source, _restore,
                           assert_export_equals_source, assert_greedy_generation_equals, import_quantized,
                           logit_errors, mis_mapping_errors, set_quantization)

from tests.test_hf import torch, transformers  # (skipped there, with why, where they are not installed)

# Window 5 of 24 tokens, layers local / global / local / global; gate and up reach ~0.5 with these weights, so a
# limit of 0.3 clamps some; YaRN over 16 original positions puts dims on both sides of its ramp; hidden sizes are
# multiples of 32 (MXFP4's groups).
HF_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                 swiglu_limit=0.3, rms_norm_eps=1e-5, max_position_embeddings=64,
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 1e4})


def _hf_gpt_oss(folder, seed=0):
  torch.manual_seed(seed)
  model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**HF_CONFIG)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():  # norms, biases and sinks random too; sinks of a size that matters
      p.add_(torch.randn_like(p) * (1.0 if name.endswith("sinks") else 0.05))
  model.save_pretrained(folder, safe_serialization=True)
  (pathlib.Path(folder) / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
  return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  """(folder, the transformers model, the imported config, model and params)."""
  tmp = tmp_path_factory.mktemp("gpt_oss")
  ref = _hf_gpt_oss(tmp / "src")
  hf.import_model(str(tmp / "src"), str(tmp / "out"))
  cfg, model, params = _restore(tmp / "out")
  return tmp, ref, cfg, model, params


# Each feature mapped wrong: (name, what it does to a copy of the imported config and params).
def _drop_sinks(params, cfg):
  params["layers"]["attn"]["sinks"] = np.full_like(params["layers"]["attn"]["sinks"], -1e30)


def _window_plus_one(params, cfg):
  cfg.sliding_window += 1


def _every_layer_local(params, cfg):
  cfg.global_every = 0


def _gate_up_as_halves(params, cfg):  # the checkpoint's interleaved gate/up read as [gate | up]
  gu = params["layers"]["moe"]["gate_up"]
  params["layers"]["moe"]["gate_up"] = np.concatenate([gu[..., ::2], gu[..., 1::2]], axis=-1)


def _no_clamp(params, cfg):
  cfg.swiglu_limit = 1e9


def _alpha_one(params, cfg):
  cfg.swiglu_alpha = 1.0


def _no_router_bias(params, cfg):
  params["layers"]["moe"]["router_bias"] = np.zeros_like(params["layers"]["moe"]["router_bias"])


def _no_expert_biases(params, cfg):
  for name in ("gate_up_bias", "down_bias"):
    params["layers"]["moe"][name] = np.zeros_like(params["layers"]["moe"][name])


def _no_out_bias(params, cfg):
  params["layers"]["attn"]["o"]["bias"] = np.zeros_like(params["layers"]["attn"]["o"]["bias"])


def _no_yarn(params, cfg):
  cfg.rope_scaling = ""


MIS_MAPS = [_drop_sinks, _window_plus_one, _every_layer_local, _gate_up_as_halves, _no_clamp, _alpha_one,
            _no_router_bias, _no_expert_biases, _no_out_bias, _no_yarn]


def test_imported_logits_equal_transformers_and_each_mis_mapping_fails(imported):
  _, ref, cfg, model, params = imported
  assert cfg.model.name == "gpt_oss"
  assert {k: cfg.model[k] for k in ("sliding_window", "global_every", "rope_scaling", "rope_scaling_factor",
                                    "rope_original_max_positions", "rope_yarn_beta_fast", "rope_yarn_truncate",
                                    "num_experts", "experts_per_token", "expert_mlp_dim", "swiglu_limit")} == dict(
      sliding_window=5, global_every=2, rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_positions=16,
      rope_yarn_beta_fast=8.0, rope_yarn_truncate=False, num_experts=4, experts_per_token=2, expert_mlp_dim=64,
      swiglu_limit=0.3)
  padded, packed = logit_errors(model, params, ref)
  print(f"gpt_oss: max relative logit error padded {padded:.2e}, packed {packed:.2e}")
  assert padded < TOL and packed < TOL
  # The padded batch alone for the mis-mappings (the packed row's path is the same model).
  for mis_map, wrong in mis_mapping_errors(cfg.model, params, ref, MIS_MAPS).items():
    print(f"gpt_oss: mis-mapped ({mis_map}): {wrong:.2e}")
    assert wrong > 100 * TOL, mis_map


def test_greedy_generation_equals_transformers(imported):
  """Left-padded prompts longer than the window, the KV cache (sinks in the cached attention): token for token."""
  tmp, ref, *_ = imported
  assert_greedy_generation_equals(tmp / "out", ref)


def test_import_export_is_bitwise_and_loads_in_transformers(imported, tmp_path):
  tmp, ref, *_ = imported
  loaded = assert_export_equals_source(tmp, ref, tmp_path / "exported")
  assert loaded.config.layer_types == ref.config.layer_types
  # The released form's dtype: a bf16 folder imports and exports back bf16, bit for bit.
  copy.deepcopy(ref).to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)
  (tmp_path / "bf16" / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')  # (an export carries one)
  hf.import_model(str(tmp_path / "bf16"), str(tmp_path / "bf16_out"))
  hf.export_model(str(tmp_path / "bf16_out" / "checkpoints"), str(tmp_path / "bf16_exported"))
  _exported_equals_source(tmp_path / "bf16", tmp_path / "bf16_exported")
  assert json.loads((tmp_path / "bf16_exported" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
  """Forked commands: training with sinks on splash and on cudnn; importing an fp8-quantized config."""
  tmp = tmp_path_factory.mktemp("refused")
  src = tmp / "fp8"
  _hf_gpt_oss(src)
  set_quantization(src, {"quant_method": "fp8"})
  argvs = [["-m", "jaxtrain.main", "--config=configs/tiny_family.py:gpt_oss", f"--config.model.attention={name}",
            f"--config.workdir={tmp / name}"] for name in ("splash", "cudnn")]
  argvs.append(["tools/convert_hf.py", "import", f"--hf={src}", f"--output={tmp / 'out'}"])
  return tmp, forked.run_many(argvs)


@pytest.mark.parametrize("case,message", [
    (0, "jaxtrain: error: model.attention: the backend 'splash' has no attention sinks and model.attention_sinks is "
        "set; use xla or blockwise"),
    (1, "jaxtrain: error: model.attention: the backend 'cudnn' has no attention sinks"),
    (2, "is quantized (fp8); dequantize it to bf16 first")])
def test_sinks_on_a_kernel_without_them_and_other_quantizations_are_one_line_exit_2(refusals, case, message):
  tmp, results = refusals
  forked.assert_one_line_exit_2(results[case], message)
  assert sorted(p.name for p in tmp.iterdir()) == ["fp8"]  # nothing written: no workdir, no output


def test_mxfp4_experts_dequantize_on_import_as_transformers_does(imported, tmp_path):
  """The released checkpoints' form: gate_up_proj and down_proj as MXFP4 blocks and scales (random codes, scales
  2^-6 to 2^-3), the rest as it is. The import's expert weights are bitwise transformers' own dequantization
  (``convert_moe_packed_tensors``), and its logits equal those of transformers' model holding them."""
  from safetensors.numpy import load_file, save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  tmp, ref, *_ = imported
  (tmp_path / "src").mkdir()
  tensors, dequantized = load_file(str(tmp / "src" / "model.safetensors")), {}
  rng = np.random.default_rng(3)
  for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
    experts, fan_in, fan_out = tensors.pop(name).shape
    blocks = rng.integers(0, 256, (experts, fan_out, fan_in // 32, 16), dtype=np.uint8)
    scales = rng.integers(121, 125, (experts, fan_out, fan_in // 32), dtype=np.uint8)
    tensors.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
    dequantized[name] = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales))
  save_file(tensors, str(tmp_path / "src" / "model.safetensors"))
  model, params = import_quantized(tmp / "src", tmp_path, {"quant_method": "mxfp4",
                                                            "modules_to_not_convert": ["model.layers.*.self_attn"]})
  theirs = copy.deepcopy(ref)
  with torch.no_grad():
    for name, value in dequantized.items():
      theirs.get_parameter(name).copy_(value.float())
      layer = int(name.split(".")[2])
      ours = np.asarray(params["layers"]["moe"]["gate_up" if "gate_up" in name else "down"][layer])
      np.testing.assert_array_equal(ours, value.float().numpy(), err_msg=name)
  padded, packed = logit_errors(model, params, theirs.eval())
  print(f"gpt_oss mxfp4: max relative logit error padded {padded:.2e}, packed {packed:.2e}")
  assert padded < TOL and packed < TOL


def _config(tmp_path, **mesh):
  c = small_config(tmp_path, **mesh)
  m = models.defaults("gpt_oss")
  m.update(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4, head_dim=16, vocab_size=256, num_experts=4,
           experts_per_token=2, expert_mlp_dim=32, sliding_window=6, swiglu_limit=0.05, load_balance_weight=0.01,
           router_z_weight=0.001, rope_original_max_positions=16, rope_scaling_factor=4.0)
  c.model = m
  return c


@pytest.mark.slow
def test_trains_sharded_equal_to_one_device(tmp_path):
  """fsdp 2 x tensor 2 x expert 2 (dropless), tensor 2 x expert 2 (capacity with room for every token: the experts'
  biases on both paths), and context 2 x expert 2 (blockwise: the sinks over gathered keys), against one device
  (packed rows, a window shorter than the documents, the auxiliary losses on): the loss and every gradient (sinks
  and biases included) within 1e-5. (fsdp splits the weights in the first mesh; the others on 4 devices.) Each layout
  starts from one device's initial params put on its shardings (no init compiled per layout)."""
  from tests.test_pipeline import _loss_and_grads, _loss_grads_and_params, _packed_batch
  batch = _packed_batch()
  ref_loss, ref_tokens, ref_grads, _, ref_params = _loss_grads_and_params(_config(tmp_path / "one"), batch,
                                                                          jax.devices()[:1])
  for i, (mesh, impl) in enumerate([(dict(fsdp=2, tensor=2, expert=2), "dropless"),
                                    (dict(tensor=2, expert=2), "capacity"),
                                    (dict(context=2, expert=2), "dropless")]):
    config = _config(tmp_path / str(i), **mesh)
    config.model.update(attention="blockwise" if "context" in mesh else "auto", moe_impl=impl, capacity_factor=8.0)
    devices = jax.devices()[:math.prod(mesh.values())]
    mesh = {**mesh, "moe_impl": impl}
    loss, tokens, grads, _ = _loss_and_grads(config, batch, devices, ref_params)
    assert tokens == ref_tokens
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=str(mesh))
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
      err = np.max(np.abs(g - r)) / np.max(np.abs(r))
      assert err < 1e-5, f"{mesh} {jax.tree_util.keystr(path)}: relative gradient error {err:.2e}"


PUBLISHED = {"gpt_oss_20b": (20_914_757_184, 3.61e9), "gpt_oss_120b": (116_829_156_672, 5.13e9)}


@pytest.mark.parametrize("config", list(PUBLISHED))
def test_published_sizes_have_the_published_parameter_counts(config):
  """Total: the published count, and transformers' for the config.json jaxtrain would export (built on the meta
  device); active (k of E experts, the head, not the input embedding table): the model card's to its rounding."""
  import importlib
  from jaxtrain.models import gpt_oss
  model_cfg = importlib.import_module(f"configs.{config}").get_config().model
  total, active = gpt_oss.param_counts(model_cfg, models.Model.from_config(model_cfg).abstract_params)
  hf_cfg = transformers.AutoConfig.for_model(**hf.hf_config(model_cfg))
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
  assert total == theirs == PUBLISHED[config][0]
  assert round(active / 1e7) == round(PUBLISHED[config][1] / 1e7)


ESTIMATED = {"gpt_oss_20b": 18.5, "gpt_oss_120b": 25.3}  # GiB per chip, as the configs' docstrings say


@pytest.fixture(scope="module")
def estimates():
  """tools/estimate.py on 256 chips, expert 8 x fsdp 32 (fsdp divides d_model 2880), for each published config."""
  results = forked.run_many([["tools/estimate.py", f"--config=configs/{name}.py", "--devices=256",
                              "--set=mesh.expert=8", "--set=mesh.fsdp=32"] for name in ESTIMATED])
  return dict(zip(ESTIMATED, results))


@pytest.mark.parametrize("config", list(ESTIMATED))
def test_the_estimator_sizes_the_published_configs_as_their_docstrings_say(estimates, config):
  result = estimates[config]
  assert result.returncode == 0, result.stderr[-2000:]
  total = re.search(r"^ +total +([0-9.]+) GiB per device", result.stdout + result.stderr, re.M)
  assert total and round(float(total.group(1)), 1) == ESTIMATED[config]
  assert f"{ESTIMATED[config]} GiB per chip" in (pathlib.Path(__file__).parents[1] / "configs" /
                                                  f"{config}.py").read_text()


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_attention_factor_equal_transformers(truncate):
  """gpt-oss-20b's head_dim and YaRN (factor 32 over 4096 positions, betas 32 / 1), truncated or not: the
  frequencies and the cos/sin factor as transformers' ``_compute_yarn_parameters`` computes them."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from jaxtrain.models.llama.model import Yarn, rope_frequencies
  rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
          "original_max_position_embeddings": 4096, "rope_theta": 150_000.0}
  config = transformers.GptOssConfig(head_dim=64, max_position_embeddings=131072, rope_parameters=rope)
  theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
  yarn = Yarn(32.0, 32.0, 1.0, 4096, truncate)
  ours = np.asarray(rope_frequencies(64, 150_000.0, yarn))
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
  assert yarn.attention_factor == pytest.approx(factor, rel=1e-12)
  unscaled = np.asarray(rope_frequencies(64, 150_000.0))
  assert np.allclose(ours[:4], unscaled[:4]) and np.allclose(ours[-4:], unscaled[-4:] / 32)  # kept | interpolated


@pytest.mark.slow
def test_lora_sft_fine_tune_of_an_import_exports_what_jaxtrain_computes(tmp_path, sft_data):  # noqa: F811
  """tests/test_families.py's LoRA check on GPT-OSS: import, LoRA (rank 4 on q, v, o: o with its bias, the sinks
  beside) on SFT data for 2 steps, export merged: the base stays as imported, transformers loads the export with no
  missing or unexpected keys, and its logits are jaxtrain's adapted model's."""
  from tests.test_hf import lora_fine_tune_exports_what_jaxtrain_computes
  _hf_gpt_oss(tmp_path / "src")
  lora_fine_tune_exports_what_jaxtrain_computes(tmp_path, sft_data)

"""GLM-4.5 (jaxtrain/models/glm4_moe): a random small Glm4MoeForCausalLM built by transformers itself (biases on q, k
and v, QK-norm, RoPE on half of each head, a dense first layer and 3 MoE layers of 8 experts in 4 groups of which 2
compete, top-3, a shared expert, a random choice bias, routed weights scaled by 2.5): imported, its logits equal
transformers' on a padded batch and a packed row, and a feature mapped wrong on purpose fails that comparison;
greedy generation (the KV cache) equals transformers' token for token; import -> export is bitwise and loads in
transformers with its logits. fsdp x tensor x expert trains equal to one device; the published GLM-4.5-Air has its
parameter counts; bad settings are one line, exit 2. (LoRA: docs/models.md, "GLM-4.5": its q, v and o paths are
those tests/test_families.py trains for qwen2 and qwen3_moe.)"""

import importlib
import json

import pytest

from jaxtrain import hf
from jaxtrain import models
from tests import forked
from tests.conftest import small_config
from tests.test_hf import (assert_export_equals_source, assert_greedy_generation_equals, imported_fixture, logit_errors,
                           mis_mapping_errors, random_builder)

from tests.test_hf import torch, transformers  # (skipped there, with why, where they are not installed)

TOL = 1e-5  # max |jaxtrain - transformers| / max |logit|, float32 (the bound)

HF_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, n_group=4,
                 topk_group=2, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
                 routed_scaling_factor=2.5, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                 rope_theta=1e4, max_position_embeddings=64, num_nextn_predict_layers=0)


_hf_glm = random_builder(transformers.Glm4MoeForCausalLM, transformers.Glm4MoeConfig, HF_CONFIG)
imported = imported_fixture("glm4_moe", _hf_glm)


def _rope_on_the_whole_head(params, cfg):
  cfg.partial_rotary_factor = 1.0


def _no_choice_bias(params, cfg):
  params["layers"]["moe"]["score_bias"][...] = 0


@pytest.mark.slow
def test_imported_logits_and_export_equal_transformers(imported, tmp_path):
  """Logits within 1e-5 (padded batch, packed row); RoPE on the whole head, or the choice bias zeroed, misses; the
  export is the source bitwise and transformers loads it with no missing or unexpected keys."""
  tmp, ref, cfg, model, params = imported
  m = cfg.model
  assert (m.name, m.partial_rotary_factor, m.qk_norm, m.qkv_bias, m.num_groups, m.topk_groups) == (
      "glm4_moe", 0.5, "head", True, 4, 2)
  padded, packed = logit_errors(model, params, ref)
  print(f"glm4_moe: max relative logit error padded {padded:.2e}, packed {packed:.2e}")
  assert padded < TOL and packed < TOL
  wrong = mis_mapping_errors(m, params, ref, [_rope_on_the_whole_head, _no_choice_bias])
  print(f"glm4_moe: mis-mapped: {wrong}")
  assert min(wrong.values()) > 1000 * TOL, wrong
  assert_export_equals_source(tmp, ref, tmp_path / "exported")


@pytest.mark.slow
def test_greedy_generation_equals_transformers(imported):
  """Left-padded prompts through the KV cache, and through continuous batching's paged cache: token for token."""
  tmp, ref, *_ = imported
  assert_greedy_generation_equals(tmp / "out", ref)


def _config(workdir, **mesh):
  c = small_config(workdir, **mesh)
  m = models.defaults("glm4_moe")
  m.update(num_layers=3, vocab_size=256, qk_norm="head", num_experts=8, experts_per_token=2, num_groups=4,
           topk_groups=2, routed_scaling_factor=2.5, load_balance_weight=0.01, router_z_weight=0.001)
  c.model = m
  return c


@pytest.mark.slow
def test_trains_sharded_equal_to_one_device(tmp_path):
  """fsdp 2 x tensor 2 x expert 2, and context 2 x expert 2, against one device (packed rows, the auxiliary losses and
  the bias feedback on): the loss and every gradient within 1e-5."""
  from tests.test_pipeline import assert_trains_like_one_device
  assert_trains_like_one_device(lambda name, **mesh: _config(tmp_path / name, **mesh),
                                [(dict(fsdp=2, tensor=2, expert=2), {}), (dict(context=2, expert=2), {})],
                                one_device_params=True)


def test_glm4_5_air_has_the_published_parameter_counts():
  """configs/glm4_5_air.py: total the published 106B, transformers' count for the config.json jaxtrain would export
  (built on the meta device) plus the choice biases it holds as buffers (45 MoE layers x 128); active (8 of 128
  routed experts), without the embedding table and the head, the published 12B."""
  model_cfg = importlib.import_module("configs.glm4_5_air").get_config().model
  total, active = models.moe.param_counts(model_cfg, models.Model.from_config(model_cfg).abstract_params)
  hf_cfg = transformers.AutoConfig.for_model(**hf.hf_config(model_cfg))
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
  assert total == theirs + 45 * 128 == 106_852_251_264
  assert active - 2 * 151552 * 4096 == 12_182_615_680


# A mistake each: its command's words (``{tmp}``: the fixture's folder) and what its one error line says.
MISTAKES = [
    (["--config.model.partial_rotary_factor=0.2"],
     "model.partial_rotary_factor: 0.2 of model.head_dim=16 turns 3 dims"),
    (["--config.mesh.tensor=4", "--config.mesh.fsdp=1", "--config.mesh.data=2"],
     "model.num_kv_heads: 2 is not divisible by mesh.tensor=4"),
    (["tools/convert_hf.py", "import", "--hf={tmp}/fp8", "--output={tmp}/out"],
     "is quantized (fp8); import the bf16 checkpoint"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
  """Each of MISTAKES forked (the training ones on configs/tiny.py's glm4_moe), beside an FP8 checkpoint's
  config.json: (the folder, their results)."""
  tmp = tmp_path_factory.mktemp("refused")
  (tmp / "fp8").mkdir()
  (tmp / "fp8" / "config.json").write_text(json.dumps({
      **HF_CONFIG, "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
      "quantization_config": {"quant_method": "fp8"}}))
  train = ["-m", "jaxtrain.main", "--config=configs/tiny.py", "--config.model.name=glm4_moe"]
  return tmp, forked.run_many([[a.format(tmp=tmp) for a in words] if words[0].endswith(".py") else
                               train + words + [f"--config.workdir={tmp}/run{i}"]
                               for i, (words, _) in enumerate(MISTAKES)])


@pytest.mark.parametrize("case", range(len(MISTAKES)), ids=[m for _, m in MISTAKES])
def test_bad_settings_are_one_line_exit_2(refusals, case):
  tmp, results = refusals
  forked.assert_one_line_exit_2(results[case], MISTAKES[case][1])
  assert sorted(p.name for p in tmp.iterdir()) == ["fp8"]  # nothing written: no workdir, no output

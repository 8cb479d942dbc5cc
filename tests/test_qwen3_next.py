"""Qwen3-Next (jaxtrain/models/qwen3_next): a random small Qwen3NextForCausalLM built by transformers itself (4
layers, full attention every 2nd, gated DeltaNet with 2 k heads serving 4 v heads, RoPE on a quarter of each head, 8
experts top-2 and a gated shared expert): imported, its logits equal transformers' on a padded batch and a packed row,
and a feature mapped wrong on purpose fails that comparison; import -> export is bitwise and loads in transformers with
its logits; the DeltaNet's chunked form equals its recurrent form over 4,096 tokens (packed documents, an entering
state); greedy generation (the KV cache with the recurrent states) equals transformers' token for token; fsdp x
tensor x expert trains equal to one device; the published Qwen3-Next-80B-A3B has its parameter counts."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import hf
from jaxtrain import models
from jaxtrain.config import base_config
from jaxtrain.errors import ConfigError
from jaxtrain.models import hf_adapter
from jaxtrain.models.qwen3_next import model as qwen3_next
from tests.conftest import small_config
from tests.test_families import sft_data  # noqa: F401 - a fixture
from tests.test_hf import (assert_export_equals_source, imported_fixture, logit_errors,
                           lora_fine_tune_exports_what_jaxtrain_computes, mis_mapping_errors, random_builder)

from tests.test_hf import torch, transformers  # (skipped there, with why, where they are not installed)

TOL = 1e-5  # max |jaxtrain - transformers| / max |logit|, float32

HF_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, num_experts=8,
                 num_experts_per_tok=2, full_attention_interval=2, partial_rotary_factor=0.25, rope_theta=1e4,
                 max_position_embeddings=64)


_hf_qwen3_next = random_builder(transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig, HF_CONFIG)
imported = imported_fixture("qwen3_next", _hf_qwen3_next)


def _norms_scaled_by_w(params, cfg):
  cfg.norm_plus_one = False


def _rope_on_the_whole_head(params, cfg):
  cfg.partial_rotary_factor = 1.0


def _conv_taps_reversed(params, cfg):
  conv = params["layers"]["linear"]["attn"]["conv"]
  conv[...] = conv[..., ::-1]


def _v_and_z_swapped(params, cfg):
  qkvz = params["layers"]["linear"]["attn"]["qkvz"]["kernel"]
  dk, width = cfg.linear_k_dim, qkvz.shape[-1] - 2 * cfg.linear_k_dim
  q_k, v, z = qkvz[..., :2 * dk], qkvz[..., 2 * dk:2 * dk + width // 2], qkvz[..., 2 * dk + width // 2:]
  qkvz[...] = np.concatenate([q_k, z, v], axis=-1)


def test_imported_logits_and_export_equal_transformers(imported, tmp_path):
  """Logits within 1e-5 (padded batch, packed row, a 150-token row across chunks); four features mapped wrong each
  miss by far; the export is the source bitwise and transformers loads it with no missing or unexpected keys and the
  same logits."""
  tmp, ref, cfg, model, params = imported
  m = cfg.model
  assert (m.name, m.full_attention_every, m.linear_k_heads, m.linear_v_heads, m.shared_mlp_dim) == (
      "qwen3_next", 2, 2, 4, 48)
  padded, packed = logit_errors(model, params, ref)
  tokens = np.random.default_rng(2).integers(0, 256, (1, 150)).astype(np.int32)  # three chunks of the DeltaNet's
  with torch.no_grad():
    theirs = ref(input_ids=torch.tensor(tokens)).logits.numpy()
  ours = np.asarray(model.apply(params, tokens, np.arange(150, dtype=np.int32)[None], np.ones_like(tokens)))
  long = float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))
  print(f"qwen3_next: max relative logit error padded {padded:.2e}, packed {packed:.2e}, 150 tokens {long:.2e}")
  assert padded < TOL and packed < TOL and long < TOL
  wrong = mis_mapping_errors(m, params, ref, [_norms_scaled_by_w, _rope_on_the_whole_head, _conv_taps_reversed,
                                               _v_and_z_swapped])
  print(f"qwen3_next: mis-mapped: {wrong}")
  assert min(wrong.values()) > 1000 * TOL, wrong
  assert_export_equals_source(tmp, ref, tmp_path / "exported")


@pytest.mark.slow
def test_lora_fine_tune_exports_what_jaxtrain_computes(tmp_path, sft_data):  # noqa: F811 - the fixture
  """LoRA on q, v and o (o: the full-attention layers' and the DeltaNet's, a stack inside each layer-scan step, each
  layer its own adapter), 2 steps of SFT, exported merged: transformers gives jaxtrain's logits."""
  _hf_qwen3_next(tmp_path / "src")
  lora_fine_tune_exports_what_jaxtrain_computes(tmp_path, sft_data)


def test_chunked_delta_rule_equals_recurrent_at_4096_tokens():
  """The chunked form (chunks of 64) against the recurrent one, one token a step: 4,096 tokens in two rows (one a
  single document, the other three packed documents and padding), 4 heads of 8 x 8, an entering state; outputs and
  final states within 1e-5 of the largest."""
  rng = np.random.default_rng(0)
  b, t, h, dk, dv = 2, 4096, 4, 8, 8
  q, k = (qwen3_next.l2_normalized(jnp.asarray(rng.normal(size=(b, t, h, dk)), jnp.float32)) for _ in range(2))
  q = q * dk ** -0.5
  v = jnp.asarray(rng.normal(size=(b, t, h, dv)), jnp.float32)
  g = -jnp.asarray(rng.exponential(0.05, size=(b, t, h)), jnp.float32)
  beta = jnp.asarray(rng.uniform(size=(b, t, h)), jnp.float32)
  segments, positions = np.ones((b, t), np.int32), np.tile(np.arange(t, dtype=np.int32), (b, 1))
  for start, seg in ((1000, 2), (1030, 3)):  # documents starting mid-chunk
    segments[1, start:], positions[1, start:] = seg, np.arange(t - start)
  segments[1, 4000:] = 0
  starts = qwen3_next.document_starts(jnp.asarray(positions), jnp.asarray(segments))
  state = jnp.asarray(rng.normal(size=(b, h, dk, dv)), jnp.float32)
  chunked = jax.jit(qwen3_next.chunked_delta_rule, static_argnums=7)(q, k, v, g, beta, starts, state, 64)
  recurrent = jax.jit(qwen3_next.recurrent_delta_rule)(q, k, v, g, beta, starts, state)
  for ours, theirs in zip(chunked, recurrent):
    err = float(jnp.max(jnp.abs(ours - theirs)) / jnp.max(jnp.abs(theirs)))
    print(f"qwen3_next: chunked vs recurrent {err:.2e}")
    assert err < 1e-5


def test_the_chunked_forms_temporaries_grow_linearly_with_the_length():
  """The chunked form's forward and backward compiled (not run) at 1,024 and 4,096 tokens: XLA's temporaries grow
  with the length, as the length (within 10%), not as its square (tools/bench_deltanet.py: 1k, 4k and 16k)."""
  def loss(q, k, v, g, beta, starts):
    out, state = qwen3_next.chunked_delta_rule(q, k, v, g, beta, starts, chunk=64)
    return jnp.sum(out ** 2) + jnp.sum(state ** 2)

  def temporaries(length):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, length, 2, 16)), jnp.float32) for _ in range(3))
    g, beta = (jnp.asarray(rng.uniform(size=(1, length, 2)), jnp.float32) for _ in range(2))
    starts = jnp.asarray(np.arange(length)[None] % 700 == 0)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    return grad.lower(q, k, v, g, beta, starts).compile().memory_analysis().temp_size_in_bytes

  ratio = temporaries(4096) / temporaries(1024)
  print(f"qwen3_next: chunked form's temporaries at 4,096 tokens / at 1,024: {ratio:.2f}")
  assert 4 / 1.1 <= ratio <= 4 * 1.1


def test_qwen3_next_80b_a3b_has_the_published_parameter_counts():
  """configs/qwen3_next_80b_a3b.py: total transformers' count for the config.json jaxtrain would export (built on the
  meta device), the published 80B; active (10 of 512 routed experts), without the embedding table and the head, the
  published 3B."""
  model_cfg = importlib.import_module("configs.qwen3_next_80b_a3b").get_config().model
  total, active = qwen3_next.param_counts(model_cfg, models.Model.from_config(model_cfg).abstract_params)
  hf_cfg = transformers.AutoConfig.for_model(**hf.hf_config(model_cfg))
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
  print(f"qwen3_next_80b_a3b: total {total:,}, active {active:,}")
  assert total == theirs == 79_674_391_296
  assert active - 2 * 151936 * 2048 == 3_252_599_552


def _config(workdir, **mesh):
  c = small_config(workdir, **mesh)
  m = models.defaults("qwen3_next")
  m.update(num_layers=4, full_attention_every=2, vocab_size=256, num_experts=8, experts_per_token=2,
           load_balance_weight=0.01, router_z_weight=0.001, deltanet_chunk=16)
  c.model = m
  c.train.microbatches = 4 if mesh.get("pipeline") else 0
  return c


@pytest.mark.slow
def test_trains_sharded_equal_to_one_device(tmp_path):
  """fsdp 2 x tensor 2 x expert 2, and 2 pipeline stages (a group of a DeltaNet and a full-attention layer each) x
  fsdp 2 x tensor 2, against one device (packed rows, the auxiliary losses on): the loss and every gradient within
  1e-5."""
  from tests.test_pipeline import assert_trains_like_one_device
  assert_trains_like_one_device(lambda name, **mesh: _config(tmp_path / name, **mesh),
                                [(dict(fsdp=2, tensor=2, expert=2), {}), (dict(pipeline=2, fsdp=2, tensor=2), {})],
                                one_device_params=True)


def test_greedy_generation_equals_transformers(imported):
  """Three left-padded prompts (prefill by the chunked form, then one token a step by the recurrent one, the full
  attention layers through the KV cache), 10 new tokens each: transformers' for each prompt alone, token for token."""
  from jaxtrain import generate
  from jaxtrain import sampling
  tmp, ref, *_ = imported
  prompts = [[9, 120, 4, 77, 31, 250, 6], [42, 42, 8], [200, 1, 64, 13]]
  run = generate.load(str(tmp / "out"))
  rows = sampling.padded_rows(len(prompts), run.mesh, run.rules)
  greedy = sampling.Generator(run.model, run.mesh, run.rules, run.param_shardings, rows=rows, prompt_len=7,
                              max_new_tokens=10, eos_ids=())
  ours = greedy.generate(run.params, prompts)
  theirs = []
  for p in prompts:
    with torch.no_grad():
      out = ref.generate(input_ids=torch.tensor([p]), do_sample=False, max_new_tokens=10, pad_token_id=0,
                         eos_token_id=None)
    theirs.append(out[0, len(p):].tolist())
  print(f"qwen3_next: greedy {ours}")
  assert ours == theirs and len({tuple(o) for o in ours}) == len(prompts)


# A mistake each: the keys it sets on configs/tiny.py's shapes for qwen3_next, and the start of its one error line.
REFUSED = [
    ({"mesh.context": 2}, "mesh.context: the 'qwen3_next' model family cannot split the sequence over devices"),
    ({"model.full_attention_every": 3}, "model.full_attention_every: 3 does not divide model.num_layers=4"),
    ({"model.linear_v_heads": 3}, "model.linear_v_heads: 3 is not a multiple of model.linear_k_heads=2"),
    ({"model.qk_norm": ""}, "model.qk_norm: is fixed in Qwen3-Next"),
    ({"model.partial_rotary_factor": 0.2}, "model.partial_rotary_factor: 0.2 of model.head_dim=16 turns 3 dims"),
]


@pytest.mark.parametrize("case", range(len(REFUSED)), ids=[m for _, m in REFUSED])
def test_bad_settings_are_one_line(case):
  """Each mistake is one ConfigError naming its key; the published config validates."""
  models.validate(importlib.import_module("configs.qwen3_next_80b_a3b").get_config())
  c = base_config(model="qwen3_next")
  for key, value in REFUSED[case][0].items():
    group, name = key.split(".")
    c[group][name] = value
  with pytest.raises(ConfigError) as e:
    models.validate(c)
  assert str(e.value).startswith(REFUSED[case][1]) and "\n" not in str(e.value)


# config.json mistakes: what each changes of the test model's, and the start of its one error line's problem.
REFUSED_HF = [
    ({"mlp_only_layers": [1]}, "mixes dense and sparse layers"),
    ({"layer_types": ["linear_attention", "full_attention", "full_attention", "full_attention"]},
     "places its full-attention layers"),
    ({"quantization_config": {"quant_method": "fp8"}}, "is quantized (fp8)"),
]


@pytest.mark.parametrize("case", range(len(REFUSED_HF)), ids=[m for _, m in REFUSED_HF])
def test_unsupported_checkpoints_are_one_line(case):
  config = {**transformers.Qwen3NextConfig(**HF_CONFIG).to_dict(), **REFUSED_HF[case][0]}
  adapter = hf_adapter.ADAPTERS.get("qwen3_next")
  assert adapter.model_config(transformers.Qwen3NextConfig(**HF_CONFIG).to_dict(), "ok").name == "qwen3_next"
  with pytest.raises(hf_adapter.HFError) as e:
    adapter.model_config(config, "config.json")
  assert e.value.problem.startswith(REFUSED_HF[case][1])

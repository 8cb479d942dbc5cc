"""QK-clip (``model.qk_clip``; Kimi K2's MuonClip with ``optim.name=muon``) on DeepSeek-V3's multi-head latent
attention: the statistic (each head's largest logit), the rule (which weights a clipped head scales, and by how
much), and the train step that measures one and applies the other, on one device and sharded."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data as data_lib
from jaxtrain import models
from jaxtrain import sharding
from jaxtrain.models import attention
from jaxtrain.models.deepseek_v3 import model as deepseek
from jaxtrain.train import step as step_lib
from jaxtrain.train import trainer
from tests.conftest import small_config
from tests.test_pipeline import _packed_batch


def _reference_max_logits(q, k, seg, pos, scale, window=0):
  """The largest ``scale x q . k`` per query head over the pairs a real query sees, in float64, written out."""
  b, t, n, _ = q.shape
  group = n // k.shape[2]
  scores = np.einsum("bqnh,bsnh->bnqs", q.astype(np.float64), np.repeat(k, group, axis=2).astype(np.float64)) * scale
  delta = pos[:, :, None] - pos[:, None, :]
  seen = (seg[:, :, None] == seg[:, None, :]) & (delta >= 0) & (seg[:, :, None] != 0)
  if window:
    seen &= delta < window
  return np.max(np.where(seen[:, None], scores, -np.inf), axis=(0, 2, 3))


def test_max_logits_are_the_largest_score_a_real_query_sees():
  """Grouped heads (8 query heads on 2 key heads), two packed documents and end padding in one row, a key count
  that is not a multiple of the block (37 keys in blocks of 16), plain and windowed: equal to the written-out
  maximum in float64."""
  rng = np.random.default_rng(0)
  b, t, n, kvh, h = 2, 37, 8, 2, 16
  q, k = rng.normal(size=(b, t, n, h)).astype(np.float32), rng.normal(size=(b, t, kvh, h)).astype(np.float32)
  seg = np.ones((b, t), np.int32)
  seg[0, 20:32], seg[0, 32:] = 2, 0
  pos = np.broadcast_to(np.arange(t), (b, t)).copy()
  pos[0, 20:32] -= 20
  pos[0, 32:] = 0
  for variant in (attention.Variant(scale=0.3), attention.Variant(window=5)):
    ours = jax.jit(functools.partial(attention.max_logits, variant=variant, block_size=16))(q, k, seg, pos)
    theirs = _reference_max_logits(q, k, seg, pos, variant.scale_for(h), variant.window)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-6, err_msg=str(variant))
  # a padding query with the largest score of all is not counted
  q[0, 35, 0] = 100 * k[0, 35, 0]
  ours = jax.jit(functools.partial(attention.max_logits, block_size=16))(q, k, seg, pos)
  assert float(ours[0]) < 1000
  np.testing.assert_allclose(np.asarray(ours), _reference_max_logits(q, k, seg, pos, h ** -0.5), rtol=1e-6)


def _model_cfg(**keys):
  m = models.defaults("deepseek_v3")
  m.update(**{**dict(num_layers=3, d_model=64, num_heads=4, vocab_size=256, q_lora_rank=32, kv_lora_rank=16,
                     qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_experts=8, experts_per_token=2,
                     expert_mlp_dim=32, num_groups=4, topk_groups=2, first_dense_layers=1, qk_clip=1.0), **keys})
  return m


def _logits(cfg, attn_params, x, positions):
  """Every head's logits ``[heads, b, t, t]`` (float64) of an MLA with ``attn_params`` on ``x``."""
  with nnx.use_eager_sharding(False):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: deepseek.MLA(cfg, jnp.float32, nnx.Rngs(0))))
    mla = nnx.merge(graphdef, attn_params)
  q_nope, q_rope = mla.queries(x, positions)
  k, _ = mla.keys_values(*mla.latent(x, positions))
  q = jnp.concatenate([q_nope, q_rope], axis=-1)
  return np.einsum("bqnh,bsnh->nbqs", np.asarray(q, np.float64), np.asarray(k, np.float64)) * mla.scale


@pytest.mark.parametrize("q_lora_rank", [32, 0])
def test_a_clipped_heads_logits_are_all_scaled_to_bring_its_largest_to_the_threshold(q_lora_rank):
  """The rule on every MLA of the model (the dense first layer, the MoE layers, the MTP module), with a query
  latent and without: given each head's largest logit ``S`` (some above the threshold 1, some below), every logit
  of a head with ``S > 1`` is ``1 / S`` times what it was, on any input (so its largest on the measured batch
  would be the threshold exactly); every other head's logits, and every head's values and the shared rope key,
  bitwise as they were. Where the update was not applied (``keep`` false) nothing changes."""
  cfg = _model_cfg(q_lora_rank=q_lora_rank, mtp_depth=1)
  model = models.Model.from_config(cfg)
  params = jax.device_get(jax.jit(model.init)(jax.random.key(0)))
  rng = np.random.default_rng(1)
  maxima = {path: jnp.asarray(np.where(np.arange(4) % 2, rng.uniform(0.5, 0.9, (layers, 4)),
                                       rng.uniform(1.2, 3.0, (layers, 4))), jnp.float32)  # heads 0, 2 clipped
            for path, layers in (("dense_layers/attn", 1), ("layers/attn", 2), ("mtp/block/attn", 1))}
  clipped = jax.device_get(jax.jit(model.qk_clip)(params, maxima, jnp.bool_(True)))
  unchanged = jax.device_get(jax.jit(model.qk_clip)(params, maxima, jnp.bool_(False)))
  jax.tree.map(np.testing.assert_array_equal, unchanged, params)
  x = jnp.asarray(rng.normal(size=(2, 8, 64)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
  for path, largest in maxima.items():
    keys = path.split("/")
    before, after = functools.reduce(lambda p, k: p[k], keys, params), functools.reduce(lambda p, k: p[k], keys,
                                                                                           clipped)
    for layer in range(largest.shape[0]):
      of = lambda tree: jax.tree.map(lambda a: a[layer], tree)  # noqa: E731
      old, new = _logits(cfg, of(before), x, positions), _logits(cfg, of(after), x, positions)
      gain = np.where(np.asarray(largest[layer]) > 1.0, 1.0 / np.asarray(largest[layer]), 1.0)[:, None, None, None]
      error = np.max(np.abs(new - gain * old), axis=(1, 2, 3)) / np.max(np.abs(old), axis=(1, 2, 3))
      assert np.all(error < 1e-5), f"{path} layer {layer}: relative logit error {error}"
    assert np.any(np.asarray(largest) > 1.0) and np.any(np.asarray(largest) < 1.0)
    np.testing.assert_array_equal(after["kv_a"]["kernel"], before["kv_a"]["kernel"])  # the shared rope key
    np.testing.assert_array_equal(after["kv_b"]["kernel"][..., 16:], before["kv_b"]["kernel"][..., 16:])  # values
    query = "q_b" if q_lora_rank else "q"
    kept = np.asarray(largest) <= 1.0  # [layers, heads]
    np.testing.assert_array_equal(after[query]["kernel"].transpose(0, 2, 1, 3)[kept],
                                  before[query]["kernel"].transpose(0, 2, 1, 3)[kept])


def test_the_step_clips_with_its_own_batchs_maxima_and_sharded_equals_one_device(tmp_path):
  """Muon with QK-clip at a learning rate too small to move a weight (1e-30): one train step, on the whole batch or
  on two microbatches, leaves the params exactly the rule applied to them with the per-head maxima of the step's
  own forward on its batch (measured apart), the threshold between the smallest and largest of those; it logs the
  largest logit and the heads it scaled back. The maxima measured on fsdp 2 x tensor 2 x expert 2 equal one
  device's."""
  def config(name, **mesh):
    c = small_config(tmp_path / name, **mesh)
    c.model = _model_cfg(bias_update_speed=0.0)
    c.optim.update(name="muon", lr=1e-30, warmup_steps=0)
    return c

  batch = _packed_batch()

  def measured(c, devices):
    run = trainer.build(c, devices)
    params = trainer.init_state(run).params
    forward = jax.jit(lambda p, b: step_lib.forward_losses(run.model, p, b)["maxima"])
    with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
      return run, params, jax.device_get(forward(params, data_lib.to_global(batch, run.batch_sharding)))

  run, params, maxima = measured(config("one"), jax.devices()[:1])
  _, _, sharded = measured(config("sharded", fsdp=2, tensor=2, expert=2), jax.devices())
  assert sorted(maxima) == ["dense_layers/attn", "layers/attn"]
  for path in maxima:
    np.testing.assert_allclose(sharded[path], maxima[path], rtol=1e-6, err_msg=path)
  values = np.concatenate([m.ravel() for m in maxima.values()])
  threshold = float(np.median(values))
  before = jax.device_get(params)
  expected = None
  for microbatches in (0, 2):  # the whole batch at once, and two microbatches (their maxima's maximum)
    c = config(f"step{microbatches}")
    c.model.qk_clip = threshold
    c.train.microbatches = microbatches
    run = trainer.build(c, jax.devices()[:1])
    expected = expected or jax.device_get(run.model.qk_clip(before, maxima, True))
    step = trainer.compile_step(run)
    with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
      state, metrics = step(trainer.init_state(run), data_lib.to_global(batch, run.batch_sharding), False)
    after, metrics = jax.device_get((state.params, metrics))
    for (path, got), want, old in zip(jax.tree_util.tree_leaves_with_path(after), jax.tree.leaves(expected),
                                      jax.tree.leaves(before), strict=True):
      name = jax.tree_util.keystr(path)
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12, err_msg=f"{microbatches} microbatches {name}")
      if not np.array_equal(want, old):
        assert "attn" in name and ("q_b" in name or "kv_b" in name), name
    assert metrics["attn/max_logit"] == pytest.approx(values.max())
    assert metrics["qk_clip/heads"] == np.sum(values > threshold) > 0


def test_grouped_attention_clips_a_head_by_its_query_alone_and_measures_what_each_layer_sees():
  """Llama's grouped-query attention (8 query heads on 2 key heads, biases on q, k and v, Gemma 2's local and global
  layers with a soft-cap): the largest logits a forward measures are, for the first layer, the written-out maximum
  of its queries and keys (before the soft-cap, local layers within their window); the rule scales a clipped head's
  query weights and bias by ``g`` (every logit of the head ``g`` times what it was), and leaves the keys (shared by
  the group), the values and every other head bitwise as they were."""
  from jaxtrain.models.llama import model as llama
  cfg = models.defaults("gemma2")
  cfg.update(num_layers=2, d_model=64, num_heads=8, num_kv_heads=2, head_dim=16, mlp_dim=64, vocab_size=256,
             sliding_window=4, qkv_bias=True, qk_clip=1.0)
  model = models.Model.from_config(cfg)
  params = jax.device_get(jax.jit(model.init)(jax.random.key(0)))
  params = jax.tree.map(lambda a: a + np.random.default_rng(a.size).normal(0, 0.1, a.shape).astype(a.dtype), params)
  tokens = np.random.default_rng(2).integers(0, 256, (2, 12)).astype(np.int32)
  positions = np.broadcast_to(np.arange(12, dtype=np.int32), (2, 12))
  segments = np.ones((2, 12), np.int32)
  maxima = jax.device_get(jax.jit(model.forward)(params, tokens, positions, segments).maxima)
  assert list(maxima) == ["layers/attn"] and maxima["layers/attn"].shape == (2, 8)

  def layer0_logits(p):
    """Layer 0's logits [heads, b, q, k] (float64) from the embedded tokens, as its attention computes them."""
    with nnx.use_eager_sharding(False):
      module = nnx.merge(model.graphdef, p)
    block = nnx.merge(nnx.graphdef(module.layers), jax.tree.map(lambda a: a[0], nnx.state(module.layers)))
    x = block.attn_norm(module.embed_tokens(jnp.asarray(tokens)))
    attn = block.attn
    q, k = attn.rotate(attn.q(x), attn.k(x), jnp.asarray(positions), llama.rope_frequencies(16, attn.theta), 1.0,
                       None)
    q, k = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 4, axis=2)
    return np.einsum("bqnh,bsnh->nbqs", q, k) * attention.variant(cfg).scale_for(16)  # (Gemma's query scale)

  old = layer0_logits(params)
  delta = positions[:, :, None] - positions[:, None, :]
  seen = (delta >= 0) & (delta < 4)  # layer 0 is local (a window of 4)
  np.testing.assert_allclose(maxima["layers/attn"][0], np.max(np.where(seen[None], old, -np.inf), axis=(1, 2, 3)),
                             rtol=1e-5)
  largest = {"layers/attn": jnp.asarray(np.where(np.arange(8) % 3 == 0, 2.5, 0.5)[None].repeat(2, 0), jnp.float32)}
  clipped = jax.device_get(jax.jit(model.qk_clip)(params, largest, jnp.bool_(True)))
  gain = np.where(np.arange(8) % 3 == 0, 1 / 2.5, 1.0)[:, None, None, None]
  new = layer0_logits(clipped)
  error = np.max(np.abs(new - gain * old), axis=(1, 2, 3)) / np.max(np.abs(old), axis=(1, 2, 3))
  assert np.all(error < 1e-5), error
  before, after = params["layers"]["attn"], clipped["layers"]["attn"]
  for name in ("k", "v", "o"):
    jax.tree.map(np.testing.assert_array_equal, after[name], before[name])
  kept = np.arange(8) % 3 != 0
  np.testing.assert_array_equal(after["q"]["kernel"][:, :, kept], before["q"]["kernel"][:, :, kept])
  np.testing.assert_array_equal(after["q"]["bias"][:, kept], before["q"]["bias"][:, kept])
  assert not np.array_equal(after["q"]["bias"][:, ~kept], before["q"]["bias"][:, ~kept])


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
  from tests import forked
  tmp = tmp_path_factory.mktemp("refused")
  base = ["-m", "jaxtrain.main", "--config=configs/tiny.py", "--config.model.qk_clip=100"]
  return tmp, forked.run_many([base + ["--config.model.name=qwen3", f"--config.workdir={tmp / 'qk_norm'}"],
                               base + ["--config.model.name=gpt_oss", f"--config.workdir={tmp / 'gpt_oss'}"],
                               base + [f"--config.workdir={tmp / 'fine'}", "--config.train.steps=0"]])


@pytest.mark.parametrize("case,message", [
    (0, "model.qk_clip: QK-clip cannot scale a head's logits back through model.qk_norm=head"),
    (1, "model.qk_clip: QK-clip has no rule for the 'gpt_oss' family's attention weights")])
def test_what_qk_clip_cannot_clip_is_one_line_exit_2(refusals, case, message):
  from tests.forked import assert_one_line_exit_2
  tmp, results = refusals
  assert_one_line_exit_2(results[case], message)
  assert not (tmp / ("qk_norm", "gpt_oss")[case]).exists()

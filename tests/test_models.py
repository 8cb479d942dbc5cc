"""The Llama model: published parameter counts, causality, document masking, remat, dtypes, registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import cpu_50m, llama3_1b, llama3_8b, llama3_70b, tiny
from jaxtrain import models
from jaxtrain.train import trainer

PUBLISHED = [(llama3_1b, 1_235_814_400), (llama3_8b, 8_030_261_248), (llama3_70b, 70_553_706_496)]


@pytest.mark.parametrize("module,published", PUBLISHED)
def test_parameter_counts_match_published(module, published):
  assert models.Model.from_config(module.get_config().model).num_params() == published


# Per layer: q, o (d x heads x head_dim each), k, v (d x kv_heads x head_dim each), gate, up, down (d x mlp each)
# and two norm scales (d); plus the embedding and, untied, the lm_head (vocab x d), and the final norm (d).
CPU_SIZES = [
    # 8 x (768*64*(2*12 + 2*4) + 3*768*2048 + 2*768) + 2*256*768 + 768
    (cpu_50m, 8 * (1_572_864 + 4_718_592 + 1_536) + 393_216 + 768),
    # 4 x (128*32*(2*4 + 2*2) + 3*128*384 + 2*128) + 2*256*128 + 128
    (tiny, 4 * (49_152 + 147_456 + 256) + 65_536 + 128),
]


@pytest.mark.parametrize("module,count", CPU_SIZES, ids=["cpu_50m", "tiny"])
def test_cpu_configs_sizes(module, count):
  assert count == {cpu_50m: 50_737_920, tiny: 853_120}[module]
  assert models.Model.from_config(module.get_config().model).num_params() == count


def _model(**overrides):
  cfg = tiny.get_config().model
  cfg.update({"num_layers": 2, **overrides})
  return models.Model.from_config(cfg)


def _model_and_params(**overrides):
  model = _model(**overrides)
  return model, jax.jit(model.init)(jax.random.key(0))


def _inputs(tokens):
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  return tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)


def test_causal():
  model, params = _model_and_params()
  tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
  changed = tokens.copy()
  changed[:, 10:] = (changed[:, 10:] + 1) % 256
  a = model.apply(params, *_inputs(tokens))
  b = model.apply(params, *_inputs(changed))
  np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
  assert not np.allclose(a[:, 10:], b[:, 10:])


def test_attention_stays_within_document():
  model, params = _model_and_params()
  tokens = np.random.default_rng(0).integers(0, 256, (1, 16))
  segments = np.array([[1] * 6 + [2] * 10], np.int32)
  positions = np.array([list(range(6)) + list(range(10))], np.int32)
  other = tokens.copy()
  other[0, :6] = (other[0, :6] + 7) % 256  # change only the first document
  a = model.apply(params, jnp.asarray(tokens), positions, segments)
  b = model.apply(params, jnp.asarray(other), positions, segments)
  np.testing.assert_allclose(a[0, 6:], b[0, 6:], atol=1e-6)  # the second document does not see the first
  assert not np.allclose(a[0, :6], b[0, :6])


@pytest.mark.slow
def test_remat_same_values_and_grads():
  """Every remat policy recomputes activations in the backward pass: the same loss and gradients, with the
  temporaries the policy promises (8 layers so the saved activations dominate the step's temporary memory)."""
  _, params = _model_and_params(num_layers=8)
  tokens = _inputs(np.random.default_rng(0).integers(0, 256, (2, 32)))
  results, temp, host = {}, {}, {}
  assert set(models.REMAT.names()) == {"none", "full", "save_dots", "save_qkv_proj", "save_out_proj", "minimal",
                                       "offload_minimal", "offload_dots", "offload_full"}
  for remat in models.REMAT.names():
    model = _model(num_layers=8, remat=remat)

    def loss(p, model=model):
      return jnp.mean(model.apply(p, *tokens) ** 2)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    results[remat] = compiled(params)
    memory = compiled.memory_analysis()
    temp[remat], host[remat] = memory.temp_size_in_bytes, memory.host_temp_size_in_bytes
  l1, g1 = results["none"]
  for remat in models.REMAT.names():
    l2, g2 = results[remat]
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), g1, g2)
  # save_dots keeps the matmul outputs, full only each layer's input (measured: 9.3 MB, 4.2 MB, 2.1 MB); the
  # named policies sit between, each keeping what it names.
  assert temp["save_dots"] < 0.7 * temp["none"], temp
  assert temp["full"] < 0.7 * temp["save_dots"], temp
  assert temp["full"] < temp["save_out_proj"] < temp["save_qkv_proj"] < temp["minimal"] <= temp["save_dots"], temp
  # Offloaded: on CPU the device's memory is the host's, so XLA keeps them where minimal / save_dots do (the HBM
  # they free on a TPU: tools/bench_topology.py --remat, docs/parallelism.md).
  for offloaded, kept in (("offload_minimal", "minimal"), ("offload_dots", "save_dots"), ("offload_full", "full")):
    assert temp[offloaded] == temp[kept] and host[offloaded] == host[kept] == 0, (temp, host)


def _next_token_loss(model, tokens):
  """params -> ((mean next-token cross-entropy, logits), gradients)."""
  def loss(params):
    logits = model.apply(params, *tokens)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[0][:, 1:, None], axis=-1)), logits
  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def test_the_tpu_programs_fusion_points_keep_values_and_gradients(monkeypatch):
  """Programs compiled for TPU project q, k and v by one matmul, rotate bfloat16 q and k by a signed-permutation
  matmul, write the gated MLP's product and the final norm's cotangent to memory (jaxtrain.models.fusion) and,
  backward, each layer norm's direct term summed with the residual's cotangent (RMSNorm.beside_residual): the same
  loss and logits as the default program, bitwise (bf16 compute), and its gradients within bfloat16 rounding (the
  projections' input gradient is one sum, not three rounded ones added; the norms' sum is rounded once more); the
  traced TPU program does hold those matmuls and the barriers; without the two, its gradients are bitwise the
  default's."""
  from jaxtrain.models import attention, llama
  model, params = _model_and_params(dtype="bfloat16")
  tokens = _inputs(np.random.default_rng(0).integers(0, 256, (2, 16)))
  default = _next_token_loss(model, tokens)(params)
  trace = lambda: str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(model.apply(p, *tokens))))(params))  # noqa: E731
  plain = trace()
  with attention.compiling_for("tpu"):
    (loss, logits), grads = _next_token_loss(model, tokens)(params)
    program = trace()
    monkeypatch.setattr(llama.Attention, "_fuse_projections", lambda self: False)
    monkeypatch.setattr(llama.RMSNorm, "beside_residual", lambda self, x: (x, self(x)))
    unfused = _next_token_loss(model, tokens)(params)
    monkeypatch.undo()
  # The MLP's product in the layers' scan body and its cotangent in the backward scan's, the final norm's cotangent,
  # and in the backward scan's body the two norms' direct terms beside the residual's cotangent.
  assert (plain.count("optimization_barrier"), program.count("optimization_barrier")) == (0, 5)
  # q's and k's rotations: forward, and each one's input gradient (a constant rotation has no weight gradient), 4
  # more; q, k and v projected by one matmul: its forward, input gradient and weight gradient, 6 fewer.
  assert program.count("dot_general") - plain.count("dot_general") == 4 - 6
  jax.tree.map(np.testing.assert_array_equal, default, unfused)
  np.testing.assert_array_equal(loss, default[0][0])
  np.testing.assert_array_equal(logits, default[0][1])
  errors = jax.tree.map(lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(
      b.astype(jnp.float32))), grads, default[1])
  assert 0 < max(jax.tree.leaves(errors)) < 1e-2, errors
  # save_dots keeps matmul outputs, but not the rotations' (the backward never reads them): no more temporaries.
  model, params = _model_and_params(dtype="bfloat16", remat="save_dots", num_layers=4)
  tokens = _inputs(np.random.default_rng(0).integers(0, 256, (2, 64)))
  def temp():
    loss = lambda p: jnp.mean(model.apply(p, *tokens).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes
  plain = temp()
  with attention.compiling_for("tpu"):
    # (The norms' backward holds its one written sum a little longer: compared without it.)
    monkeypatch.setattr(llama.RMSNorm, "beside_residual", lambda self, x: (x, self(x)))
    assert temp() <= plain


@pytest.mark.parametrize("dtype,plus_one", [("float32", False), ("float32", True), ("bfloat16", False)])
def test_the_norm_beside_the_residual_has_the_plain_norms_values_and_gradients(dtype, plus_one):
  """The norm of RMSNorm.beside_residual in a residual block ``x + f(norm(x))`` (TPU programs: its backward writes
  the residual's cotangent plus the norm's direct term once): RMSNorm's values bitwise, its gradients for x and the
  scale within float32 rounding in float32 and within bfloat16 rounding of that sum in bfloat16 (Gemma's 1 + w
  too). The model-level check is test_the_tpu_programs_fusion_points_keep_values_and_gradients."""
  from jaxtrain.models import llama
  dt = jnp.dtype(dtype)
  scale = jax.random.normal(jax.random.key(2), (64,)) * 0.3 + (0.0 if plus_one else 1.0)
  x = (jax.random.normal(jax.random.key(0), (2, 8, 64)) * 3).astype(dt)
  w = jax.random.normal(jax.random.key(1), (64, 64)).astype(dt) / 8

  def plain(x, scale):  # RMSNorm.__call__
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return x, (y * (1.0 + scale if plus_one else scale)).astype(dt)

  def block(x, scale, split):
    skip, h = split(x, scale)
    return jnp.sum((skip + jnp.tanh(h @ w)).astype(jnp.float32) ** 2)

  beside = lambda x, scale: llama._norm_beside_residual(x, scale, 1e-6, plus_one, dt)  # noqa: E731
  np.testing.assert_array_equal(beside(x, scale)[1], plain(x, scale)[1])
  reference = jax.value_and_grad(block, argnums=(0, 1))(x, scale, plain)
  ours = jax.value_and_grad(block, argnums=(0, 1))(x, scale, beside)
  program = str(jax.make_jaxpr(jax.grad(block, argnums=(0, 1)), static_argnums=2)(x, scale, beside))
  assert program.count("optimization_barrier") == 1
  np.testing.assert_array_equal(ours[0], reference[0])
  tolerance = 2e-6 if dtype == "float32" else 2 ** -7
  for a, b in zip(ours[1], reference[1]):
    error = jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32))
    assert error < tolerance, (error, tolerance)


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_params():
  model, params = _model_and_params(dtype="bfloat16")
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  fp32_model = _model()
  tokens = _inputs(np.random.default_rng(0).integers(0, 256, (2, 16)))
  (loss, logits), grads = _next_token_loss(model, tokens)(params)
  (ref_loss, ref), ref_grads = _next_token_loss(fp32_model, tokens)(params)
  assert logits.dtype == jnp.float32
  # Really computed in bf16 (8-bit mantissa: ~0.6% measured), and close; fp32 round-off would be ~1e-7.
  assert 1e-3 < float(jnp.linalg.norm(logits - ref) / jnp.linalg.norm(ref)) < 0.03
  assert float(loss) == pytest.approx(float(ref_loss), rel=1e-3)
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
    assert g.dtype == jnp.float32, jax.tree_util.keystr(path)
    rows = g.shape[0] if path[0].key == "layers" else 1  # the stacked layers: each layer's slice on its own
    for i, (a, b) in enumerate(zip(np.reshape(g, (rows, -1)), np.reshape(r, (rows, -1)))):
      cosine = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
      norm_ratio = np.linalg.norm(a) / np.linalg.norm(b)
      where = f"{jax.tree_util.keystr(path)}[{i}]"
      assert cosine > 0.999 and abs(norm_ratio - 1) < 0.02, f"{where}: cosine {cosine:.5f}, norm ratio {norm_ratio:.4f}"


def test_tied_embeddings_share_the_table():
  model, params = _model_and_params(tie_embeddings=True)
  assert "lm_head" not in params
  untied, _ = _model_and_params()
  assert untied.num_params() - model.num_params() == 128 * 256


class Bigram(nnx.Module):
  """A model added from outside the package: only logical axis names, no core edits."""

  def __init__(self, cfg, *, rngs):
    self.table = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.vocab_size)) * 0.02,
                           out_sharding=("vocab", "embed"))

  def __call__(self, tokens, positions, segment_ids):
    return self.table[...][tokens]


models.register("bigram_test", models.Family(module=Bigram))


def test_registered_model_trains(make_config):
  config = make_config(fsdp=8)
  config.model = models.defaults("bigram_test")
  config.optim.lr = 0.1
  config.train.steps = 10
  state, history = trainer.train(config)
  assert state.params["table"].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  assert history[-1]["loss"] < history[0]["loss"]

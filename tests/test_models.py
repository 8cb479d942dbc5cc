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


def test_the_tpu_programs_fusion_points_keep_values_and_gradients():
  """Programs compiled for TPU rotate bfloat16 q and k by a signed-permutation matmul and write the gated MLP's
  product and the final norm's cotangent to memory (jaxtrain.models.fusion): the same loss, logits and gradients as
  the default program, bitwise (bf16 compute); the traced TPU program does hold those matmuls and the barriers."""
  from jaxtrain.models import attention
  model, params = _model_and_params(dtype="bfloat16")
  tokens = _inputs(np.random.default_rng(0).integers(0, 256, (2, 16)))
  default = _next_token_loss(model, tokens)(params)
  trace = lambda: str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(model.apply(p, *tokens))))(params))  # noqa: E731
  plain = trace()
  with attention.compiling_for("tpu"):
    tpu = _next_token_loss(model, tokens)(params)
    program = trace()
  # The MLP's product in the layers' scan body and its cotangent in the backward scan's, and the final norm's
  # cotangent.
  assert (plain.count("optimization_barrier"), program.count("optimization_barrier")) == (0, 3)
  # q's and k's rotations: forward, and each one's input gradient (a constant rotation has no weight gradient).
  assert program.count("dot_general") - plain.count("dot_general") == 4
  jax.tree.map(np.testing.assert_array_equal, tpu, default)
  # save_dots keeps matmul outputs, but not the rotations' (the backward never reads them): no more temporaries.
  model, params = _model_and_params(dtype="bfloat16", remat="save_dots", num_layers=4)
  tokens = _inputs(np.random.default_rng(0).integers(0, 256, (2, 64)))
  def temp():
    loss = lambda p: jnp.mean(model.apply(p, *tokens).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.jit(jax.value_and_grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes
  plain = temp()
  with attention.compiling_for("tpu"):
    assert temp() <= plain


@pytest.mark.compat  # JAX's user contexts (jax.make_user_context) in jax.jit's cache keys
def test_the_platform_a_program_is_traced_for_is_part_of_its_cache_key():
  """One jitted function (llama.rope on bfloat16 q), called on this CPU host and then lowered under
  compiling_for("tpu"): two programs, the TPU one with its rotation matmul, not the CPU program from jit's cache;
  and back outside, the CPU program again."""
  from jaxtrain.models import attention
  from jaxtrain.models.llama import model as llama
  rope = jax.jit(llama.rope, static_argnums=2)
  x, positions = jnp.ones((1, 4, 2, 16), jnp.bfloat16), jnp.zeros((1, 4), jnp.int32)
  rope(x, positions, 1e4)  # traced, lowered and compiled for the CPU: in every cache of jit
  cpu = rope.lower(x, positions, 1e4).as_text()
  with attention.compiling_for("tpu"):
    tpu = rope.lower(x, positions, 1e4).as_text()
  assert "dot_general" not in cpu and "dot_general" in tpu
  assert rope.lower(x, positions, 1e4).as_text() == cpu


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_tpu_programs_train_step_is_the_default_programs_bitwise(make_config, dtype):
  """The whole train step traced for TPU (every TPU-only path: RoPE's rotation matmul, the fusion points, the
  lookup) on the CPU mesh, FSDP over 8 devices: three steps give bitwise the default program's state and metrics,
  in bfloat16 (the TPU-only paths that take it) and float32 compute. (A lookup that sums the table's gradient in
  another order on one platform, as the gathered table does, fails it in float32, whose gradient rows round when
  summed: tokens seen many times on several devices.) tools/bench_numerics.py compares 300 steps of cpu_50m."""
  from jaxtrain import data as data_lib
  from jaxtrain.data.synthetic import SyntheticSource
  from jaxtrain.models import attention

  config = make_config(fsdp=8)
  config.model.update(dtype=dtype, attention="xla")
  run = trainer.build(config)
  steps = {"default": trainer.compile_step(run)}
  with attention.compiling_for("tpu"):
    steps["tpu"] = trainer.compile_step(run)
  # Four ids: each seen ~130 times a step on every device, so that an order of the table gradient's float32 sum
  # shows.
  source = SyntheticSource(config.data.seq_len, 4, config.train.global_batch_size, 0)
  batches = [data_lib.to_global(next(source), run.batch_sharding) for _ in range(3)]
  ends = {}
  for name, step in steps.items():
    state, losses = trainer.init_state(run), []
    for batch in batches:
      state, metrics = step(state, batch, np.bool_(False))
      losses.append(float(metrics["loss"]))
    ends[name] = (jax.device_get(state), losses)
  assert ends["tpu"][1] == ends["default"][1]
  jax.tree.map(np.testing.assert_array_equal, ends["tpu"][0], ends["default"][0])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_query_scale_folded_into_rope_is_within_the_rotations_rounding(head_dim):
  """The queries' attention scale s is folded into RoPE's cos and sin (every platform, every backend that takes
  variants): ``rope(x, scale=s)`` against rotating and then scaling. For a power-of-two s (head_dim 64: 1/8) the
  same bfloat16 values bitwise; otherwise (head_dim 128) within the rotation's own rounding (cos, sin, two products
  and their sum each rounded to bfloat16: 4 x 2^-8, bfloat16's unit roundoff, of |x1 cos| + |x2 sin|, scaled), as
  rotating and then scaling is. And the TPU program's rotation (a signed-permutation matmul) gives the default's
  values and gradients bitwise."""
  from jaxtrain.models import attention, llama
  x = jax.random.normal(jax.random.key(0), (2, 64, 4, head_dim)).astype(jnp.bfloat16)
  positions = jnp.broadcast_to(jnp.arange(64) * 37, (2, 64))  # angles up to 2331 radians
  s = head_dim ** -0.5
  folded = llama.rope(x, positions, 10_000.0, scale=s)
  unfolded = llama.rope(x, positions, 10_000.0) * jnp.asarray(s, jnp.bfloat16)
  if head_dim == 64:
    np.testing.assert_array_equal(folded, unfolded)
  half = head_dim // 2
  # (the angle as rope computes it, in float32: its rounding is the same in both forms, and not bfloat16's)
  angle = np.asarray(positions, np.float32)[..., None] * np.asarray(llama.rope_frequencies(head_dim, 10_000.0))
  cos, sin = (f(angle.astype(np.float64))[:, :, None] for f in (np.cos, np.sin))
  x1, x2 = np.asarray(x[..., :half], np.float64), np.asarray(x[..., half:], np.float64)
  exact = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1) * s
  terms = np.concatenate([np.abs(x1 * cos) + np.abs(x2 * sin), np.abs(x2 * cos) + np.abs(x1 * sin)], -1) * s
  budget = 4 * 2.0 ** -8 * terms
  for ours in (folded, unfolded):
    assert np.all(np.abs(np.asarray(ours, np.float64) - exact) <= budget)
  cotangent = jax.random.normal(jax.random.key(1), x.shape).astype(jnp.bfloat16)
  default = jax.vjp(lambda x: llama.rope(x, positions, 10_000.0, scale=s), x)
  with attention.compiling_for("tpu"):
    tpu = jax.vjp(lambda x: llama.rope(x, positions, 10_000.0, scale=s), x)
  np.testing.assert_array_equal(tpu[0], default[0])
  np.testing.assert_array_equal(tpu[1](cotangent)[0], default[1](cotangent)[0])


@pytest.mark.parametrize("preset,sizes", [("fsdp", dict(fsdp=8)), ("fsdp_tp", dict(fsdp=4, tensor=2)),
                                          ("fsdp_tp", dict(fsdp=8))])
def test_the_lookup_gives_every_id_the_same_row_on_every_path(preset, sizes):
  """llama.lookup's paths (the gathered table; the table looked up where it lies under FSDP, every platform's; its
  vocabulary split over a tensor axis, or named on an axis of 1 and not split) give every id, in range or not, the
  same row and the same gradient (within float32 summation order): ``table[clip(id, 0, vocab - 1)]``, as a gather
  clamps (ids out of range are refused before they reach the program: jaxtrain.data). And the table cast to
  bfloat16 before the gather gives bitwise the rows gathered in float32 and then cast (a gather copies; the cast is
  elementwise)."""
  import types

  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxtrain import mesh as mesh_lib
  from jaxtrain import sharding
  from jaxtrain.models.llama import model as llama

  mesh = Mesh(np.array(jax.devices()[:8]).reshape([sizes.get(a, 1) for a in mesh_lib.MESH_AXES]),
              mesh_lib.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_lib.MESH_AXES))
  rules = sharding.PRESETS[preset]
  table = jax.random.normal(jax.random.key(0), (64, 16), jnp.float32)
  tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, 64)
  tokens = tokens.at[0, :4].set(jnp.array([-5, -1, 64, 1000])).at[1, :2].set(jnp.array([0, 63]))
  weights = jax.random.normal(jax.random.key(2), (8, 6, 16), jnp.float32)
  clipped = jnp.clip(tokens, 0, 63)
  np.testing.assert_array_equal(llama._take_rows(table, clipped, jnp.bfloat16),
                                jnp.take(table, clipped, axis=0).astype(jnp.bfloat16))

  def objective(table, tokens, where_the_table_is):
    rows = llama.lookup(types.SimpleNamespace(embedding=table, dtype=jnp.bfloat16), tokens, where_the_table_is)
    return jnp.sum(rows.astype(jnp.float32) * weights), rows

  layout = lambda *names: NamedSharding(mesh, sharding.logical_to_mesh_spec(P(*names), rules))  # noqa: E731
  expected = jnp.zeros_like(table).at[clipped].add(weights.astype(jnp.bfloat16).astype(jnp.float32))
  for where_the_table_is in (False, True):
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
      (_, rows), grad = jax.jit(jax.value_and_grad(objective, has_aux=True), static_argnums=2)(
          jax.device_put(table, layout("vocab", "embed")), jax.device_put(tokens, layout("batch", "length")),
          where_the_table_is)
    np.testing.assert_array_equal(rows, table[clipped].astype(jnp.bfloat16))
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-6)


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

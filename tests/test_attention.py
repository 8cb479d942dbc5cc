"""Attention backends: blockwise (memory-efficient, custom backward) equals the float32 reference and XLA's path in
outputs and gradients on packed rows with grouped-query heads, for block sizes that do and do not divide the
length; attention is causal by position within a document, whatever the order of the tokens; a model trained
with blockwise attention gives the losses of one with XLA's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import models
from jaxtrain.config import base_config
from jaxtrain.errors import ConfigError
from jaxtrain.models import attention


def _packed(seed=0, b=2, t=45, n=4, kvh=2, h=8):
  """Two rows: three documents and padding (segment 0, positions 0), and one document."""
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(k1, (b, t, n, h))
  k, v = jax.random.normal(k2, (b, t, kvh, h)), jax.random.normal(k3, (b, t, kvh, h))
  seg = np.array([[1] * 12 + [2] * 20 + [3] * 6 + [0] * 7, [1] * t], np.int32)
  pos = np.array([list(range(12)) + list(range(20)) + list(range(6)) + [0] * 7, list(range(t))], np.int32)
  return q, k, v, jnp.asarray(seg), jnp.asarray(pos)


def _loss(backend, block, seg, pos):
  w = jnp.cos(jnp.arange(8.0))  # a fixed, non-uniform cotangent

  def f(q, k, v):
    return (attention.attend(backend, q, k, v, seg, pos, block) * w).sum()
  return f


@pytest.mark.slow
@pytest.mark.parametrize("block", [1, 7, 16, 45, 128])
def test_blockwise_equals_the_reference_and_xla(block):
  q, k, v, seg, pos = _packed()
  want = attention.attend("reference", q, k, v, seg, pos)
  for backend in ("blockwise", "xla"):
    got = attention.attend(backend, q, k, v, seg, pos, block)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=backend)
    grads = jax.grad(_loss(backend, block, seg, pos), argnums=(0, 1, 2))(q, k, v)
    for g, r, name in zip(grads, jax.grad(_loss("reference", block, seg, pos), argnums=(0, 1, 2))(q, k, v), "qkv"):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()), err_msg=f"{backend} d{name}")
  # Token 12 of row 0 starts document 2: it sees only itself, so its output is its own value vector.
  np.testing.assert_allclose(want[0, 12], jnp.repeat(v[0, 12], 2, axis=0), rtol=1e-6)


def test_causal_by_position_within_a_document_whatever_the_token_order():
  """Context parallelism reorders a sequence's chunks: the same tokens in another order (with their segment ids
  and positions) give the same outputs, permuted, and the same gradients."""
  q, k, v, seg, pos = _packed(seed=1)
  perm = np.random.default_rng(0).permutation(q.shape[1])
  for backend in ("blockwise", "xla"):
    base = attention.attend(backend, q, k, v, seg, pos, 8)
    moved = attention.attend(backend, q[:, perm], k[:, perm], v[:, perm], seg[:, perm], pos[:, perm], 8)
    real = np.asarray(seg[:, perm]) != 0  # padding tokens (segment 0) attend among themselves, order-dependent
    np.testing.assert_allclose(np.asarray(moved)[real], np.asarray(base[:, perm])[real], rtol=1e-5, atol=1e-6)


def test_blockwise_in_bfloat16_stays_close():
  q, k, v, seg, pos = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in _packed(seed=2))
  want = attention.attend("reference", q, k, v, seg, pos).astype(jnp.float32)
  got = attention.attend("blockwise", q, k, v, seg, pos, 16).astype(jnp.float32)
  assert got.dtype == want.dtype and float(jnp.abs(got - want).max()) < 0.05


@pytest.mark.slow
def test_a_model_with_blockwise_attention_has_xla_attention_s_logits_and_gradients():
  c = base_config()
  c.model.update(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
  tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, 256)
  seg = jnp.asarray([[1] * 25 + [2] * 15, [1] * 40])
  pos = jnp.asarray([list(range(25)) + list(range(15)), list(range(40))])
  out = {}
  for backend in ("xla", "blockwise"):
    c.model.update(attention=backend, attention_block_size=16)
    model = models.Model.from_config(c.model)
    params = model.init(jax.random.key(0))

    def loss(p):
      return jax.nn.log_softmax(model.apply(p, tokens, pos, seg))[..., 0].mean()
    out[backend] = (model.apply(params, tokens, pos, seg), jax.grad(loss)(params))
  np.testing.assert_allclose(out["blockwise"][0], out["xla"][0], rtol=1e-5, atol=1e-5)
  for g, r in zip(jax.tree.leaves(out["blockwise"][1]), jax.tree.leaves(out["xla"][1])):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))


@pytest.mark.slow
@pytest.mark.parametrize("variant", [attention.PLAIN, attention.Variant(window=100, softcap=0.5, scale=0.05)],
                         ids=["plain", "window_softcap_scale"])
def test_splash_kernel_equals_the_reference_in_interpret_mode(variant):
  """The TPU kernel's own code, run by Pallas' interpreter on CPU (tests/test_tpu_compile.py compiles it for TPU):
  outputs and gradients of the real tokens equal the reference on packed rows with GQA and padding, plain and with
  a window shorter than the documents (its LocalMask), soft-capped scores and another scale."""
  k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
  q, k, v = jax.random.normal(k1, (2, 256, 4, 128)), *(jax.random.normal(r, (2, 256, 2, 128)) for r in (k2, k3))
  seg = jnp.asarray(np.array([[1] * 100 + [2] * 120 + [0] * 36, [1] * 256], np.int32))
  pos = jnp.asarray(np.array([list(range(100)) + list(range(120)) + list(range(36)), list(range(256))], np.int32))
  real = (seg != 0)[..., None, None]

  def loss(backend):
    return lambda q, k, v: (attention.attend(backend, q, k, v, seg, pos, 128, variant) * real).sum()
  want = attention.attend("reference", q, k, v, seg, pos, variant=variant)
  got = attention.attend("splash", q, k, v, seg, pos, 128, variant)
  np.testing.assert_allclose(np.asarray(got)[np.asarray(seg) != 0], np.asarray(want)[np.asarray(seg) != 0],
                             rtol=1e-5, atol=1e-5)
  for g, r in zip(jax.grad(loss("splash"), argnums=(0, 1, 2))(q, k, v),
                  jax.grad(loss("reference"), argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))


def test_block_size_must_be_positive():
  c = base_config()
  c.model.attention_block_size = 0
  with pytest.raises(ConfigError, match="model.attention_block_size"):
    models.validate(c)


def _largest_array(backend: str, t: int) -> int:
  """Elements of the largest array in the compiled gradient of a one-layer model at length ``t``."""
  import math
  import re
  c = base_config()
  c.model.update(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, attention=backend,
                 attention_block_size=128)
  model = models.Model.from_config(c.model)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)

  def loss(p, x):
    return jax.nn.log_softmax(model.apply(p, x, x, x)).mean()
  hlo = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
  shapes = re.findall(r"\b(?:f32|pred|s32|bf16)\[([\d,]*)\]", hlo)
  return max(math.prod(int(d) for d in dims.split(",") if d) for dims in shapes)


def test_blockwise_compiles_to_nothing_quadratic():
  """No array of the compiled forward + backward holds length x length elements (an XLA pass once hoisted the
  mask of every block out of the loop: a [blocks, ..., length, block] array); xla's path does."""
  t = 2048
  assert _largest_array("xla", t) >= t * t
  assert _largest_array("blockwise", t) == t * 128 * 4  # one key block's scores: length x block x heads


def test_auto_chooses_by_platform_length_and_layout(monkeypatch):
  """auto (the default): splash on TPU where its rules allow, else xla up to AUTO_XLA_MAX_LEN tokens and blockwise
  above; the traced choice is the backend's own computation, bit for bit."""
  assert base_config().model.attention == "auto"
  limit = attention.AUTO_XLA_MAX_LEN
  assert attention.choose("tpu", 8192) == "splash"
  assert attention.choose("tpu", 8192, context=2) == attention.choose("gpu", 8192) == "blockwise"
  assert attention.choose("tpu", 8192, in_shard_map=True) == "blockwise"  # inside the pipeline's stages
  assert attention.choose("tpu", 8192, sinks=True) == attention.resolve("auto", "tpu", 8192, sinks=True) == "blockwise"
  assert attention.choose("tpu", 1000) == attention.choose("cpu", limit) == "xla"  # 1000: not a multiple of 128
  assert attention.choose("cpu", limit + 1) == "blockwise"
  q, k, v, seg, pos = _packed()
  assert np.array_equal(attention.attend("auto", q, k, v, seg, pos, 16), attention.attend("xla", q, k, v, seg, pos))
  monkeypatch.setattr(attention, "AUTO_XLA_MAX_LEN", 44)  # the rows are 45 tokens long: now "long"
  assert np.array_equal(attention.attend("auto", q, k, v, seg, pos, 16),
                        attention.attend("blockwise", q, k, v, seg, pos, 16))


# Attention variants: sliding window, soft-cap, query scale ---------------------------------------------------------

VARIANTS = {
    "window": attention.Variant(window=5),
    "window_softcap_scale": attention.Variant(window=9, softcap=2.0, scale=0.5),
    "softcap": attention.Variant(softcap=1.5),
    "chunk": attention.Variant(chunk=6),  # Llama 4's chunks (by position: positions // chunk equal)
}


def _brute_force(q, k, v, seg, pos, variant):
  """The variant written out per query in numpy (float64): the oracle for the reference backend itself."""
  q, k, v, seg, pos = (np.asarray(x, np.float64) for x in (q, k, v, seg, pos))
  b, t, n, h = q.shape
  group = n // k.shape[2]
  out = np.zeros_like(q)
  for r in range(b):
    for i in range(t):
      seen = (seg[r] == seg[r, i]) & (pos[r] <= pos[r, i])
      if variant.window:
        seen &= pos[r, i] - pos[r] < variant.window
      if variant.chunk:
        seen &= pos[r] // variant.chunk == pos[r, i] // variant.chunk
      for head in range(n):
        s = k[r, :, head // group] @ q[r, i, head] * variant.scale_for(h)
        if variant.softcap:
          s = variant.softcap * np.tanh(s / variant.softcap)
        p = np.where(seen, np.exp(s - s[seen].max()), 0.0)
        out[r, i, head] = (p / p.sum()) @ v[r, :, head // group]
  return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_attention_variants_equal_the_written_out_definition_in_every_backend(name):
  """Window (by position: ``positions[i] - positions[j] < window``), soft-cap and scale: the reference equals a
  per-query numpy definition; blockwise (its windowed path, which skips key blocks, at block sizes that do and do
  not divide the length, and its masked path) and xla equal the reference in outputs and q/k/v gradients, on packed
  rows with padding and grouped-query heads."""
  variant = VARIANTS[name]
  q, k, v, seg, pos = _packed(seed=5)
  want = attention.attend("reference", q, k, v, seg, pos, variant=variant)
  real = np.asarray(seg) != 0
  np.testing.assert_allclose(np.asarray(want)[real], _brute_force(q, k, v, seg, pos, variant)[real],
                             rtol=1e-5, atol=1e-5)
  # Padding (segment 0, all at position 0) sees other padding by position but not always by index (the windowed
  # path): its outputs are meaningless and masked out of the loss, as the trainer's loss masks them.
  w = jnp.cos(jnp.arange(8.0)) * real[..., None, None]

  def loss(backend, block):
    return lambda q, k, v: (attention.attend(backend, q, k, v, seg, pos, block, variant) * w).sum()
  ref_grads = jax.grad(loss("reference", 0), argnums=(0, 1, 2))(q, k, v)
  for backend, block in (("blockwise", 4), ("blockwise", 7), ("blockwise", 64), ("xla", 0)):
    got = attention.attend(backend, q, k, v, seg, pos, block, variant)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5,
                               err_msg=f"{backend} {block}")
    for g, r, x in zip(jax.grad(loss(backend, block), argnums=(0, 1, 2))(q, k, v), ref_grads, "qkv"):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()),
                                 err_msg=f"{backend} {block} d{x}")


def test_a_window_changes_what_a_query_sees_exactly_at_its_edge():
  """Window w: the query at position p sees positions p - w + 1 .. p. Its output moves when the key at p - w + 1
  changes and not when the one at p - w does (transformers' sliding_window convention)."""
  q, k, v = (jax.random.normal(r, (1, 20, 2, 8)) for r in jax.random.split(jax.random.key(6), 3))
  seg, pos = jnp.ones((1, 20), jnp.int32), jnp.arange(20)[None]
  variant = attention.Variant(window=6)
  for backend in ("reference", "blockwise", "xla"):
    base = attention.attend(backend, q, k, v, seg, pos, 4, variant)[0, 15]
    inside = attention.attend(backend, q, k, v.at[0, 10].add(1.0), seg, pos, 4, variant)[0, 15]
    outside = attention.attend(backend, q, k, v.at[0, 9].add(1.0), seg, pos, 4, variant)[0, 15]
    assert not np.allclose(inside, base) and np.array_equal(outside, base), backend


def test_a_backend_without_variants_is_refused_in_one_line():
  @attention.BACKENDS.register("plain_only_test")
  def plain_only(q, k, v, segment_ids, positions, block_size=None):
    return attention.xla(q, k, v, segment_ids, positions)
  try:
    c = base_config(model="mistral")
    c.model.attention = "plain_only_test"
    with pytest.raises(ConfigError, match="model.attention.*takes no attention variants.*model.sliding_window"):
      models.validate(c)
    c.model.sliding_window = 0
    models.validate(c)  # plain attention: fine
  finally:
    attention.BACKENDS._entries.pop("plain_only_test")


# cuDNN's packed layout, emulated on CPU: the kernel runs on GPUs only (tests/test_gpu.py runs it), but what this
# module hands it (each row's runs of segment ids) and the fallback around it are plain JAX.


def _emulated_cudnn(q, k, v, segment_ids, variant, max_runs):
  """What cuDNN's packed call computes, written out: each described run its own sequence, causal by index within
  it (a window by index too); a token outside every described run sees nothing."""
  offsets, lengths, _ = attention.segment_runs(segment_ids, max_runs)
  i = jnp.arange(segment_ids.shape[1])
  inside = (i >= offsets[:, :-1, None]) & (i < offsets[:, :-1, None] + lengths[:, :, None])  # [b, runs, t]
  run = jnp.where(inside.any(1), jnp.argmax(inside, 1), -1)
  delta = i[:, None] - i[None, :]
  mask = (run[:, :, None] == run[:, None, :]) & (run[:, :, None] >= 0) & (delta >= 0)
  if variant.window:
    mask &= delta < variant.window
  return attention.dense(q, k, v, mask[:, None], variant)


def _loader_rows(t=45, docs=((12, 20, 6), (45,)), first=(0, 17)):
  """Rows as the loader packs them: documents one after another (row r's first continued from the row before, its
  positions starting at ``first[r]``), then padding (segment 0) with positions counting up."""
  seg, pos = np.zeros((len(docs), t), np.int32), np.zeros((len(docs), t), np.int32)
  for r, lengths in enumerate(docs):
    at = 0
    for d, n in enumerate(lengths):
      seg[r, at:at + n], pos[r, at:at + n] = d + 1, np.arange(n) + (first[r] if d == 0 else 0)
      at += n
    pos[r, at:] = np.arange(t - at)
  return jnp.asarray(seg), jnp.asarray(pos)


def test_segment_runs_describe_each_document_as_cudnn_reads_them():
  seg, _ = _loader_rows()
  offsets, lengths, count = attention.segment_runs(seg, 4)
  assert offsets.tolist() == [[0, 12, 32, 38, -1], [0, -1, -1, -1, -1]]
  assert lengths.tolist() == [[12, 20, 6, 7], [45, -1, -1, -1]]  # the padding is a run too
  assert count.tolist() == [4, 1]
  assert attention.segment_runs(seg, 3)[2].tolist() == [4, 1]  # one run more than described: the caller falls back


@pytest.mark.parametrize("variant", [attention.PLAIN, attention.Variant(window=5, scale=0.3)], ids=["plain", "window"])
@pytest.mark.parametrize("docs", [((12, 20, 6), (45,)), ((3,) * 15, (40, 5))], ids=["few", "more than 8"])
def test_cudnn_backend_equals_the_reference_with_the_kernel_emulated(monkeypatch, variant, docs):
  """The cudnn backend with cuDNN's packed call emulated: on loader rows it equals the reference, outputs and
  gradients; a row with more documents than the layout is given (8 here) takes the blockwise fallback and stays
  exact, where the packed call alone would attend across the documents past the 8th; and the same under a mesh
  (its shard_map over the rows)."""
  monkeypatch.setattr(attention, "_cudnn_packed", _emulated_cudnn)
  monkeypatch.setattr(attention, "CUDNN_MAX_SEGMENTS", 8)
  q, k, v, _, _ = _packed(seed=3)
  seg, pos = _loader_rows(docs=docs)

  def loss(backend):
    w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
    return lambda q, k, v: (attention.attend(backend, q, k, v, seg, pos, 16, variant) * w).sum()

  want = attention.attend("reference", q, k, v, seg, pos, variant=variant)
  np.testing.assert_allclose(attention.attend("cudnn", q, k, v, seg, pos, 16, variant), want, rtol=1e-5, atol=1e-5)
  for g, r in zip(jax.grad(loss("cudnn"), (0, 1, 2))(q, k, v), jax.grad(loss("reference"), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))
  many = len(docs[0]) > 8
  alone = _emulated_cudnn(q, k, v, seg, variant, 8)
  assert (float(jnp.abs(alone - want).max()) > 0.1) == many
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
  with jax.set_mesh(mesh), nn_rules():
    sharded = jax.jit(lambda q, k, v: attention.attend("cudnn", q, k, v, seg, pos, 16, variant))(q, k, v)
  np.testing.assert_allclose(sharded, want, rtol=1e-5, atol=1e-5)


def nn_rules():
  from jaxtrain import sharding
  return sharding.axis_rules((("batch", "data"),))


def test_cudnn_is_refused_off_gpu_and_where_it_cannot_run(monkeypatch):
  c = base_config()
  c.model.update(attention="cudnn", dtype="bfloat16")
  with pytest.raises(ConfigError, match="model.attention: 'cudnn' is the GPU kernel and this machine's backend is cpu"):
    models.validate(c)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  models.validate(c)
  for key, value, message in (("model.dtype", "float32", "model.dtype: 'cudnn' attention takes bfloat16 or float16"),
                              ("model.head_dim", 12, "model.head_dim: 'cudnn' needs a head dim that is a multiple"),
                              ("mesh.context", 2, "model.attention: 'cudnn' masks causally by token index")):
    bad = c.copy_and_resolve_references()
    bad.update_from_flattened_dict({key: value})
    with pytest.raises(ConfigError, match=message):
      models.validate(bad)


@pytest.mark.parametrize("backend", ["xla", "blockwise", "auto"])
@pytest.mark.parametrize("window", [0, 6])
def test_attention_sinks_in_every_backend_that_takes_them_equal_the_reference(backend, window):
  """GPT-OSS's sinks (a logit per head in the softmax's denominator). Packed and padded rows, grouped-query heads;
  blockwise with 8-key blocks (window 6: its windowed path): the output and the gradients of q, k, v and the sinks
  equal the float32 reference's, and the sinks change them. splash and cudnn have none: refused at validation
  (tests/test_gpt_oss.py)."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 40, heads, 8)), jnp.float32) for heads in (4, 2, 2))
  segment_ids = jnp.asarray([[1] * 15 + [2] * 25, [1] * 30 + [0] * 10], jnp.int32)
  positions = jnp.asarray([list(range(15)) + list(range(25)), list(range(40))], jnp.int32)
  sinks = jnp.asarray(rng.normal(size=4) * 2, jnp.float32)
  variant = attention.Variant(window=window)

  def run(name, *args):
    return attention.attend(name, *args[:3], segment_ids, positions, 8, variant, args[3])

  def grads(name):
    return jax.grad(lambda *a: jnp.sum(jnp.sin(run(name, *a))), argnums=(0, 1, 2, 3))(q, k, v, sinks)

  ref = run("reference", q, k, v, sinks)
  assert float(jnp.max(jnp.abs(ref - run("reference", q, k, v, None)))) > 0.1
  np.testing.assert_allclose(run(backend, q, k, v, sinks), ref, atol=2e-6)
  for ours, theirs in zip(grads(backend), grads("reference")):
    np.testing.assert_allclose(ours, theirs, atol=2e-5)

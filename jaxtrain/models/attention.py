"""Attention backends: one function each, chosen by ``model.attention`` from :data:`BACKENDS`.

A backend is ``(q, k, v, segment_ids, positions, *, block_size) -> out``: ``q`` ``[batch, length, heads,
head_dim]``, ``k`` and ``v`` ``[batch, length, kv_heads, head_dim]`` (grouped-query attention: ``heads`` a multiple
of ``kv_heads``), ``segment_ids`` and ``positions`` ``[batch, length]`` int32. Query i sees key j iff both are of
the same document (segment id) and ``positions[j] <= positions[i]``: causal by position within a document, so the
order of the tokens along ``length`` does not matter (context parallelism reorders it). No dense ``[length,
length]`` mask is handed around: each backend builds what it needs from the ids. It returns ``[batch, length,
heads, head_dim]`` in q's dtype. Models call :func:`attend`; a kernel is one more ``@BACKENDS.register(name)``
and every family can use it.

- ``xla``: ``jax.nn.dot_product_attention`` with the mask: XLA's attention, any backend; O(length^2) memory.
- ``blockwise``: pure JAX, memory-efficient (:func:`blockwise`): online softmax over blocks of ``block_size``
  keys, a custom backward that recomputes each block, never a ``[length, length]`` array; O(length x
  block_size) memory, any backend (CPU included).
- ``splash``: the TPU Pallas splash-attention kernel (:func:`splash`).
- ``cudnn``: cuDNN's flash attention on GPU, packed rows through its segment offsets (:func:`cudnn`).
- ``auto`` (the default): splash on TPU, cudnn on a Hopper GPU in 16 bits, else xla for short sequences and
  blockwise for long ones (:func:`choose`).
- ``reference``: softmax written out in float32, the oracle the others are tested against.

Attention sinks (GPT-OSS): a learned logit per query head added to every softmax's denominator (a key no query can
attend to, with a zero value), so that a query may give little weight to every real key. A backend that takes them
has a ``sinks=`` parameter (``[heads]`` float32, None: none): ``xla`` and ``reference`` write the softmax out
(:func:`dense`), ``blockwise`` rescales its output by ``sigmoid(lse - sink)`` from its log-sum-exp, which its
backward differentiates. ``splash`` and ``cudnn`` have no such input: validation refuses them (:func:`check_available`).

Decoding (jaxtrain/generate.py) attends new queries over a :class:`KVCache` with :func:`attend_cached` (XLA's
``jax.nn.dot_product_attention`` under :func:`cached_mask`, whatever ``model.attention`` is); the training path
above is untouched by it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp

from jaxtrain.errors import ConfigError
from jaxtrain.models import fusion, scans
from jaxtrain.registry import Registry
from jaxtrain.sharding import constrain

BACKENDS: Registry = Registry("model.attention", "attention backend",
                              how="jaxtrain.models.attention.BACKENDS.register")


@dataclasses.dataclass(frozen=True)
class Variant:
  """How a layer's scores are formed and masked beyond "causal by position within a document" (every backend takes
  it as ``variant=``; the defaults are plain attention).

  window: sliding-window (local) attention, 0 = off: query i sees key j only if ``positions[i] - positions[j] <
    window`` (``window`` keys, itself included: transformers' ``sliding_window``).
  softcap: attention-logit soft-capping, 0 = off: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2).
  scale: the scores' scale, None = ``1 / sqrt(head_dim)`` (Gemma's ``query_pre_attn_scalar ** -0.5``).
  chunk: chunked attention, 0 = off: query i sees key j only if ``positions[i] // chunk == positions[j] // chunk``
    (the tokens of a document in chunks of ``chunk`` positions, each attending within its own: Llama 4's
    ``attention_chunk_size``).
  """
  window: int = 0
  softcap: float = 0.0
  scale: float | None = None
  chunk: int = 0

  def scale_for(self, head_dim: int) -> float:
    return self.scale if self.scale is not None else 1.0 / head_dim ** 0.5

  @property
  def reach(self) -> int:
    """The most keys a query sees, itself included, by its window or its chunk (0: unbounded)."""
    sizes = [r for r in (self.window, self.chunk) if r]
    return min(sizes) if sizes else 0


PLAIN = Variant()
VARIANT_KEYS = ("sliding_window", "attn_softcap", "query_scale", "attention_chunk_size")  # the keys of a Variant


def layer_windows(cfg) -> list[int]:
  """Each layer's sliding window (0: global attention), from ``sliding_window`` and ``global_every``."""
  w, every = getattr(cfg, "sliding_window", 0), getattr(cfg, "global_every", 0)  # (a ConfigDict or a namespace)
  return [0 if not w or (every and (i + 1) % every == 0) else w for i in range(cfg.num_layers)]


def layer_chunks(cfg) -> list[int]:
  """Each layer's attention chunk (0: none): ``attention_chunk_size`` on the local layers, as windows are placed."""
  c, every = getattr(cfg, "attention_chunk_size", 0), getattr(cfg, "global_every", 0)
  return [0 if not c or (every and (i + 1) % every == 0) else c for i in range(cfg.num_layers)]


def mixed_layers(cfg) -> bool:
  """Whether the stack interleaves local and global layers (then a layer's kind is an input of its scan step)."""
  return len(set(zip(layer_windows(cfg), layer_chunks(cfg)))) > 1


def variant(cfg, window: int = 0) -> Variant:
  """The attention variant of a layer with this ``window``."""
  scale = getattr(cfg, "query_scale", 0.0)
  return Variant(window=window, softcap=float(getattr(cfg, "attn_softcap", 0.0)), scale=float(scale) if scale else None)


def visible(q_segment_ids, q_positions, k_segment_ids, k_positions, window=0, chunk=0) -> jax.Array:
  """``[batch, q_len, k_len]`` bool: query i sees key j iff same segment, ``positions[j] <= positions[i]``,
  (``window`` > 0) ``positions[i] - positions[j] < window`` and (``chunk`` > 0) both in the same chunk of positions.
  ``window`` and ``chunk`` may be traced (per-layer values)."""
  delta = q_positions[:, :, None] - k_positions[:, None, :]
  seen = (q_segment_ids[:, :, None] == k_segment_ids[:, None, :]) & (delta >= 0)
  if not (isinstance(window, int) and window == 0):
    seen = seen & ((window <= 0) | (delta < window))
  if isinstance(chunk, int) and chunk == 0:
    return seen
  size = jnp.maximum(chunk, 1)
  return seen & ((chunk <= 0) | (q_positions[:, :, None] // size == k_positions[:, None, :] // size))


def document_mask(segment_ids: jax.Array, positions: jax.Array, window=0, chunk=0) -> jax.Array:
  """``[batch, 1, length, length]`` bool: :func:`visible` for a sequence against itself (the ``xla`` and
  ``reference`` backends' mask; the others never build it)."""
  return visible(segment_ids, positions, segment_ids, positions, window, chunk)[:, None]


def _cap(scores, softcap: float):
  return scores if not softcap else softcap * jnp.tanh(scores / softcap)


def dense(q, k, v, mask, variant: Variant = PLAIN, dtype=None, sinks=None):
  """Attention written out: float32 scores (scaled, soft-capped), ``mask`` ``[batch, 1, q_len, k_len]``, softmax
  (with ``sinks`` ``[heads]``: one more logit per head in its denominator), the values in ``dtype`` (default q's;
  float32 for the reference). Grouped-query heads."""
  b, t, n, h = q.shape
  kvh = k.shape[2]
  dtype = dtype or q.dtype
  qg = q.astype(dtype).reshape(b, t, kvh, n // kvh, h)
  scores = jnp.einsum("bqkgh,bskh->bkgqs", qg, k.astype(dtype), preferred_element_type=jnp.float32)
  scores = _cap(scores * variant.scale_for(h), variant.softcap)
  # A finite mask value, as jax.nn.dot_product_attention's: a query that sees no key (a cache's padding slot)
  # gets a finite, meaningless output instead of NaN.
  scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
  if sinks is None:
    probs = jax.nn.softmax(scores, axis=-1)
  else:  # the sink's column joins the softmax and is dropped after it (its value is zero)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kvh, n // kvh, 1, 1), (*scores.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
  out = jnp.einsum("bkgqs,bskh->bqkgh", probs.astype(dtype), v.astype(dtype), preferred_element_type=jnp.float32)
  return out.reshape(b, t, n, h).astype(q.dtype)


@BACKENDS.register("xla")
def xla(q, k, v, segment_ids, positions, block_size=None, variant: Variant = PLAIN, sinks=None):
  """``jax.nn.dot_product_attention`` with an explicit mask: XLA's fused attention, any backend (soft-capped
  scores or sinks, which it has no option for: :func:`dense` in the compute dtype)."""
  del block_size
  mask = document_mask(segment_ids, positions, variant.window, variant.chunk)
  if variant.softcap or sinks is not None:
    return dense(q, k, v, mask, variant, sinks=sinks)
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=variant.scale)


@BACKENDS.register("reference")
def reference(q, k, v, segment_ids, positions, block_size=None, variant: Variant = PLAIN, sinks=None):
  """Softmax attention written out in float32: the oracle the other backends are tested against."""
  del block_size
  return dense(q, k, v, document_mask(segment_ids, positions, variant.window, variant.chunk), variant, jnp.float32,
               sinks)


# Blockwise (flash-style) attention in pure JAX ------------------------------------------------------------------


def _key_blocks(k, v, segment_ids, positions, block: int):
  """Keys, values, segment ids and positions split into ``[blocks, batch, block, ...]``; the tail padded with
  segment id -1, which no query has (so padding is never attended to)."""
  b, s = segment_ids.shape
  pad = -s % block

  def split(x, fill):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(b, (s + pad) // block, block, *x.shape[2:]), 1, 0)

  return split(k, 0), split(v, 0), split(segment_ids, -1), split(positions, 0)


def _barrier(block):
  """One block's slices behind an optimization barrier: without it XLA hoists the mask out of the loop, computing
  it for every block at once (a [blocks, ..., length, block] array: the quadratic memory this backend avoids;
  measured: 1 GiB per layer at 16k tokens)."""
  return jax.lax.optimization_barrier(block)


def _block_scores(qg, kb, qseg, qpos, kseg, kpos, variant):
  """Scaled (and soft-capped) scores of all queries against one key block, ``[batch, kv_heads, groups, length,
  block]`` float32, -inf where masked; the mask; and the raw scaled scores (the soft-cap's backward reads them)."""
  raw = jnp.einsum("bqkgh,bskh->bkgqs", qg, kb, preferred_element_type=jnp.float32)
  mask = visible(qseg, qpos, kseg, kpos, variant.window, variant.chunk)[:, None, None]
  scores = jnp.where(mask, _cap(raw, variant.softcap), -jnp.inf)
  return scores, mask, raw


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _blockwise(q, k, v, segment_ids, positions, k_segment_ids, k_positions, block, variant):
  """Queries with their ``segment_ids`` and ``positions`` against keys with theirs (the same arrays unless
  :func:`_windowed` hands a window of keys)."""
  return _blockwise_fwd(q, k, v, segment_ids, positions, k_segment_ids, k_positions, block, variant)[0]


def _blockwise_fwd(q, k, v, segment_ids, positions, k_segment_ids, k_positions, block, variant):
  b, t, n, h = q.shape
  kvh = k.shape[2]
  qg = (q * variant.scale_for(h)).astype(q.dtype).reshape(b, t, kvh, n // kvh, h)

  def step(carry, blk):
    m, l, acc = carry  # running max [b,k,g,q], running sum [b,k,g,q], output accumulator [b,q,k,g,h] (float32)
    kb, vb, kseg, kpos = _barrier(blk)
    scores, mask, _ = _block_scores(qg, kb, segment_ids, positions, kseg, kpos, variant)
    m_new = jnp.maximum(m, scores.max(-1))
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    correction = jnp.exp(jnp.where(jnp.isneginf(m_new), 0.0, m - m_new))  # no key seen yet: nothing to rescale
    l = l * correction + p.sum(-1)
    pv = jnp.einsum("bkgqs,bskh->bqkgh", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    acc = acc * jnp.moveaxis(correction, 3, 1)[..., None] + pv
    return (m_new, l, acc), None

  stats = jnp.full((b, kvh, n // kvh, t), -jnp.inf, jnp.float32)
  init = (stats, jnp.zeros_like(stats), jnp.zeros((b, t, kvh, n // kvh, h), jnp.float32))
  (m, l, acc), _ = jax.lax.scan(step, init, _key_blocks(k, v, k_segment_ids, k_positions, block),
                                unroll=scans.unroll())
  # Every query sees at least itself (same segment, same position), so l > 0 and m is finite.
  out = (acc / jnp.moveaxis(l, 3, 1)[..., None]).reshape(b, t, n, h).astype(q.dtype)
  lse = m + jnp.log(l)
  return out, (q, k, v, segment_ids, positions, k_segment_ids, k_positions, out, lse)


def _blockwise_bwd(block, variant, residuals, d_out, d_lse=None):
  q, k, v, segment_ids, positions, k_segment_ids, k_positions, out, lse = residuals
  b, t, n, h = q.shape
  s, kvh = k.shape[1], k.shape[2]
  g, scale = n // kvh, variant.scale_for(h)
  qg = (q * scale).astype(q.dtype).reshape(b, t, kvh, g, h)
  do = d_out.reshape(b, t, kvh, g, h)
  # D_i = sum_h dO_i . O_i: the softmax backward's per-query term, [b, k, g, q].
  delta = jnp.moveaxis(jnp.einsum("bqkgh,bqkgh->bqkg", do.astype(jnp.float32),
                                  out.reshape(b, t, kvh, g, h).astype(jnp.float32)), 1, 3)
  if d_lse is not None:  # d lse_i / d s_ij = p_ij: the log-sum-exp's cotangent joins the softmax backward's term
    delta = delta - d_lse

  def step(dq, blk):
    kb, vb, kseg, kpos = _barrier(blk)
    scores, mask, raw = _block_scores(qg, kb, segment_ids, positions, kseg, kpos, variant)
    p = jnp.where(mask, jnp.exp(scores - lse[..., None]), 0.0)  # the forward's probabilities, recomputed
    dv = jnp.einsum("bkgqs,bqkgh->bskh", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgh,bskh->bkgqs", do, vb, preferred_element_type=jnp.float32)
    ds = p * (dp - delta[..., None])
    if variant.softcap:  # d/dx c tanh(x / c) = 1 - tanh(x / c)^2
      ds = ds * (1.0 - jnp.square(jnp.tanh(raw / variant.softcap)))
    dq = dq + jnp.einsum("bkgqs,bskh->bqkgh", ds.astype(kb.dtype), kb, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqs,bqkgh->bskh", ds.astype(qg.dtype), qg, preferred_element_type=jnp.float32)
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros((b, t, kvh, g, h), jnp.float32),
                              _key_blocks(k, v, k_segment_ids, k_positions, block), unroll=scans.unroll())

  def unblock(x):  # [blocks, b, block, kvh, h] -> [b, s, kvh, h]
    return jnp.moveaxis(x, 0, 1).reshape(b, -1, kvh, h)[:, :s]

  return ((dq * scale).reshape(b, t, n, h).astype(q.dtype), unblock(dk).astype(k.dtype),
          unblock(dv).astype(v.dtype), None, None, None, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _blockwise_lse(q, k, v, segment_ids, positions, k_segment_ids, k_positions, block, variant):
  """:func:`_blockwise` and its log-sum-exp ``[batch, kv_heads, groups, length]`` (float32), both differentiable (the
  sinks' rescaling reads it)."""
  out, residuals = _blockwise_fwd(q, k, v, segment_ids, positions, k_segment_ids, k_positions, block, variant)
  return out, residuals[-1]


def _blockwise_lse_fwd(q, k, v, segment_ids, positions, k_segment_ids, k_positions, block, variant):
  out, residuals = _blockwise_fwd(q, k, v, segment_ids, positions, k_segment_ids, k_positions, block, variant)
  return (out, residuals[-1]), residuals


def _blockwise_lse_bwd(block, variant, residuals, cotangents):
  d_out, d_lse = cotangents
  return _blockwise_bwd(block, variant, residuals, d_out, d_lse)


_blockwise_lse.defvjp(_blockwise_lse_fwd, _blockwise_lse_bwd)


def _sunk(out, lse, sinks):
  """Blockwise output ``[b, t, heads, h]`` with the sinks in its softmax: ``out * sum / (sum + e^sink)`` =
  ``out * sigmoid(lse - sink)`` per query and head (``lse`` ``[b, kv_heads, groups, t]``)."""
  b, t, n, _ = out.shape
  lse = jnp.moveaxis(lse, 3, 1).reshape(b, t, n)
  return (out * jax.nn.sigmoid(lse - sinks.astype(jnp.float32))[..., None]).astype(out.dtype)


def _context_parallel() -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and dict(mesh.shape).get("context", 1) > 1


@BACKENDS.register("blockwise")
def blockwise(q, k, v, segment_ids, positions, block_size=512, variant: Variant = PLAIN, sinks=None):
  """Memory-efficient attention in pure JAX: online softmax over blocks of ``block_size`` keys (FlashAttention's
  recurrence, all queries at once), and a backward that recomputes each block's probabilities from the saved
  log-sum-exp instead of storing them. Peak memory O(length x block_size) per layer; any length (the last block
  is padded), any backend. With a sliding window or chunks shorter than the sequence: :func:`_windowed` (a window's
  work per query, not the causal triangle's). ``sinks``: see the module docstring."""
  segment_ids, positions = segment_ids.astype(jnp.int32), positions.astype(jnp.int32)
  block = min(block_size, k.shape[1])
  if variant.reach and variant.reach - 1 + block < k.shape[1] and q.shape[1] == k.shape[1] \
      and not _context_parallel():
    if sinks is None:
      return _windowed(q, k, v, segment_ids, positions, block, variant)
    return _sunk(*_windowed(q, k, v, segment_ids, positions, block, variant, with_lse=True), sinks)
  if sinks is None:
    return _blockwise(q, k, v, segment_ids, positions, segment_ids, positions, block, variant)
  return _sunk(*_blockwise_lse(q, k, v, segment_ids, positions, segment_ids, positions, block, variant), sinks)


def _windowed(q, k, v, segment_ids, positions, block, variant, with_lse: bool = False):
  """Sliding-window attention that skips the keys a window excludes: the queries in blocks of ``block``, each
  block attending (:func:`_blockwise`) to the ``window - 1`` keys before it (rounded up to whole blocks) and its
  own block. Per query ``window + block`` keys' work and memory instead of ``length``'s. (A chunk: its keys are
  within ``chunk`` positions back, the window taken here; the chunk itself is masked in the blocks.)

  Keys are picked by index, so this needs what the loader's rows are: a document's tokens contiguous in the row
  with positions counting up by one (then a key within the window by position is within it by index). Context
  parallelism reorders the tokens: :func:`blockwise` then takes the masked path over all keys. Each query block is
  rematerialized in the backward pass (``jax.checkpoint``): what is kept between the passes is the queries and the
  block index, not the key windows (window / block copies of the keys). ``with_lse``: also the log-sum-exp
  ``[b, kv_heads, groups, t]``."""
  b, t, n, h = q.shape
  back = -(-(variant.reach - 1) // block) * block  # keys before a query block, whole blocks
  blocks = -(-t // block)
  tail = blocks * block - t

  def pad(x, before, after, fill):
    return jnp.pad(x, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)

  # Padding has segment id -1 (no real token's), position 0: a padded query sees itself, so its softmax is defined.
  qp, qseg, qpos = pad(q, 0, tail, 0), pad(segment_ids, 0, tail, -1), pad(positions, 0, tail, 0)
  kp, vp, kseg, kpos = (pad(x, back, tail, f) for x, f in ((k, 0), (v, 0), (segment_ids, -1), (positions, 0)))

  def one(q_block, i):
    start = i * block  # query block i is [start, start + block); its keys [start - back, start + block)
    keys = [jax.lax.dynamic_slice_in_dim(x, start, back + block, axis=1) for x in (kp, vp, kseg, kpos)]
    mine = [jax.lax.dynamic_slice_in_dim(x, start, block, axis=1) for x in (qseg, qpos)]
    run = _blockwise_lse if with_lse else _blockwise
    return run(q_block, keys[0], keys[1], *mine, keys[2], keys[3], block, variant)

  def step(_, xs):
    q_block, i = xs
    return None, jax.checkpoint(one, prevent_cse=scans.prevent_cse())(q_block, i)

  q_blocks = jnp.moveaxis(qp.reshape(b, blocks, block, n, h), 1, 0)
  _, out = jax.lax.scan(step, None, (q_blocks, jnp.arange(blocks)), unroll=scans.unroll())
  if with_lse:  # out: ([blocks, b, block, n, h], [blocks, b, kvh, g, block])
    out, lse = out
    lse = jnp.moveaxis(lse, 0, 3).reshape(*lse.shape[1:4], blocks * block)[..., :t]
    return jnp.moveaxis(out, 0, 1).reshape(b, blocks * block, n, h)[:, :t], lse
  return jnp.moveaxis(out, 0, 1).reshape(b, blocks * block, n, h)[:, :t]


# Splash attention: the TPU Pallas kernel ---------------------------------------------------------------------------

# The platform programs are compiled for, when not this process's (a topology dry run). A JAX user context, not a
# module global: its value is part of jax.jit's tracing, lowering and compilation cache keys, so a function jitted
# on this host's CPU and then lowered under compiling_for("tpu") is traced again, for TPU, instead of handing back
# the CPU program from its cache (tests/test_models.py).
_TARGET = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def compiling_for(platform: str):
  """Within (this thread): backends compile for ``platform`` (e.g. ``"tpu"`` when lowering for a TPU topology on a
  CPU host), and jitted functions are traced again for it."""
  with _TARGET(platform):
    yield


def target_platform() -> str:
  return _TARGET.value or jax.default_backend()


SPLASH_MIN_BLOCK = 128  # the kernel's tiles: the sequence must be a multiple of this


@BACKENDS.register("splash")
def splash(q, k, v, segment_ids, positions, block_size=512, variant: Variant = PLAIN):
  """The TPU splash-attention Pallas kernel (``jax.experimental.pallas.ops.tpu.splash_attention``) with segment ids: a
  causal mask by token index and'ed with "same segment", which is this module's mask for the loader's rows (positions
  count up within a document); skips fully masked blocks. Grouped-query heads: the kernel's MQA form per KV head
  (vmapped), and per row. A sliding window is the kernel's ``LocalMask`` (by token index, as its causal mask; it
  skips the blocks outside the window) and soft-capping its ``attn_logits_soft_cap``. Run in ``jax.shard_map`` over
  the mesh with the rules' layouts (rows over the batch axes, heads over tensor); not with context parallelism (its
  static causal mask is by index). Off TPU it runs in Pallas' interpret mode (slow; the tests' correctness check)."""
  del positions
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  interpret = target_platform() != "tpu"

  def local(q, k, v, seg):
    b, t, n, h = q.shape
    kvh = k.shape[2]
    block = min(block_size, t)
    causal = (sm.LocalMask((t, t), window_size=(variant.window - 1, 0), offset=0) if variant.window
              else sm.CausalMask((t, t)))
    kernel = sk.make_splash_mqa_single_device(
        mask=sm.MultiHeadMask([causal] * (n // kvh)), attn_logits_soft_cap=variant.softcap or None,
        block_sizes=sk.BlockSizes(block_q=block, block_kv=block, block_q_dkv=block, block_kv_dkv=block,
                                  block_q_dq=block, block_kv_dq=block),
        interpret=interpret)
    qs = jnp.moveaxis((q * variant.scale_for(h)).astype(q.dtype), 1, 2).reshape(b, kvh, n // kvh, t, h)
    ks, vs = (jnp.moveaxis(x, 1, 2) for x in (k, v))  # [b, kv_heads, t, h]
    per_kv_head = jax.vmap(lambda qq, kk, vv, ids: kernel(qq, kk, vv, segment_ids=ids), in_axes=(0, 0, 0, None))
    out = jax.vmap(per_kv_head)(qs, ks, vs, sk.SegmentIds(q=seg, kv=seg))  # [b, kv_heads, groups, t, h]
    # The output's gradient written as the kernel's backward reads it: fused into the output projection's gradient,
    # the compiler writes it sequence-minor and copies it twice (jaxtrain.models.fusion).
    out = fusion.cotangent_barrier(out)
    return jnp.moveaxis(out.reshape(b, n, t, h), 1, 2).astype(q.dtype)

  return per_shard(local, q, k, v, segment_ids)


def per_shard(local, q, k, v, segment_ids):
  """``local(q, k, v, segment_ids)`` on each device's shard: ``jax.shard_map`` over the mesh with the rules'
  layouts (rows over the batch axes, heads over tensor), or a plain call without a mesh. For the kernels, whose
  custom calls XLA cannot partition along a sharded dimension itself."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(q, k, v, segment_ids)
  from flax import linen as nn
  q_spec = nn.logical_to_mesh_axes(("batch", "length", "heads", "head_dim"))
  kv_spec = nn.logical_to_mesh_axes(("batch", "length", "kv_heads", "head_dim"))
  seg_spec = nn.logical_to_mesh_axes(("batch", "length"))
  return jax.shard_map(local, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                       check_vma=False)(q, k, v, segment_ids)


# cuDNN flash attention: the GPU kernel -----------------------------------------------------------------------------

CUDNN_MAX_SEGMENTS = 32  # documents per row given to cuDNN's packed layout; a batch with a fuller row runs blockwise
CUDNN_DTYPES = ("bfloat16", "float16")  # the kernel's input types
CUDNN_MAX_HEAD_DIM = 256  # on Hopper (128 before); a multiple of 8


def segment_runs(segment_ids: jax.Array, max_runs: int):
  """Each row's runs of equal segment ids, in the form of cuDNN's packed ("THD") layout: ``offsets`` ``[batch,
  max_runs + 1]`` (each run's first index, then -1), ``lengths`` ``[batch, max_runs]`` (each run's length, then -1)
  and ``count`` ``[batch]`` (the row's runs; where it exceeds ``max_runs`` the first two describe only part of the
  row). Padding (segment 0) is a run like any other, so every token is covered, as in :func:`visible`."""
  t = segment_ids.shape[1]
  starts = _run_starts(segment_ids)
  index = jax.vmap(lambda s: jnp.nonzero(s, size=max_runs + 1, fill_value=t)[0])(starts)  # [b, max_runs + 1]
  lengths = jnp.where(index[:, :-1] < t, index[:, 1:] - index[:, :-1], -1)
  offsets = jnp.where(index < t, index, -1)
  return offsets.astype(jnp.int32), lengths.astype(jnp.int32), starts.sum(axis=1, dtype=jnp.int32)


def _cudnn_packed(q, k, v, segment_ids, variant: Variant, max_runs: int):
  """cuDNN's fused attention over each row's runs of equal segment ids, causal by index within a run."""
  # The public jax.nn.dot_product_attention(implementation="cudnn") takes sequence lengths but no segments; the
  # function under it takes cuDNN's packed layout (segment offsets and lengths), which is what packed rows need.
  from jaxtrain._compat import cudnn_fused_attention  # a private jax module, imported where it is used
  cudnn_attention = cudnn_fused_attention()
  offsets, lengths, _ = segment_runs(segment_ids, max_runs)
  return cudnn_attention.dot_product_attention(
      q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
      scale=variant.scale_for(q.shape[-1]), mask_type=cudnn_attention.MaskType.PADDING_CAUSAL, qkv_layout="BTNH",
      sliding_window_length=variant.window or None)


@BACKENDS.register("cudnn")
def cudnn(q, k, v, segment_ids, positions, block_size=512, variant: Variant = PLAIN):
  """cuDNN's flash attention (GPU; packed rows need Hopper or newer), through its packed layout: each row's runs of
  equal segment ids are its sequences (:func:`segment_runs`), causal by token index within a run, which is this
  module's mask for the loader's rows (positions count up by one within a document). Grouped-query heads natively;
  a sliding window is the kernel's own (``window`` keys, itself included); no soft-capping (validation refuses
  it). The number of runs per row is a static shape: a batch with a row of more than :data:`CUDNN_MAX_SEGMENTS`
  runs takes ``blockwise`` instead (one ``lax.cond``), so a row of many short documents is never attended across
  them. Run per shard as splash is (:func:`per_shard`); not with context parallelism (the mask is by index)."""
  if variant.softcap:
    raise ConfigError("model.attn_softcap", "the 'cudnn' backend has no attention-logit soft-capping",
                      "use blockwise or xla")

  def local(q, k, v, seg):
    fits = (segment_runs(seg, CUDNN_MAX_SEGMENTS)[2] <= CUDNN_MAX_SEGMENTS).all()
    pos = _index_positions(seg)
    return jax.lax.cond(fits, lambda: _cudnn_packed(q, k, v, seg, variant, CUDNN_MAX_SEGMENTS),
                        lambda: blockwise(q, k, v, seg, pos, block_size, variant))

  del positions  # by index within a run (above); the fallback's positions are the same within each run
  return per_shard(local, q, k, v, segment_ids)


def _run_starts(segment_ids: jax.Array) -> jax.Array:
  """``[batch, length]`` bool: whether each token starts a run of equal segment ids."""
  return jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def _index_positions(segment_ids: jax.Array) -> jax.Array:
  """Each token's index within its run of equal segment ids: the positions that index-causal masking implies."""
  index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
  return index - jax.lax.cummax(jnp.where(_run_starts(segment_ids), index, 0), axis=1)


AUTO_XLA_MAX_LEN = 2048  # auto off TPU: XLA's attention up to this many tokens (one fused matmul), blockwise above


def choose(platform: str, seq_len: int, context: int = 1, in_shard_map: bool = False, dtype=None,
           softcap: bool = False, sinks: bool = False) -> str:
  """What ``auto`` runs: the platform's kernel where its rules allow (no context parallelism, not already inside a
  ``shard_map`` such as the pipeline's, no attention sinks, which no kernel has): ``splash`` on TPU (``seq_len`` a
  multiple of its tiles), ``cudnn`` on a Hopper or newer GPU (16-bit ``dtype``, no soft-capping); else ``xla`` up to
  :data:`AUTO_XLA_MAX_LEN` tokens and ``blockwise`` above (its memory is linear in the length; xla's quadratic: 3 GiB
  of temporaries per device for configs/tiny.py at 4k, docs/models.md)."""
  kernel = context == 1 and not in_shard_map and not sinks
  if kernel and platform == "tpu" and seq_len % SPLASH_MIN_BLOCK == 0:
    return "splash"
  if kernel and platform == "gpu" and jnp.dtype(dtype or jnp.float32).name in CUDNN_DTYPES and not softcap \
      and _hopper_or_newer():
    return "cudnn"
  return "xla" if seq_len <= AUTO_XLA_MAX_LEN else "blockwise"


def _hopper_or_newer() -> bool:
  """Whether this process's first GPU runs cuDNN's packed layout (compute capability 9.0 or more)."""
  capability = getattr(jax.devices()[0], "compute_capability", "0")
  return float(capability) >= 9.0


def resolve(backend: str, platform: str, seq_len: int, context: int = 1, dtype=None, softcap: bool = False,
            sinks: bool = False) -> str:
  """``backend``, or what ``auto`` chooses for this platform, length, context axis, dtype, soft-capping and sinks."""
  return choose(platform, seq_len, context, dtype=dtype, softcap=softcap, sinks=sinks) if backend == "auto" else backend


@BACKENDS.register("auto")
def auto(q, k, v, segment_ids, positions, block_size=512, variant: Variant = PLAIN, sinks=None):
  """The best backend available where the program is compiled (:func:`choose`; logged at the start of a run). With
  sinks: xla or blockwise (the kernels have none)."""
  mesh = jax.sharding.get_abstract_mesh()
  context = 1 if mesh.empty else dict(mesh.shape).get("context", 1)
  in_shard_map = not mesh.empty and any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)
  name = choose(target_platform(), k.shape[1], context, in_shard_map, q.dtype, bool(variant.softcap),
                sinks is not None or bool(variant.chunk))  # (no kernel masks chunks by position either)
  if sinks is not None:
    return BACKENDS.get(name)(q, k, v, segment_ids, positions, block_size=block_size, variant=variant, sinks=sinks)
  return BACKENDS.get(name)(q, k, v, segment_ids, positions, block_size=block_size, variant=variant)


def check_available(config) -> None:
  """A backend that cannot run here (splash off TPU, unless compiling for a TPU topology) or with this layout: one
  ConfigError line at validation."""
  name, on = config.model.attention, config.get("dry_run_topology") and "tpu" or jax.default_backend()
  used = [f"model.{k}" for k in VARIANT_KEYS if config.model.get(k)]
  if used and not takes_variants(name):
    raise ConfigError("model.attention", f"the backend '{name}' takes no attention variants and {used[0]} is set",
                      "use xla, blockwise or splash, or give the backend a variant= parameter")
  if config.model.get("attention_chunk_size") and name in ("splash", "cudnn"):
    raise ConfigError("model.attention", f"the backend '{name}' masks by token index and has no chunked attention "
                      "(model.attention_chunk_size)", "use xla or blockwise (or auto, which picks one of them for "
                      "the chunked layers)")
  if config.model.get("attention_sinks") and not takes_sinks(name):
    raise ConfigError("model.attention", f"the backend '{name}' has no attention sinks and model.attention_sinks "
                      "is set", "use xla or blockwise (or auto, which picks one of them)")
  if name == "cudnn":
    return _check_cudnn(config, on)
  if name != "splash":
    return
  if on != "tpu":
    raise ConfigError("model.attention", f"'splash' is the TPU kernel and this machine's backend is {on}",
                      "use blockwise (memory-efficient, any backend) or xla here, or compile for a TPU with "
                      "--config.dry_run=true --config.dry_run_topology=v5e:2x2")
  if config.mesh.context * config.mesh.dcn_context != 1:
    raise ConfigError("model.attention", "'splash' masks causally by token index, which context parallelism "
                      "reorders", "use blockwise or xla with mesh.context > 1")
  if config.data.seq_len % SPLASH_MIN_BLOCK:
    raise ConfigError("model.attention", f"'splash' needs data.seq_len to be a multiple of {SPLASH_MIN_BLOCK} "
                      f"(it is {config.data.seq_len})", f"set data.seq_len to a multiple of {SPLASH_MIN_BLOCK}")


def _check_cudnn(config, on: str) -> None:
  model = config.model
  if on != "gpu":
    raise ConfigError("model.attention", f"'cudnn' is the GPU kernel and this machine's backend is {on}",
                      "use blockwise (memory-efficient, any backend) or xla here")
  if config.mesh.context * config.mesh.dcn_context != 1:
    raise ConfigError("model.attention", "'cudnn' masks causally by token index, which context parallelism "
                      "reorders", "use blockwise or xla with mesh.context > 1")
  if model.dtype not in CUDNN_DTYPES:
    raise ConfigError("model.dtype", f"'cudnn' attention takes {' or '.join(CUDNN_DTYPES)} and model.dtype is "
                      f"{model.dtype}", "set model.dtype=bfloat16, or use blockwise or xla")
  if model.get("attn_softcap"):
    raise ConfigError("model.attn_softcap", "the 'cudnn' backend has no attention-logit soft-capping",
                      "use blockwise or xla")
  head_dim = model.get("head_dim") or 0
  if head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8:
    raise ConfigError("model.head_dim", f"'cudnn' needs a head dim that is a multiple of 8 up to "
                      f"{CUDNN_MAX_HEAD_DIM} (it is {head_dim})", "use blockwise or xla")


# Memory per backend, for the estimator (tools/estimate.py) --------------------------------------------------------
# Per device for one layer: ``rows`` rows, ``heads`` local query heads, ``q_len`` local queries (the sequence over
# the context axis), ``kv_len`` keys, ``itemsize`` the compute dtype's bytes. A backend without an entry is
# estimated as xla. Checked against the TPU compiler's peak memory (tests/test_tpu_compile.py).


def _xla_memory(rows, heads, q_len, kv_len, block_size, itemsize):
  scores = rows * heads * q_len * kv_len
  # Saved without remat: the probabilities (compute dtype). In the backward: the float32 scores, the probabilities
  # and the probabilities' gradient in the compute dtype (what XLA's TPU program holds for one layer).
  return {"saved": scores * itemsize, "transient": scores * (4 + 2 * itemsize)}


def _blockwise_memory(rows, heads, q_len, kv_len, block_size, itemsize, window=0):
  # One key block at a time: float32 scores, probabilities, their gradient and the scores' gradient, all queries
  # x ``block_size`` keys (the per-query float32 dq accumulator is small beside them and not counted). With a
  # window shorter than the keys (its windowed path), one query block at a time against its window's key blocks.
  block = rows * heads * q_len * min(block_size, kv_len)
  if window and window - 1 + min(block_size, kv_len) < kv_len and q_len == kv_len:
    block = rows * heads * block_size * block_size
  return {"saved": rows * heads * q_len * 4, "transient": 4 * 4 * block}


def _splash_memory(rows, heads, q_len, kv_len, block_size, itemsize):
  # Tiles live in the kernel's VMEM (cuDNN's: shared memory); HBM holds the per-query log-sum-exp (float32).
  return {"saved": rows * heads * q_len * 4, "transient": 0}


def _reference_memory(rows, heads, q_len, kv_len, block_size, itemsize):
  scores = rows * heads * q_len * kv_len
  return {"saved": scores * 4, "transient": scores * 4 * 3}


MEMORY = {"xla": _xla_memory, "blockwise": _blockwise_memory, "splash": _splash_memory, "cudnn": _splash_memory,
          "reference": _reference_memory}


def saved_bytes(backend, rows, heads, q_len, kv_len, itemsize) -> int:  # ``auto``: resolve() it first
  """What the backend keeps for the backward pass without remat, per device for one layer."""
  return MEMORY.get(backend, _xla_memory)(rows, heads, q_len, kv_len, 0, itemsize)["saved"]


def transient_bytes(backend, rows, heads, q_len, kv_len, block_size, itemsize, window: int = 0) -> int:
  """The backend's largest transient in one layer's backward pass, per device (``window``: a local layer's; only
  ``blockwise`` uses less memory for it)."""
  memory = MEMORY.get(backend, _xla_memory)
  if backend == "blockwise":
    return memory(rows, heads, q_len, kv_len, block_size, itemsize, window)["transient"]
  return memory(rows, heads, q_len, kv_len, block_size, itemsize)["transient"]


def _float16_on_cpu(q) -> bool:
  """float16 attention compiled for CPU, which XLA:CPU cannot run: it has no float16 matmul accumulating in float32
  (every backend's scores and values). There it runs on the inputs converted to float32 (exact: the same products,
  float32 sums), only the probabilities staying float32 where a GPU rounds them to float16 for the values' matmul.
  float16 is for GPUs without bfloat16; on CPU it runs so that its loss scaling is tested."""
  return q.dtype == jnp.float16 and target_platform() == "cpu"


def takes_variants(backend: str) -> bool:
  """Whether the registered backend takes ``variant=`` (sliding window, soft-cap, query scale)."""
  return "variant" in inspect.signature(BACKENDS.get(backend)).parameters


def takes_sinks(backend: str) -> bool:
  """Whether the registered backend takes ``sinks=`` (attention sinks: the module docstring)."""
  return "sinks" in inspect.signature(BACKENDS.get(backend)).parameters


def attend(backend: str, q, k, v, segment_ids, positions=None, block_size: int = 512, variant: Variant = PLAIN,
           sinks=None):
  """Causal, document-masked attention with the registered backend ``backend`` (``positions`` default to the
  token's index: causal by order), with ``variant``'s window, soft-cap and scale. Queries keep their sharding;
  keys and values (and the ids a backend reads for them) are constrained to an unsplit ``length``: with context
  parallelism (``length`` -> ``context``) XLA all-gathers them over ``context``, otherwise the constraint changes
  nothing. A backend registered without a ``variant`` parameter runs plain attention only (validation refuses
  the variants for it: :func:`check_available`). ``sinks``: ``[heads]`` (module docstring), None: none."""
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), segment_ids.shape)
  if _float16_on_cpu(q):
    return attend(backend, *(x.astype(jnp.float32) for x in (q, k, v)), segment_ids, positions, block_size,
                  variant, sinks).astype(jnp.float16)
  k, v = (constrain(x, ("batch", None, "kv_heads", "head_dim")) for x in (k, v))
  q = constrain(q, ("batch", "length", "heads", "head_dim"))
  if sinks is not None:  # (validation refuses a backend without them)
    return BACKENDS.get(backend)(q, k, v, segment_ids, positions, block_size=block_size, variant=variant,
                                 sinks=sinks)
  if variant == PLAIN and not takes_variants(backend):
    return BACKENDS.get(backend)(q, k, v, segment_ids, positions, block_size=block_size)
  return BACKENDS.get(backend)(q, k, v, segment_ids, positions, block_size=block_size, variant=variant)


def max_logits(q, k, segment_ids, positions, variant: Variant = PLAIN, block_size: int = 512) -> jax.Array:
  """``[heads]`` float32: each query head's largest logit over the batch, ``scale x q . k`` (before any soft-cap)
  over the (query, key) pairs attention lets see each other (:func:`visible` with ``variant``'s window and chunk),
  padding queries (segment 0) left out; ``-inf`` for a head that sees none. QK-clip's statistic
  (jaxtrain/models/deepseek_v3: MuonClip), the same whatever backend computes the attention itself: the scores are
  formed again here, a block of ``block_size`` keys at a time (memory ``O(q_len x block_size)`` per head), with no
  gradient. Grouped-query heads."""
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  b, t, n, h = q.shape
  kvh, length = k.shape[2], k.shape[1]
  qg = q.reshape(b, t, kvh, n // kvh, h)
  block = min(block_size, length)
  pad = -length % block
  if pad:  # padding keys are in segment -1: no query sees them
    k = jnp.pad(k, [(0, 0), (0, pad), (0, 0), (0, 0)])
  k_segments = jnp.pad(segment_ids, [(0, 0), (0, pad)], constant_values=-1)
  k_positions = jnp.pad(positions, [(0, 0), (0, pad)])

  def one(best, i):
    kb, seg, pos = (jax.lax.dynamic_slice_in_dim(a, i * block, block, axis=1) for a in (k, k_segments, k_positions))
    scores = jnp.einsum("bqkgh,bskh->kgqsb", qg, kb, preferred_element_type=jnp.float32) * variant.scale_for(h)
    seen = visible(segment_ids, positions, seg, pos, variant.window, variant.chunk) & (segment_ids != 0)[..., None]
    seen = jnp.moveaxis(seen, 0, -1)  # [q, s, b]
    return jnp.maximum(best, jnp.max(jnp.where(seen, scores, -jnp.inf), axis=(2, 3, 4))), None

  best, _ = jax.lax.scan(one, jnp.full((kvh, n // kvh), -jnp.inf, jnp.float32), jnp.arange((length + pad) // block))
  return best.reshape(n)


# Decoding with a key/value cache --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVCache:
  """The keys and values of every layer for ``max_len`` slots per row, and what each slot holds (the static batch's
  cache: :class:`jaxtrain.sampling.Generator`).

  ``k``, ``v``: ``[layers, batch, max_len, kv_heads, head_dim]`` (compute dtype); ``segment_ids``, ``positions``:
  ``[batch, max_len]`` int32 of the token in each slot (segment id 0: empty or padding, never attended to);
  ``index``: int32 scalar, the next slot to write (the same for every row: prompts are left-padded). A forward with
  a cache writes its ``length`` new tokens at ``index`` and returns the cache with ``index + length``.

  What a family's decoding calls (the same calls work on a :class:`PagedKVCache`): ``slots =
  cache.write_slots(segment_ids, positions)`` once per forward; ``slots.scan_layers(layer, x, weights, k, v,
  kinds)`` runs the layer stack, ``layer(h, weights, k_layer, v_layer, kind) -> (h, (k_layer, v_layer))``; in each
  layer ``slots.write(k_layer, new)`` (the layer's cache with the new keys or values written) and attention over
  ``slots.view(k_layer)`` with ``slots.kv_segment_ids`` and ``slots.kv_positions``; at the end
  ``slots.advanced(k, v, length)``. A layer never looks inside ``k_layer``: here it is the layer's slice of the
  cache (a ``lax.scan`` over the layers' caches, as always), ``view`` is the array itself and ``write`` is
  :func:`write_kv`, so the static path computes what it always has. (Carrying the whole stack through the scan and
  writing it in place, as :class:`PagedKVCache` does, made the TPU compiler's estimate of Llama 3 8B's decode step
  worse, not better: each layer's slice of a carried stack is copied out for attention. tools/bench_grpo.py.)
  """
  k: jax.Array
  v: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  index: jax.Array

  @classmethod
  def zeros(cls, layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
    kv = jnp.zeros((layers, batch, max_len, kv_heads, head_dim), dtype)
    slots = jnp.zeros((batch, max_len), jnp.int32)
    return cls(kv, kv, slots, slots, jnp.zeros((), jnp.int32))

  def write_slots(self, segment_ids: jax.Array, positions: jax.Array) -> "KVCache":
    """The cache with the new tokens' segment ids and positions written at ``index`` (keys and values are written
    per layer by :meth:`write`)."""
    at = (jnp.zeros((), jnp.int32), self.index)
    return dataclasses.replace(
        self, segment_ids=jax.lax.dynamic_update_slice(self.segment_ids, segment_ids.astype(jnp.int32), at),
        positions=jax.lax.dynamic_update_slice(self.positions, positions.astype(jnp.int32), at))

  def write(self, cached: jax.Array, new: jax.Array, axes=None) -> jax.Array:
    """One layer's cache ``[batch, max_len, ...]`` with ``new`` ``[batch, length, ...]`` at ``index`` (constrained
    to ``axes``, default :data:`KV_AXES`)."""
    return write_kv(cached, new, self.index, axes)

  def view(self, cached: jax.Array, axes=None) -> jax.Array:
    """One layer's cache as attention reads it: ``[batch, max_len, ...]``, the array itself."""
    del axes
    return cached

  @property
  def kv_segment_ids(self) -> jax.Array:
    return self.segment_ids

  @property
  def kv_positions(self) -> jax.Array:
    return self.positions

  def advanced(self, k: jax.Array, v: jax.Array, length: int) -> "KVCache":
    """The cache after a forward of ``length`` tokens that wrote ``k`` and ``v``."""
    return dataclasses.replace(self, k=k, v=v, index=self.index + length)

  def scan_layers(self, layer, x, weights, k, v, kinds=None, first: int = 0):
    """``(x, (k, v))`` after the layers whose stacked ``weights`` (and per-layer ``kinds``, None: none) are given,
    ``layer(h, weights, k_layer, v_layer, kind) -> (h, (k_layer, v_layer))``: a ``lax.scan`` over them and their
    caches, layers ``first`` onward of the stacks ``k`` and ``v``, which come back with those layers written."""
    count = jax.tree.leaves(weights)[0].shape[0]
    whole = first == 0 and count == k.shape[0]
    k_part, v_part = (k, v) if whole else (k[first:first + count], v[first:first + count])
    x, (k_new, v_new) = jax.lax.scan(lambda h, xs: layer(h, *xs), x, (weights, k_part, v_part, kinds),
                                     unroll=scans.unroll())
    if whole:
      return x, (k_new, v_new)
    return x, (jax.lax.dynamic_update_slice_in_dim(k, k_new, first, 0),
               jax.lax.dynamic_update_slice_in_dim(v, v_new, first, 0))


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "segment_ids", "positions", "index"],
                                 meta_fields=[])

KV_AXES = ("batch", None, "kv_heads", "head_dim")  # logical axes of one layer's cached keys or values


def write_kv(cached: jax.Array, new: jax.Array, index: jax.Array, axes=None) -> jax.Array:
  """One layer's cache ``[batch, max_len, kv_heads, head_dim]`` with ``new`` ``[batch, length, ...]`` at slot
  ``index`` (constrained to ``axes``, default :data:`KV_AXES`)."""
  zero = jnp.zeros((), jnp.int32)
  return constrain(jax.lax.dynamic_update_slice(cached, new.astype(cached.dtype), (zero, index, zero, zero)),
                   axes or KV_AXES)


@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """A paged cache for continuous batching (:class:`jaxtrain.sampling.ContinuousGenerator`): a pool of pages that
  the rows (the decoding slots) hold through a page table, each row with its own write index.

  ``k``, ``v``: the pool, ``[layers, pages, page_size, ...]`` (a family's per-token widths: ``kv_heads, head_dim``,
  or MLA's latent ``1, kv_lora_rank``); ``page_table``: ``[rows, pages_per_row]`` int32, the pages a row holds in
  order (ids local to the row's shard, below); ``lengths``: ``[rows]`` int32, how many tokens each row has written
  (its next write index). ``shards`` (static): the batch shards; the rows and the pool's pages are split evenly over
  them and a row only holds pages of its own shard, so that writing and reading a page never leaves the device
  (the pool's ``pages`` axis is split like a static cache's ``batch``: :data:`KV_AXES` apply to a layer's pool).

  A row holds one request at a time, its tokens compact: the token at position p (within its request: positions
  start at 0, prompts are not padded) at row index p (page ``p // page_size``, offset ``p % page_size``). So a row's
  keys need no stored segment ids or positions: index j of a row is visible iff ``j < lengths[row]``, at position
  j, and a refilled row (its length reset to 0) cannot see its previous request's stale keys, which are never
  cleared. (Keys from index 0 to a length are also what TPU's paged-attention kernels read:
  jaxtrain.sampling.ContinuousGenerator's docstring.) Pages are allocated and freed by the generator (a free list
  per shard, on device).

  A forward with this cache (the same family code as :class:`KVCache`'s): each row's tokens whose segment id is
  not 0 are written at ``lengths[row]`` onward, in order (a row's real tokens in one forward are one request's, one
  segment id; padding tokens, segment 0, are not written); its queries attend over the row's pages gathered into
  one contiguous view, ``[rows, pages_per_row * page_size, ...]``, under :func:`cached_mask` (:class:`PagedSlots`):
  today's arithmetic on a view, exact on any backend.
  """
  k: jax.Array
  v: jax.Array
  page_table: jax.Array
  lengths: jax.Array
  shards: int = 1

  @classmethod
  def zeros(cls, per_token: "KVCache", pages: int, rows: int, pages_per_row: int, shards: int = 1
            ) -> "PagedKVCache":
    """An empty pool of ``pages`` pages shaped like ``per_token`` (a family's cache for one row of ``page_size``
    slots, e.g. ``jax.eval_shape`` of its ``init_cache(cfg, 1, page_size)``) and an empty page table of ``rows``
    rows."""
    def pool(a):
      return jnp.zeros((a.shape[0], pages, *a.shape[2:]), a.dtype)
    return cls(pool(per_token.k), pool(per_token.v), jnp.zeros((rows, pages_per_row), jnp.int32),
               jnp.zeros((rows,), jnp.int32), shards)

  @property
  def page_size(self) -> int:
    return self.k.shape[2]

  def write_slots(self, segment_ids: jax.Array, positions: jax.Array) -> "PagedSlots":
    """Where this forward's tokens go (the pool-local index of each, or past the end: not written)."""
    del positions  # a token at row index p is at position p (the class docstring)
    segment_ids = segment_ids.astype(jnp.int32)
    valid = segment_ids != 0
    rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
    at = jnp.where(valid, self.lengths[:, None] + rank, 0)
    page_size, per_row = self.page_size, self.page_table.shape[1]
    local_pages = self.k.shape[1] // self.shards
    page = jnp.take_along_axis(self.page_table, jnp.minimum(at // page_size, per_row - 1), axis=1)
    targets = jnp.where(valid, page * page_size + at % page_size, local_pages * page_size)
    # Each row's view as token indices into its shard's pool: its pages in order, each page's tokens.
    offsets = jnp.arange(page_size, dtype=jnp.int32)[None, None, :]
    view = (self.page_table[:, :, None] * page_size + offsets).reshape(self.page_table.shape[0], -1)
    return PagedSlots(self, targets, view, self.lengths + jnp.sum(valid, axis=1, dtype=jnp.int32),
                      jnp.max(segment_ids, axis=1))


jax.tree_util.register_dataclass(PagedKVCache, data_fields=["k", "v", "page_table", "lengths"],
                                 meta_fields=["shards"])


@dataclasses.dataclass(frozen=True)
class PoolLayer:
  """What a layer of a paged decode holds as its cache (``k_layer``, ``v_layer``): the whole pool ``[layers, pages,
  page_size, ...]``, carried through the layer scan and written in place, and the layer's index in it. (A scan over
  the layers' slices of the pool, as the static cache's, would copy the whole pool at every forward: measured, a
  third of a CPU decode step of 16 slots.)"""
  pool: jax.Array
  layer: jax.Array


jax.tree_util.register_dataclass(PoolLayer, data_fields=["pool", "layer"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class PagedSlots:
  """One forward's view of a :class:`PagedKVCache` (what ``write_slots`` returns; the layers' ``slots``):
  ``targets`` ``[rows, length]``, each new token's index in its shard's pool flattened to ``[pages * page_size]``
  (past the end: dropped); ``tokens`` ``[rows, pages_per_row * page_size]``, the index there of each entry of the
  row's view; ``lengths``, each row's length after the forward; ``segments``, each row's segment id (0: a row with
  no token in this forward)."""
  cache: PagedKVCache
  targets: jax.Array
  tokens: jax.Array
  lengths: jax.Array
  segments: jax.Array

  def _by_shard(self, x: jax.Array) -> jax.Array:
    return x.reshape(self.cache.shards, x.shape[0] // self.cache.shards, *x.shape[1:])

  def _tokens(self, pool: jax.Array) -> jax.Array:
    """A pool ``[layers, pages, page_size, ...]`` as ``[layers, shards, its tokens, ...]`` (the per-token dims kept,
    so that the KV heads stay a dim of their own, split over ``tensor``)."""
    return pool.reshape(pool.shape[0], self.cache.shards, -1, *pool.shape[3:])

  def write(self, cached: PoolLayer, new: jax.Array, axes=None) -> PoolLayer:
    """The pool with ``new`` ``[rows, length, ...]`` (a layer's new keys or values) written to that layer's pages:
    a scatter of whole token entries within each shard (vmapped over the shards: no data leaves its device),
    padding tokens dropped, in place."""
    pool = cached.pool
    entries = self._by_shard(new.astype(pool.dtype)).reshape(self.cache.shards, -1, *new.shape[2:])
    targets = self._by_shard(self.targets).reshape(self.cache.shards, -1)
    tokens = jax.vmap(lambda p, i, n: p.at[cached.layer, i].set(n, mode="drop"), in_axes=(1, 0, 0), out_axes=1)(
        self._tokens(pool), targets, entries)
    return PoolLayer(constrain(tokens.reshape(pool.shape), (None, *(axes or KV_AXES))), cached.layer)

  def view(self, cached: PoolLayer, axes=None) -> jax.Array:
    """The layer's keys or values as attention reads them: each row's pages gathered in order, ``[rows,
    pages_per_row * page_size, ...]`` (the exact fallback of a paged-attention kernel). Gathered token by token
    (``tokens``), not page by page: on CPU a decode step of 16 slots over 16-token pages then costs what it costs
    over one page per slot (page by page: 10% more)."""
    pool = cached.pool
    rows = jax.vmap(lambda p, i: p[cached.layer, i], in_axes=(1, 0))(self._tokens(pool), self._by_shard(self.tokens))
    return constrain(rows.reshape(*self.tokens.shape, *pool.shape[3:]), axes or KV_AXES)

  def scan_layers(self, layer, x, weights, k, v, kinds=None, first: int = 0):
    """As :meth:`KVCache.scan_layers`, the whole pools ``k`` and ``v`` carried through the scan (each layer a
    :class:`PoolLayer` of them, layers ``first`` onward)."""
    count = jax.tree.leaves(weights)[0].shape[0]

    def body(carry, xs):
      h, k, v = carry
      w, index, kind = xs
      h, (k, v) = layer(h, w, PoolLayer(k, index), PoolLayer(v, index), kind)
      return (h, k.pool, v.pool), None

    index = jnp.arange(first, first + count, dtype=jnp.int32)
    (x, k, v), _ = jax.lax.scan(body, (x, k, v), (weights, index, kinds), unroll=scans.unroll())
    return x, (k, v)

  @property
  def kv_segment_ids(self) -> jax.Array:
    """``[rows, view length]``: the row's segment id up to its length, 0 (never attended to) after."""
    seen = jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :] < self.lengths[:, None]
    return jnp.where(seen, self.segments[:, None], 0)

  @property
  def kv_positions(self) -> jax.Array:
    """``[rows, view length]``: index j of a row's view holds its request's token at position j."""
    return jnp.broadcast_to(jnp.arange(self.tokens.shape[1], dtype=jnp.int32), self.tokens.shape)

  def advanced(self, k: jax.Array, v: jax.Array, length: int) -> PagedKVCache:
    """The cache after this forward (its pools ``k``, ``v`` written by every layer)."""
    del length
    return dataclasses.replace(self.cache, k=k, v=v, lengths=self.lengths)


def cached_mask(q_segment_ids, q_positions, kv_segment_ids, kv_positions, window=0, chunk=0) -> jax.Array:
  """``[batch, 1, q_len, kv_len]`` bool: key j is visible to query i iff both are of the same nonzero segment and
  ``kv_positions[j] <= q_positions[i]`` (causal by position, not by slot), within ``window`` positions and the same
  ``chunk`` if set."""
  seen = visible(q_segment_ids, q_positions, kv_segment_ids, kv_positions, window, chunk)
  return (seen & (kv_segment_ids[:, None, :] != 0))[:, None]


def attend_cached(q, k, v, q_segment_ids, q_positions, kv_segment_ids, kv_positions, variant: Variant = PLAIN,
                  sinks=None):
  """Attention of new queries ``q`` ``[batch, q_len, heads, head_dim]`` over a cache's keys and values ``[batch,
  kv_len, kv_heads, head_dim]`` (grouped-query heads allowed) under :func:`cached_mask`. A sliding window masks
  the full cache (it keeps every slot: simple, and a prompt's packed rows stay exact; a window-sized ring buffer
  would save memory on long generations). A query that sees no key (a padding slot) gets a finite, meaningless
  output. ``sinks``: ``[heads]``, in the softmax as in training (:func:`dense`)."""
  if _float16_on_cpu(q):
    return attend_cached(*(x.astype(jnp.float32) for x in (q, k, v)), q_segment_ids, q_positions, kv_segment_ids,
                         kv_positions, variant, sinks).astype(jnp.float16)
  mask = cached_mask(q_segment_ids, q_positions, kv_segment_ids, kv_positions, variant.window, variant.chunk)
  if variant.softcap or sinks is not None:
    return dense(q, k, v, mask, variant, sinks=sinks)
  return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask, scale=variant.scale)

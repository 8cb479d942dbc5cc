"""Attention backends: one function each, chosen by ``model.attention`` from :data:`BACKENDS`.

A backend is ``(q, k, v, segment_ids) -> out``: ``q`` ``[batch, length, heads, head_dim]``, ``k`` and ``v``
``[batch, length, kv_heads, head_dim]`` (grouped-query attention: ``heads`` a multiple of ``kv_heads``),
``segment_ids`` ``[batch, length]`` int32; attention is causal and never crosses documents (tokens with different
segment ids). It returns ``[batch, length, heads, head_dim]`` in q's dtype. Models call :func:`attend`; a kernel
(splash, flash, cuDNN, ring attention) is one more ``@BACKENDS.register(name)`` and every family can use it.

Decoding (jaxtrain/generate.py) attends new queries over a :class:`KVCache` with :func:`attend_cached` (XLA's
``jax.nn.dot_product_attention`` under :func:`cached_mask`, whatever ``model.attention`` is); the training path
above is untouched by it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxtrain.registry import Registry
from jaxtrain.sharding import constrain

BACKENDS: Registry = Registry("model.attention", "attention backend",
                              how="jaxtrain.models.attention.BACKENDS.register")


def causal_document_mask(segment_ids: jax.Array) -> jax.Array:
  """``[batch, 1, length, length]`` bool: query i sees key j <= i of the same document."""
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
  same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same_doc)[:, None]


@BACKENDS.register("xla")
def xla(q, k, v, segment_ids):
  """``jax.nn.dot_product_attention`` with an explicit mask: XLA's fused attention, any backend."""
  return jax.nn.dot_product_attention(q, k, v, mask=causal_document_mask(segment_ids))


@BACKENDS.register("reference")
def reference(q, k, v, segment_ids):
  """Softmax attention written out in float32: the oracle the other backends are tested against."""
  b, t, n, h = q.shape
  groups = n // k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, t, k.shape[2], groups, h)
  scores = jnp.einsum("bqkgh,bskh->bkgqs", qg, k.astype(jnp.float32)) / jnp.sqrt(h)
  mask = causal_document_mask(segment_ids)[:, :, None]  # [b, 1, 1, t, t]
  probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
  out = jnp.einsum("bkgqs,bskh->bqkgh", probs, v.astype(jnp.float32))
  return out.reshape(b, t, n, h).astype(q.dtype)


def attend(backend: str, q, k, v, segment_ids):
  """Causal, document-masked attention with the registered backend ``backend``."""
  return BACKENDS.get(backend)(q, k, v, segment_ids)


# Decoding with a key/value cache --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVCache:
  """The keys and values of every layer for ``max_len`` slots per row, and what each slot holds.

  ``k``, ``v``: ``[layers, batch, max_len, kv_heads, head_dim]`` (compute dtype); ``segment_ids``, ``positions``:
  ``[batch, max_len]`` int32 of the token in each slot (segment id 0: empty or padding, never attended to);
  ``index``: int32 scalar, the next slot to write (the same for every row: prompts are left-padded). A forward with
  a cache writes its ``length`` new tokens at ``index`` and returns the cache with ``index + length``.
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
    per layer by :func:`write_kv`)."""
    at = (jnp.zeros((), jnp.int32), self.index)
    return dataclasses.replace(
        self, segment_ids=jax.lax.dynamic_update_slice(self.segment_ids, segment_ids.astype(jnp.int32), at),
        positions=jax.lax.dynamic_update_slice(self.positions, positions.astype(jnp.int32), at))


jax.tree_util.register_dataclass(KVCache, data_fields=["k", "v", "segment_ids", "positions", "index"],
                                 meta_fields=[])

KV_AXES = ("batch", None, "kv_heads", "head_dim")  # logical axes of one layer's cached keys or values


def write_kv(cached: jax.Array, new: jax.Array, index: jax.Array) -> jax.Array:
  """One layer's cache ``[batch, max_len, kv_heads, head_dim]`` with ``new`` ``[batch, length, ...]`` at slot
  ``index``."""
  zero = jnp.zeros((), jnp.int32)
  return constrain(jax.lax.dynamic_update_slice(cached, new.astype(cached.dtype), (zero, index, zero, zero)), KV_AXES)


def cached_mask(q_segment_ids, q_positions, kv_segment_ids, kv_positions) -> jax.Array:
  """``[batch, 1, q_len, kv_len]`` bool: key j is visible to query i iff both are of the same nonzero segment and
  ``kv_positions[j] <= q_positions[i]`` (causal by position, not by slot)."""
  same = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (kv_segment_ids[:, None, :] != 0)
  causal = kv_positions[:, None, :] <= q_positions[:, :, None]
  return (same & causal)[:, None]


def attend_cached(q, k, v, q_segment_ids, q_positions, kv_segment_ids, kv_positions):
  """Attention of new queries ``q`` ``[batch, q_len, heads, head_dim]`` over a cache's keys and values ``[batch,
  kv_len, kv_heads, head_dim]`` (grouped-query heads allowed) under :func:`cached_mask`. A query that sees no key
  (a padding slot) gets a finite, meaningless output."""
  mask = cached_mask(q_segment_ids, q_positions, kv_segment_ids, kv_positions)
  return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask=mask)

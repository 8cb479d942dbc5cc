"""Attention backends: one function each, chosen by ``model.attention`` from :data:`BACKENDS`.

A backend is ``(q, k, v, segment_ids) -> out``: ``q`` ``[batch, length, heads, head_dim]``, ``k`` and ``v``
``[batch, length, kv_heads, head_dim]`` (grouped-query attention: ``heads`` a multiple of ``kv_heads``),
``segment_ids`` ``[batch, length]`` int32; attention is causal and never crosses documents (tokens with different
segment ids). It returns ``[batch, length, heads, head_dim]`` in q's dtype. Models call :func:`attend`; a kernel
(splash, flash, cuDNN, ring attention) is one more ``@BACKENDS.register(name)`` and every family can use it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.registry import Registry

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

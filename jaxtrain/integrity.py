"""Integrity of the train state: a fingerprint per array that detects corrupted checkpoint bytes, and finiteness.

The fingerprint of an array is ``sum_i w_i * bits_i mod 2**32`` over its elements' bit patterns (as unsigned
integers, widened to 32 bits) with odd weights ``w_i = 2 * (i * 2654435761) + 1`` of the flat index ``i``. An
odd weight is invertible mod 2**32, so changing any one element changes the fingerprint, whatever the bit;
changes to several elements cancel only by a 2**-32 chance. Integer addition mod 2**32 is exact and order-free,
so the value is the same for any mesh, sharding or device count, and XLA computes it where the shards are, in
one pass over the state with the finiteness check, and sends one scalar per array between devices.
Orbax's own checksums cover only its index, not the data (zarr3's crc32c is on the shard index), hence this.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_GOLDEN = np.uint32(2654435761)  # Knuth's multiplicative hash constant


def _bits(x: jax.Array) -> jax.Array:
  """The element bit patterns as uint32 (narrower types widened; 64-bit types as pairs of words)."""
  width = np.dtype(x.dtype).itemsize
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width]
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  bits = jax.lax.bitcast_convert_type(x, unsigned)
  return bits.astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
  bits = _bits(x)
  index = jnp.zeros(bits.shape, jnp.uint32)  # the flat index, built per dimension so that it shards like x
  stride = np.uint32(1)
  for dim in reversed(range(bits.ndim)):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * stride
    stride = np.uint32((int(stride) * bits.shape[dim]) % 2**32)
  weight = (index * _GOLDEN) * np.uint32(2) + np.uint32(1)
  return jnp.sum(bits * weight, dtype=jnp.uint32)


def _finite(x: jax.Array) -> jax.Array:
  return jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)


def all_finite(tree: Any) -> jax.Array:
  """One boolean: every floating-point element of ``tree`` is finite (traceable; fuses into a jitted step)."""
  leaves = [_finite(x) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def summary(tree: Any) -> tuple[Any, Any]:
  """(fingerprint, finite) per array of ``tree``, as two pytrees of scalars (traceable: the train step
  computes it for the state it is about to hand to a checkpoint)."""
  return jax.tree.map(_fingerprint, tree), jax.tree.map(_finite, tree)


def no_summary(tree: Any) -> tuple[Any, Any]:
  """What :func:`summary` returns when nothing was computed (the other branch of a ``lax.cond``)."""
  return (jax.tree.map(lambda _: jnp.zeros((), jnp.uint32), tree),
          jax.tree.map(lambda _: jnp.bool_(True), tree))


def read(summarized: tuple[Any, Any]) -> tuple[dict[str, int], list[str]]:
  """``({array name: fingerprint}, [names of arrays with non-finite values])`` from a (fetched) summary.
  Names are paths like ``params/layers/attn/o/kernel``."""
  fingerprints, finite = jax.device_get(summarized)
  flat_fp = jax.tree_util.tree_flatten_with_path(fingerprints)[0]
  names = [name(path) for path, _ in flat_fp]
  return ({n: int(v) for n, (_, v) in zip(names, flat_fp)},
          [n for n, ok in zip(names, jax.tree.leaves(finite)) if not ok])


_summary = jax.jit(summary)


def summarize(tree: Any) -> tuple[dict[str, int], list[str]]:
  """:func:`read` of :func:`summary`, computed now in one jitted pass (restores, and saves the step did not
  summarize)."""
  return read(_summary(tree))


def name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")

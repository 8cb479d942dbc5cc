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
from jax.sharding import PartitionSpec as P

_GOLDEN = 2654435761  # Knuth's multiplicative hash constant


def _bits(x: jax.Array) -> jax.Array:
  """The element bit patterns as uint32 (narrower types widened; 64-bit types as pairs of words)."""
  width = np.dtype(x.dtype).itemsize
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[width]
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  bits = jax.lax.bitcast_convert_type(x, unsigned)
  return bits.astype(jnp.uint32)


# XLA:CPU does not fuse the elementwise work into the reduction: a whole-array fingerprint or finiteness check
# materializes a temporary as large as the array (measured: +1 GB for a 1 GB float32 array), which doubles the
# host memory of tools/convert_hf.py. On the CPU, arrays larger than this many elements are therefore reduced
# block by block (whole rows of their leading axis) in a loop; the value is the same. Accelerators fuse it.
_BLOCK_ELEMENTS = 1 << 22


def _rows_per_block(x: jax.Array) -> int:
  """Rows of x's leading axis per block: the largest divisor of it within the budget; 0: do not block."""
  if jax.default_backend() != "cpu" or x.ndim < 1 or x.size <= _BLOCK_ELEMENTS:
    return 0
  row = x.size // x.shape[0]
  fit = max(_BLOCK_ELEMENTS // max(row, 1), 1)
  return max(d for d in range(1, min(fit, x.shape[0]) + 1) if x.shape[0] % d == 0)


def _by_blocks(x: jax.Array, reduce_block, combine, init):
  """``reduce_block(block, first_row)`` over blocks of x's leading axis, combined into ``init``."""
  rows = _rows_per_block(x)
  if not rows or rows == x.shape[0]:
    return reduce_block(x, 0)

  def body(i, acc):
    return combine(acc, reduce_block(jax.lax.dynamic_slice_in_dim(x, i * rows, rows, 0), i * rows))

  return jax.lax.fori_loop(0, x.shape[0] // rows, body, init)


def _weighted_sum(bits: jax.Array, first: jax.Array | int) -> jax.Array:
  """sum_i w_{first + i} * bits_i mod 2**32 over the flat indices i of ``bits`` (``first``: flat index of its
  first element in the whole array)."""
  # w_i = 2 * K * i + 1 with i = first + sum_d iota_d * stride_d: one multiply-add per dimension, constants folded.
  weight = jnp.full(bits.shape, 1, jnp.uint32) + jnp.asarray(first, jnp.uint32) * np.uint32(2 * _GOLDEN % 2**32)
  stride = 1
  for dim in reversed(range(bits.ndim)):
    multiplier = np.uint32(2 * _GOLDEN * stride % 2**32)
    weight = weight + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * multiplier
    stride = stride * bits.shape[dim] % 2**32
  return jnp.sum(bits * weight, dtype=jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
  row = np.uint32(x.size // x.shape[0] % 2**32) if x.ndim else np.uint32(0)

  def block(b, first_row):
    return _weighted_sum(_bits(b), jnp.asarray(first_row, jnp.uint32) * row)

  return _by_blocks(x, block, jnp.add, jnp.uint32(0))


def _finite(x: jax.Array) -> jax.Array:
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.bool_(True)
  return _by_blocks(x, lambda b, _: jnp.all(jnp.isfinite(b)), jnp.logical_and, jnp.bool_(True))


def all_finite(tree: Any, shardings: Any = None, concatenate: bool | None = None) -> jax.Array:
  """One boolean: every floating-point element of ``tree`` is finite (traceable, for a jitted step). With the
  ``shardings`` of ``tree``'s leaves, each device reduces its own shards (in one fused pass on CPU) and the devices
  combine one scalar (a single psum); left to XLA, every array gets its own reduction and cross-device
  reduction, which on small models costs more than the check itself (tiny: ~75 extra fusions per step).
  Summing ``x * 0`` carries any NaN or infinity into that scalar. ``concatenate``: reduce the arrays as one
  (default: where the devices are CPUs, see below)."""
  leaves = jax.tree.leaves(tree)
  layouts = jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves)
  pairs = [(x, s) for x, s in zip(leaves, layouts, strict=True) if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not pairs:
    return jnp.bool_(True)
  xs = [x for x, _ in pairs]
  mesh = pairs[0][1].mesh if shardings is not None else None
  # One reduction over the arrays concatenated is one fused pass for XLA's CPU backend; the TPU compiler writes the
  # concatenation out instead (a float32 copy of the whole state: 2.8 GiB per chip for 8 Mixtral layers on v5p),
  # so there each array is reduced where it lies and the scalars are added.
  if concatenate is None:
    concatenate = mesh is None or mesh.devices.flat[0].platform == "cpu"

  def local_sum(*xs):
    if concatenate:
      return jnp.sum(jnp.concatenate([x.astype(jnp.float32).ravel() for x in xs]) * 0)
    return sum(jnp.sum(x.astype(jnp.float32) * 0) for x in xs)

  if mesh is None:
    return jnp.isfinite(local_sum(*xs))

  def per_device(*shards):
    return jax.lax.psum(local_sum(*shards), mesh.axis_names)

  total = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(s.spec for _, s in pairs), out_specs=P(),
                        check_vma=False)(*xs)
  return jnp.isfinite(total)


def summary(tree: Any) -> tuple[Any, Any]:
  """(fingerprint, finite) per array of ``tree``, as two pytrees of scalars (traceable). An array in host memory
  (an offloaded optimizer state, ``optim.offload_state``) is read on the device, a copy per array."""
  tree = jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)
  return jax.tree.map(_fingerprint, tree), jax.tree.map(_finite, tree)


def read(summarized: tuple[Any, Any]) -> tuple[dict[str, int], list[str]]:
  """``({array name: fingerprint}, [names of arrays with non-finite values])`` from a (fetched) summary.
  Names are paths like ``params/layers/attn/o/kernel``."""
  fingerprints, finite = jax.device_get(summarized)
  return ({k: int(v) for k, v in named(fingerprints).items()}, [k for k, ok in named(finite).items() if not ok])


_summary = jax.jit(summary)


def summarize(tree: Any) -> tuple[dict[str, int], list[str]]:
  """:func:`read` of :func:`summary`, computed now."""
  return read(_summary(tree))


def name(path) -> str:
  return jax.tree_util.keystr(path, simple=True, separator="/")


def named(tree: Any) -> dict[str, Any]:
  """``{'params/layers/attn/o/kernel': leaf, ...}``: the leaves of a pytree by path (the names checkpoints,
  fingerprints and error messages use)."""
  return {name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

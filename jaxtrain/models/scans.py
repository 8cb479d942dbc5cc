"""How the step's loops are traced: rolled (the normal program) or unrolled (for the compiler's cost model).

XLA's cost analysis counts a while loop's body once, whatever its trip count: the flops and bytes of a model whose
layers are a ``lax.scan`` come out as one layer's. ``tools/bench_tpu.py`` therefore compiles the step at 1 and 2
layers with every scan unrolled (layers, attention key blocks, microbatches) and extrapolates. Under
:func:`unrolled`, the scans this package writes unroll fully and remat keeps its recomputation
(``prevent_cse=True``: once unrolled, XLA would otherwise merge the backward pass's recomputation with the forward
pass, which the rolled program cannot do). Outside it, nothing changes.
"""

from __future__ import annotations

import contextlib

_STATE = {"unrolled": False}


@contextlib.contextmanager
def unrolled():
  """Within (while tracing): every scan of the model and the step unrolls, and remat is not CSE'd away."""
  previous, _STATE["unrolled"] = _STATE["unrolled"], True
  try:
    yield
  finally:
    _STATE["unrolled"] = previous


def unroll() -> bool | int:
  """``lax.scan``'s ``unroll`` argument for the step's loops."""
  return True if _STATE["unrolled"] else 1


def prevent_cse() -> bool:
  """``jax.checkpoint``'s ``prevent_cse`` for a layer inside a scan (False, the right choice in a rolled scan)."""
  return _STATE["unrolled"]

"""Materialization points that override the TPU compiler's fusion where it prices its own choice higher.

XLA fuses an elementwise producer into the matmul that reads it (and a matmul's elementwise consumers into its
output) to save a write and a read of the value. Inside the matmul that work is redone for every tile of the other
operand, and it decides the layout the value is written in. In a Llama layer on TPU the compiler's own estimate
(``tools/bench_tpu.py``) prices three of these fusions above writing the value once: the gated MLP's product
``activation(gate) * up`` fused into the down projection (forward) and its gradient into the gate's input
gradient (backward); the final RMSNorm's backward fused into the head's input gradient; and the gradient of the
attention kernel's output, which the output projection's gradient writes in a layout the kernel then copies twice
(benchmarks/NOTES.md, "The TPU step"). The models call these where they compile for TPU only: CPU and GPU keep
their compilers' fusions (not measured there). Each keeps the values it is given (an ``optimization_barrier``
rounds nothing), so the TPU program computes what the default one does (``tests/test_models.py``).
"""

from __future__ import annotations

import jax


def materialize(x):
  """``x`` as it is, written to memory: the compiler may not fuse its computation into its consumers, nor (in the
  backward pass) its cotangent's computation into theirs. A value-preserving ``optimization_barrier``."""
  return jax.lax.optimization_barrier(x)


@jax.custom_vjp
def cotangent_barrier(x):
  """The identity, whose cotangent is written to memory before the backward pass of ``x``'s producer reads it."""
  return x


def _forward(x):
  return x, None


def _backward(_, g):
  return (jax.lax.optimization_barrier(g),)


cotangent_barrier.defvjp(_forward, _backward)

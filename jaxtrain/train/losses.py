"""The token cross-entropy, computed in float32 from logits in the compute dtype.

optax's ``softmax_cross_entropy_with_integer_labels`` computes in the dtype of the logits it is given: bfloat16
logits would give a bfloat16 loss, and casting them to float32 first makes XLA keep a float32 copy of the
``[tokens, vocab]`` logits for the backward pass (Llama 3 8B at 8k tokens per chip: 4.2 GB, read and written
several times). :func:`cross_entropy` takes the logits in whatever dtype the head computed them, does its
arithmetic in float32 (optax's formula, in the same order: float32 logits give optax's values bitwise; programs
compiled for TPU take the normalizer from sums that fuse into the head's matmul instead, :func:`_windowed_sums`,
within float32 rounding for rows whose largest logit lies in [-100, 309]), keeps only
the logits themselves and one float32 per token (the log normalizer) for the backward pass, and returns the
logits' gradient in their own dtype, as the head's matmul consumes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models.attention import target_platform  # the platform the program is compiled for


@jax.custom_vjp
def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-token ``-log softmax(logits)[label]`` (float32, shape ``labels.shape``) for ``logits [..., vocab]``."""
  return _forward(logits, labels)[0]


def _forward(logits, labels):
  x = logits.astype(jnp.float32)
  # The log normalizer (one float32 per token: all the backward keeps besides the logits) and the label's logit,
  # picked by a comparison in a pass over the logits the normalizer makes anyway (a gather would be a pass of its
  # own, and from a float32 ``x`` would make XLA write all of ``x`` to memory for it).
  lse, label_logits = (_windowed_sums if target_platform() == "tpu" else _two_passes)(x, labels)
  return lse - label_logits, (logits, labels, lse)


def _two_passes(x, labels):
  """The maximum, then the sum of exponentials (and the label's logit) in a second pass: optax's arithmetic."""
  vocab = jax.lax.broadcasted_iota(labels.dtype, x.shape, x.ndim - 1)
  return jax.nn.logsumexp(x, axis=-1), jnp.sum(jnp.where(vocab == labels[..., None], x, 0.0), axis=-1)


# The shifts of :func:`_windowed_sums`: 136 apart, so that when one window's sum overflows the next one up holds the
# row's largest logit within 60 of its shift (see there).
SHIFTS = (-40.0, 96.0, 232.0)


def _windowed_sums(x, labels):
  """The log normalizer and the label's logit from sums alone: for each shift c in :data:`SHIFTS`, ``sum(exp(x -
  c))`` over the row, and the normalizer ``c + log(sum)`` from the lowest shift whose sum did not overflow.

  Why sums: the TPU compiler fuses a row reduction that is a plain sum into the output of the matmul that writes
  the logits (the head's), where it costs nothing more than the matmul; a maximum, or a running (maximum, sum) pair,
  it computes in a pass of its own over the ``[tokens, vocab]`` logits (Llama 3 8B at 8k tokens a chip: 2.1 GB,
  0.87 ms of the whole step on v5p-128 by the compiler's estimate, docs/benchmarks.md).

  Range: the lowest shift whose sum is finite is taken. The window below it overflowed, so (a vocab under 2^18
  terms of at most exp(m - c) each) the row's largest logit m lies above that shift + 76.7, that is above this
  window's shift - 60: the terms flushed to zero (below exp(-87.3)) add up to under 4e-7 of the sum. The lowest
  window has none below it and is exact while m >= -100; the highest may overflow from m = 309 on. So a row whose
  largest logit lies in [-100, 309] gets logsumexp's normalizer within float32 rounding; beyond, the loss is not
  finite and the step is skipped as non-finite (jaxtrain.train.step), as for a NaN or infinite logit anywhere. Each
  shift adds one exponential an element to the matmul's output; the compiler's estimate prices each at 0.005 ms.
  """
  vocab = jax.lax.broadcasted_iota(labels.dtype, x.shape, x.ndim - 1)
  label_logits = jnp.sum(jnp.where(vocab == labels[..., None], x, 0.0), axis=-1)
  lse = None
  for shift in reversed(SHIFTS):  # the highest first, so that the lowest finite one is chosen last
    total = jnp.sum(jnp.exp(x - shift), axis=-1)
    this = shift + jnp.log(total)
    lse = this if lse is None else jnp.where(total < jnp.inf, this, lse)
  return lse, label_logits


def _backward(residuals, g):
  logits, labels, lse = residuals
  probabilities = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
  vocab = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1)  # (no one-hot array to write)
  d_logits = jnp.where(vocab == labels[..., None], probabilities - 1.0, probabilities) * g[..., None]
  return d_logits.astype(logits.dtype), None


cross_entropy.defvjp(_forward, _backward)

"""The token cross-entropy, computed in float32 from logits in the compute dtype, and its log normalizer.

optax's ``softmax_cross_entropy_with_integer_labels`` computes in the dtype of the logits it is given: bfloat16
logits would give a bfloat16 loss, and casting them to float32 first makes XLA keep a float32 copy of the
``[tokens, vocab]`` logits for the backward pass (Llama 3 8B at 8k tokens per chip: 4.2 GB, read and written
several times). :func:`cross_entropy` takes the logits in whatever dtype the head computed them, does its
arithmetic in float32 (optax's formula, in the same order: float32 logits give optax's values bitwise), keeps only
the logits themselves and one float32 per token (the log normalizer) for the backward pass, and returns the
logits' gradient in their own dtype, as the head's matmul consumes it.

One arithmetic on every platform: the row's maximum, then the sum of exponentials shifted by it (logsumexp's
two passes). That is exact to float32 rounding for every finite logit, whatever the row's magnitude (a row whose
largest logit is 1e4 or -1e4 included), and every probability the backward pass computes from it is at most 1, so
a row the loss mask drops (its cotangent 0) gets a zero gradient whatever its logits. (Programs for TPU took the
normalizer from sums over three fixed shifts once, fused into the head's matmul: 0.87 ms of Llama 3 8B's 1.22 s
step by the compiler's estimate, exact only while a row's largest logit lay in [-100, 309]; not worth a loss that
is wrong, or a step skipped, outside: benchmarks/NOTES.md.)

:func:`cross_entropy_and_log_normalizer` also returns the log normalizer ``log Z`` with its gradient (softmax), for
an output z-loss (``train.z_loss_weight``, jaxtrain.train.step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-token ``-log softmax(logits)[label]`` (float32, shape ``labels.shape``) for ``logits [..., vocab]``."""
  return _forward(logits, labels)[0]


@jax.custom_vjp
def cross_entropy_and_log_normalizer(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(cross_entropy(logits, labels), logsumexp(logits))``, both float32 per token; the second's gradient is the
  softmax. The same forward pass as :func:`cross_entropy` (the normalizer is computed for the loss anyway)."""
  loss, (_, _, lse) = _forward(logits, labels)
  return loss, lse


def _forward(logits, labels):
  x = logits.astype(jnp.float32)
  # The log normalizer (one float32 per token: all the backward keeps besides the logits) and the label's logit,
  # picked by a comparison in the pass over the logits the normalizer makes anyway (a gather would be a pass of its
  # own, and from a float32 ``x`` would make XLA write all of ``x`` to memory for it).
  vocab = jax.lax.broadcasted_iota(labels.dtype, x.shape, x.ndim - 1)
  lse = jax.nn.logsumexp(x, axis=-1)
  label_logits = jnp.sum(jnp.where(vocab == labels[..., None], x, 0.0), axis=-1)
  return lse - label_logits, (logits, labels, lse)


def _probabilities(residuals):
  logits, labels, lse = residuals
  vocab = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1)  # (no one-hot array to write)
  return jnp.exp(logits.astype(jnp.float32) - lse[..., None]), vocab == labels[..., None]


def _backward(residuals, g):
  probabilities, is_label = _probabilities(residuals)
  d_logits = jnp.where(is_label, probabilities - 1.0, probabilities) * g[..., None]
  return d_logits.astype(residuals[0].dtype), None


def _forward_with_normalizer(logits, labels):
  loss, residuals = _forward(logits, labels)
  return (loss, residuals[2]), residuals


def _backward_with_normalizer(residuals, cotangents):
  g_loss, g_lse = (c[..., None] for c in cotangents)
  probabilities, is_label = _probabilities(residuals)
  weighted = probabilities * (g_loss + g_lse)  # d loss = softmax - one-hot, d log Z = softmax
  d_logits = jnp.where(is_label, weighted - g_loss, weighted)
  return d_logits.astype(residuals[0].dtype), None


cross_entropy.defvjp(_forward, _backward)
cross_entropy_and_log_normalizer.defvjp(_forward_with_normalizer, _backward_with_normalizer)

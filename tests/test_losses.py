"""The token cross-entropy (jaxtrain.train.losses): optax's values and gradients, float32 math on bfloat16 logits
without a float32 copy kept for the backward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxtrain.train.losses import cross_entropy


def _case(dtype):
  logits = jax.random.normal(jax.random.key(0), (3, 5, 97), jnp.float32) * 4
  labels = jax.random.randint(jax.random.key(1), (3, 5), 0, 97)
  return logits.astype(dtype), labels


def test_float32_logits_give_optax_values_bitwise_and_its_gradient():
  logits, labels = _case(jnp.float32)
  np.testing.assert_array_equal(cross_entropy(logits, labels),
                                optax.softmax_cross_entropy_with_integer_labels(logits, labels))
  weights = jnp.linspace(0.5, 2.0, 15).reshape(3, 5)  # a weighted sum, as the step's loss mask makes it
  ours = jax.grad(lambda x: jnp.sum(cross_entropy(x, labels) * weights))(logits)
  reference = jax.grad(lambda x: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, labels) * weights))(logits)
  np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-7)


def test_bfloat16_logits_are_computed_in_float32_and_their_gradient_stays_bfloat16():
  logits, labels = _case(jnp.bfloat16)
  loss = cross_entropy(logits, labels)
  assert loss.dtype == jnp.float32
  # Equal to optax on the same values in float32 (bfloat16 inputs, exact in float32), not on bfloat16 arithmetic.
  np.testing.assert_array_equal(loss, optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                                      labels))
  grad = jax.grad(lambda x: jnp.sum(cross_entropy(x, labels)))(logits)
  reference = jax.grad(lambda x: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, labels)))(
      logits.astype(jnp.float32))
  assert grad.dtype == jnp.bfloat16
  np.testing.assert_array_equal(grad, reference.astype(jnp.bfloat16))


def test_the_windowed_sums_of_tpu_programs_equal_optax_within_float32_rounding_over_their_range():
  """Programs compiled for TPU take the normalizer from sums alone (one per shift, the lowest finite one chosen):
  optax's loss and gradient within float32 rounding for rows whose largest logit lies in [-100, 309] (each window
  exercised, its edges included; -inf logits, an all -inf row), a non-finite loss beyond; the traced program has
  sums only (no maximum, no variadic reduction), which the TPU compiler fuses into the head's matmul."""
  from jaxtrain.models import attention
  from jaxtrain.train import losses
  logits, labels = _case(jnp.float32)
  logits = logits - jnp.max(logits, axis=-1, keepdims=True)  # every row's largest logit at 0, then placed:
  tops = jnp.array([[0.0, 0.0, 30.0, 37.0, 40.0], [100.0, 172.0, 174.0, 240.0, 308.0],
                    [-99.0, -60.0, 5.0, 420.0, -300.0]])
  logits = (logits + tops[..., None]).at[0, 0, :50].set(-jnp.inf).at[0, 1].set(-jnp.inf)
  labels = labels.at[0, 0].set(60)  # a finite label in the partly -inf row
  weights = jnp.linspace(0.5, 2.0, 15).reshape(3, 5)
  reference = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  in_range = np.isfinite(reference) & (np.abs(np.asarray(tops) - 104.5) <= 204.5)
  assert in_range.sum() == 12  # all but the all -inf row, the row at 420 and the row at -300

  def loss(x):
    per_token = cross_entropy(x, labels)
    return jnp.sum(jnp.where(jnp.asarray(in_range), per_token * weights, 0.0))

  two_passes, two_grad = cross_entropy(logits, labels), jax.grad(loss)(logits)
  with attention.compiling_for("tpu"):
    windowed, windowed_grad = cross_entropy(logits, labels), jax.grad(loss)(logits)
    primitives = {e.primitive.name for e in jax.make_jaxpr(cross_entropy)(logits, labels).jaxpr.eqns[0].params[
        "call_jaxpr"].jaxpr.eqns}
  assert "reduce_sum" in primitives and not {"reduce_max", "reduce"} & primitives
  np.testing.assert_array_equal(two_passes, reference)
  # Float32 rounding of a normalizer near 300 is 2e-5 in absolute terms (in both), and in relative terms of the
  # probabilities in the gradient.
  np.testing.assert_allclose(windowed[in_range], reference[in_range], rtol=2e-6, atol=4e-5)
  np.testing.assert_allclose(windowed_grad[in_range], two_grad[in_range], rtol=6e-5, atol=1e-7)
  assert not np.isfinite(windowed[2, 3]) and not np.isfinite(windowed[2, 4])  # beyond the range: not finite
  assert len(losses.SHIFTS) == 3

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


def test_the_one_pass_normalizer_of_tpu_programs_equals_optax_within_float32_rounding():
  """Programs compiled for TPU reduce the logits once (running maximum, rescaled sum, label's logit): optax's loss
  and gradient within float32 rounding, -inf logits, an all -inf row and logits far from 0 included; the traced
  program has the one variadic reduction and no separate maximum."""
  from jaxtrain.models import attention
  logits, labels = _case(jnp.float32)
  logits = logits.at[0, 0, :50].set(-jnp.inf).at[0, 1].set(-jnp.inf).at[1].add(1e4)
  labels = labels.at[0, 0].set(60)  # a finite label in the partly -inf row
  weights = jnp.linspace(0.5, 2.0, 15).reshape(3, 5)

  def loss(x):
    return jnp.sum(jnp.where(jnp.isfinite(cross_entropy(x, labels)), cross_entropy(x, labels) * weights, 0.0))

  two_passes, two_grad = cross_entropy(logits, labels), jax.grad(loss)(logits)
  with attention.compiling_for("tpu"):
    one_pass, one_grad = cross_entropy(logits, labels), jax.grad(loss)(logits)
    primitives = {e.primitive.name for e in jax.make_jaxpr(cross_entropy)(logits, labels).jaxpr.eqns[0].params[
        "call_jaxpr"].jaxpr.eqns}
  assert "reduce" in primitives and "reduce_max" not in primitives
  reference = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  np.testing.assert_array_equal(two_passes, reference)
  # The all -inf row is NaN in both (-inf - -inf), like optax's; every other loss is finite and equal.
  np.testing.assert_array_equal(np.isfinite(one_pass), np.isfinite(reference))
  assert np.isfinite(reference).sum() == 14
  finite = np.isfinite(reference)
  np.testing.assert_allclose(one_pass[finite], reference[finite], rtol=2e-6)
  np.testing.assert_allclose(one_grad, two_grad, rtol=1e-6, atol=1e-7)

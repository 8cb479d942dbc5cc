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

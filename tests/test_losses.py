"""The token cross-entropy (jaxtrain.train.losses) and the step's use of it: optax's values and gradients, exact for
every finite logit on every platform's program, masked tokens that can never make a step non-finite, and the
output z-loss."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import data as data_lib
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.models import attention
from jaxtrain.train import trainer
from jaxtrain.train.losses import cross_entropy, cross_entropy_and_log_normalizer

# The default program (this platform's) and the one compiled for TPU (what a TPU runs, traced here on CPU).
PROGRAMS = ("default", "tpu")


def _program(name):
  return attention.compiling_for("tpu") if name == "tpu" else contextlib.nullcontext()


def _case(dtype):
  logits = jax.random.normal(jax.random.key(0), (3, 5, 97), jnp.float32) * 4
  labels = jax.random.randint(jax.random.key(1), (3, 5), 0, 97)
  return logits.astype(dtype), labels


@pytest.mark.parametrize("program", PROGRAMS)
def test_float32_logits_give_optax_values_bitwise_and_its_gradient(program):
  logits, labels = _case(jnp.float32)
  weights = jnp.linspace(0.5, 2.0, 15).reshape(3, 5)  # a weighted sum, as the step's loss mask makes it
  with _program(program):
    loss = jax.jit(lambda x: cross_entropy(x, labels))(logits)
    ours = jax.jit(jax.grad(lambda x: jnp.sum(cross_entropy(x, labels) * weights)))(logits)
  np.testing.assert_array_equal(loss, optax.softmax_cross_entropy_with_integer_labels(logits, labels))
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


# Each row's largest logit. Below -87 a float32 exponential is subnormal (flushed to zero on TPU), above 88 it
# overflows: an arithmetic that exponentiates unshifted or fixed-shifted logits loses those rows.
TOPS = (-1e4, -120.0, -100.0, 0.0, 309.0, 400.0, 1e4)
# Masked rows (the loss mask's zeros: padding, prompts) at the extremes: +-1e4, and the largest float32 (a finite
# row whose loss overflows to inf: log Z = 3.4e38 and a label logit of -3.4e38).
MASKED_TOPS = (1e4, -1e4, float(np.finfo(np.float32).max))


def _extreme_rows(vocab: int, seed: int = 0):
  """``(logits [rows, vocab] float32, labels [rows], real [rows])``: the :data:`TOPS` rows (real) and the
  :data:`MASKED_TOPS` rows (masked). Below its largest logit a row spreads: most logits within a few tens of it
  (they make the normalizer), 1% from 100 to 20,000 below; the labels alternate between the largest logit and a
  random one."""
  rng = np.random.default_rng(seed)
  tops = np.array(TOPS + MASKED_TOPS[:2])
  spread = np.where(rng.random((len(tops), vocab)) < 0.01, rng.uniform(100, 2e4, (len(tops), vocab)),
                    rng.exponential(6.0, (len(tops), vocab)))
  logits = (tops[:, None] - spread).astype(np.float32)
  argmax = rng.integers(0, vocab, len(tops))
  logits[np.arange(len(tops)), argmax] = tops
  labels = np.where(np.arange(len(tops)) % 2 == 0, argmax, rng.integers(0, vocab, len(tops)))
  big = np.finfo(np.float32).max  # the last masked row: +-max, label on a -max logit
  huge = np.where(np.arange(vocab) % 2 == 0, big, -big).astype(np.float32)[None]
  logits, labels = np.concatenate([logits, huge]), np.append(labels, 1)
  real = np.arange(len(logits)) < len(TOPS)
  return jnp.asarray(logits), jnp.asarray(labels, jnp.int32), jnp.asarray(real)


def _float64_reference(logits, labels):
  """``(loss, gradient of the loss, log Z)`` per row in float64 numpy: logsumexp, softmax - one-hot."""
  x = np.asarray(logits, np.float64)
  top = x.max(-1, keepdims=True)
  log_z = top[:, 0] + np.log(np.exp(x - top).sum(-1))
  rows = np.arange(len(x))
  gradient = np.exp(x - log_z[:, None])
  gradient[rows, np.asarray(labels)] -= 1.0
  return log_z - x[rows, np.asarray(labels)], gradient, log_z


@pytest.mark.parametrize("vocab", [2**17, 2**18])
@pytest.mark.parametrize("program", PROGRAMS)
def test_the_loss_is_exact_for_every_finite_logit_and_masked_rows_get_zero_gradients(program, vocab):
  """Rows whose largest logit is anywhere in [-1e4, 1e4], in both programs: the loss equals a float64 logsumexp's
  within float32 rounding, the gradient the float64 softmax minus one-hot's; rows the loss mask drops (selected
  away as the step does) add nothing and get an exactly zero, finite gradient, the largest float32 logits
  included.

  Float32 rounding here: a logit of magnitude m is itself known to half a unit in the last place (m x 6e-8), so a
  loss computed from it carries a few of those, and every probability that relative error: the tolerances are 4
  units of m's last place, plus a vocabulary's sum of float32 roundings (1e-5 of the normalizer)."""
  logits, labels, real = _extreme_rows(vocab)
  expected, expected_gradient, _ = _float64_reference(logits, labels)

  def objective(x):  # the step's sum over the loss mask: masked rows selected away, never multiplied by 0
    return jnp.sum(jnp.where(real, cross_entropy(x, labels), 0.0))

  with _program(program):
    loss = jax.jit(lambda x: cross_entropy(x, labels))(logits)
    value, gradient = jax.jit(jax.value_and_grad(objective))(logits)
  loss, gradient, real = np.asarray(loss), np.asarray(gradient), np.asarray(real)
  magnitude = np.maximum(np.abs(np.array(TOPS + MASKED_TOPS[:2] + (0.0,))), 1.0)  # (the +-max row: not compared)
  unit = 4 * np.finfo(np.float32).eps * magnitude  # 4 units in the last place of the row's largest logit
  finite_rows = np.arange(len(loss)) < len(TOPS) + 2  # all but the +-max row (its exact loss is 6.8e38: inf)
  error = np.abs(loss - expected)[finite_rows]
  assert np.all(error <= unit[finite_rows] + 1e-5), dict(zip(np.array(TOPS + MASKED_TOPS[:2]), error))
  assert np.isfinite(value) and abs(value - expected[real].sum()) <= np.sum(unit[real] + 1e-5)
  assert np.all(np.isfinite(gradient))
  np.testing.assert_array_equal(gradient[~real], 0.0)
  probabilities = expected_gradient.copy()
  probabilities[np.arange(len(labels)), np.asarray(labels)] += 1.0
  for row in np.flatnonzero(real):
    # (each probability's error, the float32 rounding of the difference itself, p - 1 near -1, and probabilities
    # below float32's smallest normal number, 1.2e-38, which TPUs flush to zero)
    f32 = np.finfo(np.float32)
    tolerance = probabilities[row] * (unit[row] + 1e-5) + f32.eps * np.abs(expected_gradient[row]) + f32.tiny
    worst = np.max(np.abs(gradient[row] - expected_gradient[row]) - tolerance)
    assert worst <= 0, f"largest logit {TOPS[row]}: gradient off by {worst:.3g} beyond float32 rounding"


# Marker input ids for the step test: a position whose input is one of these gets its logits pushed to an extreme
# (real inputs avoid them), and its target is masked.
HIGH, LOW, LARGEST = 253, 254, 255


def _push_masked_logits(monkeypatch):
  """Makes the Llama's logits at positions whose input is a marker id extreme: HIGH rows +-1e4 (alternating over
  the vocabulary), LOW rows -1e4 throughout, LARGEST rows +-3.4e38; other positions' logits plus 0 (unchanged)."""
  from jaxtrain.models import llama
  original = llama.Llama.__call__

  def pushed(self, tokens, positions, segment_ids, cache=None):
    logits = original(self, tokens, positions, segment_ids, cache)
    sign = jnp.where(jnp.arange(logits.shape[-1]) % 2 == 0, 1.0, -1.0)
    big = float(np.finfo(np.float32).max)
    offset = jnp.select([tokens[..., None] == HIGH, tokens[..., None] == LOW, tokens[..., None] == LARGEST],
                        [1e4 * sign, jnp.full_like(sign, -1e4), big * sign], 0.0)
    return jnp.where(tokens[..., None] == LARGEST, offset, logits + offset).astype(logits.dtype)

  monkeypatch.setattr(llama.Llama, "__call__", pushed)


def _step(config, batch, program="default", devices=None):
  """One compiled train step from the initial state: (metrics, params) on the host."""
  run = trainer.build(config, devices)
  with _program(program):
    step = trainer.compile_step(run)
  state, metrics = step(trainer.init_state(run), data_lib.to_global(batch, run.batch_sharding), np.bool_(False))
  return jax.device_get(metrics), jax.device_get(state.params)


@pytest.mark.parametrize("program", PROGRAMS)
def test_masked_tokens_at_extreme_logits_never_make_the_train_step_non_finite(make_config, monkeypatch, program):
  """Padding and prompt tokens whose logits are at +-1e4, or at the largest float32 (a loss of inf), in the whole
  compiled train step of both programs: the step is finite and applied, and its loss, gradient norm and updated
  params are those of the same batch with those tokens' logits left alone (their gradient is exactly 0)."""
  config = make_config(fsdp=8)
  config.model.attention = "xla"  # (the TPU program on CPU: not splash's interpreter)
  batch = next(SyntheticSource(32, 256, 16, seed=1))
  batch["inputs"] %= HIGH  # no real input is a marker
  for row, marker in enumerate((HIGH, LOW, LARGEST, HIGH)):
    batch["inputs"][row, 8:20] = marker
    batch["loss_mask"][row, 8:20] = 0
    batch["targets"][row, 8:20] = 1  # an odd id: -3.4e38 on LARGEST rows
  plain, plain_params = _step(config, batch, program)
  _push_masked_logits(monkeypatch)
  metrics, params = _step(config, batch, program)
  assert metrics["nonfinite"] == 0 and metrics["skipped"] == 0, metrics
  assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
  assert metrics["tokens"] == 16 * 32 - 4 * 12
  np.testing.assert_allclose(metrics["loss"], plain["loss"], rtol=1e-6)
  np.testing.assert_allclose(metrics["grad_norm"], plain["grad_norm"], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), params, plain_params)


def test_the_log_normalizer_and_its_gradient_equal_logsumexps():
  """cross_entropy_and_log_normalizer: optax's loss and jax.nn.logsumexp's log Z, and the gradient of any
  combination of the two (the z-loss's ``log Z^2`` included) equal to autodiff through optax and logsumexp; bfloat16
  logits get a bfloat16 gradient."""
  logits, labels = _case(jnp.float32)
  loss, log_z = cross_entropy_and_log_normalizer(logits, labels)
  np.testing.assert_array_equal(loss, cross_entropy(logits, labels))
  np.testing.assert_allclose(log_z, jax.nn.logsumexp(logits, axis=-1), rtol=1e-6)
  weights = jnp.linspace(0.5, 2.0, 15).reshape(3, 5)

  def combined(pair):  # different weights on the loss, log Z and log Z^2: both cotangents exercised
    loss, log_z = pair
    return jnp.sum(weights * loss + 0.3 * log_z + 0.05 * weights * log_z ** 2)

  ours = jax.grad(lambda x: combined(cross_entropy_and_log_normalizer(x, labels)))(logits)
  reference = jax.grad(lambda x: combined((optax.softmax_cross_entropy_with_integer_labels(x, labels),
                                           jax.nn.logsumexp(x, axis=-1))))(logits)
  np.testing.assert_allclose(ours, reference, rtol=2e-5, atol=1e-6)
  half = jax.grad(lambda x: combined(cross_entropy_and_log_normalizer(x, labels)))(logits.astype(jnp.bfloat16))
  assert half.dtype == jnp.bfloat16


def _z_loss_batch():
  batch = next(SyntheticSource(32, 256, 16, seed=2))
  batch["loss_mask"][:5, 20:] = 0  # unequal real-token counts per microbatch
  return batch


def test_the_z_loss_equals_an_independent_computation(make_config):
  """train.z_loss_weight w: the step's objective is the mean cross-entropy plus w x the mean (log Z)^2 over the real
  target tokens, computed here from the model's logits in float64 (the metrics ``loss`` and ``z_loss``) and by
  autodiff through optax and logsumexp (the gradient's norm); with w = 0 there is no ``z_loss`` metric and the
  gradient is the cross-entropy's alone."""
  from jaxtrain import sharding
  batch, weight = _z_loss_batch(), 0.05
  config = make_config(fsdp=8)
  config.train.z_loss_weight = weight
  metrics, _ = _step(config, batch)
  run = trainer.build(config)
  params = trainer.init_state(run).params
  mask = batch["loss_mask"] > 0

  def objective(params, w):
    logits = run.model.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    log_z = jax.nn.logsumexp(logits, axis=-1)
    return (jnp.sum(jnp.where(mask, ce, 0.0)) + w * jnp.sum(jnp.where(mask, log_z ** 2, 0.0))) / mask.sum(), logits

  with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
    (_, logits), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(params, weight)
    without = jax.jit(jax.grad(lambda p: objective(p, 0.0)[0]))(params)
  expected_loss, _, log_z = _float64_reference(np.asarray(logits).reshape(-1, 256), batch["targets"].reshape(-1))
  real = mask.reshape(-1)
  np.testing.assert_allclose(metrics["loss"], expected_loss[real].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["z_loss"], np.mean(log_z[real] ** 2), rtol=1e-5)
  assert metrics["z_loss"] > 1.0  # (log Z of an untrained model: about log 256, so the term is not negligible)
  np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-4)
  assert abs(optax.tree.norm(grads) / optax.tree.norm(without) - 1) > 1e-2  # the term moves the gradient
  config.train.z_loss_weight = 0.0
  off, _ = _step(config, batch)
  assert "z_loss" not in off
  np.testing.assert_allclose(off["grad_norm"], optax.tree.norm(without), rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["microbatches", "pipeline"])
def test_the_z_loss_is_the_same_over_microbatches_and_pipeline_stages(make_config, layout):
  """The z-loss's sums are accumulated like the cross-entropy's: over 4 microbatches one after the other, or flowing
  through 2 pipeline stages (each stage's head computes it for its chunks), the loss, the z-loss, the gradient norm
  and the updated params equal one batch's."""
  batch = _z_loss_batch()
  one = make_config(fsdp=2)
  one.train.z_loss_weight = 0.05
  split = make_config(fsdp=2) if layout == "microbatches" else make_config(pipeline=2)
  split.train.update(z_loss_weight=0.05, microbatches=4)
  devices = jax.devices()[:2]
  reference, reference_params = _step(one, batch, devices=devices)
  metrics, params = _step(split, batch, devices=devices)
  for key in ("loss", "z_loss", "grad_norm"):
    np.testing.assert_allclose(metrics[key], reference[key], rtol=1e-5, err_msg=key)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params, reference_params)


def test_a_negative_z_loss_weight_is_one_readable_config_error(make_config):
  from jaxtrain import config as config_lib
  config = make_config()
  config.train.z_loss_weight = -1e-4
  with pytest.raises(config_lib.ConfigError, match=r"train\.z_loss_weight: must be >= 0, got -0\.0001"):
    config_lib.validate_values(config)

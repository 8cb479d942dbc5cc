"""Loss scaling for float16 compute (``optim.loss_scale``): the loss is multiplied by a scale before the backward
pass, so that the small gradients of float16 activations stay above float16's smallest normal number (6.1e-5; below
it they lose precision, below 6e-8 they are 0), and the gradients are divided by it after. ``dynamic``: the scale
doubles after ``optim.loss_scale_period`` finite steps in a row and halves (to at least 1) on a step whose
gradients overflow, which is skipped; a number: that scale, always, and a step whose gradients overflow at it is a
non-finite step for the NaN policy (``monitor.nan_policy``), since a scale that never moves overflows again on the
next batch like it; ``none``: no scaling (bfloat16 and float32 need none).

The scale is optimizer state (:class:`LossScaleState`, the outermost layer of the run's optimizer): it is saved in
every checkpoint and restored with it, laid out (replicated) like any scalar state, and a resumed run goes on with
the scale it had. The step (jaxtrain.train.step) reads it, scales, unscales and asks :meth:`LossScaled.adjust`
for the next one; :func:`jaxtrain.train.step.apply_update` keeps an overflowing step's params and optimizer state.

(``jmp`` computes the same arithmetic, but its ``DynamicLossScale`` pytree does not carry its minimum through a
flatten, and its leaves have no names a checkpoint can hold; optax has no loss scaling. The rule is these few
lines.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.errors import ConfigError

MODES = ("none", "dynamic")


class LossScaleState(NamedTuple):
  """The optimizer state of a loss-scaled optimizer."""
  scale: jax.Array  # float32: what the step multiplies the loss by
  good_steps: jax.Array  # int32: finite steps since the scale last changed
  inner: Any  # the wrapped optimizer's state


class LossScaled(NamedTuple):
  """An optax GradientTransformation (``init``, ``update``: the wrapped optimizer's, its state inside a
  :class:`LossScaleState`) that also says how the scale moves (``adjust``)."""
  init: Any
  update: Any
  adjust: Any  # (LossScaleState, grads finite: bool array) -> LossScaleState
  dynamic: bool  # whether the scale moves (``dynamic``): an overflow is then the scaler's to handle


def parse(value) -> tuple[str, float]:
  """``optim.loss_scale`` as ``(mode, initial scale)``: ``("none", 1)``, ``("dynamic", 2^15)`` or ``("static",
  x)``. ConfigError if it is none of those."""
  text = str(value).strip().lower()
  if text in MODES:
    return text, 2.0 ** 15 if text == "dynamic" else 1.0
  try:
    scale = float(text)
  except ValueError:
    scale = 0.0
  if not scale > 0 or scale != scale or scale == float("inf"):
    raise ConfigError("optim.loss_scale", f"'{value}' is not none, dynamic or a positive number",
                      "set --config.optim.loss_scale=dynamic (float16), or none")
  return "static", scale


def wrap(tx: optax.GradientTransformation, value, initial: float, period: int) -> optax.GradientTransformation:
  """``tx`` scaled by ``optim.loss_scale`` (``value``): ``tx`` itself for ``none``; ``initial``: a dynamic scale's
  start."""
  mode, scale = parse(value)
  if mode == "none":
    return tx
  if mode == "dynamic":
    scale = initial

  def init(params):
    return LossScaleState(jnp.asarray(scale, jnp.float32), jnp.zeros((), jnp.int32), tx.init(params))

  def update(updates, state, params=None):
    updates, inner = tx.update(updates, state.inner, params)
    return updates, state._replace(inner=inner)

  update.elementwise = getattr(tx.update, "elementwise", False)  # (jaxtrain.optim.elementwise)

  def adjust(state: LossScaleState, finite: jax.Array) -> LossScaleState:
    if mode == "static":
      return state
    grown = state.good_steps + 1 >= period
    doubled = state.scale * 2.0
    up = jnp.where(grown & jnp.isfinite(doubled), doubled, state.scale)
    scale = jnp.where(finite, up, jnp.maximum(state.scale / 2.0, 1.0))
    good = jnp.where(finite & ~grown, state.good_steps + 1, 0)
    return state._replace(scale=scale, good_steps=good.astype(jnp.int32))

  return LossScaled(init, update, adjust, mode == "dynamic")

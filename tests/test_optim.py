"""The optimizer built from config: schedules, weight-decay mask, clipping."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import optim
from jaxtrain.config import base_config


def _cfg(**kw):
  c = base_config().optim
  c.update({"lr": 1.0, "warmup_steps": 10, "end_lr_ratio": 0.1, **kw})
  return c


def _after_warmup(schedule, t):
  """The documented lr t steps into the 100-step decay from lr=1 to end_lr_ratio=0.1."""
  frac = min(t, 100) / 100
  if schedule == "cosine":
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
  if schedule == "linear":
    return 1.0 - 0.9 * frac
  return 1.0


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_schedules(schedule, caplog):
  with caplog.at_level("INFO"):  # a valid config builds its schedule without a word from optax
    unwarmed = optim.schedule(_cfg(schedule=schedule, warmup_steps=0, wsd_decay_fraction=0.0), train_steps=100)
    optim.schedule(_cfg(schedule="wsd", wsd_decay_fraction=0.0), train_steps=100)
  assert not [r.getMessage() for r in caplog.records if "transition_steps" in r.getMessage()]
  for step in [0, 25, 50, 100, 140]:
    assert float(unwarmed(step)) == pytest.approx(_after_warmup(schedule, step), abs=1e-6), step
  lr = optim.schedule(_cfg(schedule=schedule), train_steps=110)
  for step, want in [(0, 0.0), (3, 0.3), (5, 0.5), (10, 1.0)]:  # linear warmup over 10 steps
    assert float(lr(step)) == pytest.approx(want, abs=1e-6), step
  # Quarter points tell cosine (0.868, 0.232) from linear (0.775, 0.325); the midpoint (0.55) does not.
  for step in [35, 60, 85, 110, 150]:
    assert float(lr(step)) == pytest.approx(_after_warmup(schedule, step - 10), abs=1e-6), step
  if schedule != "constant":
    assert float(lr(35)) == pytest.approx({"cosine": 0.86819805, "linear": 0.775}[schedule], abs=1e-6)


def test_decay_steps_sets_the_horizon():
  """optim.decay_steps, not train.steps, is where the decay ends (counted from step 0, warmup included)."""
  lr = optim.schedule(_cfg(schedule="cosine", decay_steps=60), train_steps=1000)
  for step in [10, 20, 35, 50, 60, 500]:  # the decay runs over steps 10..60
    frac = min(step - 10, 50) / 50
    assert float(lr(step)) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * frac)), abs=1e-6), step


def test_weight_decay_skips_norms():
  params = {"layers": {"attn_norm": {"scale": jnp.ones((2, 4))}, "mlp": {"up": {"kernel": jnp.ones((2, 4, 4))}}},
            "embed": {"embedding": jnp.ones((8, 4))}}
  mask = optim.decay_mask(params)
  assert mask == {"layers": {"attn_norm": {"scale": False}, "mlp": {"up": {"kernel": True}}},
                  "embed": {"embedding": True}}
  tx = optim.make(_cfg(schedule="constant", warmup_steps=0, weight_decay=0.5, clip_norm=0.0), 10)
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero_grads, tx.init(params), params)
  assert float(jnp.abs(updates["layers"]["attn_norm"]["scale"]).max()) == 0.0
  np.testing.assert_allclose(updates["embed"]["embedding"], -0.5 * params["embed"]["embedding"])


def test_clipping_rescales_gradients_to_clip_norm():
  # With a large Adam eps the update depends on the gradient's scale, so clipping is visible in it.
  params = {"w": jnp.zeros((4,))}
  grads = {"w": jnp.array([30.0, -40.0, 0.0, 0.0])}  # global norm 50
  base = dict(schedule="constant", warmup_steps=0, weight_decay=0.0, eps=1.0)
  clipped = optim.make(_cfg(clip_norm=2.0, **base), 10)
  unclipped = optim.make(_cfg(clip_norm=0.0, **base), 10)
  u_clip, _ = clipped.update(grads, clipped.init(params), params)
  u_ref, _ = unclipped.update({"w": grads["w"] * 2.0 / 50.0}, unclipped.init(params), params)
  u_raw, _ = unclipped.update(grads, unclipped.init(params), params)
  np.testing.assert_allclose(u_clip["w"], u_ref["w"], rtol=1e-6)
  assert not np.allclose(u_clip["w"], u_raw["w"])

"""The optimizer built from config: schedules, weight-decay mask, clipping."""

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


@pytest.mark.parametrize("schedule,mid,end", [("cosine", 0.55, 0.1), ("linear", 0.55, 0.1),
                                              ("constant", 1.0, 1.0)])
def test_schedules(schedule, mid, end):
  lr = optim.schedule(_cfg(schedule=schedule), train_steps=110)
  assert float(lr(0)) == 0.0
  assert float(lr(5)) == pytest.approx(0.5)
  assert float(lr(10)) == pytest.approx(1.0)
  assert float(lr(60)) == pytest.approx(mid, abs=1e-6)
  assert float(lr(110)) == pytest.approx(end, abs=1e-6)


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

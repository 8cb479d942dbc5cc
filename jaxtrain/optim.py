"""The optax optimizer from the ``optim`` config group: AdamW, warmup + decay schedule, clipping."""

from __future__ import annotations

import jax
import optax

NO_DECAY = ("scale", "bias")  # norm scales and biases are not weight-decayed


def schedule(optim_cfg, train_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to ``lr``, then cosine / linear decay to ``lr * end_lr_ratio`` or constant."""
  lr, warmup = optim_cfg.lr, optim_cfg.warmup_steps
  decay_steps = max((optim_cfg.decay_steps or train_steps) - warmup, 1)
  end = lr * optim_cfg.end_lr_ratio
  after = {
      "cosine": lambda: optax.cosine_decay_schedule(lr, decay_steps, alpha=optim_cfg.end_lr_ratio),
      "linear": lambda: optax.linear_schedule(lr, end, decay_steps),
      "constant": lambda: optax.constant_schedule(lr),
  }[optim_cfg.schedule]()
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def decay_mask(params):
  """True for parameters that get weight decay (everything but norm scales and biases)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) not in NO_DECAY,
                                          params)


def make(optim_cfg, train_steps: int) -> optax.GradientTransformation:
  chain = []
  if optim_cfg.clip_norm > 0:
    chain.append(optax.clip_by_global_norm(optim_cfg.clip_norm))
  chain.append(optax.adamw(schedule(optim_cfg, train_steps), b1=optim_cfg.b1, b2=optim_cfg.b2,
                           eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay, mask=decay_mask))
  return optax.chain(*chain)

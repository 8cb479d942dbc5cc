"""The optax optimizer from the ``optim`` config group: AdamW, warmup + decay schedule, clipping."""

from __future__ import annotations

import jax
import ml_collections
import optax
from ml_collections import config_dict

from jaxtrain.errors import check_choice, check_positive

NO_DECAY = ("scale", "bias")  # norm scales and biases are not weight-decayed
SCHEDULES = ("cosine", "linear", "constant")


def defaults() -> ml_collections.ConfigDict:
  """The ``optim`` config group."""
  return ml_collections.ConfigDict(dict(
      lr=3e-4,
      schedule="cosine",  # cosine | linear | constant (after warmup)
      warmup_steps=100,
      decay_steps=config_dict.placeholder(int),  # default: train.steps
      end_lr_ratio=0.1,  # final lr = lr * end_lr_ratio (cosine / linear)
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.1,  # not applied to norm scales and biases
      clip_norm=1.0,  # global-norm clipping; 0 disables
  ))


def validate(config) -> None:
  """Checks of the ``optim`` group (ConfigError naming the key)."""
  check_positive(config, ["optim.lr"])
  check_positive(config, ["optim.warmup_steps", "optim.weight_decay", "optim.clip_norm", "optim.end_lr_ratio"],
                 allow_zero=True)
  check_choice(config, "optim.schedule", SCHEDULES)


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

"""What a training step minimizes: the :class:`Objective` protocol and its registry, :data:`OBJECTIVES`
(``train.objective``).

An objective owns everything that differs between, say, next-token pretraining, preference optimization and
reinforcement learning: its config checks, the batch layout its step consumes, where its batches come from, the
step itself (loss, gradient, the shared optimizer update :func:`jaxtrain.train.step.apply_update`, its metrics)
and its evaluation. Everything else (the mesh, shardings, LoRA, microbatches where the objective takes them,
checkpoints and exact resume, the NaN policy, hooks, goodput) is the loop's and is the same for every objective.

  @OBJECTIVES.register("my_loss")
  class MyLoss(Objective):
    def make_train_step(self, run): ...   # (state, batch, skip) -> (state, metrics), jitted by the trainer
"""

from __future__ import annotations

from typing import Callable, Iterator

import jax
import ml_collections
import numpy as np

from jaxtrain import data as data_lib
from jaxtrain.data import batch as batch_lib
from jaxtrain.errors import ConfigError
from jaxtrain.registry import Registry

OBJECTIVES: Registry[type["Objective"]] = Registry(
    "train.objective", "training objective", "jaxtrain.train.objectives.OBJECTIVES.register")


class Objective:
  """One training objective. The base class's answers are the language model's (``lm``), so an objective overrides
  only what it changes. One instance per run (:func:`of`)."""

  # Whether its step scales the loss for float16 (optim.loss_scale, jaxtrain/loss_scale.py).
  loss_scaling: bool = False
  # Its own figures, by metric name, that the console line shows after loss and grad_norm (a step's; an evaluation's
  # eval_* ones on the run's last line), those a record holds.
  console_metrics: tuple[str, ...] = ()

  def validate(self, config: ml_collections.ConfigDict) -> None:
    """Checks that need no devices (its own keys; what it needs of the data and the model). Raises ConfigError."""

  def abstract_batch(self, run) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch its step consumes, as shapes laid out on ``run.batch_sharding`` (rows on the batch axes)."""
    b, t = run.config.train.global_batch_size, run.config.data.seq_len
    example = batch_lib.from_tokens(np.zeros((1, t + 1), np.int32))
    if run.sources:
      example["sources"] = np.zeros((1, t), np.int32)
    return {k: jax.ShapeDtypeStruct((b, t), v.dtype, sharding=run.batch_sharding) for k, v in example.items()}

  def open_train(self, config: ml_collections.ConfigDict) -> Iterator[dict]:
    """Its training stream: per-process numpy batches in :meth:`abstract_batch`'s layout, a
    :class:`jaxtrain.checkpoint.DataPosition` so that checkpoints hold its position."""
    return data_lib.open_train(config)

  def to_global(self, run, local_batch: dict) -> dict:
    """This process's numpy batch from :meth:`open_train` -> the step's global arrays (laid out as
    :meth:`abstract_batch`), its token ids checked first (:func:`jaxtrain.data.to_global`)."""
    return data_lib.to_global(local_batch, run.batch_sharding, run.config)

  def make_train_step(self, run) -> Callable:
    """``(state, batch, skip) -> (state, metrics)``, traced and compiled by the trainer (one program)."""
    raise NotImplementedError

  def state_extra(self, config: ml_collections.ConfigDict, mesh, rules):
    """What its steps carry from one to the next besides the model (GRPO's rollouts produced ahead), as
    ShapeDtypeStructs with shardings on ``mesh``: the train state's ``extra`` (zeros at the start, checkpointed
    with the state, restored with it), or None for nothing."""
    return None

  def abstract_extra(self, run) -> tuple:
    """The shapes (with shardings) of what its step takes besides ``(state, batch, skip)`` (a frozen reference's
    params), for compiling without them (the dry run)."""
    return ()

  def step_fn(self, run, compile_step: Callable) -> Callable:
    """What the loop calls each step, ``(state, batch, skip) -> (state, metrics)`` (metrics: device values the loop
    fetches a step later). ``compile_step(run, train_step=None)`` compiles :meth:`make_train_step`'s step; an
    objective whose step needs host work between programs (sampling and scoring rollouts) wraps it here; a
    ``close()`` of what it returns is called when the run ends, whatever ends it (GRPO's: its reward pool stops)."""
    return compile_step(run)

  def make_evaluator(self, run):
    """``params -> fetch`` (``fetch() -> {name: value}``), dispatched at eval steps, or None for no eval."""
    return None


def of(config: ml_collections.ConfigDict) -> Objective:
  """The objective ``train.objective`` names (ConfigError if none is registered by that name)."""
  return OBJECTIVES.get(config.train.objective)()


def validate(config: ml_collections.ConfigDict) -> None:
  """``train.objective`` is registered, and the objective's own checks pass."""
  of(config).validate(config)


def check_loss_scaling(config: ml_collections.ConfigDict) -> None:
  """``optim.loss_scale`` only for an objective whose step scales its loss (checked before the objectives' own
  groups, whose checks would otherwise name a lesser problem first)."""
  if str(config.optim.loss_scale).lower() != "none" and not of(config).loss_scaling:
    raise ConfigError("optim.loss_scale", f"train.objective={config.train.objective} does not scale its loss",
                      "set optim.loss_scale=none and model.dtype=bfloat16 (or float32)")

"""Where a run's state starts when it has no checkpoint of its own: a fresh, seeded, sharded init, or another run's
checkpoint (``checkpoint.restore_from``: its params, or its whole state). Deterministic: a preference or RL
objective rebuilds its reference model from the same start on every restart. ``run``: a
:class:`jaxtrain.train.run.Run` (not imported: objectives import this module, and the config imports them)."""

from __future__ import annotations

import jax
from absl import logging

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain.models import lora
from jaxtrain.train import state as state_lib
from jaxtrain.train.state import TrainState


def init_state(run) -> TrainState:
  """A fresh state from ``train.seed``, laid out on the run's shardings."""
  with jax.set_mesh(run.mesh):
    return state_lib.make_init(run.model, run.tx, run.state_shardings, run.state_extra)(
        jax.random.key(run.config.train.seed))


def starting_state(run, role: str = "started from") -> TrainState:
  """A fresh state, started from ``checkpoint.restore_from`` when set (``checkpoint.restore_mode``: its params
  only, or its whole state). ``role`` begins the line that says so (a frozen reference model, built from the same
  start, says that it is one)."""
  state = init_state(run)
  c = run.config.checkpoint
  if c.restore_from:
    abstract = run.abstract_state()
    # LoRA from a base checkpoint (e.g. tools/convert_hf.py import): its params lack the adapters, which then
    # keep their fresh init (B = 0: the run starts from exactly the base model).
    optional = (lora.KEY,) if run.model.lora and c.restore_mode == "params" else ()
    other, step = checkpoint_lib.restore_from(c.restore_from, abstract, params_only=c.restore_mode == "params",
                                              optional=optional)
    if c.restore_mode == "params":
      fresh = [k for k in state.params if k not in other["params"]]
      state = state.replace(params={**state.params, **other["params"]})
      if fresh:
        logging.info("%s has no %s params: freshly initialized", c.restore_from, ", ".join(fresh))
    else:
      state = other
    logging.info("%s %s of %s (step %d)", role, c.restore_mode, c.restore_from, step)
  return state

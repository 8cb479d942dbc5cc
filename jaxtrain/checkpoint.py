"""Orbax checkpoints: async multi-host saves, retention, corrupt-checkpoint fallback, restore onto any mesh.

Each checkpoint step holds four items: ``state`` (the train state pytree: params, optimizer state, step),
``data`` (every process's data-iterator state, via Grain's handler), ``meta`` (JSON: jaxtrain version, mesh,
loss, tokens seen, wall time, seed) and ``config`` (the resolved config). Saves are written into
``<step>.orbax-checkpoint-tmp`` and committed by rename, so a killed save is never mistaken for a checkpoint.
This module knows nothing of the trainer: it saves the pytree it is given and restores against the abstract
pytree (ShapeDtypeStructs with the *current* shardings) it is handed, which is what makes restoring onto
another mesh work.
"""

from __future__ import annotations

import os
import time
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from jaxtrain.config import UserError

ITEMS = ("state", "data", "meta", "config")


class CheckpointError(UserError):
  """A checkpoint could not be written or read (disk full, permissions, nothing to restore from)."""


def _policies(every_steps: int, every_minutes: float, keep_last: int, keep_every: int):
  cm = ocp.checkpoint_managers
  save = [cm.FixedIntervalPolicy(every_steps)] if every_steps else []
  if every_minutes:
    save.append(cm.ContinuousCheckpointingPolicy(minimum_interval_secs=int(every_minutes * 60)))
  keep = [cm.LatestN(keep_last)] + ([cm.EveryNSteps(keep_every)] if keep_every else [])
  # With no periodic policy, only forced saves (end of training, preemption) are written.
  return cm.AnySavePolicy(save or [cm.SpecificStepsPolicy(())]), cm.AnyPreservationPolicy(keep)


class Checkpointer:

  def __init__(self, directory: str, *, every_steps: int = 0, every_minutes: float = 0, keep_last: int = 3,
               keep_every: int = 0, async_save: bool = True):
    self.directory = epath.Path(directory)
    save_policy, keep_policy = _policies(every_steps, every_minutes, keep_last, keep_every)
    options = ocp.CheckpointManagerOptions(save_decision_policy=save_policy, preservation_policy=keep_policy,
                                           enable_async_checkpointing=async_save, create=True)
    try:
      self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
    except OSError as e:
      raise CheckpointError(os.fspath(directory), f"cannot use the checkpoint folder ({e.strerror or e})",
                            "set checkpoint.dir to a writable folder") from None
    self.last_save_blocked_s = 0.0
    self._warned_data = False

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def should_save(self, step: int) -> bool:
    return self.manager.should_save(step)

  def save(self, step: int, state: Any, data_iterator, meta: dict, config: dict, force: bool = False) -> bool:
    """Starts (async) or does (sync) a save; returns whether one was started. Raises CheckpointError
    when the previous async save failed: that is where disk-full and permission errors surface."""
    items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                 config=ocp.args.JsonSave(config))
    if isinstance(data_iterator, grain.DatasetIterator):
      items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
    elif not self._warned_data:
      logging.warning("the data iterator (%s) has no savable state; checkpoints will not hold the data position",
                      type(data_iterator).__name__)
      self._warned_data = True
    args = ocp.args.Composite(**items)
    t = time.perf_counter()
    try:
      saved = self.manager.save(step, args=args, force=force)
    except Exception as e:  # an earlier async write failed, or this one could not start
      raise self._write_error(e) from None
    self.last_save_blocked_s = time.perf_counter() - t
    return saved

  def wait(self) -> None:
    """Blocks until pending saves are committed; raises CheckpointError if one failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._write_error(e) from None

  def _write_error(self, e: Exception) -> CheckpointError:
    return CheckpointError(os.fspath(self.directory), f"saving a checkpoint failed ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''})",
                           "free disk space or fix permissions; earlier checkpoints are intact")

  def restore(self, abstract_state: Any, data_iterator) -> tuple[Any, dict] | None:
    """Restores the newest committed checkpoint that reads back cleanly, onto the shardings in
    ``abstract_state``, and sets ``data_iterator``'s position. A checkpoint that fails to restore is
    reported, moved aside to ``corrupt-<step>`` and the previous one is tried. None if there is none."""
    self.wait()  # a save still in flight (a rollback right after a save) must commit before it is read
    for step in reversed(self.steps()):
      try:
        items = dict(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
        if isinstance(data_iterator, grain.DatasetIterator) and (self.directory / str(step) / "data").exists():
          items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"], dict(restored["meta"])
      except Exception as e:  # corrupt or truncated files: fall back to the previous checkpoint
        logging.warning("checkpoint step %d in %s cannot be restored (%s: %s); falling back to the previous "
                        "one", step, self.directory, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        self._set_aside(step)
    return None

  def _set_aside(self, step: int) -> None:
    """Renames a bad step so that it is neither restored nor overwritten, and keeps it for inspection."""
    if jax.process_index() == 0:
      src = self.directory / str(step)
      if src.exists():
        src.rename(self.directory / f"corrupt-{step}-{int(time.time())}")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxtrain_set_aside_{step}")
    self.manager.reload()

  def close(self) -> None:
    self.manager.close()


def restore_from(path: str, abstract_state: Any, params_only: bool) -> tuple[Any, int]:
  """Reads another run's checkpoint: ``path`` is a checkpoint folder (newest step) or one step folder.
  Returns the restored state pytree (only its ``params`` are meaningful when ``params_only``) and the step."""
  root = epath.Path(path)
  step_dir = root if (root / "state").exists() else None
  if step_dir is None:
    steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []
    if not steps:
      raise CheckpointError(path, "no committed checkpoint found", "point checkpoint.restore_from at a run's "
                            "checkpoints folder or one of its step folders")
    step_dir = root / str(steps[-1])
  item = step_dir / "state"
  target = {"params": abstract_state.params} if params_only else abstract_state
  try:
    if params_only:  # read just the params subtree, whatever else (optimizer state) the other run saved
      with ocp.PyTreeCheckpointer() as ckptr:
        restored = ckptr.restore(item, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    else:
      with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(item, target)
  except Exception as e:
    raise CheckpointError(os.fspath(step_dir), f"cannot restore ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''})",
                          "check that the checkpoint matches this model config") from None
  return restored, int(step_dir.name) if step_dir.name.isdigit() else -1

"""Orbax checkpoints: async multi-host saves, retention, corrupt-checkpoint fallback, restore onto any mesh.

Each checkpoint step holds four items: ``state`` (the train state pytree: params, optimizer state, step),
``data`` (every process's data position, one JSON file per process), ``meta`` (JSON: jaxtrain version, mesh,
loss, tokens seen, wall time, seed) and ``config`` (the resolved config). Saves are written into
``<step>.orbax-checkpoint-tmp`` and committed by rename, so a killed save is never mistaken for a checkpoint.
This module knows nothing of the trainer: it saves the pytree it is given and restores against the abstract
pytree (ShapeDtypeStructs with the *current* shardings) it is handed, which is what makes restoring onto
another mesh work. Before reading a step it compares the saved tensor shapes with that pytree: another model
or optimizer is the user's mistake (an error, nothing touched), not a corrupt checkpoint to fall back from.
The data position is saved and restored only through :class:`DataPosition` (``get_state``, ``set_state``,
``resplit``), so any iterator that has those three methods resumes exactly, Grain's or not; one saved by another
number of processes is re-split by the iterator itself. Creating a Checkpointer also quiets Orbax's INFO narration
(:func:`quiet_libraries`), from the command line and from Python alike.
"""

from __future__ import annotations

import errno
import json
import logging as std_logging
import os
import re
import sys
import time
from typing import Any, Protocol, runtime_checkable

import jax
import ml_collections
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from jaxtrain import integrity
from jaxtrain import paths
from jaxtrain.errors import ConfigError, UserError, check_choice, check_positive


def defaults() -> ml_collections.ConfigDict:
  """The ``checkpoint`` config group."""
  return ml_collections.ConfigDict({
      "dir": "",  # default: <workdir>/checkpoints; local paths and gs:// alike
      "every_steps": 0,  # save every N steps (0: off); the last step and preemptions always save
      "every_minutes": 0.0,  # and/or at least every T minutes (0: off)
      "keep_last": 3,  # retention: the newest K checkpoints ...
      "keep_every": 0,  # ... plus every M-th step kept permanently (0: none)
      "async": True,  # save in the background; the loop blocks only for the device-to-host copy
      "verify": True,  # fingerprint every array at save, check them (and finiteness) at restore
      "restore_from": "",  # start from another run's checkpoint (folder of steps, or one step folder)
      "restore_mode": "params",  # params | state: what restore_from takes from that checkpoint
      # A node-local tier (jaxtrain.local_checkpoint): each process saves its own shards to this folder on its
      # own disk (a local NVMe, /dev/shm; empty: off) every local_every_steps, keeping local_keep_last of them.
      # A failed local save is counted and the run goes on; after local_max_failures in a row the tier is off.
      "local_dir": "",
      "local_every_steps": 0,
      "local_keep_last": 2,
      "local_max_failures": 3,
  })


def validate(config) -> None:
  check_positive(config, ["checkpoint.every_steps", "checkpoint.every_minutes", "checkpoint.keep_every"],
                 allow_zero=True)
  check_positive(config, ["checkpoint.keep_last", "checkpoint.local_keep_last", "checkpoint.local_max_failures"])
  check_positive(config, ["checkpoint.local_every_steps"], allow_zero=True)
  c = config.checkpoint
  if c.local_dir and not c.local_every_steps:
    raise ConfigError("checkpoint.local_every_steps", "must be > 0 when checkpoint.local_dir is set",
                      "set how often the local tier saves, e.g. --config.checkpoint.local_every_steps=100")
  if c.local_dir and paths.is_url(c.local_dir):
    raise ConfigError("checkpoint.local_dir", f"'{c.local_dir}' is not on a local disk",
                      "give a node-local folder (a local NVMe, /dev/shm); checkpoint.dir is the persistent tier")
  check_choice(config, "checkpoint.restore_mode", ("params", "state"))


class CheckpointError(UserError):
  """A checkpoint could not be written or read (disk full, permissions, nothing to restore from)."""


class SaveFailed(Exception):
  """A save failed for a reason other than the storage (not the user's to fix: a bug here or in a library).
  Its ``__cause__`` is the original error with its traceback."""


class CorruptCheckpoint(Exception):
  """A checkpoint's data does not match the fingerprints written with it, or holds non-finite values."""


class NonFiniteState(Exception):
  """A state with non-finite values was handed to save(): it is not written."""


# What storage failures say, as OSError (local writes from Python) or inside TensorStore's messages (its
# writes run in C++ and reach us as ValueError text naming the OS error or the object store's status).
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG, errno.EIO,
                   errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EMFILE, errno.ENFILE, errno.ETIMEDOUT)
_STORAGE_WORDS = tuple(os.strerror(n) for n in _STORAGE_ERRNOS) + (
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "NOT_FOUND", "DEADLINE_EXCEEDED", "UNAVAILABLE")


def storage_error(e: BaseException) -> BaseException | None:
  """The OS or object-store error behind ``e`` (itself, its causes or contexts, an exception group's members),
  or None if the failure did not come from the storage."""
  seen, todo = set(), [e]
  while todo:
    x = todo.pop()
    if x is None or id(x) in seen:
      continue
    seen.add(id(x))
    if isinstance(x, OSError) or _os_error_code(x) or any(w in str(x) for w in _STORAGE_WORDS):
      return x
    todo += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]
  return None


def _os_error_code(e: BaseException) -> int | None:
  if isinstance(e, OSError) and e.errno:
    return e.errno
  match = re.search(r"os_error_code='?(\d+)", str(e))  # how TensorStore reports the errno
  return int(match.group(1)) if match else None


def storage_reason(e: BaseException) -> str:
  """The storage failure in a few words ("File too large"), first in the message: TensorStore buries it in
  the middle of a long one, which describe() may shorten."""
  code = _os_error_code(e)
  if code:
    return os.strerror(code)
  return next((w for w in _STORAGE_WORDS if w in str(e)), type(e).__name__)


def describe(e: BaseException, limit: int = 240) -> str:
  """``Type: message`` on one line. TensorStore nests the OS error ("File too large", "No space left on
  device") at the end of a long message, so a long one keeps its head and its tail."""
  text = " ".join(str(e).split())
  if len(text) > limit:
    text = f"{text[:limit // 3]} ... {text[-(limit - limit // 3):]}"
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


@runtime_checkable
class DataPosition(Protocol):
  """What the checkpointer needs of a data iterator to save its position and resume it exactly. The train
  iterator of :func:`jaxtrain.data.open_train` and the synthetic source have it; an iterator without these three
  methods trains, but its checkpoints hold no data position (a resume starts its stream over)."""

  def get_state(self) -> dict:
    """This process's position, a dict that survives ``json.dumps`` / ``json.loads`` (it is saved as JSON)."""
    ...

  def set_state(self, state: dict) -> None:
    """Moves the iterator to ``state``, one that :meth:`get_state` or :meth:`resplit` returned."""
    ...

  def resplit(self, saved_states: list[dict]) -> dict:
    """This process's position, for :meth:`set_state`, from the positions that every process of a run with
    *another* process count saved at one step (``saved_states[i]``: process i's). The global stream must go on
    where that run stopped; raise a :class:`jaxtrain.config.UserError` if it cannot (another global batch)."""
    ...


# How the data position is stored. Positions differ per process, so every process writes its own: the ``data``
# item holds one JSON file per process, process_<i>-of-<n>.json, written by that process through Orbax's
# JsonCheckpointHandler with primary_host=None (Orbax's switch for "every process writes"; by default only
# process 0 writes JSON). It is part of the same Composite save as the state: written in the background and
# committed with it, with nothing gathered across processes. The file name is the one Grain's Orbax handler wrote
# (the data item of checkpoints from before DataPosition), so those restore unchanged. ``meta`` records n
# (``data_processes``); a run with another process count reads all n files, with Orbax's handler, and hands
# them to DataPosition.resplit. Checkpoints older than that record hold nothing but the n position files.
_DATA_PROCESSES = "data_processes"


def _position_file(process_index: int, process_count: int) -> str:
  return f"process_{process_index}-of-{process_count}.json"


def _position_handler(process_index: int, process_count: int) -> ocp.JsonCheckpointHandler:
  return ocp.JsonCheckpointHandler(_position_file(process_index, process_count),
                                   multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=None))


def _saved_position(data_iterator: DataPosition) -> dict:
  """The iterator's position now (a copy: the write happens in the background while the iterator moves on)."""
  state = data_iterator.get_state()
  try:
    return json.loads(json.dumps(state))
  except (TypeError, ValueError) as e:
    raise TypeError(f"{type(data_iterator).__name__}.get_state() returned a position that is not JSON ({e})") from e


class _QuietLibraries(std_logging.Filter):
  """Orbax logs every save phase at INFO; keep its warnings and errors, drop the rest. A failed background write
  (disk full, permissions) is logged with whole tracebacks by Orbax and by asyncio (for Orbax's other write
  tasks) and then raised again to us, where it becomes jaxtrain's one-line error: keep their lines, fold each
  traceback into the exception's type and message."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    from_orbax = "/orbax/" in record.pathname
    if ((from_orbax or record.name == "asyncio") and record.levelno >= std_logging.ERROR and record.exc_info
        and record.exc_info[1] is not None):
      first = record.getMessage().splitlines()[0]
      record.msg, record.args = f"{first}: {describe(record.exc_info[1])}", None
      record.exc_info, record.exc_text = None, None
    return not from_orbax or record.levelno >= std_logging.WARNING


LIBRARY_LOG_FILTER = _QuietLibraries()
"""The filter that :func:`quiet_libraries` puts on the loggers Orbax and asyncio log to. To see Orbax's INFO lines
again: ``absl.logging.get_absl_logger().removeFilter(checkpoint.LIBRARY_LOG_FILTER)``."""


def _drop_closed_loop_noise(unraisablehook):
  """After a failed write, Orbax's event loop closes while TensorStore still completes the other in-flight
  writes; each completion then fails to wake the closed loop and prints an "unraisable" traceback from a C++
  thread. The write error itself is reported once (see _QuietLibraries); drop exactly that echo and hand
  everything else to ``unraisablehook`` (the hook that was installed before)."""

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
      unraisablehook(unraisable)
  hook.drops_closed_loop_noise = True
  return hook


def quiet_libraries() -> None:
  """Keeps Orbax's INFO narration of every save out of the log (its warnings and errors stay, each traceback of a
  failed write folded into one line) and drops the "Event loop is closed" echoes of a failed write. Called by
  every Checkpointer, so that training from Python (a notebook, a test) logs what the command line logs;
  idempotent. The filters sit on the loggers, not on a handler, so they hold whatever handlers are attached
  (absl's, pytest's, a notebook's). ``sys.unraisablehook`` is wrapped, not replaced: whatever hook is installed
  still gets every other unraisable exception (it is wrapped again if someone installs another one later)."""
  # Orbax logs through absl's logger, a few of its modules through the root logger itself; asyncio through its own.
  # A logger's filters see only the records logged to it, not those its children pass up.
  for logger in (logging.get_absl_logger(), std_logging.getLogger(), std_logging.getLogger("asyncio")):
    logger.addFilter(LIBRARY_LOG_FILTER)  # a no-op when it is there already
  if not getattr(sys.unraisablehook, "drops_closed_loop_noise", False):
    sys.unraisablehook = _drop_closed_loop_noise(sys.unraisablehook)


def _policies(every_steps: int, every_minutes: float, keep_last: int, keep_every: int):
  cm = ocp.checkpoint_managers
  save = [cm.FixedIntervalPolicy(every_steps)] if every_steps else []
  if every_minutes:
    save.append(cm.ContinuousCheckpointingPolicy(minimum_interval_secs=max(1, round(every_minutes * 60))))
  keep = [cm.LatestN(keep_last)] + ([cm.EveryNSteps(keep_every)] if keep_every else [])
  # With no periodic policy, only forced saves (end of training, preemption) are written.
  return cm.AnySavePolicy(save or [cm.SpecificStepsPolicy(())]), cm.AnyPreservationPolicy(keep)


class Checkpointer:

  def __init__(self, directory: str, *, every_steps: int = 0, every_minutes: float = 0, keep_last: int = 3,
               keep_every: int = 0, async_save: bool = True, verify: bool = True):
    """``verify``: fingerprint every array at save time (in ``meta``) and, on restore, check the arrays against
    them and for non-finite values; a mismatch is treated as corruption. A data position saved by another
    process count is re-split by the iterator (:meth:`DataPosition.resplit`). Installs :func:`quiet_libraries`."""
    quiet_libraries()
    self.verify = verify
    self.directory = epath.Path(paths.resolve(os.fspath(directory)))  # Orbax wants absolute paths
    save_policy, keep_policy = _policies(every_steps, every_minutes, keep_last, keep_every)
    options = ocp.CheckpointManagerOptions(save_decision_policy=save_policy, preservation_policy=keep_policy,
                                           enable_async_checkpointing=async_save, create=True)
    # state, meta and config get Orbax's handlers for their args; data gets this process's own file.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    positions = _position_handler(jax.process_index(), jax.process_count())
    registry.add("data", ocp.args.JsonSave, positions)
    registry.add("data", ocp.args.JsonRestore, positions)
    try:
      self.manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
    except OSError as e:
      raise CheckpointError(os.fspath(directory), f"cannot use the checkpoint folder ({e.strerror or e})",
                            "set checkpoint.dir to a writable folder") from None
    self.last_save_blocked_s = 0.0
    self._warned_data = False

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def should_save(self, step: int) -> bool:
    return self.manager.should_save(step)

  def save(self, step: int, state: Any, data_iterator, meta: dict, config: dict, force: bool = False,
           summary: tuple[dict[str, int], list[str]] | None = None) -> bool:
    """Starts (async) or does (sync) a save; returns whether one was started. ``summary``: the state's
    :func:`jaxtrain.integrity.read` if the train step already computed it (else it is computed here, one
    pass over the state). Raises NonFiniteState (nothing written) if the state has non-finite values, and
    CheckpointError when the previous async save failed: that is where disk-full and permission errors
    surface."""
    t = time.perf_counter()
    if self.verify:
      fingerprints, nonfinite = summary if summary is not None else integrity.summarize(state)
      if nonfinite:
        raise NonFiniteState(f"non-finite values in {_some(nonfinite)}")
      arrays = integrity.named(state)
      meta = {**meta, "fingerprints": {k: [v, str(arrays[k].dtype)] for k, v in fingerprints.items()}}
    items = dict(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config))
    if isinstance(data_iterator, DataPosition):
      items["data"] = ocp.args.JsonSave(_saved_position(data_iterator))
      meta = {**meta, _DATA_PROCESSES: jax.process_count()}
    elif data_iterator is not None and not self._warned_data:  # None: no data stream (e.g. an imported model)
      logging.warning("the data iterator (%s) has no get_state/set_state/resplit (jaxtrain.checkpoint."
                      "DataPosition); checkpoints will not hold the data position", type(data_iterator).__name__)
      self._warned_data = True
    args = ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items)
    try:
      saved = self.manager.save(step, args=args, force=force)
    except Exception as e:  # an earlier async write failed, or this one could not start
      raise self._write_error(e) from e
    self.last_save_blocked_s = time.perf_counter() - t
    return saved

  def wait(self) -> None:
    """Blocks until pending saves are committed; raises CheckpointError if one failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._write_error(e) from e

  def _write_error(self, e: Exception) -> Exception:
    """A storage failure is the user's to fix (CheckpointError, exit 2); anything else is reported as what it
    is (SaveFailed, with the original error as its cause) and never blamed on the disk."""
    cause = storage_error(e)
    if cause is not None:
      return CheckpointError(os.fspath(self.directory), f"saving a checkpoint failed: {storage_reason(cause)} "
                             f"({describe(cause)})",
                             "free disk space or fix permissions; earlier checkpoints are intact")
    failed = SaveFailed(f"{os.fspath(self.directory)}: saving a checkpoint failed ({describe(e)}); this is not a "
                        "storage problem but a bug in jaxtrain or a library it uses; earlier checkpoints are intact")
    failed.__cause__ = e
    return failed

  def restore(self, abstract_state: Any, data_iterator) -> tuple[Any, dict] | None:
    """Restores the newest committed checkpoint that reads back cleanly, onto the shardings in
    ``abstract_state``, and sets ``data_iterator``'s position. A checkpoint that fails to read (corrupt or
    truncated files) is reported, moved aside to ``corrupt-<step>-<time>`` and the previous one is tried;
    one written for another model or optimizer raises CheckpointError and nothing is touched. None if there
    is no checkpoint."""
    self.wait()  # a save still in flight (a rollback right after a save) must commit before it is read
    for step in reversed(self.steps()):
      try:
        self.check_compatible(step, abstract_state)
      except CheckpointError:
        raise
      except Exception as e:  # unreadable metadata: corrupt
        self._fall_back(step, e)
        continue
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        if self.verify:
          verify(restored["state"], restored["meta"])
        self._restore_data_position(step, data_iterator, restored["meta"])
      except UserError:  # the data position does not fit this run (another global batch): the user's to fix
        raise
      except Exception as e:  # corrupt or truncated files: fall back to the previous checkpoint
        self._fall_back(step, e)
        continue
      return restored["state"], dict(restored["meta"])
    return None

  def check_compatible(self, step: int, abstract_state: Any) -> None:
    """Raises CheckpointError if ``step`` was written for another model or optimizer (tensor names or shapes
    differ from ``abstract_state``), reading only metadata. Unreadable metadata raises what the read raised."""
    mismatch = _mismatch(saved_tensors(self.directory / str(step) / "state"), abstract_state)
    if mismatch:
      raise CheckpointError(os.fspath(self.directory / str(step)), f"was written for another model or optimizer "
                            f"({mismatch})", "use a new workdir (or checkpoint.dir) for this config, or go back "
                            "to the config that wrote it; checkpoint.restore_from with restore_mode=params starts "
                            "from its weights when only the optimizer differs")

  def _restore_data_position(self, step: int, data_iterator, meta: dict) -> None:
    folder = self.directory / str(step) / "data"
    if not isinstance(data_iterator, DataPosition) or not folder.exists():
      return
    # How many processes saved it (in checkpoints from before meta recorded it: how many position files it has).
    saved = meta.get(_DATA_PROCESSES) or len(list(folder.glob("process_*-of-*.json")))
    if saved == jax.process_count():
      position = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    else:
      states = [_position_handler(i, saved).restore(folder) for i in range(saved)]
      position = data_iterator.resplit(states)
      logging.info("data position of %d processes re-split over %d", saved, jax.process_count())
    data_iterator.set_state(position)

  def _fall_back(self, step: int, e: Exception) -> None:
    logging.warning("checkpoint step %d in %s cannot be restored (%s); set aside, falling back to the previous "
                    "one", step, self.directory, describe(e))
    self._set_aside(step)

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


def verify(state: Any, meta: dict) -> None:
  """Raises CorruptCheckpoint if an array of a restored ``state`` differs from the fingerprint its checkpoint's
  ``meta`` recorded at save time, or holds non-finite values. Arrays restored into another dtype than they
  were saved in (Orbax casts) are checked for finiteness only; checkpoints written before fingerprints
  existed, likewise."""
  fingerprints, nonfinite = integrity.summarize(state)
  arrays = integrity.named(state)
  saved = meta.get("fingerprints") or {}
  wrong = [k for k, (fp, dtype) in saved.items() if k in fingerprints and str(arrays[k].dtype) == dtype
           and fingerprints[k] != fp]
  if wrong:
    raise CorruptCheckpoint(f"{_some(wrong)} {'does' if len(wrong) == 1 else 'do'} not match the fingerprints "
                            "written at save time")
  if nonfinite:
    raise CorruptCheckpoint(f"non-finite values in {_some(nonfinite)}")


def _some(names: list[str]) -> str:
  names = _params_first(names)
  return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def saved_tensors(state_dir) -> dict[str, Any]:
  """``'params/layers/mlp/up/kernel' -> ArrayMetadata`` (shape, dtype) of a saved train state, from its
  metadata alone (no tensor data is read)."""
  tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir)).tree
  return integrity.named(tree)


def _mismatch(saved: dict[str, Any], abstract_state: Any) -> str:
  """What keeps a saved state from restoring into ``abstract_state`` (missing tensors, other shapes), or ''.
  Dtypes may differ: Orbax casts on restore."""
  wanted = integrity.named(abstract_state)
  problems = [f"{k} is {tuple(saved[k].shape)} there, {tuple(wanted[k].shape)} here"
              for k in _params_first(saved.keys() & wanted.keys())
              if tuple(saved[k].shape) != tuple(wanted[k].shape)]
  problems += [f"{k} is not in it" for k in _params_first(wanted.keys() - saved.keys())]
  problems += [f"it has {k}, this run does not" for k in _params_first(saved.keys() - wanted.keys())]
  more = f" and {len(problems) - 2} more" if len(problems) > 2 else ""
  return "; ".join(problems[:2]) + more


def _params_first(names) -> list[str]:
  return sorted(names, key=lambda k: (not k.startswith("params"), k))


def restore_from(path: str, abstract_state: Any, params_only: bool,
                 optional: tuple[str, ...] = (), subset: bool = False) -> tuple[Any, int]:
  """Reads another run's checkpoint: ``path`` is a checkpoint folder (newest step) or one step folder.
  Returns the restored state pytree (only its ``params`` are meaningful when ``params_only``) and the step.
  ``optional`` (with ``params_only``): top-level params keys that the checkpoint may lack (LoRA adapters, when
  starting from a base model); those it lacks are not read and are absent from the returned params. Any other
  difference between its params and ``abstract_state``'s (a missing or extra tensor, another shape) is a
  CheckpointError naming it (metadata only, before any tensor is read). ``subset`` (with ``params_only``):
  ``abstract_state``'s params name only some of the checkpoint's (read one at a time: tools/convert_hf.py export);
  the others are not compared, nor read."""
  quiet_libraries()
  root = epath.Path(paths.resolve(path))
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
      saved = {k: v for k, v in saved_tensors(item).items() if k.startswith("params/")}
      if subset:
        saved = {k: v for k, v in saved.items() if k in integrity.named({"params": abstract_state.params})}
      absent = [k for k in optional if k in abstract_state.params and not any(
          n.startswith(f"params/{k}/") for n in saved)]
      target = {"params": {k: v for k, v in abstract_state.params.items() if k not in absent}}
      mismatch = _mismatch(saved, target)
      if mismatch:
        raise CheckpointError(os.fspath(step_dir), f"holds params of another model ({mismatch})",
                              "check that the checkpoint matches this model config (model.lora included)")
      with ocp.PyTreeCheckpointer() as ckptr:
        restored = ckptr.restore(item, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    else:
      with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(item, target)
    meta_file = step_dir / "meta" / "metadata"
    verify(restored, json.loads(meta_file.read_text()) if meta_file.exists() else {})
  except CorruptCheckpoint as e:
    raise CheckpointError(os.fspath(step_dir), f"is corrupt ({e})", "restore from another step or run") from None
  except CheckpointError:
    raise
  except Exception as e:
    raise CheckpointError(os.fspath(step_dir), f"cannot restore ({describe(e)})",
                          "check that the checkpoint matches this model config") from None
  return restored, int(step_dir.name) if step_dir.name.isdigit() else -1


# A run's checkpoints, found from what a user passes (tools/convert_hf.py export, jaxtrain.generate) ------------


def step_dir(path: str, step: int | None = None) -> str:
  """The step folder that ``path`` names: a run's workdir, its checkpoints folder, or a step folder itself; the
  newest committed step unless ``step``. Raises CheckpointError (one line) when there is none."""
  path = os.path.abspath(path)
  if os.path.isdir(os.path.join(path, "state")):
    if step is not None and os.path.basename(path) != str(step):
      raise CheckpointError(path, f"is step {os.path.basename(path)}, not --step={step}",
                            "drop --step or pass its folder")
    return path
  folder = os.path.join(path, "checkpoints") if os.path.isdir(os.path.join(path, "checkpoints")) else path
  steps = sorted(int(p) for p in os.listdir(folder) if p.isdigit()) if os.path.isdir(folder) else []
  if not steps:
    raise CheckpointError(path, "holds no committed checkpoint",
                          "pass a run's workdir, its checkpoints folder or a step folder")
  if step is not None and step not in steps:
    raise CheckpointError(folder, f"has no step {step} (it has {', '.join(map(str, steps))})", "pick one of them")
  return os.path.join(folder, str(step if step is not None else steps[-1]))


def saved_config(step_dir: str) -> dict:
  """The resolved config a checkpoint was written with: its ``config`` item, else its workdir's config.json."""
  for f in (os.path.join(step_dir, "config", "metadata"),
            os.path.join(os.path.dirname(os.path.dirname(step_dir)), "config.json")):
    if os.path.exists(f):
      return json.loads(open(f).read())
  raise CheckpointError(step_dir, "has no config item and its workdir no config.json",
                        "pass a checkpoint written by jaxtrain")


def side_files_dir(step_dir: str, config: dict) -> str | None:
  """The ``hf`` folder of the import this checkpoint comes from: next to its checkpoints folder, or next to the
  checkpoint its run started from (``checkpoint.restore_from``)."""
  candidates = [os.path.dirname(os.path.dirname(step_dir))]
  restore_from = (config.get("checkpoint") or {}).get("restore_from")
  if restore_from:
    candidates += [os.path.dirname(restore_from.rstrip("/")), os.path.dirname(os.path.dirname(
        restore_from.rstrip("/")))]
  return next((os.path.join(c, "hf") for c in candidates if os.path.isdir(os.path.join(c, "hf"))), None)

"""The persistent tier: Orbax checkpoints in ``checkpoint.dir`` (local, ``gs://`` or ``s3://``), every process's
shards of one step in one folder that every process reads; async multi-host saves, retention, restore onto any mesh.

Each checkpoint step holds four items: ``state`` (the train state pytree: params, optimizer state, step),
``data`` (every process's data position, one JSON file per process), ``meta`` (JSON: jaxtrain version, mesh,
loss, tokens seen, wall time, seed) and ``config`` (the resolved config). Saves are written into
``<step>.orbax-checkpoint-tmp`` and committed by rename, so a killed save is never mistaken for a checkpoint; on an
object store, which has no rename, into ``<step>`` and committed by writing ``<step>/commit_success.txt`` last
(Orbax's commit file: a step without it is not listed). Each commit first asks the workdir's lock
(:func:`fenced_commits`): a run that no longer holds its workdir commits nothing. A store that does not answer
(stopped, unreachable) fails a save, a listing or a restore within a bounded time (:mod:`jaxtrain.stores`) and ends the
run restartable (:class:`StoreUnreachable`, exit 75), never as a corrupt step.
This module knows nothing of the trainer: it saves the pytree it is given and restores against the abstract
pytree (ShapeDtypeStructs with the *current* shardings) it is handed, which is what makes restoring onto
another mesh work. Before reading a step it compares the saved tensor shapes with that pytree: another model
or optimizer is the user's mistake (an error, nothing touched), not a corrupt checkpoint to fall back from.
The data position is saved and restored only through :class:`DataPosition` (``get_state``, ``set_state``,
``resplit``), so any iterator that has those three methods resumes exactly, Grain's or not; one saved by another
number of processes is re-split by the iterator itself. Creating a tier also quiets Orbax's INFO narration
(:func:`quiet_libraries`), from the command line and from Python alike.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import logging as std_logging
import os
import sys
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from jaxtrain import _compat
from jaxtrain import integrity
from jaxtrain import paths
from jaxtrain import stores
from jaxtrain import workdir as workdir_lib
from jaxtrain.errors import UserError
from jaxtrain.checkpoint.errors import (CheckpointError, CorruptCheckpoint, NonFiniteState, SaveFailed, describe,
                                        environment_error, read_failure)
from jaxtrain.checkpoint.tier import TIERS, DataPosition


# How the data position is stored. Positions differ per process, so every process writes its own: the ``data``
# item holds one JSON file per process, process_<i>-of-<n>.json, written by that process through Orbax's
# JsonCheckpointHandler with primary_host=None (Orbax's switch for "every process writes"; by default only
# process 0 writes JSON). It is part of the same Composite save as the state: written in the background and
# committed with it, with nothing gathered across processes. The file name is the one Grain's Orbax handler wrote
# (the data item of checkpoints from before DataPosition), so those restore unchanged. ``meta`` records n
# (``data_processes``); a run with another process count reads all n files, with Orbax's handler, and hands
# them to DataPosition.resplit. Checkpoints older than that record hold nothing but the n position files.
_DATA_PROCESSES = "data_processes"

# The file whose presence commits a step on an object store (Orbax's CommitFileTemporaryPath writes it last).
_COMMIT_FILE = "commit_success.txt"


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


# The object stores' Python clients (etils.epath's fsspec filesystems), which log each request they gave up on with
# its traceback (gcsfs) before raising it.
_STORE_CLIENT_LOGGERS = ("gcsfs", "s3fs")


# Orbax's background writes that failed, as its threads logged them ((monotonic time, the exception), newest last):
# what PersistentTier.wait raises when Orbax's own wait does not return (see _wait_bounded).
_BACKGROUND_FAILURES: collections.deque = collections.deque(maxlen=16)
FAILED_WAIT_S = 10.0  # how long a wait goes on after a background write was seen to fail


def _wait_bounded(manager, since: float) -> None:
  """``manager.wait_until_finished()``, but when a background write of the save started at ``since`` has failed and
  the wait has not returned ``FAILED_WAIT_S`` later, that failure is raised. Orbax (0.12.x) runs a save's writes as
  threads that wait for each other's signals; when one fails before it sends its signal, the others wait for it until
  their barrier's timeout (300 s), and so does wait_until_finished before it reports the failure: a failed save would
  hold the run for minutes. Its threads log the failure when it happens (_QuietLibraries sees the record): that error
  is the save's, raised here. (A thread still blocked in Orbax is left behind: the run stops on the error.)"""
  done, outcome = threading.Event(), {}

  def wait():
    try:
      manager.wait_until_finished()
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      outcome["error"] = e
    finally:
      done.set()

  threading.Thread(target=wait, name="jaxtrain-checkpoint-wait", daemon=True).start()
  while not done.wait(0.2):
    failed = [(t, e) for t, e in list(_BACKGROUND_FAILURES) if t >= since]
    if failed and time.monotonic() - failed[0][0] > FAILED_WAIT_S:
      raise failed[0][1]
  if "error" in outcome:
    raise outcome["error"]


class _QuietLibraries(std_logging.Filter):
  """Orbax logs every save phase at INFO; keep its warnings and errors, drop the rest. A failed background write
  (disk full, permissions, an object store that does not answer) is logged with whole tracebacks by Orbax, by
  asyncio (for Orbax's other write tasks) and by the stores' clients, and then raised again to us, where it becomes
  jaxtrain's one-line error: keep their lines, fold each traceback into the exception's type and message."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    from_orbax = "/orbax/" in record.pathname
    folded = from_orbax or record.name == "asyncio" or record.name.split(".")[0] in _STORE_CLIENT_LOGGERS
    if from_orbax and record.levelno >= std_logging.ERROR and record.exc_info and record.exc_info[1] is not None \
        and "Future" not in type(record.exc_info[1]).__name__ and not isinstance(record.exc_info[1], TimeoutError):
      _BACKGROUND_FAILURES.append((time.monotonic(), record.exc_info[1]))  # (see _wait_bounded)
    if (folded and record.levelno >= std_logging.ERROR and record.exc_info
        and record.exc_info[1] is not None):
      first = record.getMessage().splitlines()[0]
      record.msg, record.args = f"{first}: {describe(record.exc_info[1])}", None
      record.exc_info, record.exc_text = None, None
    return not from_orbax or record.levelno >= std_logging.WARNING


LIBRARY_LOG_FILTER = _QuietLibraries()
"""The filter that :func:`quiet_libraries` puts on the loggers Orbax and asyncio log to. To see Orbax's INFO lines
again: ``absl.logging.get_absl_logger().removeFilter(checkpoint.LIBRARY_LOG_FILTER)``."""


def _drop_library_echoes(unraisablehook):
  """After a failed write, Orbax's event loop closes while TensorStore still completes the other in-flight
  writes; each completion then fails to wake the closed loop and prints an "unraisable" traceback from a C++
  thread. After a failed read (a corrupt step on a store, set aside and fallen back from), the reads of the step's
  other chunks are left unfinished, and each one the garbage collector later closes raises Orbax's wrapper of the
  GeneratorExit (a traceback each: 160 for a tiny model's state). The error itself is reported once (see
  _QuietLibraries); drop exactly those echoes and hand everything else to ``unraisablehook`` (the hook that was
  installed before)."""

  def hook(unraisable):
    closed_loop = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
    obj = unraisable.object
    abandoned_read = (inspect.iscoroutine(obj) and "orbax" in obj.cr_code.co_filename
                      and isinstance(getattr(unraisable.exc_value, "__cause__", None), GeneratorExit))
    if not (closed_loop or abandoned_read):
      unraisablehook(unraisable)
  hook.drops_library_echoes = True
  return hook


def quiet_libraries() -> None:
  """Keeps Orbax's INFO narration of every save out of the log (its warnings and errors stay, each traceback of a
  failed write folded into one line) and drops the unraisable echoes of a failed write or read. Called by
  every Checkpointer, so that training from Python (a notebook, a test) logs what the command line logs;
  idempotent. The filters sit on the loggers, not on a handler, so they hold whatever handlers are attached
  (absl's, pytest's, a notebook's). ``sys.unraisablehook`` is wrapped, not replaced: whatever hook is installed
  still gets every other unraisable exception (it is wrapped again if someone installs another one later)."""
  # Orbax logs through absl's logger, a few of its modules through the root logger itself; asyncio and the stores'
  # clients through their own.
  # A logger's filters see only the records logged to it, not those its children pass up.
  for logger in (logging.get_absl_logger(), std_logging.getLogger(), std_logging.getLogger("asyncio"),
                 *map(std_logging.getLogger, _STORE_CLIENT_LOGGERS)):
    logger.addFilter(LIBRARY_LOG_FILTER)  # a no-op when it is there already
  if not getattr(sys.unraisablehook, "drops_library_echoes", False):
    sys.unraisablehook = _drop_library_echoes(sys.unraisablehook)


def _policies(every_steps: int, every_minutes: float, keep_last: int, keep_every: int):
  cm = ocp.checkpoint_managers
  save = [cm.FixedIntervalPolicy(every_steps)] if every_steps else []
  if every_minutes:
    save.append(cm.ContinuousCheckpointingPolicy(minimum_interval_secs=max(1, round(every_minutes * 60))))
  keep = [cm.LatestN(keep_last)] + ([cm.EveryNSteps(keep_every)] if keep_every else [])
  # With no periodic policy, only forced saves (end of training, preemption) are written.
  return cm.AnySavePolicy(save or [cm.SpecificStepsPolicy(())]), cm.AnyPreservationPolicy(keep)


class PersistentTier:
  """The :class:`jaxtrain.checkpoint.Tier` every run has, first in ``checkpoint.tiers``: an Orbax
  CheckpointManager over one folder every process reads. Its failed save ends the run (CheckpointError: the
  user's to fix, or SaveFailed)."""

  name = "persistent"
  failures = 0

  def __init__(self, directory: str, *, every_steps: int = 0, every_minutes: float = 0, keep_last: int = 3,
               keep_every: int = 0, async_save: bool = True, verify: bool = True,
               fence: workdir_lib.WorkdirLock | None = None):
    """``verify``: fingerprint every array at save time (in ``meta``) and, on restore, check the arrays against
    them and for non-finite values; a mismatch is treated as corruption. A data position saved by another
    process count is re-split by the iterator (:meth:`DataPosition.resplit`). ``fence``: the workdir lock whose
    holder alone may save and commit (:func:`fenced_commits`); default: the one this process holds
    (:func:`jaxtrain.workdir.held`: process 0 of a run, which commits every step), none elsewhere. Installs
    :func:`quiet_libraries`."""
    quiet_libraries()
    if jax.default_backend() == "cpu":  # CPU devices share nothing by splitting a save among replicas
      _compat.orbax_one_replica_writes()
    self.verify = verify
    self.directory = epath.Path(paths.resolve(os.fspath(directory), "checkpoint.dir"))  # Orbax wants absolute paths
    self.where = os.fspath(self.directory)
    self.on_store = stores.is_store(self.where)
    reach(self.where)
    save_policy, keep_policy = _policies(every_steps, every_minutes, keep_last, keep_every)
    # Object stores have no rename: a step is committed by its commit file (Orbax's default on gs://, asked for here
    # on s3://, where Orbax would otherwise copy every object of the step to "rename" it, and not atomically).
    atomicity = ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE) if self.on_store else None
    self.fence = fence if fence is not None else workdir_lib.held()
    fenced = fenced_commits(self.fence, self.directory, self.on_store) if self.fence is not None else None
    options = ocp.CheckpointManagerOptions(save_decision_policy=save_policy, preservation_policy=keep_policy,
                                           enable_async_checkpointing=async_save, create=True,
                                           atomicity_options=atomicity, temporary_path_class=fenced)
    # state, meta and config get Orbax's handlers for their args; data gets this process's own file.
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    positions = _position_handler(jax.process_index(), jax.process_count())
    registry.add("data", ocp.args.JsonSave, positions)
    registry.add("data", ocp.args.JsonRestore, positions)
    try:
      self.manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
    except Exception as e:
      self._raise_environment(e, "opening the checkpoint folder")
      raise
    self.last_save_blocked_s = 0.0
    self._warned_data = False
    self._started = time.monotonic()  # the newest save's start (its background failures are those after it)
    self._failed = False  # a save failed and was raised

  def steps(self) -> list[int]:
    try:
      return sorted(self.manager.all_steps())
    except Exception as e:
      self._raise_environment(e, "listing the checkpoints")
      raise

  def _raise_environment(self, e: BaseException, doing: str) -> None:
    """Raises what the run stops with when ``e`` is the storage's or the memory's failure (see
    :func:`jaxtrain.checkpoint.errors.environment_error`: exit 2 for the user's to fix, 75 for what a restart
    cures)."""
    stop = environment_error(e, self.where, doing, "earlier checkpoints are intact")
    if stop is not None:
      raise stop from e

  def should_save(self, step: int) -> bool:
    return self.manager.should_save(step)

  def save(self, step: int, state: Any, data_iterator, meta: dict, config: dict, force: bool = False,
           summary: tuple[dict[str, int], list[str]] | None = None) -> bool:
    """Starts (async) or does (sync) a save; returns whether one was started. ``summary``: the state's
    :func:`jaxtrain.integrity.read` if the train step already computed it (else it is computed here, one
    pass over the state). Raises NonFiniteState (nothing written) if the state has non-finite values, and
    CheckpointError when the previous async save failed: that is where disk-full and permission errors
    surface. A run that no longer holds its workdir (``fence``) raises LeaseLost, nothing written."""
    t = time.perf_counter()
    if self.fence is not None:  # the holder's token and generation, in the step's meta
      meta = {**meta, "lease": self.fence.fence()}
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
    self.wait()  # the previous save's outcome first (Orbax's save() waits for it too, but unbounded: see wait)
    self._started = time.monotonic()
    try:
      saved = self.manager.save(step, args=args, force=force)
    except Exception as e:  # an earlier async write failed, or this one could not start
      self._failed = True
      _raise_lease_lost(e)
      self._raise_environment(e, "saving a checkpoint")
      raise self._write_error(e) from e
    self.last_save_blocked_s = time.perf_counter() - t
    return saved

  def wait(self) -> None:
    """Blocks until pending saves are committed; raises what the run stops with if one failed (see
    :func:`jaxtrain.checkpoint.errors.environment_error`, :class:`SaveFailed`)."""
    try:
      _wait_bounded(self.manager, self._started)
    except Exception as e:
      self._failed = True
      _raise_lease_lost(e)
      self._raise_environment(e, "saving a checkpoint")
      raise self._write_error(e) from e

  def _write_error(self, e: Exception) -> Exception:
    """A failed save that is not the storage's nor the memory's (those are raised by :meth:`_raise_environment`):
    reported as what it is (SaveFailed, with the original error as its cause), never blamed on the disk."""
    failed = SaveFailed(f"{os.fspath(self.directory)}: saving a checkpoint failed ({describe(e)}); this is not a "
                        "storage problem but a bug in jaxtrain or a library it uses; earlier checkpoints are intact")
    failed.__cause__ = e
    return failed

  def restorable(self, abstract_state: Any, newer_than: int) -> list[int]:
    """Every committed step newer than ``newer_than``: any of them restores onto any mesh."""
    self.wait()  # a save still in flight (a rollback right after a save) must commit before it is read
    return [s for s in self.steps() if s > newer_than]

  def restore(self, step: int, abstract_state: Any, data_iterator) -> tuple[Any, dict]:
    """``step`` onto the shardings in ``abstract_state``, checked against its fingerprints (``verify``), and
    ``data_iterator`` moved to its position. A step written for another model or optimizer raises
    CheckpointError before any tensor is read; a data position that does not fit this run (another global
    batch), the iterator's UserError."""
    try:
      self.check_compatible(step, abstract_state)
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
      if self.verify:
        verify(restored["state"], restored["meta"])
      self._restore_data_position(step, data_iterator, restored["meta"])
    except (CorruptCheckpoint, UserError):  # bad bytes; another model's checkpoint, another global batch
      raise
    except Exception as e:  # only bytes proven bad set a step aside: a 403, a 503, an EIO, an OOM raise by cause
      failure = read_failure(e, self.where, step)
      if failure is e:
        raise
      raise failure from e
    return restored["state"], dict(restored["meta"])

  def check_compatible(self, step: int, abstract_state: Any) -> None:
    """Raises CheckpointError if ``step`` was written for another model or optimizer (tensor names or shapes
    differ from ``abstract_state``), reading only metadata. Unreadable metadata raises what the read raised."""
    mismatch = shape_mismatch(saved_tensors(self.directory / str(step) / "state"), abstract_state)
    if mismatch and all(part.startswith("extra/") for part in mismatch.split("; ")):
      # The objective's own state alone (TrainState.extra: GRPO's rollouts ahead)
      raise CheckpointError(os.fspath(self.directory / str(step)), f"holds another objective state ({mismatch})",
                            "resume with the rl.max_staleness (and train.objective) that wrote it, or start a new "
                            "workdir")
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

  def set_aside(self, step: int, error: Exception) -> None:
    """Renames a bad step to ``corrupt-<step>-<time>`` (on an object store: moves its objects there), so that it is
    neither restored nor overwritten, and keeps it for inspection."""
    logging.warning("checkpoint step %d in %s cannot be restored (%s); set aside, falling back to the previous "
                    "one", step, self.directory, describe(error))
    if jax.process_index() == 0:
      src, dst = self.directory / str(step), self.directory / f"corrupt-{step}-{int(time.time())}"
      try:
        if src.exists() and self.on_store:
          # Uncommitted first (Orbax's commit file, see the module's docstring), so that a move cut short leaves no
          # listed step behind; then its objects are moved one by one.
          (src / _COMMIT_FILE).unlink(missing_ok=True)
          stores.move_folder(os.fspath(src), os.fspath(dst))
        elif src.exists():
          src.rename(dst)
      except Exception as e:
        self._raise_environment(e, f"setting checkpoint step {step} aside")
        raise
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxtrain_set_aside_{step}")
    self.manager.reload()

  def forget_after(self, step: int) -> None:
    """Deletes the committed steps past ``step``. A run goes on from this tier's newest step that restores or
    from a newer step of another tier, so there are none unless a step was added behind the run's back."""
    for newer in [s for s in self.steps() if s > step]:
      try:
        self.manager.delete(newer)
      except Exception as e:
        self._raise_environment(e, f"deleting checkpoint step {newer} (past the step the run goes on from)")
        raise

  def close(self) -> None:
    """Waits for the saves in flight and releases Orbax's manager. After a failed save (already raised, by
    :meth:`save` or :meth:`wait`: the run is stopping on it) nothing is waited for: Orbax would raise it again, over
    the error being handled, or wait for its stuck threads (see :func:`_wait_bounded`)."""
    if not self._failed:
      self.manager.close()


def fenced_commits(fence: workdir_lib.WorkdirLock, directory: epath.Path, on_store: bool) -> type:
  """Orbax's temporary path class for the steps in ``directory`` (committed by a commit file on an object store, by a
  rename on a local disk) with each step's commit asking ``fence`` first (:meth:`jaxtrain.workdir.WorkdirLock.confirm`:
  this run still holds the workdir, the lock read back naming it). A run that lost the workdir raises LeaseLost there,
  in Orbax's commit (on the primary process, where the lock is): the step stays uncommitted, which restore ignores and
  the next save of that step replaces, and the save fails (exit 75). The steps' items commit inside the step, unseen
  until it commits: only the step's own commit asks.

  Why a class: Orbax's one hook before a commit is the temporary path class that ``CheckpointManagerOptions``
  takes (``temporary_path_class``: public, deprecated since orbax-checkpoint 0.12.3 for ``AtomicityOptions``, whose
  modes take no class; there from 0.12.0, read in its source, to 0.12.8, run); the subclass commits as its base does,
  after the fence."""
  atomicity = ocp.path.atomicity
  base = atomicity.CommitFileTemporaryPath if on_store else atomicity.AtomicRenameTemporaryPath
  root = os.fspath(directory)

  class FencedCommit(base):

    async def finalize(self, *args, **kwargs):
      if os.fspath(self.get_final().parent) == root:
        await asyncio.to_thread(fence.confirm)
      await super().finalize(*args, **kwargs)

  return FencedCommit


def _raise_lease_lost(e: BaseException) -> None:
  """Raises the LeaseLost behind ``e`` (a commit the fence refused, surfacing at the next save or wait) as itself: a
  restart cures it (exit 75); it is neither the storage's failure nor a bug."""
  lost = workdir_lib.lease_lost(e)
  if lost is not None:
    raise lost from None


@TIERS.register("persistent")
def from_config(config) -> PersistentTier:
  """The persistent tier of ``config.checkpoint`` (``dir``, ``every_steps``, ``every_minutes``, ``keep_last``,
  ``keep_every``, ``async``, ``verify``)."""
  c = config.checkpoint
  return PersistentTier(c.dir, every_steps=c.every_steps, every_minutes=c.every_minutes, keep_last=c.keep_last,
                        keep_every=c.keep_every, async_save=c["async"], verify=c.verify)


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


def reach(path: str) -> None:
  """Readies Orbax for checkpoints under ``path``: on an object store, its client library is checked and Orbax's
  TensorStore reads and writes are pointed at it (:func:`jaxtrain._compat.orbax_object_stores`)."""
  if stores.is_store(path):
    stores.check_client(path, path)
    _compat.orbax_object_stores()


def committed_steps(root) -> list[int]:
  """The committed steps in the checkpoints folder ``root`` (local or on an object store), ascending. Orbax's
  unfinished saves are ``<step>.orbax-checkpoint-tmp`` folders on a local disk; on an object store they are
  ``<step>`` folders without their commit file."""
  root = epath.Path(root)
  if not root.exists():
    return []
  on_store = stores.is_store(os.fspath(root))
  return sorted(int(p.name) for p in root.iterdir()
                if p.name.isdigit() and (not on_store or (p / _COMMIT_FILE).exists()))


def saved_tensors(state_dir) -> dict[str, Any]:
  """``'params/layers/mlp/up/kernel' -> ArrayMetadata`` (shape, dtype) of a saved train state, from its
  metadata alone (no tensor data is read)."""
  reach(os.fspath(state_dir))
  tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_dir)).tree
  return integrity.named(tree)


def shape_mismatch(saved: dict[str, Any], abstract_state: Any) -> str:
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



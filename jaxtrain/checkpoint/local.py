"""The node-local checkpoint tier: frequent saves of every process's own shards to its own disk
(``checkpoint.local_dir``, e.g. a local NVMe or ``/dev/shm``), beside the rarer persistent tier
(:mod:`jaxtrain.checkpoint.persistent`). A :class:`jaxtrain.checkpoint.Tier`, named ``local``.

Each process writes ``<local_dir>/run-<key>/process_<i>-of-<n>/<step>/``: its addressable shards (``shards.npz``,
each distinct shard once), its data position and the step's ``meta`` with the fingerprints of the whole state.
``<key>`` is a short hash of the run's persistent checkpoint folder, so runs that share ``local_dir`` never see, prune
or delete each other's steps. The device-to-host copy blocks the loop; the files are written by a background thread
into ``<step>.tmp``, synced (files, then the folder) and committed by renaming it, then the parent folder is synced:
a killed save is never taken for a checkpoint. A step saved again is replaced by renames (the old one aside, the new
one in, the old one deleted), so a failed replace keeps the old step. The newest ``keep_last`` steps are kept, and
never fewer than the newest step every process has plus the one being written.

The tier is optional, and it never ends a run. A failed write (a full disk or ``/dev/shm``) is settled at the next
save, on every process at once: a step that failed on any process is deleted on all of them (no restore can mix it
in), the first failure is warned about in one line, every one is counted (:attr:`LocalTier.failures`, logged
as ``checkpoint/local_failures``) and the run goes on with the persistent tier; after ``max_failures`` in a row the
tier is switched off for the rest of the run, on every process.

On restart every process lists the committed local steps that fit this run's layout (the same process count,
mesh and shardings: each process reads back exactly its shards) and are newer than the newest persistent step;
the processes agree on the newest step that all of them have (one gather), restore it and check the fingerprints
on the whole state (a step whose bytes are proven bad on any process, a file that does not decode or is missing or
fingerprints that differ, is set aside everywhere and the next one tried; a disk that fails a read has the tier passed
over, nothing set aside). A replaced host, with an empty local disk, has no such step: every process then resumes from the
persistent tier, which restores onto any layout (:meth:`jaxtrain.checkpoint.Checkpointer.restore` tries the
tiers' steps newest first). Whatever a run resumes or rolls back to, :meth:`LocalTier.forget_after` then deletes the
local steps newer than it on every process before training goes on: they belong to the abandoned timeline, and a
crash must never resume one.

Why not Orbax here: Orbax's ordinary CheckpointManager assumes one storage every process sees (process 0 commits
the step), which node-local disks are not; its emergency (multi-tier) CheckpointManager saves the train state
alone (no data position, no metadata: its own TODO) and its persistent tier is written by one replica of a
multi-slice mesh. So this tier writes each process's shards itself, with numpy.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
import time
import zipfile
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from jaxtrain import failures
from jaxtrain import integrity
from jaxtrain import paths
from jaxtrain.checkpoint.errors import (CorruptCheckpoint, NonFiniteState, TierUnavailable, describe,
                                        environment_error, proven_corrupt)
from jaxtrain.checkpoint.tier import TIERS, DataPosition

_MAX_STEPS = 32  # local steps each process offers for the agreement on restore
# Leftovers of an interrupted write or delete: removed at the next start (with the steps set aside, corrupt-*).
_STALE_SUFFIXES = (".tmp", ".trash")


def run_key(owner: str) -> str:
  """The name of a run's folder in ``local_dir``: ``run-`` and 12 hex digits of the SHA-256 of ``owner`` (the
  run's resolved persistent checkpoint folder)."""
  return "run-" + hashlib.sha256(owner.encode()).hexdigest()[:12]


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
  """A shard's index as [[start, stop], ...] per dimension."""
  return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


class LocalTier:
  """The node-local :class:`jaxtrain.checkpoint.Tier` (see the module's docstring). Always fingerprinted; a failed
  save is counted, never raised."""

  name = "local"
  verify = True

  def __init__(self, directory: str, every_steps: int, keep_last: int = 2, owner: str = "", max_failures: int = 3):
    """``owner``: the persistent checkpoint folder of the run (it names the run's folder in ``directory`` and is
    recorded with every local step). ``max_failures``: failed saves in a row after which the tier is switched
    off. Removes what an interrupted save or an earlier restore left in this process's folder."""
    self.root, self.owner = os.path.abspath(directory), owner
    self.where = f"local tier, {self.root}"
    self.run_dir = os.path.join(self.root, run_key(owner))
    self.directory = os.path.join(self.run_dir, f"process_{jax.process_index()}-of-{jax.process_count()}")
    self.every_steps, self.keep_last, self.max_failures = every_steps, keep_last, max_failures
    self.enabled = True  # the same on every process once restore() has run: agreed there and at each failure
    self.failures = 0  # failed saves in all (a save failed if it failed on any process): checkpoint/local_failures
    self.in_a_row = 0
    self._warned = False
    self._writer: threading.Thread | None = None
    self._pending: int | None = None  # the step written last, until its outcome is settled on every process
    self._error: BaseException | None = None  # why this process's write of it failed
    self._committed = False  # whether this process's write of it reached its commit
    self.last_save_blocked_s = 0.0
    try:
      os.makedirs(self.directory, exist_ok=True)
      self._remove_leftovers()
    except OSError as e:
      self._switch_off(f"its folder cannot be used ({describe(e)})")

  def steps(self) -> list[int]:
    """This process's committed local steps."""
    try:
      names = os.listdir(self.directory)
    except OSError:
      return []
    return sorted(int(p) for p in names if p.isdigit() and os.path.exists(os.path.join(self.directory, p,
                                                                                        "meta.json")))

  def should_save(self, step: int) -> bool:
    return self.enabled and bool(self.every_steps) and step % self.every_steps == 0

  def save(self, step: int, state: Any, data_iterator, meta: dict, config: dict | None = None, force: bool = False,
           summary: tuple[dict[str, int], list[str]] | None = None) -> bool:
    """Settles the previous write (:meth:`wait`), then copies this process's shards of ``state`` to host memory
    (the loop waits for that) and writes them with the data position and ``meta`` in the background; returns
    whether a write was started. Raises NonFiniteState (nothing written) for a non-finite state; a failed write
    raises nothing (see the module's docstring). Every process must call it at the same steps. ``config`` is not
    kept (the persistent tier keeps it); ``force`` changes nothing (the loop forces only persistent saves)."""
    t = time.perf_counter()
    self.wait()
    if not self.enabled:  # switched off just now
      self.last_save_blocked_s = time.perf_counter() - t
      return False
    fingerprints, nonfinite = summary if summary is not None else integrity.summarize(state)
    if nonfinite:
      raise NonFiniteState(f"non-finite values in {nonfinite[0]}")
    self._pending, self._error, self._committed = step, None, False
    arrays, shards = {}, {}
    try:
      for name, array in integrity.named(state).items():
        seen = {}
        for shard in array.addressable_shards:
          where = json.dumps(_index(shard.index, array.shape))
          if where not in seen:
            seen[where] = f"a{len(arrays)}"
            # device -> host: what the loop waits for. A copy, never a view: on CPU np.asarray may alias the
            # device buffer, which the next step (donating the state) may reuse while the thread writes.
            arrays[seen[where]] = np.array(shard.data, copy=True)
          shards.setdefault(name, []).append({"device": shard.device.id, "index": json.loads(where),
                                              "key": seen[where]})
    except MemoryError as e:  # the host is out of memory for the copy: a failed save like any other
      self._error = e
      self.last_save_blocked_s = time.perf_counter() - t
      return True
    position = data_iterator.get_state() if isinstance(data_iterator, DataPosition) else None
    record = {**meta, "fingerprints": fingerprints, "shards": shards, "position": position,
              "layout": self._layout()}
    # Every step on disk is settled (agreed) by now: the newest keep_last - 1 of them stay beside this one, and the
    # newest always (if this one fails on any process, it is what a restart has).
    prune = self.steps()[:-max(self.keep_last - 1, 1)]
    self._writer = threading.Thread(target=self._write, args=(step, arrays, record, prune), daemon=True,
                                    name=f"jaxtrain-local-save-{step}")
    self._writer.start()
    self.last_save_blocked_s = time.perf_counter() - t
    return True

  def _write(self, step: int, arrays: dict[str, np.ndarray], record: dict, prune: list[int]) -> None:
    for old in prune:  # first: the space they take may be what this write needs
      _remove(os.path.join(self.directory, str(old)))
    tmp, final = os.path.join(self.directory, f"{step}.tmp"), os.path.join(self.directory, str(step))
    try:
      _remove(tmp)
      os.makedirs(tmp)
      # Raw bytes: np.load cannot read every dtype back (bfloat16 comes back as void); the record keeps the dtype.
      with open(os.path.join(tmp, "shards.npz"), "wb") as f:
        np.savez(f, **{k: a.reshape(-1).view(np.uint8) for k, a in arrays.items()})
        _sync(f)
      record["arrays"] = {k: [str(a.dtype), list(a.shape)] for k, a in arrays.items()}
      with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(record, f)
        _sync(f)
      _sync_folder(tmp)
      self._commit(tmp, final)
    except Exception as e:  # noqa: BLE001 - settled on every process by the next save or wait
      self._error = e
      _remove(tmp)  # the space the partial files took

  def _commit(self, tmp: str, final: str) -> None:
    """``tmp`` renamed to ``final``; a ``final`` already there is renamed aside first and deleted after, so that a
    failed rename keeps it."""
    aside = f"{final}.old" if os.path.exists(final) else None
    if aside:
      _remove(aside)
      os.rename(final, aside)
    try:
      os.rename(tmp, final)  # the commit
    except BaseException:
      if aside:
        os.rename(aside, final)
      raise
    self._committed = True
    try:
      _sync_folder(self.directory)
    finally:
      if aside:
        _remove(aside)

  def wait(self) -> None:
    """Blocks until the write in flight is done, then settles its outcome on every process (a gather on a
    multi-process job: every process must call it). A step that failed anywhere is deleted everywhere; the first
    failure is warned about, every one counted; ``max_failures`` in a row switch the tier off."""
    if self._writer is not None:
      self._writer.join()
      self._writer = None
    step, error, committed = self._pending, self._error, self._committed
    if step is None:
      return  # the same on every process: all of them save at the same steps
    self._pending, self._error = None, None
    if _everywhere(error is None):
      self.in_a_row = 0
      return
    self.failures += 1
    self.in_a_row += 1
    if committed:  # written here, failed on another process (or after its commit): restorable nowhere
      _remove(os.path.join(self.directory, str(step)))
    if not self._warned:
      self._warned = True
      cause = f"({describe(error)})" if error is not None else "on another process (its log names the cause)"
      logging.warning("local checkpoint step %d not saved to %s %s; the run goes on with the persistent tier, "
                      "failures are counted in checkpoint/local_failures, and after %d in a row the local tier is "
                      "switched off (checkpoint.local_max_failures)", step, self.directory, cause,
                      self.max_failures)
    if self.in_a_row >= self.max_failures:
      self._switch_off(f"{self.in_a_row} saves in a row failed (checkpoint.local_max_failures={self.max_failures})")

  def _switch_off(self, why: str) -> None:
    if self.enabled:
      logging.warning("local checkpoint tier %s switched off for the rest of this run: %s; the persistent tier goes "
                      "on", self.directory, why)
    self.enabled = False

  def _layout(self) -> dict:
    return {"run": self.owner, "processes": jax.process_count(), "process": jax.process_index(),
            "devices": [d.id for d in jax.local_devices()]}

  def _fits(self, step: int, abstract_state: Any) -> bool:
    """Whether ``step`` holds exactly the shards this process needs for ``abstract_state`` (metadata only)."""
    try:
      with open(os.path.join(self.directory, str(step), "meta.json")) as f:
        record = json.load(f)
    except (OSError, ValueError):
      return False
    if record.get("layout") != self._layout():
      return False
    for name, leaf in integrity.named(abstract_state).items():
      saved = {s["device"]: s["index"] for s in record["shards"].get(name, [])}
      wanted = {d.id: _index(i, leaf.shape) for d, i in leaf.sharding.addressable_devices_indices_map(
          leaf.shape).items()}
      if saved != wanted:
        return False
    return True

  def restorable(self, abstract_state: Any, newer_than: int) -> list[int]:
    """The steps newer than ``newer_than`` that every process has and that fit this layout (the same process
    count, mesh and shardings: each process reads back exactly its shards), newest ``_MAX_STEPS`` of this process's.
    Every process must call it, before any save: it also agrees on whether the tier is on (a process whose folder
    cannot be used switches it off everywhere: then none)."""
    self.wait()
    if not _everywhere(self.enabled):
      self._switch_off("another process cannot use its local folder (its log says why)")
      return []
    mine = [s for s in self.steps() if s > newer_than and self._fits(s, abstract_state)][-_MAX_STEPS:]
    return _common(mine)

  def restore(self, step: int, abstract_state: Any, data_iterator) -> tuple[Any, dict]:
    """``step`` (one of :meth:`restorable`) onto ``abstract_state``'s shardings, its fingerprints checked on the
    whole state, and the data position set. The processes agree on one verdict, the worst of theirs: a part whose
    bytes are proven bad on any process (a file that does not decode or is missing, a fingerprint that differs)
    raises CorruptCheckpoint everywhere (set aside on every process); a disk that failed a read (EIO, ESTALE,
    permissions) raises TierUnavailable everywhere (the run resumes from the persistent tier, nothing set aside: the
    tier is optional); a device or host out of memory raises that failure everywhere (exit 2); a bug raises itself on
    its process and TierUnavailable on the others."""
    loaded, verdict, error = None, _OK, None
    try:
      loaded = self._load(step, abstract_state)
    except Exception as e:  # noqa: BLE001 - judged below, on every process together
      error, verdict = e, _verdict(e)
    worst = _worst(verdict)
    if worst != _OK:
      mine = f"{describe(error)}" if error is not None else "another process's part"
      if worst == _CORRUPT:
        raise CorruptCheckpoint(mine if verdict == _CORRUPT else "another process's part does not read back")
      if worst == _OUT_OF_MEMORY and verdict == _OUT_OF_MEMORY:
        raise environment_error(error, self.directory, f"restoring local checkpoint step {step}",
                                "the step is intact") from error
      if verdict == _BUG:
        raise error
      raise TierUnavailable(f"local checkpoint step {step} in {self.directory}: {mine}")
    state, record = loaded
    fingerprints, nonfinite = integrity.summarize(state)  # on the whole state: the same verdict everywhere
    wrong = [k for k, v in record["fingerprints"].items() if fingerprints.get(k) != v]
    if wrong:
      raise CorruptCheckpoint(f"{wrong[0]} does not match its fingerprint")
    if nonfinite:
      raise CorruptCheckpoint(f"non-finite values in {nonfinite[0]}")
    if record.get("position") is not None and isinstance(data_iterator, DataPosition):
      data_iterator.set_state(record["position"])
    return state, {k: v for k, v in record.items() if k not in ("shards", "position", "layout", "arrays")}

  def forget_after(self, step: int) -> None:
    """The run resumes or rolls back to ``step`` (0: starts from scratch): the local steps past it belong to an
    abandoned timeline and are deleted, on every process, before any of them goes on (a write in flight is
    settled first; one gather at the end: every process must call it). So are the folders of this run's other
    layouts on this disk (another process count), which this layout cannot restore."""
    self.wait()
    for old in self.steps():
      if old > step:
        _remove(os.path.join(self.directory, str(old)))
    try:
      folders = os.listdir(self.run_dir)
    except OSError:
      folders = []
    for folder in folders:
      if folder.startswith("process_") and not folder.endswith(f"-of-{jax.process_count()}"):
        _remove(os.path.join(self.run_dir, folder))
    _everywhere(True)  # no process saves on the new timeline before every process has deleted the old one

  def _load(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    folder = os.path.join(self.directory, str(step))
    with open(os.path.join(folder, "meta.json")) as f:
      record = json.load(f)
    with np.load(os.path.join(folder, "shards.npz")) as npz:
      host = {k: npz[k].view(np.dtype(dtype)).reshape(shape) for k, (dtype, shape) in record["arrays"].items()}
    devices = {d.id: d for d in jax.local_devices()}
    names = integrity.named(abstract_state)
    arrays = {}
    for name, leaf in names.items():
      pieces = [jax.device_put(host[s["key"]], devices[s["device"]]) for s in record["shards"][name]]
      arrays[name] = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, pieces)
    state = jax.tree_util.tree_map_with_path(lambda path, _: arrays[integrity.name(path)], abstract_state)
    return state, record

  def set_aside(self, step: int, error: Exception) -> None:
    """Renames ``step`` to ``corrupt-<step>-<time>`` (deleted at the next start)."""
    why = str(error) if isinstance(error, CorruptCheckpoint) else describe(error)
    logging.warning("local checkpoint step %d in %s cannot be restored (%s); set aside until the next start, "
                    "falling back", step, self.directory, why)
    folder = os.path.join(self.directory, str(step))
    if os.path.exists(folder):
      os.rename(folder, os.path.join(self.directory, f"corrupt-{step}-{int(time.time())}"))

  def close(self) -> None:
    """Waits for this process's write in flight, so that no thread writes into the folder once the run is over
    (its outcome is not agreed: close runs on error paths too, where the other processes may not be)."""
    if self._writer is not None:
      self._writer.join()

  def _remove_leftovers(self) -> None:
    """What an interrupted write or delete left (``.tmp``, ``.trash``) and the steps set aside at an earlier
    restore (``corrupt-*``) are deleted; a step renamed aside by an interrupted replace (``<step>.old``) is put
    back if its replacement was never committed. So is an interrupted delete of one of this run's other layouts."""
    for name in os.listdir(self.run_dir):
      if name.endswith(".trash"):
        _remove(os.path.join(self.run_dir, name))
    for name in os.listdir(self.directory):
      path = os.path.join(self.directory, name)
      if name.endswith(_STALE_SUFFIXES) or name.startswith("corrupt-"):
        _remove(path)
      elif name.endswith(".old"):
        final = path[:-len(".old")]
        if os.path.exists(final):
          _remove(path)
        else:
          os.rename(path, final)


@TIERS.register("local")
def from_config(config) -> LocalTier | None:
  """The local tier of ``config.checkpoint`` (``local_dir``, ``local_every_steps``, ``local_keep_last``,
  ``local_max_failures``), its run folder keyed by ``checkpoint.dir``; None without ``local_dir``."""
  c = config.checkpoint
  if not c.local_dir:
    return None
  return LocalTier(c.local_dir, c.local_every_steps, c.local_keep_last, owner=os.fspath(paths.resolve(c.dir)),
                   max_failures=c.local_max_failures)


def _remove(path: str) -> None:
  """Deletes a folder: first renamed (atomic: a step is gone at once, whatever interrupts the deletion), then
  its files; nothing if it is not there."""
  trash = path if path.endswith(".trash") else f"{path}.trash"
  try:
    if trash != path:
      shutil.rmtree(trash, ignore_errors=True)
      os.rename(path, trash)
  except OSError:
    if os.path.exists(path):
      shutil.rmtree(path, ignore_errors=True)
    return
  shutil.rmtree(trash, ignore_errors=True)


def _sync(f) -> None:
  """A written file's data on the disk."""
  f.flush()
  os.fsync(f.fileno())


def _sync_folder(path: str) -> None:
  """A folder's entries (the files created or renamed in it) on the disk. A file system that cannot sync a
  folder (EINVAL) keeps none to sync."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  except OSError as e:
    if e.errno not in (errno.EINVAL, errno.ENOTSUP):
      raise
  finally:
    os.close(fd)


def _common(steps: list[int]) -> list[int]:
  """The steps every process offered (ascending)."""
  if jax.process_count() == 1:
    return sorted(steps)
  own = np.full(_MAX_STEPS, -1, np.int32)
  own[:len(steps)] = steps
  every = np.asarray(multihost_utils.process_allgather(own))
  return sorted(set.intersection(*[{int(s) for s in row if s >= 0} for row in every]))


# Verdicts on a local step's read, worst last: agreed across processes (the maximum).
_OK, _UNAVAILABLE, _BUG, _OUT_OF_MEMORY, _CORRUPT = range(5)


def _verdict(e: BaseException) -> int:
  """What a failed read of this process's part says (see :meth:`LocalTier.restore`)."""
  failure = failures.classify(e)
  if failure is not None and failure.kind in (failures.DEVICE_OOM, failures.HOST_OOM):
    return _OUT_OF_MEMORY
  if proven_corrupt(e) or isinstance(e, (zipfile.BadZipFile, KeyError)) or (
      failure is not None and failure.kind in (failures.MISSING, failures.CORRUPT)):
    return _CORRUPT  # (a committed step's file missing: its meta.json names what it holds)
  return _UNAVAILABLE if failure is not None else _BUG


def _worst(verdict: int) -> int:
  """The worst verdict of every process (a gather on a multi-process job: every process must call it)."""
  if jax.process_count() == 1:
    return verdict
  return int(np.asarray(multihost_utils.process_allgather(np.int32(verdict))).max())


def _everywhere(ok: bool) -> bool:
  """Whether ``ok`` holds on every process (a gather on a multi-process job: every process must call it)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.asarray(multihost_utils.process_allgather(np.int32(ok))).min())

"""The node-local checkpoint tier: frequent saves of every process's own shards to its own disk (``checkpoint.local_dir``,
e.g. a local NVMe or ``/dev/shm``), beside the rarer persistent tier of :mod:`jaxtrain.checkpoint`.

Each process writes ``<local_dir>/process_<i>-of-<n>/<step>/``: its addressable shards (``shards.npz``, each
distinct shard once), its data position and the step's ``meta`` with the fingerprints of the whole state. The
device-to-host copy blocks the loop; the file is written by a background thread into ``<step>.tmp`` and committed
by renaming it, so a killed save is never taken for a checkpoint. The newest ``keep_last`` steps are kept.

On restart every process lists the committed local steps that fit this run's layout (the same process count,
mesh and shardings: each process reads back exactly its shards) and are newer than the newest persistent step;
the processes agree on the newest step that all of them have (one gather), restore it and check the fingerprints
on the whole state (a step any process cannot read, or whose fingerprints differ, is set aside everywhere and the
next one tried). A replaced host, with an empty local disk, has no such step: every process then resumes from the
persistent tier (:meth:`jaxtrain.checkpoint.Checkpointer.restore`), which restores onto any layout.

Why not Orbax here: Orbax's ordinary CheckpointManager assumes one storage every process sees (process 0 commits
the step), which node-local disks are not; its emergency (multi-tier) CheckpointManager saves the train state
alone (no data position, no metadata: its own TODO) and its persistent tier is written by one replica of a
multi-slice mesh. So this tier writes each process's shards itself, with numpy.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from jaxtrain import integrity
from jaxtrain.checkpoint import CheckpointError, CorruptCheckpoint, DataPosition, NonFiniteState, describe

_MAX_STEPS = 32  # local steps each process offers for the agreement on restore


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
  """A shard's index as [[start, stop], ...] per dimension."""
  return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


class LocalCheckpointer:

  def __init__(self, directory: str, every_steps: int, keep_last: int = 2, owner: str = ""):
    """``owner``: the persistent checkpoint folder of the run (recorded with every local step: a local folder
    shared by several runs never hands one run's steps to another)."""
    self.root, self.owner = os.path.abspath(directory), owner
    self.directory = os.path.join(self.root, f"process_{jax.process_index()}-of-{jax.process_count()}")
    self.every_steps, self.keep_last = every_steps, keep_last
    try:
      os.makedirs(self.directory, exist_ok=True)
    except OSError as e:
      raise CheckpointError(directory, f"cannot use the local checkpoint folder ({e.strerror or e})",
                            "set checkpoint.local_dir to a writable node-local folder") from None
    self._writer: threading.Thread | None = None
    self._error: BaseException | None = None
    self.last_save_blocked_s = 0.0

  def steps(self) -> list[int]:
    """This process's committed local steps."""
    return sorted(int(p) for p in os.listdir(self.directory)
                  if p.isdigit() and os.path.exists(os.path.join(self.directory, p, "meta.json")))

  def should_save(self, step: int) -> bool:
    return bool(self.every_steps) and step % self.every_steps == 0

  def save(self, step: int, state: Any, data_iterator, meta: dict,
           summary: tuple[dict[str, int], list[str]] | None = None) -> None:
    """Copies this process's shards of ``state`` to host memory (the loop waits for that) and writes them with the
    data position and ``meta`` in the background. Raises NonFiniteState (nothing written) for a non-finite state,
    CheckpointError when the previous write failed."""
    t = time.perf_counter()
    self.wait()
    fingerprints, nonfinite = summary if summary is not None else integrity.summarize(state)
    if nonfinite:
      raise NonFiniteState(f"non-finite values in {nonfinite[0]}")
    arrays, shards = {}, {}
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
    position = data_iterator.get_state() if isinstance(data_iterator, DataPosition) else None
    record = {**meta, "fingerprints": fingerprints, "shards": shards, "position": position,
              "layout": self._layout()}
    self._writer = threading.Thread(target=self._write, args=(step, arrays, record), daemon=True,
                                    name=f"jaxtrain-local-save-{step}")
    self._writer.start()
    self.last_save_blocked_s = time.perf_counter() - t

  def _write(self, step: int, arrays: dict[str, np.ndarray], record: dict) -> None:
    tmp, final = os.path.join(self.directory, f"{step}.tmp"), os.path.join(self.directory, str(step))
    try:
      shutil.rmtree(tmp, ignore_errors=True)
      os.makedirs(tmp)
      # Raw bytes: np.load cannot read every dtype back (bfloat16 comes back as void); the record keeps the dtype.
      np.savez(os.path.join(tmp, "shards.npz"), **{k: a.reshape(-1).view(np.uint8) for k, a in arrays.items()})
      record["arrays"] = {k: [str(a.dtype), list(a.shape)] for k, a in arrays.items()}
      with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(record, f)
      shutil.rmtree(final, ignore_errors=True)
      os.rename(tmp, final)  # the commit
      for old in self.steps()[:-self.keep_last]:
        shutil.rmtree(os.path.join(self.directory, str(old)), ignore_errors=True)
    except BaseException as e:  # noqa: BLE001 - reported by the next save or wait
      self._error = e

  def wait(self) -> None:
    """Blocks until the write in flight is committed; raises CheckpointError if it failed."""
    if self._writer is not None:
      self._writer.join()
      self._writer = None
    if self._error is not None:
      e, self._error = self._error, None
      raise CheckpointError(self.directory, f"saving a local checkpoint failed ({describe(e)})",
                            "free space on the node-local disk or set checkpoint.local_dir elsewhere")

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

  def restore(self, abstract_state: Any, data_iterator, newer_than: int) -> tuple[Any, dict] | None:
    """The newest local step newer than ``newer_than`` that every process has, fits this layout and verifies,
    restored onto ``abstract_state``'s shardings with its data position; None if there is none (then the caller
    restores the persistent tier). Every process must call it."""
    self.wait()
    mine = [s for s in self.steps() if s > newer_than and self._fits(s, abstract_state)][-_MAX_STEPS:]
    for step in reversed(_common(mine)):
      loaded, problem = None, None
      try:
        loaded = self._load(step, abstract_state)
      except Exception as e:  # noqa: BLE001 - unreadable: every process sets it aside below
        problem = describe(e)
      if not _everywhere(loaded is not None):
        self._set_aside(step, problem or "another process cannot read its part")
        continue
      state, record = loaded
      fingerprints, nonfinite = integrity.summarize(state)  # on the whole state: the same verdict everywhere
      wrong = [k for k, v in record["fingerprints"].items() if fingerprints.get(k) != v]
      if wrong or nonfinite:
        self._set_aside(step, str(CorruptCheckpoint(f"{(wrong or nonfinite)[0]} does not match its fingerprint"
                                                    if wrong else f"non-finite values in {nonfinite[0]}")))
        continue
      if record.get("position") is not None and isinstance(data_iterator, DataPosition):
        data_iterator.set_state(record["position"])
      meta = {k: v for k, v in record.items() if k not in ("shards", "position", "layout", "arrays")}
      return state, meta
    return None

  def forget_after(self, step: int) -> None:
    """The run resumes from ``step`` (0: from scratch): this process's local steps past it belong to a timeline
    that was abandoned, and so do the steps of other layouts (another process count) on this disk; deleted."""
    for folder in os.listdir(self.root):
      path = os.path.join(self.root, folder)
      if not folder.startswith("process_") or not os.path.isdir(path):
        continue
      mine = path == self.directory
      if not mine and folder.endswith(f"-of-{jax.process_count()}"):
        continue  # another process of this job: its own to clean
      for name in os.listdir(path):
        if name.isdigit() and (not mine or int(name) > step):
          shutil.rmtree(os.path.join(path, name), ignore_errors=True)

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

  def _set_aside(self, step: int, why: str) -> None:
    logging.warning("local checkpoint step %d in %s cannot be restored (%s); set aside, falling back", step,
                    self.directory, why)
    folder = os.path.join(self.directory, str(step))
    if os.path.exists(folder):
      os.rename(folder, os.path.join(self.directory, f"corrupt-{step}-{int(time.time())}"))


def _common(steps: list[int]) -> list[int]:
  """The steps every process offered (ascending)."""
  if jax.process_count() == 1:
    return sorted(steps)
  own = np.full(_MAX_STEPS, -1, np.int32)
  own[:len(steps)] = steps
  every = np.asarray(multihost_utils.process_allgather(own))
  return sorted(set.intersection(*[{int(s) for s in row if s >= 0} for row in every]))


def _everywhere(ok: bool) -> bool:
  """Whether ``ok`` holds on every process."""
  if jax.process_count() == 1:
    return ok
  return bool(np.asarray(multihost_utils.process_allgather(np.int32(ok))).min())

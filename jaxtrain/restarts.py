"""The restart budget: at most ``distributed.max_restarts_per_hour`` restarts of a run in any hour.

A cause a restart cures (exit 75: a preemption, a lost peer, a hang) is restarted by the scheduler; one that a
restart does not cure (a first eval that outlasts the watchdog every time, a peer that dies at the same step, a
flapping host) would be restarted for ever. Every process that exits 75 records why in the workdir, one small file
per process, ``<workdir>/restarts/<start>-<process>.json`` (time, cause, detail; written once, so it works on every
filesystem etils.epath reaches, ``gs://`` included); the files of one start of the job count as one restart. At
start, :func:`check` counts the starts of the last hour that ended restartably; when they exceed the budget the run
does not start: one line naming the causes, exit :data:`jaxtrain.exits.RESTARTS_EXHAUSTED`. A process killed by a
signal (SIGKILL, an OOM kill) cannot record: the shell launchers under tools/launch count their restarts too and
stop at the same budget with the same code.
"""

from __future__ import annotations

import collections
import json
import threading
import time

from absl import logging
from etils import epath

from jaxtrain import exits

HOUR_S = 3600.0
FOLDER = "restarts"
_armed: dict = {}  # {"folder": epath.Path, "start": str, "process": int} once main has checked the budget


def folder(workdir: str) -> epath.Path:
  return epath.Path(workdir) / FOLDER


def _starts(workdir: str) -> dict[str, list[epath.Path]]:
  """The records by start of the job, each start's files in process order (a listing: nothing is read)."""
  root = folder(workdir)
  if not root.exists():
    return {}
  starts = collections.defaultdict(list)
  for path in root.glob("*.json"):
    start, _, process = path.stem.rpartition("-")
    starts[start].append((int(process) if process.isdigit() else 1 << 30, path))
  return {start: [path for _, path in sorted(found)] for start, found in starts.items()}


def _first(paths: list[epath.Path]) -> dict | None:
  """The first readable record of a start (one read, however many processes the job has)."""
  for path in paths:
    try:
      return json.loads(path.read_text())
    except (OSError, ValueError):
      continue  # a record cut short by the exit that wrote it
  return None


def recent(workdir: str, now: float | None = None) -> list[dict]:
  """The restartable exits of the last hour, one per start of the job, oldest first."""
  now = time.time() if now is None else now
  found = [_first(paths) for paths in _starts(workdir).values()]
  return sorted((r for r in found if r is not None and now - r.get("time", 0.0) < HOUR_S), key=lambda r: r["time"])


def check(workdir: str, budget: int, now: float | None = None) -> str | None:
  """The line to stop with when the starts of the last hour that ended restartably exceed ``budget`` (0: no
  budget), else None."""
  if not budget:
    return None
  found = recent(workdir, now)
  if len(found) <= budget:
    return None
  causes = collections.Counter(r["cause"] for r in found)
  last = found[-1]
  return (f"{len(found)} restarts in the last hour ({', '.join(f'{c} x{n}' for c, n in causes.most_common())}), "
          f"more than distributed.max_restarts_per_hour={budget}: a restart does not cure this; the last: "
          f"{last['cause']}: {last.get('detail', '')[:300]}. Fix the cause (train.log), then start again after "
          f"removing {folder(workdir)} (or with --config.distributed.max_restarts_per_hour=0)")


def prune(workdir: str, now: float | None = None) -> None:
  """Removes the records of the starts that ended more than an hour ago (process 0, at start)."""
  now = time.time() if now is None else now
  for paths in _starts(workdir).values():
    record = _first(paths)
    if record is None or now - record.get("time", 0.0) >= HOUR_S:
      for path in paths:
        path.unlink(missing_ok=True)


def arm(workdir: str, start: str, process: int) -> None:
  """From now on this process's restartable exits are recorded for the start ``start`` (the same on every process
  of the job)."""
  _armed.update(folder=folder(workdir), start=start, process=process)


_listeners: list = []  # told of every restartable exit (jaxtrain.goodput's recorder names its run's interruption)


def listen(listener) -> None:
  """``listener(cause, detail)`` is called at each :func:`record` of this process from now on (until
  :func:`unlisten`); it must not raise and should not wait."""
  _listeners.append(listener)


def unlisten(listener) -> None:
  if listener in _listeners:
    _listeners.remove(listener)


def record(cause: str, detail: str, timeout_s: float = 10.0) -> None:
  """Records this process's restartable exit (``cause``: one of :data:`jaxtrain.exits.CAUSES`; ``detail``: the line
  it exits with), if :func:`arm` was called, and tells the listeners (:func:`listen`); never raises and waits at
  most ``timeout_s`` for the write (the process is exiting)."""
  for listener in list(_listeners):
    try:
      listener(cause, detail)
    except Exception as e:  # noqa: BLE001 - the exit goes on
      logging.warning("a listener of the restartable exit failed: %s", e)
  if not _armed:
    return
  entry = {"time": time.time(), "start": _armed["start"], "process": _armed["process"], "cause": cause,
           "detail": detail, "exit": exits.RESTART}

  def write():
    try:
      _armed["folder"].mkdir(parents=True, exist_ok=True)
      (_armed["folder"] / f"{_armed['start']}-{_armed['process']}.json").write_text(json.dumps(entry))
    except Exception as e:  # noqa: BLE001 - the exit goes on; the launchers count restarts too
      logging.warning("could not record the restartable exit in %s: %s", _armed["folder"], e)

  writer = threading.Thread(target=write, name="jaxtrain-restart-record", daemon=True)
  writer.start()
  writer.join(timeout_s)

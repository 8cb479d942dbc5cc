"""A workdir's logs on an object store (``gs://``, ``s3://``) as segments: ``metrics.jsonl``, ``train.log`` and the
goodput events, written by process 0 without the training loop ever waiting for the store.

Object stores cannot append. Rewriting a growing object whole at every record uploads bytes that grow with the run
(quadratically over it), and at a record a second it passes Cloud Storage's limit of one write per second per object,
whose back-off (429) held up the loop. Here a log is a folder of objects that each hold only what is new:

- :class:`Stream` keeps the lines in memory; its thread writes what came since its last write as a new object, at
  most every :data:`INTERVAL_S` seconds (the first line at once), named ``<run>.<first>-<last><ext>``: the run (the
  time it started in ms, the process, a counter: runs sort in the order they started) and the range of the stream's
  parts it holds. No object is written twice, and the bytes and requests of a record do not grow with the run.
- Every :data:`COMPACT_OBJECTS` objects (or :data:`COMPACT_BYTES`) and when the stream closes, the run's objects since
  the last compaction are written again as one object that covers their range, then deleted: a line is uploaded at
  most twice, and a run leaves one object per 10 minutes of writes (a week of them: ~1,000, not 600,000), plus what a
  kill left unmerged (at most :data:`COMPACT_OBJECTS`).
- :func:`read` lists the folder, keeps of each run the objects with the widest ranges (a compaction's object and the
  ones it replaces are both there between its write and its deletes: read once), and joins them: the log's whole
  object first (``metrics.jsonl`` as earlier versions wrote it), then the runs in the order they started. A reader
  racing a compaction lists again.

The thread bounds each request (:data:`REQUEST_S`); a store that fails (429, 503, a reset, no answer: classified by
:mod:`jaxtrain.failures`) is warned about once per outage, retried with back-off, and said to answer again; nothing
raises into the loop. What waits in memory is bounded (:data:`QUEUE_BYTES`; beyond it the oldest lines are dropped,
and counted). Streams are flushed when their writer closes them (the end of a run), by ``logging.shutdown()``
(Python's exit and jaxtrain.main's immediate exits call it; :func:`flush_all`), and by the watchdog before its exit.
What a kill loses: the lines of the last :data:`INTERVAL_S` seconds, or during an outage those not written yet.
"""

from __future__ import annotations

import collections
import itertools
import logging as std_logging
import math
import os
import re
import threading
import time
from typing import Callable

import fsspec
from absl import logging
from fsspec.asyn import AsyncFileSystem

from jaxtrain import failures, paths

INTERVAL_S = 1.0  # at most one write a second per stream (each a new object: no object is written twice)
COMPACT_OBJECTS = 600  # a run's objects merged into one every 600 writes (10 minutes at one a second) ...
COMPACT_BYTES = 8 << 20  # ... or 8 MB, whichever first; and at the end of the run
QUEUE_BYTES = 64 << 20  # what waits for a store that does not answer; beyond it the oldest lines are dropped
# One request's bound: longer than the clients' own retries (gcsfs's ~35 s), so that their error is what is warned
# about; a store that never answers ends there (gcsfs sets no timeout of its own).
REQUEST_S = 60.0
RETRY_S = (1.0, 30.0)  # the back-off after a failed write: from 1 s, doubling, at most 30 s
CLOSE_S = 30.0  # how long the end of a run waits for its logs to be written
EXIT_S = 10.0  # how long the watchdog waits for them before its exit
THREAD = "jaxtrain-logs"  # the writers' threads' names begin so

_NAME = re.compile(r"(?P<run>[^/.]+)\.(?P<first>\d+)-(?P<last>\d+)(?P<ext>\.[^/]*)?")
_runs = itertools.count()
_streams: list["Stream"] = []  # the streams of this process that have written and are not closed
_streams_lock = threading.Lock()


def _forget_after_fork() -> None:
  """A forked child has none of its parent's writer threads: it writes none of their streams."""
  global _streams_lock
  _streams.clear()
  _streams_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def segments(url: str) -> str:
  """The folder of the segments of the log ``url`` (``gs://b/run/metrics.jsonl`` -> ``gs://b/run/metrics.jsonl.d``)."""
  return url.rstrip("/") + ".d"


def new_run() -> str:
  """A run's name: when it started (ms), this process, a counter; runs sort in that order (:func:`_run_key`)."""
  return f"{int(1000 * time.time()):013d}-{os.getpid()}-{next(_runs)}"


def _run_key(run: str) -> tuple:
  return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in run.split("-"))


def _filesystem(url: str):
  """(fsspec filesystem, path) of ``url``."""
  return fsspec.core.url_to_fs(url)


def _bounded(fs) -> dict:
  """The keyword that bounds one request of ``fs``: an async filesystem's (gcsfs, s3fs) synchronous methods pass
  ``timeout`` to fsspec.asyn.sync, which cancels the request past it; other filesystems take none."""
  return {"timeout": REQUEST_S} if isinstance(fs, AsyncFileSystem) else {}


class Stream:
  """A log of a URL workdir written as segments under ``folder`` (see the module's docstring). ``what`` names it in
  warnings; ``ext``: its objects' extension; ``run``: this run's name (default :func:`new_run`); ``clock``: the
  cadence's clock (seconds; benchmarks pass a simulated one)."""

  def __init__(self, folder: str, what: str, ext: str = "", run: str | None = None,
               clock: Callable[[], float] = time.monotonic):
    self.folder, self.what, self.ext = folder.rstrip("/"), what, ext
    self.run = run or new_run()
    self.clock = clock
    self._cond = threading.Condition()  # guards what follows; the thread waits on it
    self._pending: list[str] = []  # lines not yet in a part
    self._pending_bytes = 0
    self._parts: collections.deque[tuple[int, str]] = collections.deque()  # (number, text), not yet written
    self._parts_bytes = 0
    self._next = 0  # the next part's number
    self._tail: list[tuple[int, int, str]] = []  # this run's objects since the last compaction: (first, last, text)
    self._garbage: list[str] = []  # objects a compaction replaced that could not be deleted yet
    self._last_write = -math.inf  # self.clock() when the last write began
    self._retry_at = 0.0  # time.monotonic() of the next try after a failure
    self._urgent = False  # a flush asked for: write everything now
    self._in_flight = False  # a write taken by the thread, not yet done and reported
    self._closing = self._done = self._closed = False
    self._dropped = 0  # lines dropped under QUEUE_BYTES, not yet warned about
    self._failing_since: float | None = None  # time.monotonic() of an outage's first failure
    self._thread: threading.Thread | None = None

  # -- the caller's side

  def write(self, text: str) -> None:
    """Adds ``text`` (whole lines); never waits for the store, never raises for it."""
    if not text:
      return
    with self._cond:
      if self._closed:
        return
      self._pending.append(text)
      self._pending_bytes += len(text)
      self._bound()
      if self._thread is None:
        self._start()
      if self.clock() - self._last_write >= INTERVAL_S:
        self._cond.notify_all()

  def _start(self) -> None:
    self._thread = threading.Thread(target=self._work, name=f"{THREAD}-{self.what}", daemon=True)
    self._thread.start()
    with _streams_lock:
      _streams.append(self)

  def _bound(self) -> None:
    """Drops the oldest lines while more than QUEUE_BYTES wait (a store that has not answered for long)."""
    while self._pending_bytes + self._parts_bytes > QUEUE_BYTES and (self._parts or len(self._pending) > 1):
      if self._parts:
        text = self._parts.popleft()[1]
        self._parts_bytes -= len(text)
      else:
        text = self._pending.pop(0)
        self._pending_bytes -= len(text)
      self._dropped += text.count("\n")

  def request_flush(self) -> None:
    """Has the thread write everything now (and retry a failed write at once)."""
    with self._cond:
      if self._pending or self._parts:
        self._urgent = True
        self._retry_at = min(self._retry_at, time.monotonic())
        self._cond.notify_all()

  def flush(self, timeout: float = CLOSE_S) -> bool:
    """Writes everything written so far, waiting up to ``timeout`` seconds; whether it is all in the store."""
    self.request_flush()
    deadline = time.monotonic() + timeout
    with self._cond:
      while self._pending or self._parts or self._in_flight:
        left = deadline - time.monotonic()
        if left <= 0 or self._thread is None or not self._thread.is_alive():
          return False
        self._cond.wait(left)
      return True

  def close(self, timeout: float = CLOSE_S) -> bool:
    """Writes everything and merges this run's objects since the last compaction into one, waiting up to
    ``timeout`` seconds; then takes no more lines. Whether everything is in the store; what is not is warned about
    (lost if the process ends before the store answers)."""
    deadline = time.monotonic() + timeout
    with self._cond:
      if self._closed:
        return not self._pending and not self._parts
      self._closing = True
      self._retry_at = min(self._retry_at, time.monotonic())
      self._cond.notify_all()
      running = self._thread is not None
      while running and not self._done and self._thread.is_alive() and time.monotonic() < deadline:
        self._cond.wait(deadline - time.monotonic())
      self._closed = True
      lost = sum(t.count("\n") for t in self._pending) + sum(t.count("\n") for _, t in self._parts)
      self._cond.notify_all()
    with _streams_lock:
      if self in _streams:
        _streams.remove(self)
    if lost:
      logging.warning("%s: %d line(s) not written to %s within %.0fs (the store did not answer): lost if the "
                      "process ends before it does", self.what, lost, self.folder, timeout)
    return not lost

  # -- the thread's side

  def _name(self, first: int, last: int) -> str:
    return f"{self.folder}/{self.run}.{first:08d}-{last:08d}{self.ext}"

  def _next_write(self) -> tuple[int, int, str] | None:
    """(first part, last part, text) of the next write, waiting for one (the lock held); None once the stream is
    closing with everything written, or closed."""
    while True:
      if self._closed:
        return None
      now = self.clock()
      if self._pending and (self._urgent or self._closing or now - self._last_write >= INTERVAL_S):
        self._seal()
      if self._parts and time.monotonic() >= self._retry_at:
        taken, size = [], 0
        for number, text in self._parts:  # a backlog (after an outage) goes in one object, up to COMPACT_BYTES
          if taken and size + len(text) > COMPACT_BYTES:
            break
          taken.append((number, text))
          size += len(text)
        self._last_write, self._in_flight = now, True
        return taken[0][0], taken[-1][0], "".join(text for _, text in taken)
      if not self._parts:
        self._urgent = False
        if self._closing:
          return None
      if self._parts:
        wait = self._retry_at - time.monotonic()
      elif self._pending:
        wait = max(0.01, min(INTERVAL_S, INTERVAL_S - (now - self._last_write)))
      else:
        wait = None
      self._cond.wait(wait)

  def _seal(self) -> None:
    """The pending lines become the next part: written whole under its number (possibly with others), or dropped."""
    text = "".join(self._pending)
    self._pending, self._pending_bytes = [], 0
    self._parts.append((self._next, text))
    self._parts_bytes += len(text)
    self._next += 1

  def _work(self) -> None:
    delay = 0.0  # the back-off after a failure
    while True:
      with self._cond:
        job = self._next_write()
      if job is None:
        if not self._closed:
          self._compact()
        with self._cond:
          self._done = True
          self._cond.notify_all()
        return
      first, last, text = job
      error = self._put(self._name(first, last), text)
      with self._cond:
        if error is None:
          while self._parts and self._parts[0][0] <= last:
            self._parts_bytes -= len(self._parts.popleft()[1])
          self._tail.append((first, last, text))
          delay = 0.0
        else:
          delay = min(RETRY_S[1], max(RETRY_S[0], 2 * delay))
          self._retry_at = time.monotonic() + (min(delay, 0.5) if self._urgent or self._closing else delay)
        dropped, self._dropped = self._dropped, 0
      self._report(error, dropped)
      with self._cond:
        self._in_flight = False  # written and reported: a flush waiting for it may return
        self._cond.notify_all()
      if error is None and (len(self._tail) >= COMPACT_OBJECTS or
                            sum(len(t) for _, _, t in self._tail) >= COMPACT_BYTES):
        self._compact()

  def _put(self, name: str, text: str) -> BaseException | None:
    """Writes the object ``name``; the error, if any (never raised: the loop must not see the store's faults)."""
    try:
      fs, path = _filesystem(name)
      fs.pipe_file(path, text.encode(), **_bounded(fs))
    except Exception as e:  # noqa: BLE001 - each store's client raises its own; classified for the warning
      return e
    return None

  def _compact(self) -> None:
    """This run's objects since the last compaction as one object covering their range, then those deleted (and
    any that a failed delete left)."""
    tail = self._tail  # only this thread changes it
    if len(tail) > 1:
      first, last, text = tail[0][0], tail[-1][1], "".join(t for _, _, t in tail)
      error = self._put(self._name(first, last), text)
      self._report(error, 0)
      if error is not None:
        return  # tried again after the next write
      self._garbage += [self._name(a, b) for a, b, _ in tail]
    self._tail = []  # (an object of its own: never written again)
    if self._garbage:
      try:
        fs, _ = _filesystem(self.folder)
        fs.rm([_filesystem(name)[1] for name in self._garbage], **_bounded(fs))
      except FileNotFoundError:
        pass  # deleted already (by a try that failed late)
      except Exception:  # noqa: BLE001 - readers skip what a compaction covers: deleted at the next one
        return
      self._garbage = []

  def _report(self, error: BaseException | None, dropped: int) -> None:
    """One warning per outage (its cause in jaxtrain.failures' words), one line when the store answers again; from
    the thread, outside the lock (the warning may itself be a line of a stream)."""
    if error is not None and self._failing_since is None:
      self._failing_since = time.monotonic()
      failure = failures.classify(error)
      logging.warning("%s: could not write to %s (%s: %s); the run goes on, keeps the lines in memory and retries "
                      "every %g-%gs: a kill before the store answers loses them", self.what, self.folder,
                      failure.kind if failure else "unclassified", failures.describe(error), *RETRY_S)
    elif error is None and self._failing_since is not None:
      logging.warning("%s: %s answers again after %.0fs: the lines kept meanwhile are written", self.what,
                      self.folder, time.monotonic() - self._failing_since)
      self._failing_since = None
    if dropped:
      logging.warning("%s: dropped the oldest %d line(s): more than %d MB waited for %s", self.what, dropped,
                      QUEUE_BYTES >> 20, self.folder)


def open_stream(url: str, what: str) -> Stream:
  """This process's open stream of the log ``url`` (``<workdir>/train.log``), or a new one: the watchdog's stacks go
  where process 0's log lines go."""
  folder = segments(url)
  with _streams_lock:
    found = [s for s in _streams if s.folder == folder]
  return found[-1] if found else Stream(folder, what, os.path.splitext(url)[1])


def flush_all(timeout: float = CLOSE_S) -> bool:
  """Writes what every open stream of this process holds, waiting up to ``timeout`` seconds in all (the streams
  write at the same time, each on its thread); whether all is in the store."""
  with _streams_lock:
    streams = list(_streams)
  for stream in streams:
    stream.request_flush()
  deadline = time.monotonic() + timeout
  return all([stream.flush(max(0.0, deadline - time.monotonic())) for stream in streams])


class _FlushAtShutdown(std_logging.Handler):
  """Never attached to a logger: ``logging.shutdown()`` flushes every handler there is, and Python's exit (logging's
  atexit function) and jaxtrain.main's immediate exits (before ``os._exit``) call it: so it writes the streams."""

  def emit(self, record) -> None:
    del record

  def flush(self) -> None:
    flush_all()


_AT_SHUTDOWN = _FlushAtShutdown()


class Handler(std_logging.Handler):
  """Log records as the lines of a :class:`Stream` (process 0's ``train.log`` on an object store). Closing it writes
  the stream's lines (bounded by :data:`CLOSE_S`)."""

  def __init__(self, stream: Stream):
    super().__init__()
    self.stream = stream

  def emit(self, record) -> None:
    try:
      self.stream.write(self.format(record) + "\n")
    except Exception:  # noqa: BLE001 - logging's own way: report and go on
      self.handleError(record)

  def close(self) -> None:
    self.stream.close()
    super().close()


# -- reading


def _latest(names: list[str]) -> dict[str, list[str]]:
  """Of each run's objects, in order, those that cover its parts once: by first part, the widest first; an object
  inside the ones kept (replaced by a compaction, not yet deleted) is skipped."""
  runs: dict[str, list[tuple[int, int, str]]] = {}
  for name in names:
    found = _NAME.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    if found:
      runs.setdefault(found["run"], []).append((int(found["first"]), -int(found["last"]), name))
  out = {}
  for run, objects in runs.items():
    kept, covered = [], -1
    for first, last, name in sorted(objects):
      if -last > covered:  # (an object overlapping the kept ones only partly: a part dropped under QUEUE_BYTES)
        kept.append(name)
        covered = -last
    out[run] = kept
  return out


def read_runs(folder: str) -> list[tuple[str, str]]:
  """``(run, text)`` of every run whose segments are under ``folder``, in the order the runs started."""
  fs, path = _filesystem(folder)
  for attempt in range(3):
    fs.invalidate_cache(path)  # a listing cached in this process would hide what a live run wrote since
    try:
      names = fs.find(path, **_bounded(fs))
    except FileNotFoundError:
      names = []
    runs = _latest(names)
    wanted = [name for run in runs.values() for name in run]
    got = fs.cat(wanted, on_error="return", **_bounded(fs)) if wanted else {}
    missing = [name for name, data in got.items() if isinstance(data, FileNotFoundError)]
    if missing and attempt < 2:
      continue  # compacted between the listing and the reads: list again
    for data in got.values():
      if isinstance(data, BaseException) and not isinstance(data, FileNotFoundError):
        raise data
    return [(run, "".join(got[name].decode() for name in runs[run] if isinstance(got.get(name), bytes)))
            for run in sorted(runs, key=_run_key)]
  return []


def read(url: str) -> str:
  """The log ``url`` as one text: a local file as it is; on an object store its whole object (an earlier version
  wrote ``metrics.jsonl`` so) followed by its segments (:func:`segments`), run after run."""
  if not paths.is_url(url):
    try:
      with open(url) as f:
        return f.read()
    except FileNotFoundError:
      return ""
  fs, path = _filesystem(url)
  fs.invalidate_cache(path.rsplit("/", 1)[0])
  try:
    whole = fs.cat_file(path, **_bounded(fs)).decode()
  except (FileNotFoundError, IsADirectoryError):
    whole = ""
  return whole + "".join(text for _, text in read_runs(segments(url)))

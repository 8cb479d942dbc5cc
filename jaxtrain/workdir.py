"""One live run per workdir: a lock that process 0 holds while it trains, and the run's log file.

The lock is ``<workdir>/run.lock``, a small JSON file naming the holder (host, PID, process start time, since
when) with a ``beat`` counter that a background thread increments every ``renew_s`` seconds. A second start
while the holder is alive is refused (:class:`WorkdirBusy`, exit 2) before anything in the workdir is touched.
A lock whose holder is gone is taken over with a warning, so a scheduler's restart after a SIGKILL, an OOM kill
or a lost host resumes without manual cleanup. Whether the holder is alive:

- same host (and the same boot and PID namespace, where the lock names them: a container has its own PIDs): its PID
  exists, is not a zombie and started when the lock says (a reused PID is not the holder);
- another host (or a PID we cannot see): the beat is watched for up to ``3 x renew_s``; a beat that moves
  proves the holder alive, one that does not means it is gone. No clocks are compared across hosts.

Creating the lock is atomic on local disks (``O_CREAT | O_EXCL``) and taking over a stale one is a rename that
only one contender wins. An object store (``gs://``, ``s3://``) has neither, nor PIDs to look at: there the lock is
a lease (:mod:`jaxtrain.lease`), written with the store's conditional writes so that one contender wins, renewed
by the holder's thread, refused to a second run while it is renewed, and taken over once it has expired
(``workdir_lease_s`` after the holder's last renewal: a crashed run's successor waits at most that long; at once when
the holder was a process of this host that is gone).

A run that no longer holds its workdir stops writing: :meth:`WorkdirLock.fence` raises :class:`LeaseLost` (exit 75)
where the run is about to write (the training loop asks before each step and before it writes metrics, the persistent
checkpoint tier before each save and, reading the lock back, before each commit: :meth:`WorkdirLock.confirm`). On an
object store that is when its lease was taken over, or could not be renewed before its deadline (the lease's own
reckoning on this host's monotonic clock, :meth:`jaxtrain.lease.Lease.deadline`, which ends a quarter of a lease before
any other run may take it over); a failed renewal is retried, more often as the deadline nears. A local ``run.lock``
is taken over only when its holder is gone, so a live run loses it only if another host's run judged it gone (its
beat stopped moving on a shared filesystem): seen by its next renewal, or by the next commit's read. Each
checkpoint's ``meta`` records the holder (``lease``: its token and generation, one more at each takeover).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging as std_logging
import os
import socket
import threading
import time
import uuid
from typing import Iterator

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from jaxtrain import errors
from jaxtrain import exits
from jaxtrain import failures
from jaxtrain import lease as lease_lib
from jaxtrain import logs, paths
from jaxtrain.errors import UserError

LOCK_FILE = "run.lock"
LOG_FILE = "train.log"


class WorkdirBusy(UserError):
  """Another live run holds the workdir."""


class LeaseLost(exits.Restart):
  """This run no longer holds its workdir (its lease ran out unrenewed, or another run took the lock over): it stops
  before writing anything more, exit 75; the restart resumes from the newest checkpoint once it holds the workdir."""

  cause = exits.LEASE_LOST


def _process_start(pid: int) -> str | None:
  """The kernel's start time of ``pid`` (Linux ``/proc``), to tell a reused PID from the holder; None if
  unknown. The second field may contain spaces: split after the closing parenthesis."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return None
  return fields[19] if fields[0] != "Z" else "zombie"


def _read_text(path: str, link: bool = False) -> str | None:
  try:
    if link:
      return os.readlink(path)
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return None


def _pid_space() -> dict:
  """What lets another process judge this one by its PID: the kernel's boot (Linux's ``boot_id``) and the PID
  namespace (a container has its own PIDs, under the host's name), and the process's start time (a reused PID is not
  the holder)."""
  return {"pid_start": _process_start(os.getpid()), "boot": _read_text("/proc/sys/kernel/random/boot_id"),
          "pid_ns": _read_text("/proc/self/ns/pid", link=True)}


def _same_pid_space(held: dict) -> bool:
  """Whether a lock's holder is a process whose PID this process can judge: this host, and (where the lock names
  them; locks written before they were recorded name neither) this boot and PID namespace."""
  if held.get("host") != socket.gethostname() or not isinstance(held.get("pid"), int):
    return False
  mine = _pid_space()
  return all(held.get(key) is None or held.get(key) == mine[key] for key in ("boot", "pid_ns"))


def _holder_gone(held: dict) -> bool:
  """Whether a lease's holder is a process of this host, boot and PID namespace that no longer runs (a lease names
  its boot and namespace always: one that does not is not judged)."""
  return (None not in (held.get("boot"), held.get("pid_ns")) and _same_pid_space(held)
          and not _pid_alive(held["pid"], held.get("pid_start")))


def _within(seconds: float, read):
  """``read()``, waited for at most ``seconds`` (on a thread of its own, left behind if it does not answer: a store's
  client retries a silent server for tens of seconds); raises TimeoutError then, or what ``read`` raised."""
  done: concurrent.futures.Future = concurrent.futures.Future()

  def run():
    try:
      done.set_result(read())
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      done.set_exception(e)

  threading.Thread(target=run, name="jaxtrain-workdir-read", daemon=True).start()
  return done.result(timeout=max(seconds, 0.0))


def _pid_alive(pid: int, start: str | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, another user's
    pass
  now = _process_start(pid)
  if now == "zombie":
    return False
  return start is None or now is None or now == start


class WorkdirLock:
  """``with WorkdirLock(workdir): ...`` holds the workdir for the block. Only process 0 should take it. While it is
  held, :meth:`fence` and :meth:`confirm` say whether this run still holds it (see the module's docstring)."""

  def __init__(self, workdir: str, renew_s: float = 10.0, lease_s: float = 120.0):
    self.dir = epath.Path(workdir)
    self.path = self.dir / LOCK_FILE
    self.renew_s = renew_s
    self._token = uuid.uuid4().hex
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._beat = 0
    self.generation = 0  # of this run's hold: 1 when it created the lock, one more at each takeover
    self._lost: str | None = None  # why this run no longer holds the workdir: set once, by any thread
    self._renew_error = ""  # the newest failed renewal's error, for the line that says the lease ran out
    self._lease = None
    if paths.is_url(os.fspath(workdir)):  # renewed often enough that a renewal or two may fail without losing it
      self.renew_s = min(renew_s, lease_s / 4)
      self._lease = lease_lib.Lease(paths.join(os.fspath(workdir), LOCK_FILE), lease_s, self.renew_s, self._token,
                                    {"since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **_pid_space()},
                                    gone=_holder_gone)

  # -- reading and judging an existing lock

  def _read(self) -> dict | None:
    try:
      return json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except (ValueError, OSError):  # a half-written lock (the holder was killed while writing it)
      return {}

  def _holder_alive(self, held: dict) -> bool:
    if not held:  # empty or half-written: a live holder writes it right after creating it; a killed one never
      deadline = time.monotonic() + 5.0
      while time.monotonic() < deadline:
        time.sleep(0.25)
        now = self._read()
        if now is None:
          return False  # removed meanwhile: free
        if now:
          return self._holder_alive(now)
      return False
    if _same_pid_space(held):
      return _pid_alive(held["pid"], held.get("pid_start"))
    # Another host: alive if its beat moves while we watch (the holder renews every renew_s).
    wait = 3 * float(held.get("renew_s", self.renew_s))
    logging.info("%s is held by %s (PID %s); watching for up to %.0fs whether that run is alive", self.path,
                 held.get("host"), held.get("pid"), wait)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
      time.sleep(min(1.0, wait / 10))
      now = self._read()
      if now is None or now.get("token") != held.get("token"):
        return True  # released or taken by someone else meanwhile: not ours to take
      if now.get("beat") != held.get("beat"):
        return True
    return False

  # -- writing

  def _content(self) -> str:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), **_pid_space(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "started_at": self._started,
                       "renew_s": self.renew_s, "beat": self._beat, "token": self._token,
                       "generation": self.generation})

  def _create(self) -> bool:
    """Writes the lock if there is none; False if someone else has one."""
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, "w") as f:
      f.write(self._content())
    return True

  def _rewrite(self) -> None:
    """Renewal: the new content replaces the old atomically (local: write aside, then rename)."""
    aside = self.dir / f".{LOCK_FILE}.{self._token}"
    aside.write_text(self._content())
    os.replace(aside, self.path)

  def _take_over(self, stale: dict) -> bool:
    """Moves a stale lock out of the way; False if it changed meanwhile (another contender took it)."""
    aside = self.dir / f".{LOCK_FILE}.stale-{self._token}"
    try:
      os.rename(self.path, aside)
    except FileNotFoundError:
      return True  # gone meanwhile: try to create
    moved = json.loads(aside.read_text() or "{}") if aside.exists() else {}
    if stale and moved.get("token") != stale.get("token"):  # we moved a fresh lock: put it back
      os.rename(aside, self.path)
      return False
    aside.unlink(missing_ok=True)
    return True

  def _describe(self, held: dict) -> str:
    return (f"another run is using this workdir (host {held.get('host', '?')}, PID {held.get('pid', '?')}, "
            f"since {held.get('since', '?')})")

  def _take_lease(self) -> None:
    try:
      held = self._lease.acquire()
    except UserError:
      raise
    except Exception as e:  # noqa: BLE001 - each store's client raises its own (no bucket, no credentials, offline)
      # By the store's answer: denied or missing (exit 2, one line), throttled or not answering (exit 75).
      failures.reraise(e, os.fspath(self.dir), f"taking the workdir's lease ({LOCK_FILE})")
      raise UserError(os.fspath(self.dir), f"the workdir's lease ({LOCK_FILE}) cannot be read or written "
                      f"({failures.describe(e)})", "check the URL, and the store's endpoint and credentials "
                      "(docs/operations.md)") from None
    self.generation = self._lease.generation
    if held is None:
      return
    if "taken_over" in held:
      why, held = held["why"], held["taken_over"]
      logging.warning("%s: the run that held it (host %s, PID %s, since %s) %s; taking over", self.path,
                      held.get("host"), held.get("pid"), held.get("since"), why)
      return
    raise WorkdirBusy(os.fspath(self.dir), self._describe(held) + f"; its lease ({LOCK_FILE}) is renewed",
                      "wait for it to finish or stop it, or use another --config.workdir; the lease of a run that "
                      f"was killed expires {held.get('lease_s', '?')}s after its last renewal (workdir_lease_s) and "
                      "is then taken over automatically")

  def _take(self) -> None:
    if self._lease is not None:
      return self._take_lease()
    self.dir.mkdir(parents=True, exist_ok=True)
    self.generation = 1
    for _ in range(3):  # a contender may create or take over between our look and our write
      if self._create():
        return
      held = self._read()
      if held is None:
        continue
      if self._holder_alive(held):
        raise WorkdirBusy(os.fspath(self.dir), self._describe(held), "wait for it to finish or stop it, or use "
                          "another --config.workdir; a lock left by a run that was killed is taken over "
                          f"automatically ({LOCK_FILE})")
      logging.warning("%s: the run that held it (host %s, PID %s, since %s) is gone; taking over", self.path,
                      held.get("host"), held.get("pid"), held.get("since"))
      self._take_over(held)
      self.generation = int(held.get("generation") or 0) + 1
    held = self._read() or {}
    raise WorkdirBusy(os.fspath(self.dir), self._describe(held), "another run started at the same moment")

  def acquire(self) -> "WorkdirLock":
    """Takes the lock or raises WorkdirBusy; a workdir that cannot be created or written is a UserError (one
    line), a store that does not answer an exits.Restart (exit 75). Creates the workdir if needed (nothing else)."""
    self._started = time.time()
    try:
      self._take()
    except OSError as e:  # not FileExistsError (handled by _create): a path this user cannot write to
      raise UserError(os.fspath(self.dir), f"the workdir cannot be created or written ({e.strerror or e})",
                      "pass a --config.workdir this user can write to") from None
    self._thread = threading.Thread(target=self._keep_lock if self._lease is None else self._keep_lease,
                                    name="jaxtrain-workdir-lock", daemon=True)
    self._thread.start()
    return self

  # -- while held

  def fence(self) -> dict:
    """``{"token", "generation"}`` of this run's hold (each checkpoint's ``meta`` records it) while it still holds the
    workdir; else raises :class:`LeaseLost`. No I/O: the renewal thread's verdict (a takeover seen) and, on an object
    store, the lease's deadline on this host's monotonic clock, which passes even while the thread waits on a store
    that does not answer."""
    if self._lost is None and self._lease is not None and self._lease.confirmed is not None \
        and time.monotonic() >= self._lease.deadline():
      unrenewed = self._lease.lease_s * (1 - lease_lib.MARGIN)
      self._lose(f"its lease ({LOCK_FILE}) was not renewed for {unrenewed:.0f}s, after which another run may take it "
                 f"over ({self._renew_error or 'the store did not answer'})")
    if self._lost is not None:
      raise LeaseLost(f"{self.dir}: this run no longer holds its workdir: {self._lost}; it stopped before writing "
                      "more, so that no two runs write the workdir")
    return {"token": self._token, "generation": self.generation}

  def confirm(self) -> dict:
    """:meth:`fence`, after reading the lock back naming this run (a checkpoint's commit asks: a takeover that the
    renewal thread has not seen yet refuses it too). On an object store the read waits at most until the lease's
    deadline, so that a store that does not answer ends in the fence's refusal; a read that fails sooner leaves the
    verdict to the deadline."""
    self.fence()
    if self._lease is None:
      held = self._read()  # None (removed by hand): the renewal writes it again; not another run's
    else:
      try:
        held = _within(self._lease.deadline() - time.monotonic(), self._lease.holder) or {}
      except Exception:  # noqa: BLE001 - the store's error, or no answer in time: the deadline decides
        held = None
    if held is not None and held.get("token") != self._token:
      self._lose(self._taken(held))
    return self.fence()

  def _taken(self, held: dict) -> str:
    if not held:
      return f"its lock ({LOCK_FILE}) was removed, or replaced by a half-written one"
    return (f"another run took its lock ({LOCK_FILE}) over (host {held.get('host', '?')}, PID {held.get('pid', '?')}, "
            f"since {held.get('since', '?')})")

  def _lose(self, why: str) -> None:
    if self._lost is None:
      self._lost = why
      logging.error("%s: this run no longer holds its workdir: %s; it stops before writing more (exit %d)", self.dir,
                    why, exits.RESTART)

  def _keep_lease(self) -> None:
    """The lease's renewals: every ``renew_s``; after a failed one sooner, each after a quarter of the time left
    before the deadline (at least 0.05 s), so that a store back in time keeps the lease. Ends at a takeover seen or
    when the deadline passes (:meth:`fence` tells the run), or at release."""
    wait, failing = self.renew_s, False
    while not self._stop.wait(wait):
      try:
        taken = self._lease.renew()
      except Exception as e:  # noqa: BLE001 - each store's client raises its own; tried again while time is left
        if self._stop.is_set():  # released meanwhile
          return
        self._renew_error = failures.describe(e)
        left = self._lease.deadline() - time.monotonic()
        if not failing:
          logging.warning("could not renew the lease %s (%s); trying again for %.0fs, then this run stops writing",
                          self.path, self._renew_error, max(left, 0.0))
        failing = True
        if left <= 0:
          with contextlib.suppress(LeaseLost):
            self.fence()  # says why, once
          return
        wait = min(self.renew_s, max(0.05, left / 4))
        continue
      if taken is not None:
        self._lose(self._taken(taken))
        return
      if self._lost is not None:  # the deadline passed while this renewal was under way: the run has stopped
        return
      wait, failing = self.renew_s, False

  def _keep_lock(self) -> None:
    """The local lock's renewals: its beat, every ``renew_s``, until a takeover is seen."""
    while not self._stop.wait(self.renew_s):
      held = self._read()
      if held is not None and held.get("token") != self._token:
        self._lose(self._taken(held))
        return
      self._beat += 1
      try:
        self._rewrite()
      except OSError as e:  # a full disk must not kill training; the next renewal tries again
        logging.warning("could not renew %s: %s", self.path, e)

  def release(self) -> None:
    """Stops renewing and removes the lock if it is still this run's. A run that lost the workdir touches nothing of
    it (nor waits for a renewal that a store leaves unanswered)."""
    self._stop.set()
    if self._thread is None:
      return
    if self._lost is None:
      self._thread.join(timeout=30)
    self._thread = None
    if self._lost is not None:
      return
    if self._lease is not None:
      try:
        self._lease.release()
      except Exception as e:  # noqa: BLE001 - the store unreachable: the lease expires by itself
        logging.warning("could not release the lease %s: %s", self.path, e)
    elif (self._read() or {}).get("token") == self._token:
      self.path.unlink(missing_ok=True)

  def __enter__(self) -> "WorkdirLock":
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


def append(path, text: str) -> None:
  """``text`` added at the end of the workdir file ``path`` (JSON Lines that a run adds to now and then: samples,
  bad batches). An object store cannot append (gcsfs's mode 'a' silently overwrites): there the object is read and
  written back whole with ``text`` added, which the store makes visible whole."""
  path = epath.Path(path)
  if not paths.is_url(os.fspath(path)):
    with path.open("a") as f:
      f.write(text)
    return
  path.write_text((path.read_text() if path.exists() else "") + text)


def log_path(workdir: str) -> str | None:
  """Where this process's log lines go besides the console: ``<workdir>/train.log`` for process 0 (on an object store
  the segments of :mod:`jaxtrain.logs` under ``train.log.d/``, read back as one file by :func:`jaxtrain.logs.read`),
  None for the others."""
  if jax.process_index() != 0:
    return None
  return paths.join(workdir, LOG_FILE)


class LogFile:
  """Process 0's log lines in ``<workdir>/train.log``: appended to a local file; on an object store, which cannot
  append, written by a :class:`jaxtrain.logs.Stream` (at most once a second, the loop never waiting; a kill loses the
  last second's lines). An unexpected exception leaving the block has its whole traceback written there, and the
  log's path set on it as ``log_file``, so that the console can show one line and say where the rest is."""

  def __init__(self, workdir: str):
    self.path = log_path(workdir)
    self._handler = None

  def __enter__(self) -> "LogFile":
    if self.path:
      if paths.is_url(self.path):
        self._handler = logs.Handler(logs.open_stream(self.path, LOG_FILE))
      else:
        self._handler = std_logging.FileHandler(self.path)
      self._handler.setFormatter(std_logging.Formatter("%(asctime)s %(levelname).1s %(module)s: %(message)s"))
      # Orbax narrates every save phase at INFO: keep its warnings and errors only; and so the store clients'
      # chatter while they write these logs (a line about a line).
      self._handler.addFilter(lambda r: r.levelno >= std_logging.WARNING or not (
          "/orbax/" in r.pathname or r.threadName.startswith(logs.THREAD)))
      std_logging.getLogger().addHandler(self._handler)  # absl's logger propagates to the root logger
    return self

  def __exit__(self, exc_type, error, tb) -> None:
    if self._handler is None:
      return
    expected = (UserError, exits.Restart)  # one line on the console says it all
    if error is not None and not isinstance(error, expected) and isinstance(error, Exception):
      self._handler.handle(std_logging.LogRecord("jaxtrain", std_logging.ERROR, __file__, 0, "unexpected error",
                                                 None, (exc_type, error, tb)))
      error.log_file = self.path
    std_logging.getLogger().removeHandler(self._handler)
    self._handler.close()  # on a store: its lines written (bounded by jaxtrain.logs.CLOSE_S)


@contextlib.contextmanager
def hold(workdir: str, renew_s: float = 10.0, lease_s: float = 120.0) -> Iterator[None]:
  """The workdir for one run: process 0 takes the lock (every process fails with WorkdirBusy if it cannot, or with
  exits.Restart when its store did not answer) and writes ``train.log``; both are released when the block ends,
  whatever ends it. ``lease_s``: the lock's lease on an object store (:class:`WorkdirLock`). While the block runs,
  :func:`held` is the lock and :func:`fence` asks it."""
  lock, refused = None, None
  if jax.process_index() == 0:
    try:
      lock = WorkdirLock(workdir, renew_s, lease_s).acquire()
    except (UserError, exits.Restart) as e:  # busy, not writable, or no answer: every process stops with one line
      refused = e
  if jax.process_count() > 1:
    # Process 0's outcome: 0 taken, 1 refused (the user's to fix), 2 + i a restart cures it (exits.CAUSES[i]).
    outcome = 0 if refused is None else 1 if isinstance(refused, UserError) else 2 + exits.CAUSES.index(refused.cause)
    outcome = int(multihost_utils.broadcast_one_to_all(np.int32(outcome)))
    if outcome == 1 and refused is None:
      refused = WorkdirBusy(workdir, "process 0 cannot take this workdir: another run uses it, or it is not "
                            "writable (process 0's error says which)",
                            "wait for that run to finish or use another --config.workdir")
    elif outcome > 1 and refused is None:
      refused = exits.Restart("process 0 could not take this workdir's lock (process 0's error says why)",
                              cause=exits.CAUSES[outcome - 2])
  if refused is not None:
    raise refused
  if lock is not None:
    _HELD.append(lock)
  try:
    with LogFile(workdir) if lock is not None else contextlib.nullcontext():
      yield
  finally:
    if lock is not None:
      _HELD.remove(lock)
      lock.release()


def lease_lost(e: BaseException) -> LeaseLost | None:
  """The :class:`LeaseLost` that ``e`` is or was raised from (a checkpoint's commit refused in Orbax's background
  thread surfaces at the next save or wait, perhaps wrapped), or None."""
  found = errors.find_cause(e, lambda x: isinstance(x, LeaseLost))
  return found if isinstance(found, LeaseLost) else None


_HELD: list[WorkdirLock] = []  # the lock hold() holds in this process, while it does


def held() -> WorkdirLock | None:
  """The workdir lock that :func:`hold` holds in this process (process 0 of a run, while it trains), or None."""
  return _HELD[-1] if _HELD else None


def fence() -> None:
  """Raises :class:`LeaseLost` when this process's run no longer holds its workdir (:meth:`WorkdirLock.fence`); nothing
  in a process that holds no lock (every process but 0, whose stop ends theirs; a tool). The training loop calls it
  before each step and before it writes metrics."""
  lock = held()
  if lock is not None:
    lock.fence()

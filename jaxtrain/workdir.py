"""One live run per workdir: a lock that process 0 holds while it trains, and the run's log file.

The lock is ``<workdir>/run.lock``, a small JSON file naming the holder (host, PID, process start time, since
when) with a ``beat`` counter that a background thread increments every ``renew_s`` seconds. A second start
while the holder is alive is refused (:class:`WorkdirBusy`, exit 2) before anything in the workdir is touched.
A lock whose holder is gone is taken over with a warning, so a scheduler's restart after a SIGKILL, an OOM kill
or a lost host resumes without manual cleanup. Whether the holder is alive:

- same host: its PID exists, is not a zombie and started when the lock says (a reused PID is not the holder);
- another host (or a PID we cannot see): the beat is watched for up to ``3 x renew_s``; a beat that moves
  proves the holder alive, one that does not means it is gone. No clocks are compared across hosts.

Creating the lock is atomic on local disks (``O_CREAT | O_EXCL``) and taking over a stale one is a rename that
only one contender wins. An object store (``gs://``, ``s3://``) has neither, nor PIDs to look at: there the lock is
a lease (:mod:`jaxtrain.lease`), written with the store's conditional writes so that one contender wins, renewed
by the holder's thread, refused to a second run while it is renewed, and taken over once it has expired
(``workdir_lease_s`` after the holder's last renewal: a crashed run's successor waits at most that long).
"""

from __future__ import annotations

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

from jaxtrain import exits
from jaxtrain import lease as lease_lib
from jaxtrain import paths
from jaxtrain.errors import UserError

LOCK_FILE = "run.lock"
LOG_FILE = "train.log"


class WorkdirBusy(UserError):
  """Another live run holds the workdir."""


def _process_start(pid: int) -> str | None:
  """The kernel's start time of ``pid`` (Linux ``/proc``), to tell a reused PID from the holder; None if
  unknown. The second field may contain spaces: split after the closing parenthesis."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return None
  return fields[19] if fields[0] != "Z" else "zombie"


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
  """``with WorkdirLock(workdir): ...`` holds the workdir for the block. Only process 0 should take it."""

  def __init__(self, workdir: str, renew_s: float = 10.0, lease_s: float = 120.0):
    self.dir = epath.Path(workdir)
    self.path = self.dir / LOCK_FILE
    self.renew_s = renew_s
    self._token = uuid.uuid4().hex
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._beat = 0
    self._lease = None
    if paths.is_url(os.fspath(workdir)):  # renewed often enough that a renewal or two may fail without losing it
      self.renew_s = min(renew_s, lease_s / 4)
      self._lease = lease_lib.Lease(paths.join(os.fspath(workdir), LOCK_FILE), lease_s, self.renew_s, self._token,
                                    {"since": time.strftime("%Y-%m-%d %H:%M:%S %Z")})

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
    if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int):
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
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "started_at": self._started,
                       "renew_s": self.renew_s, "beat": self._beat, "token": self._token})

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
    except Exception as e:  # noqa: BLE001 - each store's client raises its own (no bucket, no credentials, offline)
      raise UserError(os.fspath(self.dir), f"the workdir's lease ({LOCK_FILE}) cannot be read or written "
                      f"({type(e).__name__}: {e})", "check the URL, and the store's endpoint and credentials "
                      "(docs/operations.md)") from None
    if held is None:
      return
    if "taken_over" in held:
      held = held["taken_over"]
      logging.warning("%s: the lease of the run that held it (host %s, PID %s, since %s) expired; taking over",
                      self.path, held.get("host"), held.get("pid"), held.get("since"))
      return
    raise WorkdirBusy(os.fspath(self.dir), self._describe(held) + f"; its lease ({LOCK_FILE}) is renewed",
                      "wait for it to finish or stop it, or use another --config.workdir; the lease of a run that "
                      f"was killed expires {held.get('lease_s', '?')}s after its last renewal (workdir_lease_s) and "
                      "is then taken over automatically")

  def _take(self) -> None:
    if self._lease is not None:
      return self._take_lease()
    self.dir.mkdir(parents=True, exist_ok=True)
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
    held = self._read() or {}
    raise WorkdirBusy(os.fspath(self.dir), self._describe(held), "another run started at the same moment")

  def acquire(self) -> "WorkdirLock":
    """Takes the lock or raises WorkdirBusy; a workdir that cannot be created or written is a UserError (one
    line). Creates the workdir if needed (nothing else)."""
    self._started = time.time()
    try:
      self._take()
    except OSError as e:  # not FileExistsError (handled by _create): a path this user cannot write to
      raise UserError(os.fspath(self.dir), f"the workdir cannot be created or written ({e.strerror or e})",
                      "pass a --config.workdir this user can write to") from None
    self._thread = threading.Thread(target=self._renew, name="jaxtrain-workdir-lock", daemon=True)
    self._thread.start()
    return self

  def _renew(self) -> None:
    while not self._stop.wait(self.renew_s):
      if self._lease is not None:
        try:
          taken = self._lease.renew()
        except Exception as e:  # noqa: BLE001 - the store unreachable: the next renewal tries again
          logging.warning("could not renew the lease %s (it lasts %.0fs from its last renewal): %s", self.path,
                          self._lease.lease_s, e)
          continue
        if taken is not None:
          logging.error("%s was taken over by another run (host %s, PID %s): two runs may now share this workdir",
                        self.path, taken.get("host"), taken.get("pid"))
          return
        continue
      held = self._read()
      if held is not None and held.get("token") != self._token:
        logging.error("%s was taken over by another run (host %s, PID %s): two runs may now share this workdir",
                      self.path, held.get("host"), held.get("pid"))
        return
      self._beat += 1
      try:
        self._rewrite()
      except OSError as e:  # a full disk must not kill training; the next renewal tries again
        logging.warning("could not renew %s: %s", self.path, e)

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=30)
      self._thread = None
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
  """Where this process's log lines go besides the console: ``<workdir>/train.log`` for process 0 of a run
  with a local workdir, else None."""
  if jax.process_index() != 0 or paths.is_url(workdir):
    return None
  return os.path.join(workdir, LOG_FILE)


class LogFile:
  """Process 0's log lines appended to ``<workdir>/train.log`` (local workdirs: object stores cannot append).
  An unexpected exception leaving the block has its whole traceback written there, and the file's path set
  on it as ``log_file``, so that the console can show one line and say where the rest is."""

  def __init__(self, workdir: str):
    self.path = log_path(workdir)
    self._handler = None

  def __enter__(self) -> "LogFile":
    if self.path:
      self._handler = std_logging.FileHandler(self.path)
      self._handler.setFormatter(std_logging.Formatter("%(asctime)s %(levelname).1s %(module)s: %(message)s"))
      # Orbax narrates every save phase at INFO: keep its warnings and errors only.
      self._handler.addFilter(lambda r: r.levelno >= std_logging.WARNING or "/orbax/" not in r.pathname)
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
    self._handler.close()


@contextlib.contextmanager
def hold(workdir: str, renew_s: float = 10.0, lease_s: float = 120.0) -> Iterator[None]:
  """The workdir for one run: process 0 takes the lock (every process fails with WorkdirBusy if it cannot)
  and writes ``train.log``; both are released when the block ends, whatever ends it. ``lease_s``: the lock's lease
  on an object store (:class:`WorkdirLock`)."""
  lock, refused = None, None
  if jax.process_index() == 0:
    try:
      lock = WorkdirLock(workdir, renew_s, lease_s).acquire()
    except UserError as e:  # busy, or not writable: every process stops with one line
      refused = e
  if jax.process_count() > 1:
    taken = bool(multihost_utils.broadcast_one_to_all(np.int32(refused is None and jax.process_index() == 0)))
    if not taken and refused is None:
      refused = WorkdirBusy(workdir, "process 0 cannot take this workdir: another run uses it, or it is not "
                            "writable (process 0's error says which)",
                            "wait for that run to finish or use another --config.workdir")
  if refused is not None:
    raise refused
  try:
    with LogFile(workdir) if lock is not None else contextlib.nullcontext():
      yield
  finally:
    if lock is not None:
      lock.release()

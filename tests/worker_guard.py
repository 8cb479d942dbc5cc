"""A pytest-xdist worker that dies cannot hang the run (a pytest plugin of the controlling process, loaded by
tests/conftest.py).

xdist learns that a worker is gone when the worker's pipe reaches its end, and a pipe ends only when every process
holding it has closed it. A process the worker forked without exec (a ``multiprocessing`` fork, a data loader's
worker, a server) inherits the pipe; if the worker dies in native code (a SIGABRT) while such a child lives on, the
run waits for that child, for ever if it never exits. So, every ``POLL_S`` seconds: a worker process that has exited
while xdist still counts it up is given ``GRACE_S`` seconds to be noticed; after that, the processes still holding
its pipe are named in one line and killed, xdist sees the pipe end, reports the test the worker was running as
crashed, and the run ends as with any crash (``--max-worker-restart=0``). Linux only (it reads /proc); elsewhere it
does nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

POLL_S = 2.0
GRACE_S = 5.0


def pipe_holders(inode: int, exclude: int) -> list[int]:
  """The processes (but ``exclude``) with a file descriptor on the pipe ``inode``."""
  target, holders = f"pipe:[{inode}]", []
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) == exclude:
      continue
    try:
      fds = os.listdir(f"/proc/{entry}/fd")
      if any(os.readlink(f"/proc/{entry}/fd/{fd}") == target for fd in fds):
        holders.append(int(entry))
    except OSError:  # gone, or not ours to read
      continue
  return holders


class WorkerGuard:
  """Watches the worker processes of one xdist session (xdist's ``pytest_testnodeready`` / ``pytest_testnodedown``
  hooks) from a daemon thread."""

  def __init__(self):
    self._lock = threading.Lock()
    self._nodes: dict[str, object] = {}  # worker id -> xdist's WorkerController, while up
    self._dead_since: dict[str, float] = {}
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def pytest_testnodeready(self, node) -> None:
    with self._lock:
      self._nodes[node.gateway.id] = node
      if self._thread is None:
        self._thread = threading.Thread(target=self._watch, name="worker-guard", daemon=True)
        self._thread.start()

  def pytest_testnodedown(self, node, error) -> None:
    with self._lock:
      self._nodes.pop(node.gateway.id, None)

  def pytest_unconfigure(self, config) -> None:
    self._stop.set()

  def _watch(self) -> None:
    clock = 0.0
    while not self._stop.wait(POLL_S):
      clock += POLL_S
      with self._lock:
        nodes = dict(self._nodes)
      for wid, node in nodes.items():
        popen = getattr(getattr(node.gateway, "_io", None), "popen", None)  # execnet's Popen2IOMaster
        if popen is None or popen.poll() is None:
          continue
        first = self._dead_since.setdefault(wid, clock)
        if clock - first < GRACE_S:
          continue
        try:
          inode = os.fstat(popen.stdout.fileno()).st_ino
        except (OSError, ValueError):  # xdist closed the pipe meanwhile: it saw the worker go
          continue
        holders = pipe_holders(inode, exclude=os.getpid())
        if holders:
          print(f"\ntests/worker_guard.py: worker {wid} (pid {popen.pid}) exited with status {popen.returncode}; "
                f"its pipe is still held by process(es) {', '.join(map(str, holders))} it started: killing them so "
                "that the run ends", file=sys.stderr, flush=True)
          for pid in holders:
            try:
              os.kill(pid, signal.SIGKILL)
            except OSError:
              pass


def pytest_configure(config) -> None:
  """Only in the controlling process of an xdist run on Linux (a worker has ``workerinput``)."""
  if (not hasattr(config, "workerinput") and sys.platform.startswith("linux")
      and config.pluginmanager.hasplugin("xdist") and getattr(config.option, "numprocesses", None)):
    config.pluginmanager.register(WorkerGuard(), "worker-guard")

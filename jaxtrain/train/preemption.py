"""Preemption: turn SIGTERM / SIGINT into a clean, restartable stop, on one process or many.

The first signal asks the loop to finish its step, save a checkpoint synchronously and stop; the run then exits
75 (:data:`jaxtrain.exits.RESTART`: restart the same command to resume). A second signal exits at once with code
130: whatever save is in flight stays an uncommitted ``*.orbax-checkpoint-tmp`` folder, which restore ignores, so
nothing committed is ever damaged.

The signals are acted on by a watcher thread woken through :func:`signal.set_wakeup_fd`, not by a Python-level
handler: a handler runs only when the main thread returns to the interpreter, and a stuck run's main thread may
sit in a device wait or a collective for ever. On a multi-process job every process must stop after the same
step: the first signal posts a preemption notice to JAX's coordination service, whose preemption sync protocol
then picks that step for all processes (:func:`multihost_utils.reached_preemption_sync_point`).
"""

from __future__ import annotations

import datetime
import os
import signal
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils

from jaxtrain import _compat, exits

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:

  def __init__(self):
    self._requested = False
    self._previous: dict[int, object] = {}
    self._wakeup = None  # (read fd, write fd, the wakeup fd before ours)

  def __enter__(self) -> "PreemptionGuard":
    if threading.current_thread() is not threading.main_thread():
      return self  # signals reach the main thread only: a run started elsewhere is stopped by its caller
    read, write = os.pipe()
    os.set_blocking(write, False)  # the interpreter's C-level handler writes the signal number here at once
    self._wakeup = (read, write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
    for sig in SIGNALS:
      self._previous[sig] = signal.signal(sig, lambda *_: None)  # the watcher acts; this only enables the wakeup
    threading.Thread(target=self._watch, args=(read,), name="jaxtrain-signals", daemon=True).start()
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      # None: the handler before ours was not installed from Python (e.g. JAX's C++ SIGTERM notifier on a
      # multi-process job, which we replaced); after the loop a signal may simply end the process.
      signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    if self._wakeup:
      read, write, before = self._wakeup
      signal.set_wakeup_fd(before)
      os.close(write)  # the watcher reads end-of-file and ends, then closes the read end

  def _watch(self, read: int) -> None:
    try:
      while data := os.read(read, 64):
        for signum in data:
          if signum in SIGNALS:
            self._received(signal.Signals(signum))
    finally:
      os.close(read)

  def _received(self, sig: signal.Signals) -> None:
    if self._requested:
      logging.warning("second %s: exiting now without saving (exit %d)", sig.name, exits.INTERRUPTED)
      logging.flush()
      os._exit(exits.INTERRUPTED)
    self._requested = True
    logging.warning("%s received: finishing this step, saving a checkpoint, then exiting %d (send it again to exit "
                    "immediately)", sig.name, exits.RESTART)
    if jax.process_count() > 1:
      _notify_peers()

  def requested(self, step: int) -> bool:
    """Whether to stop after ``step``; on multi-process jobs all processes agree."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._requested


def _notify_peers() -> None:
  """Starts JAX's preemption sync protocol on every process, as JAX's own SIGTERM notifier would. That notifier
  is a C++ signal handler that handles only the first signal, so a second signal could never end a stuck job;
  ours replaces it, and JAX has no public call to post the notice, hence XLA's key through the coordination client
  (jaxtrain._compat). Death time "now": the protocol starts at once."""
  try:
    client = _compat.coordination_client()
  except _compat.PrivateAPIMissing as e:  # no sync point comes: the job trains on until the scheduler kills it
    logging.error("cannot tell the other processes of the preemption, so it saves nothing: %s", e)
    return
  try:
    _compat.post_preemption_notice(client, datetime.datetime.now(datetime.timezone.utc).isoformat())
  except Exception as e:  # noqa: BLE001 - another process posted it first (ALREADY_EXISTS): the protocol runs
    logging.info("preemption notice already posted (%s)", str(e).splitlines()[0] if str(e) else type(e).__name__)

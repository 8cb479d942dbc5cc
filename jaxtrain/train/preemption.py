"""Preemption: turn SIGTERM / SIGINT (and, on multi-host jobs, JAX's preemption sync point) into a clean stop.

The first signal asks the loop to finish its step, save a checkpoint synchronously and exit 0. A second signal
exits at once with code 130: whatever save is in flight stays an uncommitted ``*.orbax-checkpoint-tmp`` folder,
which restore ignores, so nothing committed is ever damaged.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils


class PreemptionGuard:

  def __init__(self):
    self._requested = False
    self._previous = {}

  def __enter__(self) -> "PreemptionGuard":
    # Multi-process jobs use JAX's preemption notifier (it handles SIGTERM through the coordination service,
    # so every process stops at the same step); a single process handles the signals itself.
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame) -> None:
    del frame
    if self._requested:
      logging.warning("second %s: exiting now without saving", signal.Signals(signum).name)
      logging.flush()
      os._exit(130)
    self._requested = True
    logging.warning("%s received: finishing this step, saving a checkpoint, then exiting (send it again to exit "
                    "immediately)", signal.Signals(signum).name)

  def requested(self, step: int) -> bool:
    """Whether to stop after ``step``; on multi-process jobs all processes agree."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._requested

"""What ``python -m jaxtrain.main`` exits with, so that a scheduler can act on it without reading logs.

One table (:data:`CODES`), read by ``main``, the launchers under ``tools/launch`` and the docs
(``docs/operations.md``, whose table a test compares with this one):

- ``0`` the run reached ``train.steps`` (or its workdir already had): done, do not restart;
- ``1`` a bug, or training stopped on purpose (the NaN policy): restarting would do the same, stop;
- ``2`` a user mistake (config, data, paths), reported before anything was touched: fix it, do not restart;
- ``3`` restartable failures keep coming: more restarts in the last hour than ``distributed.max_restarts_per_hour``
  (:mod:`jaxtrain.restarts`; the launchers count theirs too): a restart does not cure this, stop;
- ``75`` (``EX_TEMPFAIL`` of sysexits.h) training stopped early for a cause a restart cures: a preemption or time
  limit (after its checkpoint), a lost peer process, a hang the watchdog caught. Restart the same command: it
  resumes from the newest checkpoint;
- ``130`` a second SIGTERM/SIGINT ended the run at once (a person insisted): nothing new saved, stop.
"""

from __future__ import annotations

DONE = 0
BUG = 1
USER_ERROR = 2
RESTARTS_EXHAUSTED = 3
RESTART = 75
INTERRUPTED = 130

CODES: dict[int, str] = {
    DONE: "train.steps reached (or already reached): done",
    BUG: "a bug, or training stopped by the NaN policy: do not restart",
    USER_ERROR: "a mistake in the config, data or paths, reported before anything was touched: fix it",
    RESTARTS_EXHAUSTED: "more restarts in the last hour than distributed.max_restarts_per_hour: a restart does not "
                        "cure this: do not restart",
    RESTART: "stopped early for a cause a restart cures (preemption or time limit after its save, a lost peer, "
             "a hang): restart the same command",
    INTERRUPTED: "a second SIGTERM/SIGINT: stopped at once, nothing new saved: do not restart",
}


# Why a run stopped restartably (exit 75): the words the restart budget (jaxtrain.restarts), goodput's account of
# the interruptions (jaxtrain.goodput) and the console line name it by.
PREEMPTED = "preempted"  # a SIGTERM/SIGINT: a preemption, a maintenance event, a time limit
STORE_UNREACHABLE = "store unreachable"  # an object store that did not answer (refused, reset, 5xx, throttled)
STORAGE_IO = "storage I/O"  # a disk or a network filesystem that failed a read or write (EIO, ESTALE)
LOST_PEER = "lost peer"  # another process of the job went away
HANG = "hang"  # the watchdog: no step finished in time
LEASE_LOST = "lease lost"  # the workdir's lease could not be renewed before it ran out, or was taken over
CAUSES = (PREEMPTED, STORE_UNREACHABLE, STORAGE_IO, LOST_PEER, HANG, LEASE_LOST)


class Restart(Exception):
  """Training stopped before ``train.steps`` for a cause a restart cures; ``main`` prints it as one line and exits
  :data:`RESTART`. ``str(e)`` says why and what was saved; ``cause`` names it (one of :data:`CAUSES`: a subclass
  sets its own, or pass ``cause=``)."""

  cause = PREEMPTED

  def __init__(self, *args, cause: str | None = None):
    super().__init__(*args)
    if cause is not None:
      if cause not in CAUSES:
        raise ValueError(f"unknown restart cause {cause!r}; one of {CAUSES}")
      self.cause = cause


class RestartsExhausted(Exception):
  """The run did not start: the restarts of the last hour exceed ``distributed.max_restarts_per_hour``; ``main``
  prints it as one line and exits :data:`RESTARTS_EXHAUSTED`."""

"""Acting on trouble: anomaly warnings (loss / grad-norm spikes, throughput drops, loss stagnation) and a
hang watchdog that dumps every thread's stack and exits 75 (restartable) so that the scheduler restarts the job.

NaN/Inf handling itself lives in the train step (a non-finite update is never applied, so a NaN can never
reach the state or a checkpoint); what the run does next is the ``monitor.nan_policy`` registered in
:data:`NAN_POLICIES` (skip / rollback / stop), which the training loop (jaxtrain.train.loop) carries out.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import math
import os
import statistics
import sys
import threading
import time
from typing import Callable, Literal

from absl import logging
import ml_collections
from jaxtrain import exits
from jaxtrain.errors import check_positive
from jaxtrain.registry import Registry

# What the loop does about a new non-finite step: go on (its update was not applied), go back to the newest
# checkpoint (rollback: the policy's own; escalate: skip's when the problem persists) or stop the run (exit 1).
Action = Literal["skip", "rollback", "escalate", "stop"]


@dataclasses.dataclass(frozen=True)
class NonFiniteStep:
  """A new non-finite step (loss, gradients or updated state), as a NaN policy sees it."""
  step: int
  streak: int  # new non-finite steps in a row, this one included
  final: bool  # the run's last step (train.steps)
  max_consecutive: int  # monitor.max_consecutive_nonfinite


# monitor.nan_policy -> (NonFiniteStep) -> Action. Adding a policy is one registration; the loop enforces the
# rollback limits (see jaxtrain.train.loop.RollbackLimits) whatever the policy asks.
NAN_POLICIES: Registry[Callable[[NonFiniteStep], Action]] = Registry("monitor.nan_policy", "NaN policy",
                                                                     how="jaxtrain.monitor.NAN_POLICIES.register")


@NAN_POLICIES.register("skip")
def skip_policy(bad: NonFiniteStep) -> Action:
  """Go on without the update; ``max_consecutive`` new non-finite steps in a row, or one at the last step (a run
  must not end on one), escalate to a rollback."""
  return "escalate" if bad.streak >= bad.max_consecutive or bad.final else "skip"


@NAN_POLICIES.register("rollback")
def rollback_policy(bad: NonFiniteStep) -> Action:
  """Back to the newest checkpoint; the replay skips the bad step's batch."""
  del bad
  return "rollback"


@NAN_POLICIES.register("stop")
def stop_policy(bad: NonFiniteStep) -> Action:
  """Stop the run (exit 1); the checkpoints are intact."""
  del bad
  return "stop"


def defaults() -> ml_collections.ConfigDict:
  """The ``monitor`` config group."""
  return ml_collections.ConfigDict(dict(
      nan_policy="skip",  # non-finite loss, grads or updated state: skip (drop the update) | rollback (to the
      # last checkpoint, skipping the offending batch) | stop, or one registered in monitor.NAN_POLICIES. A
      # non-finite update is never applied.
      max_consecutive_nonfinite=5,  # skip: this many in a row (or one at the last step) roll back; a second
      # such rollback to the same checkpoint stops the run (exit 1). rollback: at most this many to one checkpoint
      spike_sigma=6.0,  # warn when loss or grad norm exceeds the window mean + k sigma (0: off)
      spike_window=50,  # logged steps in that window
      stagnation_logs=0,  # warn when the loss has not improved for this many log intervals (0: off)
      watchdog_multiple=10.0,  # exit 75 (restartable; stacks in train.log) if no step finishes in this x the median
      watchdog_min_s=120.0,  # ... but never sooner than this
      watchdog_timeout_s=0.0,  # a hard limit instead (0: use the multiple)
  ))


def validate(config) -> None:
  NAN_POLICIES.check(config)
  check_positive(config, ["monitor.spike_sigma", "monitor.stagnation_logs", "monitor.watchdog_timeout_s"],
                 allow_zero=True)
  check_positive(config, ["monitor.spike_window", "monitor.watchdog_multiple", "monitor.watchdog_min_s",
                          "monitor.max_consecutive_nonfinite"])


class AnomalyDetector:
  """Fed each logged record; returns the names of the anomalies it sees (also logged as warnings)."""

  def __init__(self, sigma: float = 6.0, window: int = 50, stagnation_logs: int = 0, throughput_drop: float = 0.5):
    self.sigma, self.stagnation_logs, self.throughput_drop = sigma, stagnation_logs, throughput_drop
    self.history = {k: collections.deque(maxlen=window) for k in ("loss", "grad_norm", "tokens_per_sec")}
    self.best_loss, self.since_best = float("inf"), 0

  def __call__(self, step: int, record: dict[str, float]) -> list[str]:
    if not all(math.isfinite(record[k]) for k in self.history):
      return []  # the NaN policy deals with non-finite steps; they would poison the statistics
    found = []
    for key in ("loss", "grad_norm"):
      past = self.history[key]
      if self.sigma and len(past) >= 10:
        mean, std = statistics.fmean(past), statistics.pstdev(past)
        if record[key] > mean + self.sigma * max(std, 1e-6 * abs(mean)):
          found.append(f"{key}_spike")
          logging.warning("step %d: %s spike: %.4g > mean %.4g + %.1f sigma (%.3g)", step, key, record[key], mean,
                          self.sigma, std)
      past.append(record[key])
    past = self.history["tokens_per_sec"]
    if len(past) >= 5 and record["tokens_per_sec"] < self.throughput_drop * statistics.median(past):
      found.append("throughput_drop")
      logging.warning("step %d: throughput dropped to %.0f tok/s (median %.0f)", step, record["tokens_per_sec"],
                      statistics.median(past))
    past.append(record["tokens_per_sec"])
    if record["loss"] < self.best_loss:
      self.best_loss, self.since_best = record["loss"], 0
    else:
      self.since_best += 1
      if self.stagnation_logs and self.since_best == self.stagnation_logs:
        found.append("loss_stagnation")
        logging.warning("step %d: loss has not improved on %.4f for %d log intervals", step, self.best_loss,
                        self.since_best)
    return found


class Watchdog:
  """A daemon thread that ends the process if no heartbeat arrives in time.

  The limit is ``multiple`` x the median gap between heartbeats seen so far (at least ``min_s``; 10 x ``min_s``
  before the first one), or ``timeout_s`` when given. When it fires it writes what ``describe()`` says (where the
  loop is) and every thread's Python stack to stderr and to ``log_path`` (train.log), then exits 75: crashes are
  better than hangs, and a hang is something a restart cures (:data:`jaxtrain.exits.RESTART`).
  """

  EXIT_CODE = exits.RESTART

  def __init__(self, multiple: float = 10.0, min_s: float = 60.0, timeout_s: float = 0.0, clock=time.monotonic,
               log_path: str | None = None, describe: Callable[[], str] = lambda: ""):
    self.multiple, self.min_s, self.timeout_s = multiple, min_s, timeout_s
    self.log_path, self.describe = log_path, describe
    self._clock = clock  # seconds, monotonic; tests pass a fake one
    self._last = clock()
    self._gaps = collections.deque(maxlen=100)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jaxtrain-watchdog", daemon=True)

  def start(self) -> "Watchdog":
    self._last = self._clock()
    self._thread.start()
    return self

  def beat(self) -> None:
    now = self._clock()
    self._gaps.append(now - self._last)
    self._last = now

  def limit(self) -> float:
    if self.timeout_s:
      return self.timeout_s
    return max(self.min_s, self.multiple * statistics.median(self._gaps)) if self._gaps else self.min_s * 10

  def overdue(self) -> float | None:
    """Seconds since the last heartbeat (or the start) when that is past the limit, else None."""
    waited = self._clock() - self._last
    return waited if waited > self.limit() else None

  def _run(self) -> None:
    while not self._stop.wait(min(1.0, self.limit() / 10)):
      waited = self.overdue()
      if waited is not None:
        self._expire(waited)
        return

  def _expire(self, waited: float) -> None:
    try:
      where = self.describe()
    except Exception as e:  # noqa: BLE001 - the report must not keep the process alive
      where = f"(could not say where the loop is: {e!r})"
    message = (f"jaxtrain: watchdog: no step finished for {waited:.1f}s (limit {self.limit():.1f}s): {where}; "
               f"stacks of all threads follow, then exit {self.EXIT_CODE} (restartable)\n")
    targets = [sys.stderr]
    if self.log_path:
      try:
        targets.append(open(self.log_path, "a"))  # noqa: SIM115 - the process exits below
      except OSError:
        pass  # the console still has it
    for f in targets:
      f.write(message)
      f.flush()
      faulthandler.dump_traceback(file=f, all_threads=True)
      f.flush()
    os._exit(self.EXIT_CODE)

  def stop(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=5)

"""Acting on trouble: anomaly warnings (loss / grad-norm spikes, throughput drops, loss stagnation) and a
hang watchdog that dumps every thread's stack and exits 75 (restartable) so that the scheduler restarts the job.

NaN/Inf handling itself lives in the train step (a non-finite update is never applied, so a NaN can never
reach the state or a checkpoint); what the run does next is the ``monitor.nan_policy`` registered in
:data:`NAN_POLICIES` (skip / rollback / stop), which the training loop (jaxtrain.train.loop) carries out.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import faulthandler
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, Literal

import jax
import ml_collections
from absl import logging

from jaxtrain import _compat, exits, logs, paths, restarts
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
      watchdog_compile_s=3600.0,  # compiles are not counted in a step's time; one compile may take this long (0: any)
      straggler_threshold=0.15,  # name a process whose data wait exceeds the median process's by this fraction of
      # the step time (0: off) ...
      straggler_logs=3,  # ... over this many logged steps; the same window for a slowdown of the whole job:
      slowdown_threshold=0.15,  # warn when the step time exceeds the job's recent median by this fraction (0: off)
  ))


def validate(config) -> None:
  NAN_POLICIES.check(config)
  check_positive(config, ["monitor.spike_sigma", "monitor.stagnation_logs", "monitor.watchdog_timeout_s",
                          "monitor.watchdog_compile_s",
                          "monitor.straggler_threshold", "monitor.slowdown_threshold"], allow_zero=True)
  check_positive(config, ["monitor.spike_window", "monitor.watchdog_multiple", "monitor.watchdog_min_s",
                          "monitor.max_consecutive_nonfinite", "monitor.straggler_logs"])


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


class Stragglers:
  """Fed at every logged step with each process's data wait per step and the job's step time; names a straggler
  and a slowdown of the whole job (warnings, and ``straggler/...`` / ``slowdown`` entries for the record).

  In an SPMD job every process's step takes the same wall time: whoever is late makes the others wait in the
  collectives, so step times cannot tell the late one. Its own wait for its input can: a host whose data
  loading, storage or CPU is slow waits longer for its batches than the others. Over the last ``logs`` logged
  intervals, a process is a straggler when its data wait exceeds the median process's by more than ``threshold``
  of the job's time (what it costs everyone) and by more than ``min_excess_s`` per step (a few milliseconds apart
  is the OS scheduler's doing, not a slow host: with steps of milliseconds, as in tests, those would pass any
  fraction); it is named when it becomes one, and again after it recovered. (A
  slow chip delays every process alike: the profiler, not this, finds it.) The job slows down when its step time
  over the last ``logs`` intervals exceeds the median of its recent such figures by ``slowdown``. Judging windows,
  not single intervals, keeps one short interval (a log right after a checkpoint's) from breaking a verdict.
  """

  def __init__(self, hosts: list[str], threshold: float = 0.15, logs: int = 3, slowdown: float = 0.15,
               history: int = 20, min_excess_s: float = 0.01, warn: Callable[..., None] = logging.warning):
    self.hosts, self.threshold, self.slowdown, self.warn = hosts, threshold, slowdown, warn
    self.min_excess_s = min_excess_s
    self.window = collections.deque(maxlen=logs)  # (data waits by process, step time) of the last intervals
    self.recent = collections.deque(maxlen=history)  # the job's step time over earlier windows
    self.named, self.slow = [False] * len(hosts), False

  def __call__(self, step: int, data_waits, step_time: float) -> dict[str, float]:
    self.window.append((list(data_waits), step_time))
    if len(self.window) < self.window.maxlen:
      return {}
    found = {}
    spent = sum(t for _, t in self.window)
    waits = [sum(w[p] for w, _ in self.window) for p in range(len(self.hosts))]
    median = statistics.median(waits)
    for p, wait in enumerate(waits):
      excess = (wait - median) / spent if spent > 0 else 0.0
      straggling = bool(self.threshold) and excess > self.threshold and \
          (wait - median) / len(self.window) > self.min_excess_s
      if straggling:
        found.update({"straggler/process": float(p), "straggler/excess": excess})
        if not self.named[p]:
          n = len(self.window)
          self.warn("step %d: process %d on host %s is a straggler: over the last %d logged steps it waited %.3fs "
                    "per step for its data, the median process %.3fs: %.0f%% of the job's %.3fs per step", step, p,
                    self.hosts[p], n, wait / n, median / n, 100 * excess, spent / n)
      self.named[p] = straggling
    per_step = spent / len(self.window)
    if self.slowdown and len(self.recent) >= 5:
      usual = statistics.median(self.recent)
      slow = per_step > (1 + self.slowdown) * usual
      if slow:
        found["slowdown"] = per_step / usual - 1
        if not self.slow:
          self.warn("step %d: the whole job slowed down: %.3fs per step over the last %d logged steps, %.0f%% over "
                    "its recent median %.3fs", step, per_step, len(self.window), 100 * found["slowdown"], usual)
      self.slow = slow
    self.recent.append(per_step)
    return found


class Watchdog:
  """A daemon thread that ends the process if no heartbeat arrives in time.

  Its limit depends on the phase of the loop (docs/observability.md):

  - the first step (until the loop's first heartbeat: the first batch, the first run of the compiled step):
    10 x ``min_s``;
  - every later step: ``multiple`` x the median gap between heartbeats so far, at least ``min_s``;
  - ``timeout_s``, when given, replaces both;
  - compiles are not counted. The loop's thread compiles when a jit call misses its caches (the evaluator's first
    call, a recompile, anything compiled lazily): JAX reports each such compile on the compiling thread through
    ``jax.monitoring`` (its trace, lowering and backend compile, in that order; jaxtrain._compat), and the span from
    the trace's start to the backend compile's end is left out of the gap. A compile in progress is not counted
    either: it is bounded on its own by ``compile_s`` (0: unbounded). Around a call known to compile (the
    evaluator's first), the loop says so with :meth:`compiling`, which also covers the trace before JAX reports it.

  When it fires it writes what ``describe()`` says (where the loop is) and every thread's Python stack to stderr and
  to ``log_path`` (train.log: a local file, or on an object store its :mod:`jaxtrain.logs` stream, which it writes,
  with the process's other logs there, for up to :data:`jaxtrain.logs.EXIT_S` seconds), records the exit
  (:mod:`jaxtrain.restarts`), then exits 75: crashes are better than hangs, and a hang is something a restart cures
  (:data:`jaxtrain.exits.RESTART`) up to the restart budget.
  """

  EXIT_CODE = exits.RESTART

  def __init__(self, multiple: float = 10.0, min_s: float = 60.0, timeout_s: float = 0.0, clock=time.monotonic,
               log_path: str | None = None, describe: Callable[[], str] = lambda: "", compile_s: float = 3600.0):
    self.multiple, self.min_s, self.timeout_s, self.compile_s = multiple, min_s, timeout_s, compile_s
    self.log_path, self.describe = log_path, describe
    self._clock = clock  # seconds, monotonic; tests pass a fake one
    self._last = clock()
    self._gaps = collections.deque(maxlen=100)
    self._lock = threading.Lock()  # the loop's thread (beats, compiles) and the watchdog's (checks)
    self._excluded = 0.0  # seconds of finished compiles since the last heartbeat
    self._compile: list | None = None  # [since, what, said by compiling()] of a compile in progress
    self._loop = threading.get_ident()  # the thread whose compiles count: the one that starts the watchdog
    self._listening = False
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jaxtrain-watchdog", daemon=True)

  def start(self) -> "Watchdog":
    self._last, self._loop = self._clock(), threading.get_ident()
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    self._listening = True
    self._thread.start()
    return self

  def beat(self) -> None:
    with self._lock:
      now = self._clock()
      self._gaps.append(max(0.0, now - self._last - self._excluded - self._compiling_for(now)))
      self._last, self._excluded = now, 0.0
      if self._compile is not None:
        if self._compile[2]:
          self._compile[0] = now  # still inside compiling(): the rest of it is the next gap's
        else:
          self._compile = None  # a trace JAX reported with no compile after it (a cache hit): over by now

  def limit(self) -> float:
    """The limit of a step in this phase (the first step, or any later one)."""
    if self.timeout_s:
      return self.timeout_s
    gaps = list(self._gaps)  # a copy: the loop's thread appends
    return max(self.min_s, self.multiple * statistics.median(gaps)) if gaps else self.min_s * 10

  @contextlib.contextmanager
  def compiling(self, what: str):
    """Leaves the time inside out of the step's (the loop's thread compiles ``what``), up to ``compile_s``."""
    self._began(self._clock(), what, said=True)
    try:
      yield
    finally:
      self._ended(said=True)

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    """jax.monitoring's duration events: a compile on the loop's thread began before a trace or a lowering ended,
    and is over when its backend compile ends."""
    del kwargs
    if threading.get_ident() != self._loop:
      return  # another thread's compile does not hold up the loop
    if event in (_compat.TRACE_EVENT, _compat.LOWER_EVENT):
      self._began(self._clock() - duration, "a jit compile", said=False)
    elif event == _compat.BACKEND_COMPILE_EVENT:
      self._ended(said=False)

  def _began(self, since: float, what: str, said: bool) -> None:
    with self._lock:
      if self._compile is None:
        self._compile = [max(since, self._last), what, said]
      elif said:
        self._compile[1:] = [what, True]

  def _ended(self, said: bool) -> None:
    with self._lock:
      if self._compile is not None and (said or not self._compile[2]):
        self._excluded += self._compiling_for(self._clock())
        self._compile = None

  def _compiling_for(self, now: float) -> float:
    return now - self._compile[0] if self._compile is not None else 0.0

  def overdue(self) -> float | None:
    """Seconds since the last heartbeat (or the start), compiles left out, when that is past the limit; or the
    seconds of a compile in progress past ``compile_s``; else None."""
    with self._lock:
      now = self._clock()
      if self._compile is not None:
        spent = self._compiling_for(now)
        return spent if self.compile_s and spent > self.compile_s else None
      waited = now - self._last - self._excluded
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
    compile_ = self._compile
    if compile_ is not None:
      what = f"{compile_[1]} has run for {waited:.1f}s (limit {self.compile_s:.1f}s, monitor.watchdog_compile_s)"
    else:
      what = f"no step finished for {waited:.1f}s (limit {self.limit():.1f}s)"
    message = (f"jaxtrain: watchdog: {what}: {where}; stacks of all threads follow, then exit {self.EXIT_CODE} "
               "(restartable)\n")
    restarts.record(exits.HANG, f"{what}: {where}")
    targets = [sys.stderr]
    on_store = bool(self.log_path) and paths.is_url(self.log_path)
    if self.log_path:
      try:  # faulthandler writes to a file descriptor: a store's train.log gets the report through a temporary file
        targets.append(tempfile.TemporaryFile("w+") if on_store else open(self.log_path, "a"))  # noqa: SIM115
      except OSError:
        pass  # the console still has it
    for f in targets:
      f.write(message)
      f.flush()
      faulthandler.dump_traceback(file=f, all_threads=True)
      f.flush()
    if on_store and len(targets) > 1:
      targets[1].seek(0)
      logs.open_stream(self.log_path, "train.log").write(targets[1].read())
    # The logs on an object store (train.log with this report, metrics, goodput events) written first, boundedly.
    logs.flush_all(logs.EXIT_S)
    os._exit(self.EXIT_CODE)

  def stop(self) -> None:
    self._stop.set()
    if self._listening:
      jax.monitoring.unregister_event_duration_listener(self._on_event)
      self._listening = False
    if self._thread.is_alive():
      self._thread.join(timeout=5)
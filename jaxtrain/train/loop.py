"""The training loop: next batch -> step N dispatched -> step N-1's metrics fetched (one step late) -> NaN policy
-> log -> checkpoint, until ``train.steps`` or a preemption; everything else it does (eval, samples, the profiler,
stragglers, goodput events, a user's hooks) is a :class:`jaxtrain.train.hooks.Hook` told of those moments.

:class:`Loop` runs it. What it counts across checkpoints is one :class:`LoopState`, saved in every checkpoint's
``meta`` next to :class:`RunMeta` and restored with the train state as one unit, on resume and on rollback. The
parts that decide need no model and are tested alone: the NaN policies (``jaxtrain.monitor.NAN_POLICIES``) and
:class:`NonFiniteSteps`, :class:`RollbackLimits`, :func:`may_save`, and
:class:`MetricsBuffer`, which owns the one-step-late fetch.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import time
from typing import Any, Iterator

import jax
import numpy as np
from absl import logging
from etils import epath

import jaxtrain
from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import data as data_lib
from jaxtrain import exits
from jaxtrain import goodput as goodput_lib
from jaxtrain import integrity
from jaxtrain import metrics as metrics_lib
from jaxtrain import monitor
from jaxtrain import workdir as workdir_lib
from jaxtrain.errors import UserError
from jaxtrain.train import hooks as hooks_lib
from jaxtrain.train import objectives
from jaxtrain.train import step as step_lib
from jaxtrain.train.preemption import PreemptionGuard
from jaxtrain.train.run import Run


class TrainingStopped(Exception):
  """Training stopped on purpose (``monitor.nan_policy=stop``, or a problem that rollbacks do not cure); main
  prints it as one line, exit code 1."""


def stop_cause(e: BaseException) -> str:
  """Why a run stopped early, in goodput's words: a restartable exit's cause (:data:`jaxtrain.exits.CAUSES`), or
  ``user error`` (exit 2), ``stopped`` (the NaN policy, exit 1), ``interrupted`` (Ctrl-C), ``bug``."""
  if isinstance(e, exits.Restart):
    return e.cause
  if isinstance(e, UserError):
    return "user error"
  if isinstance(e, TrainingStopped):
    return "stopped"
  return "interrupted" if isinstance(e, (KeyboardInterrupt, SystemExit)) else "bug"


# What is saved with each checkpoint ----------------------------------------------------------------------------


@dataclasses.dataclass
class LoopState:
  """What the loop has counted up to ``step``: saved in every checkpoint's ``meta`` (flat, under the keys that
  checkpoints have always had, so older ones resume) and restored from it as one unit."""
  step: int = 0
  tokens_seen: int = 0  # target tokens of the steps that led to this state (a rolled-back step is not one)
  skipped_steps: int = 0  # steps whose update was not applied, in all (a replay of a bad batch counts again)
  bad_steps: set[int] = dataclasses.field(default_factory=set)  # non-finite steps: skipped when replayed
  wall_time: float = 0.0  # seconds of training in all, rolled-back steps and earlier runs included

  @classmethod
  def from_meta(cls, meta: dict, step: int) -> LoopState:
    """From a checkpoint's ``meta`` (``{}`` for a fresh run); ``step``: the restored train state's."""
    return cls(step=step, tokens_seen=int(meta.get("tokens_seen", 0)), skipped_steps=int(meta.get("skipped_steps", 0)),
               bad_steps={int(s) for s in meta.get("bad_steps", ())}, wall_time=float(meta.get("wall_time", 0.0)))

  def to_meta(self) -> dict:
    return {"step": self.step, "tokens_seen": self.tokens_seen, "skipped_steps": self.skipped_steps,
            "bad_steps": sorted(self.bad_steps), "wall_time": self.wall_time}

  def rewound_to(self, saved: LoopState) -> LoopState:
    """The counts after a rollback to the checkpoint that saved ``saved``: its step and tokens (a replayed step
    counts once); the bad steps stay known (the replay skips their batches), skipped steps and wall time keep
    counting what the run did."""
    return dataclasses.replace(self, step=saved.step, tokens_seen=saved.tokens_seen,
                               bad_steps=self.bad_steps | saved.bad_steps)


@dataclasses.dataclass(frozen=True)
class RunMeta:
  """Who wrote a checkpoint, when, and the loss it had reached: saved in its ``meta`` next to the LoopState."""
  jaxtrain_version: str
  mesh: dict[str, int]
  seed: int
  loss: float | None  # the saved step's (None: no step fetched yet in this run)
  saved_at: float  # Unix time
  processes: int = 1  # the job's layout when it saved (checkpoints from before these keys: the defaults)
  microbatches: int = 1

  @classmethod
  def now(cls, run: Run, loss: float | None) -> RunMeta:
    return cls(jaxtrain_version=jaxtrain.__version__, mesh=dict(run.mesh.shape), seed=run.config.train.seed,
               loss=loss, saved_at=time.time(), processes=jax.process_count(), microbatches=run.microbatches)

  def layout_changes(self, meta: dict) -> list[str]:
    """What differs between the layout that saved a checkpoint (its ``meta``) and this one, e.g. ``['processes 2
    -> 1', 'microbatches 1 -> 2']``; keys a checkpoint lacks are not compared."""
    return [f"{key} {meta[key]} -> {getattr(self, key)}" for key in ("processes", "mesh", "microbatches")
            if key in meta and meta[key] != getattr(self, key)]


def checkpoint_meta(run_meta: RunMeta, counts: LoopState) -> dict:
  """A checkpoint's JSON ``meta`` item: both, with flat keys (what tools/inspect_checkpoint.py lists)."""
  return {**dataclasses.asdict(run_meta), **counts.to_meta()}


# Decisions (no model needed) ------------------------------------------------------------------------------------


def may_save(forced: bool, streak: int, skipped: bool) -> bool:
  """Whether a due checkpoint is written. Not while new non-finite steps are in a row (``streak``: the
  checkpoints must not move past a problem); after a step that did not apply its update (a known bad batch
  replayed: the state has not moved), only a forced one: a periodic save waits for a step that does (else
  replays would carry the checkpoints past a problem that persists)."""
  return not streak and (forced or not skipped)


class NonFiniteSteps:
  """Judges each fetched step: counts new non-finite steps in a row (``streak``; a known bad step replayed after a
  rollback neither counts nor resets it) and asks the ``monitor.nan_policy`` what to do about a new one."""

  def __init__(self, policy: str, max_consecutive: int, last_step: int):
    self.name, self.policy = policy, monitor.NAN_POLICIES.get(policy)
    self.max_consecutive, self.last_step = max_consecutive, last_step
    self.streak = 0

  def observe(self, step: int, nonfinite: bool, known: set[int]) -> monitor.Action | None:
    """None for a finite or a known bad step; for a new non-finite one (then added to ``known``) the policy's
    action."""
    if not nonfinite:
      self.streak = 0
      return None
    if step in known:
      return None
    known.add(step)
    self.streak += 1
    return self.policy(monitor.NonFiniteStep(step, self.streak, step == self.last_step, self.max_consecutive))


class RollbackLimits:
  """How often the run may go back to one checkpoint: an escalation (skip) once, since a second one to the same
  checkpoint means the problem persists; a policy rollback ``max_rollbacks`` times."""

  def __init__(self, max_rollbacks: int, bad_batches: os.PathLike | str):
    self.max_rollbacks, self.bad_batches = max_rollbacks, bad_batches
    self.counts = collections.Counter()  # checkpoint step -> rollbacks to it

  def check(self, action: monitor.Action, bad_step: int, why: str, steps: list[int]) -> None:
    """Counts a rollback to the newest of ``steps`` (the committed checkpoints). Raises TrainingStopped past the
    limit, or for an escalation with nothing to go back to; a policy rollback with nothing goes on."""
    if not steps:
      if action == "escalate":
        raise TrainingStopped(f"step {bad_step}: {why} and no checkpoint to roll back to; nothing was saved: "
                              "lower optim.lr or fix the data, or save earlier with checkpoint.every_steps")
      return
    target = steps[-1]
    self.counts[target] += 1
    if self.counts[target] > (1 if action == "escalate" else self.max_rollbacks):
      raise TrainingStopped(f"step {bad_step}: {why} again after {self.counts[target] - 1} rollback(s) to "
                            f"checkpoint step {target}; the checkpoints are intact (steps: {steps}): look at "
                            f"{self.bad_batches}, lower optim.lr or fix the data")


class MetricsBuffer:
  """The one-step-late fetch: holds the metrics of the step dispatched last (still being computed) until the next
  step is dispatched, so that the host reads step N's scalars while the device runs step N+1."""

  def __init__(self):
    self._held: tuple[int, Any] | None = None

  def push(self, step: int, metrics) -> tuple[int, dict[str, float]] | None:
    """Holds ``step``'s metrics (call it right after dispatching the step) and returns the step held before,
    fetched; None if none was."""
    held, self._held = self._held, (step, metrics)
    return _fetch(held)

  def flush(self) -> tuple[int, dict[str, float]] | None:
    """The held step, fetched now (before its checkpoint is saved); None if none is held."""
    held, self._held = self._held, None
    return _fetch(held)

  def clear(self) -> None:
    """Drops the held step (a rollback discards the steps after its checkpoint)."""
    self._held = None


def _fetch(held: tuple[int, Any] | None) -> tuple[int, dict[str, float]] | None:
  if held is None:
    return None
  step, metrics = held
  values = step_lib.host_metrics({k: float(v) for k, v in jax.device_get(metrics).items()})
  if not math.isfinite(values.get("tokens", 0.0)):  # a NaN loss mask: count no tokens for this step
    values["tokens"] = 0.0
  return step, values


# The loop -------------------------------------------------------------------------------------------------------


class Loop:
  """One training run: ``Loop(...).run()`` trains from ``state`` (restored with its checkpoint's ``meta``, or
  fresh with ``{}``) to ``train.steps`` or a preemption and returns the final state and the logged records.
  ``hooks``: told of the run's moments in this order (:func:`jaxtrain.train.hooks.standard` builds the built-in
  ones); ``goodput``: the recorder whose ``end`` the loop records (its other events are the Goodput hook's)."""

  def __init__(self, run: Run, data: Iterator[dict], checkpointer: checkpoint_lib.Checkpointer, step_fn,
               summarize, state, meta: dict, hooks: list[hooks_lib.Hook] = (),
               goodput: goodput_lib.Recorder | None = None):
    c = self.config = run.config
    self.plan, self.data, self.checkpointer = run, data, checkpointer  # plan: the trainer's Run
    self.step_fn, self.summarize, self.hooks = step_fn, summarize, list(hooks)
    self.objective = objectives.of(c)  # (its batch layout: to_global)
    self.state, self.counts = state, LoopState.from_meta(meta, int(state.step))
    self.last_step = c.train.steps
    self.nonfinite = NonFiniteSteps(c.monitor.nan_policy, c.monitor.max_consecutive_nonfinite, c.train.steps)
    self.limits = RollbackLimits(c.monitor.max_consecutive_nonfinite, epath.Path(c.workdir) / "bad_batches.jsonl")
    self.buffer, self.interval, self.history = MetricsBuffer(), _Interval(), []
    self.last, self.last_eval = {}, {}  # the newest fetched step's metrics; the newest eval's (hooks.Eval's)
    self.summary = None  # (step, fingerprints and finiteness of its state, being computed) for its save
    self.recent_doc_ids = collections.deque(maxlen=4)  # (step, document ids of this process's rows): provenance
    self.flops = metrics_lib.flops_per_token(run.model, c.data.seq_len)
    self.peak = metrics_lib.peak_flops_per_device(c.metrics.peak_tflops)
    self.config_dict = json.loads(c.to_json_best_effort())  # saved with every checkpoint
    self.goodput = goodput or goodput_lib.Recorder(c.workdir)  # the trainer's has recorded the run's start
    self.spent = dict.fromkeys(("checkpoint", "eval", "data_wait"), 0.0)  # the loop's seconds, for goodput

  def run(self):
    """Trains; returns ``(state, history)``. Raises TrainingStopped when the NaN policy or its limits stop it."""
    c, m = self.config, self.config.monitor
    logging.info("%.3g model FLOPs per token (the model family's count); %s", self.flops,
                 f"peak {self.peak / 1e12:.0f} TFLOP/s per device" if self.peak else
                 "device peak unknown: MFU not reported (set metrics.peak_tflops)")
    self.writer = metrics_lib.MetricWriter(c.workdir, c.train.steps, self.counts.step, c.metrics, self.config_dict,
                                           console=self.objective.console_metrics)
    self.anomalies = monitor.AnomalyDetector(m.spike_sigma, m.spike_window, m.stagnation_logs)
    self.watchdog = monitor.Watchdog(m.watchdog_multiple, m.watchdog_min_s, m.watchdog_timeout_s,
                                     log_path=workdir_lib.log_path(c.workdir), describe=self._whereabouts,
                                     compile_s=m.watchdog_compile_s).start()
    self._clock = (time.perf_counter(), self.counts.wall_time)
    preempted = False
    try:
      try:  # the hooks (the profiler's trace), watchdog and writers must not outlive the loop, whatever ends it
        self._tell("start")
        with PreemptionGuard() as preemption:
          while self.counts.step < self.last_step:
            if not self._step(preemption):
              preempted = True  # its step saved (unless in a run of non-finite steps)
              break
      finally:
        self._tell("close")
        self.watchdog.stop()
        self.writer.close()
      self.checkpointer.wait()
    except BaseException as e:
      # The run's end and why, for goodput's account of the interruptions (the account itself is the next run's to
      # write: the storage may be what failed).
      self.goodput.end(self.counts.step, cause=stop_cause(e), summarize=False)
      raise
    self.account = self.goodput.end(self.counts.step, cause=exits.PREEMPTED if preempted else None)
    if preempted:
      steps = self.checkpointer.steps()
      raise exits.Restart(f"preempted after step {self.counts.step} of {self.last_step}; newest checkpoint: "
                          f"step {steps[-1] if steps else 'none'}")
    if self.counts.step == self.last_step:
      self._final_report()
    return self.state, self.history

  def _whereabouts(self) -> str:
    """Where the loop is, for the watchdog's report (read from its thread: no waiting, no I/O)."""
    settled = self.history[-1]["step"] if self.history else "none"
    loss = f", loss {self.last['loss']:.4f}" if self.last else ""
    return (f"step {self.counts.step} dispatched; newest step logged: {settled}{loss}; "
            f"{self.interval.data_wait:.1f}s waiting for data since the last log")

  def _step(self, preemption) -> bool:
    """Step N: dispatched, then step N-1 settled while it runs (or N itself before N's checkpoint). False when
    preempted (N saved)."""
    workdir_lib.fence()  # a run that lost its workdir writes nothing more (LeaseLost, exit 75)
    step, metrics = self._dispatch()
    if self._settle(self.buffer.push(step, metrics)):
      return True  # rolled back: step N was dropped with the steps after the checkpoint
    preempted = preemption.requested(step)
    due = self.checkpointer.due(step, self.last_step, preempted)  # (tier, forced) or None
    if due:
      # Wait for the step's fingerprints before its metrics are logged, so that the save follows the log.
      fingerprints = integrity.read(self.summary[1]) if self.summary and self.summary[0] == step else None
      if self._settle(self.buffer.flush()):
        return True  # rolled back: no checkpoint follows a bad step
      if self._save(step, *due, fingerprints):
        return True  # its state was not finite: rolled back
    if preempted:
      self.checkpointer.wait()
      if self.nonfinite.streak:
        logging.warning("preempted at step %d, not saved (in a run of non-finite steps), exiting", step)
      else:
        logging.info("preempted: saved step %d, exiting", step)
    return not preempted

  def _dispatch(self) -> tuple[int, Any]:
    """Next batch -> the step, its hooks and (before a save) its fingerprints, all dispatched, none waited for."""
    t = time.perf_counter()
    local = next(self.data)
    batch = self.objective.to_global(self.plan, local)  # token ids checked first
    waited = time.perf_counter() - t
    self.interval.data_wait += waited
    self.spent["data_wait"] += waited
    step = self.counts.step + 1
    self.recent_doc_ids.append((step, local.get("doc_ids")))
    self.state, metrics = self.step_fn(self.state, batch, np.bool_(step in self.counts.bad_steps))
    self.counts.step = step
    self._tell("dispatched", step)  # before the next step donates this state
    if self.checkpointer.wants_fingerprints(step, self.last_step):
      self.summary = (step, self.summarize(self.state))  # the device runs it right after the step
    return step, metrics

  def _tell(self, moment: str, *args) -> None:
    """Each hook's ``moment`` (a :class:`jaxtrain.train.hooks.Hook` method): ``dispatched`` and ``logged`` at the
    steps its cadence says (:func:`jaxtrain.train.hooks.due`), the others always."""
    cadenced = moment in ("dispatched", "logged")
    for hook in self.hooks:
      if not cadenced or hooks_lib.due(args[0], hook.every, self.last_step):
        getattr(hook, moment)(self, *args)

  def _settle(self, fetched: tuple[int, dict[str, float]] | None) -> bool:
    """A fetched step: counted, judged (NaN policy), logged (then its hooks). True if the run went back to a
    checkpoint."""
    if fetched is None:
      return False
    step, values = fetched
    self.last = values
    self.watchdog.beat()
    self.counts.tokens_seen += int(values["tokens"])
    self.counts.skipped_steps += int(values["skipped"])
    self.interval.steps.append(values)
    action = self.nonfinite.observe(step, bool(values["nonfinite"]), self.counts.bad_steps)
    if action is not None:
      logging.warning("step %d: non-finite loss, gradients or updated state; update not applied (policy %s)",
                      step, self.nonfinite.name)
      report_bad_batch(self.plan, step, self.recent_doc_ids, "non-finite loss, gradients or updated state")
      if action == "stop":
        raise TrainingStopped(f"step {step}: non-finite loss, gradients or updated state and monitor.nan_policy="
                              f"{self.nonfinite.name}; the last checkpoint is intact (steps: "
                              f"{self.checkpointer.steps() or 'none'})")
    self._log(step)
    return action in ("rollback", "escalate") and self._recover(action, step)

  def _log(self, step: int) -> None:
    record = None
    if step % self.config.train.log_every == 0 or step == self.last_step:
      workdir_lib.fence()  # the lease may have run out while the step ran
      record = self.interval.record(self.plan, self.flops, self.peak, self.counts.skipped_steps)
      for hook in self.hooks:
        record.update(hook.metrics(self, step, record))
      record.update(self.checkpointer.metrics())  # failed saves of the tiers that let the run go on (agreed)
      found = self.anomalies(step, record)
      record["anomalies"] = len(found)
      if found:
        report_bad_batch(self.plan, step, self.recent_doc_ids, ", ".join(found))
      self.writer.write(step, record)
      self.history.append({"step": step, **record})
      self.interval = _Interval()
    self._tell("logged", step, record)

  def spent_now(self) -> dict[str, float]:
    """The loop's seconds so far in this run: productive (the rest of them) and each of ``self.spent``."""
    loop = time.perf_counter() - self._clock[0]
    return {"productive": loop - sum(self.spent.values()), **self.spent}

  def _save(self, step: int, tier: checkpoint_lib.Tier, forced: bool, fingerprints) -> bool:
    """Saves ``step`` to ``tier`` if it may (:func:`may_save`). True if its state was non-finite and the run rolled
    back."""
    if not may_save(forced, self.nonfinite.streak, bool(self.last["skipped"])):
      logging.warning("step %d: not saving a checkpoint after a step whose update was not applied", step)
      return False
    meta = checkpoint_meta(RunMeta.now(self.plan, self.last.get("loss")), self._counts_now())
    try:
      blocked = self.checkpointer.save(tier, step, self.state, self.data, meta, self.config_dict, forced,
                                       fingerprints)
    except checkpoint_lib.NonFiniteState as e:
      logging.warning("step %d: not saved: %s", step, e)
      return self._recover("escalate", step, why=f"a state with {e}")
    self.interval.checkpoint_blocked += blocked
    self.spent["checkpoint"] += blocked
    self._tell("saved", step)
    return False

  def _recover(self, action: monitor.Action, bad_step: int, why: str = "") -> bool:
    """Back to the newest checkpoint that restores (params, optimizer state, data position and LoopState), within
    :class:`RollbackLimits` (:meth:`jaxtrain.checkpoint.Checkpointer.rollback`: the persistent tier's newest; the
    other tiers' steps past it are deleted first, on every process); the loop then replays the batches since,
    skipping the bad ones. False if there is none (a policy rollback then goes on, the update skipped)."""
    why = why or (f"{self.nonfinite.streak} non-finite step(s) in a row" if action == "escalate" else
                  "a non-finite step")
    steps = self.checkpointer.steps()
    self.limits.check(action, bad_step, why, steps)
    if not steps:
      logging.warning("rollback at step %d: no checkpoint yet; the update was skipped instead", bad_step)
      return False
    plan = self.plan
    # The live state leaves the devices while the checkpoint is restored onto them (Checkpointer.rollback: they hold
    # one state, not two); it comes back if no checkpoint restores.
    live, self.state = self.state, None
    self.state, meta = self.checkpointer.rollback(plan.abstract_state(),
                                                  self.data, live=live)
    del live
    if meta is None:
      logging.warning("rollback at step %d: no checkpoint restores; the update was skipped instead", bad_step)
      return False
    reached, self.counts = self.counts.step, self.counts.rewound_to(LoopState.from_meta(meta, int(self.state.step)))
    logging.warning("rollback at step %d (%s): back to checkpoint step %d; the batches of the non-finite steps "
                    "will be skipped", bad_step, why, self.counts.step)
    self.nonfinite.streak, self.summary = 0, None
    self.buffer.clear()
    self._tell("rolled_back", reached)
    return True

  def _counts_now(self) -> LoopState:
    started, wall_time = self._clock
    self.counts.wall_time = wall_time + time.perf_counter() - started
    return self.counts

  def _final_report(self) -> None:
    """The run's last line: where it ended and where everything is."""
    c, step, counts = self.config, self.counts.step, self._counts_now()
    workdir = epath.Path(c.workdir)
    loss = f"loss {self.last['loss']:.4f}" if self.last else "no step run"
    if "eval_loss" in self.last_eval:
      loss += f", eval loss {self.last_eval['eval_loss']:.4f}"
    figures = {**self.last, **self.last_eval}
    loss += "".join(f", {k} {figures[k]:.4f}" for k in self.objective.console_metrics if k in figures)
    minutes, seconds = divmod(round(counts.wall_time), 60)
    saved = epath.Path(self.checkpointer.persistent.where) / str(step) if step in self.checkpointer.steps() else \
        "not saved"
    where = f"checkpoint {saved}, metrics {workdir / 'metrics.jsonl'}"
    if c.metrics.tensorboard:
      where += f", TensorBoard {workdir / 'tensorboard'}"
    if self.account:
      where += f"; {goodput_lib.describe(self.account)} ({workdir / goodput_lib.SUMMARY})"
    logging.info("done: step %d/%d, %s, %s tokens, %dm%02ds of training in all; %s; plot: python "
                 "tools/plot_metrics.py %s --out=%s", step, c.train.steps, loss, f"{counts.tokens_seen:,}", minutes,
                 seconds, where, workdir, workdir / "metrics.png")


class _Interval:
  """What the steps since the last log add up to: fetched metrics, data wait, checkpoint blocking."""

  def __init__(self):
    self.steps, self.t_start = [], time.perf_counter()
    self.data_wait = self.checkpoint_blocked = 0.0

  def record(self, run: Run, flops_per_token: float, peak: float | None, skipped_total: int) -> dict:
    elapsed = time.perf_counter() - self.t_start
    n = len(self.steps)
    c = run.config
    tflops = flops_per_token * c.train.global_batch_size * c.data.seq_len * n / elapsed / run.mesh.size / 1e12
    record = {**self.steps[-1], "tokens_per_sec": sum(m["tokens"] for m in self.steps) / elapsed,
              "step_time": elapsed / n, "data_wait_s": self.data_wait / n,
              "checkpoint_blocked_s": self.checkpoint_blocked, "tflops_per_device": tflops,
              "skipped_steps": skipped_total, "device_memory_bytes": metrics_lib.device_memory_bytes()}
    if peak:
      record["mfu"] = tflops * 1e12 / peak
    return record


def report_bad_batch(run: Run, step: int, recent_doc_ids, why: str) -> None:
  """Logs which documents formed this process's rows of ``step`` and appends them, with their shard files
  and indices, to ``<workdir>/bad_batches.jsonl`` (one file per process)."""
  doc_ids = dict(recent_doc_ids).get(step)
  entry = {"step": step, "why": why, "process": jax.process_index()}
  c = run.config
  entry.update(data_lib.provenance(c, step, doc_ids))
  logging.warning("step %d (%s): batch %s", step, why, json.dumps({k: v for k, v in entry.items()
                                                                   if k != "shards"})[:500])
  name = "bad_batches.jsonl" if jax.process_count() == 1 else f"bad_batches.p{jax.process_index()}.jsonl"
  workdir_lib.append(epath.Path(c.workdir) / name, json.dumps(entry) + "\n")

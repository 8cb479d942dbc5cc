"""The training loop: next batch -> step -> fetch the previous step's metrics (one step late) -> NaN policy ->
log -> eval -> checkpoint, until ``train.steps`` or a preemption."""

from __future__ import annotations

import collections
import json
import math
import os
import time
from typing import TYPE_CHECKING, Iterator

import jax
import numpy as np
from absl import logging
from etils import epath

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import data as data_lib
from jaxtrain import integrity
from jaxtrain import metrics as metrics_lib
from jaxtrain import monitor
import jaxtrain
from jaxtrain.train import state as state_lib
from jaxtrain.train.preemption import PreemptionGuard

if TYPE_CHECKING:
  from jaxtrain.train.trainer import Run


class TrainingStopped(Exception):
  """Training stopped on purpose (``monitor.nan_policy=stop``); main prints it as one line, exit code 1."""


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


def train_loop(run: Run, data: Iterator[dict], checkpointer: checkpoint_lib.Checkpointer, step_fn, summarize,
               evaluate, state, meta: dict):
  config = run.config

  flops = metrics_lib.flops_per_token(run.model, config.data.seq_len)
  peak = metrics_lib.peak_flops_per_device(config.metrics.peak_tflops)
  logging.info("%.3g model FLOPs per token (6N + attention); %s", flops,
               f"peak {peak / 1e12:.0f} TFLOP/s per device" if peak else
               "device peak unknown: MFU not reported (set metrics.peak_tflops)")
  config_dict = json.loads(config.to_json_best_effort())  # saved with every checkpoint
  writer = metrics_lib.MetricWriter(config.workdir, config.train.steps, int(state.step), config.metrics,
                                    config_dict)
  m = config.monitor
  anomalies = monitor.AnomalyDetector(m.spike_sigma, m.spike_window, m.stagnation_logs)
  watchdog = monitor.Watchdog(m.watchdog_multiple, m.watchdog_min_s, m.watchdog_timeout_s).start()
  profile = _Profiler(config)
  tokens_seen, wall_time = meta.get("tokens_seen", 0), meta.get("wall_time", 0.0)
  bad_steps, skipped_total = set(meta.get("bad_steps", [])), meta.get("skipped_steps", 0)
  history, interval, last, last_eval = [], _Interval(), {}, {}
  recent_records = collections.deque(maxlen=4)  # (step, record ids of this process's rows): provenance
  t_start = time.perf_counter()

  streak = 0  # consecutive new non-finite steps (known bad batches being replayed neither count nor reset)
  rollbacks = collections.Counter()  # checkpoint step -> rollbacks to it
  summary = None  # (step, fingerprints and finiteness of its state, being computed) for the next save
  evaluating = {}  # step -> fetch of its eval metrics: dispatched with that step's params, logged after its record

  def save(step: int, force: bool, fingerprints) -> None:
    checkpointer.save(step, state, data, config=config_dict, force=force, meta={
        "jaxtrain_version": jaxtrain.__version__, "step": step, "mesh": dict(run.mesh.shape),
        "loss": float(last["loss"]) if last else None, "tokens_seen": tokens_seen, "seed": config.train.seed,
        "wall_time": wall_time + time.perf_counter() - t_start, "saved_at": time.time(),
        "bad_steps": sorted(bad_steps), "skipped_steps": skipped_total},
        summary=fingerprints)
    interval.checkpoint_blocked += checkpointer.last_save_blocked_s

  def finish(step: int, metrics) -> str | None:
    """Step ``step`` is done: fetch its metrics (one step late), apply the NaN policy, log. Returns
    'rollback' (policy rollback) or 'escalate' (too many non-finite steps in a row under skip, or a run that
    would end on one) when the run must go back to its last checkpoint."""
    nonlocal last, tokens_seen, skipped_total, interval, streak
    last = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not math.isfinite(last["tokens"]):  # a NaN loss mask: count no tokens for this step
      last["tokens"] = 0.0
    watchdog.beat()
    tokens_seen += int(last["tokens"])
    skipped_total += int(last["skipped"])
    interval.steps.append(last)
    action = None
    if not last["nonfinite"]:
      streak = 0
    elif step not in bad_steps:  # a known bad step is skipped on replay: no new rollback
      bad_steps.add(step)
      streak += 1
      logging.warning("step %d: non-finite loss, gradients or updated state; update not applied (policy %s)",
                      step, m.nan_policy)
      report_bad_batch(run, step, recent_records, "non-finite loss, gradients or updated state")
      if m.nan_policy == "stop":
        raise TrainingStopped(f"step {step}: non-finite loss, gradients or updated state and monitor.nan_policy="
                              f"stop; the last checkpoint is intact (steps: {checkpointer.steps() or 'none'})")
      if m.nan_policy == "rollback":
        action = "rollback"
      elif streak >= m.max_consecutive_nonfinite or step == config.train.steps:
        action = "escalate"
    if step % config.train.log_every == 0 or step == config.train.steps:
      record = interval.record(run, flops, peak, skipped_total)
      found = anomalies(step, record)
      record["anomalies"] = len(found)
      if found:
        report_bad_batch(run, step, recent_records, ", ".join(found))
      writer.write(step, record)
      history.append({"step": step, **record})
      interval = _Interval()
    if step in evaluating:
      last_eval.update(evaluating.pop(step)())
      writer.write(step, last_eval)
      watchdog.beat()
    return action

  def recover(action: str, bad_step: int, why: str = ""):
    """Back to the newest checkpoint (see _rollback), within limits: under skip, a second escalation to the
    same checkpoint stops the run (exit 1), as do more than max_consecutive_nonfinite policy rollbacks to it."""
    nonlocal streak
    steps = checkpointer.steps()
    why = why or (f"{streak} non-finite step(s) in a row" if action == "escalate" else "a non-finite step")
    if steps:
      rollbacks[steps[-1]] += 1
      limit = 1 if action == "escalate" else m.max_consecutive_nonfinite
      if rollbacks[steps[-1]] > limit:
        raise TrainingStopped(f"step {bad_step}: {why} again after {rollbacks[steps[-1]] - 1} rollback(s) to "
                              f"checkpoint step {steps[-1]}; the checkpoints are intact (steps: {steps}): look at "
                              f"{epath.Path(config.workdir) / 'bad_batches.jsonl'}, lower optim.lr or fix the data")
    elif action == "escalate":
      raise TrainingStopped(f"step {bad_step}: {why} and no checkpoint to roll back to; nothing was saved: lower "
                            "optim.lr or fix the data, or save earlier with checkpoint.every_steps")
    streak = 0
    return _rollback(run, checkpointer, data, state, bad_step, why)

  def will_save(step: int) -> bool:  # may this step's state be saved (preemption saves compute theirs later)?
    return checkpointer.verify and (step == config.train.steps or checkpointer.should_save(step))

  try:  # the profiler trace, watchdog and writers must not outlive the loop, whatever ends it
    with PreemptionGuard() as preemption:
      pending = None  # (step, metrics) dispatched but not yet fetched
      step = int(state.step)
      while step < config.train.steps:
        t = time.perf_counter()
        local = next(data)
        batch = data_lib.to_global(local, run.batch_sharding)
        interval.data_wait += time.perf_counter() - t
        recent_records.append((step + 1, local.get("records")))
        profile(step, state)
        state, metrics = step_fn(state, batch, np.bool_(step + 1 in bad_steps))
        step += 1
        if evaluate is not None and (step % config.eval.every_steps == 0 or step == config.train.steps):
          evaluating[step] = evaluate(state.params)  # before the next step donates these params
        if will_save(step):  # dispatched now (not waited for): the device runs it right after the step
          summary = (step, summarize(state))
        if pending is not None and (action := finish(*pending)):
          state, step, pending = recover(action, step - 1)
          continue
        pending = (step, metrics)
        stop = preemption.requested(step)
        if stop or step == config.train.steps or checkpointer.should_save(step):
          # Wait for the step's fingerprints before its metrics are logged, so that the save follows the log.
          fingerprints = integrity.read(summary[1]) if summary and summary[0] == step else None
          if action := finish(*pending):  # a checkpoint must not follow a bad step under rollback
            state, step, pending = recover(action, step)
            continue
          pending = None
          forced = stop or step == config.train.steps
          # A step that did not apply its update leaves a finite state (the step's guard) that has not moved:
          # a periodic save then waits for a step that does (else replays of known bad batches would carry the
          # checkpoints past a problem that persists); a forced one only for new non-finite steps.
          if streak or (last["skipped"] and not forced):
            logging.warning("step %d: not saving a checkpoint after a step whose update was not applied", step)
          else:
            try:
              save(step, forced, fingerprints)
            except checkpoint_lib.NonFiniteState as e:
              logging.warning("step %d: not saved: %s", step, e)
              state, step, pending = recover("escalate", step, why=f"a state with {e}")
              continue
        if stop:
          checkpointer.wait()
          if streak:
            logging.warning("preempted at step %d, not saved (in a run of non-finite steps), exiting", step)
          else:
            logging.info("preempted: saved step %d, exiting", step)
          break
      if pending is not None:
        finish(*pending)
  finally:
    profile.stop()
    watchdog.stop()
    writer.close()
  checkpointer.wait()
  if step == config.train.steps:
    _final_report(config, checkpointer, step, last, last_eval, tokens_seen, wall_time + time.perf_counter() - t_start)
  return state, history


def _final_report(config, checkpointer, step: int, last: dict, last_eval: dict, tokens: int, wall_s: float) -> None:
  """The run's last line: where it ended and where everything is."""
  workdir = epath.Path(config.workdir)
  loss = f"loss {last['loss']:.4f}" if last else "no step run"
  if last_eval:
    loss += f", eval loss {last_eval['eval_loss']:.4f}"
  minutes, seconds = divmod(round(wall_s), 60)
  saved = checkpointer.directory / str(step) if step in checkpointer.steps() else "not saved"
  where = f"checkpoint {saved}, metrics {workdir / 'metrics.jsonl'}"
  if config.metrics.tensorboard:
    where += f", TensorBoard {workdir / 'tensorboard'}"
  logging.info("done: step %d/%d, %s, %s tokens, %dm%02ds of training in all; %s; plot: python "
               "tools/plot_metrics.py %s --out=%s", step, config.train.steps, loss, f"{tokens:,}", minutes,
               seconds, where, workdir, workdir / "metrics.png")


def report_bad_batch(run: Run, step: int, recent_records, why: str) -> None:
  """Logs which documents formed this process's rows of ``step`` and appends them, with their shard files
  and indices, to ``<workdir>/bad_batches.jsonl`` (one file per process)."""
  records = dict(recent_records).get(step)
  entry = {"step": step, "why": why, "process": jax.process_index()}
  c = run.config
  if records is None:
    entry["source"] = f"synthetic (seed {c.train.seed}, batch {step - 1})" if c.data.source == "synthetic" else \
        "unknown"
  else:
    from jaxtrain.data import pipeline
    ids = sorted({int(r) for r in np.unique(records) if r >= 0})
    root = data_lib.data_root(c)
    manifest = pipeline.load_manifest(root, verify_checksums=False)
    entry.update(data=root, records=ids, shards=[pipeline.locate(manifest, "train", r) for r in ids])
  logging.warning("step %d (%s): batch %s", step, why, json.dumps({k: v for k, v in entry.items()
                                                                   if k != "shards"})[:500])
  name = "bad_batches.jsonl" if jax.process_count() == 1 else f"bad_batches.p{jax.process_index()}.jsonl"
  with (epath.Path(c.workdir) / name).open("a") as f:
    f.write(json.dumps(entry) + "\n")


def _rollback(run: Run, checkpointer, data, state, bad_step: int, why: str):
  """Back to the newest checkpoint (params, optimizer state and data position); the loop then replays the
  batches since, skipping the bad ones."""
  abstract = state_lib.abstract(run.model, run.tx, run.state_shardings)
  restored = checkpointer.restore(abstract, data)
  if restored is None:
    logging.warning("rollback at step %d: no checkpoint yet; the update was skipped instead", bad_step)
    return state, int(state.step), None
  logging.warning("rollback at step %d (%s): back to checkpoint step %d; the batches of the non-finite steps "
                  "will be skipped", bad_step, why, int(restored[0].step))
  return restored[0], int(restored[0].step), None


class _Profiler:
  """One jax.profiler trace of steps [profile_start, profile_start + profile_steps) into <workdir>/profile
  (process 0; a run resumed inside that window traces the rest of it). Called before each step; ``stop`` ends
  the trace wherever the loop ends (the window reaching train.steps, a preemption, an error): a trace that is
  never stopped is never written."""

  def __init__(self, config):
    m = config.metrics
    self.start, self.end = m.profile_start, m.profile_start + m.profile_steps
    self.enabled = self.start >= 0 and jax.process_index() == 0
    self.directory = os.fspath(epath.Path(config.workdir) / "profile")
    self.tracing = False

  def __call__(self, step: int, state) -> None:
    """Before the step from ``step`` (``state``: the state that step starts from)."""
    if not self.enabled:
      return
    inside = self.start <= step < self.end
    if inside and not self.tracing:
      jax.profiler.start_trace(self.directory)
      self.tracing = True
    elif not inside and self.tracing:
      jax.block_until_ready(state)  # the window's last step may still be running: let the trace see it end
      self.stop()

  def stop(self) -> None:
    if not self.tracing:
      return
    self.tracing = self.enabled = False  # one trace per run (a rollback may step back into the window)
    try:
      jax.profiler.stop_trace()
      logging.info("profiler trace written to %s", self.directory)
    except Exception as e:  # noqa: BLE001 - a lost trace must not end the run
      logging.warning("the profiler trace could not be written: %s", e)

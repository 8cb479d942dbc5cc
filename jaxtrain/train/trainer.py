"""From a config to a trained model: validate and lay out (``build``), compile, then loop.

The loop reads top to bottom: next batch -> step -> every ``log_every`` steps fetch metrics and write them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Iterator

import jax
import numpy as np
import ml_collections
import optax
from absl import logging
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxtrain
from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain import metrics as metrics_lib
from jaxtrain import models
from jaxtrain import optim
from jaxtrain import sharding
from jaxtrain.config import ConfigError
from jaxtrain.data import batch as batch_lib
from jaxtrain.train import state as state_lib
from jaxtrain.train.preemption import PreemptionGuard
from jaxtrain.train import step as step_lib
from jaxtrain.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Run:
  """Everything derived from the config before anything is compiled."""
  config: ml_collections.ConfigDict
  mesh: Mesh
  rules: sharding.Rules
  model: models.Model
  tx: optax.GradientTransformation
  lr_schedule: optax.Schedule
  state_shardings: TrainState
  batch_sharding: NamedSharding


def build(config: ml_collections.ConfigDict, devices=None) -> Run:
  """Validates ``config`` against the devices and lays out the run. Raises ConfigError on user mistakes."""
  config_lib.validate_values(config)
  mesh = sharding.make_mesh(config.mesh, devices)
  rules = sharding.rules_from_config(config.sharding)
  try:
    model = models.Model.from_config(config.model)
  except KeyError:
    raise ConfigError("model.name", f"'{config.model.name}' is not a registered model",
                      f"use one of {', '.join(models.names())}") from None
  sharding.check_shardable(model.abstract_params, model.logical_specs, mesh, rules)
  batch_axes, batch_shards = sharding.batch_shards(mesh, rules)
  per_microbatch = config.train.global_batch_size // config.train.microbatches
  if per_microbatch % batch_shards:
    axes = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in batch_axes)
    raise ConfigError("train.global_batch_size", f"each of the {config.train.microbatches} microbatches has "
                      f"{per_microbatch} rows, not divisible by {axes}",
                      f"make global_batch_size / microbatches a multiple of {batch_shards}")
  per_process = config.train.global_batch_size // jax.process_count()
  if config.train.global_batch_size % jax.process_count():
    raise ConfigError("train.global_batch_size", f"does not split over {jax.process_count()} processes",
                      "use a multiple of the process count")
  if config.data.num_workers and per_process % config.data.num_workers:
    raise ConfigError("data.num_workers", f"{config.data.num_workers} does not divide the {per_process} rows "
                      "each process loads per step", "use a divisor of global_batch_size / processes")
  tx = optim.make(config.optim, config.train.steps)
  return Run(config=config, mesh=mesh, rules=rules, model=model, tx=tx,
             lr_schedule=optim.schedule(config.optim, config.train.steps),
             state_shardings=state_lib.shardings(model, tx, mesh, rules),
             batch_sharding=sharding.batch_sharding(mesh, rules))


def report(run: Run) -> dict[str, Any]:
  """Parameter count, per-device bytes of params and optimizer state, large replicated params."""
  abstract = state_lib.abstract(run.model, run.tx)
  sh = run.state_shardings
  info = {
      "params": run.model.num_params(),
      "param_bytes_total": sharding.total_bytes(abstract.params),
      "param_bytes_per_device": sharding.shard_bytes(abstract.params, sh.params),
      "opt_bytes_total": sharding.total_bytes(abstract.opt_state),
      "opt_bytes_per_device": sharding.shard_bytes(abstract.opt_state, sh.opt_state),
      "replicated": sharding.replicated_params(
          abstract.params, sh.params, run.config.sharding.report_replicated_mib * 2**20),
  }
  mib = 2**20
  logging.info("mesh %s | %s parameters | params %.1f MiB/device (%.1f MiB total) | optimizer state %.1f "
               "MiB/device (%.1f MiB total)", dict(run.mesh.shape), f"{info['params']:,}",
               info["param_bytes_per_device"] / mib, info["param_bytes_total"] / mib,
               info["opt_bytes_per_device"] / mib, info["opt_bytes_total"] / mib)
  for path, nbytes in info["replicated"]:
    logging.warning("fully replicated parameter %s (%.1f MiB): add a sharding rule for its axes",
                    path, nbytes / mib)
  return info


def abstract_batch(run: Run) -> dict[str, jax.ShapeDtypeStruct]:
  b, t = run.config.train.global_batch_size, run.config.data.seq_len
  example = batch_lib.from_tokens(np.zeros((1, t + 1), np.int32))
  return {k: jax.ShapeDtypeStruct((b, t), v.dtype, sharding=run.batch_sharding) for k, v in example.items()}


def compile_step(run: Run, train_step=None):
  """The jitted, donated, sharded train step compiled for this run's shapes (one compile)."""
  train_step = train_step or step_lib.make_train_step(
      run.model, run.tx, run.lr_schedule, run.config.train.microbatches, run.state_shardings.params)
  replicated = NamedSharding(run.mesh, P())
  jitted = jax.jit(train_step, in_shardings=(run.state_shardings, run.batch_sharding),
                   out_shardings=(run.state_shardings, replicated), donate_argnums=0)
  with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
    return jitted.lower(state_lib.abstract(run.model, run.tx), abstract_batch(run)).compile()


def init_state(run: Run) -> TrainState:
  with jax.set_mesh(run.mesh):
    return state_lib.make_init(run.model, run.tx, run.state_shardings)(jax.random.key(run.config.train.seed))


def write_config(config: ml_collections.ConfigDict) -> None:
  workdir = epath.Path(config.workdir)
  if jax.process_index() == 0:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")


def make_checkpointer(config: ml_collections.ConfigDict) -> checkpoint_lib.Checkpointer:
  c = config.checkpoint
  directory = c.dir or os.fspath(epath.Path(config.workdir) / "checkpoints")
  return checkpoint_lib.Checkpointer(directory, every_steps=c.every_steps, every_minutes=c.every_minutes,
                                     keep_last=c.keep_last, keep_every=c.keep_every, async_save=c["async"])


def restore_or_init(run: Run, checkpointer: checkpoint_lib.Checkpointer, data) -> tuple[TrainState, dict]:
  """This run's newest good checkpoint (onto the current mesh, with the data position), else a fresh state,
  optionally started from another run's checkpoint (``checkpoint.restore_from``)."""
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          state_lib.abstract(run.model, run.tx), run.state_shardings)
  restored = checkpointer.restore(abstract, data)
  if restored is not None:
    state, meta = restored
    logging.info("resumed from checkpoint step %d (%s)", int(state.step), checkpointer.directory)
    return state, meta
  state = init_state(run)
  c = run.config.checkpoint
  if c.restore_from:
    other, step = checkpoint_lib.restore_from(c.restore_from, abstract, params_only=c.restore_mode == "params")
    state = state.replace(params=other["params"]) if c.restore_mode == "params" else other
    logging.info("started from %s of %s (step %d)", c.restore_mode, c.restore_from, step)
  return state, {}


def train(config: ml_collections.ConfigDict, devices=None, data: Iterator[dict] | None = None):
  """Runs (or resumes) training to ``config.train.steps``. Returns the final state and the logged metrics."""
  run = build(config, devices)
  data = data if data is not None else data_lib.open_train(config)
  checkpointer = make_checkpointer(config)
  try:
    return _train_loop(run, data, checkpointer)
  finally:
    checkpointer.close()
    data_lib.close(data)


def _train_loop(run: Run, data: Iterator[dict], checkpointer: checkpoint_lib.Checkpointer):
  config = run.config
  write_config(config)
  report(run)
  t0 = time.perf_counter()
  step_fn = compile_step(run)
  state, meta = restore_or_init(run, checkpointer, data)
  logging.info("compiled and initialized in %.1fs", time.perf_counter() - t0)

  writer = metrics_lib.MetricWriter(config.workdir, config.train.steps)
  tokens_seen, wall_time = meta.get("tokens_seen", 0), meta.get("wall_time", 0.0)
  history, pending, interval, last = [], [], [], {}
  t_start = t_last = time.perf_counter()

  def save(step: int, force: bool) -> None:
    checkpointer.save(step, state, data, config=json.loads(config.to_json_best_effort()), force=force, meta={
        "jaxtrain_version": jaxtrain.__version__, "step": step, "mesh": dict(run.mesh.shape),
        "loss": float(last["loss"]) if last else None, "tokens_seen": tokens_seen, "seed": config.train.seed,
        "wall_time": wall_time + time.perf_counter() - t_start, "saved_at": time.time()})

  with PreemptionGuard() as preemption:
    for step in range(int(state.step), config.train.steps):
      state, metrics = step_fn(state, data_lib.to_global(next(data), run.batch_sharding))
      pending.append(metrics)
      done = step + 1
      stop = preemption.requested(done)
      log_now = done % config.train.log_every == 0 or done == config.train.steps
      save_now = stop or done == config.train.steps or checkpointer.should_save(done)
      if log_now or save_now:  # the only host syncs: at log and save steps
        fetched = jax.device_get(pending)
        tokens_seen += int(sum(m["tokens"] for m in fetched))
        interval += fetched
        pending, last = [], fetched[-1]
      if log_now:
        elapsed = time.perf_counter() - t_last
        record = {**interval[-1], "tokens_per_sec": sum(m["tokens"] for m in interval) / elapsed,
                  "step_time": elapsed / len(interval)}
        writer.write(done, record)
        history.append({"step": done, **record})
        interval, t_last = [], time.perf_counter()
      if save_now:
        save(done, force=stop or done == config.train.steps)
      if stop:
        checkpointer.wait()
        logging.info("preempted: saved step %d, exiting", done)
        break
  checkpointer.wait()
  return state, history

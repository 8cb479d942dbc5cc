"""From a config to a trained model: validate and lay out (``build``), compile, then loop.

The loop reads top to bottom: next batch -> step -> every ``log_every`` steps fetch metrics and write them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator

import jax
import numpy as np
import ml_collections
import optax
from absl import logging
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain import metrics as metrics_lib
from jaxtrain import models
from jaxtrain import optim
from jaxtrain import sharding
from jaxtrain.config import ConfigError
from jaxtrain.data import batch as batch_lib
from jaxtrain.train import state as state_lib
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


def train(config: ml_collections.ConfigDict, devices=None, data: Iterator[dict] | None = None):
  """Runs ``config.train.steps`` steps. Returns the final state and the logged metrics."""
  run = build(config, devices)
  data = data if data is not None else data_lib.open_train(config)
  try:
    return _train_loop(run, data)
  finally:
    data_lib.close(data)


def _train_loop(run: Run, data: Iterator[dict]):
  config = run.config
  write_config(config)
  report(run)
  t0 = time.perf_counter()
  step_fn = compile_step(run)
  state = init_state(run)
  logging.info("compiled init + train step in %.1fs", time.perf_counter() - t0)

  writer = metrics_lib.MetricWriter(config.workdir, config.train.steps)
  history, pending = [], []
  t_last = time.perf_counter()
  for step in range(int(state.step), config.train.steps):
    state, metrics = step_fn(state, data_lib.to_global(next(data), run.batch_sharding))
    pending.append(metrics)
    if (step + 1) % config.train.log_every == 0 or step + 1 == config.train.steps:
      fetched = jax.device_get(pending)  # the only host sync: once per log interval
      elapsed = time.perf_counter() - t_last
      record = {**fetched[-1], "tokens_per_sec": sum(m["tokens"] for m in fetched) / elapsed,
                "step_time": elapsed / len(fetched)}
      writer.write(step + 1, record)
      history.append({"step": step + 1, **record})
      pending, t_last = [], time.perf_counter()
  return state, history

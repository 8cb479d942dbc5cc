"""A run laid out: from a config to everything derived from it before anything is compiled (:class:`Run`).

:func:`build` validates the config against the devices (mesh sizes, divisibility, batch splits; every problem one
:class:`~jaxtrain.errors.ConfigError` line) and derives the mesh, rules, model, optimizer, shardings, microbatch
count and pipeline schedule; :func:`report` logs what one device holds.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import ml_collections
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import config as config_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain import models
from jaxtrain import optim
from jaxtrain import sharding
from jaxtrain.data import mixture
from jaxtrain.errors import ConfigError
from jaxtrain.models import attention as attention_lib
from jaxtrain.parallel import pipeline as pipeline_lib
from jaxtrain.train import objectives
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
  microbatches: int
  pipeline_schedule: pipeline_lib.Schedule | None  # None: no pipeline parallelism (mesh.pipeline = 1)
  aux_weights: dict[str, float]  # the model's auxiliary losses and their weights in the objective
  sources: tuple[str, ...] = ()  # a data mixture's components (batches carry their ids: per-component metrics)
  # The objective's state besides the model (TrainState.extra: ShapeDtypeStructs with shardings), or None.
  state_extra: Any = None

  def abstract_state(self, sharded: bool = True) -> TrainState:
    """The state's ShapeDtypeStructs, laid out on the run's shardings (``sharded``): every restore target, the
    compile's and the fingerprints' shapes come from here, so that they agree on the objective's extra state."""
    return state_lib.abstract(self.model, self.tx, self.state_shardings if sharded else None, self.state_extra)


def build(config: ml_collections.ConfigDict, devices=None) -> Run:
  """Validates ``config`` against the devices and lays out the run (``Run.config`` is the resolved config,
see :func:`jaxtrain.config.resolve`). Raises ConfigError on user mistakes."""
  config = config_lib.resolve(config)
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  rules = sharding.rules_from_config(config.sharding)
  model = models.Model.from_config(config.model)
  pipeline = None
  if mesh.shape["pipeline"] > 1:
    why = model.why_not_stageable()
    if why:
      raise ConfigError("mesh.pipeline", f"model '{config.model.name}' cannot be split into pipeline stages: {why}",
                        "set mesh.pipeline=1 and dcn_pipeline=1, or give the model those parts (see jaxtrain/models)")
    pipeline = pipeline_lib.schedule_from_config(config, mesh.shape["pipeline"], model.num_layers())
    for logical in ("layers", "stage"):
      if sharding.logical_to_mesh_spec(P(logical), rules)[0] != "pipeline":
        raise ConfigError("sharding.rules", f"'{logical}' must map to the pipeline mesh axis when mesh.pipeline > 1",
                          f"remove the '{logical}=' override")
  platform = "tpu" if config.get("dry_run_topology") else jax.default_backend()
  if config.model.dtype == "float16" and platform == "tpu":
    raise ConfigError("model.dtype", "float16 is not a TPU compute type (TPUs compute in bfloat16, which needs no "
                      "loss scaling)", "set model.dtype=bfloat16 and optim.loss_scale=none")
  if config.model.dtype == "float16" and config.optim.loss_scale == "none":
    logging.warning("model.dtype=float16 without loss scaling: gradients below float16's range underflow to 0; "
                    "set optim.loss_scale=dynamic")
  if config.model.attention == "auto":
    chosen = attention_lib.choose(platform, config.data.seq_len, mesh.shape["context"], in_shard_map=bool(pipeline),
                                  dtype=config.model.dtype, softcap=bool(config.model.get("attn_softcap")),
                                  sinks=bool(config.model.get("attention_sinks")))
    logging.info("model.attention=auto: %s (%s, seq_len %d, mesh.context %d%s)", chosen, platform,
                 config.data.seq_len, mesh.shape["context"], ", inside pipeline stages" if pipeline else "")
  batch_axes, batch_shards = sharding.batch_shards(dict(mesh.shape), rules)
  if pipeline and config.train.max_rows_per_device:
    raise ConfigError("train.max_rows_per_device", "is not supported with pipeline parallelism (its microbatches "
                      "are the pipeline's)", "set it to 0, or set pipeline.microbatches yourself")
  microbatches = pipeline.microbatches if pipeline else microbatches_for(config.train, batch_shards)
  if config.train.global_batch_size % microbatches:
    raise ConfigError("train.microbatches", f"{microbatches} does not divide train.global_batch_size="
                      f"{config.train.global_batch_size}", "choose a divisor of the batch size")
  sharding.check_shardable(model.abstract_params, model.logical_specs, mesh, rules,
                           functools.partial(models.axis_key, config.model.name))
  per_microbatch = config.train.global_batch_size // microbatches
  if per_microbatch % batch_shards:
    axes = " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in batch_axes)
    raise ConfigError("train.global_batch_size", f"each of the {microbatches} microbatches has "
                      f"{per_microbatch} rows, not divisible by {axes}",
                      f"make global_batch_size / microbatches a multiple of {batch_shards}")
  per_process = config.train.global_batch_size // jax.process_count()
  if config.train.global_batch_size % jax.process_count():
    raise ConfigError("train.global_batch_size", f"does not split over {jax.process_count()} processes",
                      "use a multiple of the process count")
  if config.data.num_workers and per_process % config.data.num_workers:
    raise ConfigError("data.num_workers", f"{config.data.num_workers} does not divide the {per_process} rows "
                      "each process loads per step", "use a divisor of global_batch_size / processes")
  if config.optim.name == "muon":
    optim.check_muon(model.abstract_params, model.logical_specs, config.model.name)
  # LoRA: the adapters only; the logical axes tell Muon an expert kernel's experts from its matrix
  tx = optim.make(config.optim, config.train.steps, model.trainable_mask(), model.logical_specs, model.balance())
  if config.optim.offload_state:
    state_lib.check_offload(mesh, jax.eval_shape(tx.init, model.abstract_params), config.optim.name)
  aux_weights = model.aux_loss_weights(step_lib.aux_loss_names(model, config.data.seq_len))
  extra = objectives.of(config).state_extra(config, mesh, rules)
  return Run(config=config, mesh=mesh, rules=rules, model=model, tx=tx,
             lr_schedule=optim.schedule(config.optim, config.train.steps),
             state_shardings=state_lib.shardings(model, tx, mesh, rules, extra, offload=config.optim.offload_state),
             batch_sharding=sharding.batch_sharding(mesh, rules), microbatches=microbatches,
             pipeline_schedule=pipeline, aux_weights=aux_weights, sources=mixture.names(config), state_extra=extra)


def microbatches_for(train: ml_collections.ConfigDict, batch_shards: int) -> int:
  """``train.microbatches`` (1 if 0); with ``train.max_rows_per_device`` set, the fewest microbatches, at least
  that many, whose rows split evenly over the ``batch_shards`` devices a batch is split over, at most the limit on
  each."""
  rows, least, limit = train.global_batch_size, max(train.microbatches, 1), train.max_rows_per_device
  if not limit:
    return least
  for m in range(least, rows + 1):
    if rows % m == 0 and (rows // m) % batch_shards == 0 and rows // m // batch_shards <= limit:
      return m
  raise ConfigError("train.max_rows_per_device", f"no split of train.global_batch_size={rows} into microbatches "
                    f"(at least {least}) puts at most {limit} row(s) on each of the {batch_shards} devices the batch "
                    "is split over", "raise the limit, or use a global batch size with more divisors")


def report(run: Run) -> dict[str, Any]:
  """Parameter count, per-device bytes of params and optimizer state, large replicated params."""
  abstract = state_lib.abstract(run.model, run.tx)
  sh = run.state_shardings
  info = {
      "params": run.model.num_params(),
      "trainable_params": sum(x.size for x in jax.tree.leaves(run.model.split_trainable(abstract.params)[0])),
      "param_bytes_total": sharding.total_bytes(abstract.params),
      "param_bytes_per_device": sharding.shard_bytes(abstract.params, sh.params),
      "opt_bytes_total": sharding.total_bytes(abstract.opt_state),
      "opt_bytes_per_device": sharding.shard_bytes(abstract.opt_state, sh.opt_state),
      "opt_bytes_on_host_per_device": state_lib.host_bytes(abstract.opt_state, sh.opt_state),
      "replicated": sharding.replicated_params(
          abstract.params, sh.params, run.config.sharding.report_replicated_mib * 2**20),
  }
  mib = 2**20
  logging.info("mesh %s | %s parameters | params %.1f MiB/device (%.1f MiB total) | optimizer state %.1f "
               "MiB/device (%.1f MiB total)%s", dict(run.mesh.shape), f"{info['params']:,}",
               info["param_bytes_per_device"] / mib, info["param_bytes_total"] / mib,
               info["opt_bytes_per_device"] / mib, info["opt_bytes_total"] / mib,
               f", {info['opt_bytes_on_host_per_device'] / mib:.1f} MiB/device of it in host memory "
               "(optim.offload_state)" if info["opt_bytes_on_host_per_device"] else "")
  if run.model.lora:
    lora_cfg = run.model.lora
    logging.info("LoRA rank %d, alpha %g on %s: %s trainable parameters (%.3f%%), the base is frozen",
                 lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets, f"{info['trainable_params']:,}",
                 100 * info["trainable_params"] / info["params"])
  train = run.config.train
  if train.max_rows_per_device:
    rows = train.global_batch_size // run.microbatches
    shards = sharding.batch_shards(dict(run.mesh.shape), run.rules)[1]
    logging.info("train.max_rows_per_device=%d: %d microbatch(es) of %d rows, %d per device over %d batch shards",
                 train.max_rows_per_device, run.microbatches, rows, rows // shards, shards)
  if run.pipeline_schedule:
    p = run.pipeline_schedule
    info["pipeline"] = {"schedule": p.kind, "stages": p.stages, "repeats": p.repeats, "microbatches": p.microbatches,
                        "bubble": p.bubble, "in_flight": p.in_flight}
    logging.info("pipeline: %d stages, %s, %d microbatches, %d layers per stage -> bubble %.1f%% "
                 "((S-1)/(R*M+S-1)), at most %d microbatch activations in flight per stage", p.stages, p.describe(),
                 p.microbatches, run.model.num_layers() // p.stages, 100 * p.bubble, p.in_flight)
  for path, nbytes in info["replicated"]:
    logging.warning("fully replicated parameter %s (%.1f MiB): add a sharding rule for its axes",
                    path, nbytes / mib)
  return info


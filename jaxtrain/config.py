"""The config schema (defaults for every key) and its validation.

Every config file under ``configs/`` starts from :func:`base_config` and overrides what it needs, so the
set of keys is defined in exactly one place. :func:`validate` checks a resolved config against the devices
before anything is compiled and raises :class:`ConfigError` with one readable line naming the key, what is
wrong and how to fix it; ``main`` turns that into exit code 2.
"""

from __future__ import annotations

import difflib
import math
from typing import Iterable

import ml_collections
from absl import logging

from jaxtrain import paths
from jaxtrain.errors import ConfigError, DataError, UserError  # noqa: F401 - where callers import them

MESH_AXES = ("data", "pipeline", "fsdp", "tensor")
REMAT_POLICIES = ("none", "full", "save_dots")
DTYPES = ("float32", "bfloat16")


def base_config() -> ml_collections.ConfigDict:
  """All keys with their defaults. Config files override values, never add keys."""
  c = ml_collections.ConfigDict()
  c.workdir = "runs/default"  # run directory: resolved config, metrics, checkpoints
  c.dry_run = False  # build the mesh, compile the step, print per-device memory and FLOPs, then exit

  c.distributed = ml_collections.ConfigDict(dict(
      coordinator_address="",  # host:port of process 0; empty = from the cluster environment, or one process
      num_processes=1,
      process_id=0,
      auto=True,  # join automatically on TPU pods, Slurm, Kubernetes indexed jobs, Open MPI
      timeout_s=300.0,  # give up (clear error) if the coordinator cannot be reached in this time
      heartbeat_timeout_s=30.0,  # a process that stops answering this long fails the job instead of hanging it
  ))

  c.model = ml_collections.ConfigDict(dict(
      name="llama",
      num_layers=2,
      d_model=64,
      num_heads=4,
      num_kv_heads=2,
      head_dim=16,
      mlp_dim=256,
      vocab_size=256,
      tie_embeddings=False,
      rope_theta=10_000.0,
      norm_eps=1e-5,
      remat="none",  # none | full | save_dots
      dtype="float32",  # compute dtype; params are always float32
  ))

  # Mesh sizes per axis: ICI (within a slice / host) and DCN (across slices or hosts). -1 fills the rest.
  c.mesh = ml_collections.ConfigDict(dict(
      data=1, fsdp=-1, tensor=1, pipeline=1,
      dcn_data=1, dcn_fsdp=1, dcn_tensor=1, dcn_pipeline=1,
  ))

  c.sharding = ml_collections.ConfigDict(dict(
      # Named rule table (see jaxtrain/sharding.py): dp | fsdp | fsdp_tp.
      preset="fsdp_tp",
      # Extra rules, tried before the preset's: "logical=axis[+axis],logical=" (empty = unsharded).
      rules="",
      # At start, list every parameter at least this large that is fully replicated.
      report_replicated_mib=1.0,
  ))

  c.data = ml_collections.ConfigDict(dict(
      source="arrayrecord",  # arrayrecord (output of tools/prepare_data.py) | synthetic (no data needed)
      path="",  # prepared data folder; empty = the bundled Shakespeare corpus, prepared on first use
      seq_len=128,
      packing=True,  # pack documents into rows (segment ids keep them apart); False = one padded doc per row
      tokenizer="",  # if set ('byte' or a tokenizer file), the data must have been prepared with it
      num_workers=0,  # Grain worker processes (0 = in-process, fastest on few cores)
      prefetch=2,  # batches buffered per worker
      verify_checksums=True,  # SHA-256 of every shard against the manifest at start
      cache_dir="~/.cache/jaxtrain",  # where the bundled corpus is prepared
  ))

  from jaxtrain import optim  # each component owns its group's defaults and checks
  c.optim = optim.defaults()

  c.train = ml_collections.ConfigDict(dict(
      steps=1000,
      seed=0,
      global_batch_size=8,
      # The batch is split into this many microbatches: accumulated one after the other, or, with
      # mesh.pipeline > 1, flowing through the stages together. 0 = auto: 1, or the stage count when pipelined.
      microbatches=0,
      log_every=10,
  ))

  # Pipeline parallelism: the layer stack split into mesh.pipeline x mesh.dcn_pipeline stages.
  c.pipeline = ml_collections.ConfigDict(dict(
      schedule="gpipe",  # gpipe | circular (each stage holds `repeats` non-adjacent groups of layers)
      repeats=2,  # circular only; bubble (S - 1) / (repeats x microbatches + S - 1) for S stages
  ))

  c.metrics = ml_collections.ConfigDict(dict(
      peak_tflops=0.0,  # per-device peak for MFU; 0 = from the device kind (TPU v4-v6e, A100, H100, H200)
      tensorboard=True,  # event files in <workdir>/tensorboard
      wandb=False,  # Weights & Biases, when installed
      wandb_project="",
      progress="auto",  # auto (a bar on a TTY, log lines otherwise) | bar | log
      profile_start=-1,  # capture a jax.profiler trace from this step ...
      profile_steps=3,  # ... for this many steps, into <workdir>/profile
  ))

  c.eval = ml_collections.ConfigDict(dict(
      every_steps=0,  # eval loss and perplexity on the held-out split every N steps (0: off)
      max_batches=0,  # 0 = the whole eval split
  ))

  c.monitor = ml_collections.ConfigDict(dict(
      nan_policy="skip",  # non-finite loss, grads or updated state: skip (drop the update) | rollback (to the
      # last checkpoint, skipping the offending batch) | stop. A non-finite update is never applied.
      max_consecutive_nonfinite=5,  # skip: this many in a row (or one at the last step) roll back; a second
      # such rollback to the same checkpoint stops the run (exit 1). rollback: at most this many to one checkpoint
      spike_sigma=6.0,  # warn when loss or grad norm exceeds the window mean + k sigma (0: off)
      spike_window=50,  # logged steps in that window
      stagnation_logs=0,  # warn when the loss has not improved for this many log intervals (0: off)
      watchdog_multiple=10.0,  # exit (code 3, with stacks) if no step finishes in this x the median time
      watchdog_min_s=120.0,  # ... but never sooner than this
      watchdog_timeout_s=0.0,  # a hard limit instead (0: use the multiple)
  ))

  c.checkpoint = ml_collections.ConfigDict({
      "dir": "",  # default: <workdir>/checkpoints; local paths and gs:// alike
      "every_steps": 0,  # save every N steps (0: off); the last step and preemptions always save
      "every_minutes": 0.0,  # and/or at least every T minutes (0: off)
      "keep_last": 3,  # retention: the newest K checkpoints ...
      "keep_every": 0,  # ... plus every M-th step kept permanently (0: none)
      "async": True,  # save in the background; the loop blocks only for the device-to-host copy
      "verify": True,  # fingerprint every array at save, check them (and finiteness) at restore
      "restore_from": "",  # start from another run's checkpoint (folder of steps, or one step folder)
      "restore_mode": "params",  # params | state: what restore_from takes from that checkpoint
  })
  return c


def flat_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  keys = []
  for k, v in cfg.items():
    if isinstance(v, ml_collections.ConfigDict):
      keys += flat_keys(v, f"{prefix}{k}.")
    else:
      keys.append(f"{prefix}{k}")
  return keys


def unknown_key_error(key: str, cfg: ml_collections.ConfigDict) -> ConfigError:
  close = difflib.get_close_matches(key, flat_keys(cfg), n=1, cutoff=0.5)
  fix = f"did you mean '{close[0]}'?" if close else "see jaxtrain/config.py for the keys"
  return ConfigError(key, "unknown config key", fix)


def resolve_axis_sizes(sizes: dict[str, int], total: int, what: str, unit: str) -> dict[str, int]:
  """Fills at most one -1 so the product of ``sizes`` equals ``total``."""
  fill = [k for k, v in sizes.items() if v == -1]
  for k, v in sizes.items():
    if v != -1 and v < 1:
      raise ConfigError(f"mesh.{k}", f"size {v} is invalid", "use a positive size or -1 to fill")
  if len(fill) > 1:
    raise ConfigError(f"mesh.{fill[1]}", f"more than one {what} axis is -1 ({', '.join(fill)})",
                      "set all but one to explicit sizes")
  known = math.prod(v for v in sizes.values() if v != -1)
  if fill:
    if total % known:
      raise ConfigError(f"mesh.{fill[0]}", f"cannot fill: {total} {unit} are not divisible by "
                        f"the other {what} axes' product {known}", f"make the explicit {what} sizes divide {total}")
    sizes = {**sizes, fill[0]: total // known}
  elif known != total:
    desc = " x ".join(f"{k}={v}" for k, v in sizes.items())
    raise ConfigError("mesh", f"{what} mesh {desc} = {known} {unit}, but there are {total}",
                      f"make the product {total} or set one axis to -1")
  return sizes


def mesh_shape(mesh_cfg, num_devices: int, num_slices: int) -> tuple[dict[str, int], dict[str, int]]:
  """(ici, dcn) sizes per axis in MESH_AXES order, -1s filled. Raises ConfigError when impossible."""
  dcn = {f"dcn_{a}": mesh_cfg[f"dcn_{a}"] for a in MESH_AXES}
  dcn = resolve_axis_sizes(dcn, num_slices, "DCN", "slices (or processes)")
  if num_devices % num_slices:
    raise ConfigError("mesh", f"{num_devices} devices do not split evenly into {num_slices} slices",
                      "use the same number of devices on every host/slice")
  ici = resolve_axis_sizes({a: mesh_cfg[a] for a in MESH_AXES}, num_devices // num_slices, "ICI",
                           "devices per slice" if num_slices > 1 else "devices")
  return ({a: ici[a] for a in MESH_AXES}, {a: dcn[f"dcn_{a}"] for a in MESH_AXES})


def _check_choice(cfg, key: str, choices: Iterable[str]):
  group, name = key.split(".")
  value = cfg[group][name]
  if value not in choices:
    raise ConfigError(key, f"'{value}' is not one of {', '.join(choices)}", f"set {key} to one of them")


def _check_positive(cfg, keys: Iterable[str], allow_zero: bool = False):
  for key in keys:
    group, name = key.split(".")
    value = cfg[group][name]
    if value < 0 or (value == 0 and not allow_zero):
      raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}", "fix the value")


def validate_values(cfg: ml_collections.ConfigDict) -> None:
  """Checks that need no devices and no model: ranges, choices and simple relations."""
  m = cfg.model
  _check_positive(cfg, ["model.num_layers", "model.d_model", "model.num_heads", "model.num_kv_heads",
                        "model.head_dim", "model.mlp_dim", "model.vocab_size", "data.seq_len",
                        "train.steps", "train.global_batch_size", "data.prefetch", "train.log_every",
                        "pipeline.repeats"])
  _check_positive(cfg, ["train.microbatches", "data.num_workers", "checkpoint.every_steps", "checkpoint.every_minutes",
                        "checkpoint.keep_every"], allow_zero=True)
  _check_choice(cfg, "model.remat", REMAT_POLICIES)
  _check_choice(cfg, "model.dtype", DTYPES)
  from jaxtrain import optim
  optim.validate(cfg)
  _check_choice(cfg, "data.source", ("arrayrecord", "synthetic"))
  if cfg.data.source == "synthetic" and cfg.data.path:
    raise ConfigError("data.path", "is set but data.source='synthetic' ignores it",
                      "set data.source=arrayrecord or clear data.path")
  if m.num_heads % m.num_kv_heads:
    raise ConfigError("model.num_kv_heads", f"{m.num_kv_heads} does not divide model.num_heads={m.num_heads}",
                      "grouped-query attention needs num_heads to be a multiple of num_kv_heads")
  _check_choice(cfg, "pipeline.schedule", ("gpipe", "circular"))
  _check_choice(cfg, "checkpoint.restore_mode", ("params", "state"))
  _check_choice(cfg, "monitor.nan_policy", ("skip", "rollback", "stop"))
  _check_positive(cfg, ["distributed.timeout_s", "distributed.heartbeat_timeout_s"])
  _check_choice(cfg, "metrics.progress", ("auto", "bar", "log"))
  _check_positive(cfg, ["eval.every_steps", "eval.max_batches", "monitor.spike_sigma", "monitor.stagnation_logs",
                        "monitor.watchdog_timeout_s", "metrics.peak_tflops"], allow_zero=True)
  _check_positive(cfg, ["monitor.spike_window", "monitor.watchdog_multiple", "monitor.watchdog_min_s",
                        "metrics.profile_steps", "monitor.max_consecutive_nonfinite"])
  _check_positive(cfg, ["checkpoint.keep_last"])
  if not cfg.workdir:
    raise ConfigError("workdir", "is empty", "set --config.workdir=DIR")


def resolve(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config a run uses, as ``config.json`` records it: validated (:func:`validate_values`), every path
  absolute (:mod:`jaxtrain.paths`; ``checkpoint.dir`` filled in), and a warmup longer than the schedule
  clipped to it with a warning (so that ``--config.train.steps=N`` shortens any config). A new ConfigDict;
  resolving twice changes nothing."""
  validate_values(cfg)
  out = cfg.copy_and_resolve_references()
  for key in paths.CONFIG_KEYS:
    group, _, name = key.rpartition(".")
    holder = out[group] if group else out
    if key != "data.tokenizer" or holder[name] != "byte":
      holder[name] = paths.resolve(holder[name])
  out.checkpoint.dir = out.checkpoint.dir or paths.join(out.workdir, "checkpoints")
  horizon = out.optim.decay_steps or out.train.steps
  if out.optim.warmup_steps > horizon:
    logging.warning("optim.warmup_steps=%d is longer than the %d-step schedule (optim.decay_steps, default "
                    "train.steps): warming up over all %d steps instead", out.optim.warmup_steps, horizon, horizon)
    out.optim.warmup_steps = horizon
  return out


def config_key_for_logical_axis(axis: str) -> str:
  """Which model config key sets the size of a parameter dimension with this logical name."""
  return {"embed": "model.d_model", "heads": "model.num_heads", "kv_heads": "model.num_kv_heads",
          "head_dim": "model.head_dim", "mlp": "model.mlp_dim", "vocab": "model.vocab_size",
          "layers": "model.num_layers"}.get(axis, f"the '{axis}' dimension")


def check_divisible(key: str, size: int, mesh_axes: tuple[str, ...], mesh_sizes: dict[str, int], what: str):
  shards = math.prod(mesh_sizes[a] for a in mesh_axes)
  if size % shards:
    axes = " x ".join(f"mesh.{a}={mesh_sizes[a]}" for a in mesh_axes)
    raise ConfigError(key, f"{size} is not divisible by {axes} ({what} is sharded over "
                      f"{', '.join(mesh_axes)})", f"make {key} a multiple of {shards} or shrink those axes")

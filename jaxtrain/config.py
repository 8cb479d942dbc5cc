"""The config: composed from the components' groups, validated by them, resolved once.

Every config file under ``configs/`` starts from :func:`base_config` and overrides what it needs. Each config
group's keys, defaults and checks live in the module that reads them (:data:`COMPONENTS`); the model group is the
chosen family's (jaxtrain.models). :func:`resolve` runs every component's ``validate`` (:func:`validate_values`),
then makes paths absolute; checks that need the devices or the model (mesh sizes, divisibility, batch splits) run
in ``trainer.build``. Every check raises :class:`ConfigError` with one readable line naming the key, what is
wrong and how to fix it; ``main`` turns that into exit code 2.
"""

from __future__ import annotations

import difflib
import importlib.util
import json

import ml_collections
from absl import logging

from jaxtrain import checkpoint, data, distributed, mesh, metrics, models, monitor, optim, paths, sharding, topology
from jaxtrain.errors import ConfigError, DataError, UserError, check_positive  # noqa: F401 - callers import them here
from jaxtrain.parallel import context, pipeline
from jaxtrain.train import hooks, objectives
from jaxtrain.train.objectives import grpo
from jaxtrain.train.objectives import preference

# Config group -> the module that owns its defaults (``defaults()``) and its checks (``validate(config)``), next to
# the code that reads those keys. The core (this module) keeps only what every run shares: workdir, train, eval.
COMPONENTS = (
    ("distributed", distributed),
    ("model", models),
    ("mesh", mesh),
    ("sharding", sharding),
    ("data", data),
    ("optim", optim),
    ("pipeline", pipeline),
    ("metrics", metrics),
    ("monitor", monitor),
    ("checkpoint", checkpoint),
    ("rl", grpo),
    ("preference", preference),
)
# Checks across groups by modules that own no group: context parallelism (mesh.context against data.seq_len and
# the model family).
CROSS_CHECKS = (context,)


def base_config(model: str = "llama") -> ml_collections.ConfigDict:
  """All keys with their defaults, the ``model`` group being that of the model family ``model`` (its own keys:
  see jaxtrain/models). Config files override values, never add keys; ``--config.model.name=F`` on the command
  line swaps in family F's group (see jaxtrain.main)."""
  c = ml_collections.ConfigDict()
  c.workdir = "runs/default"  # run directory: resolved config, metrics, checkpoints
  # A workdir on an object store (gs://, s3://) is locked by a lease the run renews; a start takes a run's lease over
  # once it watched it unrenewed this long (the restart of a crashed run waits at most this long), and a run that
  # cannot renew it for 3/4 of this stops writing (exit 75).
  c.workdir_lease_s = 120.0
  c.dry_run = False  # build the mesh, compile the step, print per-device memory and FLOPs, then exit
  # With dry_run: compile for this TPU topology instead of the local devices, on any host (needs libtpu:
  # pip install -e '.[tpu]'), e.g. v5e:2x2, v5p:4x4x4, v6e:8x8; the memory is the TPU compiler's.
  c.dry_run_topology = ""
  # XLA's compiled programs are kept here (JAX's persistent compilation cache), so that a restart after a
  # preemption or a crash, a resume, or the same command again loads the step instead of compiling it (minutes for
  # a large model on a pod). Local or gs://; one per host is fine. '' = off. An explicit JAX setting wins
  # (JAX_COMPILATION_CACHE_DIR, or jax.config set by the caller).
  c.compilation_cache_dir = "~/.cache/jaxtrain/xla"
  c.train = ml_collections.ConfigDict(dict(
      steps=1000,
      seed=0,
      global_batch_size=8,
      # The batch is split into this many microbatches: accumulated one after the other, or, with
      # mesh.pipeline > 1, flowing through the stages together. 0 = auto: 1, or the stage count when pipelined.
      microbatches=0,
      # Elastic batch: at most this many rows on any device per pass (0: no limit). The microbatch count is
      # derived for the devices the run starts on (the fewest, at least train.microbatches, that keep to it), so
      # a restart on fewer or more devices keeps global_batch_size and accumulates more or fewer microbatches.
      max_rows_per_device=0,
      log_every=10,
      # Greedy continuations of sample_prompts (sample_tokens new tokens each) logged every N steps and at the end
      # (0: off): to the log and <workdir>/samples.jsonl (jaxtrain.sampling.Sampler, compiled once).
      sample_every=0,
      sample_prompts=("ROMEO:",),
      sample_tokens=32,
      # Output z-loss (PaLM's): this weight x the mean over real target tokens of (log Z)^2, Z the softmax's
      # normalizer, added to the objective to keep log Z near 0 (PaLM: 1e-4); logged as z_loss. 0 = off.
      z_loss_weight=0.0,
      # Your loop hooks (jaxtrain.train.hooks.Hook), each a factory named by import path, "module.path:factory",
      # called with the run (jaxtrain.train.run.Run); told of the run's moments after the built-in ones.
      hooks=(),
      # What the step minimizes (jaxtrain.train.objectives): lm (next-token cross-entropy).
      objective="lm",
  ))
  c.eval = ml_collections.ConfigDict(dict(
      every_steps=0,  # eval loss and perplexity on the held-out split every N steps (0: off)
      max_batches=0,  # 0 = the whole eval split (per eval set)
      # Benchmark scores during the run (lm-evaluation-harness, the eval extra; jaxtrain.train.hooks.Harness): these
      # harness tasks on the live params every harness_every steps and at the last, logged as
      # harness/<task>/<metric>; harness_limit documents per task (0: all), harness_include_path a folder of task
      # YAMLs (local tasks), harness_num_fewshot few-shot examples (-1: the task's own); harness_apply_chat_template
      # and harness_fewshot_as_multiturn as jaxtrain.evaluate's --apply_chat_template / --fewshot_as_multiturn.
      harness_tasks=(),
      harness_every=0,
      harness_limit=0,
      harness_include_path="",
      harness_num_fewshot=-1,
      harness_apply_chat_template=False,
      harness_fewshot_as_multiturn=False,
      **data.eval_set_defaults(),  # eval.sets: named eval data (jaxtrain/data)
  ))
  for group, module in COMPONENTS:
    c[group] = module.defaults(model) if group == "model" else module.defaults()
  return c


def for_target(c: ml_collections.ConfigDict, name: str, targets: dict[str, dict], target: str
               ) -> ml_collections.ConfigDict:
  """``c`` (the config ``configs/<name>.py``) for a ``:target`` variant: its flattened-key overrides from
  ``targets`` applied and its own workdir, ``runs/<name>_<target>``; ``c`` itself when ``target`` is empty."""
  if not target:
    return c
  if target not in targets:
    raise ValueError(f"unknown variant '{target}' of {name}.py: use {' or '.join(targets)}")
  c.update_from_flattened_dict(targets[target])
  c.workdir = f"runs/{name}_{target}"
  return c


def load_file(path: str, overrides: list[str] = ()) -> ml_collections.ConfigDict:
  """``configs/x.py[:variant]`` plus ``key=value`` overrides (values parsed as JSON where they parse), as the
  ``--config`` / ``--config.key=value`` flags of jaxtrain.main give them; for tools that load configs themselves."""
  path, _, variant = path.partition(":")
  module = _module(path)
  config = module.get_config(variant) if variant else module.get_config()
  for item in overrides:
    key, value = item.split("=", 1)
    try:
      value = json.loads(value)
    except json.JSONDecodeError:
      pass
    config.update_from_flattened_dict({key: value})
  return config


def _module(path: str):
  spec = importlib.util.spec_from_file_location("cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def as_overrides(path: str, overrides: list[str] = ()) -> tuple[str, list[str]]:
  """``configs/x.py:variant`` plus ``overrides`` as the base file and every override, the variant's own (its
  ``TARGETS`` entry) first: what a record of a measurement keeps, so that it still names the settings measured
  after the variant changes."""
  path, _, variant = path.partition(":")
  own = _module(path).TARGETS[variant] if variant else {}
  return path, [f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in own.items()] + list(overrides)


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
  fix = f"did you mean '{close[0]}'?" if close else "every key is listed in docs/configuration.md (#every-key)"
  return ConfigError(key, "unknown config key", fix)


def validate_values(cfg: ml_collections.ConfigDict) -> None:
  """Checks that need no devices: each component's ``validate`` (its keys' ranges, choices and relations), then
  the core's."""
  objectives.check_loss_scaling(cfg)
  for module in [module for _, module in COMPONENTS] + list(CROSS_CHECKS):
    module.validate(cfg)
  check_positive(cfg, ["train.steps", "train.global_batch_size", "train.log_every", "workdir_lease_s"])
  check_positive(cfg, ["train.microbatches", "train.max_rows_per_device", "eval.every_steps", "eval.max_batches"],
                 allow_zero=True)
  check_positive(cfg, ["train.sample_every", "train.z_loss_weight"], allow_zero=True)
  hooks.validate_harness(cfg)
  check_positive(cfg, ["train.sample_tokens"])
  hooks.validate(cfg)
  objectives.validate(cfg)
  prompts = cfg.train.sample_prompts
  if cfg.train.sample_every and (isinstance(prompts, str) or not prompts or
                                 not all(isinstance(p, str) and p for p in prompts)):
    raise ConfigError("train.sample_prompts", f"{prompts!r} is not a non-empty tuple of non-empty strings",
                      "set e.g. --config.train.sample_prompts=\"('ROMEO:', 'JULIET:')\"")
  if not cfg.workdir:
    raise ConfigError("workdir", "is empty", "set --config.workdir=DIR")
  if cfg.dry_run_topology:
    topology.validate(cfg)


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
      holder[name] = paths.resolve(holder[name], key)
  data.resolve(out)
  out.checkpoint.dir = out.checkpoint.dir or paths.join(out.workdir, "checkpoints")
  horizon = out.optim.decay_steps or out.train.steps
  if out.optim.warmup_steps > horizon:
    logging.warning("optim.warmup_steps=%d is longer than the %d-step schedule (optim.decay_steps, default "
                    "train.steps): warming up over all %d steps instead", out.optim.warmup_steps, horizon, horizon)
    out.optim.warmup_steps = horizon
  return out

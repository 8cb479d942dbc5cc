"""Text generation from a checkpoint: KV-cache decoding through the model's own attention, sharded on the mesh.

  python -m jaxtrain.generate --checkpoint=RUN_OR_CHECKPOINT_DIR --prompt="ROMEO:" [--prompt=...]
      [--prompts_file=FILE|FILE.jsonl] [--chat] [--max_new_tokens=64] [--temperature=0 (greedy) --top_k=0 --top_p=1 --seed=0]
      [--step=N] [--set=mesh.data=2 ...] [--tokenizer=FILE] [--format=text|jsonl] [--no_cache] [--slots=N]

``--checkpoint`` is a run's workdir, its checkpoints folder or one step folder (the newest step unless ``--step``).
The params are restored onto the mesh of the run's saved config (``--set mesh.KEY=N`` / ``--config.mesh.KEY=N``
override it, as do ``sharding.*``, ``model.dtype`` and ``model.attention``) through jaxtrain's sharding rules, so a
model too big for one device samples too. Prompts are left-padded into one batch (a multiple of the batch shards):
a jitted prefill runs the whole prompts at once and fills the KV cache (``[layers, batch, max_len, kv_heads,
head_dim]``, logical axes ``(batch, None, kv_heads, head_dim)`` per layer), then one jitted ``lax.while_loop``
decodes one token per step until every row has produced an EOS token or ``max_new_tokens``. Sampling: greedy at
``temperature=0``, else softmax at that temperature restricted to the ``top_k`` most likely tokens and the nucleus
of probability ``top_p``; row r of step i draws with ``fold_in(fold_in(key(seed), i), r)``, so a completion does not
depend on the other prompts of the batch. ``--no_cache`` recomputes the whole forward for every new token (to
measure the cache, and the oracle of the tests). ``--slots=N``: continuous batching
(jaxtrain.sampling.ContinuousGenerator): N rows decode the prompts as a queue, a row taking the next prompt as soon
as its own completion ends, over a paged KV cache; the same completions, faster when they end at very different
lengths.

Tokenizer: the one the run's lineage carries (its ``hf/`` folder, copied from its parent's at its start, back to an
import: jaxtrain.checkpoint.lineage; ``tokenizer.json`` or ``tokenizer.model`` with ``bos_token_id`` prepended to a
plain prompt, from ``generation_config.json`` or ``config.json``), else the run's ``data.tokenizer``, else the
data's (byte-level for the bundled corpus), or ``--tokenizer=FILE``. A row ends at the generation config's EOS ids
and at the tokenizer's own EOS token, the same ids as the GRPO sampler's and the harness's. ``--chat`` renders each
prompt as the user's message with the tokenizer's chat template and its generation prompt; a ``.jsonl``
``--prompts_file`` holds ``{"prompt": ...}`` records (a prompt may hold newlines) or ``{"messages": [...]}``
conversations. Completions go to stdout, one line per prompt in the order given (the ``--prompt`` ones, then
the file's; newlines written as ``\\n``; ``--format=jsonl`` writes JSON objects). A mistake (no checkpoint, an empty
prompt, a bad flag value) prints one line ``generate: error: ...`` and exits 2.

The generation engine and the tokenizer lookup are jaxtrain.sampling (which training samples use too); this
module finds the checkpoint, restores its params onto a mesh and is the command line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import config as config_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain import models
from jaxtrain import paths
from jaxtrain import sharding
from jaxtrain.errors import ConfigError, UserError
from jaxtrain.sampling import (ContinuousGenerator, GenerateError, Generator, Sampling, encode_prompts,
                               padded_rows, tokenizer_for)
from jaxtrain.train.state import TrainState

# Keys of the saved run config that the command line may override (the layout and the compute, not the model).
OVERRIDABLE = ("mesh.", "sharding.", "model.dtype", "model.attention", "model.mla_cache")  # (MLA: its cache kind)


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint and its config.

@dataclasses.dataclass
class Loaded:
  """A checkpoint restored for generation."""
  config: ml_collections.ConfigDict  # the run's saved config (model, mesh, sharding, data) with the overrides
  saved: dict  # the saved config as it was
  step_dir: str
  model: models.Model
  mesh: Any
  rules: Any
  param_shardings: Any
  params: Any


def _coerce(old, new, key: str):
  if isinstance(old, bool):
    if isinstance(new, str) and new.lower() in ("true", "false", "1", "0"):
      return new.lower() in ("true", "1")
    return bool(new)
  try:
    if isinstance(old, int):
      return int(new)
    if isinstance(old, float):
      return float(new)
  except (TypeError, ValueError):
    raise GenerateError(key, f"'{new}' is not {'an integer' if isinstance(old, int) else 'a number'}",
                        "fix the value") from None
  if isinstance(old, tuple):
    return tuple(new)
  return new if isinstance(new, str) or old is None else type(old)(new)


def run_config(saved: dict, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """The groups generation needs (model, mesh, sharding, data, checkpoint) of a run's saved config dict, on top of
  today's defaults, with ``overrides`` (``KEY=VALUE`` for the keys in :data:`OVERRIDABLE`) applied."""
  name = (saved.get("model") or {}).get("name", "llama")
  if name not in models.names():
    raise GenerateError("model.name", f"the checkpoint's model '{name}' is not a registered family",
                        f"use one of {', '.join(models.names())} (or import the module that registers it)")
  config = config_lib.base_config(name)

  def merge(cfg, values: dict, prefix: str):
    for k, v in values.items():
      if k not in cfg:
        continue  # a key of another jaxtrain version
      if isinstance(cfg[k], ml_collections.ConfigDict):
        merge(cfg[k], v or {}, f"{prefix}{k}.")
      else:
        cfg[k] = _coerce(cfg[k], v, f"{prefix}{k}")

  for group in ("model", "mesh", "sharding", "data", "checkpoint"):
    merge(config[group], saved.get(group) or {}, f"{group}.")
  config.workdir = saved.get("workdir") or config.workdir
  for item in overrides:
    key, eq, value = item.partition("=")
    key = key.strip().removeprefix("--").removeprefix("config.")
    if not eq:
      raise GenerateError("--set", f"'{item}' is not KEY=VALUE", "write e.g. --set=mesh.data=2")
    if not key.startswith(OVERRIDABLE):
      raise GenerateError(key, "cannot be overridden for generation", f"override only {', '.join(OVERRIDABLE)}")
    group, _, name = key.partition(".")
    if name not in config[group]:
      raise config_lib.unknown_key_error(key, config)
    config[group][name] = _coerce(config[group][name], value, key)
  return config


def find(checkpoint: str, step: int | None = None) -> tuple[str, dict]:
  """The step folder of ``checkpoint`` (the newest step unless ``step``) and its run's saved config: nothing is
  restored."""
  checkpoint = paths.resolve(checkpoint, "--checkpoint")
  if not epath.Path(checkpoint).exists():
    raise GenerateError(checkpoint, "does not exist", "pass --checkpoint=a run's workdir, its checkpoints folder "
                        "or a step folder")
  step_dir = checkpoint_lib.step_dir(checkpoint, step)
  return step_dir, checkpoint_lib.saved_config(step_dir)


def load(checkpoint: str, step: int | None = None, overrides: Sequence[str] = (), devices=None) -> Loaded:
  """Restores the params of ``checkpoint`` (a workdir, its checkpoints folder or a step folder) onto the mesh of
  its run's config (with ``overrides``), through the sharding rules."""
  step_dir, saved = find(checkpoint, step)
  config = run_config(saved, overrides)
  models.validate(config)
  rules = sharding.rules_from_config(config.sharding)
  model = models.Model.from_config(config.model)
  try:
    mesh = mesh_lib.make_mesh(config.mesh, devices)
    sharding.check_shardable(model.abstract_params, model.logical_specs, mesh, rules,
                             lambda axis: models.axis_key(config.model.name, axis))
  except ConfigError as e:  # the run's mesh on these devices
    raise GenerateError(e.subject, e.problem, f"{e.fix} (the mesh is the run's saved one: override it with "
                        "--config.mesh.KEY=N)") from None
  param_shardings = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model.abstract_params,
                          param_shardings)
  target = TrainState(step=jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P())), params=abstract,
                      opt_state={})
  restored, _ = checkpoint_lib.restore_from(step_dir, target, params_only=True)
  return Loaded(config, saved, step_dir, model, mesh, rules, param_shardings, restored["params"])


# ---------------------------------------------------------------------------------------------------------------
# The command line.

def _define_flags():
  flags.DEFINE_string("checkpoint", None, "A run's workdir, its checkpoints folder or one step folder.")
  flags.DEFINE_integer("step", None, "The step to load (default: the newest).")
  flags.DEFINE_multi_string("prompt", [], "A prompt (repeatable).")
  flags.DEFINE_string("prompts_file", None, "A file of prompts after the --prompt ones: *.jsonl, one JSON object "
                      "per line ({\"prompt\": TEXT} or {\"messages\": [{\"role\", \"content\"}, ...]}: prompts with "
                      "newlines, conversations); any other file, one prompt per line (blank lines skipped).")
  flags.DEFINE_bool("chat", False, "Render each prompt with the tokenizer's chat template (a prompt is the user's "
                    "message; a JSONL record's messages are the conversation), with the generation prompt.")
  flags.DEFINE_integer("max_new_tokens", 64, "New tokens per prompt (at most; a row ends at an EOS token).")
  flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
  flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: all).")
  flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: the smallest set of tokens of this probability (1: all).")
  flags.DEFINE_integer("seed", 0, "Random seed of the sampling.")
  flags.DEFINE_multi_string("set", [], "KEY=VALUE override of the run's config: mesh.*, sharding.*, model.dtype, "
                            "model.attention (also accepted as --config.KEY=VALUE).")
  flags.DEFINE_string("tokenizer", "", "A tokenizer file to use instead of the run's.")
  flags.DEFINE_enum("format", "text", ["text", "jsonl"], "text: one line per prompt (newlines as \\n); jsonl: "
                    "one JSON object per prompt.")
  flags.DEFINE_bool("no_cache", False, "Recompute the whole forward for every token (no KV cache).")
  flags.DEFINE_integer("slots", 0, "Continuous batching: this many rows decode the prompts as a queue (a finished "
                       "row takes the next prompt at once) over a paged KV cache; rounded up to a multiple of the "
                       "batch shards. 0: one static batch of all prompts.")
  return flags.FLAGS


def fail(tool: str, message: str) -> None:
  """A user mistake in a checkpoint tool's command line (``tool``: its name): one line, exit code 2."""
  print(f"{tool}: error: {message}", file=sys.stderr)
  sys.exit(2)


def _fail(message: str) -> None:
  fail("generate", message)


def parse_flags(tool: str, FLAGS, argv: list[str], positional_hint: str = "") -> list[str]:
  """``FLAGS(argv)`` for a checkpoint tool (this one, jaxtrain.evaluate), ``--config.KEY=VALUE`` read as
  ``--set=KEY=VALUE``; an unknown flag, a value of the wrong type or a positional argument is one line, exit 2."""
  argv = [argv[0]] + [f"--set={a[len('--config.'):]}" if a.startswith("--config.") else a for a in argv[1:]]
  try:
    rest = FLAGS(argv)
  except Exception as e:  # absl: unknown flag, a value of the wrong type
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    fail(tool, lines[0] if lines else type(e).__name__)
  if len(rest) > 1:
    fail(tool, f"unexpected argument {rest[1]!r}{positional_hint}")
  return rest


def _parse(argv: list[str]) -> list[str]:
  FLAGS = _define_flags()
  rest = parse_flags("generate", FLAGS, argv, "; pass prompts as --prompt=TEXT")
  if not FLAGS.checkpoint:
    _fail("--checkpoint: is required; pass a run's workdir, its checkpoints folder or a step folder")
  if FLAGS.max_new_tokens < 1:
    _fail(f"--max_new_tokens: must be > 0, got {FLAGS.max_new_tokens}; fix the value")
  if FLAGS.slots < 0:
    _fail(f"--slots: must be >= 0, got {FLAGS.slots}; use 0 for one static batch")
  if FLAGS.slots and FLAGS.no_cache:
    _fail("--slots: continuous batching decodes with the KV cache; drop --no_cache or --slots")
  return rest


def _prompts(FLAGS) -> list[str | list[dict]]:
  """The prompts: texts, and conversations (lists of messages) from a JSONL file's ``messages`` records."""
  prompts: list[str | list[dict]] = list(FLAGS.prompt)
  if FLAGS.prompts_file:
    path = paths.resolve(FLAGS.prompts_file)
    try:
      text = epath.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
      raise GenerateError(FLAGS.prompts_file, f"cannot be read ({e.__class__.__name__}: "
                          f"{getattr(e, 'strerror', None) or e})", "pass a UTF-8 text file, one prompt per line, or "
                          "a .jsonl file of {\"prompt\": TEXT} records")
    if not path.endswith(".jsonl"):
      return prompts + [line for line in text.splitlines() if line.strip()]
    for n, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError as e:
        raise GenerateError(f"{FLAGS.prompts_file}:{n}", f"is not JSON ({e})", "write one JSON object per line")
      if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        prompts.append(record["prompt"])
      elif isinstance(record, dict) and isinstance(record.get("messages"), list) and all(
          isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
          for m in record["messages"]) and record["messages"]:
        prompts.append(record["messages"])
      else:
        got = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise GenerateError(f"{FLAGS.prompts_file}:{n}", f"has no 'prompt' text nor 'messages' list (it has {got})",
                            "write {\"prompt\": TEXT} or {\"messages\": [{\"role\": ..., \"content\": ...}]}")
  return prompts


def encode(tok, prompts: list[str | list[dict]], chat: bool, vocab_size: int) -> list[list[int]]:
  """The prompts' ids: plain texts as the tokenizer encodes them, or (``chat``, and every conversation) rendered by
  the chat template with the generation prompt."""
  if not chat and any(not isinstance(p, str) for p in prompts):
    raise GenerateError("--prompts_file", "holds conversations ('messages' records)", "pass --chat to render them "
                        "with the chat template")
  if not chat:
    return encode_prompts(tok, prompts, vocab_size)
  out = []
  for i, p in enumerate(prompts):
    messages = [{"role": "user", "content": p}] if isinstance(p, str) else p
    if not any(m["content"] for m in messages):
      raise GenerateError(f"prompt {i + 1}", "is empty", "give every prompt some text")
    ids = tok.encode_chat(messages)
    if max(ids) >= vocab_size:
      raise GenerateError(f"prompt {i + 1}", f"has token id {max(ids)}, outside the model's vocab_size "
                          f"{vocab_size}", f"use the tokenizer the model was trained with (this is {tok.where})")
    out.append(ids)
  return out


def main(argv: list[str]) -> None:
  FLAGS = flags.FLAGS
  del argv
  try:
    sampling = Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p).check()
    prompts = _prompts(FLAGS)
    if not prompts:
      raise GenerateError("--prompt", "no prompt given", "pass --prompt=TEXT or --prompts_file=FILE")
    loaded = load(FLAGS.checkpoint, FLAGS.step, FLAGS.set)
    tok = tokenizer_for(loaded.config, loaded.saved, loaded.step_dir, FLAGS.tokenizer)
    ids = encode(tok, prompts, FLAGS.chat, loaded.config.model.vocab_size)
    with jax.set_mesh(loaded.mesh):
      common = dict(prompt_len=max(map(len, ids)), max_new_tokens=FLAGS.max_new_tokens, sampling=sampling,
                    eos_ids=tok.eos_ids)
      if FLAGS.slots:
        gen = ContinuousGenerator(loaded.model, loaded.mesh, loaded.rules, loaded.param_shardings,
                                  requests=len(ids), slots=padded_rows(FLAGS.slots, loaded.mesh, loaded.rules),
                                  **common)
      else:
        gen = Generator(loaded.model, loaded.mesh, loaded.rules, loaded.param_shardings,
                        rows=padded_rows(len(ids), loaded.mesh, loaded.rules), use_cache=not FLAGS.no_cache, **common)
      batch = gen.batch(ids)
      t = time.perf_counter()
      result = jax.block_until_ready(gen(loaded.params, batch, FLAGS.seed))
      seconds = time.perf_counter() - t
  except (UserError, ConfigError) as e:
    _fail(str(e))
  completions = gen.completions(result, batch)
  new = sum(len(c) for c in completions)
  logging.info("%s: %d prompt(s), %d new tokens in %.2fs (%.1f tokens/s; compiled in %.1fs; mesh %s; %s "
               "tokenizer; %s)", loaded.step_dir, len(prompts), new, seconds, new / max(seconds, 1e-9),
               gen.compile_s, dict(loaded.mesh.shape), tok.where,
               "no cache" if FLAGS.no_cache else f"{gen.slots} slots, paged KV cache" if FLAGS.slots else "KV cache")
  for prompt, c in zip(prompts, completions):
    text = tok.decode(c)
    if FLAGS.format == "jsonl":
      key = "prompt" if isinstance(prompt, str) else "messages"
      print(json.dumps({key: prompt, "completion": text, "tokens": len(c)}, ensure_ascii=False))
    else:
      print(text.replace("\\", "\\\\").replace("\n", "\\n"))
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main, flags_parser=_parse)

"""Benchmark scores of a checkpoint with EleutherAI's lm-evaluation-harness, on the mesh.

  python -m jaxtrain.evaluate --checkpoint=RUN_OR_IMPORT --tasks=hellaswag,arc_easy [--include_path=TASK_DIR]
      [--num_fewshot=N] [--limit=N] [--output=results.json] [--step=N] [--batch_size=8] [--max_length=N]
      [--max_gen_toks=256] [--apply_chat_template] [--tokenizer=FILE] [--set=mesh.data=2 ...]

``--checkpoint`` is what jaxtrain.generate takes: a run's workdir, its checkpoints folder, a step folder, or an
import (``tools/convert_hf.py import``), restored onto the run's mesh (``--set mesh.KEY=N`` overrides it). The
harness's own evaluator (``lm_eval.simple_evaluate``: its task definitions, prompts, metrics and results format)
runs the tasks on the harness model ``jaxtrain`` (jaxtrain.evaluation.harness.JaxtrainLM, registered here, so
``lm_eval.simple_evaluate(model="jaxtrain", model_args="checkpoint=...")`` works after ``import jaxtrain.evaluate``).
The scores are printed as the harness's table; ``--output`` writes its results JSON. Tasks whose data is on the
Hugging Face hub need the network; a task YAML with local files (``--include_path``) works offline.

``--max_length`` (tokens per row) defaults to the imported model's ``max_position_embeddings`` (what the harness's
``hf`` model uses), else the run's ``data.seq_len``. A mistake (an unknown task, a task YAML the harness cannot read
or build, a template that names a field the task's data lacks, a checkpoint without a tokenizer, a task whose data
cannot be had offline, a bad flag) prints one line ``evaluate: error: ...`` and exits 2, writing nothing; the
tasks are built (their data loaded, their templates tried) before the params are loaded.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import jax
from absl import app, flags, logging
from lm_eval.api.registry import register_model  # the eval extra: pip install 'jaxtrain[eval]'

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import generate
from jaxtrain import paths
from jaxtrain.errors import ConfigError, UserError
from jaxtrain.evaluation import harness


def default_max_length(loaded: generate.Loaded) -> int:
  """An import's ``max_position_embeddings`` (its hf/config.json), else the run's ``data.seq_len``."""
  side = checkpoint_lib.side_files_dir(loaded.step_dir, loaded.saved)
  if side:
    try:
      value = json.loads(open(os.path.join(side, "config.json")).read()).get("max_position_embeddings")
      if value:
        return int(value)
    except (OSError, ValueError):
      pass
  return int(loaded.config.data.seq_len)


@register_model("jaxtrain")
class CheckpointLM(harness.JaxtrainLM):
  """The harness model ``jaxtrain`` on a checkpoint: ``checkpoint`` (see the module docstring), ``step``,
  ``overrides`` (``KEY=VALUE`` of mesh.*, sharding.*, model.dtype, model.attention, or ';'-separated in one
  string), ``tokenizer`` (a file or folder instead of the checkpoint's)."""

  def __init__(self, checkpoint: str, step: int | None = None, overrides=(), tokenizer: str = "",
               batch_size: int | str | None = 8, max_length: int | None = None, max_gen_toks: int = 256, **unused):
    if unused:
      logging.warning("jaxtrain model: ignoring the arguments %s", ", ".join(sorted(unused)))
    if isinstance(overrides, str):
      overrides = [o for o in overrides.split(";") if o]
    loaded = generate.load(checkpoint, None if step in (None, "") else int(step), overrides)
    text = harness.text_of(loaded.config, loaded.saved, loaded.step_dir, paths.resolve(tokenizer) if tokenizer
                           else "")
    batch = int(batch_size) if str(batch_size or "").isdigit() else 8  # the harness's "auto": our default
    self.loaded = loaded
    super().__init__(loaded.model, loaded.mesh, loaded.rules, loaded.param_shardings, text, loaded.params,
                     batch_size=batch, max_length=int(max_length or default_max_length(loaded)),
                     max_gen_toks=int(max_gen_toks))


# ---------------------------------------------------------------------------------------------------------------
# The command line.

def _define_flags():
  flags.DEFINE_string("checkpoint", None, "A run's workdir, its checkpoints folder, a step folder, or an import.")
  flags.DEFINE_integer("step", None, "The step to load (default: the newest).")
  flags.DEFINE_string("tasks", None, "Comma-separated harness task names (or groups).")
  flags.DEFINE_multi_string("include_path", [], "A folder of task YAMLs to add to the harness's (repeatable).")
  flags.DEFINE_integer("num_fewshot", None, "Few-shot examples per request (default: the task's).")
  flags.DEFINE_float("limit", None, "At most this many documents per task (a fraction < 1: that share of them).")
  flags.DEFINE_string("output", "", "Write the harness's results JSON here.")
  flags.DEFINE_integer("batch_size", 8, "Rows per program (rounded up to a multiple of the mesh's batch shards).")
  flags.DEFINE_integer("max_length", None, "Tokens per row at most (default: see the module docstring).")
  flags.DEFINE_integer("max_gen_toks", 256, "New tokens of a generation task that does not say.")
  flags.DEFINE_bool("apply_chat_template", False, "Render the requests with the tokenizer's chat template.")
  flags.DEFINE_bool("fewshot_as_multiturn", False, "With the chat template: few-shot examples as turns.")
  flags.DEFINE_string("tokenizer", "", "A tokenizer file or folder instead of the checkpoint's.")
  flags.DEFINE_integer("seed", 0, "The harness's random seed (few-shot sampling, document order).")
  flags.DEFINE_multi_string("set", [], "KEY=VALUE override of the run's config: mesh.*, sharding.*, model.dtype, "
                            "model.attention (also accepted as --config.KEY=VALUE).")
  return flags.FLAGS


def _fail(message: str) -> None:
  generate.fail("evaluate", message)


def _parse(argv: list[str]) -> list[str]:
  FLAGS = _define_flags()
  rest = generate.parse_flags("evaluate", FLAGS, argv)
  for name in ("checkpoint", "tasks"):
    if not FLAGS[name].value:
      _fail(f"--{name}: is required")
  if FLAGS.limit is not None and FLAGS.limit <= 0:
    _fail(f"--limit: must be > 0, got {FLAGS.limit}; fix the value")
  if FLAGS.output and not os.path.isdir(os.path.dirname(paths.resolve(FLAGS.output))):
    _fail(f"--output: the folder of {FLAGS.output} does not exist; create it or write elsewhere")
  return rest


def main(argv: list[str]) -> None:
  del argv
  FLAGS = flags.FLAGS
  from lm_eval.utils import handle_non_serializable, make_table
  gc.freeze()  # as jaxtrain.main: the imports' objects (torch's among them) out of the collector's walks
  try:
    # The cheap checks first (the checkpoint is there and carries a tokenizer), then the tasks, then the params.
    step_dir, saved = generate.find(FLAGS.checkpoint, FLAGS.step)
    harness.text_of(generate.run_config(saved, FLAGS.set), saved, step_dir,
                    paths.resolve(FLAGS.tokenizer) if FLAGS.tokenizer else "")
    manager = harness.task_manager([paths.resolve(p) for p in FLAGS.include_path], [FLAGS.tasks])
    harness.build_tasks([FLAGS.tasks], manager)  # known, their data there, their templates fit it
    t = time.perf_counter()
    lm = CheckpointLM(FLAGS.checkpoint, FLAGS.step, FLAGS.set, FLAGS.tokenizer, FLAGS.batch_size,
                      FLAGS.max_length, FLAGS.max_gen_toks)
    loaded_s = time.perf_counter() - t
    limit = None if FLAGS.limit is None else (int(FLAGS.limit) if FLAGS.limit >= 1 else FLAGS.limit)
    t = time.perf_counter()
    results = harness.evaluate(lm, [FLAGS.tasks], manager=manager, num_fewshot=FLAGS.num_fewshot, limit=limit,
                               apply_chat_template=FLAGS.apply_chat_template,
                               fewshot_as_multiturn=FLAGS.fewshot_as_multiturn, log_samples=False,
                               random_seed=FLAGS.seed, numpy_random_seed=FLAGS.seed, torch_random_seed=FLAGS.seed,
                               fewshot_random_seed=FLAGS.seed)
  except (UserError, ConfigError) as e:
    _fail(str(e))
  logging.info("%s: loaded in %.1fs, evaluated in %.1fs (%d programs compiled in %.1fs; mesh %s; %s tokenizer)",
               lm.loaded.step_dir, loaded_s, time.perf_counter() - t, lm.compiles, lm.scorer.compile_s,
               dict(lm.mesh.shape), lm.text.where)
  if jax.process_index() != 0:
    return
  print(make_table(results))
  if "groups" in results:
    print(make_table(results, "groups"))
  if FLAGS.output:
    results.pop("samples", None)
    path = paths.resolve(FLAGS.output)
    with open(path + ".tmp", "w") as f:
      json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    os.replace(path + ".tmp", path)
    print(f"results: {path}")
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main, flags_parser=_parse)

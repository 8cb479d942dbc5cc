"""Quantized training on CPU: the loss curve of each ``model.quantization`` recipe against the unquantized run.

  python tools/bench_quantization.py [--config=tiny] [--steps=200] [--recipes=none,int8,fp8] [--dtype=bfloat16]
      [--out=benchmarks/results/quantization.json]

Trains the config from scratch once per recipe (same seed, same batches, 8 simulated devices, ``--dtype`` compute)
and compares every logged step's loss with the first recipe's (the reference): the largest and the mean absolute
difference over all steps and over the last quarter, the final losses, and the step time (XLA:CPU has no int8 or
fp8 matmul units: its times say nothing of a TPU's or GPU's; `tools/bench_tpu.py --set=model.quantization=int8`
gives the TPU compiler's estimate).
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import importlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

from absl import app, flags, logging  # noqa: E402

from jaxtrain.train import trainer  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "tiny", "Config module under configs/.")
_STEPS = flags.DEFINE_integer("steps", 200, "Training steps per recipe.")
_RECIPES = flags.DEFINE_list("recipes", ["none", "int8", "fp8"], "Recipes; the first is the reference.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "model.dtype of every run.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/quantization.json", "Where to write the JSON results.")


def curve(recipe: str, workdir: str) -> tuple[list[float], float]:
  """(the loss at every step, the median step time) of a fresh run."""
  c = importlib.import_module(f"configs.{_CONFIG.value}").get_config()
  c.workdir = workdir
  c.model.update(quantization=recipe, dtype=_DTYPE.value)
  c.train.update(steps=_STEPS.value, log_every=1)
  _, history = trainer.train(c)
  return [h["loss"] for h in history], statistics.median(h["step_time"] for h in history[len(history) // 4:])


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)  # the monitor's warnings (a loaded CPU's slow steps) are not the result
  runs = {}
  for recipe in _RECIPES.value:
    workdir = tempfile.mkdtemp(prefix=f"jaxtrain-bench-quant-{recipe}-")
    try:
      runs[recipe] = curve(recipe, workdir)
    finally:
      shutil.rmtree(workdir, ignore_errors=True)
  reference = runs[_RECIPES.value[0]][0]
  rows = []
  print(f"{_CONFIG.value}, {_STEPS.value} steps, {_DTYPE.value}; differences against '{_RECIPES.value[0]}'")
  print("| recipe | final loss | max abs diff | mean abs diff | mean abs diff, last quarter | step s |")
  print("|---|---|---|---|---|---|")
  for recipe, (losses, step_time) in runs.items():
    diffs = [abs(a - b) for a, b in zip(losses, reference, strict=True)]
    last = diffs[-len(diffs) // 4:]
    row = dict(recipe=recipe, final_loss=losses[-1], max_abs_diff=max(diffs), mean_abs_diff=statistics.mean(diffs),
               mean_abs_diff_last_quarter=statistics.mean(last), step_time_s=step_time, losses=losses)
    rows.append(row)
    print(f"| {recipe} | {losses[-1]:.4f} | {max(diffs):.4f} | {statistics.mean(diffs):.4f} | "
          f"{statistics.mean(last):.4f} | {step_time:.3f} |")
  path = _bench.write_json(_OUT.value, dict(config=_CONFIG.value, steps=_STEPS.value, dtype=_DTYPE.value,
                                            reference=_RECIPES.value[0], results=rows))
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)

"""Optimizers against each other on the same run: one config, data and seed trained with each optimizer at each
learning rate, their loss curves and final eval losses side by side.

  python tools/bench_optimizers.py [--config=configs/tiny.py] [--steps=300] [--optimizers=adamw,muon]
      [--lrs=1e-3,3e-3,1e-2] [--set=key=value ...] [--workdir=/tmp/bench_optimizers]
      [--out=benchmarks/results/optimizers_tiny.json]

Every (optimizer, lr) pair is a fresh run in ``<workdir>/<optimizer>_<lr>`` (a finished one is read back, not run
again), logging every 10 steps and evaluating the held-out split at the end. Prints a table (the mean training loss
of the last 50 steps, the final eval loss, each optimizer's best learning rate marked) and writes JSON with every
curve. Nothing is claimed beyond the runs measured: one config, one seed. On CPU it simulates 8 devices unless
XLA_FLAGS already says otherwise.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import json  # noqa: E402
import os  # noqa: E402

from absl import app, flags, logging  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/tiny.py", "Config file (configs/x.py[:variant]).")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps of each run.")
_OPTIMIZERS = flags.DEFINE_list("optimizers", ["adamw", "muon"], "optim.name of each run.")
_LRS = flags.DEFINE_list("lrs", ["1e-3", "3e-3", "1e-2"], "optim.lr of each run (every optimizer at each).")
_SET = flags.DEFINE_multi_string("set", [], "key=value overrides for every run.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_optimizers", "The runs' workdirs: <workdir>/<name>_<lr>.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/optimizers_tiny.json", "Where to write the JSON results.")


def run_one(name: str, lr: str) -> dict:
  """One run's curve and final eval loss (read back from its metrics.jsonl when it finished before)."""
  from jaxtrain import config as config_lib
  from jaxtrain.train import trainer

  workdir = os.path.join(_WORKDIR.value, f"{name}_{lr}")
  steps = _STEPS.value
  config = config_lib.load_file(_CONFIG.value, [
      *_SET.value, f"optim.name={name}", f"optim.lr={lr}", f"train.steps={steps}", "train.log_every=10",
      f"eval.every_steps={steps}", f"workdir={workdir}", f"checkpoint.every_steps={steps}"])
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(metrics_path) or not any(
      json.loads(line).get("step") == steps and "eval_loss" in json.loads(line) for line in open(metrics_path)):
    trainer.train(config)
  records = [json.loads(line) for line in open(metrics_path)]
  curve = {r["step"]: r["loss"] for r in records if "loss" in r}
  tail = [v for s, v in curve.items() if s > steps - 50]
  return {"optimizer": name, "lr": float(lr), "curve": curve, "final_loss": sum(tail) / len(tail),
          "eval_loss": next(r["eval_loss"] for r in reversed(records) if "eval_loss" in r)}


def main(argv) -> None:
  del argv
  logging.set_verbosity(logging.WARNING)
  runs = [run_one(name, lr) for name in _OPTIMIZERS.value for lr in _LRS.value]
  best = {name: min((r for r in runs if r["optimizer"] == name), key=lambda r: r["eval_loss"])
          for name in _OPTIMIZERS.value}
  print(f"{_CONFIG.value}, {_STEPS.value} steps, overrides {_SET.value or 'none'}")
  print(f"{'optimizer':<10}{'lr':>9}{'train loss (last 50)':>22}{'eval loss':>11}")
  for r in runs:
    mark = "  <- best" if best[r["optimizer"]] is r else ""
    print(f"{r['optimizer']:<10}{r['lr']:>9.0e}{r['final_loss']:>22.4f}{r['eval_loss']:>11.4f}{mark}")
  results = {"config": _CONFIG.value, "steps": _STEPS.value, "overrides": _SET.value, "runs": runs,
             "best": {name: {"lr": r["lr"], "eval_loss": r["eval_loss"]} for name, r in best.items()}}
  print("wrote", _bench.write_json(_OUT.value, results))


if __name__ == "__main__":
  app.run(main)

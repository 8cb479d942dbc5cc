"""The TPU program's numerics against the default program's, on the (simulated) CPU mesh: two training runs of the
same config, data and seed, one traced as for TPU (``jaxtrain.models.attention.compiling_for("tpu")`` around the
whole run: every TPU-only arithmetic path the models and the loss take), and their logged losses compared step by
step.

  python tools/bench_numerics.py [--config=configs/cpu_50m.py] [--steps=300] [--set=key=value ...]
      [--control=key=value ...] [--workdir=/tmp/bench_numerics] [--jobs=1] [--compare_only]
      [--out=benchmarks/results/numerics_cpu_50m.json]

Each run is its own process (``python -m`` this file with ``--program=default`` or ``--program=tpu``), writing
``<workdir>/<program>/metrics.jsonl`` and its log ``<workdir>/<program>.log``; a run interrupted resumes from its
workdir's checkpoint (saved every 50 steps) when the command is given again, and one that finished is read as it
is; ``--compare_only`` runs nothing and compares the steps both runs have logged. The attention
backend is named (``model.attention=xla`` unless ``--set`` names another), so that the TPU-traced run keeps a
CPU backend instead of ``auto``'s splash kernel; the loss is logged every step (``train.log_every=1``). Prints a
table (every ``--every``-th step, and the largest difference) and writes JSON: both loss curves, the relative
difference |tpu - default| / |default| at every logged step, its largest value and whether it is within
``--tolerance``. ``--control``: a third run, the default program with these overrides too (another mesh layout,
say: the same computation, its sums in another order), compared with the default run the same way: the scale of
the differences the default program has with itself, against which the TPU program's are read. On CPU it
simulates 8 devices unless XLA_FLAGS already says otherwise.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from absl import app, flags, logging  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/cpu_50m.py", "Config file (configs/x.py[:variant]).")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps of each run.")
_SET = flags.DEFINE_multi_string("set", [], "key=value overrides for both runs, e.g. model.dtype=bfloat16.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/bench_numerics", "The runs' workdirs: <workdir>/<program>.")
_JOBS = flags.DEFINE_integer("jobs", 1, "Runs at the same time (1: one after the other).")
_TOLERANCE = flags.DEFINE_float("tolerance", 1e-3, "The largest relative loss difference that passes.")
_EVERY = flags.DEFINE_integer("every", 25, "Print every N-th step of the table.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/numerics_cpu_50m.json", "Where to write the JSON results.")
_CONTROL = flags.DEFINE_multi_string("control", [], "Overrides of a third run of the default program (e.g. "
                                     "mesh.data=2): the default's differences with itself.")
_COMPARE_ONLY = flags.DEFINE_bool("compare_only", False, "Run nothing: compare the steps both runs have logged.")
_PROGRAM = flags.DEFINE_enum("program", "", ["", "default", "tpu", "control"],
                             "Internal: run one program's training here.")


def programs() -> tuple[str, ...]:
  return ("default", "tpu", "control") if _CONTROL.value else ("default", "tpu")


def overrides() -> list[str]:
  """Both runs' overrides: ``--set``'s, plus the step count, a per-step log, a checkpoint every 50 steps and a named
  CPU attention backend (each unless ``--set`` gives it)."""
  given = list(_SET.value)
  for key, value in (("model.attention", "xla"), ("checkpoint.every_steps", "50")):
    if not any(o.startswith(key + "=") for o in given):
      given.append(f"{key}={value}")
  return [*given, f"train.steps={_STEPS.value}", "train.log_every=1"]


def train(program: str) -> None:
  """One run, in this process: the config with :func:`overrides`, traced for ``program``."""
  from jaxtrain import config as config_lib
  from jaxtrain.models import attention
  from jaxtrain.train import trainer
  config = config_lib.load_file(_CONFIG.value, overrides() + (list(_CONTROL.value) if program == "control" else []))
  config.workdir = os.path.join(_WORKDIR.value, program)
  with attention.compiling_for("tpu") if program == "tpu" else contextlib.nullcontext():
    trainer.train(config)


def command(program: str) -> list[str]:
  return [sys.executable, os.path.abspath(__file__), f"--program={program}", f"--config={_CONFIG.value}",
          f"--steps={_STEPS.value}", f"--workdir={_WORKDIR.value}", *[f"--set={o}" for o in _SET.value],
          *[f"--control={o}" for o in _CONTROL.value]]


def losses(program: str) -> dict[int, float]:
  """``{step: logged loss}`` from the run's metrics.jsonl (a step logged twice, across a resume: the last)."""
  path = os.path.join(_WORKDIR.value, program, "metrics.jsonl")
  found = {}
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:  # a line cut by a kill
        continue
      if "loss" in record:
        found[int(record["step"])] = float(record["loss"])
  return found


def main(argv):
  del argv
  if _PROGRAM.value:
    train(_PROGRAM.value)
    return
  logging.set_verbosity(logging.WARNING)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  running = []
  for program in () if _COMPARE_ONLY.value else programs():  # at most --jobs at a time
    log = open(os.path.join(_WORKDIR.value, f"{program}.log"), "a")
    running.append((program, subprocess.Popen(command(program), stdout=log, stderr=subprocess.STDOUT, env=env)))
    while len([p for _, p in running if p.poll() is None]) >= _JOBS.value:
      next(p for _, p in running if p.poll() is None).wait()
  for program, process in running:
    if process.wait():
      sys.exit(f"bench_numerics: the {program} run failed (exit {process.returncode}); see "
               f"{os.path.join(_WORKDIR.value, program + '.log')}")
  curves = {p: losses(p) for p in programs()}
  steps = sorted(set.intersection(*(set(c) for c in curves.values())))
  if len(steps) < _STEPS.value and not _COMPARE_ONLY.value:
    sys.exit(f"bench_numerics: only {len(steps)} of {_STEPS.value} steps were logged by every run")
  others = [p for p in programs() if p != "default"]
  relative = {p: {s: abs(curves[p][s] - curves["default"][s]) / abs(curves["default"][s]) for s in steps}
              for p in others}
  worst = {p: max(steps, key=relative[p].get) for p in others}
  print(f"{'step':>5} {'default loss':>13}" + "".join(f" {p + ' loss':>13} {'rel. diff':>10}" for p in others))
  for s in steps:
    if s % _EVERY.value == 0 or s == steps[0] or s in worst.values():
      print(f"{s:>5} {curves['default'][s]:>13.6f}" +
            "".join(f" {curves[p][s]:>13.6f} {relative[p][s]:>10.2e}" for p in others))
  results = {}
  for p in others:
    first = next((s for s in steps if curves[p][s] != curves["default"][s]), None)
    results[p] = {"max_rel_diff": relative[p][worst[p]], "at_step": worst[p],
                  "mean_rel_diff": sum(relative[p].values()) / len(steps), "first_different_step": first,
                  "rel_diff": [relative[p][s] for s in steps]}
    print(f"{p}: largest relative difference {relative[p][worst[p]]:.3e} at step {worst[p]}; "
          f"{'bitwise the default throughout' if first is None else f'bitwise the default up to step {first - 1}'}")
  passed = results["tpu"]["max_rel_diff"] <= _TOLERANCE.value
  print(f"tpu: {'within' if passed else 'ABOVE'} {_TOLERANCE.value:g}")
  summary = {
      "config": _CONFIG.value, "overrides": overrides(), "control_overrides": list(_CONTROL.value),
      "steps": len(steps),
      "compared": "the logged loss (metrics.jsonl) of each step: the TPU program (compiling_for('tpu')) against "
                  "the default program, same config, data and seed" +
                  ("; and the default program with the control overrides against it" if _CONTROL.value else ""),
      "tolerance": _TOLERANCE.value, "passed": passed, **results["tpu"],
      **({"control": results["control"]} if _CONTROL.value else {}),
      "commands": {p: " ".join(command(p)[1:]) for p in programs()},
      "loss": {p: [curves[p][s] for s in steps] for p in programs()}}
  print(f"wrote {_bench.write_json(_OUT.value, summary)}")
  if not passed:
    sys.exit(1)

if __name__ == "__main__":
  app.run(main)

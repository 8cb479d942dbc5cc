"""Core benchmark on the (simulated) device mesh: framework overhead, FSDP memory, throughput.

  python tools/bench_core.py [--configs=tiny,cpu_50m] [--steps=20] [--out=benchmarks/results/core.json]
  python tools/bench_core.py --mode=loop [--rounds=2] [--out=benchmarks/results/loop.json]

1. Overhead: jaxtrain's compiled step vs a minimal hand-written jitted step (same model, optimizer, mesh,
   shardings, batch), alternated step by step in one process; median step-time ratio.
2. Memory with fsdp=8: per-device bytes of params + optimizer state (array shard sizes and the compiled
   step's argument bytes from memory_analysis()) against total / 8.
3. Tokens/s and compile time per config.
Prints a table and writes JSON. On CPU it simulates 8 devices unless XLA_FLAGS already says otherwise.

``--mode=loop`` times whole runs instead, each in its own process, alternated over ``--rounds``: ``python -m
jaxtrain.main`` (tiny grown to 4 layers x d_model 256, 8 heads x 32, mlp 1024, seq 256, batch 16, fsdp 8, fp32,
remat full, 30 steps, log_every=1, the bundled corpus; the median logged ``step_time`` of steps 5-30) against
a bare loop of the same model, optimizer and batches (``next(data)`` -> global arrays -> the hand-written step
above; the loss of step N-1 read after step N is dispatched; the same median), and against the bare loop on one
fixed batch (no data loading at all).
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxtrain import data as data_lib  # noqa: E402
from jaxtrain import sharding  # noqa: E402
from jaxtrain.data.synthetic import SyntheticSource  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_CONFIGS = flags.DEFINE_list("configs", ["tiny", "cpu_50m"], "Config modules under configs/.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps per config (each side, for the overhead test).")
_BATCH = flags.DEFINE_integer("batch", 16, "Global batch size.")
_OUT = flags.DEFINE_string("out", "", "Where to write the JSON results (default benchmarks/results/core.json, "
                           "with --mode=loop loop.json).")
_MODE = flags.DEFINE_enum("mode", "step", ["step", "loop", "bare"], "step: compiled steps in one process. loop: "
                          "whole runs (main against bare loops), each in a process. bare: one bare loop (internal).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "--mode=loop: alternated rounds.")
_BARE_DATA = flags.DEFINE_enum("bare_data", "loader", ["loader", "fixed"], "--mode=bare: the batches.")

# The whole-run workload (--mode=loop): configs/tiny.py with these overrides.
LOOP_OVERRIDES = ("model.d_model=256", "model.num_heads=8", "model.head_dim=32", "model.mlp_dim=1024",
                  "model.remat=full", "data.seq_len=256", "train.steps=30", "train.log_every=1",
                  "train.global_batch_size=16", "mesh.fsdp=8")
LOOP_FIRST = 5  # steps LOOP_FIRST..30 are timed


def handwritten_step(run):
  """The same model and optimizer in the plainest jitted JAX: no TrainState, no metrics, no accumulation."""
  model, tx = run.model, run.tx
  sh = run.state_shardings

  def step(params, opt_state, batch):
    def loss(p):
      logits = model.apply(p, batch["inputs"], batch["positions"], batch["segment_ids"])
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
      return (ce * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, in_shardings=(sh.params, sh.opt_state, run.batch_sharding),
                 out_shardings=(sh.params, sh.opt_state, None), donate_argnums=(0, 1))


def timed(fn, *args):
  t = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t


def bench_config(name: str) -> dict:
  config = importlib.import_module(f"configs.{name}").get_config()
  config.train.global_batch_size = _BATCH.value
  config.mesh.update(data=1, fsdp=-1, tensor=1)
  run = trainer.build(config)
  (step_fn, compile_s) = timed(trainer.compile_step, run)
  (state, init_s) = timed(trainer.init_state, run)
  source = SyntheticSource(config.data.seq_len, config.model.vocab_size, config.train.global_batch_size, 0)
  batch = data_lib.to_global(next(source), run.batch_sharding)

  no_skip = np.bool_(False)
  hand = handwritten_step(run)
  with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
    hand = hand.lower(state.params, state.opt_state, batch).compile()
  hand_params = jax.tree.map(lambda x: x.copy(), state.params)
  hand_opt = jax.tree.map(lambda x: x.copy(), state.opt_state)

  for _ in range(2):  # warm-up both
    (state, _), _ = timed(step_fn, state, batch, no_skip)
    (hand_params, hand_opt, _), _ = timed(hand, hand_params, hand_opt, batch)
  ours, theirs = [], []
  for _ in range(_STEPS.value):
    (state, _), t = timed(step_fn, state, batch, no_skip)
    ours.append(t)
    (hand_params, hand_opt, _), t = timed(hand, hand_params, hand_opt, batch)
    theirs.append(t)

  info = trainer.report(run)
  mem = step_fn.memory_analysis()
  n = jax.device_count()
  tokens = config.train.global_batch_size * config.data.seq_len
  state_bytes_total = info["param_bytes_total"] + info["opt_bytes_total"]
  state_bytes_device = info["param_bytes_per_device"] + info["opt_bytes_per_device"]
  return {
      "config": name, "params": info["params"], "devices": n, "mesh": dict(run.mesh.shape),
      "global_batch": config.train.global_batch_size, "seq_len": config.data.seq_len,
      "compile_step_s": compile_s, "compile_init_s": init_s,
      "step_s_median": statistics.median(ours), "handwritten_step_s_median": statistics.median(theirs),
      "overhead_ratio": statistics.median(ours) / statistics.median(theirs),
      "tokens_per_sec": tokens / statistics.median(ours),
      "state_bytes_total": state_bytes_total, "state_bytes_per_device": state_bytes_device,
      "state_ratio_vs_ideal": state_bytes_device / (state_bytes_total / n),
      "compiled_argument_bytes_per_device": getattr(mem, "argument_size_in_bytes", None),
      "compiled_temp_bytes_per_device": getattr(mem, "temp_size_in_bytes", None),
  }


def _loop_config(workdir: str):
  from jaxtrain.config import resolve
  config = importlib.import_module("configs.tiny").get_config()
  for item in LOOP_OVERRIDES + (f"workdir={workdir}",):
    key, value = item.split("=")
    group, _, name = key.rpartition(".")
    holder = config[group] if group else config
    holder[name] = type(holder[name])(value)
  return resolve(config)


def bare_loop(data: str) -> list[float]:
  """The bare loop's step times: ``next(data)`` (or one fixed batch) -> global arrays -> the hand-written step,
  the previous step's loss read after each dispatch."""
  run = trainer.build(_loop_config(tempfile.mkdtemp(prefix="bare_loop_")))
  state = trainer.init_state(run)
  params, opt_state = state.params, state.opt_state
  stream = data_lib.open_train(run.config)
  fixed = data_lib.to_global(next(stream), run.batch_sharding)
  with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
    hand = handwritten_step(run).lower(params, opt_state, fixed).compile()
  times, previous, t = [], None, time.perf_counter()
  for _ in range(run.config.train.steps):
    batch = fixed if data == "fixed" else data_lib.to_global(next(stream), run.batch_sharding)
    params, opt_state, loss = hand(params, opt_state, batch)
    if previous is not None:
      float(previous)
    now = time.perf_counter()
    times.append(now - t)
    previous, t = loss, now
  float(previous)
  data_lib.close(stream)
  return times


def _median_steps(times: list[float]) -> float:
  return statistics.median(times[LOOP_FIRST - 1:])


def run_main(workdir: str) -> float:
  args = [f"--config.{o}" for o in LOOP_OVERRIDES]
  r = subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config=configs/tiny.py", *args,
                      f"--config.workdir={workdir}"], cwd=_ROOT, capture_output=True, text=True)
  if r.returncode:
    raise RuntimeError(r.stderr[-3000:])
  records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return _median_steps([r["step_time"] for r in records if "step_time" in r])


def run_bare(data: str) -> float:
  r = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode=bare", f"--bare_data={data}"], cwd=_ROOT,
                     capture_output=True, text=True)
  if r.returncode:
    raise RuntimeError(r.stderr[-3000:])
  return _median_steps(json.loads(r.stdout.strip().splitlines()[-1]))


_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main_loop() -> None:
  rounds = []
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(_ROUNDS.value):
      kinds = ("main", "bare", "bare_fixed") if i % 2 == 0 else ("bare_fixed", "bare", "main")
      times = {}
      for kind in kinds:
        times[kind] = (run_main(os.path.join(tmp, f"run{i}")) if kind == "main" else
                       run_bare("fixed" if kind == "bare_fixed" else "loader"))
      rounds.append(times)
  header = f"{'round':<7}{'main ms':>9}{'bare ms':>9}{'bare, fixed batch ms':>22}{'main / bare':>13}{'main / fixed':>14}"
  print(header)
  print("-" * len(header))
  for i, t in enumerate(rounds):
    print(f"{i:<7}{1e3 * t['main']:>9.1f}{1e3 * t['bare']:>9.1f}{1e3 * t['bare_fixed']:>22.1f}"
          f"{t['main'] / t['bare']:>13.3f}{t['main'] / t['bare_fixed']:>14.3f}")
  ratio = statistics.median(t["main"] / t["bare"] for t in rounds)
  fixed = statistics.median(t["main"] / t["bare_fixed"] for t in rounds)
  print(f"median over rounds: main / bare loop {ratio:.3f}, main / bare loop on a fixed batch {fixed:.3f}")
  out = _OUT.value or "benchmarks/results/loop.json"
  print(f"wrote {_bench.write_json(out, {'workload': list(LOOP_OVERRIDES), 'rounds': rounds, 'main_vs_bare': ratio, 'main_vs_bare_fixed': fixed})}")


def main(argv):
  del argv
  if _MODE.value == "bare":
    print(json.dumps(bare_loop(_BARE_DATA.value)))
    return
  if _MODE.value == "loop":
    return main_loop()
  results = [bench_config(name) for name in _CONFIGS.value]
  mib = 2**20
  header = (f"{'config':<10}{'params':>12}{'compile s':>11}{'step ms':>10}{'hand ms':>10}{'ratio':>8}"
            f"{'tok/s':>10}{'state MiB/dev':>15}{'ideal x':>9}{'args MiB/dev':>14}")
  print(header)
  print("-" * len(header))
  for r in results:
    print(f"{r['config']:<10}{r['params']:>12,}{r['compile_step_s'] + r['compile_init_s']:>11.1f}"
          f"{1e3 * r['step_s_median']:>10.1f}{1e3 * r['handwritten_step_s_median']:>10.1f}"
          f"{r['overhead_ratio']:>8.3f}{r['tokens_per_sec']:>10,.0f}{r['state_bytes_per_device'] / mib:>15.2f}"
          f"{r['state_ratio_vs_ideal']:>9.3f}{(r['compiled_argument_bytes_per_device'] or 0) / mib:>14.2f}")
  print(f"wrote {_bench.write_json(_OUT.value or 'benchmarks/results/core.json', {'results': results})}")


if __name__ == "__main__":
  app.run(main)

"""Core benchmark on the (simulated) device mesh: framework overhead, FSDP memory, throughput.

  python tools/bench_core.py [--configs=tiny,cpu_50m] [--steps=20] [--out=benchmarks/results/core.json]

1. Overhead: jaxtrain's compiled step vs a minimal hand-written jitted step (same model, optimizer, mesh,
   shardings, batch), alternated step by step in one process; median step-time ratio.
2. Memory with fsdp=8: per-device bytes of params + optimizer state (array shard sizes and the compiled
   step's argument bytes from memory_analysis()) against total / 8.
3. Tokens/s and compile time per config.
Prints a table and writes JSON. On CPU it simulates 8 devices unless XLA_FLAGS already says otherwise.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import importlib  # noqa: E402
import statistics  # noqa: E402
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
_OUT = flags.DEFINE_string("out", "benchmarks/results/core.json", "Where to write the JSON results.")


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


def main(argv):
  del argv
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
  print(f"wrote {_bench.write_json(_OUT.value, {'results': results})}")


if __name__ == "__main__":
  app.run(main)

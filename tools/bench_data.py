"""Data benchmark: loader throughput vs what the step consumes, and the data stall in the training loop.

  python tools/bench_data.py [--configs=tiny,cpu_50m] [--rounds=8] [--out=benchmarks/results/data.json]

For each config (on the bundled corpus, prepared on first use; 8 simulated CPU devices):
1. Loader alone: tokens/s with 0 and 2 worker processes, against the tokens/s the train step consumes.
2. Stall: pairs of rounds of K steps, one fed by the real pipeline and one by synthetic batches (which goes
   first alternates), through the same compiled step and the trainer's loop body (next batch -> global
   arrays -> step, no per-step sync). Round times on a shared 2-core machine swing by +-30%, so the stall is
   the median over pairs of (real / synthetic) step time; the medians of each kind are reported too.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import importlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxtrain import data as data_lib  # noqa: E402
from jaxtrain.data.synthetic import SyntheticSource  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_CONFIGS = flags.DEFINE_list("configs", ["tiny", "cpu_50m"], "Config modules under configs/.")
_ROUNDS = flags.DEFINE_string("pairs", "tiny=30,cpu_50m=4", "Real / synthetic round pairs, per config.")
_STEPS = flags.DEFINE_string("steps_per_round", "tiny=5,cpu_50m=2", "Steps per round, per config.")
_BATCH = flags.DEFINE_integer("batch", 16, "Global batch size.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/data.json", "Where to write the JSON results.")


def loader_tokens_per_sec(config, workers: int, batches: int = 200) -> float:
  config.data.num_workers = workers
  it = data_lib.open_train(config)
  for _ in range(5):  # start-up (worker processes) is not throughput
    next(it)
  t = time.perf_counter()
  for _ in range(batches):
    next(it)
  elapsed = time.perf_counter() - t
  data_lib.close(it)
  return batches * config.train.global_batch_size * config.data.seq_len / elapsed


def run_round(step_fn, state, source, sharding, steps: int):
  t = time.perf_counter()
  for _ in range(steps):
    state, metrics = step_fn(state, data_lib.to_global(next(source), sharding), np.bool_(False))
  jax.block_until_ready(metrics)
  return state, (time.perf_counter() - t) / steps


def bench(name: str) -> dict:
  config = importlib.import_module(f"configs.{name}").get_config()
  config.train.global_batch_size = _BATCH.value
  config.mesh.update(data=1, fsdp=-1, tensor=1)
  k = int(dict(s.split("=") for s in _STEPS.value.split(",")).get(name, 5))
  pairs = int(dict(s.split("=") for s in _ROUNDS.value.split(",")).get(name, 10))
  loader = {w: loader_tokens_per_sec(config, w) for w in (0, 2)}
  config.data.num_workers = 0

  run = trainer.build(config)
  step_fn = trainer.compile_step(run)
  state = trainer.init_state(run)
  real = data_lib.open_train(config)
  synthetic = SyntheticSource(config.data.seq_len, config.model.vocab_size, config.train.global_batch_size, 0)
  state, _ = run_round(step_fn, state, synthetic, run.batch_sharding, 2)  # warm-up
  times = {"real": [], "synthetic": []}
  for pair in range(pairs):
    order = (("real", real), ("synthetic", synthetic))
    for kind, source in order if pair % 2 == 0 else order[::-1]:
      state, t = run_round(step_fn, state, source, run.batch_sharding, k)
      times[kind].append(t)
  data_lib.close(real)
  step_real, step_syn = statistics.median(times["real"]), statistics.median(times["synthetic"])
  paired = statistics.median(r / s for r, s in zip(times["real"], times["synthetic"]))
  consumed = config.train.global_batch_size * config.data.seq_len / step_syn
  return {"config": name, "global_batch": config.train.global_batch_size, "seq_len": config.data.seq_len,
          "loader_tokens_per_sec_0_workers": loader[0], "loader_tokens_per_sec_2_workers": loader[2],
          "step_consumes_tokens_per_sec": consumed,
          "loader_vs_step_0_workers": loader[0] / consumed, "loader_vs_step_2_workers": loader[2] / consumed,
          "step_s_real_median": step_real, "step_s_synthetic_median": step_syn,
          "stall_ratio": paired, "stall_ratio_of_medians": step_real / step_syn, "pairs": pairs,
          "steps_per_round": k,
          "round_times": times}


def main(argv):
  del argv
  results = [bench(name) for name in _CONFIGS.value]
  header = (f"{'config':<9}{'loader tok/s (0 w)':>20}{'(2 w)':>12}{'step needs tok/s':>18}{'x (0 w)':>9}"
            f"{'x (2 w)':>9}{'step real ms':>14}{'synthetic ms':>14}{'stall':>8}")
  print(header)
  print("-" * len(header))
  for r in results:
    print(f"{r['config']:<9}{r['loader_tokens_per_sec_0_workers']:>20,.0f}"
          f"{r['loader_tokens_per_sec_2_workers']:>12,.0f}{r['step_consumes_tokens_per_sec']:>18,.0f}"
          f"{r['loader_vs_step_0_workers']:>9.1f}{r['loader_vs_step_2_workers']:>9.1f}"
          f"{1e3 * r['step_s_real_median']:>14.1f}{1e3 * r['step_s_synthetic_median']:>14.1f}"
          f"{r['stall_ratio']:>8.3f}")
  print(f"wrote {_bench.write_json(_OUT.value, {'results': results})}")


if __name__ == "__main__":
  app.run(main)

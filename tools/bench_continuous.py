"""Continuous batching against the static batch: tokens/s on completions of varied lengths (jaxtrain/sampling.py).

  python tools/bench_continuous.py [--config=tiny] [--requests=256] [--slots=16] [--prompt_len=16]
      [--min_new=4] [--max_new=64] [--page_size=16] [--pages=0] [--mesh=1,1,1] [--reps=5]
      [--out=benchmarks/results/continuous.json]

The workload: ``--requests`` prompts (random ids, lengths uniform from 4 to ``--prompt_len``) whose completions are
``--min_new`` to ``--max_new`` tokens long, uniformly (each request's budget, drawn with a fixed seed; greedy, no
EOS, so every request produces exactly its budget). The same requests both ways, on random params of
``configs/<--config>.py`` (speed does not depend on their values):

- static: :class:`jaxtrain.sampling.Generator` with ``--slots`` rows, the queue in consecutive batches of that
  many, one after the other; a batch prefills its prompts at once and decodes until its longest completion ends
  (each row stops at its own budget, the batch at its longest).
- continuous: one :class:`jaxtrain.sampling.ContinuousGenerator` of ``--slots`` slots over the whole queue (a
  finished slot takes the next request at once; the paged cache of ``--pages`` pages of ``--page_size`` tokens, 0:
  every slot at its longest).

Tokens/s = the completions' tokens (the sum of the budgets) / wall seconds, prefill included, compile excluded
(median of ``--reps`` runs, the two ways interleaved so that a noisy machine slows both alike). It checks that
both give the same tokens for every request. Also printed: the decode steps (the static batches' loop steps, the
continuous loop's: their ratio is what scheduling alone gains at equal step costs) and the prefills (one per
static batch; one per request, one row a shard, in the continuous loop).
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

from jaxtrain import mesh as mesh_lib  # noqa: E402
from jaxtrain import models  # noqa: E402
from jaxtrain import sampling as sampling_lib  # noqa: E402
from jaxtrain import sharding  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "tiny", "Config module under configs/.")
_REQUESTS = flags.DEFINE_integer("requests", 256, "Queued requests.")
_SLOTS = flags.DEFINE_integer("slots", 16, "Rows decoded together (the static batch's rows, the continuous slots).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Longest prompt (prompts are 4 to this many tokens).")
_MIN_NEW = flags.DEFINE_integer("min_new", 4, "Shortest completion.")
_MAX_NEW = flags.DEFINE_integer("max_new", 64, "Longest completion (both generators' max_new_tokens).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page of the continuous generator's cache.")
_PAGES = flags.DEFINE_integer("pages", 0, "Pages in its pool (0: slots x pages of the longest request).")
_MESH = flags.DEFINE_list("mesh", ["1", "1", "1"], "data,fsdp,tensor sizes.")
_REPS = flags.DEFINE_integer("reps", 5, "Timed runs of each (median), after one warm-up.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the prompts and the budgets.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/continuous.json", "Where to write the JSON results.")


def workload(vocab: int) -> tuple[list[list[int]], list[int]]:
  rng = np.random.default_rng(_SEED.value)
  lengths = rng.integers(min(4, _PROMPT_LEN.value), _PROMPT_LEN.value + 1, _REQUESTS.value)
  prompts = [rng.integers(0, vocab, n).tolist() for n in lengths]
  budgets = rng.integers(_MIN_NEW.value, _MAX_NEW.value + 1, _REQUESTS.value).tolist()
  return prompts, budgets


def main(argv):
  del argv
  config = importlib.import_module(f"configs.{_CONFIG.value}").get_config()
  data, fsdp, tensor = map(int, _MESH.value)
  config.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:data * fsdp * tensor])
  rules = sharding.rules_from_config(config.sharding)
  model = models.Model.from_config(config.model)
  shardings = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0))
  prompts, budgets = workload(config.model.vocab_size)
  slots, n = _SLOTS.value, _MAX_NEW.value
  with jax.set_mesh(mesh):
    static = sampling_lib.Generator(model, mesh, rules, shardings, rows=slots, prompt_len=_PROMPT_LEN.value,
                                    max_new_tokens=n)
    continuous = sampling_lib.ContinuousGenerator(model, mesh, rules, shardings, requests=len(prompts), slots=slots,
                                                  prompt_len=_PROMPT_LEN.value, max_new_tokens=n,
                                                  page_size=_PAGE_SIZE.value, pages=_PAGES.value)
    batches = [static.batch(prompts[i:i + slots], budgets[i:i + slots]) for i in range(0, len(prompts), slots)]
    queue = continuous.batch(prompts, budgets)

    def run_static():
      return jax.block_until_ready([static(params, b) for b in batches])

    def run_continuous():
      return jax.block_until_ready(continuous(params, queue))

    seconds = {"static": [], "continuous": []}
    results = {}
    for rep in range(_REPS.value + 1):  # the first is a warm-up
      for name, fn in (("static", run_static), ("continuous", run_continuous)):
        t = time.perf_counter()
        results[name] = fn()
        if rep:
          seconds[name].append(time.perf_counter() - t)
  static_tokens = np.concatenate([np.asarray(r[0])[:b.count] for r, b in zip(results["static"], batches)])
  static_produced = np.concatenate([np.asarray(r[1])[:b.count] for r, b in zip(results["static"], batches)])
  tokens, produced, stats = (jax.device_get(x) for x in results["continuous"])
  assert (static_produced == budgets).all() and (produced == budgets).all(), (static_produced, produced)
  same = bool((static_tokens == tokens).all())
  static_steps = int(sum(max(b.budgets[:b.count]) for b in batches))  # each batch loops until its longest row ends
  total = int(sum(budgets))
  row = {"config": _CONFIG.value, "params": model.num_params(), "mesh": dict(mesh.shape), "requests": len(prompts),
         "slots": slots, "prompt_len": _PROMPT_LEN.value, "new_tokens": [_MIN_NEW.value, n],
         "completion_tokens": total, "page_size": _PAGE_SIZE.value, "pages": continuous.pages,
         "pages_per_slot": continuous.pages_per_slot, "same_tokens": same}
  for name in ("static", "continuous"):
    median = statistics.median(seconds[name])
    row[name] = {"seconds": median, "all_seconds": seconds[name], "tokens_per_s": total / median}
  row["static"].update(batches=len(batches), decode_steps=static_steps,
                       compile_s=static.compile_s)
  row["continuous"].update(decode_steps=int(stats["steps"]), prefills=int(stats["prefills"]),
                           compile_s=continuous.compile_s)
  row["speedup"] = row["continuous"]["tokens_per_s"] / row["static"]["tokens_per_s"]
  header = f"{'':<11}{'tok/s':>9}{'seconds':>9}{'steps':>7}{'prefills':>10}{'compile s':>11}"
  print(f"{_CONFIG.value} ({row['params']:,} params), mesh {dict(mesh.shape)}: {len(prompts)} requests, {slots} "
        f"slots, prompts 4-{_PROMPT_LEN.value} tokens, completions {_MIN_NEW.value}-{n} tokens ({total} in all)")
  print(header)
  print("-" * len(header))
  for name in ("static", "continuous"):
    r = row[name]
    prefills = r.get("prefills", r.get("batches"))
    print(f"{name:<11}{r['tokens_per_s']:>9,.0f}{r['seconds']:>9.3f}{r['decode_steps']:>7}{prefills:>10}"
          f"{r['compile_s']:>11.1f}")
  row["step_ratio"] = static_steps / row["continuous"]["decode_steps"]
  print(f"speedup {row['speedup']:.2f}x ({row['step_ratio']:.2f}x fewer decode steps); same tokens for every "
        f"request: {same}")
  print(f"wrote {_bench.write_json(_OUT.value, {'results': [row]})}")


if __name__ == "__main__":
  app.run(main)

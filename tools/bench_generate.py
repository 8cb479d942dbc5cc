"""Generation benchmark: decode tokens/s with and without the KV cache (jaxtrain/generate.py).

  python tools/bench_generate.py [--configs=tiny,cpu_50m] [--batch=4] [--lengths=16:32,64:64,128:128]
      [--mesh=1,1,1] [--reps=2] [--out=benchmarks/results/generate.json]

For each config (random params: speed does not depend on their values) and each prompt:new length pair, compiles
the prefill and the decode loop (not timed), then times ``--reps`` runs of each: the prefill (whole prompts at
once) and the decode loop (max_new - 1 forward steps of one token per row, greedy, no EOS so every row runs to the
end). Decode tokens/s = batch x (max_new - 1) / decode seconds (median). ``--no_cache_max_gflop`` skips the
no-cache run where its recomputed forwards would pass that many GFLOPs (they grow quadratically with length).
``--mesh=data,fsdp,tensor`` on the first data x fsdp x tensor devices (8 simulated CPU devices exist).
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import importlib  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxtrain import sampling as sampling_lib  # noqa: E402
from jaxtrain import models  # noqa: E402
from jaxtrain import mesh as mesh_lib  # noqa: E402
from jaxtrain import sharding  # noqa: E402

_CONFIGS = flags.DEFINE_list("configs", ["tiny", "cpu_50m"], "Config modules under configs/.")
_BATCH = flags.DEFINE_integer("batch", 4, "Prompts per batch.")
_LENGTHS = flags.DEFINE_list("lengths", ["16:32", "64:64", "128:128"], "prompt_len:max_new_tokens pairs.")
_MESH = flags.DEFINE_list("mesh", ["1", "1", "1"], "data,fsdp,tensor sizes.")
_REPS = flags.DEFINE_integer("reps", 2, "Timed runs per measurement (median).")
_NO_CACHE_MAX = flags.DEFINE_float("no_cache_max_gflop", 3000, "Skip the no-cache run where its forward FLOPs "
                                   "(2 x params x rows x recomputed positions) would pass this.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/generate.json", "Where to write the JSON results.")


def measure(gen: sampling_lib.Generator, params, batch) -> dict:
  prefill_s, decode_s = [], []
  for _ in range(_REPS.value + 1):  # the first is a warm-up
    t = time.perf_counter()
    prefilled = jax.block_until_ready(gen.prefill(params, batch))
    t1 = time.perf_counter()
    out = jax.block_until_ready(gen.decode(params, prefilled, batch))
    t2 = time.perf_counter()
    prefill_s.append(t1 - t)
    decode_s.append(t2 - t1)
  produced = np.asarray(out[1])[:batch.count]
  assert (produced == gen.max_new_tokens).all(), produced
  prefill, decode = statistics.median(prefill_s[1:]), statistics.median(decode_s[1:])
  steps = gen.max_new_tokens - 1
  return {"compile_s": gen.compile_s, "prefill_s": prefill, "decode_s": decode,
          "decode_tokens_per_s": batch.count * steps / decode, "ms_per_step": 1e3 * decode / steps,
          "prefill_tokens_per_s": int(batch.lengths.sum()) / prefill, "tokens": np.asarray(out[0]).tolist()}


def bench_config(name: str) -> list[dict]:
  config = importlib.import_module(f"configs.{name}").get_config()
  data, fsdp, tensor = map(int, _MESH.value)
  config.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:data * fsdp * tensor])
  rules = sharding.rules_from_config(config.sharding)
  model = models.Model.from_config(config.model)
  shardings = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0))
  rng = np.random.default_rng(0)
  results = []
  for pair in _LENGTHS.value:
    prompt_len, new = map(int, pair.split(":"))
    prompts = [rng.integers(0, config.model.vocab_size, prompt_len).tolist() for _ in range(_BATCH.value)]
    row = {"config": name, "params": model.num_params(), "mesh": dict(mesh.shape), "batch": _BATCH.value,
           "prompt_len": prompt_len, "max_new_tokens": new}
    for mode in ("cache", "no_cache"):
      positions = sum(prompt_len + i for i in range(new))
      if mode == "no_cache" and 2 * model.num_params() * _BATCH.value * positions / 1e9 > _NO_CACHE_MAX.value:
        row[mode] = None
        continue
      gen = sampling_lib.Generator(model, mesh, rules, shardings, rows=sampling_lib.padded_rows(len(prompts), mesh, rules),
                               prompt_len=prompt_len, max_new_tokens=new, use_cache=mode == "cache")
      row[mode] = measure(gen, params, gen.batch(prompts))
      print(f"  {name} {prompt_len}:{new} {mode}: {row[mode]['decode_tokens_per_s']:.1f} tok/s", flush=True)
    if row["no_cache"]:
      row["same_tokens"] = row["cache"]["tokens"] == row["no_cache"]["tokens"]
      row["speedup"] = row["cache"]["decode_tokens_per_s"] / row["no_cache"]["decode_tokens_per_s"]
    for mode in ("cache", "no_cache"):
      if row[mode]:
        del row[mode]["tokens"]
    results.append(row)
  return results


def _fmt(x, spec):
  return format(x, spec) if x is not None and not (isinstance(x, float) and math.isnan(x)) else "-"


def main(argv):
  del argv
  results = [r for name in _CONFIGS.value for r in bench_config(name)]
  header = (f"{'config':<9}{'params':>12}{'batch':>6}{'prompt':>7}{'new':>5}{'compile s':>10}{'prefill s':>10}"
            f"{'cache tok/s':>12}{'ms/step':>9}{'no-cache tok/s':>15}{'ms/step':>9}{'speedup':>8}{'same':>6}")
  print(header)
  print("-" * len(header))
  for r in results:
    c, n = r["cache"], r["no_cache"] or {}
    print(f"{r['config']:<9}{r['params']:>12,}{r['batch']:>6}{r['prompt_len']:>7}{r['max_new_tokens']:>5}"
          f"{c['compile_s']:>10.1f}{c['prefill_s']:>10.3f}{c['decode_tokens_per_s']:>12,.1f}{c['ms_per_step']:>9.1f}"
          f"{_fmt(n.get('decode_tokens_per_s'), '>15,.1f'):>15}{_fmt(n.get('ms_per_step'), '>9.1f'):>9}"
          f"{_fmt(r.get('speedup'), '>8.1f'):>8}{str(r.get('same_tokens', '-')):>6}")
  print(f"wrote {_bench.write_json(_OUT.value, {'results': results})}")


if __name__ == "__main__":
  app.run(main)

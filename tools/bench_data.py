"""Data benchmark: loader throughput vs what the step consumes, and the data stall in the training loop.

  python tools/bench_data.py [--configs=tiny,cpu_50m] [--pairs=tiny=30,cpu_50m=4] [--source=arrayrecord|raw|mixture]
      [--raw_dir=DIR] [--out=benchmarks/results/data.json]

For each config (8 simulated CPU devices), on the bundled corpus: prepared on first use (``--source=arrayrecord``,
the default), or as raw JSONL tokenized inside the Grain pipeline (``--source=raw``, ``data.source=raw``: ~20 MB
of the corpus's paragraphs, repeated with a counter so documents differ, in 8 .jsonl files with a "text" field,
written once to ``--raw_dir`` or a temporary folder; byte tokenizer; results to benchmarks/results/data_stream.json):
``--source=mixture`` compares the loader of one prepared folder (the bundled corpus) with that of a 3-component
mixture (``data.mixture``: the corpus's paragraphs dealt into three prepared folders, weights 0.6 / 0.3 / 0.1) in
alternated rounds of ``--mixture_batches`` batches, 0 workers (results to benchmarks/results/data_mixture.json).
``--source=store`` compares the loader reading from local disk with the same data on an S3 server (moto) and a GCS
server (the emulator) on localhost (tests/object_store.py; the test extra): the prepared corpus (read from this
host's copy of the shards: its first open includes the copy) and the raw JSONL corpus (streamed from the store), in
alternated rounds of ``--mixture_batches`` batches, 0 workers (results to benchmarks/results/data_store.json).
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
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
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
_SOURCE = flags.DEFINE_enum("source", "arrayrecord", ["arrayrecord", "raw", "mixture", "store"], "arrayrecord: the "
                            "prepared bundled corpus. raw: data.source=raw on a generated JSONL corpus. mixture: one "
                            "folder against a 3-component mixture, loader only. store: local disk against s3:// and "
                            "gs:// servers on localhost, loader only.")
_MIX_ROUNDS = flags.DEFINE_integer("mixture_rounds", 10, "--source=mixture: alternated round pairs.")
_MIX_BATCHES = flags.DEFINE_integer("mixture_batches", 100, "--source=mixture: batches per round.")
_RAW_DIR = flags.DEFINE_string("raw_dir", "", "--source=raw: where the JSONL corpus is written (reused if there); "
                               "empty = a temporary folder, removed at the end.")
_RAW_MB = flags.DEFINE_float("raw_mb", 20.0, "--source=raw: size of the generated JSONL corpus, in MB.")
_OUT = flags.DEFINE_string("out", "", "Where to write the JSON results (default: benchmarks/results/data.json, "
                           "or data_stream.json with --source=raw).")

_RAW_FILES = 8
_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jaxtrain", "data", "corpus",
                       "tinyshakespeare.txt")


def write_raw_corpus(folder: str, megabytes: float) -> dict:
  """The bundled corpus's paragraphs as JSONL documents {"text": "<copy> <paragraph>"} (copy k of the corpus is
  prefixed with k, so documents differ), about ``megabytes`` MB in all, in 8 files (contiguous shares of the
  documents). Kept if ``folder`` already holds them."""
  names = [os.path.join(folder, f"part-{i:02d}.jsonl") for i in range(_RAW_FILES)]
  if not all(os.path.exists(n) for n in names):
    with open(_CORPUS, encoding="utf-8") as f:
      paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", f.read()) if p.strip()]
    lines, size, copy = [], 0, 0
    while size < megabytes * 1e6:
      for p in paragraphs:
        lines.append(json.dumps({"text": f"{copy} {p}"}) + "\n")
        size += len(lines[-1])
      copy += 1
    os.makedirs(folder, exist_ok=True)
    for i, name in enumerate(names):
      with open(name + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(lines[i * len(lines) // _RAW_FILES:(i + 1) * len(lines) // _RAW_FILES])
      os.replace(name + ".tmp", name)
  docs = 0
  for n in names:
    with open(n, "rb") as f:
      docs += sum(1 for _ in f)
  return {"path": folder, "files": _RAW_FILES, "documents": docs, "bytes": sum(os.path.getsize(n) for n in names)}


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


def bench(name: str, raw_dir: str = "") -> dict:
  config = importlib.import_module(f"configs.{name}").get_config()
  if raw_dir:
    config.data.update(source="raw", path=raw_dir, tokenizer="byte")
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


def write_mixture(folder: str) -> dict[str, str]:
  """The bundled corpus's paragraphs dealt round-robin into three prepared folders (kept if there)."""
  from jaxtrain.data import prepare
  with open(_CORPUS, encoding="utf-8") as f:
    paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", f.read()) if p.strip()]
  out = {}
  for i, name in enumerate(("web", "code", "books")):
    out[name] = os.path.join(folder, name)
    if not os.path.exists(os.path.join(out[name], "manifest.json")):
      os.makedirs(os.path.join(folder, f"{name}_in"), exist_ok=True)
      with open(os.path.join(folder, f"{name}_in", "a.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join(paragraphs[i::3]) + "\n")
      prepare.prepare(prepare.Options(inputs=[os.path.join(folder, f"{name}_in")], output=out[name], progress=False))
  return out


def bench_mixture(name: str, folder: str) -> dict:
  """Loader tokens/s of one folder and of a 3-component mixture, in alternated rounds (0 workers)."""
  parts = write_mixture(folder)
  single = importlib.import_module(f"configs.{name}").get_config()
  single.train.global_batch_size = _BATCH.value
  mixed = single.copy_and_resolve_references()
  mixed.data.mixture = f"web={parts['web']}:0.6,code={parts['code']}:0.3,books={parts['books']}:0.1"
  iterators = {"single": data_lib.open_train(single), "mixture": data_lib.open_train(mixed)}
  rows = single.train.global_batch_size * single.data.seq_len
  rates = {"single": [], "mixture": []}
  for it in iterators.values():
    for _ in range(5):
      next(it)
  for pair in range(_MIX_ROUNDS.value):
    order = ("single", "mixture") if pair % 2 == 0 else ("mixture", "single")
    for kind in order:
      t = time.perf_counter()
      for _ in range(_MIX_BATCHES.value):
        next(iterators[kind])
      rates[kind].append(_MIX_BATCHES.value * rows / (time.perf_counter() - t))
  for it in iterators.values():
    data_lib.close(it)
  return {"config": name, "global_batch": single.train.global_batch_size, "seq_len": single.data.seq_len,
          "single_tokens_per_sec_median": statistics.median(rates["single"]),
          "mixture_tokens_per_sec_median": statistics.median(rates["mixture"]),
          "mixture_vs_single_paired_median": statistics.median(m / s for m, s in zip(rates["mixture"],
                                                                                    rates["single"])),
          "rounds": rates}


def main_mixture() -> None:
  folder = _RAW_DIR.value or tempfile.mkdtemp(prefix="bench_data_mixture_")
  try:
    results = [bench_mixture(name, folder) for name in _CONFIGS.value]
  finally:
    if not _RAW_DIR.value:
      shutil.rmtree(folder, ignore_errors=True)
  header = f"{'config':<9}{'one folder tok/s':>18}{'3-component mixture tok/s':>27}{'mixture / one (paired)':>24}"
  print(header)
  print("-" * len(header))
  for r in results:
    print(f"{r['config']:<9}{r['single_tokens_per_sec_median']:>18,.0f}{r['mixture_tokens_per_sec_median']:>27,.0f}"
          f"{r['mixture_vs_single_paired_median']:>24.3f}")
  out = _OUT.value or "benchmarks/results/data_mixture.json"
  print(f"wrote {_bench.write_json(out, {'source': 'mixture', 'results': results})}")


def bench_store(name: str, sources: dict[str, str], kind: str, cache: str) -> dict:
  """Loader tokens/s of the same data at each of ``sources`` (where -> path or URL), in alternated rounds; the
  first batch's time (opening, and for prepared data the copy of the shards to a fresh local cache) apart."""
  from jaxtrain.data import shard_cache
  iterators, first = {}, {}
  for where, path in sources.items():
    config = importlib.import_module(f"configs.{name}").get_config()
    config.train.global_batch_size = _BATCH.value
    config.data.update(source=kind, path=path, tokenizer="byte", num_workers=0)
    os.environ[shard_cache.ENV] = os.path.join(cache, where)
    t = time.perf_counter()
    iterators[where] = data_lib.open_train(config)
    next(iterators[where])
    first[where] = time.perf_counter() - t
  rows = _BATCH.value * config.data.seq_len
  rates = {where: [] for where in sources}
  names = list(sources)
  for r in range(_MIX_ROUNDS.value):
    for where in names[r % len(names):] + names[:r % len(names)]:
      t = time.perf_counter()
      for _ in range(_MIX_BATCHES.value):
        next(iterators[where])
      rates[where].append(_MIX_BATCHES.value * rows / (time.perf_counter() - t))
  for it in iterators.values():
    data_lib.close(it)
  return {"config": name, "source": kind, "global_batch": _BATCH.value, "seq_len": config.data.seq_len,
          "tokens_per_sec_median": {w: statistics.median(v) for w, v in rates.items()},
          "vs_local_paired_median": {w: statistics.median(a / b for a, b in zip(v, rates["local"]))
                                     for w, v in rates.items()},
          "first_batch_s": first, "rounds": rates}


def main_store() -> None:
  import fsspec
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
  from tests import object_store
  from jaxtrain.data import prepare
  folder = tempfile.mkdtemp(prefix="bench_data_store_")
  try:
    prepared = os.fspath(prepare.bundled_corpus(os.path.join(folder, "cache")))
    raw = write_raw_corpus(os.path.join(folder, "raw"), _RAW_MB.value)["path"]
    results = []
    with object_store.serve("s3") as s3, object_store.serve("gs") as gs:
      for kind, local in (("arrayrecord", prepared), ("raw", raw)):
        sources = {"local": local}
        for store in (s3, gs):
          url = store.url(kind)
          fs, path = fsspec.core.url_to_fs(url)
          fs.put(local.rstrip("/") + "/", path, recursive=True)
          sources[store.scheme] = url
        for name in _CONFIGS.value:
          results.append(bench_store(name, sources, kind, os.path.join(folder, f"shards-{kind}-{name}")))
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  header = f"{'config':<9}{'data':<13}{'where':<7}{'tokens/s':>12}{'vs local':>10}{'first batch s':>15}"
  print(header)
  print("-" * len(header))
  for r in results:
    for where, rate in r["tokens_per_sec_median"].items():
      print(f"{r['config']:<9}{r['source']:<13}{where:<7}{rate:>12,.0f}{r['vs_local_paired_median'][where]:>10.3f}"
            f"{r['first_batch_s'][where]:>15.2f}")
  out = _OUT.value or "benchmarks/results/data_store.json"
  print(f"wrote {_bench.write_json(out, {'source': 'store', 'raw_mb': _RAW_MB.value, 'results': results})}")


def main(argv):
  del argv
  if _SOURCE.value == "mixture":
    return main_mixture()
  if _SOURCE.value == "store":
    return main_store()
  raw, tmp = {}, None
  if _SOURCE.value == "raw":
    folder = _RAW_DIR.value or (tmp := tempfile.mkdtemp(prefix="bench_data_raw_"))
    t = time.perf_counter()
    raw = write_raw_corpus(folder, _RAW_MB.value)
    print(f"raw corpus: {raw['documents']:,} documents, {raw['bytes'] / 1e6:.1f} MB in {raw['files']} .jsonl files "
          f"at {folder} ({time.perf_counter() - t:.1f} s)")
  try:
    results = [bench(name, raw.get("path", "")) for name in _CONFIGS.value]
  finally:
    if tmp:
      shutil.rmtree(tmp, ignore_errors=True)
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
  out = _OUT.value or ("benchmarks/results/data_stream.json" if raw else "benchmarks/results/data.json")
  extra = {"source": "raw", "raw_corpus": raw} if raw else {}
  print(f"wrote {_bench.write_json(out, {**extra, 'results': results})}")


if __name__ == "__main__":
  app.run(main)

"""Data preparation benchmark: throughput and peak memory against the input's size, per executor and worker count.

  python tools/bench_prepare.py [--sizes_mb=25,100,400] [--shard_mib=32] [--out=benchmarks/results/prepare.json]
  python tools/bench_prepare.py --sizes_mb=5,25 --runs=local:1,DirectRunner:1,DaskRunner:2 \
      --out=benchmarks/results/prepare_dask.json

Generates JSONL corpora of growing size (the bundled corpus's paragraphs, copy k prefixed with k so documents
differ, every 20th document a repeat of an earlier one; 16 files) and prepares each with
``tools/prepare_data.py`` (byte tokenizer) in a fresh process per run: in process with 1 and 2 workers, and as an
Apache Beam pipeline (FnApiRunner, the local runner; 1 and 2 worker processes); ``DaskRunner:N`` runs it on a Dask
cluster on this machine, a ``dask scheduler`` and N single-thread worker processes started before the run (not
timed: a cluster outlives its jobs) and stopped after it; ``--baseline=GIT_REV`` adds the tool as it was at that
revision (e.g. the in-memory path before the Beam work). Reported: wall seconds, documents/s and tokens/s, and peak
resident memory of the whole process tree (driver + workers, and the Dask scheduler and workers, sampled every
50 ms), of the driver and of the largest worker; and whether every run of one size wrote the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import portpicker
import psutil
from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import _bench  # noqa: E402  (tools/ is on sys.path when a script runs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SIZES = flags.DEFINE_list("sizes_mb", ["25", "100", "400"], "Corpus sizes in MB of JSONL.")
_SHARD = flags.DEFINE_float("shard_mib", 32.0, "--shard_mib of the runs (MiB of input per shard).")
_RUNS = flags.DEFINE_list("runs", ["local:1", "local:2", "FnApiRunner:1", "FnApiRunner:2"],
                          "EXECUTOR:WORKERS pairs; EXECUTOR is local or a Beam runner name (DaskRunner: on a "
                          "local Dask cluster of WORKERS worker processes).")
_BASELINE = flags.DEFINE_string("baseline", "", "A git revision whose tools/prepare_data.py also runs (1 worker).")
_WORK = flags.DEFINE_string("work", "", "Scratch folder (default: a temporary one, removed at the end).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/prepare.json", "Where to write the JSON results.")


def write_corpus(folder: str, megabytes: float, files: int = 16) -> dict:
  corpus = open(os.path.join(ROOT, "jaxtrain", "data", "corpus", "tinyshakespeare.txt"), encoding="utf-8").read()
  paragraphs = [p.strip("\n") for p in corpus.split("\n\n") if p.strip()]
  lines, size, copy = [], 0, 0
  while size < megabytes * 1e6:
    for p in paragraphs:
      text = lines[len(lines) // 2] if len(lines) % 20 == 19 else json.dumps({"text": f"{copy} {p}"}) + "\n"
      lines.append(text)
      size += len(text)
    copy += 1
  os.makedirs(folder, exist_ok=True)
  for i in range(files):
    with open(os.path.join(folder, f"part-{i:02d}.jsonl"), "w", encoding="utf-8") as f:
      f.writelines(lines[i * len(lines) // files:(i + 1) * len(lines) // files])
  return {"documents": len(lines), "bytes": size}


def _peak_memory(proc: subprocess.Popen, stop: threading.Event, out: dict, others=()) -> None:
  """Samples the RSS of ``proc``, the processes ``others`` and their descendants every 50 ms until ``stop``."""
  roots = [psutil.Process(proc.pid)] + [psutil.Process(p.pid) for p in others]
  while not stop.is_set():
    try:
      procs = [q for root in roots for q in [root] + root.children(recursive=True)]
      rss = {}
      for p in procs:
        try:
          rss[p.pid] = p.memory_info().rss
        except psutil.Error:
          pass
      out["tree"] = max(out.get("tree", 0), sum(rss.values()))
      out["driver"] = max(out.get("driver", 0), rss.get(proc.pid, 0))
      workers = [v for k, v in rss.items() if k != proc.pid]
      out["worker"] = max(out.get("worker", 0), max(workers, default=0))
    except psutil.Error:
      pass
    stop.wait(0.05)


class DaskCluster:
  """A ``dask scheduler`` and ``workers`` single-thread ``dask worker`` processes on localhost, ready on entry (the
  repository first on their PYTHONPATH), stopped on exit."""

  def __init__(self, workers: int, logs: str):
    self.workers, self.logs, self.procs = workers, logs, []
    self.address = f"tcp://127.0.0.1:{portpicker.pick_unused_port()}"

  def __enter__(self):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    start = [("scheduler", ["distributed.cli.dask_scheduler", "--host=127.0.0.1",
                            f"--port={self.address.rsplit(':', 1)[1]}", "--no-dashboard", "--idle-timeout=300s"])]
    start += [(f"worker{i}", ["distributed.cli.dask_worker", self.address, "--host=127.0.0.1", "--nworkers=1",
                              "--nthreads=1", "--no-dashboard", "--death-timeout=60"]) for i in range(self.workers)]
    try:
      for name, args in start:
        with open(os.path.join(self.logs, f"dask-{name}.log"), "w") as log:
          self.procs.append(subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                             env=env, cwd=ROOT, start_new_session=True))
      import distributed
      with distributed.Client(self.address, timeout=60) as client:
        client.wait_for_workers(self.workers, timeout=120)
    except BaseException:
      self.__exit__()
      raise
    return self

  def __exit__(self, *_):
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
    for p in self.procs:
      try:
        p.wait(timeout=15)
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def run_once(tool_root: str, inputs: str, output: str, executor: str, workers: int, cluster=None) -> dict:
  args = [sys.executable, os.path.join(tool_root, "tools", "prepare_data.py"), f"--input={inputs}",
          f"--output={output}", f"--workers={workers if workers > 1 and not cluster else 0}", "--eval_fraction=0.01"]
  if tool_root == ROOT:
    args.append(f"--shard_mib={_SHARD.value}")
  if executor != "local":
    args.append(f"--runner={executor}")
  if cluster:
    args += ["--", f"--dask_client_address={cluster.address}"]
  memory, stop = {}, threading.Event()
  start = time.perf_counter()
  proc = subprocess.Popen(args, cwd=tool_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  sampler = threading.Thread(target=_peak_memory, args=(proc, stop, memory, cluster.procs if cluster else ()))
  sampler.start()
  out, err = proc.communicate()
  seconds = time.perf_counter() - start
  stop.set()
  sampler.join()
  if proc.returncode:
    raise RuntimeError(f"{' '.join(args)} failed:\n{err[-3000:]}")
  manifest = json.load(open(os.path.join(output, "manifest.json")))
  digest = hashlib.sha256()
  for shard in manifest["shards"]:
    digest.update(open(os.path.join(output, shard["file"]), "rb").read())
  read = manifest["documents"] + manifest["duplicates_removed"]
  return {"seconds": seconds, "documents_read": read, "documents": manifest["documents"],
          "duplicates_removed": manifest["duplicates_removed"], "tokens": manifest["tokens"],
          "docs_per_s": read / seconds, "tokens_per_s": manifest["tokens"] / seconds,
          "peak_rss_mib": {k: v / 2**20 for k, v in memory.items()}, "shards_sha256": digest.hexdigest(),
          "shards": len(manifest["shards"])}


def main(argv):
  del argv
  work = _WORK.value or tempfile.mkdtemp(prefix="bench_prepare_")
  runs = [(r.split(":")[0], int(r.split(":")[1])) for r in _RUNS.value]
  baseline_root = None
  if _BASELINE.value:
    baseline_root = os.path.join(work, "baseline")
    if not os.path.exists(baseline_root):
      subprocess.run(["git", "worktree", "add", "--detach", baseline_root, _BASELINE.value], cwd=ROOT, check=True,
                     capture_output=True)
  results = []
  try:
    print(f"{'MB':>5} {'executor':>22} {'workers':>7} {'s':>7} {'docs/s':>9} {'Mtok/s':>7} "
          f"{'tree MiB':>9} {'driver':>7} {'worker':>7}  same bytes")
    for size in map(float, _SIZES.value):
      folder = os.path.join(work, f"in-{size:g}")
      corpus = write_corpus(folder, size)
      digests = set()
      plan = ([("baseline " + _BASELINE.value, 1, baseline_root)] if baseline_root else []) + \
          [(e, w, ROOT) for e, w in runs]
      for executor, workers, root in plan:
        output = os.path.join(work, "out")
        shutil.rmtree(output, ignore_errors=True)
        dask = executor == "DaskRunner"
        with DaskCluster(workers, work) if dask else contextlib.nullcontext() as cluster:
          # On a cluster, a first run on fresh workers (which import jaxtrain and Beam then) and a second one.
          for warm in (False, True) if dask else (False,):
            shutil.rmtree(output, ignore_errors=True)
            r = run_once(root, folder, output, "local" if executor.startswith("baseline") else executor, workers,
                         cluster)
            if root == ROOT:
              digests.add(r["shards_sha256"])
            mem, name = r["peak_rss_mib"], executor + (", warm" if warm else "")
            print(f"{size:>5g} {name:>22} {workers:>7} {r['seconds']:>7.1f} {r['docs_per_s']:>9,.0f} "
                  f"{r['tokens_per_s'] / 1e6:>7.2f} {mem.get('tree', 0):>9,.0f} {mem.get('driver', 0):>7,.0f} "
                  f"{mem.get('worker', 0):>7,.0f}  {len(digests) == 1 if root == ROOT else '-'}", flush=True)
            results.append({"size_mb": size, "corpus": corpus, "executor": executor, "workers": workers,
                            **({"warm_cluster": warm} if dask else {}), **r})
      shutil.rmtree(folder)
  finally:
    if baseline_root:
      subprocess.run(["git", "worktree", "remove", "--force", baseline_root], cwd=ROOT, capture_output=True)
    if not _WORK.value:
      shutil.rmtree(work, ignore_errors=True)
  print(f"wrote {_bench.write_json(_OUT.value, {'shard_mib': _SHARD.value, 'results': results})}")


if __name__ == "__main__":
  app.run(main)

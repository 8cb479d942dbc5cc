"""What logging every step costs on an object store: bytes uploaded, requests and objects per record of
``metrics.jsonl`` on a ``gs://`` and an ``s3://`` workdir, at 100, 1,000 and 10,000 records (``train.log_every=1``).

  python tools/bench_store_logs.py [--records=100,1000,10000] [--stores=gs,s3] [--step_s=0.5]
      [--out=benchmarks/results/store_logs.json]

Each store is a server on localhost that the tool starts (tests/object_store.py, the test extra: moto for S3,
fake-gcs-server for Cloud Storage), reached through tests/faults.py's proxy, which sees every request the clients
send and counts its bytes (head and body). Per count of records, the real ``MetricWriter`` of a fresh workdir writes
them (the record of a training step: loss, grad norm, lr, throughput...), then closes (the end of a run); bytes,
requests and the objects left are counted, and the records read back (``metrics.read_records``) must be the ones
written. A step takes ``--step_s`` seconds on the writer's clock (simulated, so that 10,000 steps take no real
hours): the writer writes what came in since its last write at most every ``jaxtrain.logs.INTERVAL_S`` seconds, and
each of those writes is waited for before the next step (steps longer than a write, as in training). ``write()`` is
timed: it is what the loop waits for.

``before``: the previous version's way, the whole ``metrics.jsonl`` written as the object at every record (up to
1,000 records: at 10,000 it uploads ~12 GB). Acceptance (issue 62): bytes per record within 2x from 100 to 10,000
records.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup(devices=1)

import contextlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import fsspec  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from jaxtrain import logs, metrics  # noqa: E402

_RECORDS = flags.DEFINE_list("records", ["100", "1000", "10000"], "Records per run.")
_STORES = flags.DEFINE_list("stores", ["gs", "s3"], "Object stores: gs, s3.")
_STEP_S = flags.DEFINE_float("step_s", 0.5, "Seconds per step on the writer's clock (one record per step).")
_BEFORE_MAX = flags.DEFINE_integer("before_max", 1000, "The previous version's way up to this many records.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/store_logs.json", "Where to write the JSON results.")


def _record(step: int) -> dict[str, float]:
  """A training step's record, as the loop logs it."""
  return {"loss": 3.0 + 1.0 / step, "grad_norm": 0.5 + 0.001 * step, "lr": 3e-4, "tokens": 65536.0,
          "tokens_seen": 65536.0 * step, "tokens_per_sec": 125000.0 + step, "tflops_per_device": 97.5,
          "mfu": 0.43, "step_time": 0.52, "data_wait": 0.001, "checkpoint_blocked": 0.0, "memory_gb": 61.2,
          "skipped_steps": 0.0, "anomalies": 0.0}


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


def _objects(url: str) -> int:
  fs, path = fsspec.core.url_to_fs(url)
  fs.invalidate_cache()
  return len(fs.find(path))


def _segments(proxy, store, n: int) -> dict:
  """``n`` records by the MetricWriter on a fresh workdir of ``store``."""
  workdir = store.url(f"bench-{uuid.uuid4().hex[:8]}")
  cfg = metrics.defaults()
  cfg.update(tensorboard=False, progress="log")
  writer = metrics.MetricWriter(workdir, n, 0, cfg, {})
  clock = _Clock()
  writer.stream.clock = clock  # the simulated steps
  first, written, waits, last = len(proxy.sizes), [], [], -float("inf")
  for step in range(1, n + 1):
    clock.now += _STEP_S.value
    t = time.perf_counter()
    writer.write(step, _record(step))
    waits.append(time.perf_counter() - t)
    written.append({"step": step, **_record(step)})
    if clock.now - last >= logs.INTERVAL_S:  # the write the thread makes now: done within the step
      assert writer.stream.flush(60)
      last = clock.now
  writer.close()
  sizes = proxy.sizes[first:]
  objects = _objects(logs.segments(f"{workdir}/{metrics.METRICS}"))
  assert metrics.read_records(workdir) == written, "the records read back differ from those written"
  return {"records": n, "bytes": sum(sizes), "requests": len(sizes), "objects": objects,
          "bytes_per_record": sum(sizes) / n, "requests_per_record": len(sizes) / n,
          "write_ms_max": 1e3 * max(waits), "write_ms_mean": 1e3 * sum(waits) / n}


def _before(proxy, store, n: int) -> dict:
  """The previous version's MetricWriter on a store: its whole text written as the object at every record."""
  fs, path = fsspec.core.url_to_fs(store.url(f"before-{uuid.uuid4().hex[:8]}", metrics.METRICS))
  first, text, waits = len(proxy.sizes), "", []
  for step in range(1, n + 1):
    text += json.dumps({"step": step, **_record(step)}) + "\n"
    t = time.perf_counter()
    fs.pipe_file(path, text.encode())
    waits.append(time.perf_counter() - t)
  sizes = proxy.sizes[first:]
  return {"records": n, "bytes": sum(sizes), "requests": len(sizes), "objects": 1,
          "bytes_per_record": sum(sizes) / n, "requests_per_record": len(sizes) / n,
          "write_ms_max": 1e3 * max(waits), "write_ms_mean": 1e3 * sum(waits) / n}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # the writer's console line per record
  from tests import faults, object_store  # pylint: disable=import-outside-toplevel  (the test extra)
  counts = [int(n) for n in _RECORDS.value]
  results = {"step_s": _STEP_S.value, "interval_s": logs.INTERVAL_S, "compact_objects": logs.COMPACT_OBJECTS,
             "servers": "localhost: moto (s3), fake-gcs-server (gs), through tests/faults.py's counting proxy",
             "bytes": "as the client sent them: request line, headers and body"}
  rows = []
  for scheme in _STORES.value:
    with contextlib.ExitStack() as stack:
      store = stack.enter_context(object_store.serve(scheme))
      proxy = stack.enter_context(faults.FaultyStore(store))
      stack.enter_context(proxy.use())
      for n in counts:
        for how, run in (("segments", _segments), ("before", _before)):
          if how == "before" and n > _BEFORE_MAX.value:
            continue
          r = run(proxy, store, n)
          results[f"{scheme}_{how}_{n}"] = r
          rows.append((scheme, how, r))
      ours = [results[f"{scheme}_segments_{n}"]["bytes_per_record"] for n in counts]
      results[f"{scheme}_bytes_per_record_ratio"] = max(ours) / min(ours)
  print(f"metrics.jsonl on a store, one record per step of {_STEP_S.value} s (writes at most every "
        f"{logs.INTERVAL_S:g} s; merged every {logs.COMPACT_OBJECTS} objects and at the end)")
  print(f"{'store':<6}{'way':<10}{'records':>8}{'bytes/record':>14}{'requests/record':>17}{'objects':>9}"
        f"{'write() max ms':>16}")
  for scheme, how, r in rows:
    print(f"{scheme:<6}{how:<10}{r['records']:>8,}{r['bytes_per_record']:>14,.0f}{r['requests_per_record']:>17.3f}"
          f"{r['objects']:>9,}{r['write_ms_max']:>16.2f}")
  for scheme in _STORES.value:
    ratio = results[f"{scheme}_bytes_per_record_ratio"]
    print(f"{scheme}: bytes per record, largest / smallest over {counts}: {ratio:.2f} (acceptance: within 2x)")
  print(f"wrote {_bench.write_json(_OUT.value, results)}")


if __name__ == "__main__":
  app.run(main)

"""Checkpoint benchmark: how long the training loop blocks per async save vs a synchronous save, and per save to
the node-local tier (``checkpoint.local_dir``) vs the persistent one.

  python tools/bench_checkpoint.py [--config=cpu_50m] [--saves=5] [--dir=/tmp/jaxtrain-bench-ckpt]
      [--out=benchmarks/results/checkpoint.json]

Uses the real train state of the config (params + AdamW state, sharded over 8 simulated devices; cpu_50m is
~609 MB) after ``--train_steps`` real optimizer steps on synthetic batches, so that it is the state of a run in
progress: a freshly initialised state has all-zero Adam moments, which Orbax's compressed writes store almost
for free and which would flatter the synchronous save. Then the real persistent tier and a synthetic data
iterator. Per mode (sync / async, with and without integrity verification), ``--saves`` saves at new steps; the
first is reported apart (it sets Orbax up). Blocking = the time ``save()`` takes to return, which is what the
training loop waits for; for async saves the background write is timed up to ``wait()``. With verification the
save is handed the state's fingerprints as the train step computes them; the pass that computes them is timed
apart (it is device work of the save step, not blocking). Restore = reading the newest checkpoint back onto the
mesh (median of 3), with verification: plus recomputing and comparing the fingerprints and finiteness. The
local tier (jaxtrain.checkpoint.local, always verified) is timed the same way into ``--dir``/local: the loop
waits for the device-to-host copy, a thread writes the file.

With ``--targets`` it compares where the persistent tier saves instead: the local disk (``--dir``) against object
stores, each an S3 (moto) or GCS (fake-gcs-server) server on localhost that the tool starts (tests/object_store.py,
the test extra) unless ``--s3_url`` / ``--gs_url`` name a bucket folder to use. Per target, async verified saves:
the loop's blocking and the time from save() to commit (wait() returned), and restores; throughput = state bytes /
seconds. The servers run on the same machine, so the figures show what the store's protocol costs (HTTP requests,
TensorStore's object-store drivers), not a network:

  python tools/bench_checkpoint.py --targets=disk,s3,gs --num_layers=4 --saves=4 \
      --out=benchmarks/results/checkpoint_stores.json
"""

from __future__ import annotations

import os

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import contextlib  # noqa: E402
import importlib  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from jaxtrain import checkpoint as checkpoint_lib  # noqa: E402
from jaxtrain import data as data_lib  # noqa: E402
from jaxtrain import integrity  # noqa: E402
from jaxtrain import sharding  # noqa: E402
from jaxtrain.data.synthetic import SyntheticSource  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "cpu_50m", "Config module under configs/.")
_SAVES = flags.DEFINE_integer("saves", 5, "Saves per mode.")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 2, "Optimizer steps taken before saving (short batches).")
_DIR = flags.DEFINE_string("dir", "/tmp/jaxtrain-bench-ckpt", "Scratch folder (deleted first).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/checkpoint.json", "Where to write the JSON results.")
_TARGETS = flags.DEFINE_list("targets", [], "Compare where checkpoints go: disk, s3, gs (empty: the save modes).")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 0, "Layers of the model (0: the config's).")
_S3_URL = flags.DEFINE_string("s3_url", "", "s3://bucket/folder to save to (default: a server on localhost).")
_GS_URL = flags.DEFINE_string("gs_url", "", "gs://bucket/folder to save to (default: a server on localhost).")


def timed(fn, *args, **kwargs):
  t = time.perf_counter()
  out = fn(*args, **kwargs)
  return out, time.perf_counter() - t


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = importlib.import_module(f"configs.{_CONFIG.value}").get_config()
  config.mesh.update(data=1, fsdp=-1, tensor=1)
  if _NUM_LAYERS.value:
    config.model.num_layers = _NUM_LAYERS.value
  # The batch only has to move the optimizer state off its zeros; its size does not change the state's.
  config.train.global_batch_size, config.data.seq_len = jax.device_count(), 64
  run = trainer.build(config)
  state = trainer.init_state(run)
  step_fn = trainer.compile_step(run)
  batches = SyntheticSource(config.data.seq_len, config.model.vocab_size, config.train.global_batch_size, 0)
  for _ in range(_TRAIN_STEPS.value):
    state, _ = step_fn(state, data_lib.to_global(next(batches), run.batch_sharding), np.bool_(False))
  jax.block_until_ready(state)
  abstract = run.abstract_state()
  state_bytes = sharding.total_bytes(abstract)
  data = SyntheticSource(8, 256, 8, 0)
  shutil.rmtree(_DIR.value, ignore_errors=True)
  if _TARGETS.value:
    return compare_targets(config, state, abstract, state_bytes, data)
  results = {"config": _CONFIG.value, "state_bytes": state_bytes, "devices": jax.device_count(),
             "train_steps_before_saving": _TRAIN_STEPS.value}

  # What a save step's device work grows by with verification: the fingerprints and finiteness of the state,
  # which the train step computes (lax.cond) when its state is about to be saved.
  summary_fn = jax.jit(integrity.summary)
  jax.block_until_ready(summary_fn(state))
  passes = [timed(lambda: jax.block_until_ready(summary_fn(state)))[1] for _ in range(5)]
  results["fingerprint_pass_s_median"] = statistics.median(passes)
  summary = integrity.read(summary_fn(state))

  modes = [(m, v) for v in (False, True) for m in ("sync", "async")]
  for mode, verify in modes:
    key = f"{mode}_verified" if verify else mode
    ckpt = checkpoint_lib.PersistentTier(os.path.join(_DIR.value, key), keep_last=2, async_save=mode == "async",
                                         verify=verify)
    blocked, written = [], []
    for step in range(1, _SAVES.value + 1):
      _, b = timed(ckpt.save, step, state, data, meta={"step": step}, config={}, force=True,
                   summary=summary if verify else None)
      _, w = timed(ckpt.wait)
      blocked.append(b)
      written.append(b + w)
    newest = pathlib.Path(_DIR.value, key, str(ckpt.steps()[-1]))
    disk_bytes = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    restores = []
    for _ in range(3):
      restored, restore_s = timed(lambda: jax.block_until_ready(
          checkpoint_lib.Checkpointer([ckpt]).restore(abstract, data)[0]))
      restores.append(restore_s)
    ckpt.close()
    results[key] = {"first_save_blocked_s": blocked[0], "blocked_s_median": statistics.median(blocked[1:]),
                    "save_total_s_median": statistics.median(written[1:]),
                    "restore_s_median": statistics.median(restores), "disk_bytes": disk_bytes,
                    "blocked_s": blocked, "save_total_s": written, "restore_s": restores}
  local = checkpoint_lib.LocalTier(os.path.join(_DIR.value, "local"), every_steps=1, keep_last=2)
  blocked, written = [], []
  for step in range(1, _SAVES.value + 1):
    _, b = timed(local.save, step, state, data, meta={"step": step}, summary=summary)
    _, w = timed(local.wait)
    blocked.append(local.last_save_blocked_s)
    written.append(b + w)
  newest = pathlib.Path(local.directory, str(local.steps()[-1]))
  restores = [timed(lambda: jax.block_until_ready(
      checkpoint_lib.Checkpointer([local]).restore(abstract, data)[0]))[1] for _ in range(3)]
  results["local"] = {"first_save_blocked_s": blocked[0], "blocked_s_median": statistics.median(blocked[1:]),
                      "save_total_s_median": statistics.median(written[1:]),
                      "restore_s_median": statistics.median(restores),
                      "disk_bytes": sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()),
                      "blocked_s": blocked, "save_total_s": written, "restore_s": restores}
  results["local_blocking_vs_async_verified"] = (results["local"]["blocked_s_median"] /
                                                 results["async_verified"]["blocked_s_median"])
  for suffix in ("", "_verified"):
    results[f"async_blocking_vs_sync{suffix}"] = (results[f"async{suffix}"]["blocked_s_median"] /
                                                 results[f"sync{suffix}"]["blocked_s_median"])

  mb = state_bytes / 1e6
  print(f"{_CONFIG.value}: params + optimizer state = {mb:,.0f} MB on {jax.device_count()} devices, "
        f"after {_TRAIN_STEPS.value} optimizer steps")
  print(f"{'mode':<7}{'verify':>7}{'loop blocked s (median)':>25}{'save total s':>14}{'first save s':>14}"
        f"{'restore s':>11}{'on disk MB':>12}")
  for mode, verify in modes + [("local", True)]:
    r = results[f"{mode}_verified" if verify and mode != "local" else mode]
    print(f"{mode:<7}{'yes' if verify else 'no':>7}{r['blocked_s_median']:>25.3f}{r['save_total_s_median']:>14.3f}"
          f"{r['first_save_blocked_s']:>14.3f}{r['restore_s_median']:>11.3f}{r['disk_bytes'] / 1e6:>12,.0f}")
  print(f"async blocking / sync save = {results['async_blocking_vs_sync_verified']:.3f} with verification, "
        f"{results['async_blocking_vs_sync']:.3f} without")
  print(f"local tier blocking / persistent async save (verified) = {results['local_blocking_vs_async_verified']:.3f}")
  print(f"fingerprint + finiteness pass over the state (device work of a save step) = "
        f"{results['fingerprint_pass_s_median']:.3f} s")
  print(f"wrote {_bench.write_json(_OUT.value, results)}")
  shutil.rmtree(_DIR.value, ignore_errors=True)


def compare_targets(config, state, abstract, state_bytes: int, data) -> None:
  """The persistent tier's async verified saves and restores on each of ``--targets``."""
  summary = integrity.summarize(state)
  results = {"config": _CONFIG.value, "num_layers": config.model.num_layers, "state_bytes": state_bytes,
             "devices": jax.device_count(), "train_steps_before_saving": _TRAIN_STEPS.value,
             "mode": "async, verified", "servers": "localhost"}
  for target in _TARGETS.value:
    with contextlib.ExitStack() as stack:
      url = {"s3": _S3_URL.value, "gs": _GS_URL.value}.get(target, "")
      if target == "disk":
        where = os.path.join(_DIR.value, "store-disk")
      elif url:
        where = url
      else:
        from tests import object_store  # pylint: disable=import-outside-toplevel  (the test extra)
        server = stack.enter_context(object_store.serve(target))
        where = server.url("bench")
        results[f"{target}_server"] = "moto" if target == "s3" else "fake-gcs-server"
      ckpt = checkpoint_lib.PersistentTier(where, keep_last=2, async_save=True, verify=True)
      blocked, committed = [], []
      for step in range(1, _SAVES.value + 1):
        _, b = timed(ckpt.save, step, state, data, meta={"step": step}, config={}, force=True, summary=summary)
        _, w = timed(ckpt.wait)
        blocked.append(b)
        committed.append(b + w)
      restores = [timed(lambda: jax.block_until_ready(
          checkpoint_lib.Checkpointer([ckpt]).restore(abstract, data)[0]))[1] for _ in range(3)]
      ckpt.close()
      commit, restore = statistics.median(committed[1:]), statistics.median(restores)
      results[target] = {"where": where.split("://")[0] if "://" in where else "local disk",
                         "first_save_blocked_s": blocked[0], "blocked_s_median": statistics.median(blocked[1:]),
                         "commit_s_median": commit, "restore_s_median": restore,
                         "save_mb_per_s": state_bytes / 1e6 / commit, "restore_mb_per_s": state_bytes / 1e6 / restore,
                         "blocked_s": blocked, "commit_s": committed, "restore_s": restores}
  print(f"{_CONFIG.value} with {config.model.num_layers} layers: params + optimizer state = "
        f"{state_bytes / 1e6:,.0f} MB on {jax.device_count()} devices; async verified saves (median of {_SAVES.value - 1} after the first)")
  print(f"{'target':<8}{'loop blocked s':>16}{'save to commit s':>18}{'save MB/s':>11}{'restore s':>11}"
        f"{'restore MB/s':>14}")
  for target in _TARGETS.value:
    r = results[target]
    print(f"{target:<8}{r['blocked_s_median']:>16.3f}{r['commit_s_median']:>18.3f}{r['save_mb_per_s']:>11,.0f}"
          f"{r['restore_s_median']:>11.3f}{r['restore_mb_per_s']:>14,.0f}")
  print(f"wrote {_bench.write_json(_OUT.value, results)}")
  shutil.rmtree(_DIR.value, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)

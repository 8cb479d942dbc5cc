"""Checkpoint benchmark: how long the training loop blocks per async save vs a synchronous save.

  python tools/bench_checkpoint.py [--config=cpu_50m] [--saves=5] [--dir=/tmp/jaxtrain-bench-ckpt]
      [--out=benchmarks/results/checkpoint.json]

Uses the real train state of the config (params + AdamW state, sharded over 8 simulated devices; cpu_50m is
~609 MB) after ``--train_steps`` real optimizer steps on synthetic batches, so that it is the state of a run in
progress: a freshly initialised state has all-zero Adam moments, which Orbax's compressed writes store almost
for free and which would flatter the synchronous save. Then the real Checkpointer and a synthetic data
iterator. Per mode, ``--saves`` saves at new steps; the first is reported apart (it sets Orbax up). Blocking =
the time ``save()`` takes to return, which is what the training loop waits for; for async saves the
background write is timed up to ``wait()``. Restore = reading the newest checkpoint back onto the mesh.
"""

from __future__ import annotations

import os

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import importlib  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from jaxtrain import checkpoint as checkpoint_lib  # noqa: E402
from jaxtrain import data as data_lib  # noqa: E402
from jaxtrain import sharding  # noqa: E402
from jaxtrain.data.synthetic import SyntheticSource  # noqa: E402
from jaxtrain.train import state as state_lib  # noqa: E402
from jaxtrain.train import step as step_lib  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "cpu_50m", "Config module under configs/.")
_SAVES = flags.DEFINE_integer("saves", 5, "Saves per mode.")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 2, "Optimizer steps taken before saving (short batches).")
_DIR = flags.DEFINE_string("dir", "/tmp/jaxtrain-bench-ckpt", "Scratch folder (deleted first).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/checkpoint.json", "Where to write the JSON results.")


def timed(fn, *args, **kwargs):
  t = time.perf_counter()
  out = fn(*args, **kwargs)
  return out, time.perf_counter() - t


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = importlib.import_module(f"configs.{_CONFIG.value}").get_config()
  config.mesh.update(data=1, fsdp=-1, tensor=1)
  # The batch only has to move the optimizer state off its zeros; its size does not change the state's.
  config.train.global_batch_size, config.data.seq_len = jax.device_count(), 64
  run = trainer.build(config)
  state = trainer.init_state(run)
  step_fn = trainer.compile_step(run)
  batches = SyntheticSource(config.data.seq_len, config.model.vocab_size, config.train.global_batch_size, 0)
  for _ in range(_TRAIN_STEPS.value):
    state, _ = step_fn(state, data_lib.to_global(next(batches), run.batch_sharding), step_lib.control())
  jax.block_until_ready(state)
  abstract = state_lib.abstract(run.model, run.tx, run.state_shardings)
  state_bytes = sharding.total_bytes(abstract)
  data = SyntheticSource(8, 256, 8, 0)
  shutil.rmtree(_DIR.value, ignore_errors=True)
  results = {"config": _CONFIG.value, "state_bytes": state_bytes, "devices": jax.device_count(),
             "train_steps_before_saving": _TRAIN_STEPS.value}

  for mode in ("sync", "async"):
    ckpt = checkpoint_lib.Checkpointer(os.path.join(_DIR.value, mode), keep_last=2, async_save=mode == "async")
    blocked, written = [], []
    for step in range(1, _SAVES.value + 1):
      _, b = timed(ckpt.save, step, state, data, meta={"step": step}, config={}, force=True)
      _, w = timed(ckpt.wait)
      blocked.append(b)
      written.append(b + w)
    newest = pathlib.Path(_DIR.value, mode, str(ckpt.steps()[-1]))
    disk_bytes = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    restored, restore_s = timed(ckpt.restore, abstract, data)
    jax.block_until_ready(restored[0])
    ckpt.close()
    results[mode] = {"first_save_blocked_s": blocked[0], "blocked_s_median": statistics.median(blocked[1:]),
                     "save_total_s_median": statistics.median(written[1:]), "restore_s": restore_s,
                     "disk_bytes": disk_bytes, "blocked_s": blocked, "save_total_s": written}
  results["async_blocking_vs_sync"] = results["async"]["blocked_s_median"] / results["sync"]["blocked_s_median"]

  mb = state_bytes / 1e6
  print(f"{_CONFIG.value}: params + optimizer state = {mb:,.0f} MB on {jax.device_count()} devices, "
        f"after {_TRAIN_STEPS.value} optimizer steps")
  print(f"{'mode':<7}{'loop blocked s (median)':>25}{'save total s':>14}{'first save s':>14}{'restore s':>11}"
        f"{'on disk MB':>12}")
  for mode in ("sync", "async"):
    r = results[mode]
    print(f"{mode:<7}{r['blocked_s_median']:>25.3f}{r['save_total_s_median']:>14.3f}"
          f"{r['first_save_blocked_s']:>14.3f}{r['restore_s']:>11.3f}{r['disk_bytes'] / 1e6:>12,.0f}")
  print(f"async blocking / sync save = {results['async_blocking_vs_sync']:.3f}")
  print(f"wrote {_bench.write_json(_OUT.value, results)}")
  shutil.rmtree(_DIR.value, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)

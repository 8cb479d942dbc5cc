"""Observability: FLOPs and MFU, writers, NaN policies, anomaly warnings, watchdog, plots, profiler."""

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import llama3_8b
from jaxtrain import integrity, metrics, models, monitor
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.train import trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_llama3_8b_flops_per_token_is_6n_plus_attention():
  config = llama3_8b.get_config()
  model = models.Model.from_config(config.model)
  n_without_input_embedding = 8_030_261_248 - 128_256 * 4096
  attention = 12 * 32 * 32 * 128 * 8192
  expected = 6 * n_without_input_embedding + attention
  assert abs(metrics.flops_per_token(model, 8192) - expected) / expected < 0.01


def test_peak_table():
  assert metrics.peak_flops_per_device(2.5) == 2.5e12
  class Kind:
    def __init__(self, kind):
      self.device_kind = kind
  assert metrics.peak_flops_per_device(0, Kind("TPU v5 lite")) == 197e12
  assert metrics.peak_flops_per_device(0, Kind("NVIDIA H100 80GB HBM3")) == 989e12
  assert metrics.peak_flops_per_device(0, Kind("cpu")) is None


def test_mfu_on_console_jsonl_and_tensorboard(make_config, caplog):
  from tensorboard.backend.event_processing import event_accumulator
  config = make_config(fsdp=8)
  config.metrics.peak_tflops = 0.01  # a made-up CPU peak, so that MFU is reported
  with caplog.at_level("INFO"):
    _, history = trainer.train(config)
  assert "MFU" in caplog.text and "TFLOP/s/device" in caplog.text
  records = [json.loads(line) for line in pathlib.Path(config.workdir, "metrics.jsonl").read_text().splitlines()]
  assert all(0 < r["mfu"] < 100 for r in records)
  flops = metrics.flops_per_token(trainer.build(config).model, 32)
  r = records[-1]
  np.testing.assert_allclose(r["tflops_per_device"], flops * 16 * 32 / r["step_time"] / 8 / 1e12, rtol=1e-6)
  events = event_accumulator.EventAccumulator(os.fspath(pathlib.Path(config.workdir) / "tensorboard"))
  events.Reload()
  tags = events.Tags()["scalars"]
  assert {"loss", "mfu", "tokens_per_sec", "grad_norm", "lr", "data_wait_s"} <= set(tags)
  assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
  np.testing.assert_allclose(events.Scalars("loss")[-1].value, history[-1]["loss"], rtol=1e-6)


class Poisoned(SyntheticSource):
  """Batch `bad` (0-based) carries a NaN in its loss mask, so that step's loss and gradients are NaN."""

  def __init__(self, bad, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.bad = bad

  def __next__(self):
    bad = self.step == self.bad
    batch = super().__next__()
    if bad:
      batch["loss_mask"][0, 0] = np.nan
    return batch


class Without(SyntheticSource):
  """The same stream with batch `drop` left out."""

  def __init__(self, drop, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.drop = drop

  def __next__(self):
    if self.step == self.drop:
      self.step += 1
    return super().__next__()


def _nan_config(make_config, workdir, policy, steps):
  config = make_config(fsdp=8)
  config.workdir = str(workdir)
  config.train.steps = steps
  config.optim.update(schedule="constant", warmup_steps=0)  # so a skipped step does not shift the schedule
  config.monitor.nan_policy = policy
  config.checkpoint.every_steps = 3
  return config


def _assert_checkpoints_finite(workdir):
  root = pathlib.Path(workdir) / "checkpoints"
  steps = [p for p in root.iterdir() if p.name.isdigit()]
  assert steps
  for step in steps:
    with ocp.StandardCheckpointer() as ckptr:
      state = ckptr.restore(step / "state")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_nan_step_is_skipped_and_never_checkpointed(make_config, tmp_path, policy, caplog):
  args = (32, 256, 16, 0)
  reference = _nan_config(make_config, tmp_path / "ref", "skip", 7)
  ref_state, _ = trainer.train(reference, data=Without(4, *args))
  config = _nan_config(make_config, tmp_path / policy, policy, 8)
  with caplog.at_level("WARNING"):
    state, history = trainer.train(config, data=Poisoned(4, *args))
  assert "step 5: non-finite loss, gradients or updated state; update not applied" in caplog.text
  if policy == "rollback":
    assert "back to checkpoint step 3" in caplog.text
  report = json.loads(pathlib.Path(config.workdir, "bad_batches.jsonl").read_text().splitlines()[0])
  assert report["step"] == 5 and report["source"] == "synthetic (seed 0, batch 4)"
  # Skip drops the update once; rollback drops it when seen and again when the replay reaches that batch.
  assert int(state.step) == 8 and history[-1]["skipped_steps"] == (1 if policy == "skip" else 2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
               state.params, ref_state.params)
  _assert_checkpoints_finite(config.workdir)


def test_nan_policy_stop(make_config, tmp_path):
  config = _nan_config(make_config, tmp_path, "stop", 8)
  with pytest.raises(trainer.TrainingStopped, match="step 5: non-finite"):
    trainer.train(config, data=Poisoned(4, 32, 256, 16, 0))
  _assert_checkpoints_finite(config.workdir)
  import threading  # the watchdog must not outlive the run (it would kill this process later)
  assert not any(t.name == "jaxtrain-watchdog" for t in threading.enumerate())


# A learning rate of 1e30 turns the params huge (but finite) at step 1; every later step's loss is non-finite:
# a problem that persists whatever the batch, as a diverged model or a bad optimizer state would.
DIVERGING = ["--config=configs/tiny.py", "--config.train.global_batch_size=8", "--config.data.seq_len=64",
             "--config.train.log_every=1", "--config.optim.lr=1e30", "--config.optim.warmup_steps=0",
             "--config.optim.schedule=constant"]


def _main(*args):
  return subprocess.run([sys.executable, "-m", "jaxtrain.main", *DIVERGING, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)


def test_persistent_non_finite_steps_under_skip_roll_back_then_stop(tmp_path):
  r = _main(f"--config.workdir={tmp_path}", "--config.train.steps=20", "--config.checkpoint.every_steps=1",
            "--config.monitor.max_consecutive_nonfinite=3")
  assert r.returncode == 1, r.stderr[-3000:]
  # Steps 2-4 fail: back to checkpoint 1; the replay skips their batches, 5-7 fail again: stop.
  assert "rollback at step 4 (3 non-finite step(s) in a row): back to checkpoint step 1" in r.stderr
  assert r.stderr.strip().splitlines()[-1] == (
      "jaxtrain: stopped: step 7: 3 non-finite step(s) in a row again after 1 rollback(s) to checkpoint step 1; "
      f"the checkpoints are intact (steps: [1]): look at {tmp_path / 'bad_batches.jsonl'}, lower optim.lr or fix "
      "the data")
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]  # never carried past the problem
  _assert_checkpoints_finite(tmp_path)


def test_rollback_policy_stops_after_too_many_rollbacks_to_one_checkpoint(tmp_path):
  r = _main(f"--config.workdir={tmp_path}", "--config.train.steps=20", "--config.checkpoint.every_steps=1",
            "--config.monitor.max_consecutive_nonfinite=3", "--config.monitor.nan_policy=rollback")
  assert r.returncode == 1, r.stderr[-3000:]
  # Each new step fails and rolls back to 1 (the replays skip the known ones): 2, 3, 4, then 5 is one too many.
  assert [line.split("rollback at step ")[1][:2] for line in r.stderr.splitlines() if "rollback at step" in line] \
      == ["2 ", "3 ", "4 "]
  assert r.stderr.strip().splitlines()[-1] == (
      "jaxtrain: stopped: step 5: a non-finite step again after 3 rollback(s) to checkpoint step 1; the checkpoints "
      f"are intact (steps: [1]): look at {tmp_path / 'bad_batches.jsonl'}, lower optim.lr or fix the data")


def test_a_run_never_exits_0_when_its_last_steps_were_non_finite(tmp_path):
  r = _main(f"--config.workdir={tmp_path}", "--config.train.steps=3")  # steps 2 and 3 fail, fewer than the limit
  assert r.returncode == 1, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == (
      "jaxtrain: stopped: step 3: 2 non-finite step(s) in a row and no checkpoint to roll back to; nothing was "
      "saved: lower optim.lr or fix the data, or save earlier with checkpoint.every_steps")
  assert list((tmp_path / "checkpoints").iterdir()) == []


def test_non_finite_values_injected_into_a_live_state_never_reach_a_checkpoint(make_config, tmp_path, caplog,
                                                                               monkeypatch):
  """A fault in device memory (here: NaN written into AdamW's second moment before step 7): the step's guard
  reports it non-finite and keeps it out of the params, no checkpoint is written from it, and the run rolls back
  to the last good checkpoint and finishes."""
  compile_step, poisoned = trainer.compile_step, []

  def compile_with_fault(run, train_step=None):
    step_fn = compile_step(run, train_step)

    def faulty(state, batch, control):
      if int(state.step) == 6 and not poisoned:
        def poison(path, x):
          if integrity.name(path) != "1/0/nu/layers/attn/o/kernel":
            return x
          return jax.device_put(x.at[(0,) * x.ndim].set(np.nan), x.sharding)
        state = state.replace(opt_state=jax.tree_util.tree_map_with_path(poison, state.opt_state))
        poisoned.append(True)
      return step_fn(state, batch, control)
    return faulty

  monkeypatch.setattr(trainer, "compile_step", compile_with_fault)
  config = _nan_config(make_config, tmp_path, "skip", 12)
  config.monitor.max_consecutive_nonfinite = 3
  with caplog.at_level("WARNING"):
    state, history = trainer.train(config)
  assert poisoned and int(state.step) == 12
  assert "step 7: non-finite loss, gradients or updated state; update not applied" in caplog.text
  assert "rollback at step 9 (3 non-finite step(s) in a row): back to checkpoint step 6" in caplog.text
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
  # Not 9: on the replay, step 9 skipped its (known bad) batch, and a save waits for an applied update.
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [3, 6, 12]
  _assert_checkpoints_finite(tmp_path)


def test_anomaly_detector_flags_spikes_drops_and_stagnation():
  detect = monitor.AnomalyDetector(sigma=4.0, window=20, stagnation_logs=3)
  rng = np.random.default_rng(0)
  for step in range(15):
    assert detect(step, {"loss": 2.0 + 0.01 * rng.standard_normal(), "grad_norm": 1.0 + 0.01 * step % 3,
                         "tokens_per_sec": 1000.0}) in ([], ["loss_stagnation"])
  found = detect(15, {"loss": 5.0, "grad_norm": 50.0, "tokens_per_sec": 100.0})
  assert {"loss_spike", "grad_norm_spike", "throughput_drop"} <= set(found)


def test_watchdog_dumps_stacks_and_exits_nonzero(tmp_path):
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  err_file = tmp_path / "stderr.txt"
  with err_file.open("w") as err_out:
    p = subprocess.Popen([sys.executable, "tests/stall_worker.py", str(tmp_path), "4"], cwd=ROOT, env=env,
                         stderr=err_out, stdout=subprocess.DEVNULL)
    deadline, stalled_at = time.time() + 180, None
    while p.poll() is None and time.time() < deadline:
      if stalled_at is None and "STALLING" in err_file.read_text():
        stalled_at = time.time()
      time.sleep(0.05)
    if p.poll() is None:
      p.kill()
      p.wait(timeout=30)
      pytest.fail("the watchdog did not end the stalled process")
  err = err_file.read_text()
  assert p.returncode == monitor.Watchdog.EXIT_CODE, err[-3000:]
  assert stalled_at is not None and time.time() - stalled_at < 4 + 3  # within the limit (+ polling slack)
  assert "watchdog: no step finished" in err and "Thread" in err and "stall_worker.py" in err


def test_plot_metrics_writes_png(make_config, tmp_path):
  config = make_config(fsdp=8)
  trainer.train(config)
  out = tmp_path / "plot.png"
  r = subprocess.run([sys.executable, "tools/plot_metrics.py", config.workdir, f"--out={out}"], cwd=ROOT,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  import matplotlib.image
  image = matplotlib.image.imread(out)
  assert image.shape[0] > 400 and image.shape[1] > 600 and image.std() > 0.05  # a real picture, not blank


def test_profiler_trace_is_written(make_config):
  config = make_config(fsdp=8)
  config.metrics.update(profile_start=1, profile_steps=2)
  trainer.train(config)
  assert list(pathlib.Path(config.workdir, "profile").rglob("*.xplane.pb"))


def test_progress_bar_shows_step_loss_throughput_and_mfu(make_config, capsys):
  config = make_config(fsdp=8)
  config.metrics.update(progress="bar", peak_tflops=0.01)
  trainer.train(config)
  err = capsys.readouterr().err
  assert "5/5" in err and "loss" in err and "tok/s" in err and "MFU" in err

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
from jaxtrain import metrics, models, monitor
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
  assert "step 5: non-finite loss or gradients" in caplog.text
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

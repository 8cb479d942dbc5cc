"""jaxtrain.main as a real 2-process job on localhost: train, checkpoint, kill, restart, resume, go on as one
process, match one process; a dead process fails the job instead of hanging it; explicit config errors; dry
run."""

import functools
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
ARGS = ["--config=configs/tiny.py", "--config.train.log_every=1", "--config.optim.decay_steps=40",
        "--config.train.global_batch_size=8", "--config.data.seq_len=64", "--config.checkpoint.every_steps=4"]


def _losses(workdir):
  lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
  return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _logged(workdir):
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return len(path.read_text().splitlines()) if path.exists() else 0


def test_two_process_job_trains_is_killed_resumes_and_matches_one_process(tmp_path):
  run = [*ARGS, f"--config.workdir={tmp_path / 'mp'}", "--config.train.steps=12"]
  procs = multiprocess.start_main(run)
  deadline = time.time() + 240
  while time.time() < deadline and _logged(tmp_path / "mp") < 6 and all(p.poll() is None for p in procs):
    time.sleep(0.05)
  assert _logged(tmp_path / "mp") >= 6, procs[0].err_path.read_text()[-3000:]
  for p in procs:
    p.send_signal(signal.SIGKILL)
  multiprocess.wait_all(procs, 30)
  procs = multiprocess.start_main(run)
  codes = multiprocess.wait_all(procs, 300)
  err = procs[0].err_path.read_text()
  assert codes == [0, 0], err[-3000:]
  assert "resumed from checkpoint step 4" in err or "resumed from checkpoint step 8" in err
  assert "resumed" not in procs[1].err_path.read_text()  # only process 0 prints info lines
  # The host count shrinks: the same workdir goes on as one process with 8 devices, from the 2-process
  # checkpoint, its data position re-split over one process.
  shrunk = _main_one_process(tmp_path / "mp", steps=16)
  assert "resumed from checkpoint step 12" in shrunk and "re-split over 1" in shrunk, shrunk[-2000:]
  _main_one_process(tmp_path / "one", steps=16)
  mp, one = _losses(tmp_path / "mp"), _losses(tmp_path / "one")
  np.testing.assert_allclose([mp[s] for s in range(1, 17)], [one[s] for s in range(1, 17)], rtol=1e-5)


def _main_one_process(workdir, steps):
  r = subprocess.run([sys.executable, "-m", "jaxtrain.main", *ARGS, f"--config.workdir={workdir}",
                      f"--config.train.steps={steps}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  return r.stderr


def test_a_dead_process_fails_the_job_within_60s(tmp_path):
  procs = multiprocess.start_main([*ARGS, f"--config.workdir={tmp_path}", "--config.train.steps=100000"])
  deadline = time.time() + 240
  while time.time() < deadline and _logged(tmp_path) < 3 and all(p.poll() is None for p in procs):
    time.sleep(0.05)
  assert _logged(tmp_path) >= 3, procs[0].err_path.read_text()[-3000:]
  procs[1].send_signal(signal.SIGKILL)
  t = time.time()
  code = multiprocess.wait_all(procs[:1], 90)[0]
  assert code not in (0, None) and time.time() - t < 60, (code, procs[0].err_path.read_text()[-3000:])


def test_unreachable_coordinator_is_a_clear_error(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxtrain.main", *ARGS, f"--config.workdir={tmp_path}",
                      "--config.distributed.coordinator_address=127.0.0.1:1", "--config.distributed.num_processes=2",
                      "--config.distributed.process_id=1", "--config.distributed.timeout_s=5"],
                     cwd=ROOT, capture_output=True, text=True, timeout=120,
                     env={**os.environ, "PYTHONPATH": str(ROOT)})
  errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
  assert "could not join the job at 127.0.0.1:1 within 5s" in errors[0]


def test_dry_run_compiles_and_reports_without_training(tmp_path):
  r = subprocess.run([sys.executable, "-m", "jaxtrain.main", "--config=configs/tiny.py", "--config.dry_run=true",
                      f"--config.workdir={tmp_path / 'dry'}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  info = json.loads(r.stdout.strip().splitlines()[-1])
  assert info["params"] == 853_120 and info["peak_bytes_per_device"] > info["memory_per_device"]["argument"] > 0
  assert info["flops_per_token"] > 6 * 853_120 - 6 * 256 * 128
  assert "dry run: compiled" in r.stderr and not (tmp_path / "dry").exists()



@functools.cache
def _estimate_module():
  spec = importlib.util.spec_from_file_location("estimate", ROOT / "tools" / "estimate.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("config_file,overrides", [
    ("configs/tiny.py", []),
    ("configs/tiny.py:tp", []),
    ("configs/tiny.py", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
    ("configs/cpu_50m.py", ["train.global_batch_size=8"]),
], ids=["tiny-fsdp8", "tiny-fsdp4xtp2", "tiny-2x2x2", "cpu_50m-fsdp8"])
def test_estimate_matches_compiled_memory(config_file, overrides):
  from jaxtrain.data import batch as batch_lib
  from jaxtrain.train import trainer
  estimate = _estimate_module()
  config = estimate.load_config(config_file, overrides)
  predicted = estimate.estimate(config, 8)["params_plus_optimizer_per_device"]
  run = trainer.build(config)
  compiled = trainer.compile_step(run).memory_analysis()
  rows = config.train.global_batch_size // (8 // run.mesh.shape["tensor"])  # batch split over data x fsdp
  batch_bytes = len(batch_lib.KEYS) * rows * config.data.seq_len * 4 + 1  # + the skip flag
  measured = compiled.argument_size_in_bytes - batch_bytes
  assert abs(predicted - measured) / measured < 0.15, (predicted, measured)


def test_launch_scripts_parse():
  import shutil
  import yaml
  for script in ("tools/launch/tpu_vm.sh", "tools/launch/slurm.sbatch"):
    assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0, script
    if shutil.which("shellcheck"):
      assert subprocess.run(["shellcheck", "-S", "error", script], cwd=ROOT).returncode == 0, script
  jobset = yaml.safe_load((ROOT / "tools/launch/k8s_jobset.yaml").read_text())
  assert jobset["kind"] == "JobSet"
  container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
  assert container["command"] == ["python", "-m", "jaxtrain.main"]

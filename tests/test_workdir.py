"""One live run per workdir: a second start is refused while the first is alive, a killed run's lock is taken
over, the lock tells a live holder on another host from a dead one by its beat alone, and a run whose lock was taken
over commits nothing more and stops (the lease's own tests, on object stores: tests/test_store_runs.py)."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from jaxtrain import workdir as workdir_lib
from tests import forked
from tests.test_checkpoint import run_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
# tests/test_checkpoint.py's runs (2 layers of tiny.py, on 2 simulated devices: run_env), checkpointing every 5 steps.
BASE = ["--config=configs/tiny.py", "--config.train.log_every=1", "--config.optim.decay_steps=40",
        "--config.train.global_batch_size=8", "--config.data.seq_len=64", "--config.model.num_layers=2",
        "--config.checkpoint.every_steps=5"]


def _start(workdir, *args):
  return forked.popen(["-m", "jaxtrain.main", *BASE, f"--config.workdir={workdir}", *args], run_env())


def _wait_for(path: pathlib.Path, process: forked.Forked, timeout: float = 300):
  """Until ``path`` exists (an event of the run), failing if the run ends first or the bound passes."""
  deadline = time.monotonic() + timeout
  while not path.exists():
    if process.poll() is not None:
      pytest.fail(f"the run ended (code {process.returncode}) before {path} appeared: "
                  f"{process.err_path.read_text()[-3000:]}")
    assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
    time.sleep(0.1)


def _files(workdir: pathlib.Path) -> dict:
  return {p: p.read_bytes() for p in workdir.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_second_run_on_a_live_workdir_is_refused_and_the_first_finishes(tmp_path):
  first = _start(tmp_path, "--config.train.steps=30")
  try:
    _wait_for(tmp_path / "checkpoints" / "5", first)
    first.send_signal(signal.SIGSTOP)  # alive but frozen: nothing in the workdir can change under us
    before = _files(tmp_path)
    lock = json.loads((tmp_path / "run.lock").read_text())
    assert lock["pid"] == first.pid and lock["host"] == socket.gethostname()
    second = forked.run(["-m", "jaxtrain.main", *BASE, f"--config.workdir={tmp_path}", "--config.train.steps=30"],
                        run_env())
    errors = [line for line in second.stderr.splitlines() if line.startswith("jaxtrain: error:")]
    assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
    assert errors[0] == (f"jaxtrain: error: {tmp_path}: another run is using this workdir (host "
                         f"{socket.gethostname()}, PID {first.pid}, since {lock['since']}); wait for it to finish "
                         "or stop it, or use another --config.workdir; a lock left by a run that was killed is "
                         "taken over automatically (run.lock)")
    assert "Traceback" not in second.stderr
    assert _files(tmp_path) == before
  finally:
    first.send_signal(signal.SIGCONT)
  _, err = first.communicate(timeout=300)
  assert first.returncode == 0, err[-3000:]
  assert "done: step 30/30" in err
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["20", "25", "30"]
  steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert steps == list(range(1, 31))
  assert not (tmp_path / "run.lock").exists()


@pytest.mark.slow
def test_lock_of_a_killed_run_is_taken_over_and_the_restart_resumes(tmp_path):
  first = _start(tmp_path, "--config.train.steps=400")
  _wait_for(tmp_path / "checkpoints" / "5", first)
  first.kill()
  first.communicate(timeout=60)
  assert json.loads((tmp_path / "run.lock").read_text())["pid"] == first.pid  # left behind
  saved = max(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
  restart = forked.run(["-m", "jaxtrain.main", *BASE, f"--config.workdir={tmp_path}",
                        f"--config.train.steps={saved + 2}"], run_env())
  assert restart.returncode == 0, restart.stderr[-3000:]
  assert f"the run that held it (host {socket.gethostname()}, PID {first.pid}, since" in restart.stderr
  assert "is gone; taking over" in restart.stderr
  assert f"resumed from checkpoint step {saved}" in restart.stderr and f"done: step {saved + 2}/" in restart.stderr
  assert not (tmp_path / "run.lock").exists()


def _foreign_lock(workdir: pathlib.Path, **fields) -> dict:
  lock = {"host": "another-host", "pid": 4242, "pid_start": "1", "since": "2026-01-01 00:00:00 UTC",
          "renew_s": 0.2, "beat": 0, "token": "theirs", **fields}
  (workdir / "run.lock").write_text(json.dumps(lock))
  return lock


def test_lock_on_another_host_that_stopped_beating_is_stale(tmp_path, caplog):
  _foreign_lock(tmp_path)
  lock = workdir_lib.WorkdirLock(str(tmp_path), renew_s=0.2).acquire()
  try:
    held = json.loads((tmp_path / "run.lock").read_text())
    assert held["pid"] == os.getpid() and held["token"] != "theirs"
    assert "the run that held it (host another-host, PID 4242" in caplog.text
  finally:
    lock.release()
  assert not (tmp_path / "run.lock").exists()


def test_lock_on_another_host_that_beats_is_alive(tmp_path):
  lock = _foreign_lock(tmp_path)
  stop = threading.Event()

  def beat():  # the other host's renewals
    while not stop.wait(0.1):
      lock["beat"] += 1
      (tmp_path / "run.lock.new").write_text(json.dumps(lock))
      os.replace(tmp_path / "run.lock.new", tmp_path / "run.lock")

  beater = threading.Thread(target=beat)
  beater.start()
  try:
    with pytest.raises(workdir_lib.WorkdirBusy, match="host another-host, PID 4242, since 2026-01-01"):
      workdir_lib.WorkdirLock(str(tmp_path), renew_s=0.2).acquire()
  finally:
    stop.set()
    beater.join()
  assert json.loads((tmp_path / "run.lock").read_text())["token"] == "theirs"


def test_lock_on_this_host_is_judged_by_its_pid(tmp_path):
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
  try:
    start = workdir_lib._process_start(sleeper.pid)
    _foreign_lock(tmp_path, host=socket.gethostname(), pid=sleeper.pid, pid_start=start)
    with pytest.raises(workdir_lib.WorkdirBusy, match=f"PID {sleeper.pid}"):
      workdir_lib.WorkdirLock(str(tmp_path)).acquire()
    # The same PID with another start time is a reused PID, not the holder: stale, taken at once.
    _foreign_lock(tmp_path, host=socket.gethostname(), pid=sleeper.pid, pid_start=str(int(start) - 1))
    workdir_lib.WorkdirLock(str(tmp_path)).acquire().release()
  finally:
    sleeper.kill()
    sleeper.wait()
  _foreign_lock(tmp_path, host=socket.gethostname(), pid=sleeper.pid, pid_start=start)  # now dead
  lock = workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
  lock.release()


def test_an_empty_lock_left_by_a_run_killed_while_creating_it_is_stale(tmp_path):
  (tmp_path / "run.lock").write_text("")
  lock = workdir_lib.WorkdirLock(str(tmp_path)).acquire()
  assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
  lock.release()


def test_a_run_whose_local_lock_was_taken_over_commits_nothing_and_stops(tmp_path):
  """Another host's run took the lock over (it judged this run gone: its beat stopped on a shared filesystem). The
  next checkpoint commit reads the lock back and is refused before its thread has seen anything (the step stays
  uncommitted), the run's fence says lease lost from then on (exit 75), and leaving the workdir touches nothing of
  the other run's. Each commit's meta names its holder."""
  import jax.numpy as jnp
  from jaxtrain import exits
  from jaxtrain.checkpoint import PersistentTier, committed_steps

  state = {"w": jnp.arange(8.0)}
  with pytest.raises(workdir_lib.LeaseLost) as lost:
    with workdir_lib.hold(str(tmp_path)):  # renewed every 10 s: the takeover is not seen before the commit
      lock = workdir_lib.held()
      tier = PersistentTier(tmp_path / "checkpoints", async_save=False, verify=False)  # fenced by the lock held
      tier.save(1, state, None, {}, {}, force=True)
      _foreign_lock(tmp_path, generation=2)
      with pytest.raises(workdir_lib.LeaseLost, match="another run took its lock .run.lock. over .host another-host, "
                         "PID 4242, since 2026-01-01 00:00:00 UTC."):
        tier.save(2, state, None, {}, {}, force=True)
      tier.close()
      workdir_lib.fence()  # as the loop asks before each step
  assert lost.value.cause == exits.LEASE_LOST
  assert committed_steps(tmp_path / "checkpoints") == [1]
  assert (tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp").is_dir()  # written, never committed
  meta = json.loads((tmp_path / "checkpoints" / "1" / "meta" / "metadata").read_text())
  assert meta["lease"] == {"token": lock._token, "generation": 1}
  assert json.loads((tmp_path / "run.lock").read_text())["token"] == "theirs"  # not released: not this run's


def test_a_lock_taken_over_is_seen_by_the_renewal(tmp_path):
  lock = workdir_lib.WorkdirLock(str(tmp_path), renew_s=0.1).acquire()
  assert lock.fence() == {"token": lock._token, "generation": 1}
  _foreign_lock(tmp_path)
  deadline = time.monotonic() + 30
  with pytest.raises(workdir_lib.LeaseLost, match="another run took its lock"):
    while time.monotonic() < deadline:
      lock.fence()
      time.sleep(0.02)
  lock.release()
  assert json.loads((tmp_path / "run.lock").read_text())["token"] == "theirs"

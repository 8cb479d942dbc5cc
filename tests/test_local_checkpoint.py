"""The node-local checkpoint tier (jaxtrain.checkpoint.local): a full disk never ends a run, a rollback never comes
back after a crash, runs sharing a local folder never touch each other's steps, and what an interrupted save leaves
is cleaned up at the next start."""

import errno
import json
import logging as std_logging
import os
import pathlib
import threading

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import config as config_lib
from jaxtrain.checkpoint import local as local_checkpoint
from jaxtrain.metrics import read_records
from jaxtrain.train import trainer
from tests import forked, multiprocess
from tests.conftest import small_config
from tests.test_checkpoint import run_env

# A tiny run on the bundled corpus (tests/test_checkpoint.py's: 2 layers, on 2 simulated devices), every step logged;
# persistent saves at 4, 8 and 12, local ones at every step in between.
BASE = ["--config=configs/tiny.py", "--config.train.log_every=1", "--config.optim.decay_steps=40",
        "--config.train.global_batch_size=8", "--config.data.seq_len=64", "--config.model.num_layers=2",
        "--config.train.steps=12",
        "--config.checkpoint.every_steps=4", "--config.checkpoint.local_every_steps=1"]


def _main(tmp_path, name, *args):
  """``tests/local_tier_main.py`` (jaxtrain.main with the faults and the config flags in ``args``) in
  ``tmp_path/name``, its local tier in ``tmp_path/local`` (shared by every run of a test), its faults recorded in
  ``tmp_path/faults_<name>``."""
  faults = [a for a in args if not a.startswith("--config")]
  flags = [a for a in args if a.startswith("--config")]
  return forked.run(["tests/local_tier_main.py", str(tmp_path / f"faults_{name}"), *faults, *BASE,
                     f"--config.workdir={tmp_path / name}", f"--config.checkpoint.local_dir={tmp_path / 'local'}",
                     *flags], run_env())


def _losses(workdir):
  return {r["step"]: r["loss"] for r in read_records(workdir) if "loss" in r}  # a re-run step keeps its last value


def _run_folder(local, checkpoints) -> pathlib.Path:
  """This process's folder of the local tier of the run whose persistent folder is ``checkpoints``."""
  return pathlib.Path(local) / local_checkpoint.run_key(str(checkpoints)) / "process_0-of-1"


def _steps(folder) -> list[str]:
  return sorted(p.name for p in pathlib.Path(folder).iterdir()) if pathlib.Path(folder).exists() else []


@pytest.mark.slow
def test_a_full_local_disk_never_ends_the_run_and_switches_the_tier_off_after_max_failures(tmp_path):
  reference = _main(tmp_path, "reference")
  assert reference.returncode == 0, reference.stderr[-3000:]
  r = _main(tmp_path, "full", "--full_from=5", "--config.checkpoint.local_max_failures=3")
  assert r.returncode == 0, r.stderr[-3000:]
  # The disk fills at step 5: its write, 6's and 7's fail (each settled at the next local save); after 3 in a row
  # the tier is off: steps 9-11 are not even tried (4, 8 and 12 are the persistent tier's).
  attempts = [int(s) for s in (tmp_path / "faults_full" / "attempts-0").read_text().split()]
  assert attempts == [1, 2, 3, 5, 6, 7]
  folder = _run_folder(tmp_path / "local", tmp_path / "full" / "checkpoints")
  warnings = [line for line in r.stderr.splitlines() if "local checkpoint" in line]
  assert len(warnings) == 2, warnings
  assert f"local checkpoint step 5 not saved to {folder} (OSError: [Errno 28] No space left on device" in warnings[0]
  assert "the run goes on with the persistent tier" in warnings[0]
  assert (f"local checkpoint tier {folder} switched off for the rest of this run: 3 saves in a row failed "
          "(checkpoint.local_max_failures=3)") in warnings[1]
  # Counted in metrics.jsonl: a step's record is logged before its save settles the write before it.
  counts = [rec["checkpoint/local_failures"] for rec in read_records(tmp_path / "full")]
  assert counts == [0] * 6 + [1, 2, 2, 3, 3, 3]
  # Nothing partial is left; the last step every save agreed on stays; the persistent tier has every save.
  assert _steps(folder) == ["3"]
  assert sorted(int(p) for p in _steps(tmp_path / "full" / "checkpoints") if p.isdigit()) == [4, 8, 12]
  assert _losses(tmp_path / "full") == _losses(tmp_path / "reference")


@pytest.mark.slow
def test_a_crash_after_a_rollback_resumes_the_rolled_back_timeline(tmp_path):
  """A transient fault (a NaN at step 7, once) rolls the run back to the persistent step 4; the replay saves the
  local step 5 (which knows that step 7 is bad) and the process is killed at the next local save, long before the
  persistent save of step 8. The abandoned timeline's local step 6 (saved before the fault, not knowing it) must
  not be what the restart resumes: it would train step 7 on the batch that the rollback skipped."""
  rollback = ["--nan_at=7", "--config.monitor.nan_policy=rollback"]
  reference = _main(tmp_path, "reference", *rollback)
  assert reference.returncode == 0, reference.stderr[-3000:]
  assert "rollback at step 7 (a non-finite step): back to checkpoint step 4" in reference.stderr
  crashed = _main(tmp_path, "run", *rollback, "--crash_at=6")
  assert crashed.returncode == -9, crashed.stderr[-3000:]
  assert "rollback at step 7 (a non-finite step): back to checkpoint step 4" in crashed.stderr
  folder = _run_folder(tmp_path / "local", tmp_path / "run" / "checkpoints")
  assert _steps(folder) == ["5"]  # the replay's; the abandoned timeline's 5 and 6 are gone
  assert json.loads((folder / "5" / "meta.json").read_text())["bad_steps"] == [7]
  restarted = _main(tmp_path, "run", *rollback, "--crash_at=6")  # (the faults happened: once per job)
  assert restarted.returncode == 0, restarted.stderr[-3000:]
  assert f"resumed from checkpoint step 5 (local tier, {tmp_path / 'local'})" in restarted.stderr
  assert "non-finite" not in restarted.stderr
  assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")
  assert read_records(tmp_path / "run")[-1]["skipped_steps"] == read_records(tmp_path / "reference")[-1][
      "skipped_steps"] == 2  # step 7 when it failed, and again when the replay skipped its batch


@pytest.mark.slow
def test_a_local_write_failing_on_one_process_of_two_is_deleted_on_both_and_counted_alike(tmp_path):
  """2 processes x 1 device; process 1's local disk is full from step 6 on, process 0's is not. Each failed step is
  settled at the next local save: process 0 deletes its copy, both count it, so the two folders always hold the
  same steps (a restart could never pair a step with one that does not exist) and both switch the tier off
  together."""
  workdir, local = tmp_path / "mp", tmp_path / "local"
  procs = multiprocess.start_main(
      [*BASE[:6], "--config.train.steps=10", "--config.checkpoint.every_steps=4",
       "--config.checkpoint.local_every_steps=1", f"--config.workdir={workdir}",
       f"--config.checkpoint.local_dir={local}"],
      local_devices=1, entry=("tests/local_tier_main.py", str(tmp_path / "faults"), "--full_from=6",
                              "--full_process=1"))
  assert multiprocess.wait_all(procs, 300) == [0, 0], procs[1].err_path.read_text()[-3000:]
  errs = [p.err_path.read_text() for p in procs]
  tier = local / local_checkpoint.run_key(str(workdir / "checkpoints"))
  # Local saves at 1-3, 5-7 and 9 (4, 8 and 10 are persistent): process 1's 6, 7 and 9 fail; 9 is settled at the
  # end of the run, the third failure in a row: the tier is off there, on both.
  assert [int(s) for s in (tmp_path / "faults" / "attempts-1").read_text().split()] == [1, 2, 3, 5, 6, 7, 9]
  assert (f"local checkpoint step 6 not saved to {tier / 'process_1-of-2'} (OSError: [Errno 28] No space left "
          "on device") in errs[1]
  assert f"local checkpoint step 6 not saved to {tier / 'process_0-of-2'} on another process" in errs[0]
  for i, err in enumerate(errs):
    assert f"local checkpoint tier {tier / f'process_{i}-of-2'} switched off" in err, err[-3000:]
  assert _steps(tier / "process_0-of-2") == _steps(tier / "process_1-of-2") == ["5"]
  counts = [r["checkpoint/local_failures"] for r in read_records(workdir)]  # process 0's records
  assert counts == [0] * 7 + [1, 1, 2]


class Crash(Exception):
  """Stands for a process killed at a local save."""


def test_two_runs_sharing_a_local_folder_never_touch_each_others_steps(tmp_path, monkeypatch, caplog):
  configs = {}
  for name in ("a", "b"):
    c = small_config(tmp_path / name, fsdp=8)
    c.train.steps = 8
    c.checkpoint.update(every_steps=4, local_dir=str(tmp_path / "local"), local_every_steps=1)
    configs[name] = c
  save = local_checkpoint.LocalTier.save

  def crash_at_7(self, step, *args, **kwargs):
    if step == 7:
      self.wait()  # 6 committed
      raise Crash()
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(local_checkpoint.LocalTier, "save", crash_at_7)
  with pytest.raises(Crash):
    trainer.train(configs["a"])  # run a: persistent step 4, local steps 5 and 6
  monkeypatch.setattr(local_checkpoint.LocalTier, "save", save)
  folder_a = _run_folder(tmp_path / "local", tmp_path / "a" / "checkpoints")
  assert _steps(folder_a) == ["5", "6"]
  before = {p.name: p.stat().st_mtime_ns for p in folder_a.iterdir()}
  with caplog.at_level("INFO"):
    _, history_b = trainer.train(configs["b"])  # another run on the same local folder, from scratch
  assert "resumed" not in caplog.text
  folder_b = _run_folder(tmp_path / "local", tmp_path / "b" / "checkpoints")
  assert folder_b != folder_a and _steps(folder_b) == ["6", "7"]
  assert {p.name: p.stat().st_mtime_ns for p in folder_a.iterdir()} == before  # run a's steps untouched
  caplog.clear()
  with caplog.at_level("INFO"):
    trainer.train(configs["a"])  # run a again: from its own newest local step
  assert f"resumed from checkpoint step 6 (local tier, {tmp_path / 'local'})" in caplog.text
  losses_a = _losses(tmp_path / "a")
  assert [losses_a[s] for s in range(1, 9)] == [r["loss"] for r in history_b]  # b ran a's config uninterrupted


def _state(mesh, scale: float):
  sharding = NamedSharding(mesh, P("x"))
  return {"w": jax.device_put(scale * np.arange(16, dtype=np.float32).reshape(8, 2), sharding),
          "b": jax.device_put(np.full(3, scale, np.float32), NamedSharding(mesh, P()))}


def _abstract(state):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


@pytest.fixture
def mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))


def test_an_interrupted_saves_leftovers_are_removed_at_the_next_start(tmp_path):
  folder = _run_folder(tmp_path, "/runs/x/checkpoints")
  for name in ("4", "7.tmp", "5.trash", "corrupt-3-1700000000", "6.old", "4.old"):
    (folder / name).mkdir(parents=True)
    (folder / name / "meta.json").write_text("{}")
  other_process = folder.parent / "process_1-of-2"
  other_run = _run_folder(tmp_path, "/runs/y/checkpoints")
  for kept in (other_process / "7.tmp", other_run / "corrupt-3-1700000000"):
    kept.mkdir(parents=True)
  local = local_checkpoint.LocalTier(str(tmp_path), 1, owner="/runs/x/checkpoints")
  assert local.directory == str(folder) and local.enabled
  # 6.old: a step renamed aside by a replace whose new step never came: put back. 4.old: 4 was replaced: deleted.
  assert _steps(folder) == ["4", "6"] and local.steps() == [4, 6]
  assert _steps(other_process) == ["7.tmp"] and _steps(other_run) == ["corrupt-3-1700000000"]  # not this run's


def test_a_replace_whose_rename_fails_keeps_the_old_step(tmp_path, mesh, monkeypatch, caplog):
  local = local_checkpoint.LocalTier(str(tmp_path), 1, owner="run")
  old, new = _state(mesh, 1.0), _state(mesh, 2.0)
  local.save(2, old, None, meta={"step": 2})
  local.wait()
  rename = os.rename

  def failing(src, dst):
    if str(src).endswith("2.tmp"):
      raise OSError(errno.EIO, os.strerror(errno.EIO), src)
    return rename(src, dst)

  monkeypatch.setattr(os, "rename", failing)
  with caplog.at_level("WARNING"):
    local.save(2, new, None, meta={"step": 2})
    local.wait()
  monkeypatch.setattr(os, "rename", rename)
  assert local.failures == 1 and "local checkpoint step 2 not saved" in caplog.text
  assert _steps(local.directory) == ["2"]  # no .tmp, no .old left
  state, meta, _ = checkpoint_lib.Checkpointer([local]).restore(_abstract(old), None)
  assert meta["step"] == 2
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, old)
  # And a replace that works: the new step in, nothing aside.
  local.save(2, new, None, meta={"step": 2})
  local.wait()
  assert _steps(local.directory) == ["2"] and local.failures == 1
  state, _, _ = checkpoint_lib.Checkpointer([local]).restore(_abstract(new), None)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), state, new)


def test_failed_saves_are_counted_warned_once_and_only_max_failures_in_a_row_switch_the_tier_off(
    tmp_path, mesh, monkeypatch, caplog):
  failing = {2, 3, 5, 6, 7}  # two in a row, a success, then three in a row
  savez = np.savez

  def full_disk(file, *args, **kwargs):
    step = int(threading.current_thread().name.rsplit("-", 1)[1])
    if step in failing:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file.name)
    return savez(file, *args, **kwargs)

  monkeypatch.setattr(np, "savez", full_disk)
  local = local_checkpoint.LocalTier(str(tmp_path), 1, keep_last=2, owner="run", max_failures=3)
  state, seen = _state(mesh, 1.0), []
  with caplog.at_level("WARNING"):
    for step in range(1, 10):
      if local.should_save(step):
        local.save(step, state, None, meta={})
      seen.append((local.failures, local.enabled))
    local.wait()
  # Each write is settled at the next save: 2 and 3 fail, 4 resets the streak, 5-7 fail: off at the save of 8.
  assert seen == [(0, True), (0, True), (1, True), (2, True), (2, True), (3, True), (4, True), (5, False),
                  (5, False)]
  warnings = [r.getMessage() for r in caplog.records if r.levelno == std_logging.WARNING]
  assert len(warnings) == 2, warnings
  assert warnings[0].startswith(f"local checkpoint step 2 not saved to {local.directory} (OSError: [Errno 28] No "
                                "space left on device")
  assert warnings[1].startswith(f"local checkpoint tier {local.directory} switched off for the rest of this run: 3 "
                                "saves in a row failed")
  assert local.steps() == [4]  # nothing of the failed writes left; the newest step saved stays
  assert not [p for p in os.listdir(local.directory) if not p.isdigit()]


def test_a_step_that_failed_on_another_process_is_deleted_on_this_one(tmp_path, mesh, monkeypatch, caplog):
  """The processes settle each write together: a step is restorable only if every process wrote it."""
  local = local_checkpoint.LocalTier(str(tmp_path), 1, owner="run")
  state = _state(mesh, 1.0)
  local.save(1, state, None, meta={})
  local.save(2, state, None, meta={})  # settles 1: written everywhere
  monkeypatch.setattr(local_checkpoint, "_everywhere", lambda ok: False)  # another process's write of 2 failed
  with caplog.at_level("WARNING"):
    local.wait()
  assert local.steps() == [1] and local.failures == 1
  assert "local checkpoint step 2 not saved to" in caplog.text and "on another process" in caplog.text


def test_restoring_from_any_tier_deletes_the_newer_local_steps_and_this_runs_other_layouts(tmp_path, mesh):
  local = local_checkpoint.LocalTier(str(tmp_path), 1, keep_last=5, owner="run")
  state = _state(mesh, 1.0)
  for step in (3, 4, 5, 6):
    local.save(step, state, None, meta={})
  old_layout = pathlib.Path(local.run_dir) / "process_0-of-4"
  (old_layout / "9").mkdir(parents=True)
  local.forget_after(4)  # e.g. a rollback to the persistent step 4
  assert local.steps() == [3, 4] and not old_layout.exists()
  assert local.restorable(_abstract(state), newer_than=4) == []


def test_local_max_failures_is_validated(tmp_path):
  c = small_config(tmp_path)
  c.checkpoint.local_max_failures = 0
  with pytest.raises(config_lib.ConfigError, match=r"checkpoint.local_max_failures: must be > 0, got 0"):
    checkpoint_lib.validate(c)

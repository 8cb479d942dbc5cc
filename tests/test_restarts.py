"""The restart budget's records (jaxtrain.restarts): what counts as one restart, what is forgotten, the line a
refused start prints. The whole loop (a launcher, jaxtrain exiting 75 at every start, the stop) is
tests/test_distributed.py's test_the_restart_budget_turns_a_loop_of_restartable_exits_into_one_stop."""

import json

import pytest

from jaxtrain import restarts


@pytest.fixture
def record(monkeypatch):
  """``record(workdir, start, process, cause, at)``: that process's restartable exit, written by restarts.record."""
  def write(workdir, start, process, cause, at):
    monkeypatch.setattr(restarts, "_armed", {})
    restarts.arm(str(workdir), start, process)
    monkeypatch.setattr(restarts.time, "time", lambda: at)
    restarts.record(cause, f"{cause} at {at}")
    monkeypatch.undo()
  return write


def test_a_start_counts_once_however_many_processes_record_it_and_the_last_hour_only(tmp_path, record):
  now = 100_000.0
  record(tmp_path, "0000090000-aa", 0, "lost peer", now - 3700)  # over an hour ago
  for process, cause in ((1, "lost peer"), (0, "hang")):  # one start, two processes: process 0's record speaks
    record(tmp_path, "0000095000-bb", process, cause, now - 1800)
  record(tmp_path, "0000098000-cc", 2, "preempted", now - 60)
  (tmp_path / "restarts" / "0000098000-cc-0.json").write_text('{"time": ')  # cut short by its exit: skipped
  assert json.loads((tmp_path / "restarts" / "0000095000-bb-1.json").read_text())["cause"] == "lost peer"
  assert [(r["cause"], r["process"]) for r in restarts.recent(str(tmp_path), now)] == [("hang", 0), ("preempted", 2)]
  assert restarts.check(str(tmp_path), 2, now) is None and restarts.check(str(tmp_path), 0, now) is None
  line = restarts.check(str(tmp_path), 1, now)
  assert line == ("2 restarts in the last hour (hang x1, preempted x1), more than distributed.max_restarts_per_hour=1: "
                  f"a restart does not cure this; the last: preempted: preempted at {now - 60}. Fix the cause "
                  f"(train.log), then start again after removing {tmp_path / 'restarts'} (or with "
                  "--config.distributed.max_restarts_per_hour=0)")
  restarts.prune(str(tmp_path), now)
  assert sorted(p.name for p in (tmp_path / "restarts").iterdir()) == [
      "0000095000-bb-0.json", "0000095000-bb-1.json", "0000098000-cc-0.json", "0000098000-cc-2.json"]


def test_nothing_is_recorded_before_main_arms_it_and_a_failed_write_does_not_raise(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(restarts, "_armed", {})
  restarts.record("hang", "no workdir yet")  # a run started by the library, not by main: nothing to record
  assert not (tmp_path / "restarts").exists() and restarts.recent(str(tmp_path)) == []
  (tmp_path / "restarts").write_text("a file where the folder should be")
  restarts.arm(str(tmp_path), "0000000001-aa", 0)
  restarts.record("hang", "cannot be written")
  assert "could not record the restartable exit" in caplog.text

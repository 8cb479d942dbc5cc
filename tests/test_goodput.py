"""Goodput (jaxtrain/goodput.py, tools/goodput.py): the account of a timeline worked out by hand, on a local
workdir, on an object store that cannot append (gs:// through etils.epath and fsspec, no bucket) and on workdirs
whose first run an earlier version recorded (locally, and on the store); a failed write made good by a retry; the
tool on a gs:// workdir; a NaN rollback's steps counted as lost in a real run."""

import json
import pathlib

import fsspec
import pytest
from etils import epath
from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem

from jaxtrain import goodput, logs


class ObjectStore(MemoryFileSystem):
  """gs:// in memory, as Cloud Storage behaves for these writes: an object is visible once whole, and there is
  no appending to one (gcsfs refuses mode 'a' too)."""

  protocol = ("gs", "gcs")

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.store, self.pseudo_dirs = {}, [""]  # this instance's own objects (MemoryFileSystem's are class-wide)
    self.fail_writes = 0  # the next N writes raise, as a flaky connection

  @classmethod
  def _strip_protocol(cls, path):
    path = str(path)
    for prefix in ("gs://", "gcs://"):
      path = path.removeprefix(prefix)
    return path.strip("/")

  def _open(self, path, mode="rb", **kwargs):
    if "a" in mode or "+" in mode:
      raise OSError(f"{path}: an object store cannot append")
    if "w" in mode:
      self._fail()
    return super()._open(path, mode, **kwargs)

  def pipe_file(self, path, value, **kwargs):
    self._fail()
    return super().pipe_file(path, value, **kwargs)

  def _fail(self):
    if self.fail_writes:
      self.fail_writes -= 1
      raise OSError("503 Service Unavailable")


@pytest.fixture
def bucket(monkeypatch):
  """Every gs:// path of etils.epath (fsspec's backend, as without TensorFlow) and of fsspec (jaxtrain.logs's
  segments) lands in a fresh ObjectStore."""
  store = ObjectStore(skip_instance_cache=True)
  monkeypatch.setattr(epath_backend.fsspec_backend, "fs", lambda path: store)
  url_to_fs = fsspec.core.url_to_fs
  monkeypatch.setattr(fsspec.core, "url_to_fs", lambda url, **kwargs: (store, store._strip_protocol(url))
                      if str(url).startswith("gs://") else url_to_fs(url, **kwargs))
  return store


class Clock:
  """The time the test says it is."""

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now

  def at(self, t: float) -> "Clock":
    self.now = t
    return self


def _spent(productive, checkpoint, eval_, data_wait) -> dict[str, float]:
  return {"productive": productive, "checkpoint": checkpoint, "eval": eval_, "data_wait": data_wait}


# Run 1 (killed after its last event): the process starts at t=100, the loop at 130 from step 0. Its records, with
# the loop's cumulative seconds (productive, checkpoint, eval, data_wait): step 10 at 150, step 20 (a checkpoint) at
# 170; a NaN rollback at 180, the loop at step 25, back to checkpoint 20; step 30 (a checkpoint) at 200; step 35 at
# 210; then the kill. Run 2 starts at 240, its loop at 270 resuming checkpoint 30 after a 5 s restore; step 40 at
# 290; its end at 295.
RUN_1 = [("start", 100.0, ()), ("ready", 130.0, (0, 0.0)),
         ("progress", 150.0, (10, _spent(15, 2, 0, 1))), ("progress", 170.0, (20, _spent(30, 4, 1, 2))),
         ("rollback", 180.0, (25, 20, _spent(38, 4, 1, 2))),
         ("progress", 200.0, (30, _spent(52, 6, 1, 3))), ("progress", 210.0, (35, _spent(60, 6, 1, 4)))]
RUN_2 = [("start", 240.0, ()), ("ready", 270.0, (30, 5.0)), ("progress", 290.0, (40, _spent(12, 3, 0, 2))),
         ("end", 295.0, (40,))]
# Worked out from that timeline by hand:
BY_HAND = {
    "productive": (15 - 0) + (30 - 15) + (52 - 38) + (12 - 0),  # run 1's stretches up to 20, then 20 -> 30; run 2's
    "lost": (38 - 30) + (60 - 52),  # 20 -> 25 thrown away by the rollback; 30 -> 35 trained again by run 2
    "startup": (130 - 100) + (270 - 240 - 5),
    "restore": 5,
    "checkpoint": 6 + 3,
    "eval": 1 + 0,
    "data_wait": 4 + 2,
    "down": 240 - 210,
    "other": (210 - 130 - (60 + 6 + 1 + 4)) + (295 - 270 - (12 + 3 + 0 + 2)),  # the loops' time not in a record
}
WALL = 295 - 100


def _record(recorder: goodput.Recorder, clock: Clock, events) -> dict | None:
  """Records ``events``; a run without an end is killed once its events are in the store (its stream flushed, as its
  thread does within logs.INTERVAL_S)."""
  summary = None
  for event, t, args in events:
    clock.at(t)
    summary = getattr(recorder, event)(*args)
  if recorder.stream is not None:
    assert recorder.stream.flush(10)
  return summary


def _legacy(workdir: pathlib.Path, events) -> None:
  """The events as an earlier version appended them to goodput.jsonl (it recorded no rollbacks), the last line cut
  short by the kill."""
  lines = []
  for event, t, args in events:
    if event == "rollback":
      continue
    fields = {"start": lambda: {}, "ready": lambda step, restore_s: {"step": step, "restore_s": restore_s},
              "progress": lambda step, spent: {"step": step, **spent}, "end": lambda step: {"step": step}}[event](*args)
    lines.append(json.dumps({"event": event, "t": t, **fields}) + "\n")
  workdir.mkdir(parents=True)
  (workdir / goodput.LEGACY_EVENTS).write_text("".join(lines) + '{"event": "progress", "t": 21')


def _previous_version(workdir: str, events) -> None:
  """The events as the previous version wrote them on a store: whole objects ``goodput/<run>-<part>.jsonl`` of up to
  PART_EVENTS events (2 here, so that the run spans several)."""
  recorded = [{"event": event, "t": t, **fields} for (event, t, _), fields in zip(events, [
      {}, {"step": 0, "restore_s": 0.0}, {"step": 10, **_spent(15, 2, 0, 1)}, {"step": 20, **_spent(30, 4, 1, 2)},
      {"step": 20, "reached": 25, **_spent(38, 4, 1, 2)}, {"step": 30, **_spent(52, 6, 1, 3)},
      {"step": 35, **_spent(60, 6, 1, 4)}])]
  for part in range(0, len(recorded), 2):
    epath.Path(f"{workdir}/goodput/0000000100000-7-0-{part // 2:05d}.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in recorded[part:part + 2]))


@pytest.mark.parametrize("where", ["local", "gs", "earlier_version", "gs_previous_version"])
def test_the_account_equals_a_timeline_worked_out_by_hand(where, tmp_path, request):
  """Two runs (a rollback in the first, a kill after its last event, a restart from an older checkpoint) recorded
  with a fake clock: each part of the account is the value worked out from the timeline by hand. On gs:// (an
  object store that refuses appends: the events as segments); on a workdir whose first run an earlier version
  appended to goodput.jsonl (no rollback there: none lost by one), and on a store whose first run the previous
  version wrote as whole objects."""
  on_store = where.startswith("gs")
  workdir = f"gs://bucket/runs/{where}" if on_store else str(tmp_path / where)
  store = request.getfixturevalue("bucket") if on_store else None
  clock = Clock()
  if where == "earlier_version":
    _legacy(pathlib.Path(workdir), RUN_1)
  elif where == "gs_previous_version":
    _previous_version(workdir, RUN_1)
  else:
    _record(goodput.Recorder(workdir, clock), clock, RUN_1)  # then killed: no end
    first = goodput.read_events(workdir)
    assert [(e["event"], e["t"]) for e in first] == [(event, t) for event, t, _ in RUN_1]  # every event kept
  summary = _record(goodput.Recorder(workdir, clock), clock, RUN_2)
  expected = dict(BY_HAND)
  if where == "earlier_version":  # the rollback's 8 s stay productive (and the 5 steps are not counted)
    expected.update(productive=BY_HAND["productive"] + (38 - 30), lost=BY_HAND["lost"] - (38 - 30))
  assert summary["seconds"] == pytest.approx(expected, abs=1e-9)
  assert summary["wall_s"] == WALL and summary["runs"] == 2
  assert summary["steps_trained_again"] == (35 - 30) + (0 if where == "earlier_version" else 25 - 20)
  assert summary["goodput"] == pytest.approx(expected["productive"] / WALL)
  assert json.loads((epath.Path(workdir) / goodput.SUMMARY).read_text()) == summary
  if where == "gs":  # segments, none appended (the store refuses): the killed run's as written, the ended run's one
    names = sorted(p.rsplit("/", 1)[1] for p in store.store if "/goodput/" in p)
    runs = {}
    for name in names:
      run, _, span = name.removesuffix(".jsonl").partition(".")
      runs.setdefault(run, []).append(span)
    assert len(runs) == 2 and all(len(spans) >= 1 for spans in runs.values()), names
    assert len(runs[max(runs)]) == 1, names  # merged into one object when the run ended


def test_a_failed_write_is_warned_about_once_and_made_good_by_a_retry(bucket, caplog, monkeypatch):
  monkeypatch.setattr(logs, "RETRY_S", (0.01, 0.05))
  clock = Clock()
  recorder = goodput.Recorder("gs://bucket/run", clock)
  bucket.fail_writes = 2
  with caplog.at_level("WARNING"):
    _record(recorder, clock, RUN_1[:3])  # the first two tries fail: warned once; the third writes all three
  assert caplog.text.count("goodput events: could not write to gs://bucket/run/goodput (") == 1, caplog.text
  assert "503 Service Unavailable" in caplog.text and caplog.text.count("answers again after") == 1, caplog.text
  assert [e["event"] for e in goodput.read_events("gs://bucket/run")] == ["start", "ready", "progress"]


def test_the_tool_prints_the_account_of_a_gs_workdir(bucket, tmp_path, monkeypatch, capsys):
  """tools/goodput.py on a gs:// workdir: the one line, the table, --json (the account); a workdir with no run:
  one line, exit 2."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("goodput_tool", pathlib.Path(__file__).parents[1] / "tools" /
                                                "goodput.py")
  tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(tool)
  clock = Clock()
  _record(goodput.Recorder("gs://bucket/run", clock), clock, RUN_1)
  summary = _record(goodput.Recorder("gs://bucket/run", clock), clock, RUN_2)
  monkeypatch.setattr("sys.argv", ["goodput.py", "gs://bucket/run", f"--json={tmp_path / 'account.json'}"])
  tool.main()
  out = capsys.readouterr().out
  assert out.startswith(f"goodput {100 * BY_HAND['productive'] / WALL:.1f}% of 195s over 2 run(s) (badput: ")
  assert "\nlost               16.0     8.2%\n" in out and "\ndown               30.0    15.4%\n" in out, out
  assert json.loads((tmp_path / "account.json").read_text()) == summary
  monkeypatch.setattr("sys.argv", ["goodput.py", "gs://bucket/nothing"])
  with pytest.raises(SystemExit) as exit_:
    tool.main()
  assert exit_.value.code == 2 and capsys.readouterr().err == \
      "goodput: error: gs://bucket/nothing: no run recorded there (no events in goodput/); pass the workdir of a run\n"


def test_a_nan_rollback_counts_the_steps_it_throws_away_as_lost(make_config):
  """Step 5 is non-finite under nan_policy=rollback (checkpoints every 3): the loop, at step 6, goes back to
  checkpoint 3. Its productive time from step 3's record to the rollback is lost, steps 4-6 are trained again."""
  from jaxtrain.train import trainer
  from tests.test_monitor import Poisoned
  config = make_config(fsdp=8)
  config.train.steps = 8
  config.checkpoint.every_steps = 3
  config.monitor.nan_policy = "rollback"
  config.metrics.tensorboard = False
  trainer.train(config, data=Poisoned(4, 32, 256, 16, 0))
  events = goodput.read_events(config.workdir)
  [rollback] = [e for e in events if e["event"] == "rollback"]
  assert (rollback["reached"], rollback["step"]) == (6, 3)
  before = events[:events.index(rollback)]
  at_checkpoint = [e for e in before if e["event"] == "progress" and e["step"] == 3][-1]
  summary = json.loads((pathlib.Path(config.workdir) / goodput.SUMMARY).read_text())
  assert summary["steps_trained_again"] == 6 - 3
  assert summary["seconds"]["lost"] == pytest.approx(rollback["productive"] - at_checkpoint["productive"], abs=1e-9)
  assert summary["seconds"]["lost"] > 0
  final = [e for e in events if e["event"] == "progress"][-1]
  assert final["step"] == 8
  assert summary["seconds"]["productive"] == pytest.approx(final["productive"] - summary["seconds"]["lost"], abs=1e-9)


def test_each_interruption_is_named_by_its_cause(tmp_path):
  """A run that stopped restartably names its cause at its end (a store unreachable) or, exiting at once (a hang, a
  lost peer), through the restart record's listener; a run that said nothing was killed; the last run ended."""
  from jaxtrain import restarts
  t = [100.0]
  clock = lambda: t[0]  # noqa: E731

  def run(ending):
    recorder = goodput.Recorder(str(tmp_path), clock=clock)
    recorder.start()
    recorder.ready(0, 0.0)
    t[0] += 10
    recorder.progress(5, {"productive": 9.0, "checkpoint": 0.0, "eval": 0.0, "data_wait": 0.0})
    ending(recorder)
    t[0] += 5
    restarts.unlisten(recorder.stopped)  # (as the process's exit would: no later run of this test hears it)

  run(lambda r: r.end(5, cause="store unreachable", summarize=False))
  run(lambda r: restarts.record("hang", "no step finished for 60s"))  # the watchdog's exit: no end
  run(lambda r: None)  # SIGKILL
  run(lambda r: r.end(5))
  summary = goodput.account(goodput.read_events(str(tmp_path)))
  assert [i["cause"] for i in summary["interruptions"]] == ["store unreachable", "hang", "killed"]
  assert summary["interrupted_by"] == {"store unreachable": 1, "hang": 1, "killed": 1}
  assert goodput.describe(summary).endswith("; interrupted by hang x1, killed x1, store unreachable x1")

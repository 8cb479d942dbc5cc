"""A workdir and data on an object store (gs:// and s3://, real servers on localhost: tests/object_store.py): the
lock's lease, metrics written whole, prepared and raw data read with the local batches, the README quick start,
kills at random moments and a two-process job, each on the store as on a local disk."""

import collections
import errno
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import fsspec
import numpy as np
import pytest

from jaxtrain import data as data_lib
from jaxtrain import lease as lease_lib
from jaxtrain import logs
from jaxtrain import metrics as metrics_lib
from jaxtrain import workdir as workdir_lib
from jaxtrain.config import base_config
from jaxtrain.errors import DataError, UserError
from jaxtrain.data import batch as batch_lib
from jaxtrain.data import prepare, shard_cache
from tests import forked, object_store
# The local tests' runs, started the same way (forked), with the servers' settings in this process's environment.
from tests.test_checkpoint import BASE, _run, kill_at_random_moments, run_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCHEMES = ("gs", "s3")
# Orbax's TensorStore s3 driver needs the endpoint handed to it (the path layer's work); until then a checkpoint on
# the s3 server hangs, so the runs that checkpoint on s3 wait for it.
# A tiny run on the bundled corpus, every step logged (as tests/test_checkpoint.py's).


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
  """Both servers, started once for the module; their settings (and a shard cache of the module's) in os.environ,
  which the runs started by these tests inherit."""
  saved = os.environ.get(shard_cache.ENV)
  os.environ[shard_cache.ENV] = os.fspath(tmp_path_factory.mktemp("shard-cache"))
  with object_store.serve("gs") as gs, object_store.serve("s3") as s3:
    yield {"gs": gs, "s3": s3}
  if saved is None:
    os.environ.pop(shard_cache.ENV, None)
  else:
    os.environ[shard_cache.ENV] = saved


def _url(servers, scheme, name):
  """A fresh folder on the ``scheme`` server."""
  return servers[scheme].url(f"{name}-{uuid.uuid4().hex[:8]}")


# -- the lock's lease


LEASE_S = 4.0  # renewed every second: a loaded test machine still renews well within it
# A run holding a workdir (as process 0 of a run does) and asking its fence, as the loop does before each step; it
# stops renewing on SIGUSR1 (a renewal thread stuck on a store that no longer answers it), and says so when the fence
# says it lost the workdir (the cause, and its deadline, from when it wrote nothing: the monotonic clock is the
# host's); it stays alive after that, so that a contender cannot tell by its PID.
_HOLDER = """import signal, sys, time
from jaxtrain import workdir
lock = workdir.WorkdirLock(sys.argv[1], lease_s=float(sys.argv[2])).acquire()

def stop_renewing(*_):
  lock._stop.set()
  lock._thread.join()
  print("not renewing", file=sys.stderr, flush=True)

signal.signal(signal.SIGUSR1, stop_renewing)
while True:
  time.sleep(0.05)
  try:
    lock.fence()
  except workdir.LeaseLost as e:
    print(e.cause, lock._lease.deadline(), file=sys.stderr, flush=True)
    time.sleep(600)
"""


class _Clock:
  """jaxtrain.lease's ``time`` with its wall clock ``offset_s`` off (monotonic time and sleep the real ones): the
  contender runs on a host whose clock is ahead or behind the holder's."""

  monotonic, sleep, wall = staticmethod(time.monotonic), staticmethod(time.sleep), staticmethod(time.time)

  def __init__(self, offset_s: float):
    self.offset_s = offset_s

  def time(self) -> float:
    return self.wall() + self.offset_s


def _wait_held(workdir, holder, timeout=60):
  deadline = time.monotonic() + timeout
  while not _fs(workdir).exists(workdir + "/run.lock"):
    assert holder.poll() is None, holder.err_path.read_text()[-3000:]
    assert time.monotonic() < deadline, "the lease was not taken"
    time.sleep(0.05)
  return json.loads(_fs(workdir).cat_file(workdir + "/run.lock"))


@pytest.mark.parametrize("scheme", ["gs"])  # the renewals of a run's thread on gs; on s3: the test below
def test_lease_refuses_a_live_holder_whatever_the_clocks_and_is_taken_over_after_a_lease_unrenewed(servers, scheme,
                                                                                                  monkeypatch):
  """A contender whose clock is 90 s ahead of the holder's is refused at the first renewal it sees (by the old rule,
  expiry judged by its own clock, it took the live lease at once; a clock behind only ever made a contender wait).
  A holder that stops renewing but goes on is taken over once a whole lease passed unrenewed by the contender's own
  monotonic clock, not at once by its clock ahead; the holder's fence said it lost the workdir before that (3/4 of
  a lease after its last renewal)."""
  workdir = _url(servers, scheme, "lease")
  holder = forked.popen(["-c", _HOLDER, workdir, str(LEASE_S)])
  try:
    held = _wait_held(workdir, holder)
    assert held["pid"] == holder.pid and held["generation"] == 1 and held["expires"] > time.time()
    monkeypatch.setattr(lease_lib, "time", _Clock(90.0))  # the holder's expiry is 86 s past by this clock
    t = time.monotonic()
    with pytest.raises(workdir_lib.WorkdirBusy, match="another run is using this workdir.*lease .*renewed"):
      workdir_lib.WorkdirLock(workdir, lease_s=LEASE_S).acquire()
    assert time.monotonic() - t < LEASE_S  # refused at its first renewal seen, not after a lease
    holder.send_signal(signal.SIGUSR1)
    bound = time.monotonic() + 60
    while "not renewing" not in holder.err_path.read_text():
      assert holder.poll() is None and time.monotonic() < bound, holder.err_path.read_text()[-3000:]
      time.sleep(0.05)
    t = time.monotonic()
    successor = workdir_lib.WorkdirLock(workdir, lease_s=LEASE_S).acquire()
    taken = time.monotonic()
    assert LEASE_S <= taken - t < 2.5 * LEASE_S
    monkeypatch.undo()
    held = json.loads(_fs(workdir).cat_file(workdir + "/run.lock"))
    assert held["token"] == successor._token and held["generation"] == successor.generation == 2
    bound = time.monotonic() + 30
    while "lease lost" not in (err := holder.err_path.read_text()):
      assert time.monotonic() < bound, err[-3000:]
      time.sleep(0.05)
    cause, deadline = err.splitlines()[-1].rsplit(" ", 1)
    assert cause == "lease lost" and float(deadline) < t + LEASE_S <= taken, err[-3000:]
    successor.release()
    assert not _fs(workdir).exists(workdir + "/run.lock")
  finally:
    holder.kill()


def test_a_lease_long_expired_or_whose_holder_died_on_this_host_is_taken_at_once(servers):
  """A restart long after a crash (the lease expired by more than the clock allowance), or after its holder died on
  this host (same boot and PID namespace: its PID tells), does not wait a lease; a holder in another PID namespace is
  not judged by a PID that this process cannot see."""
  from jaxtrain.workdir import _pid_space  # what a lease of this host records
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  here = {"host": socket.gethostname(), "pid": dead.pid, **_pid_space(), "pid_start": None}
  for name, content, wait_s in [
      ("expired", {"host": "another-host", "pid": 1, "expires": time.time() - lease_lib.CLOCK_SKEW_S - 60}, 0.0),
      ("gone", here, 0.0),
      ("container", {**here, "pid_ns": "pid:[1]", "lease_s": 1.0}, 1.0)]:
    workdir = _url(servers, "s3", name)
    lease_lib.Store(workdir + "/run.lock").create(json.dumps(
        {"token": "theirs", "generation": 4, "lease_s": 120.0, "expires": time.time() + 120.0, **content}).encode())
    t = time.monotonic()
    lock = workdir_lib.WorkdirLock(workdir, lease_s=LEASE_S).acquire()
    assert wait_s <= time.monotonic() - t < wait_s + 2.0, name
    assert lock.generation == 5 and lock.fence() == {"token": lock._token, "generation": 5}
    lock.release()


def test_only_a_lost_condition_is_a_conflict():
  """A conditional write that lost is told by the store's answer (412, S3's PreconditionFailed), not by the errno
  s3fs gives it (EINVAL), which it gives many other S3 errors too: those propagate."""
  from botocore.exceptions import ClientError
  from s3fs.errors import translate_boto_error

  def s3_error(code, status):
    return translate_boto_error(ClientError({"Error": {"Code": code, "Message": code},
                                             "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"))

  lost, other = s3_error("PreconditionFailed", 412), s3_error("InvalidArgument", 400)
  assert lost.errno == other.errno == errno.EINVAL
  assert lease_lib._precondition_failed(lost) and not lease_lib._precondition_failed(other)
  assert lease_lib._precondition_failed(s3_error("ConditionalRequestConflict", 409))


def test_a_gcsfs_without_the_request_the_lease_makes_is_one_line():
  """The lease's upload on gs:// uses gcsfs's own request method and endpoint, which gcsfs does not document
  (jaxtrain._compat.gcsfs_json_api): a release without them names the feature and the releases it was checked on."""
  from jaxtrain import _compat

  class Elsewhere:  # a gcsfs whose request method moved
    call = None

  with pytest.raises(UserError, match=r"^the workdir's lease on gs://: needs gcsfs.GCSFileSystem.call and ._location "
                     r"\(checked on gcsfs .*\); install a tested gcsfs"):
    _compat.gcsfs_json_api(Elsewhere())


def _lease_of(checkpoints, step):
  """The holder that committed ``step`` (its token and generation), from the step's meta."""
  return json.loads(_fs(checkpoints).cat_file(f"{checkpoints}/{step}/meta/metadata"))["lease"]


def test_a_holder_cut_off_from_its_lease_stops_and_exactly_one_run_commits_after_the_takeover(servers):
  """The holder's connections to the store go silent (its lease's requests through a proxy that stops answering;
  its checkpoint writes still reach the store: the case where only the fence stops a stale writer). Its deadline
  passes 3/4 of a lease after its last renewal: the commit of the save under way is refused (the step stays
  uncommitted), its later saves write nothing, its fence says lease lost. A contender that talks to the store takes
  the lease over after a whole lease, later than the holder's refusal, and commits; every step committed after the
  takeover is the contender's. (s3: its client keeps the endpoint it was made with, so the holder alone goes through
  the proxy in this one process; the lease is the same code on gs, whose writes the tests above cover.)"""
  import jax.numpy as jnp
  from jaxtrain import exits
  from jaxtrain.checkpoint import PersistentTier, committed_steps
  from tests.faults import FaultyStore

  workdir = _url(servers, "s3", "fenced")
  checkpoints, state = workdir + "/checkpoints", {"w": jnp.arange(8.0)}
  with FaultyStore(servers["s3"]) as proxy:
    with proxy.use():
      holder = workdir_lib.WorkdirLock(workdir, lease_s=LEASE_S).acquire()
    tier = PersistentTier(checkpoints, verify=False, fence=holder)  # its writes reach the store directly
    try:
      tier.save(1, state, None, {}, {}, force=True)
      tier.wait()
      proxy.fail("silent")
      tier.save(2, state, None, {}, {}, force=True)  # its commit waits for the lease read, then the deadline refuses
      taken, contender = [], threading.Thread(target=lambda: taken.append(
          (workdir_lib.WorkdirLock(workdir, lease_s=LEASE_S).acquire(), time.monotonic())))
      t = time.monotonic()
      contender.start()
      with pytest.raises(workdir_lib.LeaseLost, match="this run no longer holds its workdir: its lease .run.lock. "
                         "was not renewed for 3s") as lost:
        tier.wait()
      assert lost.value.cause == exits.LEASE_LOST and committed_steps(checkpoints) == [1]
      with pytest.raises(workdir_lib.LeaseLost):
        tier.save(4, state, None, {}, {}, force=True)  # refused before anything is written
      contender.join(3 * LEASE_S)
      (successor, taken_at), = taken
      assert holder._lease.deadline() < t + LEASE_S <= taken_at  # the holder stopped writing before the takeover
      successor_tier = PersistentTier(checkpoints, verify=False, fence=successor)
      for step in (2, 3):  # step 2 again: the holder's uncommitted one is replaced
        successor_tier.save(step, state, None, {}, {}, force=True)
      successor_tier.wait()
      successor_tier.close()
      successor.release()
    finally:
      holder.release()
      tier.close()
  assert committed_steps(checkpoints) == [1, 2, 3] and not _fs(workdir).exists(checkpoints + "/4")
  assert _lease_of(checkpoints, 1) == {"token": holder._token, "generation": 1}
  assert _lease_of(checkpoints, 2) == _lease_of(checkpoints, 3) == {"token": successor._token, "generation": 2}


def test_failed_renewals_are_tried_again_within_the_lease(servers):
  """Renewals that fail (here refused twice, 403) are tried again sooner than every renew_s, and one that goes
  through before the deadline keeps the lease: the run goes on writing."""
  from tests.faults import FaultyStore

  workdir = _url(servers, "s3", "renewals")
  with FaultyStore(servers["s3"]) as proxy:
    with proxy.use():
      holder = workdir_lib.WorkdirLock(workdir, lease_s=LEASE_S).acquire()
    try:
      rule = proxy.fail("denied", match=r"PUT .*run\.lock", times=2)
      start = time.monotonic()
      while not (rule.fired == 2 and holder._lease.confirmed > start):  # two refused, then one through
        assert holder.fence() == {"token": holder._token, "generation": 1}  # as the loop asks before each step
        assert time.monotonic() - start < LEASE_S
        time.sleep(0.02)
      assert holder.fence() and holder._lease.deadline() > time.monotonic()
    finally:
      holder.release()
  assert not _fs(workdir).exists(workdir + "/run.lock")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_conditional_writes_let_exactly_one_contender_win(servers, scheme):
  store = lease_lib.Store(_url(servers, scheme, "cas") + "/run.lock")
  store.create(b'{"token": "a"}')
  with pytest.raises(lease_lib.Conflict):
    store.create(b'{"token": "b"}')
  version = store.read().version
  store.replace(b'{"token": "c"}', version)  # the first to replace the version it read wins ...
  with pytest.raises(lease_lib.Conflict):
    store.replace(b'{"token": "d"}', version)  # ... the second, holding the same version, loses
  assert store.read().content == {"token": "c"}
  # Two runs starting at the same moment on an empty workdir: one holds it, the other is refused.
  workdir = _url(servers, scheme, "race")
  results, go = [], threading.Barrier(2)

  def contend():
    go.wait()
    try:
      results.append(workdir_lib.WorkdirLock(workdir, lease_s=2.0).acquire())
    except workdir_lib.WorkdirBusy as e:
      results.append(e)

  threads = [threading.Thread(target=contend) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  held = [r for r in results if isinstance(r, workdir_lib.WorkdirLock)]
  assert len(held) == 1 and len(results) == 2, results
  held[0].release()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_workdir_in_a_bucket_that_does_not_exist_is_one_line(servers, scheme):
  with pytest.raises(UserError, match=rf"^{scheme}://no-such-bucket-jt/run: taking the workdir's lease \(run.lock\) "
                     r"failed: missing \(.*\); check that the path, or the bucket, exists$"):
    workdir_lib.WorkdirLock(f"{scheme}://no-such-bucket-jt/run").acquire()


def test_a_store_that_refuses_the_lease_is_one_line(servers):
  """The start's lease is judged by the store's answer: refused (403: the credentials' or the bucket's permissions)
  is the user's, one line, exit 2. (What a restart cures is exit 75, by jaxtrain.failures: measured, not run here
  for its time, a reset connection after s3fs's retries 4 s, a 503 7 s, a 429 9 s; gs's 503 and 429 33 s; a silent
  s3 store ~7 minutes of s3fs's read timeouts.)"""
  from tests.faults import FaultyStore

  workdir = _url(servers, "s3", "refused")
  with FaultyStore(servers["s3"]) as proxy, proxy.use():
    proxy.fail("denied", match="run.lock")
    with pytest.raises(UserError, match=rf"^{workdir}: taking the workdir's lease \(run.lock\) failed: denied \(HTTP "
                       r"403: .*\); give this host's credentials access to it"):
      workdir_lib.WorkdirLock(workdir).acquire()


# -- metrics, train.log, goodput events: segments (jaxtrain/logs.py)


def _record(loss):
  return {"loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1e3, "tflops_per_device": 0.1,
          "step_time": 0.1}


def _writer(workdir, start_step=0):
  cfg = metrics_lib.defaults()
  cfg.update(tensorboard=False, progress="log")
  return metrics_lib.MetricWriter(workdir, 10, start_step, cfg, {})


def _segment_names(url):
  fs = _fs(url)
  return sorted(p.rsplit("/", 1)[1] for p in fs.find(fsspec.core.url_to_fs(url)[1]))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_metrics_on_a_store_are_segments_read_back_as_one_file_after_an_earlier_versions(servers, scheme,
                                                                                          monkeypatch):
  """metrics.jsonl on a store: the whole object an earlier version wrote, then each run's records as segments
  (metrics.jsonl.d/), read back as one file in the order the runs started; a live run's records are there within a
  write (flushed here), its writes are merged every COMPACT_OBJECTS, a run that ends leaves one object, and an object
  a merge replaced is read once."""
  workdir = _url(servers, scheme, "metrics")
  fs, path = fsspec.core.url_to_fs(workdir + "/metrics.jsonl")
  fs.pipe_file(path, b'{"step": 1, "loss": 4.5}\n{"step": 2, "loss": 3.5}\n')  # the earlier version's run
  writer = _writer(workdir, start_step=1)  # resumed from step 1: logs step 2 again
  monkeypatch.setattr(logs, "COMPACT_OBJECTS", 2)  # merged every 2 writes (600)
  for step in (2, 3):
    writer.write(step, _record(5.0 - step))
    assert writer.stream.flush(30)  # what the stream's thread does within a second: a live run's records readable
  merged, deadline = [f"{writer.stream.run}.00000000-00000001.jsonl"], time.monotonic() + 30
  while _segment_names(workdir + "/metrics.jsonl.d") != merged:  # the merge follows the second write
    assert time.monotonic() < deadline, _segment_names(workdir + "/metrics.jsonl.d")
    time.sleep(0.05)
  assert [(r["step"], r["loss"]) for r in metrics_lib.read_records(workdir)] == [(1, 4.5), (2, 3.5), (2, 3.0),
                                                                                 (3, 2.0)]
  writer.write(4, _record(1.0))
  writer.close()
  resumed = _writer(workdir, start_step=3)  # a later run logs step 4 again: after the first run's records
  resumed.write(4, _record(0.5))
  resumed.close()
  steps = [(r["step"], r["loss"]) for r in metrics_lib.read_records(workdir)]
  assert steps == [(1, 4.5), (2, 3.5), (2, 3.0), (3, 2.0), (4, 1.0), (4, 0.5)], steps
  assert metrics_lib.read_records(workdir + "/metrics.jsonl") == metrics_lib.read_records(workdir)
  first, second = writer.stream.run, resumed.stream.run
  assert _segment_names(workdir + "/metrics.jsonl.d") == [  # the merged writes, the last one's; one write of the run
      f"{first}.00000000-00000001.jsonl", f"{first}.00000002-00000002.jsonl", f"{second}.00000000-00000000.jsonl"]
  # A merge's leftovers (it writes its object, then deletes those it replaces: a kill may come between) are read
  # once: here the first run's first write again.
  fs.pipe_file(f"{path}.d/{first}.00000000-00000000.jsonl", b'{"step": 2, "loss": 3.0}\n{"step": 3, "loss": 2.0}\n')
  assert [(r["step"], r["loss"]) for r in metrics_lib.read_records(workdir)] == steps


# One outage per stream: each warned about once, the writes never held up, every line written once it answers.
LOG_FAULTS = [("gs", "server_error"), ("s3", "throttled"), ("gs", "reset"), ("s3", "silent")]


@pytest.mark.parametrize("scheme,fault", LOG_FAULTS)
def test_logs_on_a_store_ride_out_its_faults_without_holding_up_the_loop(servers, scheme, fault, caplog,
                                                                         monkeypatch):
  """metrics, train.log and goodput events written while every write of theirs fails (tests/faults.py's proxy: 503,
  429, a reset, a store that never answers): nothing raises, no write() waits for the store, each stream warns once,
  and once the store answers again every record, line and event is there. (Requests bounded at 0.5 s and retried
  every 0.05-0.2 s here, so that the clients' own back-off does not make the test wait.)"""
  from absl import logging
  from jaxtrain import goodput
  from tests import faults
  monkeypatch.setattr(logs, "REQUEST_S", 0.5)
  monkeypatch.setattr(logs, "RETRY_S", (0.05, 0.2))
  failed, put = collections.Counter(), logs.Stream._put  # each stream's failed writes

  def counted(stream, name, text):
    error = put(stream, name, text)
    failed[stream.what] += error is not None
    return error

  monkeypatch.setattr(logs.Stream, "_put", counted)
  streams = ("metrics", "train.log", "goodput events")
  workdir = _url(servers, scheme, f"faults-{fault}")
  with faults.FaultyStore(servers[scheme]) as proxy, proxy.use(), caplog.at_level("WARNING"):
    rule = proxy.fail(fault, match=r"metrics\.jsonl\.d|train\.log\.d|goodput")
    log = workdir_lib.LogFile(workdir).__enter__()
    writer, recorder = _writer(workdir), goodput.Recorder(workdir)
    recorder.start()
    slowest, step = 0.0, 0
    deadline = time.monotonic() + 30
    while min(failed[what] for what in streams) < 2:  # each stream has failed, and failed again when it retried
      assert time.monotonic() < deadline, caplog.text
      step += 1
      t = time.monotonic()
      writer.write(step, _record(1.0 / step))
      logging.warning("line %d for train.log", step)
      recorder.progress(step, {"productive": step, "checkpoint": 0.0, "eval": 0.0, "data_wait": 0.0})
      slowest = max(slowest, time.monotonic() - t)
      time.sleep(0.02)
    assert rule.fired > 0 and slowest < 0.2, slowest  # the loop's side never waited for the store
    for what in streams:
      assert caplog.text.count(f"{what}: could not write to {workdir}/") == 1, caplog.text
    assert "Traceback" not in caplog.text
    proxy.heal()
    writer.close()
    recorder.end(step)
    log.__exit__(None, None, None)
  assert [r["step"] for r in metrics_lib.read_records(workdir)] == list(range(1, step + 1))
  lines = re.findall(r"line (\d+) for train.log", logs.read(workdir + "/train.log"))
  assert lines == [str(i) for i in range(1, step + 1)]
  events = goodput.read_events(workdir)
  assert [e["event"] for e in events] == ["start", *["progress"] * step, "end"], events
  assert caplog.text.count("answers again after") == 3, caplog.text


def test_the_watchdogs_report_and_the_last_records_reach_the_store_before_it_exits(servers, monkeypatch):
  """The watchdog on a store workdir: its report (where the loop is, every thread's stack) goes to train.log's
  stream, and every stream (train.log, metrics) is written before its exit (os._exit, replaced here)."""
  from jaxtrain import monitor
  workdir = _url(servers, "gs", "watchdog")
  exited = []  # (the exit code, train.log and the steps in metrics.jsonl as the store has them then)
  monkeypatch.setattr(os, "_exit", lambda code: exited.append(
      (code, logs.read(workdir + "/train.log"), [r["step"] for r in metrics_lib.read_records(workdir)])))
  with workdir_lib.LogFile(workdir):
    from absl import logging
    logging.warning("the last line before the hang")
    writer = _writer(workdir)
    writer.write(1, _record(2.0))
    writer.write(2, _record(1.5))  # within the second: not written yet
    dog = monitor.Watchdog(min_s=1.0, log_path=workdir_lib.log_path(workdir), describe=lambda: "step 3 dispatched")
    assert dog.log_path == workdir + "/train.log"
    dog._expire(12.5)
    writer.close()
  [(code, log, steps)] = exited
  assert code == monitor.Watchdog.EXIT_CODE and steps == [1, 2]
  assert "the last line before the hang" in log, log
  assert "jaxtrain: watchdog: no step finished for 12.5s (limit 10.0s): step 3 dispatched; stacks" in log, log
  assert "Thread 0x" in log and "in test_the_watchdogs_report" in log, log


def test_a_long_outage_keeps_the_newest_lines_within_the_bound_and_says_how_many_it_dropped(servers, caplog,
                                                                                             monkeypatch):
  """What waits for a store that does not answer is bounded (logs.QUEUE_BYTES, 2 KB here): the oldest lines are
  dropped, counted in a warning; the newest are written once it answers, in order."""
  from tests import faults
  monkeypatch.setattr(logs, "QUEUE_BYTES", 2000)
  monkeypatch.setattr(logs, "REQUEST_S", 0.5)
  monkeypatch.setattr(logs, "RETRY_S", (0.05, 0.2))
  workdir = _url(servers, "s3", "bounded")
  with faults.FaultyStore(servers["s3"]) as proxy, proxy.use(), caplog.at_level("WARNING"):
    rule = proxy.fail("server_error", match=r"metrics\.jsonl\.d")
    stream = logs.Stream(logs.segments(workdir + "/metrics.jsonl"), "metrics", ".jsonl")
    for i in range(100):
      stream.write(json.dumps({"step": i, "pad": "x" * 80}) + "\n")  # 100 bytes a line: 20 fit in the bound
    deadline = time.monotonic() + 30
    while "dropped the oldest" not in caplog.text or not rule.fired:
      assert time.monotonic() < deadline, caplog.text
      time.sleep(0.02)
    proxy.heal()
    assert stream.close(30)
  kept = [r["step"] for r in metrics_lib.read_records(workdir)]
  dropped = sum(int(n) for n in re.findall(r"dropped the oldest (\d+) line", caplog.text))
  assert kept == list(range(100 - len(kept), 100)) and len(kept) + dropped == 100 and len(kept) >= 19, (kept, dropped)


_EXITS = {"sys.exit": "sys.exit(75)",  # the restartable exit of jaxtrain.main
          "leave": "import logging, os; logging.shutdown(); os._exit(75)"}  # its immediate one (main._leave)


@pytest.mark.parametrize("how", sorted(_EXITS))
def test_a_restartable_exit_writes_the_logs_first(servers, how):
  """A process that logged records within the last second and exits 75 (as jaxtrain.main does, normally or at
  once): the records are on the store."""
  workdir = _url(servers, "s3", f"exit-{how}")
  script = ("import sys\nfrom jaxtrain import metrics\n"
            "cfg = metrics.defaults(); cfg.update(tensorboard=False, progress='log')\n"
            f"w = metrics.MetricWriter({workdir!r}, 10, 0, cfg, {{}})\n"
            "for step in range(1, 6):\n"
            f"  w.write(step, {_record(1.0)!r})\n"
            f"{_EXITS[how]}\n")
  r = forked.run(["-c", script], timeout=120)
  assert r.returncode == 75, r.stderr[-3000:]
  assert [rec["step"] for rec in _records(workdir)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_workdir_files_that_runs_add_to_keep_every_line(servers, scheme):
  """samples.jsonl and bad_batches.jsonl grow a few lines at a time: on a store (gcsfs's append mode silently
  overwrites) every line stays."""
  path = _url(servers, scheme, "append") + "/samples.jsonl"
  for i in range(3):
    workdir_lib.append(path, f'{{"step": {i}}}\n')
  assert [r["step"] for r in metrics_lib.read_records(path)] == [0, 1, 2]


# -- data


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  out = tmp_path_factory.mktemp("data") / "shakespeare"
  prepare.prepare(prepare.Options(inputs=[os.fspath(prepare.BUNDLED)], output=os.fspath(out), progress=False,
                                  eval_fraction=0.05))
  return os.fspath(out)


def _upload(local: str, url: str) -> str:
  fs, path = fsspec.core.url_to_fs(url)
  fs.put(local.rstrip("/") + "/", path, recursive=True)
  return url


def _config(**data):
  c = base_config()
  c.data.update(seq_len=64, **data)
  c.train.global_batch_size = 8
  return c


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for k in batch_lib.KEYS + ("doc_ids",):
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _same_stream_and_resume(local_config, store_config):
  """The store's stream equals the local one, and resumes exactly from a state saved mid-way."""
  it = data_lib.open_train(store_config)
  first = _take(it, 4)
  state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
  rest = _take(it, 4)
  data_lib.close(it)
  local = data_lib.open_train(local_config)
  _assert_same(first + rest, _take(local, 8))
  data_lib.close(local)
  resumed = data_lib.open_train(store_config)
  resumed.set_state(state)
  _assert_same(_take(resumed, 4), rest)
  data_lib.close(resumed)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prepared_data_on_a_store_gives_the_local_batches_and_resumes_exactly(servers, scheme, prepared,
                                                                                tmp_path, monkeypatch):
  monkeypatch.setenv(shard_cache.ENV, os.fspath(tmp_path / "cache"))
  url = _upload(prepared, _url(servers, scheme, "prepared"))
  _same_stream_and_resume(_config(path=prepared), _config(path=url))
  # Read from this host's copies of the shards, named by their digests in the manifest.
  manifest = json.loads(pathlib.Path(prepared, "manifest.json").read_text())
  assert sorted(os.listdir(tmp_path / "cache")) == sorted(s["sha256"] + ".array_record"
                                                          for s in manifest["shards"])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_corrupt_shard_on_a_store_is_one_line(servers, scheme, prepared, tmp_path, monkeypatch):
  monkeypatch.setenv(shard_cache.ENV, os.fspath(tmp_path / "cache"))
  url = _upload(prepared, _url(servers, scheme, "corrupt"))
  fs, path = fsspec.core.url_to_fs(url + "/train-00000-of-00001.array_record")
  data = bytearray(fs.cat_file(path))
  data[100] ^= 0xFF
  fs.pipe_file(path, bytes(data))
  manifest = json.loads(pathlib.Path(prepared, "manifest.json").read_text())
  with pytest.raises(DataError, match="train-00000-of-00001.array_record: shard checksum does not match the "
                     "manifest"):
    data_lib.open_train(_config(path=url))
  train = next(s["sha256"] for s in manifest["shards"] if s["split"] == "train")
  assert not any(name.startswith(train) for name in os.listdir(tmp_path / "cache"))  # no copy of it kept


def test_a_manifest_whose_names_leave_its_folder_is_one_line_before_anything_is_written(servers, prepared, tmp_path,
                                                                                        monkeypatch):
  """A manifest on a shared bucket names each shard's file (a path under the data folder) and its digest (the name
  of this host's copy): a name that would be a path elsewhere, or a digest that is not one, is a one-line DataError
  (exit 2 from jaxtrain.main) before any shard is read or copied."""
  monkeypatch.setenv(shard_cache.ENV, os.fspath(tmp_path / "cache"))
  url = _upload(prepared, _url(servers, "s3", "hostile"))
  fs, path = fsspec.core.url_to_fs(url + "/manifest.json")
  manifest = json.loads(fs.cat_file(path))
  entry = next(i for i, s in enumerate(manifest["shards"]) if s["split"] == "train")
  for key, value, message in [
      ("sha256", "../escaped", "gives train-00000-of-00001.array_record the sha256 '../escaped', not a SHA-256 hex"),
      ("sha256", manifest["shards"][entry]["sha256"].upper(), "not a SHA-256 hex digest"),
      ("file", "../../elsewhere/train.array_record", "names the shard '../../elsewhere/train.array_record', not a "
                                                     "file name in its folder"),
      ("file", "/etc/passwd", "names the shard '/etc/passwd', not a file name in its folder"),
      ("bytes", "-1", "the size '-1', not a byte count")]:
    fs.pipe_file(path, json.dumps({**manifest, "shards": [
        {**s, key: value} if i == entry else s for i, s in enumerate(manifest["shards"])]}).encode())
    with pytest.raises(DataError) as e:
      data_lib.open_train(_config(path=url))
    assert str(e.value).startswith(f"{url}/manifest.json: ") and message in str(e.value), e.value
    assert "\n" not in str(e.value) and "re-run tools/prepare_data.py" in str(e.value)
  assert not (tmp_path / "cache").exists() and not (tmp_path / "escaped.array_record").exists()  # nothing written
  # This host's copies take their names from the manifest only through that check.
  with pytest.raises(DataError, match="not a SHA-256 hex digest"):
    shard_cache.local_copy(url + "/train-00000-of-00001.array_record",
                           {**manifest["shards"][entry], "sha256": "../escaped"})
  assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_raw_files_on_a_store_give_the_local_batches_and_resume_exactly(servers, scheme, tmp_path):
  from tests.test_stream import _paragraphs, _write
  docs = _paragraphs()[:400]
  for kind in ("jsonl", "parquet", "text"):
    local = _write(tmp_path / kind, kind, docs)
    url = _upload(os.fspath(local), _url(servers, scheme, f"raw-{kind}"))
    _same_stream_and_resume(_config(source="raw", path=os.fspath(local)), _config(source="raw", path=url))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_bundled_corpus_cache_on_a_store(servers, scheme, tmp_path, monkeypatch):
  monkeypatch.setenv(shard_cache.ENV, os.fspath(tmp_path / "cache"))
  cache = _url(servers, scheme, "cache")
  _same_stream_and_resume(_config(cache_dir=os.fspath(tmp_path / "local")), _config(cache_dir=cache))
  fs, _ = fsspec.core.url_to_fs(cache)
  assert [p.rsplit("/", 1)[1] for p in fs.glob(cache + "/tinyshakespeare-*/manifest.json")] == ["manifest.json"]


# -- runs: python -m jaxtrain.main with its workdir (and checkpoints) on the store


def _fs(url):
  fs, _ = fsspec.core.url_to_fs(url)
  fs.invalidate_cache()  # a listing cached in this process would hide what the run wrote since
  return fs


def _records(workdir):
  _fs(workdir)
  return metrics_lib.read_records(workdir)


def _losses(workdir):
  return {r["step"]: r["loss"] for r in _records(workdir)}  # a re-run step keeps its last value


def _committed(checkpoints):
  """The steps whose checkpoint is committed (Orbax on an object store marks it with commit_success.txt)."""
  if "://" not in os.fspath(checkpoints):
    root = pathlib.Path(checkpoints)
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []
  fs = _fs(checkpoints)
  return sorted(int(p.rstrip("/").split("/")[-2]) for p in fs.glob(checkpoints + "/*/commit_success.txt")
                if p.rstrip("/").split("/")[-2].isdigit())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The reference: 20 steps on a local disk."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _run(workdir, "--config.train.steps=20")
  return {r["step"]: r["loss"] for r in metrics_lib.read_records(workdir)}


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quick_start_with_its_workdir_on_a_store(servers, scheme, uninterrupted, tmp_path):
  """The README's quick start with --config.workdir on the store: trains, checkpoints, resumes on the second
  start; the end line, metrics, goodput, TensorBoard and config.json as on a local disk; the tools read them."""
  workdir = _url(servers, scheme, "runs/tiny")
  err = _run(workdir, "--config.train.steps=6", "--config.checkpoint.every_steps=3")
  assert f"done: step 6/6, loss {uninterrupted[6]:.4f}" in err and f"checkpoint {workdir}/checkpoints/6" in err
  assert "goodput" in err and "over 1 run(s)" in err, err[-2000:]
  err = _run(workdir, "--config.train.steps=10", "--config.checkpoint.every_steps=3")
  assert "resumed from checkpoint step 6" in err, err[-3000:]
  end = next(line for line in err.splitlines() if "done: step 10/10" in line)
  assert (f"checkpoint {workdir}/checkpoints/10, metrics {workdir}/metrics.jsonl, TensorBoard {workdir}/tensorboard; "
          "goodput " in end and "over 2 run(s)" in end and f"({workdir}/goodput.json)" in end), end
  assert _losses(workdir) == {s: uninterrupted[s] for s in range(1, 11)}  # bitwise the local run's
  fs = _fs(workdir)
  summary = json.loads(fs.cat_file(workdir + "/goodput.json"))
  assert summary["runs"] == 2 and 0 < summary["goodput"] < 1
  assert json.loads(fs.cat_file(workdir + "/config.json"))["workdir"] == workdir
  assert fs.glob(workdir + "/tensorboard/events.out.tfevents.*")
  log = logs.read(workdir + "/train.log")  # process 0's log lines, both runs', as segments
  assert "resumed from checkpoint step 6" in log and "done: step 10/10" in log, log[-3000:]
  assert not fs.exists(workdir + "/run.lock")  # released at the end
  # The tools as commands (forked: tests/forked.py).
  out = forked.run(["tools/goodput.py", workdir, f"--json={tmp_path / 'g.json'}"], timeout=120)
  assert out.returncode == 0 and json.loads((tmp_path / "g.json").read_text())["runs"] == 2, out.stderr[-2000:]
  out = forked.run(["tools/plot_metrics.py", workdir, f"--out={tmp_path / 'm.png'}"], timeout=120)
  assert out.returncode == 0 and (tmp_path / "m.png").stat().st_size > 1000, out.stderr[-2000:]
  # The command the end line prints: the plot next to the metrics, on the store.
  plot = re.search(r"plot: python (tools/plot_metrics.py \S+ --out=\S+)", end).group(1).split()
  out = forked.run(plot, timeout=120)
  assert out.returncode == 0 and _fs(workdir).size(workdir + "/metrics.png") > 1000, out.stderr[-2000:]


def _wait_logged(workdir, process, steps, timeout=300):
  deadline = time.monotonic() + timeout
  while len(_records(workdir)) < steps:
    if process.poll() is not None:
      pytest.fail(f"the run ended ({process.returncode}) early: {process.err_path.read_text()[-3000:]}")
    assert time.monotonic() < deadline, f"{steps} steps not logged within {timeout}s"
    time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3"])  # end to end on one store: the lease's own tests above run on both
def test_a_second_run_is_refused_and_a_run_cut_off_from_its_lease_stops_and_its_restart_takes_over(servers, scheme,
                                                                                                   tmp_path):
  """The workdir's lock on the store: refused in one line (exit 2) while the first run renews its lease. Then the
  first run's lease requests go unanswered (its connections to the store pass a proxy, which stops answering them):
  the loop stops at its first step past the lease's deadline (no checkpoint is due: only the loop's fence can stop
  it) and the run exits 75 with its cause (lease lost), one line, recorded for the restart budget; the next start
  takes the lease over (its holder gone from this host: at once). (Checkpoints on a local disk here: this is about
  the workdir; the other tests checkpoint on the store.)"""
  from tests.faults import FaultyStore

  workdir = _url(servers, scheme, "lock")
  args = ["--config.workdir_lease_s=4", "--config.checkpoint.every_steps=0", f"--config.checkpoint.dir={tmp_path}"]
  with FaultyStore(servers[scheme]) as proxy:
    first = forked.popen(["-m", "jaxtrain.main", *BASE, f"--config.workdir={workdir}", "--config.train.steps=100000",
                          *args], {**run_env(), **proxy.env})
    try:
      _wait_logged(workdir, first, 3)
      held = json.loads(_fs(workdir).cat_file(workdir + "/run.lock"))
      second = forked.run(["-m", "jaxtrain.main", *BASE, f"--config.workdir={workdir}", "--config.train.steps=500",
                           *args], run_env())
      errors = [line for line in second.stderr.splitlines() if line.startswith("jaxtrain: error:")]
      assert second.returncode == 2 and len(errors) == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
      assert errors[0].startswith(f"jaxtrain: error: {workdir}: another run is using this workdir (host "
                                  f"{held['host']}, PID {first.pid}, since {held['since']}); its lease (run.lock) is "
                                  "renewed; wait for it to finish"), errors[0]
      assert first.poll() is None  # untouched
      proxy.fail("silent", match=r"^\w+ [^ ]*/run\.lock")  # the lease's requests (not a log line naming it)
      _, err = first.communicate(timeout=120)
    finally:
      first.kill()
  stopped = [line for line in err.splitlines() if line.startswith("jaxtrain: ")]
  assert first.returncode == 75 and "Traceback" not in err, err[-3000:]
  assert stopped == [f"jaxtrain: stopped: lease lost: {workdir}: this run no longer holds its workdir: its lease "
                     "(run.lock) was not renewed for 3s, after which another run may take it over (the store did not "
                     "answer); it stopped before writing more, so that no two runs write the workdir; restart the "
                     "same command to resume (exit 75)"], err[-3000:]
  recorded = [json.loads(_fs(workdir).cat_file(p)) for p in _fs(workdir).find(workdir + "/restarts")]
  assert [r["cause"] for r in recorded] == ["lease lost"], recorded
  err = _run(workdir, "--config.train.steps=2", *args)
  assert f"(host {held['host']}, PID {first.pid}, since {held['since']}) is gone (its process no longer runs on this " \
         "host); taking over" in err, err[-3000:]
  assert not _fs(workdir).exists(workdir + "/run.lock")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3"])  # the slowest end-to-end runs take one store each: the kills s3, the
def test_kills_at_ten_random_moments_resume_exactly(servers, scheme, uninterrupted):
  """SIGKILL after a random 1-3 new steps (plus jitter) nine times, and once while an async save to the store is in
  flight; every start resumes from the newest committed checkpoint on the store (taking the killed run's lease over)
  and the final loss is bitwise the uninterrupted local run's."""
  workdir = _url(servers, scheme, "kills")
  checkpoints = workdir + "/checkpoints"
  # A lease of 4 s (renewed every second): a run whose renewals all failed for 3 s would stop. Each start takes the
  # killed run's lease over at once: its holder is gone from this host.
  args = ["--config.train.steps=20", "--config.checkpoint.every_steps=2", f"--config.workdir_lease_s={LEASE_S:g}"]
  # The store's metrics arrive as segments at most once a second, which a kill inside the save may come before. Each
  # look at the steps logged is a few requests to the store's server: every 0.25 s (local files: every 0.02 s).
  kill_at_random_moments(workdir, args, 10, 4, lambda: _committed(checkpoints),
                         lambda: [r["step"] for r in _records(workdir)], logged_in_save=False, poll_s=0.25)
  newest = _committed(checkpoints)
  err = _run(workdir, *args)
  # The store's metrics arrive up to a flush interval late, so the last kill can come after step 20 committed (the
  # run was still shutting down): the restart then says it is done instead.
  if newest and newest[-1] < 20:
    assert f"resumed from checkpoint step {newest[-1]}" in err
  elif newest:
    assert "is already at step 20 (train.steps=20): nothing to train" in err, err[-2000:]
  assert _committed(checkpoints)[-1] == 20
  assert _losses(workdir)[20] == uninterrupted[20]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["gs"])  # two-process job gs (tests/test_store_checkpoint.py saves on both)
def test_a_two_process_job_on_the_store_restarted_after_a_kill_gives_the_uninterrupted_losses(servers, scheme,
                                                                                              prepared, tmp_path):
  """2 processes x 4 devices, the workdir, the persistent checkpoint tier and the data on the store, the local tier
  on disk: process 1 is killed, process 0 exits restartably (75), the job started again resumes, and every loss is
  bitwise that of the same job run uninterrupted on a local disk."""
  from tests import multiprocess
  end = 9
  common = [*BASE, "--config.checkpoint.every_steps=3", f"--config.train.steps={end}"]

  def job(*args):
    procs = multiprocess.start_main([*common, *args], local_devices=4)
    return procs, multiprocess.wait_all(procs, 300)

  reference = tmp_path / "reference"
  procs, codes = job(f"--config.workdir={reference}", f"--config.data.path={prepared}")
  assert codes == [0, 0], procs[0].err_path.read_text()[-3000:]
  workdir = _url(servers, scheme, "two-processes")
  data = _upload(prepared, _url(servers, scheme, "two-processes-data"))
  run = [f"--config.workdir={workdir}", f"--config.data.path={data}", f"--config.workdir_lease_s={LEASE_S:g}",
         f"--config.checkpoint.local_dir={tmp_path / 'local'}", "--config.checkpoint.local_every_steps=1"]
  procs = multiprocess.start_main([*common, *run], local_devices=4)
  deadline = time.monotonic() + 300
  while not _committed(workdir + "/checkpoints") or len(_records(workdir)) < 4:
    assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
        procs[0].err_path.read_text()[-3000:]
    time.sleep(0.2)
  procs[1].send_signal(signal.SIGKILL)  # a host lost
  assert multiprocess.wait_all(procs, 120) == [75, -9], procs[0].err_path.read_text()[-3000:]
  procs, codes = job(*run)  # the scheduler starts the job again on exit 75
  err = procs[0].err_path.read_text()
  assert codes == [0, 0] and "resumed from checkpoint step" in err, err[-3000:]
  assert _losses(workdir) == {r["step"]: r["loss"] for r in metrics_lib.read_records(reference)}

"""A workdir and data on an object store (gs:// and s3://, real servers on localhost: tests/object_store.py): the
lock's lease, metrics written whole, prepared and raw data read with the local batches, the README quick start,
kills at random moments and a two-process job, each on the store as on a local disk."""

import json
import os
import pathlib
import re
import signal
import threading
import time
import uuid

import fsspec
import numpy as np
import pytest

from jaxtrain import data as data_lib
from jaxtrain import lease as lease_lib
from jaxtrain import metrics as metrics_lib
from jaxtrain import workdir as workdir_lib
from jaxtrain.config import base_config
from jaxtrain.errors import DataError, UserError
from jaxtrain.data import batch as batch_lib
from jaxtrain.data import prepare, shard_cache
from tests import forked, object_store
# The local tests' runs, started the same way (forked), with the servers' settings in this process's environment.
from tests.test_checkpoint import BASE, _run, _start, kill_at_random_moments, run_env

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


@pytest.mark.parametrize("scheme", SCHEMES)
def test_lease_refuses_a_live_holder_and_is_taken_over_once_expired(servers, scheme):
  workdir = _url(servers, scheme, "lease")
  holder = workdir_lib.WorkdirLock(workdir, lease_s=LEASE_S).acquire()
  try:
    held = json.loads(fsspec.open(workdir + "/run.lock").open().read())
    assert held["token"] == holder._token and held["expires"] > time.time()
    t = time.monotonic()
    with pytest.raises(workdir_lib.WorkdirBusy, match="another run is using this workdir.*lease .*renewed"):
      workdir_lib.WorkdirLock(workdir, lease_s=LEASE_S).acquire()
    assert time.monotonic() - t < LEASE_S  # refused at its first renewal seen, not after a lease
    # The holder dies without a word (its renewals stop): its lease is taken over once it has expired.
    holder._stop.set()
    holder._thread.join(5)
    holder._thread = None
    stopped = time.time()
    successor = workdir_lib.WorkdirLock(workdir, lease_s=LEASE_S).acquire()
    assert LEASE_S / 2 < time.time() - stopped < 2.5 * LEASE_S
    held = json.loads(fsspec.open(workdir + "/run.lock").open().read())
    assert held["token"] == successor._token
    successor.release()
    assert not fsspec.core.url_to_fs(workdir)[0].exists(workdir + "/run.lock")
  finally:
    holder._stop.set()


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
  with pytest.raises(UserError, match=rf"^{scheme}://no-such-bucket-jt/run: the workdir's lease \(run.lock\) cannot "
                     "be read or written .*; check the URL, and the store's endpoint and credentials"):
    workdir_lib.WorkdirLock(f"{scheme}://no-such-bucket-jt/run").acquire()


# -- metrics


@pytest.mark.parametrize("scheme", SCHEMES)
def test_metrics_on_a_store_are_whole_objects_that_a_resumed_run_extends(servers, scheme):
  workdir = _url(servers, scheme, "metrics")
  cfg = metrics_lib.defaults()
  cfg.update(tensorboard=False, progress="log")
  record = lambda loss: {"loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1e3,  # noqa: E731
                         "tflops_per_device": 0.1, "step_time": 0.1}
  writer = metrics_lib.MetricWriter(workdir, 10, 0, cfg, {})
  for step in (1, 2, 3):
    writer.write(step, record(5.0 - step))
    # Each record is in the object when write returns: nothing is buffered past it.
    assert [r["step"] for r in metrics_lib.read_records(workdir)] == list(range(1, step + 1))
  writer.close()
  resumed = metrics_lib.MetricWriter(workdir, 10, 2, cfg, {})  # a run resumed from step 2 logs step 3 again
  resumed.write(3, record(1.5))
  resumed.close()
  assert [(r["step"], r["loss"]) for r in metrics_lib.read_records(workdir)] == [(1, 4.0), (2, 3.0), (3, 2.0),
                                                                                 (3, 1.5)]


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
def test_a_second_run_is_refused_and_a_killed_runs_lease_is_taken_over(servers, scheme, tmp_path):
  """The workdir's lock on the store: refused in one line (exit 2) while the first run renews its lease; after a
  SIGKILL, the next start takes the lease over once it has expired and resumes. (Checkpoints on a local disk here:
  this is about the workdir; the other tests checkpoint on the store.)"""
  workdir = _url(servers, scheme, "lock")
  args = ["--config.workdir_lease_s=4", "--config.checkpoint.every_steps=2", f"--config.checkpoint.dir={tmp_path}"]
  first = _start(workdir, "--config.train.steps=500", *args)
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
  finally:
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
  killed = time.monotonic()
  saved = _committed(tmp_path)
  target = (saved[-1] if saved else 0) + 2
  err = _run(workdir, f"--config.train.steps={target}", *args)
  assert "expired; taking over" in err, err[-3000:]
  assert time.monotonic() - killed > 3.0  # not before the lease ran out
  if saved:
    assert f"resumed from checkpoint step {saved[-1]}" in err
  assert not _fs(workdir).exists(workdir + "/run.lock")


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["s3"])  # the slowest end-to-end runs take one store each: the kills s3, the
def test_kills_at_ten_random_moments_resume_exactly(servers, scheme, uninterrupted):
  """SIGKILL after a random 1-3 new steps (plus jitter) nine times, and once while an async save to the store is in
  flight; every start resumes from the newest committed checkpoint on the store (after the killed run's lease
  expires) and the final loss is bitwise the uninterrupted local run's."""
  workdir = _url(servers, scheme, "kills")
  checkpoints = workdir + "/checkpoints"
  # A lease of 1 s (renewed every 0.25 s): no run contends with a live one here, so a late renewal loses nothing.
  args = ["--config.train.steps=20", "--config.checkpoint.every_steps=2", "--config.workdir_lease_s=1"]
  # The store's metrics object is rewritten at each flush, which a kill inside the save may come before. Each look at
  # the steps logged is a request to the store's server: every 0.1 s (local files are read every 0.02 s).
  kill_at_random_moments(workdir, args, 10, 4, lambda: _committed(checkpoints),
                         lambda: [r["step"] for r in _records(workdir)], logged_in_save=False, poll_s=0.1)
  newest = _committed(checkpoints)
  err = _run(workdir, *args)
  if newest:
    assert f"resumed from checkpoint step {newest[-1]}" in err
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
  run = [f"--config.workdir={workdir}", f"--config.data.path={data}", "--config.workdir_lease_s=3",
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

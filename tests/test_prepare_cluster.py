"""Data preparation on a cluster engine (tools/prepare_data.py --runner=DaskRunner): a real Dask scheduler and two
worker processes on localhost, started here. The shards and manifest are the bytes of the in-process run; the work
runs in the workers, by the scheduler's own account; a worker killed inside a pipeline task is replaced, its work
redone by the engine, and the output is still the same bytes. The first run reads its input from and writes its
output to an S3 store on localhost (tests/object_store.py), as a cluster's workers share a bucket."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import types

import pytest
from etils import epath

from jaxtrain.data import prepare
from jaxtrain.errors import DataError
from tests import object_store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("apache_beam.runners.dask.dask_runner", reason="needs apache-beam and dask[distributed] "
                    "(pip install -e '.[test]')")
pytest.importorskip("datasketch", reason="near-duplicate removal needs datasketch (pip install -e '.[test]')")
distributed = pytest.importorskip("distributed")
portpicker = pytest.importorskip("portpicker")

_FILES = 6
_OPTIONS = ["--seed=5", "--eval_fraction=0.2", "--shard_mib=0.01", "--near_dup_threshold=0.7"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """Six JSONL and text files of documents, some repeated across files (exact duplicates) and some planted again
  with a few words changed (near duplicates); returns (folder, the in-process run's files by name)."""
  rng = random.Random(3)
  vocab = [f"w{i}" for i in range(3000)] + ["café", "数据"]
  docs = [" ".join(rng.choice(vocab) for _ in range(rng.randint(20, 150))) for _ in range(240)]
  near = []
  for d in docs[:6]:
    words = d.split()
    words[len(words) // 2] = "changed"
    near.append(" ".join(words))
  folder = tmp_path_factory.mktemp("raw")
  for i in range(_FILES):
    mine = docs[i::_FILES] + docs[i + 1:i + 3] + near[i:i + 1]
    if i % 2:
      (folder / f"part-{i}.txt").write_text("\n\n".join(mine) + "\n")
    else:
      (folder / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in mine))
  reference = tmp_path_factory.mktemp("reference") / "out"
  manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(folder)], output=os.fspath(reference), seed=5,
                                             eval_fraction=0.2, shard_mib=0.01, near_dup_threshold=0.7,
                                             progress=False))
  assert manifest["duplicates_removed"] > 0 and manifest["near_duplicates_removed"] > 0
  assert len(manifest["shards"]) > 3
  return folder, _files(reference)


def _files(folder) -> dict:
  """Every file of ``folder`` (local or on a store) by name."""
  folder = epath.Path(folder)
  return {p.name: p.read_bytes() for p in sorted(folder.iterdir(), key=lambda p: p.name)}


def _stop(procs) -> None:
  """SIGTERM to each process group started here, SIGKILL to those still alive 10 s later."""
  for p in procs:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  for p in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait(timeout=10)


@pytest.fixture(scope="module")
def store():
  """An S3 server on localhost, its endpoint and keys in the environment the cluster's processes start with."""
  with object_store.serve("s3") as s3:
    yield s3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, store):
  """``dask scheduler`` and two ``dask worker`` processes (one process, one thread each, under a nanny that
  restarts a worker process that dies) on localhost, their logs in files; the workers preload tests/dask_hold.py
  and reach ``store``."""
  folder = tmp_path_factory.mktemp("dask")
  hold = folder / "hold"
  hold.mkdir()
  address = f"tcp://127.0.0.1:{portpicker.pick_unused_port()}"
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
         "JAXTRAIN_TEST_HOLD": os.fspath(hold)}
  procs, client = [], None

  def start(name, *args):
    with open(folder / f"{name}.log", "w") as log:
      procs.append(subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=ROOT, start_new_session=True))

  try:
    # Should the teardown never run: the scheduler ends after 300 s without a task, a worker 60 s after it.
    start("scheduler", "distributed.cli.dask_scheduler", "--host=127.0.0.1", f"--port={address.rsplit(':', 1)[1]}",
          "--no-dashboard", "--idle-timeout=300s")
    for i in (1, 2):
      start(f"worker{i}", "distributed.cli.dask_worker", address, "--host=127.0.0.1", "--nworkers=1",
            "--nthreads=1", "--no-dashboard", "--preload=tests.dask_hold", f"--name=w{i}", "--death-timeout=60")
    client = distributed.Client(address, timeout=60)
    client.wait_for_workers(2, timeout=120)
    yield types.SimpleNamespace(address=address, client=client, hold=hold, logs=folder)
  finally:
    if client is not None:
      client.close()
    _stop(procs)


def _arm(hold) -> None:
  """Scatters from now on mark their start and wait for ``release``."""
  for f in os.listdir(hold):
    os.remove(hold / f)
  (hold / "armed").touch()


def _started(hold) -> list[tuple[int, int]]:
  """(input file index, worker pid) of every scatter started since :func:`_arm`."""
  return sorted(tuple(map(int, f.split("-")[1:])) for f in os.listdir(hold) if f.startswith("started-"))


def _wait_for(what: str, ready, proc, timeout: float = 120):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if value := ready():
      return value
    if proc.poll() is not None:
      pytest.fail(f"prepare_data ended (exit {proc.returncode}) while waiting for {what}:\n"
                  f"{proc.communicate()[1][-3000:]}")
    time.sleep(0.05)
  pytest.fail(f"no {what} after {timeout} s")


def _prepare_on(cluster, folder, out) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "tools/prepare_data.py", f"--input={folder}", f"--output={out}",
                           *_OPTIONS, "--runner=DaskRunner", "--", f"--dask_client_address={cluster.address}",
                           "--dask_connection_timeout=60"], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _finish(proc) -> None:
  try:
    _, err = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 0, err[-3000:]


def _worker_pids(client) -> dict:
  """pid -> address of the workers the scheduler has, each asked by the engine for its pid."""
  return {pid: address for address, pid in client.run(os.getpid).items()}


@pytest.mark.slow
def test_the_workers_prepare_the_bytes_of_the_in_process_run_from_and_to_a_store(cluster, corpus, store):
  folder, want = corpus
  raw, out = epath.Path(store.url("prepare/raw")), store.url("prepare/out")
  for f in folder.iterdir():
    (raw / f.name).write_bytes(f.read_bytes())
  workers = _worker_pids(cluster.client)
  scheduler = cluster.client.run_on_scheduler(os.getpid)
  assert len(workers) == 2 and not set(workers) & {os.getpid(), scheduler}  # processes of their own
  seen = len(cluster.client.get_task_stream())  # installs the scheduler's task stream plugin
  _arm(cluster.hold)
  proc = _prepare_on(cluster, store.url("prepare/raw"), out)
  # Both workers inside a scatter at once: the scheduler spread the files over them.
  _wait_for("scatter in each worker", lambda: len({pid for _, pid in _started(cluster.hold)}) == 2, proc)
  (cluster.hold / "release").touch()
  _finish(proc)
  assert _files(out) == want  # shards and manifest, byte for byte
  assert sorted(p.name for p in epath.Path(store.url("prepare")).iterdir()) == ["out", "raw"]  # no temporary folder
  started = _started(cluster.hold)
  assert sorted(i for i, _ in started) == list(range(_FILES))  # every file scattered once
  assert {pid for _, pid in started} == set(workers)  # in the worker processes, both of them
  # The scheduler's record of the run: the pipeline's steps (Beam DoFns on Dask bag partitions) ran on both workers.
  ran = [t for t in cluster.client.get_task_stream()[seen:] if "apply_dofn_to_bundle" in str(t["key"])]
  assert len(ran) > _FILES and {t["worker"] for t in ran} == set(workers.values())


@pytest.mark.slow
def test_a_worker_killed_inside_a_task_is_replaced_and_its_work_redone(cluster, corpus, tmp_path):
  folder, want = corpus
  workers = _worker_pids(cluster.client)
  _arm(cluster.hold)
  proc = _prepare_on(cluster, folder, tmp_path / "out")
  try:
    started = _wait_for("scatter in each worker",
                        lambda: (s := _started(cluster.hold)) and len({pid for _, pid in s}) == 2 and s, proc)
    index, victim = started[0]
    assert victim in workers
    lost = cluster.client.processing([workers[victim]])[workers[victim]]  # the scheduler's view of its tasks
    seen = len(cluster.client.get_task_stream())
    os.kill(victim, signal.SIGKILL)  # inside the scatter of file `index`
    _wait_for("the scheduler to lose the worker",
              lambda: workers[victim] not in cluster.client.scheduler_info()["workers"], proc)
    (cluster.hold / "release").touch()
  except BaseException:
    proc.kill()
    raise
  _finish(proc)
  assert _files(tmp_path / "out") == want
  # The engine ran the lost work again: file `index` scattered in another worker process, and by the scheduler's
  # task stream every task it had on the killed worker finished on another worker.
  assert [pid for i, pid in _started(cluster.hold) if i == index and pid != victim]
  finished = {t["key"]: t["worker"] for t in cluster.client.get_task_stream()[seen:]}
  assert lost and all(finished.get(key) not in (None, workers[victim]) for key in lost), (lost, finished)
  cluster.client.wait_for_workers(2, timeout=120)  # the nanny started a new worker process
  assert victim not in _worker_pids(cluster.client)


def test_an_unreachable_scheduler_is_named_and_nothing_written(corpus, tmp_path):
  """The user's mistake, in process (the command line prints a DataError as one line, exit 2: test_cli)."""
  folder, _ = corpus
  address = f"tcp://127.0.0.1:{portpicker.pick_unused_port()}"  # nothing listens there
  with pytest.raises(DataError) as e:
    prepare.prepare(prepare.Options(inputs=[os.fspath(folder)], output=os.fspath(tmp_path / "out"), progress=False,
                                    runner="DaskRunner", pipeline_options=(f"--dask_client_address={address}",
                                                                           "--dask_connection_timeout=1")))
  assert str(e.value).startswith(f"--dask_client_address: no Dask scheduler answers at {address} (")
  assert str(e.value).endswith("; start one (dask scheduler) or fix the address")
  assert os.listdir(tmp_path) == []  # no output, no temporary folder

"""Checkpoints on an object store (checkpoint.dir on s3:// and gs://, servers on localhost: tests/object_store.py):
Orbax's async saves and their commit, resume bitwise as from local disk, the corrupt-step fallback, restore onto
another mesh, the two tiers (local disk -> store), a missing client library."""

import gc
import json
import subprocess
import sys

import fsspec
import jax
import numpy as np
import pytest

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import config as config_lib
from jaxtrain import errors
from jaxtrain import exits
from jaxtrain import stores
from jaxtrain.train import state as state_lib
from jaxtrain.train import trainer
from tests import forked, object_store
from tests.conftest import small_config

STEPS = 12  # the uninterrupted run's


@pytest.fixture(scope="module")
def store_of():
  """One server per scheme, started on first use and stopped at the end of the module."""
  servers, stack = {}, []

  def get(scheme):
    if scheme not in servers:
      context = object_store.serve(scheme, set_environ=False)
      servers[scheme] = context.__enter__()
      stack.append(context)
    return servers[scheme]

  yield get
  for context in reversed(stack):
    context.__exit__(None, None, None)


@pytest.fixture
def s3(store_of, monkeypatch):
  return _use(store_of("s3"), monkeypatch)


@pytest.fixture
def gs(store_of, monkeypatch):
  return _use(store_of("gs"), monkeypatch)


def _use(store, monkeypatch):
  for k, v in store.env.items():
    monkeypatch.setenv(k, v)
  object_store.forget_clients()
  return store


def _config(workdir, checkpoint_dir, steps, **mesh):
  c = small_config(workdir, **(mesh or {"fsdp": 8}))
  c.checkpoint.dir, c.train.steps, c.checkpoint.every_steps = checkpoint_dir, steps, 5
  c.optim.decay_steps = 20
  return c


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """Step -> loss of a run on local disk, never stopped."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _, history = trainer.train(_config(workdir, "", STEPS))
  return {h["step"]: h["loss"] for h in history}


def _objects(url):
  fs, path = fsspec.core.url_to_fs(url)
  return sorted(p[len(path):].lstrip("/") for p in fs.find(path))


def _steps(url):
  return sorted({int(p.split("/")[0]) for p in _objects(url) if p.split("/")[0].isdigit()})


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_async_saves_commit_on_the_store_and_resume_bitwise(store_of, monkeypatch, tmp_path, uninterrupted, scheme):
  store = _use(store_of(scheme), monkeypatch)
  url = store.url("resume", str(tmp_path.name))
  trainer.train(_config(tmp_path, url, 10))
  objects = _objects(url)
  assert _steps(url) == [5, 10]
  for step in (5, 10):  # each step committed by its commit file, written into the step itself (no rename)
    assert f"{step}/commit_success.txt" in objects and any(o.startswith(f"{step}/state/") for o in objects)
  assert not any("orbax-checkpoint-tmp" in o for o in objects)
  _, history = trainer.train(_config(tmp_path, url, STEPS))
  assert {h["step"]: h["loss"] for h in history} == {s: uninterrupted[s] for s in (11, 12)}
  assert _steps(url) == [5, 10, 12]


# Orbax abandons the other reads of the failed restore; their coroutines are reported as unraisable when collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_newest_step_on_the_store_falls_back(s3, tmp_path, uninterrupted, caplog, monkeypatch):
  """The truncated step is set aside and the run goes on exactly from the one before, its error said once: the
  reads of the step's other chunks, left unfinished, print no traceback when they are collected."""
  echoes = []
  monkeypatch.setattr(sys, "unraisablehook", echoes.append)  # what the checkpointer's filter passes on
  url = s3.url("corrupt")
  trainer.train(_config(tmp_path, url, 10))
  fs, root = fsspec.core.url_to_fs(url)
  data = [p for p in fs.find(f"{root}/10/state") if "/d/" in p]
  biggest = max(data, key=lambda p: fs.size(p))
  fs.pipe(biggest, fs.cat(biggest)[: fs.size(biggest) // 3])  # truncated, as by a copy cut short
  with caplog.at_level("WARNING"):
    _, history = trainer.train(_config(tmp_path, url, STEPS))
  assert f"checkpoint step 10 in {url} cannot be restored" in caplog.text and "falling back" in caplog.text
  assert {h["step"]: h["loss"] for h in history} == {s: uninterrupted[s] for s in range(6, 13)}  # from step 5
  aside = [p for p in _objects(url) if p.startswith("corrupt-10-")]  # kept for inspection, uncommitted
  assert any("/state/" in p for p in aside) and not any(p.count("/") == 1 and "commit_success" in p for p in aside)
  assert _steps(url) == [5, 10, 12]  # step 10 written again by the run that went on
  gc.collect()
  assert echoes == [], [str(e.exc_value)[:200] for e in echoes[:3]]


def test_restore_onto_another_mesh_from_the_store(s3, tmp_path, uninterrupted):
  url = s3.url("mesh")
  trainer.train(_config(tmp_path, url, 10, fsdp=8))
  state, history = trainer.train(_config(tmp_path, url, STEPS, fsdp=4), devices=jax.devices()[:4])
  np.testing.assert_allclose([h["loss"] for h in history], [uninterrupted[s] for s in (11, 12)], rtol=1e-5)
  assert state.params["layers"]["mlp"]["up"]["kernel"].sharding.mesh.size == 4


def test_local_tier_on_disk_and_persistent_tier_on_the_store(s3, tmp_path, uninterrupted, caplog):
  """The local tier's newer step wins over the store's (here: the store's newest step lost), and the run goes on
  exactly."""
  url, local = s3.url("tiers"), tmp_path / "local"
  c = _config(tmp_path, url, 10)
  c.checkpoint.update(every_steps=4, local_dir=str(local), local_every_steps=3)
  trainer.train(c)
  assert _steps(url) == [4, 8, 10]
  assert sorted(int(p.name) for p in local.glob("*/process_0-of-1/*") if p.name.isdigit()) == [6, 9]
  fs, root = fsspec.core.url_to_fs(url)
  fs.rm(f"{root}/10", recursive=True)
  c.train.steps = STEPS
  with caplog.at_level("INFO"):
    _, history = trainer.train(c)
  assert f"resumed from checkpoint step 9 (local tier, {local}" in caplog.text, caplog.text[-2000:]
  assert {h["step"]: h["loss"] for h in history} == {s: uninterrupted[s] for s in (10, 11, 12)}


def test_tools_and_restore_from_read_only_committed_steps_on_the_store(s3, tmp_path):
  """A step folder without its commit file (a save killed on the store) is not a checkpoint to the tools,
  checkpoint.restore_from or the run."""
  url = s3.url("tools")
  trainer.train(_config(tmp_path, url, 5))
  fs, root = fsspec.core.url_to_fs(url)
  for f in fs.find(f"{root}/5"):  # step 7: every object of a step but its commit file
    if not f.endswith("/5/commit_success.txt"):
      fs.copy(f, f.replace("/5/", "/7/", 1))
  assert checkpoint_lib.committed_steps(url) == [5]
  step_dir = checkpoint_lib.step_dir(url)
  assert step_dir == f"{url}/5" and checkpoint_lib.saved_config(step_dir)["train"]["steps"] == 5
  with pytest.raises(checkpoint_lib.CheckpointError, match=r"has no step 7 \(it has 5\)"):
    checkpoint_lib.step_dir(url, 7)
  run = trainer.build(_config(tmp_path, url, 5))
  _, step = checkpoint_lib.restore_from(url, state_lib.abstract(run.model, run.tx, run.state_shardings), True)
  assert step == 5
  r = forked.run(["tools/inspect_checkpoint.py", url, "--json"], timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  info = json.loads(r.stdout)
  assert info["steps"] == [5] and "params/lm_head/kernel" in {t["name"] for t in info["tensors"]}
  assert "7" in info["not_committed_or_set_aside"]
  from tests import harness_data  # (a run trained from scratch carries no tokenizer: the export is given one)
  harness_data.bpe_tokenizer()[0].save(str(tmp_path / "tokenizer.json"))
  r = forked.run(["tools/convert_hf.py", "export", f"--checkpoint={url}", f"--output={tmp_path / 'hf'}",
                  f"--tokenizer={tmp_path / 'tokenizer.json'}"], timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert (tmp_path / "hf" / "model.safetensors").exists() and f"{url}/5" in r.stdout
  assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


# A store that goes away mid-run (its saves, commits, restores, listings and deletes refused, reset, throttled or
# silent) is tests/test_faults.py's matrix, run in one process against these servers behind a fault proxy; a real
# run through ten of those faults, restarted after each exit, is tools/fault_drill.py (docs/operations.md).


def test_missing_client_library_is_one_line_naming_the_extra(monkeypatch, tmp_path):
  find_spec = stores.importlib.util.find_spec
  monkeypatch.setattr(stores.importlib.util, "find_spec", lambda name, *a: None if name == "s3fs" else
                      find_spec(name, *a))
  c = config_lib.base_config()
  c.workdir, c.checkpoint.dir = str(tmp_path / "run"), "s3://bucket/ckpt"
  with pytest.raises(errors.UserError) as e:
    config_lib.resolve(c)
  assert str(e.value) == ("checkpoint.dir: 's3://bucket/ckpt' needs the s3fs package, which is not installed; "
                          "pip install -e '.[s3]' (or pip install s3fs)")
  c.checkpoint.dir = "gs://bucket/ckpt"  # gcsfs is there
  assert config_lib.resolve(c).checkpoint.dir == "gs://bucket/ckpt"


def test_missing_client_library_exits_2_from_the_command_line(tmp_path):
  hide = ("import importlib.util as u, runpy, sys; f = u.find_spec\n"
          "u.find_spec = lambda n, *a: None if n == 'gcsfs' else f(n, *a)\n"
          "sys.argv[0:1] = ['jaxtrain.main']; runpy.run_module('jaxtrain.main', run_name='__main__')")
  r = subprocess.run([sys.executable, "-c", hide, "--config=configs/tiny.py", f"--config.workdir={tmp_path}/run",
                      "--config.data.path=gs://bucket/data"], capture_output=True, text=True, timeout=120,
                     cwd=forked.ROOT, env=forked.run_env())
  assert r.returncode == exits.USER_ERROR, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1] == ("jaxtrain: error: data.path: 'gs://bucket/data' needs the gcsfs "
                                               "package, which is not installed; pip install -e '.[gcs]' (or pip "
                                               "install gcsfs)")
  assert not (tmp_path / "run").exists()


def test_tensorstore_reaches_the_store_the_environment_names_with_bounded_retries(monkeypatch):
  for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
            "TENSORSTORE_GCS_BACKEND"):
    monkeypatch.delenv(k, raising=False)
  retries = {"max_retries": 5, "initial_delay": "0.5s", "max_delay": "8s"}
  assert stores.tensorstore_kvstore("s3://b/runs/x") == {"driver": "s3", "bucket": "b", "path": "runs/x",
                                                          "s3_request_retries": retries}  # Amazon's, found by AWS
  monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:9000")
  monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://minio:9000")  # the S3-specific one wins, as in boto3
  monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
  spec = stores.tensorstore_kvstore("s3://b/runs/x")
  assert (spec["endpoint"], spec["aws_region"], spec["aws_credentials"]) == (
      "http://minio:9000", "us-east-1", {"type": "environment"})
  monkeypatch.setenv("AWS_REGION", "auto")
  assert stores.tensorstore_kvstore("s3://b/x")["aws_region"] == "auto"
  assert stores.tensorstore_kvstore("gs://b/runs/x") == {"driver": "gcs", "bucket": "b", "path": "runs/x",
                                                          "gcs_request_retries": retries}


def test_a_store_that_does_not_answer_is_told_apart_from_other_failures():
  refused = ConnectionRefusedError(111, "Connection refused")
  try:
    try:
      raise refused
    except OSError as e:
      raise ValueError("writing the state failed") from e
  except ValueError as e:
    chained = e
  assert stores.unreachable(chained) is refused
  assert stores.unreachable(ValueError('UNAVAILABLE: Error writing "x": HTTP response code: 503')) is not None
  for other in (PermissionError(13, "Permission denied"), ValueError("Checkpoint path should be absolute"),
                OSError(28, "No space left on device")):
    assert stores.unreachable(other) is None, other

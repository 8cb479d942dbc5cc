"""Checkpoints: exact resume, resume on another mesh, kills, SIGTERM, corrupt fallback, write errors, 2 processes."""

import datetime
import gc
import json
import logging as std_logging
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl import logging

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import exits
from jaxtrain import goodput
from jaxtrain import integrity
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.metrics import read_records
from jaxtrain.train import state as state_lib
from jaxtrain.train import trainer
from tests import forked, multiprocess
from tests.conftest import resumable_copy, small_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A tiny run on the bundled corpus (2 of tiny.py's layers), every step logged, schedule fixed independently of
# train.steps. Its runs have 2 simulated devices (RUN_ENV): kills, resumes and locks are the same on 2 as on 8, and a
# step is ~3x cheaper (the runs about the device count or the mesh are trainer.train's, in this process).
BASE = ["--config=configs/tiny.py", "--config.train.log_every=1", "--config.optim.decay_steps=40",
        "--config.train.global_batch_size=8", "--config.data.seq_len=64", "--config.model.num_layers=2"]
RUN_DEVICES = 2


def run_env() -> dict[str, str]:
  """This process's environment with RUN_DEVICES simulated devices (the later flag wins): the environment of the
  runs BASE is given to."""
  return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                                     f"--xla_force_host_platform_device_count={RUN_DEVICES}".strip()}


def _start(workdir, *args):
  """``python -m jaxtrain.main`` with BASE and ``args``, started (tests/forked.py: forked from a process with the
  libraries imported, as every training run of this file) on RUN_DEVICES devices."""
  return forked.popen(["-m", "jaxtrain.main", *BASE, f"--config.workdir={workdir}", *args], run_env())


def _run(workdir, *args, timeout=300):
  p = _start(workdir, *args)
  out, err = p.communicate(timeout=timeout)
  assert p.returncode == 0, err[-3000:]
  return err


def _losses(workdir):
  return {r["step"]: r["loss"] for r in read_records(workdir)}  # a re-run step keeps its last value


def _params(workdir, step):
  with ocp.StandardCheckpointer() as ckptr:
    state = ckptr.restore(pathlib.Path(workdir) / "checkpoints" / str(step) / "state")
  return state["params"]


def _committed(workdir):
  return _committed_in(pathlib.Path(workdir) / "checkpoints")


def _committed_in(root):
  return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []


def _at(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree


def _assert_bitwise(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _run(workdir, "--config.train.steps=20")
  return workdir


@pytest.mark.slow
def test_exact_resume_is_bitwise(uninterrupted, tmp_path):
  _run(tmp_path, "--config.train.steps=10")
  err = _run(tmp_path, "--config.train.steps=20")
  assert "resumed from checkpoint step 10" in err
  full, resumed = _losses(uninterrupted), _losses(tmp_path)
  assert [resumed[s] for s in range(11, 21)] == [full[s] for s in range(11, 21)]
  _assert_bitwise(_params(tmp_path, 20), _params(uninterrupted, 20))


def _logged_steps(workdir):
  """Steps of the complete records so far (a record being appended right now may be half there)."""
  return [r["step"] for r in read_records(workdir)]


# Runs jaxtrain.main with the process SIGKILLing itself right after Checkpointer.save has started the async save
# of step argv[1]: its files are being written (or about to be) when the process dies.
_KILL_IN_SAVE_MAIN = ("import os, runpy, signal, sys; from jaxtrain import checkpoint as c\n"
                      "save = c.PersistentTier.save\n"
                      "kill_at = int(sys.argv[1])\n"
                      "def killing_save(self, step, *a, **k):\n"
                      "  started = save(self, step, *a, **k)\n"
                      "  if started and step == kill_at: os.kill(os.getpid(), signal.SIGKILL)\n"
                      "  return started\n"
                      "c.PersistentTier.save = killing_save; sys.argv[0:2] = ['jaxtrain.main']\n"
                      "runpy.run_module('jaxtrain.main', run_name='__main__')")


def kill_at_random_moments(workdir, args, kills, in_save_kill, committed, logged_steps, logged_in_save=True,
                           poll_s=0.02):
  """The kill loop of the kill-and-resume tests (here and in tests/test_store_runs.py): ``kills`` runs of BASE and
  ``args`` in ``workdir``, each SIGKILLed after a random 1-3 new logged steps plus up to 0.3 s of jitter
  (``random.Random(0)``), except run number ``in_save_kill``, which kills itself inside the async save of the next
  even step (that step never committed; ``logged_in_save``: and already logged). Every run that found a committed
  checkpoint says it resumed from the newest. ``committed()`` and ``logged_steps()``: the steps so far, read every
  ``poll_s`` seconds while a run goes on."""
  rng = random.Random(0)
  for kill in range(kills):
    before, logged = committed(), len(logged_steps())
    if kill == in_save_kill:
      in_save = max(before, default=0) + 2
      p = forked.popen(["-c", _KILL_IN_SAVE_MAIN, str(in_save), *BASE, f"--config.workdir={workdir}", *args],
                       run_env())
      _, err = p.communicate(timeout=300)
      assert p.returncode == -signal.SIGKILL, err[-2000:]
      assert in_save not in committed() and (in_save in logged_steps() or not logged_in_save)
    else:
      wait_steps, jitter = rng.randint(1, 3), rng.uniform(0, 0.3)
      p = _start(workdir, *args)
      deadline = time.monotonic() + 300  # bounds the wait for the event on a loaded machine
      while len(logged_steps()) < logged + wait_steps:
        assert p.poll() is None, f"the run ended ({p.returncode}) early: {p.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{wait_steps} more steps not logged within 300 s"
        time.sleep(poll_s)
      time.sleep(jitter)
      assert p.poll() is None, "the run finished before it could be killed"
      p.send_signal(signal.SIGKILL)
      _, err = p.communicate(timeout=60)
    if before:  # the run resumed from the newest committed step there was when it started
      assert f"resumed from checkpoint step {before[-1]}" in err, err[-2000:]


@pytest.mark.slow
def test_kills_at_random_moments_resume_exactly(uninterrupted, tmp_path):
  """SIGKILL after a random 1-3 new steps (plus jitter) four times, and once while an async save is in flight;
  every run resumes from the newest committed checkpoint and the end result is bitwise the uninterrupted one."""
  args = ["--config.train.steps=20", "--config.checkpoint.every_steps=2"]
  kill_at_random_moments(tmp_path, args, 5, 2, lambda: _committed(tmp_path), lambda: _logged_steps(tmp_path))
  newest = _committed(tmp_path)
  err = _run(tmp_path, *args)
  if newest:
    assert f"resumed from checkpoint step {newest[-1]}" in err
  for step in _committed(tmp_path):  # every committed checkpoint reads back
    _params(tmp_path, step)
  _assert_bitwise(_params(tmp_path, 20), _params(uninterrupted, 20))
  assert _losses(tmp_path)[20] == _losses(uninterrupted)[20]


@pytest.mark.slow
def test_sigterm_saves_exits_75_and_resumes_at_next_step(tmp_path):
  p = _start(tmp_path, "--config.train.steps=500")
  deadline = time.time() + 300
  while time.time() < deadline and p.poll() is None and len(_logged_steps(tmp_path)) < 3:
    time.sleep(0.05)
  p.send_signal(signal.SIGSTOP)  # the signal arrives at a known step, however loaded the machine is
  logged = _logged_steps(tmp_path)[-1]
  p.send_signal(signal.SIGTERM)
  p.send_signal(signal.SIGCONT)
  _, err = p.communicate(timeout=300)
  assert p.returncode == exits.RESTART, err[-2000:]  # restartable: the scheduler runs it again
  saved = _committed(tmp_path)
  assert len(saved) == 1 and f"preempted: saved step {saved[0]}, exiting" in err
  assert f"jaxtrain: stopped: preempted after step {saved[0]} of 500; newest checkpoint: step {saved[0]}; " \
         "restart the same command to resume (exit 75)" in err, err[-2000:]
  # The step running when the signal came (logging trails dispatch by one step, a half-written record by one more)
  assert logged + 1 <= saved[0] <= logged + 3, (logged, saved)
  assert _logged_steps(tmp_path)[-1] == saved[0]
  err = _run(tmp_path, f"--config.train.steps={saved[0] + 2}")
  assert f"resumed from checkpoint step {saved[0]}" in err
  assert _logged_steps(tmp_path)[-2:] == [saved[0] + 1, saved[0] + 2]
  summary = json.loads((tmp_path / goodput.SUMMARY).read_text())  # the interruption named by its cause
  assert summary["interruptions"] == [{"run": 0, "step": saved[0], "cause": "preempted"}], summary
  assert "interrupted by preempted x1" in err


def _config(make_config, workdir, **mesh):
  config = make_config(**(mesh or {"fsdp": 8}))
  config.workdir = str(workdir)
  config.train.steps = 10
  config.optim.decay_steps = 20
  config.checkpoint.every_steps = 5
  return config


@pytest.fixture(scope="module")
def ten_steps(tmp_path_factory):
  """The workdir of _config's run (10 steps on fsdp=8, saved at 5 and 10) and its final state, on the host: the
  run that the restore_from tests start from and test_truncated_newest_checkpoint_falls_back corrupts a copy of."""
  workdir = tmp_path_factory.mktemp("ten_steps") / "run"
  state, _ = trainer.train(_config(lambda **mesh: small_config(workdir, **mesh), workdir))
  return workdir, jax.device_get(state)


def _corpus_config(workdir, steps, **mesh):
  config = _config(lambda **mesh: small_config(workdir, **mesh), workdir, **mesh)
  config.data.source, config.train.steps = "arrayrecord", steps
  return config


@pytest.fixture(scope="module")
def on_8_devices(tmp_path_factory):
  """The 20 steps of an uninterrupted run on 8 devices (its history), and the workdir of the same run stopped at
  10, which each case of test_resume_on_another_mesh resumes a copy of."""
  root = tmp_path_factory.mktemp("mesh")
  _, history = trainer.train(_corpus_config(root / "full", 20, fsdp=8))  # (saves 5, 10, 15, 20; keeps 10, 15, 20)
  # The stopped run: the full run's workdir without its checkpoints after step 10 (the schedule does not depend on
  # train.steps: optim.decay_steps is fixed), as a run of 10 steps would have left it.
  return history, resumable_copy(root / "full", root / "elastic", 10)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,devices", [(dict(data=2, fsdp=2, tensor=2), 8), (dict(fsdp=4), 4)],
                         ids=["(1,8,1)->(2,2,2)", "8->4 devices"])
def test_resume_on_another_mesh(on_8_devices, tmp_path, mesh, devices):
  """On the bundled corpus (packed rows: the trained-on token count differs from batch to batch), so equal
  counts per step mean the resumed run reads the same batches in the same order."""
  h_full, stopped = on_8_devices
  shutil.copytree(stopped, tmp_path / "elastic")
  state, h_resumed = trainer.train(_corpus_config(tmp_path / "elastic", 20, **mesh), devices=jax.devices()[:devices])
  assert [h["step"] for h in h_resumed] == list(range(11, 21))
  np.testing.assert_allclose([h["loss"] for h in h_resumed], [h["loss"] for h in h_full[10:]], rtol=1e-5)
  tokens = [h["tokens"] for h in h_full]
  assert len(set(tokens)) > 1 and [h["tokens"] for h in h_resumed] == tokens[10:]  # same data order
  assert state.params["layers"]["mlp"]["up"]["kernel"].sharding.mesh.size == devices


# Orbax abandons the other reads of the failed restore; their coroutines are reported as unraisable when
# collected, so the test collects them itself (else the next test gets the warnings).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_truncated_newest_checkpoint_falls_back(ten_steps, make_config, tmp_path, caplog):
  shutil.copytree(ten_steps[0], tmp_path, dirs_exist_ok=True)  # _config's run, trained to 10
  config = _config(make_config, tmp_path)
  newest = tmp_path / "checkpoints" / "10" / "state"
  biggest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 3])
  config.train.steps = 12
  with caplog.at_level("WARNING"):
    _, history = trainer.train(config)
  assert "checkpoint step 10" in caplog.text and "falling back" in caplog.text
  assert [h["step"] for h in history] == list(range(6, 13))  # resumed from step 5
  assert any(p.name.startswith("corrupt-10-") for p in (tmp_path / "checkpoints").iterdir())
  assert _committed(tmp_path)[-1] == 12
  gc.collect()


def _flip(path: pathlib.Path, at: int) -> None:
  """What a bad disk or a faulty copy does: 3 bytes inverted at byte ``at`` of the file."""
  data = bytearray(path.read_bytes())
  data[at:at + 3] = bytes(b ^ 0xFF for b in data[at:at + 3])
  path.write_bytes(bytes(data))


def _ocdbt_layout(state_dir: pathlib.Path) -> tuple[dict[str, tuple[str, int, int]], tuple[str, int, int]]:
  """Where an Orbax (OCDBT) checkpoint keeps its bytes, read from its own index with tensorstore's dump: each
  stored value out of line (an array chunk, key like ``params.lm_head.kernel/0.1``) -> (file relative to
  ``state_dir``, offset, length), and the same for the index's root node."""
  import tensorstore as ts

  base = ts.KvStore.open(f"file://{state_dir}/").result()

  def place(location: str) -> tuple[str, int, int]:  # "value:ocdbt.process_0/:d/<id>:<offset>:<length>"
    head, offset, length = location.rsplit(":", 2)
    return "".join(head.split(":")[1:]), int(offset), int(length)

  def values(location: str, prefix: bytes = b""):
    node = ts.ocdbt.dump(base, location).result()
    for e in node["entries"]:  # an inner node's children hold keys without their common prefix
      if node["height"]:
        yield from values(e["location"], prefix + e.get("subtree_common_prefix", b""))
      elif "indirect_value" in e:
        yield (prefix + e["key"]).decode(), place(e["indirect_value"])

  root = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
  return dict(values(root)), place(root)


@pytest.mark.slow
def test_flipped_bytes_in_any_data_file_are_detected_and_the_run_falls_back(make_config, tmp_path, caplog):
  """Orbax reads these back without complaint (its checksums cover only its index); the fingerprints written at
  save time catch them and name the array. The fallback run then continues exactly as an uncorrupted one."""
  def config(workdir, steps):
    c = _config(make_config, workdir)
    c.train.steps, c.checkpoint.every_steps = steps, 4
    return c

  _, first = trainer.train(config(tmp_path / "run", 12))
  shutil.copytree(tmp_path / "run", tmp_path / "clean")
  _, clean = trainer.train(config(tmp_path / "clean", 16))  # resumes from 12
  expected = {h["step"]: h["loss"] for h in first + clean if h["step"] > 8}
  state_dir = tmp_path / "run" / "checkpoints" / "12" / "state"
  chunks, index = _ocdbt_layout(state_dir)
  # Where to flip: inside the largest chunk of the parameters and of the optimizer state, inside one chunk of every
  # data file that holds any (files are filled in whatever order the writes finish), and in the index.
  targets = {max((k for k in chunks if k.startswith(part + ".")), key=lambda k: chunks[k][2])
             for part in ("params", "opt_state")}
  targets |= {min(k for k in chunks if chunks[k][0] == file) for file in {f for f, _, _ in chunks.values()}}
  # (Usually several data files; under load Orbax's writers may fill one: every file there is, is flipped.)
  assert {chunks[k][0] for k in targets} == {f for f, _, _ in chunks.values()}, chunks
  run = trainer.build(config(tmp_path / "run", 16))  # the layout restores read onto
  trained = set()
  for name, (file, offset, length) in [*((k, chunks[k]) for k in sorted(targets)), ("the index", index)]:
    workdir = tmp_path / "flip"
    shutil.copytree(tmp_path / "run", workdir)
    _flip(workdir / state_dir.relative_to(tmp_path / "run") / file, offset + length // 2)
    caplog.clear()
    with caplog.at_level("WARNING"):
      checkpointer = checkpoint_lib.Checkpointer([checkpoint_lib.PersistentTier(os.fspath(workdir / "checkpoints"),
                                                                                async_save=False)])
      state, _, _ = checkpointer.restore(state_lib.abstract(run.model, run.tx, run.state_shardings), None)
      checkpointer.close()
    warning = [r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage()]
    assert int(state.step) == 8 and len(warning) == 1 and warning[0].startswith(
        f"checkpoint step 12 in {workdir / 'checkpoints'} cannot be restored ("), (name, caplog.text)
    if name == "the index":  # caught by the checksum OCDBT keeps on its own nodes: proven bad, so set aside
      kind = "read error"
      assert "(CorruptCheckpoint: ValueError: DATA_LOSS: " in warning[0] and "fingerprints" not in warning[0], \
          warning[0]
    else:  # the array the flipped chunk belongs to, by name
      kind = "fingerprints"
      array = name.split("/")[0].replace(".", "/")
      assert f"(CorruptCheckpoint: {array} does not match the fingerprints written at save time)" in warning[0], \
          (name, warning[0])
    assert [p.name.split("-")[0] for p in (workdir / "checkpoints").iterdir() if not p.name.isdigit()] == \
        ["corrupt"]
    if kind not in trained:  # the run from here: step 12 set aside, it resumes from 8
      trained.add(kind)
      _, history = trainer.train(config(workdir, 16))
      assert {h["step"]: h["loss"] for h in history} == expected  # bitwise the clean run
    shutil.rmtree(workdir)
  gc.collect()


def test_non_finite_state_is_never_saved_and_a_non_finite_checkpoint_is_corrupt(tmp_path, caplog):
  good = {"w": jnp.arange(4.0), "moment": jnp.ones((2, 2))}
  bad = {"w": jnp.array([0.0, jnp.nan, 2.0, 3.0]), "moment": jnp.ones((2, 2))}
  data = iter([])
  ckpt = checkpoint_lib.PersistentTier(tmp_path, keep_last=5)
  ckpt.save(1, good, data, meta={}, config={}, force=True)
  with pytest.raises(checkpoint_lib.NonFiniteState, match="non-finite values in w"):
    ckpt.save(2, bad, data, meta={}, config={}, force=True)
  ckpt.wait()
  assert ckpt.steps() == [1]
  unverified = checkpoint_lib.PersistentTier(tmp_path, keep_last=5, verify=False)  # writes it anyway
  unverified.save(2, bad, data, meta={}, config={}, force=True)
  unverified.close()
  ckpt.manager.reload()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), good)
  with caplog.at_level("WARNING"):
    state, _, _ = checkpoint_lib.Checkpointer([ckpt]).restore(abstract, data)
  ckpt.close()
  assert "checkpoint step 2" in caplog.text and "CorruptCheckpoint: non-finite values in w" in caplog.text
  np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(4.0))
  assert [p.name.split("-")[:2] for p in tmp_path.iterdir() if not p.name.isdigit()] == [["corrupt", "2"]]


@pytest.mark.slow
def test_restore_params_from_another_run(ten_steps, make_config, tmp_path):
  source, state_a = ten_steps  # _config's run, trained to 10
  target = _config(make_config, tmp_path / "b", data=2, fsdp=4)
  target.train.steps = 1
  target.optim.update(lr=1e-12, warmup_steps=0)  # one step that barely moves the params
  target.checkpoint.restore_from = str(source / "checkpoints")
  state_b, history = trainer.train(target)
  assert [h["step"] for h in history] == [1]  # a fresh run (step 0), not a resume
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
               state_a.params, state_b.params)


@pytest.mark.parametrize("mode", ["params", "state"])
def test_restore_from_takes_the_params_or_the_whole_state(ten_steps, make_config, tmp_path, mode):
  """restore_mode=state starts from the other run's whole state (step, optimizer moments) on this run's mesh;
  params takes its params and a fresh optimizer at step 0."""
  source, state_a = ten_steps  # _config's run, trained to 10
  target = _config(make_config, tmp_path / "b", data=2, fsdp=4)
  target.checkpoint.update(restore_from=str(source / "checkpoints"), restore_mode=mode)
  run = trainer.build(target)
  fresh = trainer.init_state(run)
  checkpointer = trainer.make_checkpointer(run.config)
  try:
    state_b, _ = trainer.restore_or_init(run, checkpointer, None)
  finally:
    checkpointer.close()
  expected = state_a if mode == "state" else fresh.replace(params=state_a.params)
  assert int(state_b.step) == (10 if mode == "state" else 0)
  _assert_bitwise(jax.device_get(state_b.params), jax.device_get(expected.params))
  _assert_bitwise(jax.device_get(state_b.opt_state), jax.device_get(expected.opt_state))
  kernel = ("layers", "mlp", "up", "kernel")
  assert _at(state_b.params, kernel).sharding == _at(fresh.params, kernel).sharding  # this run's mesh


def test_unwritable_checkpoint_dir_is_a_clear_error(tmp_path):
  p = _start(tmp_path, "--config.checkpoint.dir=/proc/jaxtrain-ckpt")
  _, err = p.communicate(timeout=120)
  errors = [line for line in err.splitlines() if line.startswith("jaxtrain: error:")]
  assert p.returncode == 2 and len(errors) == 1 and "/proc/jaxtrain-ckpt" in errors[0], err[-2000:]
  assert "Traceback" not in err


def test_unwritable_workdir_is_a_clear_error(tmp_path):
  """A workdir that cannot be created (under /proc) is one line naming it, exit 2: no traceback."""
  p = _start(tmp_path, "--config.workdir=/proc/jaxtrain")
  _, err = p.communicate(timeout=120)
  errors = [line for line in err.splitlines() if line.startswith("jaxtrain: error:")]
  assert p.returncode == 2 and errors == [errors[0]], err[-2000:]
  assert errors[0].startswith("jaxtrain: error: /proc/jaxtrain: the workdir cannot be created or written (")
  assert "--config.workdir" in errors[0] and "Traceback" not in err


# Runs jaxtrain.main with a file-size limit: a write past it fails with EFBIG (SIGXFSZ ignored) instead of
# killing the process. Set in a launcher that execs, not in preexec_fn (unsafe in a threaded parent).
_LIMITED_MAIN = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                 "limit = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); "
                 "os.execv(sys.executable, [sys.executable, '-m', 'jaxtrain.main', *sys.argv[2:]])")


def test_write_error_during_save_is_clear_and_keeps_earlier_checkpoints(uninterrupted, tmp_path):
  """A save that fails while writing (files over RLIMIT_FSIZE fail as a full disk does, but without root or a
  small filesystem): one error line naming the OS error, exit 2, the earlier checkpoint byte for byte intact."""
  shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
  committed = _committed(tmp_path)
  before = {p: p.read_bytes() for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()}
  limit = 256 * 1024  # the state's data files are ~0.5-4 MB; config, metrics and event files stay below
  p = subprocess.Popen([sys.executable, "-c", _LIMITED_MAIN, str(limit), *BASE, f"--config.workdir={tmp_path}",
                        "--config.train.steps=25"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  _, err = p.communicate(timeout=300)
  errors = [line for line in err.splitlines() if line.startswith("jaxtrain: error:")]
  assert p.returncode == 2 and len(errors) == 1, err[-3000:]
  assert errors[0].startswith(f"jaxtrain: error: {tmp_path / 'checkpoints'}: saving a checkpoint failed: disk full "
                              "(File too large: "), errors[0]
  assert "Traceback" not in err, err[-3000:]
  assert _committed(tmp_path) == committed == [20]
  assert all(path.read_bytes() == data for path, data in before.items())
  _assert_bitwise(_params(tmp_path, 20), _params(uninterrupted, 20))


# Runs jaxtrain.main with Checkpointer.save handed a state with a leaf Orbax cannot serialize: a save that
# fails for a reason that is not the storage's.
_BROKEN_SAVE_MAIN = ("import runpy, sys; from jaxtrain import checkpoint as c; save = c.PersistentTier.save; "
                     "c.PersistentTier.save = lambda self, step, state, *a, **k: save(self, step, "
                     "{'state': state, 'bad': object()}, *a, **k); sys.argv[0] = 'jaxtrain.main'; "
                     "runpy.run_module('jaxtrain.main', run_name='__main__')")


def test_save_failing_for_another_reason_is_reported_as_a_bug_not_a_disk_problem(tmp_path):
  p = forked.run(["-c", _BROKEN_SAVE_MAIN, *BASE, f"--config.workdir={tmp_path}", "--config.train.steps=2",
                  "--config.checkpoint.verify=false"], run_env())  # fingerprints need arrays
  errors = [line for line in p.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert p.returncode == 1 and len(errors) == 1, p.stderr[-3000:]
  assert errors[0] == (f"jaxtrain: error: {tmp_path / 'checkpoints'}: saving a checkpoint failed (ValueError: "
                       "Unsupported type: <class 'object'> for key: ('bad',).); this is not a storage problem but a "
                       "bug in jaxtrain or a library it uses; earlier checkpoints are intact; the traceback is in "
                       f"{tmp_path / 'train.log'}")
  assert "Traceback" not in p.stderr and "disk" not in p.stderr.lower()
  log = (tmp_path / "train.log").read_text()
  assert "Traceback (most recent call last)" in log and "ValueError: Unsupported type" in log
  assert _committed(tmp_path) == [] and not (tmp_path / "run.lock").exists()


@pytest.mark.parametrize("override,expected", [
    ("--config.model.mlp_dim=96", "was written for another model or optimizer (params/layers/mlp/"),
    ("--config.train.global_batch_size=16", "train.global_batch_size changed")], ids=["model", "batch"])
def test_resume_into_another_model_or_batch_is_a_clear_error_and_touches_nothing(uninterrupted, tmp_path,
                                                                                 override, expected):
  """Not corruption: the checkpoints must not be set aside (the run would silently start over)."""
  shutil.copytree(uninterrupted, tmp_path, dirs_exist_ok=True)
  before = {p: p.read_bytes() for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()}
  p = _start(tmp_path, "--config.train.steps=25", override)
  _, err = p.communicate(timeout=300)
  errors = [line for line in err.splitlines() if line.startswith("jaxtrain: error:")]
  assert p.returncode == 2 and len(errors) == 1 and expected in errors[0], err[-3000:]
  assert "Traceback" not in err
  assert {p: p.read_bytes() for p in (tmp_path / "checkpoints").rglob("*") if p.is_file()} == before


class _Clock(datetime.datetime):
  """Orbax's clock for save decisions, moved forward by the test instead of by sleeping."""
  ahead = datetime.timedelta()

  @classmethod
  def now(cls, tz=None):
    return datetime.datetime.now(tz) + cls.ahead


def test_every_minutes_saves_by_the_clock(tmp_path, monkeypatch):
  monkeypatch.setattr(ocp.checkpoint_manager, "datetime", types.SimpleNamespace(
      datetime=_Clock, timezone=datetime.timezone, timedelta=datetime.timedelta))
  ckpt = checkpoint_lib.PersistentTier(tmp_path, every_minutes=1, keep_last=5)
  state = {"w": jnp.arange(4.0)}
  try:
    assert ckpt.should_save(1)
    ckpt.save(1, state, None, meta={}, config={})
    ckpt.wait()
    _Clock.ahead = datetime.timedelta(seconds=59)
    assert not ckpt.should_save(2)
    _Clock.ahead = datetime.timedelta(seconds=61)
    assert ckpt.should_save(3)
  finally:
    _Clock.ahead = datetime.timedelta()
    ckpt.close()


@pytest.mark.parametrize("keep_last,keep_every,kept", [(3, 0, [8, 9, 10]), (2, 4, [4, 8, 9, 10]),
                                                        (1, 3, [3, 6, 9, 10])])
def test_retention_keeps_exactly_the_newest_and_every_nth(tmp_path, keep_last, keep_every, kept):
  ckpt = checkpoint_lib.PersistentTier(tmp_path, every_steps=1, keep_last=keep_last, keep_every=keep_every)
  try:
    for step in range(1, 11):
      assert ckpt.save(step, {"w": jnp.full((4,), float(step))}, None, meta={}, config={})
    ckpt.wait()
  finally:
    ckpt.close()
  assert _committed_in(tmp_path) == kept


def test_sync_save_is_committed_when_save_returns(tmp_path):
  ckpt = checkpoint_lib.PersistentTier(tmp_path, every_steps=1, async_save=False)
  try:
    ckpt.save(1, {"w": jnp.arange(4.0)}, None, meta={}, config={})
    assert _committed_in(tmp_path) == [1] and not any("tmp" in p.name for p in tmp_path.iterdir())
    restored, _, _ = checkpoint_lib.Checkpointer([ckpt]).restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, None)
  finally:
    ckpt.close()
  np.testing.assert_array_equal(restored["w"], np.arange(4.0))


def test_synthetic_stream_resumes_exactly(tmp_path):
  """The synthetic source's position is saved with the state: a new source restored from the checkpoint yields
  exactly the batch the saved one would have yielded next."""
  source = SyntheticSource(16, 256, 8, seed=3)
  _ = [next(source) for _ in range(5)]
  ckpt = checkpoint_lib.PersistentTier(tmp_path, async_save=False)
  try:
    ckpt.save(5, {"w": jnp.arange(4.0)}, source, meta={}, config={}, force=True)
    expected = next(source)
    resumed = SyntheticSource(16, 256, 8, seed=3)
    checkpoint_lib.Checkpointer([ckpt]).restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32)}, resumed)
  finally:
    ckpt.close()
  got = next(resumed)
  assert got.keys() == expected.keys()
  for k in expected:
    np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
  assert not all(np.array_equal(got[k], next(SyntheticSource(16, 256, 8, seed=3))[k]) for k in got)  # not batch 0


class _Counter:
  """A data source with the DataPosition protocol and nothing else (no Grain): it counts, its position is the
  count."""

  def __init__(self):
    self.count, self.resplit_from = 0, None

  def __iter__(self):
    return self

  def __next__(self):
    self.count += 1
    return self.count

  def get_state(self):
    return {"count": self.count, "kind": "counter"}

  def set_state(self, state):
    assert state["kind"] == "counter"
    self.count = state["count"]

  def resplit(self, saved_states):
    self.resplit_from = saved_states
    return {"count": sum(s["count"] for s in saved_states), "kind": "counter"}


def _save_counter(directory, count):
  counter = _Counter()
  _ = [next(counter) for _ in range(count)]
  ckpt = checkpoint_lib.PersistentTier(directory, async_save=False)
  ckpt.save(count, {"w": jnp.arange(4.0)}, counter, meta={}, config={}, force=True)
  ckpt.close()


def _restore_counter(directory):
  counter = _Counter()
  ckpt = checkpoint_lib.PersistentTier(directory)
  try:
    assert checkpoint_lib.Checkpointer([ckpt]).restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32)},
                                                       counter) is not None
  finally:
    ckpt.close()
  return counter


def test_any_iterator_with_the_data_position_protocol_is_saved_and_restored(tmp_path):
  """The checkpointer needs only DataPosition (importing it imports no Grain): a source of its own resumes at its
  position, and one without the protocol is warned about and resumes nothing."""
  assert isinstance(_Counter(), checkpoint_lib.DataPosition)
  _save_counter(tmp_path, 7)
  assert json.loads((tmp_path / "7" / "data" / "process_0-of-1.json").read_text()) == {"count": 7,
                                                                                       "kind": "counter"}
  counter = _restore_counter(tmp_path)
  assert counter.count == 7 and counter.resplit_from is None and next(counter) == 8
  r = subprocess.run([sys.executable, "-c", "import sys, jaxtrain.checkpoint; sys.exit('grain' in sys.modules)"],
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, "importing jaxtrain.checkpoint imports grain"


def test_another_process_count_hands_every_saved_position_to_resplit(tmp_path):
  """A step saved by 2 processes (each wrote its own position file) restored by 1: the iterator gets both
  positions, in process order, and is set to what its resplit made of them."""
  _save_counter(tmp_path, 7)
  data, meta_file = tmp_path / "7" / "data", tmp_path / "7" / "meta" / "metadata"
  (data / "process_0-of-1.json").unlink()  # what 2 processes at counts 3 and 4 would have written
  for i, count in enumerate((3, 4)):
    (data / f"process_{i}-of-2.json").write_text(json.dumps({"count": count, "kind": "counter"}))
  meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "data_processes": 2}))
  counter = _restore_counter(tmp_path)
  assert counter.resplit_from == [{"count": 3, "kind": "counter"}, {"count": 4, "kind": "counter"}]
  assert counter.count == 7


def test_python_runs_keep_orbax_info_out_of_the_log_but_not_its_warnings(make_config, tmp_path, caplog):
  """trainer.train called from Python (no jaxtrain.main: a notebook, a test) logs like the command line: the
  Checkpointer it creates keeps Orbax's INFO narration of every save out of absl's log; Orbax's warnings and
  jaxtrain's own INFO lines stay."""
  loggers = [logging.get_absl_logger(), std_logging.getLogger(), std_logging.getLogger("asyncio")]
  for logger in loggers:
    logger.removeFilter(checkpoint_lib.LIBRARY_LOG_FILTER)  # as in a fresh process
  config = _config(make_config, tmp_path)
  config.train.steps = 4
  with caplog.at_level("INFO"):
    trainer.train(config)
    ocp.CheckpointManagerOptions(read_only=True)  # Orbax warns that it turns `create` off
  orbax = [r for r in caplog.records if "/orbax/" in r.pathname]
  assert [r.levelname for r in orbax if r.levelno < std_logging.WARNING] == [], [r.getMessage() for r in orbax][:5]
  warned = [r for r in orbax if "read_only=True, setting create=False" in r.getMessage()]
  assert [r.levelname for r in warned] == ["WARNING"]
  assert any(r.getMessage().startswith("compiled and initialized in") for r in caplog.records)
  assert all(checkpoint_lib.LIBRARY_LOG_FILTER in logger.filters for logger in loggers)


def test_unraisable_hook_drops_only_the_closed_loop_echo_and_keeps_the_hook_it_wraps(monkeypatch):
  seen = []
  monkeypatch.setattr(sys, "unraisablehook", seen.append)  # whatever hook was there (pytest's, a notebook's)
  checkpoint_lib.quiet_libraries()
  hook = sys.unraisablehook
  checkpoint_lib.quiet_libraries()
  assert sys.unraisablehook is hook  # wrapped once

  def unraisable(e):
    return types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=None, err_msg=None, object=None)

  for e in (RuntimeError("Event loop is closed"), RuntimeError("another"), ValueError("Event loop is closed")):
    hook(unraisable(e))
  assert [(type(a.exc_value), str(a.exc_value)) for a in seen] == [(RuntimeError, "another"),
                                                                   (ValueError, "Event loop is closed")]


@pytest.mark.slow
def test_two_processes_save_restore_and_continue(uninterrupted, tmp_path):
  args = ["--config=configs/tiny.py", "--out", os.fspath(tmp_path / "out.json"), "--",
          f"workdir={tmp_path / 'run'}", "train.global_batch_size=8", "data.seq_len=64", "train.log_every=1",
          "optim.decay_steps=40", "model.num_layers=2", "checkpoint.every_steps=3", "train.steps=6"]

  def job():  # 2 processes (forked: tests/multiprocess.py) of 1 device each: a tiny step's collectives over 2 gloo
    procs = multiprocess.start_script("tests/train_worker.py", args, local_devices=1)  # ranks, not 8
    codes = multiprocess.wait_all(procs, 300)
    for p, code in zip(procs, codes):
      assert code == 0, p.err_path.read_text()[-3000:]

  job()
  assert _committed(tmp_path / "run") == [3, 6]
  args[-1] = "train.steps=9"
  job()
  history = json.loads((tmp_path / "out.json").read_text())["history"]
  assert [h["step"] for h in history] == [7, 8, 9]  # resumed from step 6
  # The same run on one process (RUN_DEVICES devices) gives the same losses (fp32 tolerance): the uninterrupted
  # run, BASE's flags, whose 20 steps go through these (optim.decay_steps=40: the schedule does not depend on
  # train.steps; when it saves changes no loss).
  np.testing.assert_allclose([h["loss"] for h in history], [_losses(uninterrupted)[s] for s in (7, 8, 9)], rtol=1e-5)


def test_inspect_checkpoint_lists_steps_meta_and_tensors(ten_steps, make_config):
  workdir = ten_steps[0]  # _config's run, trained to 10
  config = _config(make_config, workdir)
  r = forked.run(["tools/inspect_checkpoint.py", str(workdir), "--json"], timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  info = json.loads(r.stdout)
  assert info["steps"] == [5, 10] and info["step"] == 10
  assert info["meta"]["step"] == 10 and info["meta"]["tokens_seen"] == 10 * 16 * 32
  tensors = {t["name"]: t for t in info["tensors"]}
  assert tensors["params/lm_head/kernel"]["shape"] == [64, 256]
  assert tensors["params/lm_head/kernel"]["bytes"] == 64 * 256 * 4
  report = trainer.report(trainer.build(config))
  assert info["total_bytes"] == report["param_bytes_total"] + report["opt_bytes_total"] + 4  # + step
  table = forked.run(["tools/inspect_checkpoint.py", str(workdir)], timeout=120)
  assert "steps 5, 10" in table.stdout and "params/lm_head/kernel" in table.stdout


def _fingerprint_by_formula(x: np.ndarray) -> int:
  """sum_i (2 K i + 1) * bits_i mod 2**32 in Python integers (jaxtrain/integrity.py's definition)."""
  bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).ravel().astype(np.uint64)
  i = np.arange(bits.size, dtype=np.uint64)
  return int(np.sum((2 * 2654435761 * i + 1) % 2**32 * bits % 2**32) % 2**32)


@pytest.mark.parametrize("block", [None, 8])
def test_fingerprints_equal_their_formula_whole_or_block_by_block(monkeypatch, block):
  """On the CPU large arrays are fingerprinted block by block (XLA:CPU would otherwise hold a temporary as large
  as the array): the value is the definition's either way, and a NaN in any block is found."""
  if block:
    monkeypatch.setattr(integrity, "_BLOCK_ELEMENTS", block)
  rng = np.random.default_rng(0)
  tree = {"a": rng.standard_normal((12, 5, 7)).astype(np.float32), "b": rng.integers(0, 9, (10, 3)).astype(np.int32),
          "c": rng.standard_normal((7, 11)).astype(np.float16), "d": np.float32(2.5)}
  tree["a"][9, 4, 6] = np.nan  # in the last block
  # (a new function to trace: jit's cache would otherwise hand back the other parameter's program)
  fingerprints, nonfinite = integrity.read(jax.jit(lambda t: integrity.summary(t))(tree))
  assert fingerprints == {k: _fingerprint_by_formula(np.asarray(v)) for k, v in tree.items()}
  assert nonfinite == ["a"]
  assert [integrity._rows_per_block(jnp.asarray(tree[k])) for k in "abcd"] == ([1, 2, 1, 0] if block else [0] * 4)


@pytest.mark.parametrize("concatenate", [True, False], ids=["one_reduction", "per_array"])
def test_the_step_finite_check_sees_one_bad_element_in_any_shard(concatenate):
  """integrity.all_finite in both of its forms (one reduction over the concatenated shards, CPU's; per array, the
  TPU's): true for a finite sharded tree; false for a NaN or an infinity in any one element of any array,
  whichever device holds it; integer arrays are not checked."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
  layout = {"w": NamedSharding(mesh, P("fsdp", "tensor")), "b": NamedSharding(mesh, P("tensor")),
            "n": NamedSharding(mesh, P()), "h": NamedSharding(mesh, P(None, "fsdp"))}
  tree = {"w": np.ones((8, 4), np.float32), "b": np.zeros(6, np.float32), "n": np.arange(3, dtype=np.int32),
          "h": np.full((2, 8), 0.5, jnp.bfloat16)}
  check = jax.jit(lambda t: integrity.all_finite(t, layout, concatenate))
  put = lambda t: jax.device_put(t, layout)  # noqa: E731
  assert bool(check(put(tree)))
  for name, index, bad in [("w", (7, 3), np.nan), ("w", (0, 0), np.inf), ("b", (5,), -np.inf), ("h", (1, 6), np.nan)]:
    broken = {k: v.copy() for k, v in tree.items()}
    broken[name][index] = bad
    assert not bool(check(put(broken))), (name, index, bad)


@pytest.mark.slow
def test_goodput_of_a_killed_and_restarted_run_counts_the_steps_redone_and_the_down_time(tmp_path):
  p = _start(tmp_path, "--config.train.steps=20", "--config.checkpoint.every_steps=5")
  deadline = time.monotonic() + 300  # bounds the wait for the event on a loaded machine
  while not (_committed(tmp_path) and max(_logged_steps(tmp_path), default=0) >= _committed(tmp_path)[-1] + 3):
    assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
    time.sleep(0.05)
  p.send_signal(signal.SIGSTOP)  # frozen: its last event is written and no other follows
  first = goodput.read_events(tmp_path)
  p.kill()
  p.communicate()
  time.sleep(1.0)  # the scheduler's delay
  restarted_at = time.time()
  err = _run(tmp_path, "--config.train.steps=20", "--config.checkpoint.every_steps=5")
  resumed = int(re.search(r"resumed from checkpoint step (\d+) \(", err).group(1))
  summary = json.loads((tmp_path / goodput.SUMMARY).read_text())
  assert summary == goodput.account(goodput.read_events(tmp_path)) and summary["runs"] == 2
  # Lost: the first run's productive time after the checkpoint the second resumed from, and those steps.
  progress = [e for e in first if e["event"] == "progress"]
  at_resume = [e for e in progress if e["step"] <= resumed][-1]
  assert summary["steps_trained_again"] == progress[-1]["step"] - resumed > 0
  assert summary["seconds"]["lost"] == pytest.approx(progress[-1]["productive"] - at_resume["productive"], abs=1e-9)
  assert summary["seconds"]["lost"] > 0
  # Down: from the first run's last event to the second's start (the process's own start, from the kernel: a
  # clock tick, plus the fork and exec after restarted_at).
  assert summary["seconds"]["down"] == pytest.approx(restarted_at - first[-1]["t"], abs=0.05)
  assert f"goodput {100 * summary['goodput']:.1f}% of " in err
  # The first run said nothing as it went (SIGKILL): its interruption is named so.
  assert summary["interrupted_by"] == {"killed": 1} and summary["interruptions"][0]["cause"] == "killed"


def test_a_failed_background_write_is_raised_even_when_orbaxs_own_wait_does_not_return(monkeypatch):
  """Orbax's writes of a save wait for each other's signals: when one fails before it signals, wait_until_finished
  blocks until the barrier's timeout (300 s) before it reports anything. The failure its thread logged is raised
  FAILED_WAIT_S after it was seen, the error itself (a disk's EACCES here: exit 2), not a hang."""
  from jaxtrain.checkpoint import persistent
  monkeypatch.setattr(persistent, "FAILED_WAIT_S", 0.3)
  released = threading.Event()

  class Stuck:
    def wait_until_finished(self):
      released.wait(30)

  since = time.monotonic()
  failure = PermissionError(13, "Permission denied", "/ckpt/6.orbax-checkpoint-tmp/state")
  record = std_logging.LogRecord("absl", std_logging.ERROR, "/x/orbax/checkpoint/_src/futures/future.py", 1,
                                 "_SignalingThread.run() raised an exception: %s", (failure,),
                                 (PermissionError, failure, None))
  checkpoint_lib.LIBRARY_LOG_FILTER.filter(record)
  t = time.monotonic()
  try:
    with pytest.raises(PermissionError, match="Permission denied"):
      persistent._wait_bounded(Stuck(), since)
    assert time.monotonic() - t < 5
    # A failure of an earlier save is not this one's: its wait goes on to what Orbax says.
    later = time.monotonic()
    released.set()
    persistent._wait_bounded(Stuck(), later)
  finally:
    released.set()

"""Simulate 8 CPU devices before jax is imported, and share small configs."""

import os
import shutil
import tempfile

from tests.xla_flags import TEST_XLA_FLAGS

# TEST_XLA_FLAGS: no SIGABRT when a simulated device's thread runs late under load, and a faster compile of the
# tests' tiny programs (tests/xla_flags.py).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 "
                           + TEST_XLA_FLAGS).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# Tests compile the same small programs many times (and in subprocesses): share a persistent cache.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxtrain-test-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest  # noqa: E402

from jaxtrain.config import base_config  # noqa: E402
from tests import collector  # noqa: E402

# A worker that dies with children holding its pipe ends the run instead of hanging it (tests/worker_guard.py).
pytest_plugins = ("tests.worker_guard",)


def small_config(workdir, **mesh):
  """A 2-layer model small enough to compile in seconds; mesh sizes given as data=, fsdp=, tensor=."""
  c = base_config()
  c.workdir = str(workdir)
  c.model.update(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4, head_dim=16, mlp_dim=128,
                 vocab_size=256)
  c.data.update(seq_len=32, source="synthetic")
  c.train.update(steps=5, global_batch_size=16, log_every=1)
  c.optim.update(lr=1e-3, warmup_steps=2)
  c.mesh.update(data=1, fsdp=1, tensor=1)
  c.mesh.update(**mesh)
  return c


def resumable_copy(workdir, to, keep_through):
  """A copy of ``workdir`` with its checkpoints after step ``keep_through`` removed: the run as if it had stopped
  there (killed before its next save committed)."""
  shutil.copytree(workdir, to)
  for step in (to / "checkpoints").iterdir():
    if step.name.isdigit() and int(step.name) > keep_through:
      shutil.rmtree(step)
  return to


@pytest.fixture
def make_config(tmp_path):
  return lambda **mesh: small_config(tmp_path, **mesh)


def count_dispatched_steps(monkeypatch) -> list[int]:
  """Makes every train step a run dispatches add 1 to the returned ``[count]`` (patches trainer.compile_step)."""
  from jaxtrain.train import trainer
  dispatched, compile_step = [0], trainer.compile_step

  def counting(run, train_step=None, extra=()):
    step_fn = compile_step(run, train_step, extra)

    def counted(*args):
      dispatched[0] += 1
      return step_fn(*args)
    return counted

  monkeypatch.setattr(trainer, "compile_step", counting)
  return dispatched


# The files that take longest (measured with --durations=0, cold cache), longest first. pytest-xdist
# hands whole files to its workers in collection order (--dist loadfile), so starting with these keeps one worker
# from finishing a long file alone at the end. Files not listed keep their order, after these.
LONGEST_FIRST = ("test_readme.py", "test_distributed.py", "test_faults.py", "test_store_runs.py", "test_checkpoint.py",
                 "test_families.py", "test_preference.py", "test_moe.py", "test_monitor.py", "test_deepseek_v3.py",
                 "test_cli.py", "test_evaluate.py", "test_mixture.py", "test_grpo.py", "test_lora.py", "test_stream.py",
                 "test_tpu_compile.py", "test_optimizers.py", "test_store_checkpoint.py", "test_data.py",
                 "test_pipeline.py", "test_loss_scale.py", "test_gpt_oss.py", "test_prepare_cluster.py",
                 "test_launch.py")


_last_module = [None]


def pytest_runtest_setup(item):
  """At the first test of each file: a full collection of what the files before left, then everything alive frozen
  out of the collector's sight and full collections made rare (tests/collector.py). At the first file that is the
  test modules and their libraries, which live as long as the worker (as jaxtrain.main freezes its imports)."""
  if item.module is not _last_module[0]:
    _last_module[0] = item.module
    collector.between_files()


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file is kept

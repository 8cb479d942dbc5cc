"""Run a script as N real JAX processes on localhost (gloo collectives), every wait bounded."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import portpicker

from tests import forked
from tests.xla_flags import TEST_XLA_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env(local_devices: int) -> dict[str, str]:
  return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
          "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices} {TEST_XLA_FLAGS}"}


def run(script: str, args: list[str], num_processes: int = 2, local_devices: int = 4,
        timeout: float = 300) -> list[subprocess.CompletedProcess]:
  """Starts ``python script --coordinator=127.0.0.1:PORT --num_processes=N --process_id=i *args`` for each
  i, waits at most ``timeout`` seconds for all, kills every one still running, and returns the results."""
  port = portpicker.pick_unused_port()
  env = _env(local_devices)
  procs = [subprocess.Popen([sys.executable, script, f"--coordinator=127.0.0.1:{port}",
                             f"--num_processes={num_processes}", f"--process_id={i}", *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(num_processes)]
  results = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
  return results


def _popen(argv: list[str], env: dict[str, str], name: str) -> forked.Forked:
  return forked.Forked(argv, env, pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / name)


def slurm_env(num_processes: int, process_id: int, port: int) -> dict[str, str]:
  """The variables ``srun`` gives one task of a ``num_processes``-task step on this host (job 1), with JAX's
  coordinator port override so that concurrent jobs do not collide."""
  return {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_NUM_NODES": "1",
          "SLURM_NTASKS": str(num_processes), "SLURM_PROCID": str(process_id), "SLURM_LOCALID": str(process_id),
          "JAX_COORDINATOR_PORT": str(port)}


def start_main(args: list[str], num_processes: int = 2, local_devices: int = 4, cluster: str = "explicit",
               entry: tuple[str, ...] = ("-m", "jaxtrain.main")) -> list[subprocess.Popen]:
  """Starts ``python -m jaxtrain.main *args`` (or ``python *entry *args``) as a ``num_processes``-process job on localhost (a fresh port):
  ``cluster='explicit'`` passes the coordinator config flags (none for one process), ``'slurm'`` gives each process the environment of
  an ``srun`` task instead (no flags: jaxtrain joins by auto-detection). stderr goes to a file per process,
  returned as ``p.err_path``."""
  port = portpicker.pick_unused_port()
  procs = []
  for i in range(num_processes):
    env, flags = _env(local_devices), []
    if cluster == "slurm":
      env.update(slurm_env(num_processes, i, port))
    elif cluster == "explicit" and num_processes > 1:
      flags = [f"--config.distributed.coordinator_address=127.0.0.1:{port}",
               f"--config.distributed.num_processes={num_processes}", f"--config.distributed.process_id={i}"]
    elif cluster != "explicit":
      raise ValueError(f"cluster={cluster!r}: use 'explicit' or 'slurm'")
    procs.append(_popen([*entry, *args, *flags], env, f"jaxtrain-mp-{port}-{i}.err"))
  return procs


def start_script(script: str, args: list[str], num_processes: int = 2,
                 local_devices: int = 4) -> list[subprocess.Popen]:
  """Starts ``python script [--coordinator=127.0.0.1:PORT --num_processes=N --process_id=i] *args`` for each
  i without waiting (the flags only when N > 1); stderr goes to ``p.err_path``."""
  port = portpicker.pick_unused_port()
  procs = []
  for i in range(num_processes):
    flags = [f"--coordinator=127.0.0.1:{port}", f"--num_processes={num_processes}",
             f"--process_id={i}"] if num_processes > 1 else []
    procs.append(_popen([script, *flags, *args], _env(local_devices), f"jaxtrain-mp-{port}-{i}.err"))
  return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
  """Exit codes; every process still running after ``timeout`` seconds is killed (and fails the caller)."""
  deadline = time.time() + timeout
  for p in procs:
    try:
      p.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
      pass
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait(timeout=30)
  return [p.returncode for p in procs]


def init_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
  """For the worker scripts: join the localhost job with gloo CPU collectives."""
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id, initialization_timeout=120)


# jaxtrain.main that SIGKILLs itself when the loop is about to save step argv[1] (once the previous save has
# committed): the steps after that checkpoint have run and are lost; the next run resumes from it.
_KILL_AT_SAVE = ("import os, runpy, signal, sys; from jaxtrain import checkpoint as c\n"
                 "save, kill_at = c.PersistentTier.save, int(sys.argv[1])\n"
                 "def killing_save(self, step, *a, **k):\n"
                 "  if step == kill_at: self.wait(); os.kill(os.getpid(), signal.SIGKILL)\n"
                 "  return save(self, step, *a, **k)\n"
                 "c.PersistentTier.save = killing_save; sys.argv[0:2] = ['jaxtrain.main']\n"
                 "runpy.run_module('jaxtrain.main', run_name='__main__')")


def main_killed_at_save(step: int, args: list[str], log: pathlib.Path, timeout: float = 300) -> int:
  """Runs ``python -m jaxtrain.main *args`` (forked, in the repository, stderr to ``log``) until it SIGKILLs itself
  about to save ``step``; returns its exit status (-SIGKILL when it was killed there). It runs in its own process
  group, killed once it is gone: a killed trainer's Grain workers may outlive it for a moment."""
  import signal
  p = forked.Forked(["-c", _KILL_AT_SAVE, str(step), *args], forked.run_env(), log, new_session=True)
  try:
    p.wait(timeout=timeout)
  finally:
    try:
      os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  return p.returncode

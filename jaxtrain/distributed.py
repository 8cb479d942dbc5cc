"""Joining a multi-process job: JAX's distributed runtime, started the way each cluster expects.

- Explicit: ``distributed.coordinator_address`` (+ ``num_processes``, ``process_id``), e.g. for tests on
  localhost or a cluster jaxtrain does not know.
- Automatic (``distributed.auto``): TPU VM pods (GCE/GKE metadata), Slurm (``srun``), Kubernetes (indexed Jobs /
  JobSets), Open MPI: whatever ``jax.distributed.initialize()`` detects from the environment.
- Otherwise a single process: nothing to do.

``heartbeat_timeout_s`` bounds how long the others wait for a process that died: they then fail instead of
hanging (crashes are better than hangs; the scheduler restarts the job). CPU processes use gloo collectives.
"""

from __future__ import annotations

import os
import socket
import time

import jax
import ml_collections
from absl import logging

from jaxtrain.errors import ConfigError, check_positive

def defaults() -> ml_collections.ConfigDict:
  """The ``distributed`` config group."""
  return ml_collections.ConfigDict(dict(
      coordinator_address="",  # host:port of process 0; empty = from the cluster environment, or one process
      num_processes=1,
      process_id=0,
      auto=True,  # join automatically on TPU pods, Slurm, Kubernetes indexed jobs, Open MPI
      timeout_s=300.0,  # give up (clear error) if the coordinator cannot be reached in this time
      heartbeat_timeout_s=30.0,  # a process that stops answering this long fails the job instead of hanging it
  ))


def validate(config) -> None:
  check_positive(config, ["distributed.timeout_s", "distributed.heartbeat_timeout_s"])


def _multi_process_environment() -> bool:
  """Whether the environment says this process is one of several (checked before JAX starts)."""
  env = os.environ
  return (int(env.get("SLURM_NTASKS", "1")) > 1  # srun with several tasks
          or "JOB_COMPLETION_INDEX" in env  # Kubernetes indexed Job / JobSet
          or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1  # mpirun
          or "," in env.get("TPU_WORKER_HOSTNAMES", "")  # a multi-host TPU VM slice
          or "MEGASCALE_COORDINATOR_ADDRESS" in env)  # multi-slice TPU


def _wait_for_coordinator(address: str, timeout_s: float) -> bool:
  """Whether ``host:port`` accepts TCP connections within ``timeout_s``. jax.distributed.initialize aborts the
  whole process (a C++ check failure, no Python exception) when it cannot connect, so the other processes
  probe the coordinator first and can fail with a readable message instead."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
        return True
    except (OSError, ValueError):
      if time.monotonic() > deadline:
        return False
      time.sleep(0.5)


def initialize(cfg) -> None:
  """Joins the job described by the ``distributed`` config group (or its environment). Idempotent."""
  if jax.distributed.is_initialized():
    return
  explicit = bool(cfg.coordinator_address)
  if not explicit and not (cfg.auto and _multi_process_environment()):
    return
  if jax.config.jax_platforms in ("cpu",) or os.environ.get("JAX_PLATFORMS") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kwargs = dict(initialization_timeout=int(cfg.timeout_s), heartbeat_timeout_seconds=int(cfg.heartbeat_timeout_s))
  if explicit:
    if cfg.num_processes < 1 or not 0 <= cfg.process_id < cfg.num_processes:
      raise ConfigError("distributed.process_id", f"{cfg.process_id} is not in [0, distributed.num_processes="
                        f"{cfg.num_processes})", "give every process its index and the same process count")
    kwargs.update(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                  process_id=cfg.process_id)
    if cfg.process_id != 0 and not _wait_for_coordinator(cfg.coordinator_address, cfg.timeout_s):
      raise ConfigError("distributed.coordinator_address", f"could not join the job at {cfg.coordinator_address} "
                        f"within {cfg.timeout_s:.0f}s (nothing accepts connections there)",
                        "check that process 0 runs and the address/port is reachable")
  try:
    jax.distributed.initialize(**kwargs)
  except Exception as e:  # unreachable coordinator, timeout, bad environment
    where = cfg.coordinator_address or "the coordinator the cluster environment names"
    raise ConfigError("distributed.coordinator_address", f"could not join the job at {where} within "
                      f"{cfg.timeout_s:.0f}s ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})",
                      "check that process 0 runs and the address/port is reachable") from None
  logging.info("joined a %d-process job as process %d (%d local / %d global devices)", jax.process_count(),
               jax.process_index(), jax.local_device_count(), jax.device_count())

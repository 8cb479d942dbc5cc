"""Joining a multi-process job: JAX's distributed runtime, started the way each cluster expects.

- Explicit: ``distributed.coordinator_address`` (+ ``num_processes``, ``process_id``), e.g. for tests on
  localhost or a cluster jaxtrain does not know.
- Automatic (``distributed.auto``): TPU VM pods (GCE/GKE metadata), Slurm (``srun``), Kubernetes (indexed Jobs /
  JobSets), Open MPI: whatever ``jax.distributed.initialize()`` detects from the environment.
- Otherwise a single process: nothing to do.

A lost peer ends the job restartably (exit 75, :data:`jaxtrain.exits.RESTART`: the scheduler restarts it and it
resumes), never as a hang or a crash: :class:`PeerWatch` names a process not heard from for
``heartbeat_timeout_s`` and exits 75, and main reads a collective that failed on a broken connection the same way
(:func:`lost_peer`). JAX's own heartbeat check stays as the backstop at twice that timeout: when it fires it aborts
the process (SIGABRT), which a scheduler cannot tell from a crash. CPU processes use gloo collectives.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time

import jax
import ml_collections
from absl import logging
from jax._src import distributed as jax_distributed  # the coordination client: see PeerWatch

from jaxtrain import exits
from jaxtrain.errors import ConfigError, check_positive


def defaults() -> ml_collections.ConfigDict:
  """The ``distributed`` config group."""
  return ml_collections.ConfigDict(dict(
      coordinator_address="",  # host:port of process 0; empty = from the cluster environment, or one process
      num_processes=1,
      process_id=0,
      auto=True,  # join automatically on TPU pods, Slurm, Kubernetes indexed jobs, Open MPI
      timeout_s=300.0,  # give up (clear error) if the coordinator cannot be reached in this time
      heartbeat_timeout_s=30.0,  # a process not heard from this long ends the job restartably (exit 75)
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
  # JAX's heartbeat check is the backstop: PeerWatch answers first, restartably.
  kwargs = dict(initialization_timeout=int(cfg.timeout_s),
                heartbeat_timeout_seconds=int(2 * cfg.heartbeat_timeout_s + 10))
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
  client = jax_distributed.global_state.client
  if client is not None:  # None: jax.distributed.initialize was replaced (tests)
    watch = PeerWatch(client, jax.process_index(), jax.process_count(), cfg.heartbeat_timeout_s).start()
    atexit.register(watch.done)  # after JAX's shutdown hook, so it runs first (atexit is last in, first out)


# Words of a collective that failed because a peer went away (gloo on CPU, NCCL on GPU, the coordination service).
_LOST_PEER_WORDS = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed",
                    "remote process exited", "stopped sending heartbeats", "heartbeat timeout")


def lost_peer(error: BaseException) -> bool:
  """Whether ``error``, raised on a multi-process job, says that another process went away (not a bug here)."""
  return jax.process_count() > 1 and any(w in str(error) for w in _LOST_PEER_WORDS)


class PeerWatch:
  """Every process posts a beat to the coordination service's key-value store every ``timeout_s / 5`` seconds and
  reads everyone's; a peer whose beat has not moved for ``timeout_s`` (or a coordination service that no longer
  answers) ends this process with exit 75. A process that exits normally posts ``done`` first (``done()``, at
  exit), so the others do not mistake the end of a run for a lost peer. ``on_lost`` is for tests."""

  PREFIX = "jaxtrain/beat/"

  def __init__(self, client, process_id: int, num_processes: int, timeout_s: float, clock=time.monotonic,
               on_lost=None):
    self.client, self.me, self.n, self.timeout_s, self._clock = client, process_id, num_processes, timeout_s, clock
    self.on_lost = on_lost or exit_lost_peer
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jaxtrain-peer-watch", daemon=True)
    self._heard: dict[int, tuple[str | None, float]] = {}  # peer -> (its newest beat, when it last moved)

  def start(self) -> "PeerWatch":
    self._thread.start()
    return self

  def _run(self) -> None:
    beat = 0
    while not self._stop.wait(self.timeout_s / 5):
      beat += 1
      try:
        self.client.key_value_set(f"{self.PREFIX}{self.me}", str(beat), allow_overwrite=True)
        beats = dict(self.client.key_value_dir_get(self.PREFIX))
      except Exception as e:  # noqa: BLE001 - the service (in process 0) is gone
        if not self._stop.is_set():
          self.on_lost(f"the coordination service no longer answers ({str(e).splitlines()[0][:200]})")
        return
      lost = self.check(beats)
      if lost and not self._stop.is_set():
        self.on_lost(lost)
        return

  def check(self, beats: dict[str, str]) -> str | None:
    """Notes the peers' beats; a description of a peer not heard from for ``timeout_s``, else None."""
    now = self._clock()
    for peer in range(self.n):
      value = beats.get(f"{self.PREFIX}{peer}")
      if peer == self.me or value == "done":
        continue
      last, since = self._heard.get(peer, (None, now))
      if value != last or peer not in self._heard:
        self._heard[peer] = (value, now)
      elif now - since > self.timeout_s:
        return f"process {peer} has not been heard from for {now - since:.0f}s"
    return None

  def done(self) -> None:
    """This process ends normally: stop watching and tell the others."""
    self._stop.set()
    try:
      self.client.key_value_set(f"{self.PREFIX}{self.me}", "done", allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the service is already gone: nobody is left to tell
      pass


def exit_lost_peer(why: str) -> None:
  """Says that a process of the job is gone and why (console and train.log), then exits 75 at once."""
  logging.error("a process of the job is gone (%s): exiting %d so that the job restarts", why, exits.RESTART)
  logging.flush()
  print(f"jaxtrain: stopped: a process of the job is gone ({why}); restart the job: it resumes from the newest "
        f"checkpoint (exit {exits.RESTART})", file=sys.stderr, flush=True)
  os._exit(exits.RESTART)  # not sys.exit: JAX's shutdown barrier would wait for the lost process, then abort


"""Joining a multi-process job: JAX's distributed runtime, started the way each cluster expects.

- Explicit: ``distributed.coordinator_address`` (+ ``num_processes``, ``process_id``), e.g. for tests on
  localhost or a cluster jaxtrain does not know.
- Automatic (``distributed.auto``): TPU VM pods (GCE/GKE metadata), Slurm (``srun``), Kubernetes (indexed Jobs /
  JobSets), Open MPI: whatever ``jax.distributed.initialize()`` detects from the environment.
- Otherwise a single process: nothing to do.

A lost peer ends the job restartably (exit 75, :data:`jaxtrain.exits.RESTART`: the scheduler restarts it and it
resumes), never as a hang or a crash: :class:`PeerWatch` names a process not heard from for
``heartbeat_timeout_s`` and exits 75, and main reads an error that says a peer went away the same way
(:func:`lost_peer`, by the error's type and status code). JAX's own heartbeat check stays as the backstop at twice
that timeout: when it fires it aborts the process (SIGABRT), which a scheduler cannot tell from a crash. CPU
processes use gloo collectives.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import socket
import sys
import threading
import time

import jax
import ml_collections
from absl import logging

from jaxtrain import _compat, exits, logs, restarts
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
      max_restarts_per_hour=6,  # more restarts than this in the last hour: do not start (exit 3; 0: no limit)
  ))


def validate(config) -> None:
  check_positive(config, ["distributed.timeout_s", "distributed.heartbeat_timeout_s"])
  budget = config.distributed.max_restarts_per_hour
  if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
    raise ConfigError("distributed.max_restarts_per_hour", f"must be a whole number >= 0, got {budget!r}",
                      "give the restarts allowed in any hour (0: no limit)")


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
  try:
    client = _compat.coordination_client()
  except _compat.PrivateAPIMissing as e:  # the job runs; JAX's own heartbeat check is left
    logging.warning("no peer watch: %s", e)
    client = None
  if client is not None:  # None: jax.distributed.initialize was replaced (tests)
    watch = PeerWatch(client, jax.process_index(), jax.process_count(), cfg.heartbeat_timeout_s).start()
    _WATCH[:] = [watch]
    atexit.register(watch.done)  # after JAX's shutdown hook, so it runs first (atexit is last in, first out)


_WATCH: list[PeerWatch] = []  # this process's peer watch, once initialize() started it


def stop_job(code: int, line: str) -> bool:
  """On a multi-process job, this process stops the job for a cause a restart does not cure (a user error, a bug:
  ``code``, with its one ``line``): every other process is told to exit with the same code and line, and this one
  waits (bounded) until they have, so that the whole job ends by the cause, not as a lost peer (exit 75, a restart
  that fails the same way) or, when this is process 0, as the abort of the others that follows the coordination
  service's end. A no-op without a peer watch (one process). Whether it told other processes; then exit with
  ``os._exit``: JAX's shutdown barrier would wait for processes that have left."""
  if not (_WATCH and jax.process_count() > 1):  # (in that order: no backend is started before initialize())
    return False
  _WATCH[0].stop_job(code, line)
  return True


# What a process sees when another process of the job goes away: the error's type and absl status code, then where
# it comes from. Found by experiment (2 processes on localhost, tests/test_distributed.py), the same on jax 0.10.2 and
# 0.12.0.1:
# - a collective over gloo (CPU) whose peer was killed: status code UNKNOWN, raised as jax.errors.JaxRuntimeError
#   where the result is read (device_get, float) and as a ValueError whose message starts with the code where the
#   next dispatch finds the failure. XLA turns any exception of gloo into that code ("Gloo <op> failed: " + its
#   what()); the one gloo throws when a connection breaks or times out (gloo::IoException) comes from its transport
#   and names it ("[.../gloo/transport/tcp/pair.cc:538] Read error ...: Connection reset by peer").
# - the coordination service: a JaxRuntimeError with the service's payload (type.googleapis.com/tensorflow.
#   CoordinationServiceError): DEADLINE_EXCEEDED when a barrier or a key a peer should have posted timed out (the
#   barrier names the tasks that never came); INTERNAL "Barrier failed because: task is set to ERROR: UNAVAILABLE:
#   Task 1 heartbeat timeout" when the service declared a peer dead during a barrier (the agent's abort, below,
#   follows within a millisecond); UNAVAILABLE is the status the service gives a dead task.
# - the coordination service itself gone (process 0 killed) or frozen: JAX's agent in every other process polls the
#   error (UNAVAILABLE, or DEADLINE_EXCEEDED on its heartbeat) and aborts the process (SIGABRT, "Terminating process
#   because the JAX distributed service detected fatal errors") from its own thread, before Python sees anything;
#   the launchers restart a death by a signal. Its callback for that (missed_heartbeat_callback) cannot be used from
#   Python: jaxlib fails to pass it the status (std::bad_cast, both versions).
# - NCCL (GPU; from XLA's nccl_errors.h, not run here: no multi-GPU host): JaxRuntimeError, code INTERNAL, "NCCL
#   operation <call> failed: " + NCCL's text for ncclRemoteError ("remote process exited or there was a network
#   error") or ncclSystemError ("unhandled system error").
# Anything else, whatever its words ("Broken pipe" in a host callback's error, say), is not a lost peer.
_GLOO_TRANSPORT = re.compile(r"^(UNKNOWN: )?Gloo [\w -]+ failed: \[[^\]]*gloo/transport/")
_NCCL_PEER = re.compile(r"NCCL operation .* failed: (remote process exited or there was a network error|"
                        r"unhandled system error)")
_COORDINATION_PAYLOAD = "type.googleapis.com/tensorflow.CoordinationServiceError"
# Status codes of a call to a coordination service that stopped answering (gRPC's, for a peer or a server gone).
GONE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED")


_STATUS_CODES = frozenset((
    "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"))  # absl::StatusCode's names


def status_code(error: BaseException) -> str | None:
  """The absl status code of an error of JAX's runtime ('UNAVAILABLE', ...): a ``jax.errors.JaxRuntimeError``'s, or
  that of the ValueError jaxlib raises when a dispatch finds an earlier execution failed (its message starts with
  the code); None for any other error."""
  if isinstance(error, jax.errors.JaxRuntimeError):
    return getattr(error, "error_code_string", None) or str(error).partition(":")[0]  # the attribute: jax 0.10.2+
  if type(error) is ValueError:
    code = str(error).partition(": ")[0]
    return code if code in _STATUS_CODES else None
  return None


def peer_loss(error: BaseException) -> str | None:
  """What ``error`` (or an error it was raised from) says about a process of the job that went away, by its type and
  status code; None when it says nothing of the kind."""
  for _ in range(8):  # the error, then what it was raised from (a library may wrap it)
    if error is None:
      return None
    code, text = status_code(error), str(error)
    if code == "UNKNOWN" and _GLOO_TRANSPORT.match(text):
      return "a collective lost its connection to a peer (gloo)"
    if code == "INTERNAL" and _NCCL_PEER.search(text):
      return "a collective lost a peer (NCCL)"
    if _COORDINATION_PAYLOAD in text:
      if code == "UNAVAILABLE" or (code == "INTERNAL" and "task is set to ERROR: UNAVAILABLE" in text):
        return "the coordination service declared a peer dead"
      if code == "DEADLINE_EXCEEDED":
        return "a peer did not reach a barrier of the coordination service in time"
    error = error.__cause__ or error.__context__
  return None


def lost_peer(error: BaseException) -> str | None:
  """On a multi-process job, what ``error`` says about another process that went away (not a bug here), else None."""
  return peer_loss(error) if jax.process_count() > 1 else None


class PeerWatch:
  """Every process posts a beat to the coordination service's key-value store every ``timeout_s / 5`` seconds and
  reads everyone's; a peer whose beat has not moved for ``timeout_s`` (or a coordination service that no longer
  answers) ends this process with exit 75. A process that exits normally posts ``done`` first (``done()``, at
  exit), so the others do not mistake the end of a run for a lost peer. ``on_lost`` is for tests."""

  PREFIX = "jaxtrain/beat/"
  # A beat's value besides its counter: the process ended normally; it stops the job (with its code and line, as
  # JSON after the word); it leaves because a peer stopped the job.
  DONE, STOP, STOPPED = "done", "stop ", "stopped"
  LEAVE_S = 1.0  # what a process that stops the job leaves the others, once they said they go, to be gone

  def __init__(self, client, process_id: int, num_processes: int, timeout_s: float, clock=time.monotonic,
               on_lost=None, on_stop=None):
    self.client, self.me, self.n, self.timeout_s, self._clock = client, process_id, num_processes, timeout_s, clock
    self.on_lost = on_lost or exit_lost_peer
    self.on_stop = on_stop or exit_stopped_by_peer
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
      except Exception as e:  # noqa: BLE001 - the thread ends either way
        if self._stop.is_set():
          return
        if status_code(e) in GONE_CODES:  # the service (in process 0) is gone or does not answer
          self.on_lost(f"the coordination service no longer answers ({str(e).splitlines()[0][:200]})")
        else:  # not the service's answer: a bug or a changed client; JAX's own heartbeat check is left
          logging.warning("the peer watch stopped (jax %s): %s: %s", _compat.installed("jax"), type(e).__name__,
                          str(e).splitlines()[0][:200] if str(e) else "")
        return
      stopped = self.stopped_by(beats)
      if stopped is not None and not self._stop.is_set():
        try:  # the process that stops the job waits for this word
          self.client.key_value_set(f"{self.PREFIX}{self.me}", self.STOPPED, allow_overwrite=True)
          if self.me == 0:  # the coordination service's host leaves last (see _others_left)
            self._others_left()
        except Exception:  # noqa: BLE001 - it stops waiting at its bound
          pass
        self.on_stop(*stopped)
        return
      lost = self.check(beats)
      if lost and not self._stop.is_set():
        self.on_lost(lost)
        return

  def stopped_by(self, beats: dict[str, str]) -> tuple[int, int, str] | None:
    """``(process, code, line)`` of another process that stops the job (:meth:`stop_job`), else None."""
    for peer in range(self.n):
      value = beats.get(f"{self.PREFIX}{peer}", "")
      if peer != self.me and value.startswith(self.STOP):
        told = json.loads(value[len(self.STOP):])
        return peer, int(told["code"]), str(told["line"])
    return None

  def stop_job(self, code: int, line: str) -> None:
    """Posts that this process stops the job (``code``, ``line``) and waits until every other process has left
    (its beat says so) or stops the job itself, at most two of their polls and 10 s."""
    self._stop.set()
    self._thread.join(timeout=self.timeout_s / 5 + 5)  # its last beat must not overwrite the word below
    try:
      self.client.key_value_set(f"{self.PREFIX}{self.me}", self.STOP + json.dumps({"code": code, "line": line}),
                                allow_overwrite=True)
      self._others_left()
    except Exception as e:  # noqa: BLE001 - the service is gone: the others are ending already
      logging.warning("stopping the job: the coordination service no longer answers (%s)", str(e)[:200])

  def _others_left(self) -> None:
    """Waits until every other process has said that it leaves (or stops the job itself), at most two of their
    polls and 10 s. They leave right after saying so; process 0 then waits a moment more: the coordination service
    lives in it, and JAX aborts a process whose service is gone (exit -6 instead of the job's code)."""
    deadline = time.monotonic() + 2 * self.timeout_s / 5 + 10
    while time.monotonic() < deadline:
      beats = dict(self.client.key_value_dir_get(self.PREFIX))
      values = [beats.get(f"{self.PREFIX}{p}", "") for p in range(self.n) if p != self.me]
      if all(v in (self.DONE, self.STOPPED) or v.startswith(self.STOP) for v in values):
        if self.me == 0:
          time.sleep(self.LEAVE_S)
        return
      time.sleep(0.1)
    logging.warning("stopping the job: not every process said it leaves within the bound; leaving anyway")

  def check(self, beats: dict[str, str]) -> str | None:
    """Notes the peers' beats; a description of a peer not heard from for ``timeout_s``, else None."""
    now = self._clock()
    for peer in range(self.n):
      value = beats.get(f"{self.PREFIX}{peer}")
      if peer == self.me or value in (self.DONE, self.STOPPED) or (value or "").startswith(self.STOP):
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
      self.client.key_value_set(f"{self.PREFIX}{self.me}", self.DONE, allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the service is already gone: nobody is left to tell
      pass


def exit_lost_peer(why: str) -> None:
  """Says that a process of the job is gone and why (console and train.log), records it (:mod:`jaxtrain.restarts`),
  then exits 75 at once."""
  restarts.record(exits.LOST_PEER, why)
  logging.error("a process of the job is gone (%s): exiting %d so that the job restarts", why, exits.RESTART)
  logging.flush()
  print(f"jaxtrain: stopped: a process of the job is gone ({why}); restart the job: it resumes from the newest "
        f"checkpoint (exit {exits.RESTART})", file=sys.stderr, flush=True)
  logs.flush_all(logs.EXIT_S)  # process 0's logs on an object store (jaxtrain.logs): the last second's too
  os._exit(exits.RESTART)  # not sys.exit: JAX's shutdown barrier would wait for the lost process, then abort


def exit_stopped_by_peer(process: int, code: int, line: str) -> None:
  """Another process stopped the job (:func:`stop_job`): says so in its words (console and train.log), then exits
  with its code at once."""
  logging.error("process %d stopped the job (exit %d): %s", process, code, line)
  logging.flush()
  print(f"jaxtrain: error: process {process} stopped the job: {line}", file=sys.stderr, flush=True)
  logs.flush_all(logs.EXIT_S)  # process 0's logs on an object store (jaxtrain.logs): the last second's too
  os._exit(code)  # not sys.exit: JAX's shutdown barrier would wait for the processes still in a collective

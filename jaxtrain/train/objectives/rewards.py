"""Rewards a program checks, for reinforcement learning (``rl.rewards``): :data:`REWARDS`, the built-in ones, and
``module.path:function`` for a user's.

A reward function is ``fn(completions: list[str], records: list[dict]) -> sequence of floats``, one number per
completion: ``records[i]`` is the prompts file's record completion i answers (its prompt and whatever else it
holds: an ``answer``, test cases). A registered reward is a factory, ``rl_config -> reward function`` (so that it can
read its own keys of the ``rl`` group); a ``module:function`` is the reward function itself. ``rl.rewards`` names
them with weights, ``"exact_match,format=0.1,my_rewards:brevity=0.5"`` (weight 1 when none is given); a
completion's reward is the weighted sum, and each is logged as ``rl/reward/<name>``. In a job of several processes
the rewards run on process 0 alone, on every process's completions, and what derives from them is broadcast
(:func:`jaxtrain.train.objectives.grpo.score_once`); only the check at start calls each on every process.

A reward function may declare the record fields it reads, ``fn.fields``: a tuple of names, or a dict of each name to
the config key that names it (``{"answer": "rl.answer_field"}``). Every record of the prompts files (``data.path``,
``data.eval_path``) is checked for them when the config is (:func:`check_records`): a record without one is a
DataError naming the file, the line, the field and the fields the record has, before anything compiles.

Where they run (``rl.reward_workers``): 0, in the trainer's process, each reward called once on all the step's
completions, and one that raises or returns anything but one finite number per completion is a RewardError (one line,
exit 2). N > 0: every reward runs in a :class:`RewardPool` of N worker processes, each completion scored alone
(``fn([completion], [record])``) within ``rl.reward_timeout_s`` seconds, so that a completion whose reward raises,
returns a non-number or a non-finite one, takes longer (its worker is killed, with whatever it started, and
replaced) or ends its worker (``os._exit``, a segfault) costs that completion that reward alone: it scores 0, a
warning line names the reward, the completion and the cause (at most ``WARN_LINES`` lines a minute, the rest
counted in one line), and it is counted (``rl/reward_failures``, ``rl/reward_failures/<name>``): for rewards that run
code. A reward that scores each completion alone scores the same in the pool as in the trainer's process,
bitwise; one that reads the other completions of its call does not.

The pool: one process, a fresh interpreter (subprocess, as multiprocessing's ``spawn`` starts one but without
running the trainer's main module again; not a fork of the trainer, whose JAX runtime has threads: its child can
deadlock) in its own session, which imports the rewards' modules and builds the rewards as :func:`load` does, from
the ``rl`` group (so a reward need not be picklable; a registered reward's factory module is imported there first),
then forks its N workers (a fork of this process, which runs no JAX runtime: cheap, and a worker killed is replaced
in milliseconds), each in its own process group. A worker past its deadline gets SIGKILL, its process
group with it (what the reward started: a compiler, a test binary); the workers die with the pool's process
(PR_SET_PDEATHSIG), which stops when the trainer closes the pool (the end of a run, an error too), exits or dies (its
pipe's end). The trainer waits for a call at most the time its completions could take, plus slack.

Built in:
  exact_match  1 when the completion's final answer equals the record's ``rl.answer_field`` (default ``answer``),
               else 0. The final answer is the text after the completion's last ``####`` (GSM8K's marker) when it has
               one, else the whole completion; both sides stripped, and compared as numbers when both are numbers
               (``"7.0"`` equals ``"7"``, ``"1,000"`` equals ``"1000"``).
  format       1 when the whole completion matches the regular expression ``rl.format_regex``, else 0.

  from jaxtrain.train.objectives.rewards import REWARDS
  @REWARDS.register("brevity")
  def brevity(rl):                      # the rl config group -> the reward function
    return lambda completions, records: [1.0 / (1 + len(c)) for c in completions]
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import dataclasses
import importlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable, Sequence

import ml_collections
import numpy as np
from absl import logging

from jaxtrain.errors import ConfigError, DataError, UserError
from jaxtrain import registry
from jaxtrain.registry import Registry

RewardFn = Callable[[list[str], list[dict]], Sequence[float]]

REWARDS: Registry[Callable[..., RewardFn]] = Registry(
    "rl.rewards", "reward", "jaxtrain.train.objectives.rewards.REWARDS.register or 'module.path:function'")


class RewardError(UserError):
  """A reward function that fails or returns something other than one finite number per completion."""


@dataclasses.dataclass
class Reward:
  name: str
  weight: float
  fn: RewardFn

  @property
  def fields(self) -> dict[str, str]:
    """The record fields the function declares it reads (``fn.fields``), each with the config key naming it ("")
    or none."""
    fields = getattr(self.fn, "fields", ())
    return dict(fields) if isinstance(fields, dict) else dict.fromkeys([fields] if isinstance(fields, str) else fields,
                                                                       "")


def final_answer(completion: str) -> str:
  """The text after the completion's last ``####``, else the whole completion; stripped."""
  return completion.rpartition("####")[2].strip()


def _number(text: str) -> float | None:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return None


def same_answer(given: str, expected) -> bool:
  expected = str(expected).strip()
  a, b = _number(given), _number(expected)
  if a is not None and b is not None:
    return a == b
  return given == expected


@REWARDS.register("exact_match")
def exact_match(rl) -> RewardFn:
  field = rl.answer_field

  def reward(completions, records):
    return [float(same_answer(final_answer(c), r[field])) for c, r in zip(completions, records)]
  reward.fields = {field: "rl.answer_field"}
  return reward


@REWARDS.register("format")
def format_match(rl) -> RewardFn:
  pattern = re.compile(rl.format_regex, re.DOTALL)
  return lambda completions, records: [float(pattern.fullmatch(c) is not None) for c in completions]


def parse(spec) -> list[tuple[str, float]]:
  """``rl.rewards`` (a comma-separated string or a tuple of entries, each ``name[=weight]``) as (name, weight)."""
  entries = [e.strip() for e in (spec.split(",") if isinstance(spec, str) else spec)]
  if not entries or not all(entries):
    raise ConfigError("rl.rewards", f"{spec!r} names no reward", "e.g. --config.rl.rewards=exact_match,format=0.1")
  out = []
  for entry in entries:
    name, _, weight = entry.partition("=")
    try:
      w = float(weight) if weight else 1.0
    except ValueError:
      raise ConfigError("rl.rewards", f"'{entry}': weight '{weight}' is not a number", "write name=0.5") from None
    if not math.isfinite(w):
      raise ConfigError("rl.rewards", f"'{entry}': weight {w} is not finite", "give a finite weight")
    out.append((name.strip(), w))
  return out


def _import(path: str) -> RewardFn:
  return registry.by_import_path(path, "rl.rewards", "function", "my_rewards:brevity",
                                 "a function (completions, records) -> one float per completion")


def load(rl) -> list[Reward]:
  """The rewards ``rl.rewards`` names; ConfigError (one line naming ``rl.rewards``) when one is not registered or
  cannot be imported."""
  out = []
  for name, weight in parse(rl.rewards):
    fn = _import(name) if ":" in name else REWARDS.get(name)(rl)
    out.append(Reward(name.rpartition(":")[2] if ":" in name else name, weight, fn))
  names = [r.name for r in out]
  if len(set(names)) != len(names):
    raise ConfigError("rl.rewards", f"names a reward twice ({', '.join(names)})", "give each reward once")
  return out


def check_records(rewards: list[Reward], records: list[dict], where) -> None:
  """Every record has every field the rewards declare (:attr:`Reward.fields`); DataError naming ``where(i)`` (the
  file and line of record i), the field, the reward and the record's fields for the first that does not."""
  needs = [(field, key, r.name) for r in rewards for field, key in r.fields.items()]
  for i, record in enumerate(records):
    for field, key, name in needs:
      if field not in record:
        fix = f"add '{field}' to every record" + (f", or set {key} to the field that holds it" if key else "")
        raise DataError(where(i), f"has no '{field}' field, which reward {name} reads (its fields: "
                        f"{', '.join(map(str, record)) or 'none'})", fix)


def score(rewards: list[Reward], completions: list[str], records: list[dict]) -> tuple[np.ndarray, dict]:
  """(The weighted sum per completion, float64 ``[n]``; ``{name: [n]}`` each reward's). RewardError naming the
  function when one raises or does not return one finite number per completion."""
  parts = {}
  for r in rewards:
    try:
      values = r.fn(list(completions), list(records))
      values = np.asarray(values, np.float64)
    except (TypeError, ValueError) as e:
      raise RewardError(f"reward {r.name}", f"did not return numbers ({type(e).__name__}: {e})",
                        "return one float per completion") from None
    if values.shape != (len(completions),):
      raise RewardError(f"reward {r.name}", f"returned shape {values.shape} for {len(completions)} completions",
                        "return one float per completion (a list of that length)")
    if not np.all(np.isfinite(values)):
      raise RewardError(f"reward {r.name}", "returned a non-finite value", "return finite floats")
    parts[r.name] = values
  return _weighted(rewards, parts), parts


def _weighted(rewards: list[Reward], parts: dict[str, np.ndarray]) -> np.ndarray:
  """The weighted sum per completion (in the pool as in the trainer's process: the same sum, the same bits)."""
  return np.asarray(sum(r.weight * parts[r.name] for r in rewards), np.float64)


# The reward pool (rl.reward_workers > 0) ----------------------------------------------------------------------------

START_TIMEOUT_S = 180.0  # the pool's process imports and builds the rewards within this, or the run stops
SLACK_S = 30.0  # a call waits at most rounds x (rl.reward_timeout_s + ROUND_SLACK_S) + this (rounds: tasks / workers)
ROUND_SLACK_S = 5.0
WARN_LINES, WARN_WINDOW_S = 10, 60.0  # failure lines at most, per window; the rest counted in one line
_POLL_S = 2.0  # the pool's process checks this often that the trainer is still there


class _Gone(Exception):
  """The pool's process ended (or stopped answering) during a call."""


class RewardPool:
  """``rl.reward_workers`` worker processes scoring completions with ``rewards`` (the module docstring says how).
  The process starts at :meth:`start` (or the first :meth:`score`) and stops at :meth:`close` (or
  :func:`close_pools`, which the trainer calls at the end of a run and ``atexit`` at the process's end); a pool
  closed can be used again (it starts again)."""

  def __init__(self, rewards: list[Reward], rl):
    self.rewards, self.names = list(rewards), [r.name for r in rewards]
    self.workers, self.timeout_s = int(rl.reward_workers), float(rl.reward_timeout_s)
    rl_dict = rl.to_dict() if hasattr(rl, "to_dict") else dict(rl)
    self.key = _key(rl_dict)
    # A registered reward's factory module (a user's registers on import), imported in the pool before load().
    modules = {REWARDS.get(name).__module__ for name, _ in parse(rl.rewards) if ":" not in name}
    self._spec = (rl_dict, sorted(modules - {__name__, "__main__", "__mp_main__"}))
    self._process = self._conn = None
    self._ready = False
    self._lock = threading.Lock()
    self._warnings = _Warnings()
    _POOLS.add(self)

  @property
  def pid(self) -> int | None:
    """The pool's process id, while it runs (its workers are its children)."""
    return self._process.pid if self._process is not None else None

  def start(self) -> None:
    """Starts the pool's process (not waiting for it), unless it runs."""
    if self._process is not None:
      return
    mine, theirs = socket.socketpair()
    try:
      # A fresh interpreter, in its own session (the terminal's and a job's signals to the trainer's process group
      # are the trainer's to handle), given its end of the pipe alone.
      self._process = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                       stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
      theirs.close()
    self._conn, self._ready = multiprocessing.connection.Connection(mine.detach()), False
    rl_dict, modules = self._spec
    self._conn.send({"sys_path": list(sys.path), "rl_dict": rl_dict, "modules": modules, "workers": self.workers,
                     "timeout_s": self.timeout_s, "trainer": os.getpid()})

  def close(self) -> None:
    """Stops the pool's process and its workers (within seconds: killed if it does not stop)."""
    process, conn = self._process, self._conn
    self._process = self._conn = None
    if process is None:
      return
    try:
      conn.send(None)
      process.wait(5)
    except (OSError, subprocess.TimeoutExpired):
      process.kill()  # (its workers die with it: PR_SET_PDEATHSIG)
      process.wait(5)
    conn.close()

  def score(self, completions: list[str], records: list[dict]) -> tuple[np.ndarray, dict, dict[str, int]]:
    """(The weighted sum per completion, float64 ``[n]``; ``{name: [n]}`` each reward's; ``{name: failures}``):
    what :func:`score` returns for rewards that score each completion alone, a failed completion 0 for that reward
    (each warned of and counted). RewardError when the rewards cannot be built in the pool's process (one line, as
    :func:`load`'s), or when that process ends twice during one call."""
    with self._lock:
      values, failures = self._call(list(completions), list(records))
    parts = {name: values[k] for k, name in enumerate(self.names)}
    counts = dict.fromkeys(self.names, 0)
    for r, i, cause in sorted(failures, key=lambda f: (f[1], f[0])):  # (as the completions, not as they ended)
      counts[self.names[r]] += 1
      self._warnings.say(f"reward {self.names[r]}: completion {i} scored 0: {cause}")
    self._warnings.flush()
    return _weighted(self.rewards, parts), parts, counts

  def _call(self, completions, records):
    rounds = -(-len(completions) * len(self.rewards) // self.workers)
    bound = rounds * (self.timeout_s + ROUND_SLACK_S) + SLACK_S
    for attempt in (1, 2):
      self.start()
      try:
        if not self._ready:
          self._answer(self._receive(START_TIMEOUT_S, "start"), "ready")
          self._ready = True
        try:
          self._conn.send((completions, records))
        except OSError:
          raise _Gone(self._ended()) from None
        return self._answer(self._receive(bound, "score"), "scored")
      except _Gone as gone:
        self.close()
        if attempt == 2:
          raise RewardError("reward pool", f"its process {gone}, twice in one call",
                            "see the output above for what ended it") from None

  def _answer(self, message, kind: str):
    if message[0] == "error":
      self.close()
      raise message[1]
    assert message[0] == kind, message
    if kind == "ready" and message[1] != self.names:
      self.close()
      raise RewardError("reward pool", f"built rewards {message[1]}, not {self.names}",
                        "register a reward in a module, not in __main__")
    return message[1]

  def _receive(self, seconds: float, what: str):
    """The pool process's next message, within ``seconds``; _Gone when it ends (its end of the pipe with it) or
    does not answer in time (it is killed then)."""
    if not self._conn.poll(seconds):
      self._process.kill()
      self._process.wait(5)
      raise _Gone(f"did not {what} within {seconds:.0f}s and was killed")
    try:
      return self._conn.recv()
    except (EOFError, OSError):
      raise _Gone(self._ended()) from None

  def _ended(self) -> str:
    try:
      code = self._process.wait(5)
    except subprocess.TimeoutExpired:
      return "closed its pipe"
    return f"ended ({'killed by ' + signal.Signals(-code).name if code < 0 else f'exit code {code}'})"


_POOLS: weakref.WeakSet[RewardPool] = weakref.WeakSet()


def open_pool(rewards: list[Reward], rl, start: bool = False) -> RewardPool | None:
  """The process's pool for the ``rl`` group (one per distinct group: the trainer's and the evaluator's are one), or
  None when ``rl.reward_workers`` is 0 (the rewards run in this process); ``start``: its process starts now, in the
  background (else at its first call)."""
  if not rl.reward_workers:
    return None
  key = _key(rl.to_dict() if hasattr(rl, "to_dict") else dict(rl))
  pool = next((p for p in list(_POOLS) if p.key == key), None) or RewardPool(rewards, rl)
  if start:
    pool.start()
  return pool


def close_pools() -> None:
  """Stops every pool of this process (the end of a run; and at exit)."""
  for pool in list(_POOLS):
    pool.close()


atexit.register(close_pools)  # (a process that ends by os._exit or a signal: the pool's sees its pipe end, and stops)


def _key(rl_dict: dict) -> str:
  return json.dumps(rl_dict, sort_keys=True, default=str)


class _Warnings:
  """Failure lines, at most ``lines`` per ``window_s`` seconds; the rest counted and told in one line when the window
  is over (at the next call's end)."""

  def __init__(self, lines: int = WARN_LINES, window_s: float = WARN_WINDOW_S):
    self.lines, self.window_s = lines, window_s
    self.start, self.said, self.held = -math.inf, 0, 0

  def say(self, message: str) -> None:
    self.flush()
    if self.said < self.lines:
      logging.warning("%s", message)
      self.said += 1
    else:
      self.held += 1

  def flush(self) -> None:
    now = time.monotonic()
    if now - self.start < self.window_s:
      return
    if self.held:
      logging.warning("%d more reward failures in the last %.0fs, not shown (the reward_failures metrics count "
                      "each)", self.held, now - self.start)
    self.start, self.said, self.held = now, 0, 0


# The pool's process: its end of the pipe, then what RewardPool.start sends (the trainer's sys.path first, so that the
# rewards' modules import as they do in the trainer).
_BOOT = ("import sys\n"
         "from multiprocessing.connection import Connection\n"
         "conn = Connection(int(sys.argv[1]))\n"
         "spec = conn.recv()\n"
         "sys.path[:] = spec.pop('sys_path')\n"
         "from jaxtrain.train.objectives.rewards import _serve\n"
         "_serve(conn, **spec)\n")


def _serve(conn, rl_dict: dict, modules: list[str], workers: int, timeout_s: float, trainer: int) -> None:
  """The pool's process: builds the rewards, forks the workers, scores each call's completions until the trainer
  sends None, closes its end, or is gone."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    for module in modules:
      importlib.import_module(module)
    rewards = load(ml_collections.ConfigDict(rl_dict))
    pool = _Workers(rewards, workers, timeout_s, conn, trainer)
  except UserError as e:
    conn.send(("error", e))
    return
  except Exception as e:  # noqa: BLE001 - a factory's or an import's failure, whatever it is, told as one line
    conn.send(("error", RewardError("reward pool", f"cannot build the rewards ({type(e).__name__}: {e})",
                                    "import the reward's module in a fresh Python to see why")))
    return
  try:
    conn.send(("ready", [r.name for r in rewards]))
    while True:
      while not conn.poll(_POLL_S):
        if os.getppid() != trainer:
          return
      call = conn.recv()
      if call is None:
        return
      scored = pool.run(*call)
      if scored is None:
        return
      conn.send(("scored", scored))
  except (EOFError, OSError):
    return
  finally:
    pool.close()


class _Workers:
  """The pool process's forked workers, each with its pipe and its own process group."""

  def __init__(self, rewards: list[Reward], n: int, timeout_s: float, trainer_conn, trainer: int):
    self.rewards, self.timeout_s, self.trainer_conn, self.trainer = rewards, timeout_s, trainer_conn, trainer
    self.pids = {}  # the pool's end of each worker's pipe -> its pid
    self.idle = [self._fork() for _ in range(n)]

  def _fork(self):
    mine, theirs = multiprocessing.Pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker: never returns
      code = 0
      try:
        for c in (mine, self.trainer_conn, *self.pids):
          c.close()
        os.setpgid(0, 0)
        _die_with(parent)
        for s in (signal.SIGINT, signal.SIGTERM):
          signal.signal(s, signal.SIG_DFL)
        _work(theirs, self.rewards)
      except BaseException:  # noqa: BLE001 - the worker's end, whatever ends it: never the pool's code after fork
        code = 1
      finally:
        for stream in (sys.stdout, sys.stderr):
          try:
            stream.flush()
          except Exception:  # noqa: BLE001, S110 - a stream closed by the reward: nothing to flush
            pass
        os._exit(code)
    theirs.close()
    try:
      os.setpgid(pid, pid)  # (as the worker does: whichever runs first)
    except OSError:
      pass
    self.pids[mine] = pid
    return mine

  def _end(self, conn) -> str:
    """Kills a worker (and its process group), reaps it; how it ended."""
    pid = self.pids.pop(conn)
    conn.close()
    for kill in (os.killpg, os.kill):
      try:
        kill(pid, signal.SIGKILL)
        break
      except OSError:
        continue
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
      return f"its worker was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"its worker exited with code {os.WEXITSTATUS(status)}"

  def run(self, completions: list[str], records: list[dict]):
    """(Values ``[rewards, n]`` float64, failures [(reward, completion, cause)]); None when the trainer is gone or
    has closed its end."""
    values = np.zeros((len(self.rewards), len(completions)), np.float64)
    failures = []
    todo = collections.deque((i, r) for i in range(len(completions)) for r in range(len(self.rewards)))
    busy = {}  # conn -> (completion, reward, deadline)
    while todo or busy:
      while todo and self.idle:
        conn = self.idle.pop()
        i, r = todo.popleft()
        try:
          conn.send((r, completions[i], records[i]))
        except OSError:  # the worker ended since its last answer: the task goes to another one
          self._end(conn)
          self.idle.append(self._fork())
          todo.appendleft((i, r))
          continue
        busy[conn] = (i, r, time.monotonic() + self.timeout_s)
      wait = min(deadline for _, _, deadline in busy.values()) - time.monotonic()
      ready = multiprocessing.connection.wait([*busy, self.trainer_conn], timeout=min(max(wait, 0.0), _POLL_S))
      if self.trainer_conn in ready or os.getppid() != self.trainer:
        return None  # (the trainer sends nothing during a call: it has closed its end, or is gone)
      for conn in ready:
        i, r, _ = busy.pop(conn)
        try:
          value, cause = conn.recv()
          self.idle.append(conn)
        except (EOFError, OSError):
          value, cause = None, self._end(conn)
          self.idle.append(self._fork())
        if cause is None:
          values[r, i] = value
        else:
          failures.append((r, i, cause))
      now = time.monotonic()
      for conn, (i, r, deadline) in list(busy.items()):
        if now >= deadline:
          del busy[conn]
          self._end(conn)
          self.idle.append(self._fork())
          failures.append((r, i, f"took longer than rl.reward_timeout_s={self.timeout_s:g}s (its worker was killed)"))
    return values, failures

  def close(self) -> None:
    for conn in list(self.pids):
      self._end(conn)
    self.idle = []


def _work(conn, rewards: list[Reward]) -> None:
  """A worker: scores one completion by one reward per message, until its pipe ends."""
  while True:
    try:
      r, completion, record = conn.recv()
    except EOFError:
      return
    conn.send(_score_one(rewards[r].fn, completion, record))


def _score_one(fn: RewardFn, completion: str, record: dict) -> tuple[float | None, str | None]:
  """(The reward's value, None), or (None, why it has none)."""
  try:
    out = fn([completion], [record])
  except BaseException as e:  # noqa: BLE001 - sys.exit in a reward too: the completion fails, the worker lives on
    return None, _one_line(f"raised {type(e).__name__}: {e}")
  try:
    values = np.asarray(out, np.float64)
  except (TypeError, ValueError) as e:
    return None, _one_line(f"did not return numbers ({type(e).__name__}: {e})")
  if values.shape != (1,):
    return None, f"returned shape {values.shape} for 1 completion"
  if not np.isfinite(values[0]):
    return None, f"returned {values[0]}"
  return float(values[0]), None


def _one_line(text: str, limit: int = 300) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _die_with(parent: int) -> None:
  """This process gets SIGKILL when ``parent`` (the thread that forked it) ends: Linux's PR_SET_PDEATHSIG; elsewhere
  nothing (the pipe's end stops a worker waiting for work)."""
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    return
  if os.getppid() != parent:  # (it ended before the call)
    os._exit(0)

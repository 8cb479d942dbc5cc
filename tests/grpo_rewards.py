"""Reward functions for tests/test_grpo.py, named as ``tests.grpo_rewards:<function>``."""


def wrong_shape(completions, records):
  return [0.0] * (len(completions) + 1)  # one number too many


def letters(completions, records):
  """The share of a completion's characters that are lowercase letters: varies between samples of any model."""
  return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]


_DRAWN: list = []  # this process's generator and its calls so far


def flaky_coin(completions, records):
  """0 or 1 at random for each completion, then NaN from its 5th call on (step 4 of a run: the check at start is its
  first): a reward that answers differently at every call and on every process, then fails, as code run under a
  timeout may. Its generator is seeded by the process's index, so that process 0 of a job draws what the one process
  of a 1-process run draws."""
  import jax  # (at the call: jax.distributed has started by then)
  import numpy as np
  if not _DRAWN:
    _DRAWN[:] = [np.random.default_rng(jax.process_index()), 0]
  _DRAWN[1] += 1
  if _DRAWN[1] >= 5:
    return [float("nan")] * len(completions)
  return _DRAWN[0].integers(0, 2, len(completions)).astype(float).tolist()


def misbehaving(completions, records):
  """``letters``, but as code run for a reward may fail, by what the completion says: "crash" ends the process
  (os._exit(3)), "segv" kills it with SIGSEGV, "hang" sleeps for ten minutes, "hang_child" starts a process that
  sleeps for ten minutes (its pid written to the record's ``pid_file``) and sleeps too, "raise" raises, "nan" returns
  NaN, "text" returns a string: for tests/test_grpo.py's reward pool (rl.reward_workers)."""
  import os
  import signal
  import subprocess
  import time
  out = []
  for c, r in zip(completions, records):
    if c == "crash":
      os._exit(3)
    if c == "segv":
      os.kill(os.getpid(), signal.SIGSEGV)
    if c == "hang":
      time.sleep(600)
    if c == "hang_child":
      child = subprocess.Popen(["sleep", "600"])
      with open(r["pid_file"], "w") as f:
        f.write(str(child.pid))
      time.sleep(600)
    if c == "raise":
      raise ValueError(f"cannot run {c!r}")
    out.append(float("nan") if c == "nan" else "seven" if c == "text" else letters([c], [r])[0])
  return out


def starts_lower(completions, records):
  """1 when a completion starts with a lowercase ASCII letter, else 0: about 1 completion in 10 of a model at its
  random start (byte-level), so that about half the groups of 8 have equal rewards (rl.dynamic_sampling's test)."""
  return [float(c[:1].isascii() and c[:1].islower()) for c in completions]

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

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

import dataclasses
import math
import re
from typing import Callable, Sequence

import numpy as np

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
  total = sum(r.weight * parts[r.name] for r in rewards)
  return np.asarray(total, np.float64), parts

"""User mistakes, and the small checks every component uses to report them.

A mistake in what the user gave us (a config value, a data file, a path) is a :class:`UserError`: ``main`` prints
it as one line, ``<subject>: <problem>; <fix>``, and exits with code 2 before anything is touched. Each component
validates its own config keys next to their defaults (``validate(config)`` in its module) with these helpers.
"""

from __future__ import annotations

from typing import Iterable


class UserError(Exception):
  """A mistake in what the user gave us (config, data, paths): printed as one line, exit code 2."""

  def __init__(self, subject: str, problem: str, fix: str):
    self.subject, self.problem, self.fix = subject, problem, fix
    super().__init__(f"{subject}: {problem}; {fix}")

  def __reduce__(self):  # picklable with its three parts: raised in a worker process, re-raised in the parent
    return type(self), (self.subject, self.problem, self.fix)


class ConfigError(UserError):
  """A config key with a wrong value: ``subject`` is the key."""


class DataError(UserError):
  """A missing, empty, corrupt or mismatched data file: ``subject`` names the file."""


def value(cfg, key: str):
  """``cfg['a']['b']`` for ``key='a.b'``."""
  for part in key.split("."):
    cfg = cfg[part]
  return cfg


def check_choice(cfg, key: str, choices: Iterable[str]) -> None:
  choices = list(choices)
  v = value(cfg, key)
  if v not in choices:
    raise ConfigError(key, f"'{v}' is not one of {', '.join(choices)}", f"set {key} to one of them")


def check_positive(cfg, keys: Iterable[str], allow_zero: bool = False) -> None:
  for key in keys:
    v = value(cfg, key)
    if v < 0 or (v == 0 and not allow_zero):
      raise ConfigError(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {v}", "fix the value")


def find_cause(e: BaseException, matches) -> BaseException | None:
  """The first of ``e``, its causes and contexts and an exception group's members for which ``matches`` is true, or
  None (each visited once)."""
  seen, todo = set(), [e]
  while todo:
    x = todo.pop()
    if x is None or id(x) in seen:
      continue
    seen.add(id(x))
    if matches(x):
      return x
    todo += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]
  return None

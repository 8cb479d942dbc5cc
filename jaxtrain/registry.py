"""Named choices: every choice a config key makes (a model family, an optimizer, a schedule, a remat policy, an
attention backend, a data source, a NaN policy) is one :class:`Registry`, and the key's validation reads it, so
adding a choice is one ``register`` call, from inside the package or outside it.

  OPTIMIZERS = Registry("optim.name", "optimizer")
  @OPTIMIZERS.register("lion")
  def lion(cfg, learning_rate): ...     # -> optax.GradientTransformation
  OPTIMIZERS.get(config.optim.name)      # ConfigError naming optim.name and the registered names if unknown
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

from jaxtrain.errors import ConfigError, value

T = TypeVar("T")
_DECORATOR = object()


class Registry(Generic[T]):
  """Name -> value for the config key ``key``. The module that defines a registry imports the modules of its
  built-in choices (explicitly, so that the import graph sees them: tests/test_layers.py)."""

  def __init__(self, key: str, what: str, how: str = ""):
    """``how``: where a user adds an entry (named in the error for an unknown name)."""
    self.key, self.what, self.how = key, what, how or f"{key}'s registry"
    self._entries: dict[str, T] = {}

  def register(self, name: str, value: T = _DECORATOR):
    """``register(name, value)``, or ``@register(name)`` on a function or class. Registering a name again
    replaces the entry (a user's module reloaded in a notebook)."""
    if value is not _DECORATOR:
      self._entries[name] = value
      return value

    def wrap(v: T) -> T:
      self._entries[name] = v
      return v
    return wrap

  def names(self) -> list[str]:
    return sorted(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def get(self, name: str) -> T:
    """The entry, or ConfigError naming the key and what is registered."""
    if name not in self:
      raise ConfigError(self.key, f"'{name}' is not a registered {self.what}",
                        f"use one of {', '.join(self.names())}, or register yours with {self.how}")
    return self._entries[name]

  def check(self, cfg) -> None:
    """Raises ConfigError if the config's value of this key is not registered."""
    self.get(value(cfg, self.key))

  def items(self) -> list[tuple[str, T]]:
    return sorted(self._entries.items())


def by_import_path(path: str, key: str, kind: str, example: str, wanted: str):
  """The callable that ``path`` (``"package.module:name"``) names, for the config key ``key``: a user's part given
  by import path (a loop hook's factory, a reward function). ConfigError (one line naming ``key`` and the path) if
  it is not of that form (``kind``: what its ``name`` is; ``example``: a path of the right form), cannot be imported,
  is not there or is not callable (``wanted``: what it should name)."""
  module, _, name = path.partition(":")
  if not module or not name:
    raise ConfigError(key, f"'{path}' is not 'module.path:{kind}'", f"e.g. '{example}'")
  try:
    found = getattr(importlib.import_module(module), name)
  except ImportError as e:
    raise ConfigError(key, f"'{path}': module {module} cannot be imported ({type(e).__name__}: {e})",
                      "put its folder on PYTHONPATH or install it") from None
  except AttributeError:
    raise ConfigError(key, f"'{path}': module {module} has no {name}", f"name {wanted}") from None
  if not callable(found):
    raise ConfigError(key, f"'{path}' is not callable", f"name {wanted}")
  return found

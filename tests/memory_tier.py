"""A checkpoint tier added from outside ``jaxtrain/`` (docs/extending.md walks through it): every process keeps its
steps in host memory, here for the life of the Python process (a real one would keep them in another process or
on a peer host, to outlive a crash). Importing this module registers it as ``memory``; a config picks it with
``checkpoint.tiers = ("persistent", "memory")``. The checkpointer decides when it saves (every
``memory_every_steps`` steps the persistent tier does not take), restores it when it holds the newest step, falls
back from a step that does not read back and has it forget an abandoned timeline's steps."""

from __future__ import annotations

import json

import jax
import numpy as np
from absl import logging

from jaxtrain import checkpoint
from jaxtrain import integrity

STORE: dict[str, dict[int, tuple]] = {}  # run (its persistent folder) -> step -> (host state, position, meta)


class MemoryTier:
  """A :class:`jaxtrain.checkpoint.Tier` in host memory: saves are synchronous copies, every one fingerprinted."""

  name = "memory"
  verify = True
  failures = 0

  def __init__(self, run: str, every_steps: int, keep_last: int = 2):
    self.saved = STORE.setdefault(run, {})
    self.where = f"memory tier, {run}"
    self.every_steps, self.keep_last = every_steps, keep_last
    self.last_save_blocked_s = 0.0

  def steps(self) -> list[int]:
    return sorted(self.saved)

  def should_save(self, step: int) -> bool:
    return step % self.every_steps == 0

  def save(self, step, state, data_iterator, meta, config, force=False, summary=None) -> bool:
    fingerprints, nonfinite = summary if summary is not None else integrity.summarize(state)
    if nonfinite:
      raise checkpoint.NonFiniteState(f"non-finite values in {nonfinite[0]}")
    host = jax.tree.map(lambda a: np.array(a, copy=True), state)  # the next step donates the device buffers
    position = data_iterator.get_state() if isinstance(data_iterator, checkpoint.DataPosition) else None
    self.saved[step] = (host, json.loads(json.dumps(position)), {**meta, "fingerprints": fingerprints})
    for old in self.steps()[:-self.keep_last]:
      del self.saved[old]
    return True

  def wait(self) -> None:
    """Nothing in flight: every save is done when save() returns."""

  def restorable(self, abstract_state, newer_than: int) -> list[int]:
    return [s for s in self.steps() if s > newer_than]

  def restore(self, step, abstract_state, data_iterator):
    host, position, meta = self.saved[step]
    state = jax.tree.map(lambda h, a: jax.device_put(h, a.sharding), host, abstract_state)
    wrong = [k for k, v in integrity.summarize(state)[0].items() if meta["fingerprints"].get(k) != v]
    if wrong:
      raise checkpoint.CorruptCheckpoint(f"{wrong[0]} does not match its fingerprint")
    if position is not None and isinstance(data_iterator, checkpoint.DataPosition):
      data_iterator.set_state(position)
    return state, {k: v for k, v in meta.items() if k != "fingerprints"}

  def set_aside(self, step: int, error: Exception) -> None:
    logging.warning("memory checkpoint step %d cannot be restored (%s); dropped, falling back", step, error)
    del self.saved[step]

  def forget_after(self, step: int) -> None:
    for newer in [s for s in self.steps() if s > step]:
      del self.saved[newer]

  def close(self) -> None:
    """Nothing to release: the steps stay in STORE for the next run of this process."""


@checkpoint.TIERS.register("memory")
def from_config(config) -> MemoryTier:
  return MemoryTier(config.checkpoint.dir, every_steps=config.checkpoint.get("memory_every_steps", 1))

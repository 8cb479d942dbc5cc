"""The one object a run's loop and trainer hold for its checkpoints: :class:`Checkpointer`, over the tiers
``checkpoint.tiers`` names (:data:`jaxtrain.checkpoint.TIERS`). It decides which tier saves a step, restores the
newest step any tier has that every process can read, falls back from a step that does not read back (set aside,
the next one tried), rolls back to the persistent tier, and has the other tiers forget the steps of an abandoned
timeline."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from absl import logging

from jaxtrain.checkpoint.errors import CorruptCheckpoint, TierUnavailable
from jaxtrain.checkpoint.tier import TIERS, Tier


def checkpoint_due(step: int, last: int, preempted: bool, should_save: Callable[[int], bool]) -> str | None:
  """``'forced'`` at the last step and on preemption, ``'periodic'`` where ``should_save(step)`` (the
  persistent tier's every_steps / every_minutes) says so, else None."""
  if preempted or step == last:
    return "forced"
  return "periodic" if should_save(step) else None


class Checkpointer:
  """A run's checkpoints in ``tiers``, the persistent tier first: the one every process reads, saved at the last
  step and on preemption, and the one a rollback goes back to. Every process calls every method at the same
  steps."""

  def __init__(self, tiers: Sequence[Tier]):
    self.tiers = list(tiers)
    self.persistent = self.tiers[0]

  @classmethod
  def from_config(cls, config) -> Checkpointer:
    """The tiers of ``checkpoint.tiers`` (a registered tier's factory may turn itself off: None)."""
    tiers = [TIERS.get(name)(config) for name in config.checkpoint.tiers]
    return cls([tier for tier in tiers if tier is not None])

  @property
  def verify(self) -> bool:
    """Whether any tier fingerprints its saves (then the loop has the train step compute them)."""
    return any(tier.verify for tier in self.tiers)

  def steps(self) -> list[int]:
    """The persistent tier's committed steps (what a rollback may go back to)."""
    return self.persistent.steps()

  def due(self, step: int, last: int, preempted: bool) -> tuple[Tier, bool] | None:
    """``(tier, forced)``: the tier that saves ``step`` (the persistent tier at the last step, on preemption and
    on its cadence; else the first other tier whose cadence says so), or None."""
    why = checkpoint_due(step, last, preempted, self.persistent.should_save)
    if why:
      return self.persistent, why == "forced"
    return next(((tier, False) for tier in self.tiers[1:] if tier.should_save(step)), None)

  def wants_fingerprints(self, step: int, last: int) -> bool:
    """Whether ``step`` may be saved to a tier that fingerprints its saves (asked when the step is dispatched,
    before a preemption is known: the persistent tier's forced save at the last step counts)."""
    return any(tier.verify and tier.should_save(step) for tier in self.tiers[1:]) or (
        self.persistent.verify and (step == last or self.persistent.should_save(step)))

  def save(self, tier: Tier, step: int, state: Any, data_iterator, meta: dict, config: dict, forced: bool,
           summary=None) -> float:
    """Saves ``step`` to ``tier`` (see :meth:`Tier.save`); returns the seconds the save blocked the loop."""
    tier.save(step, state, data_iterator, meta, config, force=forced, summary=summary)
    return tier.last_save_blocked_s

  def wait(self) -> None:
    for tier in self.tiers:
      tier.wait()

  def restore(self, abstract_state: Any, data_iterator) -> tuple[Any, dict, str] | None:
    """``(state, meta, where)`` of the newest step that every process can restore, with the data position: a
    step of another tier only if it is newer than the persistent tier's newest (at the same step the tier listed
    first wins), else the persistent tier's. None if there is none. The steps past the one restored are forgotten
    in every tier (0 if none: a fresh start)."""
    newest = self.persistent.steps()
    floor = newest[-1] if newest else 0
    offers = [(step, -rank, tier) for rank, tier in enumerate(self.tiers)
              for step in tier.restorable(abstract_state, 0 if rank == 0 else floor)]
    restored = self._first_that_restores(sorted(offers, key=lambda o: o[:2], reverse=True), abstract_state,
                                         data_iterator)
    self._forget_after(restored[0] if restored else 0)
    return restored and restored[1:]

  def rollback(self, abstract_state: Any, data_iterator, live: Any = None) -> tuple[Any, dict] | None:
    """``(state, meta)`` of the persistent tier's newest step that restores, with the data position; the steps
    past it are forgotten in every tier. ``live``: the run's state, which leaves the devices (to host memory,
    :class:`Spilled`) while the checkpoint is restored onto them, since they hold one state, not two; it is freed
    once a step restored. When none restores (nothing is forgotten then): ``(live, None)``, ``live`` back on the
    devices as it was, or None without ``live``."""
    offers = [(step, 0, self.persistent) for step in reversed(self.persistent.restorable(abstract_state, 0))]
    spilled = Spilled(live) if live is not None and offers else None
    restored = self._first_that_restores(offers, abstract_state, data_iterator)
    if restored is None:
      return (spilled.back() if spilled is not None else live, None) if live is not None else None
    self._forget_after(restored[0])
    return restored[1:3]

  def _first_that_restores(self, offers, abstract_state: Any,
                           data_iterator) -> tuple[int, Any, dict, str] | None:
    """``(step, state, meta, where)`` of the first of ``offers`` (``(step, _, tier)``, in the order to try) that
    restores. A step whose own bytes are proven bad (:class:`CorruptCheckpoint`) is set aside by its tier and the next
    one tried; a tier that cannot be read now (:class:`TierUnavailable`, never the persistent one) is passed over,
    nothing set aside. Everything else is raised by its cause: the user's mistakes and the environment's failures
    (exit 2: permissions, a full disk, out of memory; exit 75: a store that does not answer, an I/O error) and bugs,
    so that no readable step is ever set aside and a run never starts over silently."""
    skipped = set()
    for step, _, tier in offers:
      if tier.name in skipped:
        continue
      try:
        state, meta = tier.restore(step, abstract_state, data_iterator)
      except CorruptCheckpoint as e:
        tier.set_aside(step, e)
        continue
      except TierUnavailable as e:
        if tier is self.persistent:
          raise
        logging.warning("the %s tier cannot be read now (%s); restoring from the other tiers, nothing set aside",
                        tier.name, e)
        skipped.add(tier.name)
        continue
      return step, state, meta, tier.where
    return None

  def _forget_after(self, step: int) -> None:
    for tier in self.tiers:
      tier.forget_after(step)

  def metrics(self) -> dict[str, int]:
    """``checkpoint/<name>_failures``: the failed saves each tier but the persistent one counted (agreed)."""
    return {f"checkpoint/{tier.name}_failures": tier.failures for tier in self.tiers[1:]}

  def close(self) -> None:
    for tier in self.tiers:
      tier.close()


class Spilled:
  """A state moved off its devices: this process's distinct shards of every array copied to host memory, then the
  device buffers freed (:meth:`back` puts them back, bitwise). A rollback restores a checkpoint while the live state
  would otherwise still hold the devices' memory: two states at once, which a chip sized for one cannot hold (XLA's
  RESOURCE_EXHAUSTED). Leaves that are not arrays stay as they are."""

  def __init__(self, state: Any):
    leaves, self.treedef = jax.tree.flatten(state)
    self.leaves = []
    for leaf in leaves:
      if not isinstance(leaf, jax.Array):
        self.leaves.append(leaf)
        continue
      host: dict[Any, Any] = {}  # a shard's index -> its values (a replicated array: one copy for its devices)
      placed = []
      for shard in leaf.addressable_shards:
        key = tuple((s.start, s.stop, s.step) for s in shard.index)
        if key not in host:
          host[key] = jax.device_get(shard.data)
        placed.append((shard.device, key))
      self.leaves.append(_OnHost(leaf.shape, leaf.sharding, host, placed))
    for leaf in leaves:
      if isinstance(leaf, jax.Array):
        leaf.delete()

  def back(self) -> Any:
    """The state on its devices again, as it was."""
    return jax.tree.unflatten(self.treedef, [leaf.back() if isinstance(leaf, _OnHost) else leaf
                                             for leaf in self.leaves])


class _OnHost:
  def __init__(self, shape, sharding, host, placed):
    self.shape, self.sharding, self.host, self.placed = shape, sharding, host, placed

  def back(self) -> jax.Array:
    return jax.make_array_from_single_device_arrays(self.shape, self.sharding, [
        jax.device_put(self.host[key], device) for device, key in self.placed])

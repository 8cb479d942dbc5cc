"""The one object a run's loop and trainer hold for its checkpoints: :class:`Checkpointer`, over the tiers
``checkpoint.tiers`` names (:data:`jaxtrain.checkpoint.TIERS`). It decides which tier saves a step, restores the
newest step any tier has that every process can read, falls back from a step that does not read back (set aside,
the next one tried), rolls back to the persistent tier, and has the other tiers forget the steps of an abandoned
timeline."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxtrain import exits
from jaxtrain.checkpoint.tier import TIERS, Tier
from jaxtrain.errors import UserError


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

  def rollback(self, abstract_state: Any, data_iterator) -> tuple[Any, dict] | None:
    """``(state, meta)`` of the persistent tier's newest step that restores, with the data position; the steps
    past it are forgotten in every tier. None if there is none (nothing is forgotten then)."""
    offers = [(step, 0, self.persistent) for step in reversed(self.persistent.restorable(abstract_state, 0))]
    restored = self._first_that_restores(offers, abstract_state, data_iterator)
    if restored is None:
      return None
    self._forget_after(restored[0])
    return restored[1:3]

  def _first_that_restores(self, offers, abstract_state: Any,
                           data_iterator) -> tuple[int, Any, dict, str] | None:
    """``(step, state, meta, where)`` of the first of ``offers`` (``(step, _, tier)``, in the order to try) that
    restores; each that does not read back is set aside by its tier. The user's mistakes (a checkpoint of another
    model) and the failures a restart cures (an object store that does not answer) are raised."""
    for step, _, tier in offers:
      try:
        state, meta = tier.restore(step, abstract_state, data_iterator)
      except (UserError, exits.Restart):
        raise
      except Exception as e:  # noqa: BLE001 - corrupt or truncated: fall back to the next one
        tier.set_aside(step, e)
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

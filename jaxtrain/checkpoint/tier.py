"""The two interfaces of the checkpoint package: :class:`Tier`, one place a run's checkpoints are kept (the
persistent Orbax tier, the node-local tier, a user's), and :class:`DataPosition`, what a data iterator needs to be
saved with them. :data:`TIERS` names the tiers ``checkpoint.tiers`` picks from.

A tier saves, lists, restores one step, sets a bad step aside and forgets the steps past the one a run goes on
from; *when* it saves, which step a run resumes from and what happens on a corrupt step is the
:class:`jaxtrain.checkpoint.Checkpointer`'s, the same for every tier.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

from jaxtrain.registry import Registry


@runtime_checkable
class DataPosition(Protocol):
  """What the checkpointer needs of a data iterator to save its position and resume it exactly. The train
  iterator of :func:`jaxtrain.data.open_train` and the synthetic source have it; an iterator without these three
  methods trains, but its checkpoints hold no data position (a resume starts its stream over)."""

  def get_state(self) -> dict:
    """This process's position, a dict that survives ``json.dumps`` / ``json.loads`` (it is saved as JSON)."""
    ...

  def set_state(self, state: dict) -> None:
    """Moves the iterator to ``state``, one that :meth:`get_state` or :meth:`resplit` returned."""
    ...

  def resplit(self, saved_states: list[dict]) -> dict:
    """This process's position, for :meth:`set_state`, from the positions that every process of a run with
    *another* process count saved at one step (``saved_states[i]``: process i's). The global stream must go on
    where that run stopped; raise a :class:`jaxtrain.config.UserError` if it cannot (another global batch)."""
    ...


@runtime_checkable
class Tier(Protocol):
  """One place a run's checkpoints are kept. Every process of a job holds one of each tier and calls its methods
  at the same steps (a tier may gather across processes in any of them). A step is committed or absent: a killed
  save must never be listed.

  ``name``: the tier's name in ``checkpoint.tiers`` and in its failure count's metric
  (``checkpoint/<name>_failures``, logged for every tier but the first). ``where``: where its checkpoints are, for
  the log (``resumed from checkpoint step 6 (<where>)``). ``verify``: whether its saves are fingerprinted (the
  checkpointer then has the fingerprints computed on device, with the step, and hands them to :meth:`save`).
  ``failures``: failed saves the tier counted and let the run go on after (a tier whose failed save ends the run
  raises instead: 0). ``last_save_blocked_s``: how long the last :meth:`save` blocked the loop."""
  name: str
  where: str
  verify: bool
  failures: int
  last_save_blocked_s: float

  def steps(self) -> list[int]:
    """The committed steps, ascending (this process's view)."""
    ...

  def should_save(self, step: int) -> bool:
    """Whether the tier's own cadence saves ``step``."""
    ...

  def save(self, step: int, state: Any, data_iterator, meta: dict, config: dict, force: bool = False,
           summary: tuple[dict[str, int], list[str]] | None = None) -> bool:
    """Starts saving ``state`` (the train state pytree), the position of ``data_iterator`` (a
    :class:`DataPosition`, or anything else: then none) and the JSON ``meta`` as ``step``; returns whether a save
    was started. ``config``: the resolved config (a tier may keep it); ``force``: save even if the cadence says
    no (the last step, a preemption); ``summary``: the state's fingerprints and non-finite names
    (:func:`jaxtrain.integrity.read`), when ``verify``. Raises :class:`NonFiniteState` (nothing written) for a
    non-finite state."""
    ...

  def wait(self) -> None:
    """Blocks until the saves started are committed (or settled as failed)."""
    ...

  def restorable(self, abstract_state: Any, newer_than: int) -> list[int]:
    """The steps newer than ``newer_than`` that this tier may restore onto ``abstract_state``'s shardings,
    ascending, the same list on every process (agreed across them if need be)."""
    ...

  def restore(self, step: int, abstract_state: Any, data_iterator) -> tuple[Any, dict]:
    """``(state, meta)`` of ``step``, onto ``abstract_state``'s shardings (ShapeDtypeStructs), checked against its
    fingerprints when it has them; moves ``data_iterator`` to the saved position. Raises
    :class:`jaxtrain.checkpoint.CorruptCheckpoint` when the step's own bytes are proven bad (a fingerprint mismatch,
    non-finite values, bytes that do not decode, files missing: the checkpointer sets it aside and falls back to the
    next step); a tier other than the persistent one may raise :class:`jaxtrain.checkpoint.TierUnavailable` when it
    cannot be read now (the checkpointer passes over its steps, nothing set aside). Anything else is raised by its
    cause and ends the run: a :class:`jaxtrain.errors.UserError` for the user's mistake (a checkpoint of another
    model), the storage's and the memory's failures (:func:`jaxtrain.checkpoint.environment_error`), a bug. A
    readable step is never set aside."""
    ...

  def set_aside(self, step: int, error: Exception) -> None:
    """Says why ``step`` cannot be restored (``error``) and moves it where it is neither restored nor listed."""
    ...

  def forget_after(self, step: int) -> None:
    """The run goes on from ``step`` (0: from scratch): the steps past it belong to an abandoned timeline and are
    deleted (on every process) before any of them saves again."""
    ...

  def close(self) -> None:
    """Waits for the saves in flight and releases what the tier holds."""
    ...


TIERS: Registry[Callable[[Any], Tier | None]] = Registry(
    "checkpoint.tiers", "checkpoint tier", how="jaxtrain.checkpoint.TIERS.register(name, factory)")
"""Name -> ``factory(config) -> Tier | None``: the tier of a resolved config, or None when the config turns it off
(the local tier without ``checkpoint.local_dir``). ``checkpoint.tiers`` lists the names a run uses; its first is
the persistent tier, which every process reads (rollbacks go back to it)."""

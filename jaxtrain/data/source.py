"""What a data source is: one :class:`Source` in :data:`SOURCES`, registered by the module that implements it
(built in: :mod:`jaxtrain.data.arrayrecord`, :mod:`jaxtrain.data.stream` (raw), :mod:`jaxtrain.data.synthetic`;
from outside: ``jaxtrain.data.SOURCES.register(name, Source(...))``, e.g. in a config file).

A source owns everything about itself: its train stream (a :class:`jaxtrain.checkpoint.DataPosition`, so that
checkpoints hold its position), its eval batches, where a batch's rows came from, its own config keys (``defaults``:
the group ``data.<name>``), its config-time checks (``validate``), the tokenizer its tokens come from (for
generation), how a document is named in errors, and, when it can serve documents by id (:class:`Documents`), how a
path of it opens as a :class:`Folder`: a mixture's component or an eval set. Nothing outside its module names it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import ml_collections

from jaxtrain.errors import ConfigError, DataError
from jaxtrain.registry import Registry



class StepPosition:
  """The data position of a stream whose batches are a function of the global step alone (``self.step``: batches
  taken), the same on every process: checkpointed as the step, and restored onto any number of processes."""

  step: int

  def get_state(self) -> dict:
    return {"step": self.step}

  def set_state(self, state: dict) -> None:
    self.step = int(state["step"])

  def resplit(self, saved_states: list[dict]) -> dict:
    """Every process of a run is at the same global step, so any process's position is this one's."""
    steps = sorted({int(s["step"]) for s in saved_states})
    if len(steps) != 1:
      raise DataError("data position", f"the processes that saved it were at different steps ({steps})",
                      "resume with the number of processes that saved it")
    return {"step": steps[0]}

@dataclasses.dataclass
class Folder:
  """A path of a document source opened for a config (:meth:`Documents.open`). ``train`` / ``held_out``: document
  id -> int32 tokens (``[n]``, or ``[2, n]`` tokens and trained flags when ``masked``), ``train_docs`` /
  ``held_out_docs`` of them (``held_out`` None when there are none), each with ``where(doc) -> str`` naming a
  document for errors. ``tokenizer``: the name of the tokenizer its tokens come from. ``order(config, lanes)``: the
  endless document order that a mixture's packed lanes read (:class:`jaxtrain.data.packing.PackedLanes`).
  ``locate(doc)``: where training document ``doc`` lies, for bad-batch reports. ``fix``: how to fix its token
  ids when they do not fit the model."""
  name: str
  path: str
  source: str  # its name in SOURCES
  tokenizer: str
  masked: bool
  train: Any
  train_docs: int
  held_out: Any | None
  held_out_docs: int
  order: Callable[[Any, int], Any] = None
  locate: Callable[[int], Any] = None
  fix: str = ""


@dataclasses.dataclass(frozen=True)
class Documents:
  """A source that serves documents by id, so that a mixture can take a path of it as a component and
  ``eval.sets`` as an eval set. open: ``(name, path, config, key, whole, verify) -> Folder`` (``path`` resolved;
  ``whole``: every document held out, an eval set; ``verify``: check checksums where the source has them; errors
  name ``key``). check: ``(path, config, key)``: config-time checks of one path (ConfigError naming ``key``).
  has_held_out: ``(path, config) -> bool``: whether ``path`` holds documents held out of training. claims:
  ``path -> bool``: whether a path named without a source is this source's. fallback: it takes every path that
  no source claims (one does: raw records). reads: keys of the ``data`` group (of the source's ``reads``) that its
  eval sets read too. tokenizer: ``(path, config) -> str | None``: as :attr:`Source.tokenizer`, for one path."""
  open: Callable[..., Folder]
  check: Callable[[str, Any, str], None] = lambda path, c, key: None
  has_held_out: Callable[[str, Any], bool] = lambda path, c: False
  claims: Callable[[str], bool] = lambda path: False
  fallback: bool = False
  reads: tuple[str, ...] = ()
  tokenizer: Callable[[str, Any], str | None] = lambda path, c: None


def _nothing(config) -> None:
  del config


@dataclasses.dataclass(frozen=True)
class Source:
  """open_train: ``config -> iterator`` of this process's batches (validated before anything is compiled: raise
    DataError / ConfigError on bad input), a DataPosition (``get_state`` / ``set_state`` / ``resplit``) for its
    position to be checkpointed. open_eval: ``config -> list`` of this process's held-out batches.
  provenance: ``(config, step, doc_ids) -> dict``: where the rows of ``step`` came from (``doc_ids``: the batch's
    ``doc_ids`` field, or None if it has none). reads_path: whether the source reads ``data.path``.
  defaults: ``() -> dict``: the source's own keys and defaults, the config group ``data.<name>`` (none: no group).
  validate: ``config -> None``: config-time checks when it is ``data.source`` (one ConfigError line naming the key).
  reads: keys of the ``data`` group it reads that no source but those naming them here does (``data.<key>``
    set with another source is an error naming them).
  tokenizer: ``config -> str | None``: the tokenizer its tokens come from ('byte' or a tokenizer file), for
    generation; None: it cannot tell (generation asks for ``--tokenizer``). Raises a UserError if it knows it
    cannot be loaded.
  document: ``(config, split, doc) -> (subject, fix)``: document ``doc`` (a ``doc_ids`` value, or None) of the
    train (``split="train"``) or eval batches named for errors, and how to fix its token ids; None: named by the
    source's name and the id.
  documents: how a path of it opens as a :class:`Folder` (mixture components, eval sets); None: it cannot be mixed."""
  open_train: Callable[[Any], Iterator[dict]]
  open_eval: Callable[[Any], list[dict]]
  provenance: Callable[[Any, int, Any], dict]
  reads_path: bool = True
  defaults: Callable[[], dict] = dict
  validate: Callable[[Any], None] = _nothing
  reads: tuple[str, ...] = ()
  tokenizer: Callable[[Any], str | None] = lambda config: None
  document: Callable[[Any, str, int | None], tuple[str, str]] | None = None
  documents: Documents | None = None


SOURCES: Registry[Source] = Registry("data.source", "data source", how="jaxtrain.data.SOURCES.register")


def groups() -> dict[str, ml_collections.ConfigDict]:
  """``name -> ConfigDict`` of every registered source that has keys of its own (its ``data.<name>`` group)."""
  return {name: ml_collections.ConfigDict(keys) for name, keys in ((n, s.defaults()) for n, s in SOURCES.items())
          if keys}


def options(config, name: str) -> ml_collections.ConfigDict:
  """Source ``name``'s group ``data.<name>``; its defaults if the config was made before the source registered."""
  group = config.data.get(name)
  return group if group is not None else ml_collections.ConfigDict(SOURCES.get(name).defaults())


def claimant(path: str, key: str) -> str:
  """The name of the source a path named without one belongs to: the one whose ``documents.claims`` it, else the
  fallback. ConfigError naming ``key`` when no source can read it."""
  readers = [(n, s.documents) for n, s in SOURCES.items() if s.documents is not None]
  for name, documents in readers:
    if documents.claims(path):
      return name
  for name, documents in readers:
    if documents.fallback:
      return name
  raise ConfigError(key, f"no data source reads {path}", "name the component's source (name@source=path)")


def document_source(name: str, key: str) -> Documents:
  """The :class:`Documents` of source ``name``; ConfigError naming ``key`` when it is not registered or serves
  none."""
  if name not in SOURCES:
    raise ConfigError(key, f"'{name}' is not a registered data source",
                      f"use one of {', '.join(SOURCES.names())}, or register yours with {SOURCES.how}")
  documents = SOURCES.get(name).documents
  if documents is None:
    raise ConfigError(key, f"data source '{name}' serves no documents by id, so it cannot be mixed or evaluated as "
                      "a named set", "use a source that can (e.g. prepared folders or raw records)")
  return documents

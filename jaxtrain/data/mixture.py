"""Training on a mixture of data folders (``data.mixture``), with weights that may change over the run.

Components. ``data.mixture`` names them: ``'web=data/web:0.7,code=data/code:0.3'`` (name=path:weight, comma
separated) or, in a config file, ``{"web": ("data/web", 0.7), ...}`` (or ``{"web": {"path": ..., "weight": ...}}``).
Each is opened by a data source that serves documents by id (:mod:`jaxtrain.data.folders`): the one named with it
(``'web@raw=data/web:0.7'``, or ``"source"`` in the dict form), else the one that claims the path (a prepared
folder, else raw records); their tokens must come from one tokenizer. Components are kept in name order (the order
a config gives them in changes nothing), and weights are normalized to sum to 1; a weight may be 0.

Stages. ``data.mixture_stages``: ``'10:web=0.9,code=0.1;500:web=0.5,code=0.5'``: after step 10 (from step 11 on)
the weights are 0.9 / 0.1, after step 500 0.5 / 0.5; before the first stage, ``data.mixture``'s. Every stage
names every component. ``data.mixture_ramp=True`` moves the weights linearly from each stage to the next instead
of at once (the last stage's hold after it).

Rows. The global batch's B rows are the lanes of :mod:`jaxtrain.data.packing`, and each component packs its own
lanes, in the document order its source gives (a prepared folder: lane r reads documents r, r + B, ... of the
component's own seeded order, reshuffled every epoch; raw records: the r-th contiguous B-th, from its start again
at the end). Row k of lane r (the row of step k + 1) is taken whole from the component that the weights of step
k + 1 give the point ``frac(offset + (k B + r) phi)`` (phi the golden ratio, offset from ``train.seed``; exact
64-bit integer arithmetic): a low-discrepancy sequence, so every stretch of rows holds each component in
proportion to its weight (with packing, every row is full: token shares equal row shares), the same rows for any
number of processes or Grain workers, and no state beyond the row count. A component's epoch is counted on its
own: a small one repeats (in a fresh order each epoch) as often as its weight asks.

Position. Each lane saves its row count and, per component, its (document, offset): a change of weights or of
stages on a resumed run changes which component later rows read, never where a component is. A component added on
resume starts at its beginning; one removed keeps its saved position in every later checkpoint (added back, it
goes on from there).

Why not Grain's ``MapDataset.mix`` / ``IterDataset.mix``: they mix elements (here: documents before packing, or the
rows of one lane) in proportions fixed when the dataset is built and refuse a weight of 0, so a schedule would
rebuild the pipeline at every change; their selection depends on the element index only, so B lanes mixed that
way would take the same component at the same step (whole batches of one component, not mixed batches); and
mixing documents gives document shares, not token shares.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
import re
from typing import Any, Mapping, NamedTuple, Sequence

import grain
import jax
import ml_collections
import numpy as np

from jaxtrain import paths
from jaxtrain.data import folders, loader
from jaxtrain.data import packing as packing_lib
from jaxtrain.data.source import SOURCES, Source
from jaxtrain.errors import ConfigError, DataError

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / phi, odd: n -> n * _GOLDEN mod 2^64 visits [0, 2^64) evenly
_MAPPINGS = (Mapping, ml_collections.ConfigDict)  # a config file's dict may have become a ConfigDict
_EXAMPLE = "e.g. --config.data.mixture='web=data/web:0.7,code=data/code:0.3'"


@dataclasses.dataclass(frozen=True)
class Component:
  name: str
  path: str  # resolved (absolute, or a URL)
  weight: float  # normalized: the weights of a mixture sum to 1
  source: str = ""  # the data source that reads it; "" = the one that claims the path


class Named(NamedTuple):
  """One entry of a named list (:func:`parse_named`)."""
  name: str
  path: str
  weight: float | None
  source: str  # "" = found from the path


# ------------------------------------------------------------------------------------------------- parsing


def parse_named(value: Any, key: str, weighted: bool) -> list[Named]:
  """``'name[@source]=path[:weight],...'`` or a mapping ``name -> path`` / ``(path, weight)`` / ``{path, weight,
  source}`` -> ``[Named(name, path, weight or None, source or "")]`` in name order, each checked (one ConfigError
  line naming ``key``)."""
  example = _EXAMPLE if weighted else "e.g. --config.eval.sets='books=data/books,code=data/code_eval'"
  form = "name=path:weight" if weighted else "name=path"
  if _empty(value):
    return []
  entries = []
  if isinstance(value, str):
    for item in value.split(","):  # (a path holding a comma needs the dict form)
      name, eq, rest = item.strip().partition("=")
      weight = None
      if weighted:
        rest, colon, text = rest.rpartition(":")
        if not colon or not rest:
          raise ConfigError(key, f"'{item.strip()}' is not {form}", example)
        try:
          weight = float(text)
        except ValueError:
          raise ConfigError(key, f"the weight '{text}' of '{name}' is not a number", example) from None
      if not eq or not rest:
        raise ConfigError(key, f"'{item.strip()}' is not {form}", example)
      name, _, source = name.strip().partition("@")
      entries.append(Named(name.strip(), rest.strip(), weight, source.strip()))
  elif isinstance(value, _MAPPINGS):
    for name, v in value.items():
      path, weight, source = v, None, ""
      if isinstance(v, _MAPPINGS):
        path, weight, source = v.get("path"), v.get("weight"), v.get("source", "")
      elif isinstance(v, (tuple, list)) and len(v) == 2:
        path, weight = v
      if not isinstance(path, str) or (weighted and not isinstance(weight, (int, float))):
        raise ConfigError(key, f"the entry of '{name}' ({v!r}) is not "
                          f"{'(path, weight)' if weighted else 'a path'}", example)
      entries.append(Named(str(name), path, float(weight) if weighted else None, str(source or "")))
  else:
    raise ConfigError(key, f"is a {type(value).__name__}; give '{form},...' or a dict", example)
  seen = set()
  for name, path, weight, source in entries:
    if not _NAME.match(name):
      raise ConfigError(key, f"'{name}' is not a name (letters, digits, _ . -)", example)
    if name in seen:
      raise ConfigError(key, f"'{name}' is named twice", "give each component one entry")
    seen.add(name)
    if not path:
      raise ConfigError(key, f"'{name}' has an empty path", example)
    if source and not _NAME.match(source):
      raise ConfigError(key, f"'{source}' (the source of '{name}') is not a name", example)
    if weighted and not (math.isfinite(weight) and weight >= 0):
      raise ConfigError(key, f"the weight {weight} of '{name}' is {'negative' if weight < 0 else 'not finite'}",
                        "give every component a weight >= 0")
  if weighted and not sum(e.weight for e in entries) > 0:
    raise ConfigError(key, "every weight is 0", "give at least one component a weight > 0")
  return sorted(entries)


def components(c) -> list[Component]:
  """``data.mixture``'s components, in name order, weights normalized; [] without a mixture."""
  entries = parse_named(c.data.get("mixture", ""), "data.mixture", weighted=True)
  total = sum(e.weight for e in entries)
  return [Component(e.name, paths.resolve(e.path), e.weight / total, e.source) for e in entries]


def names(c) -> tuple[str, ...]:
  """The components' names: the index of a name is its id in batches' ``sources``."""
  return tuple(comp.name for comp in components(c))


def stages(c) -> list[tuple[int, np.ndarray]]:
  """``[(after step, normalized weights in component order)]``: data.mixture's at step 0, then
  ``data.mixture_stages``'. ConfigError on a stage that does not parse, names other components or goes back."""
  comps = components(c)
  out = [(0, np.asarray([comp.weight for comp in comps]))]
  value, key = c.data.get("mixture_stages", ""), "data.mixture_stages"
  example = "e.g. --config.data.mixture_stages='1000:web=0.9,code=0.1' (after step 1000: those weights)"
  if _empty(value):
    return out
  if isinstance(value, str):
    raw = []
    for item in value.split(";"):
      step, colon, weights = item.strip().partition(":")
      if not colon:
        raise ConfigError(key, f"'{item.strip()}' is not step:name=weight,...", example)
      pairs = {}
      for pair in weights.split(","):
        name, eq, w = pair.strip().partition("=")
        try:
          pairs[name.strip()] = float(w)
        except ValueError:
          raise ConfigError(key, f"'{pair.strip()}' (stage {step.strip()}) is not name=weight", example) from None
        if not eq:
          raise ConfigError(key, f"'{pair.strip()}' (stage {step.strip()}) is not name=weight", example)
      raw.append((step.strip(), pairs))
  elif isinstance(value, _MAPPINGS):
    raw = list(value.items())
  else:
    raw = list(value)
  for item in raw:
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], _MAPPINGS)):
      raise ConfigError(key, f"{item!r} is not (step, {{name: weight}})", example)
    step, weights = item
    try:
      step = int(step)
    except (TypeError, ValueError):
      raise ConfigError(key, f"the step '{step}' is not a whole number", example) from None
    if step <= out[-1][0]:
      raise ConfigError(key, f"the stage at step {step} does not come after step {out[-1][0]}",
                        "list stages by increasing step, each > 0")
    missing = [comp.name for comp in comps if comp.name not in weights]
    unknown = [n for n in weights if n not in {comp.name for comp in comps}]
    if unknown or missing:
      raise ConfigError(key, f"the stage at step {step} " + (f"names '{unknown[0]}', not a component of "
                        "data.mixture" if unknown else f"gives no weight to '{missing[0]}'"),
                        "give every component of data.mixture a weight (0 to leave it out)")
    w = np.asarray([float(weights[comp.name]) for comp in comps])
    if not (np.all(np.isfinite(w)) and np.all(w >= 0) and w.sum() > 0):
      raise ConfigError(key, f"the stage at step {step} has weights {w.tolist()}",
                        "give weights >= 0, at least one > 0")
    out.append((step, w / w.sum()))
  return out


def _empty(value) -> bool:
  return value is None or (isinstance(value, (str, Sequence, *_MAPPINGS)) and not len(value))


def stages_given(c) -> bool:
  return not _empty(c.data.mixture_stages)


def replace(group: ml_collections.ConfigDict, key: str, value: str) -> None:
  """``group[key] = value`` whatever type the key held (a resolved config locks each field to its value's type)."""
  with group.unlocked():
    del group[key]
    group[key] = value


def format_named(entries: list[Named], key: str) -> str:
  """The string form of :func:`parse_named`'s entries (paths resolved). ConfigError on a path with a comma."""
  for e in entries:
    if "," in e.path:
      raise ConfigError(key, f"the path {e.path} of '{e.name}' holds a comma, which the recorded form cannot hold",
                        "rename the folder")
  return ",".join(e.name + (f"@{e.source}" if e.source else "") + f"={paths.resolve(e.path)}"
                  + (f":{e.weight!r}" if e.weight is not None else "") for e in entries)


def canonical(c) -> None:
  """``data.mixture`` and ``data.mixture_stages`` in the form config.json records (strings: absolute paths, name
  order, weights as given), so that a resumed run and the tools read the same mixture."""
  if _empty(c.data.mixture):
    return
  replace(c.data, "mixture", format_named(parse_named(c.data.mixture, "data.mixture", weighted=True),
                                              "data.mixture"))
  if not _empty(c.data.mixture_stages):
    comps = components(c)
    replace(c.data, "mixture_stages", ";".join(
        f"{step}:" + ",".join(f"{comp.name}={float(x)!r}" for comp, x in zip(comps, w)) for step, w in stages(c)[1:]))


def validate(c) -> None:
  """Config-time checks of a mixture: it parses, it is the run's only training data, every folder is there."""
  comps = components(c)
  if not comps:
    for key, given in (("mixture_stages", stages_given(c)), ("mixture_ramp", c.data.mixture_ramp)):
      if given:
        raise ConfigError(f"data.{key}", "is set but data.mixture is empty", f"set data.mixture ({_EXAMPLE})")
    return
  if c.data.path:
    raise ConfigError("data.path", "is set together with data.mixture", "make it a component of data.mixture, or "
                      "clear data.mixture")
  if SOURCES.get(c.data.source).documents is None:
    raise ConfigError("data.source", f"{c.data.source} data cannot be mixed", "set data.source=arrayrecord (the "
                      "default: each component's source is found from its path, or named with it)")
  if c.data.eval_path:
    raise ConfigError("data.eval_path", "is not read with data.mixture (each component's own eval split is)",
                      "clear it; eval.sets evaluates other data")
  stages(c)
  for comp in comps:
    folders.check(comp.path, c, f"data.mixture ({comp.name})", comp.source)
  if c.eval.every_steps and _empty(c.eval.sets) and not any(
      folders.has_held_out(comp.path, c, comp.source, f"data.mixture ({comp.name})") for comp in comps):
    raise ConfigError("eval.every_steps", "is set but no component of data.mixture holds eval documents (and "
                      "eval.sets is empty)", "prepare them with --eval_fraction > 0, set data.eval_fraction for raw "
                      "components, or set eval.sets")


# ---------------------------------------------------------------------------------------------- the schedule


class Schedule:
  """``(row k, lane r) -> component``: the component of lane r's k-th row (the row of step k + 1), by the weights
  of that step (see the module docstring). Picklable (Grain's worker processes call it)."""

  def __init__(self, stages: list[tuple[int, np.ndarray]], ramp: bool, seed: int, num_lanes: int):
    self.steps = [s for s, _ in stages]
    self.weights_at = [np.asarray(w, np.float64) for _, w in stages]
    self.ramp, self.num_lanes = ramp, num_lanes
    self.offset = int.from_bytes(hashlib.sha256(f"jaxtrain.mixture:{seed}".encode()).digest()[:8], "little")
    self._cached = (-1, None)

  def weights(self, row: int) -> np.ndarray:
    """The normalized weights of row ``row`` (step ``row + 1``: the stage after step s applies from row s on)."""
    i = bisect.bisect_right(self.steps, row) - 1
    w = self.weights_at[i]
    if self.ramp and i + 1 < len(self.steps):
      t = (row - self.steps[i]) / (self.steps[i + 1] - self.steps[i])
      w = (1 - t) * w + t * self.weights_at[i + 1]
    return w / w.sum()

  def __call__(self, row: int, lane: int) -> int:
    if self._cached[0] != row:  # (a Python list and bisect: a row costs ~1 us, not numpy's call overheads)
      w = self.weights(row)
      self._cached = (row, (np.cumsum(w).tolist(), int(np.flatnonzero(w > 0)[-1])))
    cumulative, last = self._cached[1]
    u = ((self.offset + (row * self.num_lanes + lane) * _GOLDEN) % 2**64) / 2**64
    return min(bisect.bisect_right(cumulative, u), last)


def schedule(c) -> Schedule:
  return Schedule(stages(c), bool(c.data.mixture_ramp), c.train.seed, c.train.global_batch_size)


# ------------------------------------------------------------------------------------------------- the source


def open_folders(c, verify: bool = True) -> list[folders.Folder]:
  """Every component opened (manifests and, with ``verify``, checksums checked; raw files indexed); DataError if
  their tokenizers differ."""
  opened = [folders.open_folder(comp.name, comp.path, c, f"data.mixture ({comp.name})", verify=verify,
                                source=comp.source) for comp in components(c)]
  folders.check_same_tokenizer(opened, "data.mixture")
  return opened


def _order(c, folder: folders.Folder, lanes: int):
  """A component's endless document order that its packed lanes read (its source's)."""
  return folder.order(c, lanes)


def train_dataset(c, process_index: int, process_count: int) -> grain.IterDataset:
  """This process's share of the endless stream of mixed, packed training batches."""
  b = c.train.global_batch_size
  lanes = loader.process_lanes(b, process_index, process_count)
  parts = [packing_lib.PackedLanes(_order(c, f, b), f.train, lanes, b, c.data.seq_len + 1, c.data.packing,
                                   f.masked) for f in open_folders(c)]
  mixed = packing_lib.MixedLanes(parts, names(c), schedule(c), lanes)
  return loader.batched(mixed, len(lanes), num_workers=c.data.num_workers, prefetch=c.data.prefetch)


def open_train(c) -> loader.TrainIterator:
  dataset = train_dataset(c, jax.process_index(), jax.process_count())
  return loader.TrainIterator(dataset, c.train.global_batch_size, jax.process_index(), jax.process_count())


def eval_batches(folder: folders.Folder, c, process_index: int, process_count: int) -> list[dict]:
  """A folder's held-out documents, packed in order: this process's rows of each global batch (at most
  ``eval.max_batches`` batches)."""
  return loader.packed_eval_batches(folder.held_out, folder.held_out_docs, seq_len=c.data.seq_len,
                                    global_batch=c.train.global_batch_size, process_index=process_index,
                                    process_count=process_count, masked=folder.masked,
                                    max_batches=c.eval.max_batches)


def eval_splits(c) -> list[tuple[folders.Folder, list[dict]]]:
  """``[(component, this process's eval batches)]`` for each component that holds an eval split."""
  return [(f, eval_batches(f, c, jax.process_index(), jax.process_count()))
          for f in open_folders(c, verify=False) if f.held_out_docs]  # (training verified the shards)


def component_of(c, doc_id: int) -> tuple[folders.Folder, int]:
  """A training batch's document (its ``doc_ids`` value: component << SOURCE_SHIFT | document) -> the component's
  folder (opened, shards not re-verified) and the document's id in its ``train`` source."""
  comp = components(c)[doc_id >> packing_lib.SOURCE_SHIFT]
  folder = folders.open_folder(comp.name, comp.path, c, f"data.mixture ({comp.name})", verify=False,
                               source=comp.source)
  return folder, doc_id & ((1 << packing_lib.SOURCE_SHIFT) - 1)


def provenance(c, step: int, doc_ids) -> dict:
  """Where the rows of ``step`` came from: per component, its documents and their shards / records."""
  del step
  if doc_ids is None:
    return {"source": "unknown"}
  ids = np.unique(np.asarray(doc_ids, np.int64))
  ids = ids[ids >= 0]
  out = {}
  for comp_id, comp in enumerate(components(c)):
    docs = [int(d) for d in ids[(ids >> packing_lib.SOURCE_SHIFT) == comp_id] & ((1 << packing_lib.SOURCE_SHIFT) - 1)]
    if not docs:
      continue
    folder = folders.open_folder(comp.name, comp.path, c, f"data.mixture ({comp.name})", verify=False,
                                 source=comp.source)
    out[comp.name] = {"data": comp.path, "documents": docs, "where": [folder.locate(d) for d in docs]}
  return {"mixture": out}


def in_folder(folder: folders.Folder, key: str, documents, doc: int | None) -> tuple[str, str]:
  """Document ``doc`` of ``documents`` (``folder.train`` or ``folder.held_out``) of a named folder (a mixture's
  component, an eval set), named for errors (:data:`jaxtrain.data.ids.Where`)."""
  return f"{key} ({folder.name}): " + (documents.where(doc) if doc is not None else folder.path), folder.fix


def _document(c, split: str, doc: int | None) -> tuple[str, str]:
  del split  # (a mixture's eval batches are checked per component, by jaxtrain.data.eval_sets)
  if doc is None:
    return "data.mixture", "re-prepare or re-tokenize its components with the model's tokenizer"
  folder, doc = component_of(c, doc)
  return in_folder(folder, "data.mixture", folder.train, doc)


def _tokenizer(c) -> str:
  """The components' tokenizer, as each one's source says (training checks that they agree). DataError if a
  source cannot tell."""
  found = {folders.tokenizer(comp.path, c, comp.source, f"data.mixture ({comp.name})") for comp in components(c)}
  if None in found or len(found) != 1:
    raise DataError("data.mixture", "generation does not know the tokenizer of every component",
                    "pass --tokenizer=FILE")
  return found.pop()


# data.mixture's source: not a data.source choice (the mixture names its paths, each read by its own source).
MIXTURE = Source(open_train, lambda c: [b for _, bs in eval_splits(c) for b in bs], provenance,
                 tokenizer=_tokenizer, document=_document)

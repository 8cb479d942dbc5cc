"""Concat-then-split packing of document streams into fixed-length rows, one stream ("lane") per row.

Lane r of a global batch of B rows reads documents ``docs[r], docs[r + B], docs[r + 2B], ...`` and cuts their
concatenation into rows of ``length`` tokens; a document that does not fit continues in the lane's next row.
Every row carries segment ids (1, 2, ... per document piece, 0 for padding), positions (within the
document) and the id of each token's document (-1 for padding), so a bad batch can be traced. Over SFT data
(``masked``: a document is [2, n], its tokens and their trained flags) rows also carry ``trained`` (0 for
padding), cut exactly like the tokens.
Without packing each row holds the start of one document, padded.

Why not ``grain.experimental.ConcatThenSplitIterDataset`` + ``InterleaveIterDataset``: measured here they cost
~0.8 ms per 129-token row (per-element Python buffering) and another ~1.2 ms with a prefetch thread per lane,
more than the training step of the tiny model can hide on 2 cores. This packer does the same cut with numpy,
touching each document once, and its state is two integers per lane.
"""

from __future__ import annotations

import copy
from typing import Sequence

import grain
import numpy as np

from jaxtrain.errors import DataError


class PackedLanes(grain.IterDataset):
  """Yields rows ``{"tokens", "segment_ids", "positions", "doc_ids"}`` (each [length]; plus ``"trained"`` when
  ``masked``) cycling through ``lanes`` in order:
  one row of each lane per round, so batching ``len(lanes)`` consecutive rows gives the lanes' rows of one
  step. Grain's worker processes each take a strided subset of the lanes (``set_slice``); their round-robin
  merge restores the lane order when the lane count is a multiple of the worker count."""

  def __init__(self, doc_ids: grain.MapDataset, source, lanes: Sequence[int], num_lanes: int, length: int,
               packing: bool = True, masked: bool = False):
    """``doc_ids``: the (shuffled, repeated) order of document ids; ``source[i]``: document i's tokens [n], or
    with ``masked`` its tokens and trained flags [2, n]."""
    super().__init__()
    self.docs, self.source, self.lanes, self.num_lanes = doc_ids, source, list(lanes), num_lanes
    self.length, self.packing, self.masked = length, packing, masked

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    if sequential_slice:
      raise ValueError("PackedLanes supports only strided slicing (one lane subset per worker)")
    self.lanes = self.lanes[sl]

  def __iter__(self) -> "_PackedLanesIterator":
    return _PackedLanesIterator(self)


class _PackedLanesIterator(grain.DatasetIterator):

  def __init__(self, ds: PackedLanes):
    super().__init__()
    self._ds = ds
    self._doc = [0] * len(ds.lanes)  # per lane: index of its current document within the lane
    self._offset = [0] * len(ds.lanes)  # per lane: tokens of that document already emitted
    self._next = 0  # position in the lane cycle
    self._finite = len(ds.docs) < 2**62  # an unrepeated source runs out

  def _document(self, i: int) -> tuple[int, np.ndarray] | tuple[None, None]:
    index = self._ds.lanes[i] + self._doc[i] * self._ds.num_lanes
    if self._finite and index >= len(self._ds.docs):
      return None, None
    doc_id = int(self._ds.docs[index])
    return doc_id, self._ds.source[doc_id]

  def _row(self, i: int) -> dict[str, np.ndarray] | None:
    """Lane i's next row, or None when its (finite) documents are used up."""
    length = self._ds.length
    keys = ("tokens", "segment_ids", "positions") + (("trained",) if self._ds.masked else ())
    row = {k: np.zeros(length, np.int32) for k in keys}
    row["doc_ids"] = np.full(length, -1, np.int32)
    filled, segment = 0, 0
    while filled < length:
      doc_id, doc = self._document(i)
      if doc is None:
        return row if filled else None
      start, size = self._offset[i], doc.shape[-1]
      take = min(size - start, length - filled)
      segment += 1
      if self._ds.masked:
        row["trained"][filled:filled + take] = doc[1, start:start + take]
        doc = doc[0]
      row["tokens"][filled:filled + take] = doc[start:start + take]
      row["segment_ids"][filled:filled + take] = segment
      row["positions"][filled:filled + take] = np.arange(start, start + take)
      row["doc_ids"][filled:filled + take] = doc_id
      filled += take
      if self._ds.packing and start + take < size:
        self._offset[i] = start + take  # the rest of this document opens the lane's next row
      else:
        self._doc[i], self._offset[i] = self._doc[i] + 1, 0
      if not self._ds.packing:
        break
    return row

  def __next__(self) -> dict[str, np.ndarray]:
    for _ in range(len(self._ds.lanes)):
      i, self._next = self._next, (self._next + 1) % len(self._ds.lanes)
      row = self._row(i)
      if row is not None:
        return row
    raise StopIteration

  def get_state(self) -> dict:
    return {"doc": list(self._doc), "offset": list(self._offset), "next": self._next}

  def set_state(self, state: dict) -> None:
    if len(state["doc"]) != len(self._ds.lanes):
      raise _rows_changed(len(state["doc"]), len(self._ds.lanes))
    self._doc, self._offset, self._next = list(state["doc"]), list(state["offset"]), int(state["next"])


class MixedLanes(grain.IterDataset):
  """Rows of ``lanes`` drawn from several :class:`PackedLanes` (a mixture's components, same lanes and length):
  lane i's k-th row comes from component ``choose(k, lanes[i])``, the next row of that component's own lane i.
  So each component keeps its own position per lane (what a change of weights or of components on a resumed run
  preserves), and which component a row reads is a function of (row, lane) only. Rows carry ``sources`` (the
  component's index, per token; batches then carry ``doc_ids`` as ``component << 40 | document``, int64, -1:
  padding, see :func:`jaxtrain.data.loader.batched`);
  when any component is SFT data (``masked``), rows of the others are trained wherever they hold tokens."""

  def __init__(self, parts: Sequence[PackedLanes], names: Sequence[str], choose, lanes: Sequence[int]):
    super().__init__()
    self.parts, self.names, self.choose, self.lanes = list(parts), list(names), choose, list(lanes)
    self.masked = any(p.masked for p in self.parts)

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    if sequential_slice:
      raise ValueError("MixedLanes supports only strided slicing (one lane subset per worker)")
    self.lanes = self.lanes[sl]
    for part in self.parts:
      part.set_slice(sl)

  def __iter__(self) -> "_MixedLanesIterator":
    return _MixedLanesIterator(self)


SOURCE_SHIFT = 40  # a mixture row's doc_ids: component << SOURCE_SHIFT | document


class _MixedLanesIterator(grain.DatasetIterator):

  def __init__(self, ds: MixedLanes):
    super().__init__()
    self._ds = ds
    self._parts = [iter(p) for p in ds.parts]
    self._rows = [0] * len(ds.lanes)  # per lane: rows emitted
    self._next = 0
    self._retired = {}  # positions of components a checkpoint holds and this mixture lacks: saved on, unchanged

  def __next__(self) -> dict[str, np.ndarray]:
    ds, i = self._ds, self._next
    self._next = (i + 1) % len(ds.lanes)
    c = ds.choose(self._rows[i], ds.lanes[i])
    row = self._parts[c]._row(i)  # noqa: SLF001 - the same package's packer, one lane's next row
    if row is None:  # components are endless streams
      raise StopIteration
    self._rows[i] += 1
    length = row["tokens"].shape[0]
    row["sources"] = np.full(length, c, np.int32)
    if ds.masked and "trained" not in row:
      row["trained"] = (row["segment_ids"] > 0).astype(np.int32)
    return row

  def get_state(self) -> dict:
    parts = dict(self._retired)
    for name, part in zip(self._ds.names, self._parts):
      state = part.get_state()
      parts[name] = {"doc": state["doc"], "offset": state["offset"]}
    return {"rows": list(self._rows), "next": self._next, "parts": parts}

  def set_state(self, state: dict) -> None:
    if "parts" not in state:
      raise DataError("data position", "the checkpoint holds the position of one data source and this run reads "
                      "a mixture (data.mixture)", "resume without data.mixture, or start a new workdir from its "
                      "weights with checkpoint.restore_from")
    if len(state["rows"]) != len(self._ds.lanes):
      raise _rows_changed(len(state["rows"]), len(self._ds.lanes))
    self._rows, self._next = list(state["rows"]), int(state["next"])
    lanes = len(self._ds.lanes)
    for name, part in zip(self._ds.names, self._parts):
      saved = state["parts"].get(name, {"doc": [0] * lanes, "offset": [0] * lanes})  # a new component: its start
      part.set_state({"doc": saved["doc"], "offset": saved["offset"], "next": 0})
    self._retired = {n: p for n, p in state["parts"].items() if n not in self._ds.names}


# The data position is per lane, i.e. per row of the *global* batch, so it does not depend on how many
# processes read the lanes: a checkpoint saved by P processes resumes on P' by gathering the lanes' positions
# in process order and giving each new process its own. Grain's worker pool (data.num_workers) holds the
# lanes strided over its workers (worker w: lanes w, w+W, ...; before the workers start, its state lists every
# lane under each worker); the state is taken between steps, where every lane's cycle is complete.


def _rows_changed(saved: int, here: int) -> DataError:
  return DataError("data position", f"the checkpoint holds the position of {saved} rows per process batch and "
                   f"this run reads {here} (train.global_batch_size changed)", "resume with the global batch size "
                   "that saved it, or start a new workdir from its weights with checkpoint.restore_from")


def _is_lanes_state(state: dict) -> bool:
  return {"doc", "offset", "next"} <= state.keys() or {"rows", "parts", "next"} <= state.keys()


def _lane_parts(state: dict) -> list[dict]:
  """The lane iterators' states inside a pipeline state: itself, or one per Grain worker (in worker order)."""
  if _is_lanes_state(state):
    return [state]
  if "iterators_in_use_states" in state:
    order = sorted(range(len(state["iterators_in_use_indices"])), key=lambda i: state["iterators_in_use_indices"][i])
    return [state["iterators_in_use_states"][i] for i in order]
  raise DataError("data position", f"the saved data-iterator state has an unknown layout (keys {sorted(state)})",
                  "resume with the number of processes that saved it")


def _lanes_of(part: dict) -> list:
  """One lane iterator's state -> its lanes' positions, in its lane order: (document, offset) per lane of
  :class:`PackedLanes`; ``{"rows": n, "parts": {name: (document, offset)}}`` per lane of :class:`MixedLanes`."""
  if "parts" in part:
    return [{"rows": part["rows"][j], "parts": {name: (p["doc"][j], p["offset"][j]) for name, p in
                                                part["parts"].items()}} for j in range(len(part["rows"]))]
  return list(zip(part["doc"], part["offset"]))


def _set_lanes(part: dict, lanes: Sequence) -> None:
  """The inverse of :func:`_lanes_of`: ``part`` (a lane iterator's state) set to ``lanes``, at a round's start."""
  if "parts" in part:
    names = sorted({name for lane in lanes for name in lane["parts"]})
    part.update(rows=[lane["rows"] for lane in lanes], next=0,
                parts={name: {"doc": [lane["parts"][name][0] for lane in lanes],
                              "offset": [lane["parts"][name][1] for lane in lanes]} for name in names})
  else:
    part.update(doc=[d for d, _ in lanes], offset=[o for _, o in lanes], next=0)


def lane_positions(state: dict, lanes: int) -> list:
  """The position of each of a process's ``lanes`` lanes (see :func:`_lanes_of`), in lane order."""
  parts = _lane_parts(state)
  if len(parts) > 1 and all(len(_lanes_of(p)) == lanes and p == parts[0] for p in parts):
    parts = parts[:1]  # the worker pool has not started: every worker still lists every lane
  per_part = [_lanes_of(p) for p in parts]
  if sum(map(len, per_part)) != lanes:
    raise _rows_changed(sum(map(len, per_part)), lanes)
  return [per_part[i % len(parts)][i // len(parts)] for i in range(lanes)]


def with_lane_positions(template: dict, positions: Sequence) -> dict:
  """``template`` (an iterator's own state, for its layout) with its lanes set to ``positions``."""
  state = copy.deepcopy(template)
  parts = _lane_parts(state)
  for w, part in enumerate(parts):
    _set_lanes(part, positions[w::len(parts)])
  return state


def resplit(saved: Sequence[dict], template: dict, global_batch: int, process_index: int,
            process_count: int) -> dict:
  """Process ``process_index`` of ``process_count``'s position from the pipeline states that each process of a
  run with another process count saved (``saved[i]``: process i's), ``template`` being its own iterator's state
  (for its layout). The global batch must be the one that saved them (else DataError), so that the global
  position is the same."""
  # Every row of the global batch, in order (DataError if the saved run had another global batch).
  lanes = [lane for state in saved for lane in lane_positions(state, global_batch // len(saved))]
  mine = global_batch // process_count
  return with_lane_positions(template, lanes[process_index * mine:(process_index + 1) * mine])

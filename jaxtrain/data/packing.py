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


# The data position is per lane, i.e. per row of the *global* batch, so it does not depend on how many
# processes read the lanes: a checkpoint saved by P processes resumes on P' by gathering the lanes' positions
# in process order and giving each new process its own. Grain's worker pool (data.num_workers) holds the
# lanes strided over its workers (worker w: lanes w, w+W, ...; before the workers start, its state lists every
# lane under each worker); the state is taken between steps, where every lane's cycle is complete.


def _rows_changed(saved: int, here: int) -> DataError:
  return DataError("data position", f"the checkpoint holds the position of {saved} rows per process batch and "
                   f"this run reads {here} (train.global_batch_size changed)", "resume with the global batch size "
                   "that saved it, or start a new workdir from its weights with checkpoint.restore_from")


def _lane_parts(state: dict) -> list[dict]:
  """The lane iterators' states inside a pipeline state: itself, or one per Grain worker (in worker order)."""
  if {"doc", "offset", "next"} <= state.keys():
    return [state]
  if "iterators_in_use_states" in state:
    order = sorted(range(len(state["iterators_in_use_indices"])), key=lambda i: state["iterators_in_use_indices"][i])
    return [state["iterators_in_use_states"][i] for i in order]
  raise DataError("data position", f"the saved data-iterator state has an unknown layout (keys {sorted(state)})",
                  "resume with the number of processes that saved it")


def lane_positions(state: dict, lanes: int) -> list[tuple[int, int]]:
  """(document, offset) of each of a process's ``lanes`` lanes, in lane order."""
  parts = _lane_parts(state)
  if len(parts) > 1 and all(len(p["doc"]) == lanes and p == parts[0] for p in parts):
    parts = parts[:1]  # the worker pool has not started: every worker still lists every lane
  if sum(len(p["doc"]) for p in parts) != lanes:
    raise _rows_changed(sum(len(p["doc"]) for p in parts), lanes)
  return [(parts[i % len(parts)]["doc"][i // len(parts)], parts[i % len(parts)]["offset"][i // len(parts)])
          for i in range(lanes)]


def with_lane_positions(template: dict, positions: Sequence[tuple[int, int]]) -> dict:
  """``template`` (an iterator's own state, for its layout) with its lanes set to ``positions``."""
  state = copy.deepcopy(template)
  parts = _lane_parts(state)
  for w, part in enumerate(parts):
    mine = positions[w::len(parts)]
    part.update(doc=[d for d, _ in mine], offset=[o for _, o in mine], next=0)
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

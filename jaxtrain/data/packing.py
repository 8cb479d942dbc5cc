"""Concat-then-split packing of document streams into fixed-length rows, one stream ("lane") per row.

Lane r of a global batch of B rows reads documents ``docs[r], docs[r + B], docs[r + 2B], ...`` and cuts their
concatenation into rows of ``length`` tokens; a document that does not fit continues in the lane's next row.
Every row carries segment ids (1, 2, ... per document piece, 0 for padding) and positions (within the
document). Without packing each row holds the start of one document, padded.

Why not ``grain.experimental.ConcatThenSplitIterDataset`` + ``InterleaveIterDataset``: measured here they cost
~0.8 ms per 129-token row (per-element Python buffering) and another ~1.2 ms with a prefetch thread per lane,
more than the training step of the tiny model can hide on 2 cores. This packer does the same cut with numpy,
touching each document once, and its state is two integers per lane.
"""

from __future__ import annotations

from typing import Sequence

import grain
import numpy as np


class PackedLanes(grain.IterDataset):
  """Yields ``{"tokens", "segment_ids", "positions"}`` arrays of shape [len(lanes), length] per step."""

  def __init__(self, docs: grain.MapDataset, lanes: Sequence[int], num_lanes: int, length: int,
               packing: bool = True):
    super().__init__()
    self.docs, self.lanes, self.num_lanes = docs, list(lanes), num_lanes
    self.length, self.packing = length, packing

  def __iter__(self) -> "_PackedLanesIterator":
    return _PackedLanesIterator(self)


class _PackedLanesIterator(grain.DatasetIterator):

  def __init__(self, ds: PackedLanes):
    super().__init__()
    self._ds = ds
    self._doc = [0] * len(ds.lanes)  # per lane: index of its current document within the lane
    self._offset = [0] * len(ds.lanes)  # per lane: tokens of that document already emitted
    self._finite = len(ds.docs) < 2**62  # an unrepeated source runs out

  def _document(self, lane_pos: int) -> np.ndarray | None:
    index = self._ds.lanes[lane_pos] + self._doc[lane_pos] * self._ds.num_lanes
    if self._finite and index >= len(self._ds.docs):
      return None
    return self._ds.docs[index]

  def _row(self, lane_pos: int) -> tuple[list, bool]:
    """The pieces (tokens, segment, first position) of one row, and whether the lane has data left."""
    pieces, filled, segment = [], 0, 0
    while filled < self._ds.length:
      doc = self._document(lane_pos)
      if doc is None:
        return pieces, bool(pieces)
      start = self._offset[lane_pos]
      take = min(doc.size - start, self._ds.length - filled)
      segment += 1
      pieces.append((doc[start:start + take], segment, start))
      filled += take
      if start + take < doc.size and self._ds.packing:
        self._offset[lane_pos] = start + take  # the rest of this document opens the lane's next row
      else:
        self._doc[lane_pos] += 1
        self._offset[lane_pos] = 0
      if not self._ds.packing:
        break
    return pieces, True

  def __next__(self) -> dict[str, np.ndarray]:
    n, length = len(self._ds.lanes), self._ds.length
    out = {k: np.zeros((n, length), np.int32) for k in ("tokens", "segment_ids", "positions")}
    any_data = False
    for i in range(n):
      pieces, has_data = self._row(i)
      any_data |= has_data
      at = 0
      for tokens, segment, first in pieces:
        end = at + tokens.size
        out["tokens"][i, at:end] = tokens
        out["segment_ids"][i, at:end] = segment
        out["positions"][i, at:end] = np.arange(first, first + tokens.size)
        at = end
    if not any_data:
      raise StopIteration
    return out

  def get_state(self) -> dict:
    return {"doc": list(self._doc), "offset": list(self._offset)}

  def set_state(self, state: dict) -> None:
    self._doc, self._offset = list(state["doc"]), list(state["offset"])

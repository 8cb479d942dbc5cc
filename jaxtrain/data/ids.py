"""Token ids against the model's vocabulary, checked on the host where a process's rows become a step's batch.

An id outside [0, model.vocab_size) has no row of the embedding table and no logit: the lookup would clip it to
row V-1 (training that row in its place), the loss would read no label. Every source's rows pass here (prepared
folders, SFT data, raw files, mixtures, registered sources): the training stream's in
:func:`jaxtrain.data.to_global`, the eval sets' as :func:`jaxtrain.data.eval_sets` builds them. Each process checks
its own rows before they reach a device. Inputs are checked everywhere (the model looks every one up); targets
where the loss mask counts them, so that a source may pad targets with an id of its own (say -100) under mask 0.
The packers pad with token 0.

Cost: one reduction over each of ``inputs`` and ``targets`` (int32 ids viewed as uint32, so that a negative id
is a large one and ``max < vocab`` is the whole test); the offending token, its document and its position are
found only when that test fails.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxtrain.errors import DataError


class TokenIdError(DataError):
  """A token id outside the model's vocabulary: the source and document (``subject``), the id, its position and
  ``model.vocab_size`` (``problem``), and the fix."""


# A batch's document id (its ``doc_ids`` value; None where the batch has none) -> (the source and that document,
# e.g. "/data/a.jsonl:14"; how to remake the data, e.g. "re-prepare the data with the model's tokenizer").
Where = Callable[[int | None], tuple[str, str]]


def _in_range(ids: np.ndarray, vocab_size: int) -> bool:
  if ids.size == 0:
    return True
  if ids.dtype == np.int32:
    return int(ids.view(np.uint32).max()) < vocab_size
  return int(ids.min()) >= 0 and int(ids.max()) < vocab_size


def _outside(ids: np.ndarray, vocab_size: int) -> np.ndarray:
  return (ids < 0) | (ids >= vocab_size)


def check(batch: dict, vocab_size: int, where: Where) -> None:
  """Raises :class:`TokenIdError` unless every id of ``batch["inputs"]``, and of ``batch["targets"]`` where
  ``batch["loss_mask"]`` is > 0, lies in [0, vocab_size). ``where`` names the document of the first offending
  token (called only then)."""
  inputs, targets = np.asarray(batch["inputs"]), np.asarray(batch["targets"])
  if _in_range(inputs, vocab_size) and _in_range(targets, vocab_size):
    return
  bad_inputs = _outside(inputs, vocab_size)
  bad_targets = _outside(targets, vocab_size) & (np.asarray(batch["loss_mask"]) > 0)
  # The first offending token in row order: input (r, c) is token c of row r, target (r, c) its token c + 1.
  found = [(int(r), int(c), 0) for r, c in np.argwhere(bad_inputs)[:1]]
  found += [(int(r), int(c) + 1, 1) for r, c in np.argwhere(bad_targets)[:1]]
  if not found:
    return  # only targets outside the loss mask (a source's padding id)
  row, token, shift = min(found)
  col = token - shift
  value = int((targets if shift else inputs)[row, col])
  doc_ids = batch.get("doc_ids")
  doc = int(doc_ids[row, col]) if doc_ids is not None and doc_ids[row, col] >= 0 else None
  position = int(np.asarray(batch["positions"])[row, col]) + shift
  subject, remake = where(doc)
  field = "target" if shift else "input"
  problem = (f"token id {value} at position {position} of the document ({field} row {row}, column {col} of this "
             f"process's batch) is outside the model's vocabulary [0, {vocab_size}) (model.vocab_size={vocab_size})")
  if value < 0:
    fix = f"token ids are never negative: {remake}"
  else:
    largest = max(int(inputs[bad_inputs].max(initial=0)), int(targets[bad_targets].max(initial=0)))
    fix = f"set model.vocab_size to the tokenizer's vocabulary size (at least {largest + 1}), or {remake}"
  raise TokenIdError(subject, problem, fix)

"""The batch format the train step consumes."""

from __future__ import annotations

import numpy as np

KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


def from_packed(tokens: np.ndarray, segment_ids: np.ndarray, positions: np.ndarray,
                trained: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Packed rows of ``seq_len + 1`` tokens with segment ids (0 = padding) and positions -> a training batch.
  A target counts only when it continues the input's document: never across documents, never padding; and,
  given ``trained`` (per token, SFT data), only when the target token is trained (a response token)."""
  same_doc = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
  if trained is not None:
    same_doc &= trained[:, 1:] > 0
  return {
      "inputs": tokens[:, :-1].astype(np.int32),
      "targets": tokens[:, 1:].astype(np.int32),
      "loss_mask": same_doc.astype(np.float32),
      "positions": positions[:, :-1].astype(np.int32),
      "segment_ids": segment_ids[:, :-1].astype(np.int32),
  }


def from_tokens(tokens: np.ndarray) -> dict[str, np.ndarray]:
  """Rows of ``seq_len + 1`` tokens (one document each, no padding) -> a training batch:
  ``inputs``/``targets`` (int32 [b, seq_len], targets shifted by one), ``loss_mask`` (float32, 1 where the
  target is a real token of the same document), ``positions`` (int32, position within the document) and
  ``segment_ids`` (int32, document id within the row; 0 = padding)."""
  b, t = tokens.shape[0], tokens.shape[1] - 1
  return {
      "inputs": tokens[:, :-1].astype(np.int32),
      "targets": tokens[:, 1:].astype(np.int32),
      "loss_mask": np.ones((b, t), np.float32),
      "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
      "segment_ids": np.ones((b, t), np.int32),
  }

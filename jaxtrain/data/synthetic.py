"""A synthetic, learnable token stream so that training runs with no dataset.

Row r of step s is an arithmetic progression ``(a + k * d) mod vocab`` with ``a`` and ``d`` drawn from a
generator seeded by ``(seed, s)``: deterministic, identical however the global batch is split over
processes, and learnable (the model must infer ``d`` from context), so the loss falls.
"""

from __future__ import annotations

import grain
import numpy as np

from jaxtrain.data import batch as batch_lib


class SyntheticSource(grain.DatasetIterator):
  """A Grain iterator (so checkpoints store its position like any other pipeline's)."""

  def __init__(self, seq_len: int, vocab_size: int, global_batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    if global_batch_size % process_count:
      raise ValueError(f"global batch {global_batch_size} does not split over {process_count} processes")
    super().__init__()
    self.seq_len, self.vocab, self.seed = seq_len, vocab_size, seed
    self.global_batch = global_batch_size
    per_process = global_batch_size // process_count
    self.rows = slice(process_index * per_process, (process_index + 1) * per_process)
    self.step = 0

  def __next__(self) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((self.seed, self.step))
    start = rng.integers(0, self.vocab, (self.global_batch, 1))
    stride = rng.integers(1, max(self.vocab // 8, 2), (self.global_batch, 1))
    tokens = (start + stride * np.arange(self.seq_len + 1)) % self.vocab
    self.step += 1
    return batch_lib.from_tokens(tokens[self.rows])

  def get_state(self) -> dict:
    return {"step": self.step}

  def set_state(self, state: dict) -> None:
    self.step = int(state["step"])

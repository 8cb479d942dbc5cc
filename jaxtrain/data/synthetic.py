"""A synthetic, learnable token stream so that training runs with no dataset.

Row r of step s is an arithmetic progression ``(a + k * d) mod vocab`` with ``a`` and ``d`` drawn from a
generator seeded by ``(seed, s)``: deterministic, identical however the global batch is split over
processes, and learnable (the model must infer ``d`` from context), so the loss falls.
"""

from __future__ import annotations

import numpy as np

from jaxtrain.errors import DataError
from jaxtrain.data import batch as batch_lib


class SyntheticSource:
  """This process's rows of the synthetic stream. Its position (``get_state``: the global step count) is a
  :class:`jaxtrain.checkpoint.DataPosition`, so checkpoints store it and a resumed run goes on with the very
  batches it would have read, on any number of processes."""

  def __init__(self, seq_len: int, vocab_size: int, global_batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    if global_batch_size % process_count:
      raise ValueError(f"global batch {global_batch_size} does not split over {process_count} processes")
    self.seq_len, self.vocab, self.seed = seq_len, vocab_size, seed
    self.global_batch = global_batch_size
    per_process = global_batch_size // process_count
    self.rows = slice(process_index * per_process, (process_index + 1) * per_process)
    self.step = 0

  def __iter__(self) -> "SyntheticSource":
    return self

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

  def resplit(self, saved_states: list[dict]) -> dict:
    """Every process of a run is at the same global step, so any process's position is this one's."""
    steps = sorted({int(s["step"]) for s in saved_states})
    if len(steps) != 1:
      raise DataError("data position", f"the processes that saved it were at different steps ({steps})",
                      "resume with the number of processes that saved it")
    return {"step": steps[0]}

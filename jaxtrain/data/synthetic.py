"""A synthetic, learnable token stream so that training runs with no dataset.

Row r of step s is an arithmetic progression ``(a + k * d) mod vocab`` with ``a`` and ``d`` drawn from a
generator seeded by ``(seed, s)``: deterministic, identical however the global batch is split over
processes, and learnable (the model must infer ``d`` from context), so the loss falls. ``data.source=synthetic``:
no path, no eval split of its own (eval reads fixed batches of another seed), byte-level ids for generation.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain.data import batch as batch_lib
from jaxtrain.data.source import SOURCES, Source, StepPosition


class SyntheticSource(StepPosition):
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


def _open(c, seed: int) -> SyntheticSource:
  return SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size, seed, jax.process_index(),
                         jax.process_count())


def _eval(c) -> list[dict]:
  source = _open(c, c.train.seed + 10_000)  # fixed batches of another seed
  return [next(source) for _ in range(c.eval.max_batches or 4)]


def _provenance(c, step: int, doc_ids) -> dict:
  del doc_ids
  return {"source": f"synthetic (seed {c.train.seed}, batch {step - 1})"}


SOURCES.register("synthetic", Source(lambda c: _open(c, c.train.seed), _eval, _provenance, reads_path=False,
                                     tokenizer=lambda c: "byte"))

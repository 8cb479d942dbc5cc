"""Log-likelihoods of token sequences on the mesh, compiled for a few fixed shapes.

:class:`Scorer` scores requests ``(tokens, n)``: the log-probability of the last ``n`` tokens of ``tokens`` given
the ones before them, and whether each of those is the model's most likely next token (greedy). Every token row
goes through the training forward (``Model.forward``, sharded by the run's rules, the batch over the batch shards)
and :func:`jaxtrain.train.losses.cross_entropy` (float32 from logits in the compute dtype), so a score here is the
number the training loss would give the same tokens.

Shapes: ``rows`` rows (a multiple of the batch shards) of one of a few lengths (:func:`buckets`: powers of two up
to ``max_length`` and the midpoints between them;
``max_length`` is always one). A request goes into the shortest bucket that holds it, right-padded
(segment 0: attended by nothing, scored by nothing); each bucket's program is compiled on its first use (AOT: a
call of another shape would be an error, never a silent recompile), so a whole evaluation compiles at most
``len(buckets)`` programs, however many requests it has. The results come back replicated (every process has
them: on a multi-process job every process scores the same requests together).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import models
from jaxtrain import sharding
from jaxtrain.train import losses as losses_lib


def buckets(max_length: int, smallest: int = 64) -> tuple[int, ...]:
  """The row lengths: powers of two from ``smallest`` and the midpoints between them (64, 96, 128, 192, ...: a row
  is at most a third padding), below ``max_length``, then ``max_length``."""
  out, n = [], smallest
  while n < max_length:
    out += [n] + ([n * 3 // 2] if n * 3 // 2 < max_length and n >= 32 else [])
    n *= 2
  return tuple(out) + (max_length,)


class Scorer:
  """Compiled log-likelihood of token rows for ``model`` with params laid out by ``param_shardings``."""

  def __init__(self, model: models.Model, mesh, rules, param_shardings, *, rows: int, max_length: int,
               smallest: int = 64):
    _, shards = sharding.batch_shards(dict(mesh.shape), rules)
    if rows % shards:
      raise ValueError(f"rows={rows} is not a multiple of the {shards} batch shards")
    self.model, self.mesh, self.rules, self.rows = model, mesh, rules, rows
    self.lengths = buckets(max_length, smallest)
    self.batch_sharding = sharding.batch_sharding(mesh, rules)
    self._abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  model.abstract_params, param_shardings)
    self._programs: dict[int, Any] = {}
    self.compiles, self.compile_s = 0, 0.0

  def _score(self, params, inputs, targets, positions, segment_ids, mask):
    """Per row: the summed log-probability of the masked targets, and whether each is the argmax."""
    logits = self.model.forward(params, inputs, positions, segment_ids).logits
    logps = -losses_lib.cross_entropy(logits, targets)
    scored = mask > 0
    total = jnp.sum(jnp.where(scored, logps, 0.0), axis=1)
    greedy = jnp.all(~scored | (jnp.argmax(logits, axis=-1).astype(targets.dtype) == targets), axis=1)
    return total, greedy

  def program(self, length: int):
    """The compiled program for rows of ``length`` tokens (compiled on its first use)."""
    if length not in self._programs:
      t = time.perf_counter()
      row = jax.ShapeDtypeStruct((self.rows, length), jnp.int32, sharding=self.batch_sharding)
      replicated = NamedSharding(self.mesh, P())
      with jax.set_mesh(self.mesh), sharding.axis_rules(self.rules):
        fn = jax.jit(self._score, out_shardings=(replicated, replicated))
        self._programs[length] = fn.lower(self._abstract, *[row] * 5).compile()
      self.compiles += 1
      self.compile_s += time.perf_counter() - t
    return self._programs[length]

  def bucket(self, n: int) -> int:
    """The shortest row length that holds ``n`` tokens."""
    for length in self.lengths:
      if n <= length:
        return length
    raise ValueError(f"{n} tokens do not fit the longest row ({self.lengths[-1]})")

  def score(self, params, requests: Sequence[tuple[Sequence[int], int]], progress=None
            ) -> list[tuple[float, bool]]:
    """``(log p, greedy)`` of each request ``(tokens, n)``: the last ``n`` of ``tokens`` (at least 2 tokens, at
    most the longest bucket + 1) given the ones before. ``progress(k)``: told after each batch of k requests."""
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    by_length: dict[int, list[int]] = {}
    for i, (tokens, n) in enumerate(requests):
      if not 0 < n < len(tokens):
        raise ValueError(f"request {i}: {n} scored tokens of {len(tokens)}")
      by_length.setdefault(self.bucket(len(tokens) - 1), []).append(i)
    for length in sorted(by_length):
      order = sorted(by_length[length], key=lambda i: -len(requests[i][0]))
      program = self.program(length)
      for start in range(0, len(order), self.rows):
        chunk = order[start:start + self.rows]
        arrays = self._rows([requests[i] for i in chunk], length)
        with jax.set_mesh(self.mesh):
          put = [jax.device_put(a, self.batch_sharding) for a in arrays]
          total, greedy = program(params, *put)
        total, greedy = np.asarray(total), np.asarray(greedy)
        for r, i in enumerate(chunk):
          out[i] = (float(total[r]), bool(greedy[r]))
        if progress is not None:
          progress(len(chunk))
    return out

  def _rows(self, requests, length: int) -> list[np.ndarray]:
    """inputs, targets, positions, segment_ids, mask ``[rows, length]`` of ``requests`` (right-padded)."""
    inputs, targets, positions, segments, mask = (np.zeros((self.rows, length), np.int32) for _ in range(5))
    for r, (tokens, n) in enumerate(requests):
      tokens = np.asarray(tokens, np.int32)
      m = len(tokens) - 1
      inputs[r, :m], targets[r, :m] = tokens[:-1], tokens[1:]
      positions[r, :m], segments[r, :m] = np.arange(m), 1
      mask[r, m - n:m] = 1
    return [inputs, targets, positions, segments, mask]

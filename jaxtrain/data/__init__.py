"""Input pipelines. Every source yields per-process numpy batches in the format of
:mod:`jaxtrain.data.batch`; :func:`to_global` assembles them into global jax.Arrays."""

from __future__ import annotations

import gc
import os
from typing import Iterator

import jax
from jax.sharding import NamedSharding
import ml_collections
from jaxtrain.errors import ConfigError, check_choice, check_positive



SOURCES = ("arrayrecord", "synthetic")


def defaults() -> ml_collections.ConfigDict:
  """The ``data`` config group."""
  return ml_collections.ConfigDict(dict(
      source="arrayrecord",  # arrayrecord (output of tools/prepare_data.py) | synthetic (no data needed)
      path="",  # prepared data folder; empty = the bundled Shakespeare corpus, prepared on first use
      seq_len=128,
      packing=True,  # pack documents into rows (segment ids keep them apart); False = one padded doc per row
      tokenizer="",  # if set ('byte' or a tokenizer file), the data must have been prepared with it
      num_workers=0,  # Grain worker processes (0 = in-process, fastest on few cores)
      prefetch=2,  # batches buffered per worker
      verify_checksums=True,  # SHA-256 of every shard against the manifest at start
      cache_dir="~/.cache/jaxtrain",  # where the bundled corpus is prepared
  ))


def validate(config) -> None:
  check_positive(config, ["data.seq_len", "data.prefetch"])
  check_positive(config, ["data.num_workers"], allow_zero=True)
  check_choice(config, "data.source", SOURCES)
  if config.data.source == "synthetic" and config.data.path:
    raise ConfigError("data.path", "is set but data.source='synthetic' ignores it",
                      "set data.source=arrayrecord or clear data.path")


def to_global(local_batch: dict, sharding: NamedSharding) -> dict:
  """This process's rows -> global arrays laid out with ``sharding`` (works on one host and on many).
  Host-side fields (``records``: provenance) stay behind."""
  from jaxtrain.data.batch import KEYS
  return {k: jax.make_array_from_process_local_data(sharding, local_batch[k]) for k in KEYS}


def data_root(config) -> str:
  """The prepared data folder: ``data.path``, or the bundled corpus (prepared on first use)."""
  from jaxtrain.data import prepare
  return config.data.path or os.fspath(prepare.bundled_corpus(config.data.cache_dir))


def open_train(config) -> Iterator[dict]:
  """The training stream the config asks for, validated before anything is compiled. The iterator has
  ``get_state()`` / ``set_state()`` for checkpoints. Raises DataError / ConfigError on bad input."""
  from jaxtrain.data import pipeline
  from jaxtrain.data.synthetic import SyntheticSource

  c = config
  if c.data.source == "synthetic":
    return SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size, c.train.seed,
                           jax.process_index(), jax.process_count())
  root = data_root(c)
  manifest = pipeline.load_manifest(root, c.data.verify_checksums)
  pipeline.check_compatible(manifest, root, c.model.vocab_size, c.data.tokenizer)
  dataset = pipeline.train_dataset(
      root, manifest, seq_len=c.data.seq_len, global_batch=c.train.global_batch_size, seed=c.train.seed,
      process_index=jax.process_index(), process_count=jax.process_count(), packing=c.data.packing,
      num_workers=c.data.num_workers, prefetch=c.data.prefetch)
  return iter(dataset)


def open_eval(config) -> list[dict]:
  """This process's share of the held-out eval batches (``eval.max_batches`` of them; 0 = all): the
  prepared data's eval split, or fixed synthetic batches of another seed."""
  from jaxtrain.data import pipeline
  from jaxtrain.data.synthetic import SyntheticSource

  c, limit = config, config.eval.max_batches or None
  if c.data.source == "synthetic":
    source = SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size, c.train.seed + 10_000,
                             jax.process_index(), jax.process_count())
    return [next(source) for _ in range(limit or 4)]
  root = data_root(c)
  batches = pipeline.eval_batches(root, pipeline.load_manifest(root, verify_checksums=False),
                                  seq_len=c.data.seq_len, global_batch=c.train.global_batch_size,
                                  process_index=jax.process_index(), process_count=jax.process_count())
  return batches[:limit]


def resplit_position(saved: list[dict], current: dict, global_batch: int, process_index: int | None = None,
                     process_count: int | None = None) -> dict:
  """This process's data position from the iterator states that each process of a run with another process
  count saved (``saved[i]``: process i's), ``current`` being this iterator's own state (its layout). The
  global batch must be the one that saved them, so that the global position is the same."""
  from jaxtrain.data import packing

  index = jax.process_index() if process_index is None else process_index
  count = jax.process_count() if process_count is None else process_count
  if set(current) == {"step"}:  # the synthetic source: its position is the global step count
    return {"step": saved[0]["step"]}
  # Every row of the global batch, in order (DataError if the saved run had another global batch).
  lanes = [lane for state in saved for lane in packing.lane_positions(state, global_batch // len(saved))]
  mine = global_batch // count
  return packing.with_lane_positions(current, lanes[index * mine:(index + 1) * mine])


def close(iterator) -> None:
  """Stops a Grain iterator's threads and worker processes now. Left to interpreter shutdown, its per-lane
  prefetch threads are collected after their modules are gone and print spurious errors."""
  if hasattr(iterator, "close"):
    iterator.close()
  gc.collect()

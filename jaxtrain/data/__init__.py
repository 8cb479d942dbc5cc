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
  """The training stream the config asks for, validated before anything is compiled. The iterator is a
  :class:`jaxtrain.checkpoint.DataPosition` (``get_state`` / ``set_state`` / ``resplit``), so checkpoints hold
  its position. Raises DataError / ConfigError on bad input."""
  from jaxtrain.data import loader
  from jaxtrain.data.synthetic import SyntheticSource

  c = config
  if c.data.source == "synthetic":
    return SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size, c.train.seed,
                           jax.process_index(), jax.process_count())
  root = data_root(c)
  manifest = loader.load_manifest(root, c.data.verify_checksums)
  loader.check_compatible(manifest, root, c.model.vocab_size, c.data.tokenizer)
  dataset = loader.train_dataset(
      root, manifest, seq_len=c.data.seq_len, global_batch=c.train.global_batch_size, seed=c.train.seed,
      process_index=jax.process_index(), process_count=jax.process_count(), packing=c.data.packing,
      num_workers=c.data.num_workers, prefetch=c.data.prefetch)
  return loader.TrainIterator(dataset, c.train.global_batch_size, jax.process_index(), jax.process_count())


def open_eval(config) -> list[dict]:
  """This process's share of the held-out eval batches (``eval.max_batches`` of them; 0 = all): the
  prepared data's eval split, or fixed synthetic batches of another seed."""
  from jaxtrain.data import loader
  from jaxtrain.data.synthetic import SyntheticSource

  c, limit = config, config.eval.max_batches or None
  if c.data.source == "synthetic":
    source = SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size, c.train.seed + 10_000,
                             jax.process_index(), jax.process_count())
    return [next(source) for _ in range(limit or 4)]
  root = data_root(c)
  batches = loader.eval_batches(root, loader.load_manifest(root, verify_checksums=False),
                                seq_len=c.data.seq_len, global_batch=c.train.global_batch_size,
                                process_index=jax.process_index(), process_count=jax.process_count())
  return batches[:limit]


def close(iterator) -> None:
  """Stops a Grain iterator's threads and worker processes now. Left to interpreter shutdown, its per-lane
  prefetch threads are collected after their modules are gone and print spurious errors."""
  if hasattr(iterator, "close"):
    iterator.close()
  gc.collect()

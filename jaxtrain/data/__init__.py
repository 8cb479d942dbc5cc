"""Data sources, chosen by ``data.source`` from :data:`SOURCES`. Every source yields per-process numpy batches in
the format of :mod:`jaxtrain.data.batch`; :func:`to_global` assembles them into global jax.Arrays, after checking
their token ids against the model's vocabulary (:mod:`jaxtrain.data.ids`; eval batches: :func:`eval_sets`). A new
source is one ``SOURCES.register(name, Source(...))``: its train stream (a :class:`jaxtrain.checkpoint.DataPosition`,
so that checkpoints hold its position), its eval batches, and where a batch's rows came from (for bad-batch
reports)."""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
from typing import Any, Callable, Iterator

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding

from jaxtrain import paths
from jaxtrain.data import folders, ids, loader, mixture, prepare, stream
from jaxtrain.data.batch import KEYS
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.errors import ConfigError, check_positive
from jaxtrain.registry import Registry


@dataclasses.dataclass(frozen=True)
class Source:
  """open_train: ``config -> iterator`` of this process's batches (validated before anything is compiled: raise
    DataError / ConfigError on bad input). open_eval: ``config -> list`` of this process's held-out batches.
  provenance: ``(config, step, doc_ids) -> dict``: where the rows of ``step`` came from (``doc_ids``: the batch's
    ``doc_ids`` field, or None if it has none). reads_path: whether the source reads ``data.path``."""
  open_train: Callable[[Any], Iterator[dict]]
  open_eval: Callable[[Any], list[dict]]
  provenance: Callable[[Any, int, Any], dict]
  reads_path: bool = True


SOURCES: Registry[Source] = Registry("data.source", "data source", how="jaxtrain.data.SOURCES.register")


def defaults() -> ml_collections.ConfigDict:
  """The ``data`` config group."""
  return ml_collections.ConfigDict(dict(
      source="arrayrecord",  # a name in SOURCES: arrayrecord (tools/prepare_data.py's output) | raw | synthetic
      path="",  # prepared data folder; empty = the bundled Shakespeare corpus, prepared on first use. raw: a
      # file, folder or glob of .jsonl / .parquet / .txt files
      seq_len=128,
      packing=True,  # pack documents into rows (segment ids keep them apart); False = one padded doc per row
      tokenizer="",  # if set ('byte' or a tokenizer file), the data must have been prepared with it
      num_workers=0,  # Grain worker processes (0 = in-process, fastest on few cores)
      prefetch=2,  # batches buffered per worker
      verify_checksums=True,  # SHA-256 of every shard against the manifest at start
      cache_dir="~/.cache/jaxtrain",  # where the bundled corpus is prepared
      # data.source=raw only (jaxtrain/data/stream.py):
      field="text",  # the JSONL field / Parquet column holding the text
      eval_path="",  # eval records (file, folder or glob); empty = the last eval_fraction of data.path
      eval_fraction=0.0,  # without eval_path: this fraction of data.path's records (its last ones) is eval only
      # several folders mixed (jaxtrain/data/mixture.py), instead of data.path: 'web=data/web:0.7,code=data/code:0.3'
      # (name=path:weight; in a config file also {'web': ('data/web', 0.7), ...}); per-component metrics and evals
      mixture=ml_collections.FieldReference("", field_type=object),
      mixture_stages=ml_collections.FieldReference("", field_type=object),  # '1000:web=0.9,code=0.1;...': after
      # step 1000 those weights (every component named)
      mixture_ramp=False,  # True: weights move linearly from each stage to the next instead of at once
  ))


def eval_set_defaults() -> dict:
  """The ``eval`` group's key this package reads (the group itself is the core's, jaxtrain.config)."""
  # named eval data besides the training data's own eval split, each reported as eval_loss/<name>:
  # 'books=data/books,code=data/code_eval' (prepared folders: every split; raw files: every record)
  return dict(sets=ml_collections.FieldReference("", field_type=object))


def validate(config) -> None:
  check_positive(config, ["data.seq_len", "data.prefetch"])
  check_positive(config, ["data.num_workers"], allow_zero=True)
  _validate_eval_sets(config)
  if mixture.components(config) or mixture.stages_given(config) or config.data.mixture_ramp:
    mixture.validate(config)
    return
  source = SOURCES.get(config.data.source)
  if config.data.path and not source.reads_path:
    raise ConfigError("data.path", f"is set but data.source='{config.data.source}' ignores it",
                      "set data.source=arrayrecord or clear data.path")
  if config.data.source == "raw":
    stream.check(config)  # files there, field in them, tokenizer fits, enough records: before anything compiles
    return
  for key, default in (("field", "text"), ("eval_path", ""), ("eval_fraction", 0.0)):
    if config.data[key] != default and not (key == "field" and config.eval.sets):  # raw eval sets read field
      raise ConfigError(f"data.{key}", f"is set but only data.source=raw reads it (data.source="
                        f"'{config.data.source}')", f"set data.source=raw or leave data.{key} at {default!r}")


def _validate_eval_sets(config) -> None:
  sets = mixture.parse_named(config.eval.sets, "eval.sets", weighted=False)
  if not sets:
    return
  if not config.eval.every_steps:
    raise ConfigError("eval.sets", "is set but eval.every_steps=0 (eval never runs)", "set eval.every_steps=N")
  clash = set(mixture.names(config)) & {name for name, _, _ in sets}
  if clash:
    raise ConfigError("eval.sets", f"'{sorted(clash)[0]}' is also a component of data.mixture (whose eval split "
                      "is reported under that name)", "give the eval set another name")
  for name, path, _ in sets:
    folders.check(paths.resolve(path), config, f"eval.sets ({name})")


def resolve(config) -> None:
  """The data keys' canonical form (config.json's): mixtures and eval sets with absolute paths, in name order."""
  mixture.canonical(config)
  sets = mixture.parse_named(config.eval.sets, "eval.sets", weighted=False)
  if sets:
    mixture.replace(config.eval, "sets", mixture.format_named(sets, "eval.sets"))


def to_global(local_batch: dict, sharding: NamedSharding, config=None) -> dict:
  """This process's rows -> global arrays laid out with ``sharding`` (works on one host and on many).
  Host-side fields (``doc_ids``: provenance) stay behind; a mixture's ``sources`` go along. With ``config`` (the
  rows of its training stream), a token id outside [0, model.vocab_size) is refused first: a
  :class:`jaxtrain.data.ids.TokenIdError` naming the source, the document and the position."""
  if config is not None:
    ids.check(local_batch, config.model.vocab_size, functools.partial(_document, config, "train"))
  keys = KEYS + (("sources",) if "sources" in local_batch else ())
  return {k: jax.make_array_from_process_local_data(sharding, local_batch[k]) for k in keys}


_REPREPARE = "re-prepare the data with the model's tokenizer (tools/prepare_data.py --tokenizer)"
_RETOKENIZE = "set data.tokenizer to the model's tokenizer"


def _document(config, split: str, doc: int | None) -> tuple[str, str]:
  """Document ``doc`` (a ``doc_ids`` value) of the training stream (``split="train"``) or of the eval batches
  (``"eval"``) of the configured source, named for errors: :data:`jaxtrain.data.ids.Where`."""
  if mixture.components(config):  # (a mixture's eval batches are checked per component: _held_out_document)
    if doc is None:
      return "data.mixture", f"{_REPREPARE}, or {_RETOKENIZE} (raw components)"
    folder, doc = mixture.component_of(config, doc)
    return _in_folder(folder, "data.mixture", folder.train, doc)
  name = config.data.source
  if name == "arrayrecord":
    root = data_root(config)
    if doc is None:
      return root, _REPREPARE
    return loader.TokenSource(root, loader.load_manifest(root, verify_checksums=False), split).where(doc), _REPREPARE
  if name == "raw":
    files = config.data.eval_path if split == "eval" and config.data.eval_path else config.data.path
    return (stream.build_index(files, config.data.field).where(doc) if doc is not None else files), _RETOKENIZE
  return (f"data.source '{name}'" + (f" ({split})" if split == "eval" else "")
          + (f", document {doc}" if doc is not None else "")), f"fix data.source '{name}'"


def _in_folder(folder: folders.Folder, key: str, documents, doc: int | None) -> tuple[str, str]:
  """Document ``doc`` of ``documents`` (``folder.train`` or ``folder.held_out``) of a named folder (a mixture's
  component, an eval set), named for errors."""
  subject = f"{key} ({folder.name}): " + (documents.where(doc) if doc is not None else folder.path)
  return subject, _REPREPARE if folder.kind == "prepared" else _RETOKENIZE


def _held_out_document(folder: folders.Folder, key: str, doc: int | None) -> tuple[str, str]:
  return _in_folder(folder, key, folder.held_out, doc)


def data_root(config) -> str:
  """The prepared data folder: ``data.path``, or the bundled corpus (prepared on first use)."""
  return config.data.path or os.fspath(prepare.bundled_corpus(config.data.cache_dir))


def _source(config) -> Source:
  """The configured source: ``data.source``'s, or the mixture's when ``data.mixture`` is set."""
  return MIXTURE if mixture.components(config) else SOURCES.get(config.data.source)


def open_train(config) -> Iterator[dict]:
  """The training stream of the configured source, validated before anything is compiled. Raises DataError /
  ConfigError on bad input."""
  return _source(config).open_train(config)


def open_eval(config) -> list[dict]:
  """This process's share of the held-out eval batches (``eval.max_batches`` of them; 0 = all)."""
  return _source(config).open_eval(config)[:config.eval.max_batches or None]


@dataclasses.dataclass
class EvalSet:
  """Held-out batches evaluated together: ``name`` None for the training data's own eval split (``eval_loss``),
  else reported as ``eval_loss/<name>``; ``in_total``: its tokens count in ``eval_loss`` (a mixture's
  components do; ``eval.sets`` do not)."""
  name: str | None
  batches: list[dict]
  in_total: bool


def eval_sets(config) -> list[EvalSet]:
  """Everything the evaluator runs: the training data's eval split (per component for a mixture), then
  ``eval.sets``. This process's rows; at most ``eval.max_batches`` batches each. Their token ids are checked here,
  once (:mod:`jaxtrain.data.ids`): a TokenIdError names the set, the document and the position."""
  if mixture.components(config):
    out = [(EvalSet(f.name, batches, True), functools.partial(_held_out_document, f, "data.mixture"))
           for f, batches in mixture.eval_splits(config)]
  else:
    out = [(EvalSet(None, open_eval(config), True), functools.partial(_document, config, "eval"))]
  named = mixture.parse_named(config.eval.sets, "eval.sets", weighted=False)
  opened = [folders.open_folder(name, paths.resolve(path), config, f"eval.sets ({name})", whole=True)
            for name, path, _ in named]
  for folder in opened:
    batches = mixture.eval_batches(folder, config, jax.process_index(), jax.process_count())
    out.append((EvalSet(folder.name, batches, False), functools.partial(_held_out_document, folder, "eval.sets")))
  for s, where in out:
    for batch in s.batches:
      ids.check(batch, config.model.vocab_size, where)
  return [s for s, _ in out if s.batches]


def provenance(config, step: int, doc_ids) -> dict:
  """Where the rows of ``step`` came from, for bad-batch reports."""
  return _source(config).provenance(config, step, doc_ids)


def _arrayrecord_train(c) -> Iterator[dict]:
  root = data_root(c)
  manifest = loader.load_manifest(root, c.data.verify_checksums)
  loader.check_compatible(manifest, root, c.model.vocab_size, c.data.tokenizer)
  dataset = loader.train_dataset(
      root, manifest, seq_len=c.data.seq_len, global_batch=c.train.global_batch_size, seed=c.train.seed,
      process_index=jax.process_index(), process_count=jax.process_count(), packing=c.data.packing,
      num_workers=c.data.num_workers, prefetch=c.data.prefetch)
  return loader.TrainIterator(dataset, c.train.global_batch_size, jax.process_index(), jax.process_count())


def _arrayrecord_eval(c) -> list[dict]:
  root = data_root(c)
  return loader.eval_batches(root, loader.load_manifest(root, verify_checksums=False), seq_len=c.data.seq_len,
                             global_batch=c.train.global_batch_size, process_index=jax.process_index(),
                             process_count=jax.process_count())


def _arrayrecord_provenance(c, step: int, doc_ids) -> dict:
  if doc_ids is None:
    return {"source": "unknown"}
  ids = sorted({int(d) for d in np.unique(doc_ids) if d >= 0})
  root = data_root(c)
  manifest = loader.load_manifest(root, verify_checksums=False)
  return {"data": root, "documents": ids, "shards": [loader.locate(manifest, "train", d) for d in ids]}


def _synthetic(c, seed: int):
  return SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size, seed, jax.process_index(),
                         jax.process_count())


def _synthetic_eval(c) -> list[dict]:
  source = _synthetic(c, c.train.seed + 10_000)  # fixed batches of another seed
  return [next(source) for _ in range(c.eval.max_batches or 4)]


def _synthetic_provenance(c, step: int, doc_ids) -> dict:
  del doc_ids
  return {"source": f"synthetic (seed {c.train.seed}, batch {step - 1})"}


SOURCES.register("arrayrecord", Source(_arrayrecord_train, _arrayrecord_eval, _arrayrecord_provenance))
SOURCES.register("raw", Source(stream.open_train, stream.open_eval, stream.provenance))
# data.mixture's source: not a data.source choice (the mixture names its folders, each prepared or raw)
MIXTURE = Source(mixture.open_train, lambda c: [b for _, bs in mixture.eval_splits(c) for b in bs],
                 mixture.provenance)
SOURCES.register("synthetic", Source(lambda c: _synthetic(c, c.train.seed), _synthetic_eval, _synthetic_provenance,
                                     reads_path=False))


def close(iterator) -> None:
  """Stops a Grain iterator's threads and worker processes now. Left to interpreter shutdown, its per-lane
  prefetch threads are collected after their modules are gone and print spurious errors."""
  if hasattr(iterator, "close"):
    iterator.close()
  gc.collect()

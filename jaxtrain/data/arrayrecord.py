"""Prepared data (``data.source=arrayrecord``, the default): the ArrayRecord shards and manifest that
tools/prepare_data.py writes (:mod:`jaxtrain.data.prepare`), read by :mod:`jaxtrain.data.loader`. ``data.path`` is
the folder; empty, the bundled Shakespeare corpus, prepared on first use into ``data.cache_dir``. Its ``train``
split trains, its ``eval`` split is held out. A folder holding ``manifest.json`` named by a mixture or
``eval.sets`` is this source's too.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator

import grain
import jax
import numpy as np
from etils import epath

from jaxtrain import paths
from jaxtrain.checkpoint import lineage
from jaxtrain.data import loader, prepare
from jaxtrain.data.source import SOURCES, Documents, Folder, Source
from jaxtrain.errors import DataError

FIX = "re-prepare the data with the model's tokenizer (tools/prepare_data.py --tokenizer)"


def data_root(config) -> str:
  """The prepared data folder: ``data.path``, or the bundled corpus (prepared on first use)."""
  return config.data.path or os.fspath(prepare.bundled_corpus(config.data.cache_dir))


def open_train(c) -> Iterator[dict]:
  root = data_root(c)
  manifest = loader.load_manifest(root, c.data.verify_checksums)
  loader.check_compatible(manifest, root, c.model.vocab_size, c.data.tokenizer, lineage.tokenizer_of(c.to_dict()))
  dataset = loader.train_dataset(
      root, manifest, seq_len=c.data.seq_len, global_batch=c.train.global_batch_size, seed=c.train.seed,
      process_index=jax.process_index(), process_count=jax.process_count(), packing=c.data.packing,
      num_workers=c.data.num_workers, prefetch=c.data.prefetch)
  return loader.TrainIterator(dataset, c.train.global_batch_size, jax.process_index(), jax.process_count())


def open_eval(c) -> list[dict]:
  root = data_root(c)
  return loader.eval_batches(root, loader.load_manifest(root, verify_checksums=False), seq_len=c.data.seq_len,
                             global_batch=c.train.global_batch_size, process_index=jax.process_index(),
                             process_count=jax.process_count())


def provenance(c, step: int, doc_ids) -> dict:
  del step
  if doc_ids is None:
    return {"source": "unknown"}
  ids = sorted({int(d) for d in np.unique(doc_ids) if d >= 0})
  root = data_root(c)
  manifest = loader.load_manifest(root, verify_checksums=False, formats=prepare.RECORD_FORMATS)  # (pairs: theirs)
  return {"data": root, "documents": ids, "shards": [loader.locate(manifest, "train", d) for d in ids]}


def document(c, split: str, doc: int | None) -> tuple[str, str]:
  root = data_root(c)
  if doc is None:
    return root, FIX
  return loader.TokenSource(root, loader.load_manifest(root, verify_checksums=False), split).where(doc), FIX


def tokenizer(c) -> str:
  """'byte': the bundled corpus, or a folder prepared with it (:func:`folder_tokenizer`)."""
  return folder_tokenizer(c.data.path, c) if c.data.path else "byte"


def folder_tokenizer(path: str, c) -> str:
  """'byte' if the folder was prepared with it; a folder prepared with another tokenizer holds only its name, so
  generation needs that tokenizer's file (DataError)."""
  del c
  manifest = os.path.join(path, prepare.MANIFEST)
  try:
    name = json.loads(open(manifest).read())["tokenizer"]
  except (OSError, ValueError, KeyError):
    raise DataError(path, "has no readable manifest.json naming the data's tokenizer",
                    "pass --tokenizer=FILE (the tokenizer the data was prepared with)") from None
  if name != "byte":
    raise DataError(manifest, f"names tokenizer {name}, which is not saved with the data",
                    "pass --tokenizer=FILE (that tokenizer file)")
  return name


# ------------------------------------------------------------------------------ a prepared folder as documents


def is_prepared(path: str) -> bool:
  return (epath.Path(paths.resolve(path)) / prepare.MANIFEST).exists()


def has_held_out(path: str, c) -> bool:
  del c
  return any(s["split"] == "eval" for s in loader.load_manifest(paths.resolve(path), verify_checksums=False)["shards"])


def _shuffled(c, name: str, docs: int) -> grain.MapDataset:
  """A mixture component's endless document order: seeded by ``train.seed`` and the component's name, reshuffled
  every epoch."""
  seed = int.from_bytes(hashlib.sha256(f"{c.train.seed}:{name}".encode()).digest()[:4], "little") >> 1
  return grain.MapDataset.range(docs).seed(seed).shuffle().repeat(None)


def open_folder(name: str, path: str, c, key: str, whole: bool = False, verify: bool = True) -> Folder:
  """The prepared folder ``path``: its ``train`` split and its ``eval`` split held out (``whole``: every split
  held out)."""
  del key
  manifest = loader.load_manifest(path, verify and c.data.verify_checksums)
  loader.check_compatible(manifest, path, c.model.vocab_size, c.data.tokenizer, lineage.tokenizer_of(c.to_dict()))
  masked = bool(manifest.get("loss_mask", False))
  splits = {s["split"] for s in manifest["shards"]}
  if whole:
    train, held_out = None, loader.TokenSource(path, manifest, None)
  else:
    train = loader.TokenSource(path, manifest, "train")
    held_out = loader.TokenSource(path, manifest, "eval") if "eval" in splits else None
  docs = len(train) if train is not None else 0
  return Folder(name, path, "arrayrecord", manifest["tokenizer"], masked, train, docs, held_out,
                len(held_out) if held_out else 0, order=lambda c, lanes: _shuffled(c, name, docs),
                locate=lambda d: loader.locate(manifest, "train", d), fix=FIX)


SOURCES.register("arrayrecord", Source(
    open_train, open_eval, provenance, tokenizer=tokenizer, document=document,
    documents=Documents(open=open_folder, has_held_out=has_held_out, claims=is_prepared, tokenizer=folder_tokenizer)))

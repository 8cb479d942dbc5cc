"""The Grain input pipeline (data loader) over prepared shards: per-host, packed, deterministic, resumable.

The global batch of B rows is made of B *lanes*. Lane r reads documents r, r+B, r+2B, ... of the globally
shuffled (and every epoch reshuffled) document order and packs them into rows of ``seq_len + 1`` tokens.
A process builds only its own lanes (rows ``[p*B/P, (p+1)*B/P)``), so processes read disjoint documents that
together cover each epoch exactly once, and the global batch is the same for any number of processes.
Lanes are interleaved round-robin and batched by Grain, so the whole pipeline is one Grain dataset whose
iterator state (``get_state`` / ``set_state``) restores the stream exactly. :class:`TrainIterator` adds what a
checkpoint needs to resume it on another number of processes (``resplit``); only this package knows Grain.
Supervised fine-tuning data (manifest ``loss_mask: true``, see :mod:`jaxtrain.data.prepare`) brings per-token
trained flags, cut into rows with the tokens: a target then counts only if it is a trained (response) token.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os

import grain
import numpy as np
from absl import flags
from etils import epath

from jaxtrain import failures
from jaxtrain.data import batch as batch_lib
from jaxtrain import paths
from jaxtrain.data import packing as packing_lib
from jaxtrain.data import prepare
from jaxtrain.data import shard_cache
from jaxtrain.data import tokenizers
from jaxtrain.errors import DataError


def load_manifest(path: str, verify_checksums: bool = True, formats: tuple[str, ...] | None = None) -> dict:
  """Reads ``path/manifest.json`` and checks that every shard is there, whole and (optionally) intact.
  ``formats``: the record formats the reader takes (default: token documents and SFT examples)."""
  root = epath.Path(path)
  manifest_path = root / prepare.MANIFEST
  # Read, not looked for first: fsspec's exists() answers False for any error, so a store's 403 or 503 would read as
  # a missing folder. Each failure is told by its cause (jaxtrain.failures): exit 2 or 75, never "missing" for it.
  try:
    text = manifest_path.read_text()
  except FileNotFoundError:
    if not root.exists():
      raise DataError(path, "no such data folder", "run tools/prepare_data.py --output=" + path + " first") from None
    raise DataError(path, "no manifest.json (no prepared shards here)", "point data.path at the --output of "
                    "tools/prepare_data.py") from None
  except Exception as e:
    failures.reraise(e, path, "reading the prepared data's manifest")
    raise
  try:
    manifest = json.loads(text)
    assert manifest["format"] in prepare.RECORD_FORMATS
    assert isinstance(manifest["shards"], list)
  except Exception:
    raise DataError(os.fspath(manifest_path), "not a jaxtrain manifest (unreadable or wrong format)",
                    "re-run tools/prepare_data.py") from None
  formats = formats or (prepare.FORMAT, prepare.FORMAT_SFT)
  if manifest["format"] not in formats:
    if manifest["format"] == prepare.FORMAT_PREFERENCE:
      raise DataError(path, "holds preference pairs (tools/prepare_data.py --format=preference), which train.objective"
                      "=lm does not read", "train it with train.objective=dpo, simpo or orpo")
    raise DataError(path, f"holds no preference pairs (its records are {manifest['format']})",
                    "prepare chosen/rejected pairs with tools/prepare_data.py --format=preference")
  for shard in manifest["shards"]:  # its names checked before any becomes a path (a shared bucket's manifest)
    shard_cache.check_entry(os.fspath(manifest_path), shard)
  for shard in manifest["shards"]:
    f = root / shard["file"]
    try:
      size = f.stat().length
    except FileNotFoundError:
      raise DataError(os.fspath(f), "shard listed in the manifest is missing", "re-run tools/prepare_data.py") from None
    except Exception as e:
      failures.reraise(e, os.fspath(f), "reading a prepared shard")
      raise
    if size != shard["bytes"]:
      raise DataError(os.fspath(f), f"shard is truncated or changed ({size} bytes, manifest says "
                      f"{shard['bytes']})", "re-run tools/prepare_data.py")
    if verify_checksums and paths.is_url(os.fspath(f)):
      shard_cache.local_copy(os.fspath(f), shard)  # checked as it is copied (the copy is what is read)
    elif verify_checksums and hashlib.sha256(f.read_bytes()).hexdigest() != shard["sha256"]:
      raise DataError(os.fspath(f), "shard checksum does not match the manifest (corrupt file)",
                      "re-run tools/prepare_data.py (or set data.verify_checksums=False to skip this check)")
  return manifest


def check_compatible(manifest: dict, path: str, model_vocab: int, tokenizer: str, carried: str = "") -> None:
  """The config must be able to use these tokens: ``tokenizer`` (``data.tokenizer``) made them, or, left empty, the
  tokenizer the model's lineage carries (``carried``: jaxtrain.checkpoint.lineage.tokenizer_of) when it has one."""
  if manifest["vocab_size"] > model_vocab:
    raise DataError(path, f"tokens need vocab_size {manifest['vocab_size']} (tokenizer {manifest['tokenizer']}) "
                    f"but model.vocab_size={model_vocab}", f"set model.vocab_size >= {manifest['vocab_size']}")
  if tokenizer and not _same_tokenizer(tokenizer, manifest["tokenizer"]):
    raise DataError(path, f"prepared with tokenizer {manifest['tokenizer']}, but data.tokenizer={tokenizer}",
                    "prepare the data with that tokenizer or set data.tokenizer to match")
  if not tokenizer and carried and not _same_tokenizer(carried, manifest["tokenizer"]):
    raise DataError(path, f"prepared with tokenizer {manifest['tokenizer']}, but the model's lineage carries the "
                    f"tokenizer {carried}, which it was trained with", f"prepare the data with --tokenizer={carried}, "
                    "or set data.tokenizer to the tokenizer the data was prepared with")


def _same_tokenizer(config_value: str, manifest_value: str) -> bool:
  if config_value == manifest_value:
    return True
  if config_value in ("", "byte"):
    return manifest_value == "byte"
  return tokenizers.load(config_value).name == manifest_value


class TokenSource(grain.sources.RandomAccessDataSource):
  """Random access to the documents of one split (``split=None``: of every split, in manifest order): document i -> int32 token ids [n] or, for SFT data
  (``masked``), int32 [2, n]: its token ids and their trained flags (1: the token's prediction is trained)."""

  def __init__(self, root: str, manifest: dict, split: str):
    shards = [s for s in manifest["shards"] if split in (None, s["split"])]
    files = [os.fspath(epath.Path(root) / s["file"]) for s in shards]
    if not files:
      raise DataError(root, f"no '{split or 'any'}' shards in the manifest", "prepare the data with that split")
    self._files, self._ends = files, np.cumsum([s["documents"] for s in shards])
    # ArrayRecord reads local files only: a store's shards are read from this host's copies (shard_cache).
    self._source = grain.sources.ArrayRecordDataSource(
        [shard_cache.local_copy(f, s) if paths.is_url(f) else f for f, s in zip(files, shards)])
    self._dtype = np.dtype(manifest["dtype"])
    self.masked = bool(manifest.get("loss_mask", False))

  def __len__(self) -> int:
    return len(self._source)

  def where(self, index: int) -> str:
    """Document ``index``'s shard file and record number in it (for errors that name it)."""
    shard = int(np.searchsorted(self._ends, index, side="right"))
    return f"{self._files[shard]} (record {index - (int(self._ends[shard - 1]) if shard else 0)})"

  def __getitem__(self, index: int) -> np.ndarray:
    record = self._source[index]
    if not self.masked:
      return np.frombuffer(record, self._dtype).astype(np.int32)
    n = len(record) // (self._dtype.itemsize + 1)  # n token ids, then n uint8 flags
    return np.stack([np.frombuffer(record, self._dtype, n).astype(np.int32),
                     np.frombuffer(record, np.uint8, n, n * self._dtype.itemsize).astype(np.int32)])


def _to_train_batch(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  batch = batch_lib.from_packed(rows["tokens"], rows["segment_ids"], rows["positions"], rows.get("trained"))
  batch["doc_ids"] = rows["doc_ids"][:, :-1]  # host-side provenance: the document of each input token
  if "sources" in rows:  # a mixture's component of each input token (per-component metrics in the step)
    batch["sources"] = rows["sources"][:, :-1]
    doc_ids = batch["doc_ids"]  # provenance names the component too: component << SOURCE_SHIFT | document
    batch["doc_ids"] = np.where(doc_ids >= 0, doc_ids.astype(np.int64) | (batch["sources"].astype(np.int64)
                                                                          << packing_lib.SOURCE_SHIFT), -1)
  return batch


def locate(manifest: dict, split: str, doc_id: int) -> tuple[str, int]:
  """A split's document id (its index in the split) -> (shard file, index within that shard)."""
  for shard in (s for s in manifest["shards"] if s["split"] == split):
    if doc_id < shard["documents"]:
      return shard["file"], doc_id
    doc_id -= shard["documents"]
  raise IndexError(doc_id)


def train_dataset(root: str, manifest: dict, *, seq_len: int, global_batch: int, seed: int,
                  process_index: int, process_count: int, packing: bool = True, split: str = "train",
                  num_workers: int = 0, prefetch: int = 2) -> grain.IterDataset:
  """This process's share of an endless stream of training batches (numpy, jaxtrain batch format)."""
  source = TokenSource(root, manifest, split)
  doc_ids = grain.MapDataset.range(len(source)).seed(seed).shuffle().repeat(None)
  return lanes_dataset(doc_ids, source, seq_len=seq_len, global_batch=global_batch, process_index=process_index,
                       process_count=process_count, packing=packing, masked=source.masked, num_workers=num_workers,
                       prefetch=prefetch)


def lanes_dataset(doc_ids, source, *, seq_len: int, global_batch: int, process_index: int, process_count: int,
                  packing: bool = True, masked: bool = False, num_workers: int = 0,
                  prefetch: int = 2) -> grain.IterDataset:
  """This process's batches of the packed lanes over ``doc_ids`` (the endless document order that
  :class:`jaxtrain.data.packing.PackedLanes` reads, lane r at r, r + B, ...) and ``source`` (document id ->
  tokens): the tail of :func:`train_dataset`, shared with the raw-data source (:mod:`jaxtrain.data.stream`)."""
  lanes = process_lanes(global_batch, process_index, process_count)
  per_process = len(lanes)
  ds = packing_lib.PackedLanes(doc_ids, source, lanes, global_batch, seq_len + 1, packing, masked)
  return batched(ds, per_process, num_workers=num_workers, prefetch=prefetch)


def process_lanes(global_batch: int, process_index: int, process_count: int) -> range:
  """The lanes (rows of the global batch) process ``process_index`` of ``process_count`` reads."""
  if global_batch % process_count:
    raise ValueError(f"global batch {global_batch} does not split over {process_count} processes")
  per_process = global_batch // process_count
  return range(process_index * per_process, (process_index + 1) * per_process)


def batched(ds: grain.IterDataset, per_process: int, *, num_workers: int = 0, prefetch: int = 2) -> grain.IterDataset:
  """Rows of a process's lanes (:class:`~jaxtrain.data.packing.PackedLanes` or ``MixedLanes``) -> its batches:
  packed by ``num_workers`` Grain worker processes (each a strided subset of the lanes) or in process."""
  if num_workers > 0:
    if per_process % num_workers:
      raise ValueError(f"{num_workers} workers do not divide the {per_process} rows of a process's batch")
    if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; callers outside absl.app have none
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers,
                                                     per_worker_buffer_size=prefetch * per_process))
  return ds.batch(per_process, drop_remainder=True).map(_to_train_batch)


class TrainIterator:
  """The iterator of a :func:`train_dataset` with its position for checkpoints: a
  :class:`jaxtrain.checkpoint.DataPosition`. ``get_state`` / ``set_state`` are Grain's; ``resplit`` gives this
  process its lanes' positions from those that the processes of a run with another process count saved."""

  def __init__(self, dataset: grain.IterDataset, global_batch: int, process_index: int, process_count: int):
    """``dataset``: :func:`train_dataset` built for ``process_index`` of ``process_count`` and ``global_batch``."""
    self._iterator = iter(dataset)
    self.global_batch, self.process_index, self.process_count = global_batch, process_index, process_count

  def __iter__(self) -> "TrainIterator":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> dict:
    return self._iterator.get_state()

  def set_state(self, state: dict) -> None:
    """Moves to ``state`` and starts Grain's worker processes (if any) reading from there right away."""
    self._iterator.set_state(state)
    self._iterator.start_prefetch()

  def resplit(self, saved_states: list[dict]) -> dict:
    return packing_lib.resplit(saved_states, self.get_state(), self.global_batch, self.process_index,
                               self.process_count)

  def close(self) -> None:
    """Stops Grain's threads and worker processes."""
    self._iterator.close()


def eval_batches(root: str, manifest: dict, *, seq_len: int, global_batch: int, process_index: int,
                 process_count: int, split: str = "eval") -> list[dict[str, np.ndarray]]:
  """One pass over the eval split, packed in file order, this process's rows of each global batch.
  The last batch is padded with empty rows (loss mask 0), so every document counts exactly once."""
  source = TokenSource(root, manifest, split)
  return packed_eval_batches(source, len(source), seq_len=seq_len, global_batch=global_batch,
                             process_index=process_index, process_count=process_count, masked=source.masked)


def packed_eval_batches(source, num_docs: int, *, seq_len: int, global_batch: int, process_index: int,
                        process_count: int, masked: bool = False,
                        max_batches: int = 0) -> list[dict[str, np.ndarray]]:
  """:func:`eval_batches` over any ``source`` (document id -> tokens) of ``num_docs`` documents; with
  ``max_batches`` > 0 only the first that many batches are packed."""
  rows = packing_lib.PackedLanes(grain.MapDataset.range(num_docs), source, [0], 1, seq_len + 1, masked=masked)
  rows = list(itertools.islice(rows, max_batches * global_batch if max_batches else None))
  empty = {k: np.zeros(seq_len + 1, np.int32) for k in ("tokens", "segment_ids", "positions")
           + (("trained",) if masked else ())}
  empty["doc_ids"] = np.full(seq_len + 1, -1, np.int32)
  rows += [empty] * (-len(rows) % global_batch)
  per_process = global_batch // process_count
  batches = []
  for start in range(0, len(rows), global_batch):
    mine = rows[start + process_index * per_process:start + (process_index + 1) * per_process]
    batches.append(_to_train_batch({k: np.stack([r[k] for r in mine]) for k in empty}))
  return batches

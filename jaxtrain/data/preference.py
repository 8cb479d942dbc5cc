"""Preference folders (``tools/prepare_data.py --format=preference``, :mod:`jaxtrain.data.pairs`) -> the batches
of the preference objectives (:mod:`jaxtrain.train.objectives.preference`).

A batch of B pairs has ``chosen_<key>`` and ``rejected_<key>`` for each key of :data:`jaxtrain.data.batch.KEYS`,
``[B, seq_len]`` each: row i of both is pair i, one side per row, padded (segment id 0, loss mask 0), so both sides
of a pair are always in the same step and, rows being split over the batch axes alike, on the same device. With
precomputed reference log-probabilities (:func:`write_reference`, ``tools/reference_logps.py``) it also has
``reference_chosen`` and ``reference_rejected``, float32 ``[B]``.

The training stream is one Grain dataset: the folder's ``train`` pairs in a seeded shuffle, reshuffled every
epoch, cut into global batches of B pairs of which each process reads its own rows (``[p*B/P, (p+1)*B/P)``). Its
position is the number of global batches read, the same on every process: a checkpoint resumes it exactly, on any
number of processes.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

import grain
import jax
import numpy as np
from etils import epath

from jaxtrain.checkpoint import lineage
from jaxtrain.data import batch as batch_lib
from jaxtrain.data import ids, loader, pairs, prepare
from jaxtrain.errors import DataError, UserError

SIDES = pairs.SIDES
REFERENCE = "reference-{split}.npy"  # precomputed reference log-probs: float32 [pairs, 2] (chosen, rejected)
REFERENCE_INFO = "reference.json"  # what they were computed with


def open_manifest(path: str, verify_checksums: bool = False) -> dict:
  """The folder's manifest, which must hold preference pairs (DataError naming the folder otherwise)."""
  return loader.load_manifest(path, verify_checksums, formats=(prepare.FORMAT_PREFERENCE,))


def check(config) -> dict:
  """The configured folder: its manifest, its tokens fit the model, its pairs fit ``data.seq_len``."""
  root = config.data.path
  manifest = open_manifest(root, config.data.verify_checksums)
  loader.check_compatible(manifest, root, config.model.vocab_size, config.data.tokenizer,
                          lineage.tokenizer_of(config.to_dict()))
  prepared = manifest["preference"]["seq_len"]
  if config.data.seq_len < prepared:
    raise DataError(root, f"was prepared for rows of {prepared} tokens (--seq_len), longer than data.seq_len="
                    f"{config.data.seq_len}", f"re-prepare it with --seq_len={config.data.seq_len}, or set "
                    f"data.seq_len={prepared}")
  return manifest


class Pairs:
  """Random access to the pairs of one split: pair i -> ((chosen ids, trained), (rejected ids, trained))."""

  def __init__(self, root: str, manifest: dict, split: str):
    self.tokens = loader.TokenSource(root, manifest, split)
    self.root, self.split = root, split

  def __len__(self) -> int:
    return len(self.tokens)

  def __getitem__(self, index: int):
    ids_and_flags = self.tokens[index]
    return pairs.decode(ids_and_flags[0], ids_and_flags[1].astype(np.uint8))

  def where(self, index: int) -> str:
    return self.tokens.where(index)


def rows(sides: list[tuple[np.ndarray, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
  """One side of several pairs (ids, trained) -> a batch of rows (:func:`jaxtrain.data.batch.from_packed`), each
  padded to ``seq_len + 1`` tokens."""
  n = len(sides)
  tokens = np.zeros((n, seq_len + 1), np.int32)
  trained = np.zeros((n, seq_len + 1), np.int32)
  segment_ids = np.zeros((n, seq_len + 1), np.int32)
  for i, (side_ids, side_trained) in enumerate(sides):
    k = len(side_ids)
    tokens[i, :k], trained[i, :k], segment_ids[i, :k] = side_ids, side_trained, 1
  positions = np.where(segment_ids > 0, np.arange(seq_len + 1, dtype=np.int32), 0)
  return batch_lib.from_packed(tokens, segment_ids, positions, trained)


def make_batch(source: Pairs, indices, seq_len: int, reference: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Pairs ``indices`` of ``source`` -> a preference batch (see the module docstring); ``reference``: the split's
  precomputed reference log-probs. Host-side ``doc_ids`` (``[B]``) name the pairs (a bad batch's provenance)."""
  indices = np.asarray(indices, np.int64)
  got = [source[int(i)] for i in indices]
  out = {}
  for s, name in enumerate(SIDES):
    out.update({f"{name}_{k}": v for k, v in rows([g[s] for g in got], seq_len).items()})
  if reference is not None:
    out["reference_chosen"], out["reference_rejected"] = (reference[indices, s].astype(np.float32) for s in (0, 1))
  out["doc_ids"] = indices
  return out


def read_reference(root: str, split: str, count: int) -> np.ndarray:
  """The precomputed reference log-probs of ``split`` (DataError when missing or not of this folder's pairs)."""
  path = epath.Path(root) / REFERENCE.format(split=split)
  if not path.exists():
    raise DataError(root, f"has no precomputed reference log-probs ({path.name})",
                    f"run tools/reference_logps.py --config=... --config.data.path={root} first, or set "
                    "preference.reference=auto")
  with path.open("rb") as f:
    values = np.load(f)
  if values.shape != (count, 2):
    raise DataError(os.fspath(path), f"holds {values.shape[0]} pairs' log-probs, the folder's {split} split {count}",
                    "re-run tools/reference_logps.py")
  return values


def write_reference(root: str, split: str, values: np.ndarray, info: dict) -> None:
  """Saves ``values`` (float32 [pairs, 2]) as ``split``'s precomputed reference log-probs, and what made them."""
  path = epath.Path(root) / REFERENCE.format(split=split)
  tmp = path.parent / (path.name + ".tmp")
  with tmp.open("wb") as f:
    np.save(f, np.asarray(values, np.float32))
  tmp.rename(path)
  (epath.Path(root) / REFERENCE_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


class TrainStream:
  """This process's training batches, a :class:`jaxtrain.checkpoint.DataPosition` (Grain's iterator state)."""

  def __init__(self, config, reference: bool):
    c = config
    root = c.data.path
    manifest = check(c)
    self.source = Pairs(root, manifest, "train")
    values = read_reference(root, "train", len(self.source)) if reference else None
    self.global_batch = c.train.global_batch_size
    lanes = np.asarray(loader.process_lanes(self.global_batch, jax.process_index(), jax.process_count()))
    seq_len = c.data.seq_len
    order = grain.MapDataset.range(len(self.source)).seed(c.train.seed).shuffle().repeat(None)
    dataset = order.batch(self.global_batch, drop_remainder=True).map(
        lambda ids_: make_batch(self.source, np.asarray(ids_)[lanes], seq_len, values))
    self._iterator = iter(dataset.to_iter_dataset())

  def __iter__(self) -> "TrainStream":
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> dict:
    return {"grain": self._iterator.get_state(), "global_batch": self.global_batch}

  def set_state(self, state: dict) -> None:
    self._iterator.set_state(state["grain"])

  def resplit(self, saved_states: list[dict]) -> dict:
    """Every process is at the same global batch: any process's position is this one's."""
    state = saved_states[0]
    if state.get("global_batch") != self.global_batch:
      raise UserError("train.global_batch_size", f"the checkpoint's preference stream was cut into batches of "
                      f"{state.get('global_batch')} pairs, this run's into {self.global_batch}",
                      "resume with the same global batch size")
    return state


def eval_batches(config, reference: bool) -> list[dict[str, np.ndarray]]:
  """This process's rows of the held-out pairs (the folder's ``eval`` split) in global batches, the last padded
  with copies of the first pair whose ``pair_weight`` is 0; [] when the folder holds none."""
  root = config.data.path
  manifest = open_manifest(root)
  if not any(s["split"] == "eval" for s in manifest["shards"]):
    return []
  source = Pairs(root, manifest, "eval")
  values = read_reference(root, "eval", len(source)) if reference else None
  b = config.train.global_batch_size
  lanes = np.asarray(loader.process_lanes(b, jax.process_index(), jax.process_count()))
  out = []
  for start in range(0, len(source), b):
    indices = np.arange(start, start + b)
    weight = (indices < len(source)).astype(np.float32)
    indices = np.where(weight > 0, indices, 0)
    batch = make_batch(source, indices[lanes], config.data.seq_len, values)
    batch["pair_weight"] = weight[lanes]
    out.append(batch)
  return out


def check_ids(batch: dict, vocab_size: int, source_name: str) -> None:
  """Token ids of both sides against the model's vocabulary (:func:`jaxtrain.data.ids.check`), naming the pair."""
  for name in SIDES:
    side = {k: batch[f"{name}_{k}"] for k in ("inputs", "targets", "loss_mask")}
    ids.check(side, vocab_size, lambda doc: (f"{source_name}, {name} side", "re-prepare the data with the "
                                             "model's tokenizer (tools/prepare_data.py --tokenizer)"))


def stream(config, reference: bool) -> Iterator[dict]:
  """The training stream (:class:`TrainStream`)."""
  return TrainStream(config, reference)

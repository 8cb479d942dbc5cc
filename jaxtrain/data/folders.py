"""A named data folder, opened the same way wherever a config names several: a mixture's components
(``data.mixture``) and the eval sets (``eval.sets``).

A path holding ``manifest.json`` is *prepared* data (tools/prepare_data.py's shards: its ``train`` split trains,
its ``eval`` split is held out); any other file, folder or glob is *raw* records (:mod:`jaxtrain.data.stream`:
the last ``data.eval_fraction`` of them held out, ``data.field``, ``data.tokenizer``). An eval set reads every
document of its folder (every split of prepared data, every record of raw files).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from etils import epath

from jaxtrain import paths
from jaxtrain.data import loader, prepare, stream, tokenizers
from jaxtrain.errors import ConfigError, DataError


@dataclasses.dataclass
class Folder:
  """One opened folder. ``train`` / ``held_out``: document id -> tokens (``train_docs`` / ``held_out_docs`` of
  them; ``held_out`` None when there are none); ``tokenizer``: the name of the tokenizer its tokens come from."""
  name: str
  path: str
  kind: str  # "prepared" | "raw"
  tokenizer: str
  masked: bool
  train: Any
  train_docs: int
  held_out: Any | None
  held_out_docs: int


def is_prepared(path: str) -> bool:
  return (epath.Path(paths.resolve(path)) / prepare.MANIFEST).exists()


def has_held_out(path: str, c) -> bool:
  """Whether ``path`` holds documents held out of training (prepared: an ``eval`` split; raw: data.eval_fraction)."""
  if not is_prepared(path):
    return c.data.eval_fraction > 0
  return any(s["split"] == "eval" for s in loader.load_manifest(paths.resolve(path), verify_checksums=False)["shards"])


def check(path: str, c, key: str) -> None:
  """Config-time checks: the path is prepared data, or raw files with ``data.field`` in their first record (their
  index is built here, and cached for training). ConfigError naming ``key``."""
  if not is_prepared(path):
    stream.checked_index(path, c.data.field, key)


def open_folder(name: str, path: str, c, key: str, whole: bool = False, verify: bool = True) -> Folder:
  """Opens ``path`` (already resolved) for config ``c``; ``whole``: every document is held out (an eval set);
  ``verify``: check prepared shards' SHA-256 when ``data.verify_checksums`` asks (False where training opened the
  same folder already). Raises DataError / ConfigError (naming ``key`` or the file) on bad input."""
  if is_prepared(path):
    manifest = loader.load_manifest(path, verify and c.data.verify_checksums)
    loader.check_compatible(manifest, path, c.model.vocab_size, c.data.tokenizer)
    masked = bool(manifest.get("loss_mask", False))
    splits = {s["split"] for s in manifest["shards"]}
    if whole:
      source = loader.TokenSource(path, manifest, None)
      return Folder(name, path, "prepared", manifest["tokenizer"], masked, None, 0, source, len(source))
    train = loader.TokenSource(path, manifest, "train")
    held_out = loader.TokenSource(path, manifest, "eval") if "eval" in splits else None
    return Folder(name, path, "prepared", manifest["tokenizer"], masked, train, len(train), held_out,
                  len(held_out) if held_out else 0)
  index = stream.checked_index(path, c.data.field, key)
  tokenizer = tokenizers.load(c.data.tokenizer)
  if tokenizer.vocab_size > c.model.vocab_size:
    raise ConfigError("data.tokenizer", f"{tokenizer.name} has {tokenizer.vocab_size} tokens but "
                      f"model.vocab_size={c.model.vocab_size}", f"set model.vocab_size >= {tokenizer.vocab_size}")
  n = len(index)
  held = n if whole else (math.ceil(n * c.data.eval_fraction) if c.data.eval_fraction else 0)
  train = stream.RawSource(index, c.data.field, c.data.tokenizer, 0, n - held, cached_row_groups=64)
  held_out = stream.RawSource(index, c.data.field, c.data.tokenizer, n - held, held) if held else None
  return Folder(name, path, "raw", tokenizer.name, False, train, n - held, held_out, held)


def check_same_tokenizer(folders: list[Folder], key: str) -> None:
  """Every folder's tokens must come from one tokenizer (DataError naming the first that differs, as ``key
  (name)``)."""
  first = folders[0]
  for f in folders[1:]:
    if f.tokenizer != first.tokenizer:
      raise DataError(f"{key} ({f.name})", f"{f.path} was made with tokenizer {f.tokenizer}, but '{first.name}' "
                      f"with {first.tokenizer}", "prepare every folder with the same tokenizer "
                      "(tools/prepare_data.py --tokenizer)")

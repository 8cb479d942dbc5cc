"""A named path of data, opened the same way wherever a config names several: a mixture's components
(``data.mixture``) and the eval sets (``eval.sets``).

Each is opened by its data source (:data:`jaxtrain.data.SOURCES`, one that serves documents by id:
:class:`jaxtrain.data.source.Documents`): the one named with it (``name@source=path``), else the one that claims
the path (a folder holding ``manifest.json`` is prepared data; any other file, folder or glob is raw records). The
source decides what it holds out: a prepared folder its ``eval`` split, raw records their last
``data.eval_fraction``. An eval set reads every document of its path.
"""

from __future__ import annotations

from jaxtrain.data.source import Folder, claimant, document_source
from jaxtrain.errors import DataError

__all__ = ["Folder", "check", "check_same_tokenizer", "has_held_out", "open_folder", "source_of", "tokenizer"]


def source_of(path: str, source: str, key: str) -> str:
  """The source a path is read with: ``source`` if given, else the one that claims it."""
  return source or claimant(path, key)


def has_held_out(path: str, c, source: str = "", key: str = "data.mixture") -> bool:
  """Whether ``path`` holds documents held out of training."""
  return document_source(source_of(path, source, key), key).has_held_out(path, c)


def tokenizer(path: str, c, source: str = "", key: str = "data.mixture") -> str | None:
  """The tokenizer ``path``'s tokens come from, for generation ('byte' or a file; None: its source cannot tell)."""
  return document_source(source_of(path, source, key), key).tokenizer(path, c)


def check(path: str, c, key: str, source: str = "") -> None:
  """Config-time checks of ``path`` by its source (ConfigError naming ``key``)."""
  document_source(source_of(path, source, key), key).check(path, c, key)


def open_folder(name: str, path: str, c, key: str, whole: bool = False, verify: bool = True,
                source: str = "") -> Folder:
  """Opens ``path`` (already resolved) for config ``c`` with its source; ``whole``: every document is held out (an
  eval set); ``verify``: check checksums when ``data.verify_checksums`` asks (False where training opened the same
  folder already). Raises DataError / ConfigError (naming ``key`` or the file) on bad input."""
  return document_source(source_of(path, source, key), key).open(name, path, c, key, whole=whole, verify=verify)


def check_same_tokenizer(folders: list[Folder], key: str) -> None:
  """Every folder's tokens must come from one tokenizer (DataError naming the first that differs, as ``key
  (name)``)."""
  first = folders[0]
  for f in folders[1:]:
    if f.tokenizer != first.tokenizer:
      raise DataError(f"{key} ({f.name})", f"{f.path} was made with tokenizer {f.tokenizer}, but '{first.name}' "
                      f"with {first.tokenizer}", "prepare every folder with the same tokenizer "
                      "(tools/prepare_data.py --tokenizer)")

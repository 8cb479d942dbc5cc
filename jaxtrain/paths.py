"""Every path a user gives (config keys, tool arguments) is resolved here, once, at start.

A path may be relative to the current directory, start with ``~``, be absolute, or be a URL the storage
libraries understand (``gs://bucket/...``: etils.epath, Orbax and TensorStore all accept it). Relative paths
become absolute because Orbax refuses relative checkpoint paths and a multi-host job's processes must not
depend on their working directory after start.
"""

from __future__ import annotations

import os

# Config keys that hold paths ('' means "the default" for each). data.tokenizer is a path unless it is
# 'byte', the built-in tokenizer.
CONFIG_KEYS = ("workdir", "checkpoint.dir", "checkpoint.restore_from", "data.path", "data.cache_dir",
               "data.tokenizer", "compilation_cache_dir", "eval.harness_include_path")


def is_url(path: str) -> bool:
  return "://" in path


def resolve(path: str) -> str:
  """``path`` made absolute (``~`` expanded, relative to the current directory); URLs and '' unchanged."""
  if not path or is_url(path):
    return path
  return os.path.abspath(os.path.expanduser(path))


def join(base: str, *parts: str) -> str:
  """``base/part/...`` for local folders and URLs alike."""
  return "/".join([base.rstrip("/"), *parts]) if is_url(base) else os.path.join(base, *parts)

"""Every path a user gives (config keys, tool arguments) is resolved here, once, at start.

A path may be relative to the current directory, start with ``~``, be absolute, or be a URL of an object store:
``gs://bucket/...`` (Google Cloud Storage) or ``s3://bucket/...`` (S3 and S3-compatible servers), which
etils.epath, Orbax and TensorStore all reach (:mod:`jaxtrain.stores`: the client library each needs, endpoints,
credentials). Relative paths become absolute because Orbax refuses relative checkpoint paths and a multi-host
job's processes must not depend on their working directory after start. A URL whose store's client library is not
installed is the user's mistake, reported here in one line with the extra to install.
"""

from __future__ import annotations

import os

from jaxtrain import stores

# Config keys that hold paths ('' means "the default" for each). data.tokenizer is a path unless it is
# 'byte', the built-in tokenizer.
CONFIG_KEYS = ("workdir", "checkpoint.dir", "checkpoint.restore_from", "data.path", "data.cache_dir",
               "data.tokenizer", "compilation_cache_dir", "eval.harness_include_path")


def is_url(path: str) -> bool:
  """Whether ``path`` is a URL (an object store's, ``gs://`` or ``s3://``), not a local path."""
  return "://" in path


def resolve(path: str, what: str = "") -> str:
  """``path`` made absolute (``~`` expanded, relative to the current directory); URLs and '' unchanged. Raises a
  UserError when ``path`` is on an object store whose client library is not installed (``what``: the config key or
  argument that names it, for the message; default: the path)."""
  if not path:
    return path
  if is_url(path):
    stores.check_client(path, what or path)
    return path
  return os.path.abspath(os.path.expanduser(path))


def join(base: str, *parts: str) -> str:
  """``base/part/...`` for local folders and URLs alike."""
  return "/".join([base.rstrip("/"), *parts]) if is_url(base) else os.path.join(base, *parts)

"""Prepared shards on an object store (``gs://``, ``s3://``), read from a per-host local copy.

ArrayRecord's reader (under Grain's ``ArrayRecordDataSource``) opens local files only: its C++ reader takes a path
and calls ``open()``, and it has no file-object or byte-range interface that a Python store client could serve. So
a shard named by a URL is copied once to local disk and read there: a run's random access (a global shuffle reads
every shard of the split, record by record) then costs local reads, not one store request per record.

The copies live in ``$JAXTRAIN_SHARD_CACHE`` (default ``~/.cache/jaxtrain/shards``), named by the SHA-256 that the
manifest records for each shard: a copy is the shard's content whatever folder or bucket it came from, so datasets
and runs share copies, and a shard re-prepared with other content gets a new name (no stale copy is ever read). A
copy is downloaded to a temporary name, its digest checked against the manifest, then renamed into place: a killed
download leaves no copy, and processes on one host that fetch the same shard at once each write their own temporary
file and the last rename wins with identical content. Disk needed per host: the prepared data's size (the manifest's
``bytes``), once; remove the folder to reclaim it.
"""

from __future__ import annotations

import hashlib
import os
import uuid

from absl import logging
from etils import epath

from jaxtrain.errors import DataError

ENV = "JAXTRAIN_SHARD_CACHE"
DEFAULT = "~/.cache/jaxtrain/shards"
CHUNK = 16 << 20


def folder() -> str:
  return os.path.expanduser(os.environ.get(ENV) or DEFAULT)


def local_copy(url: str, shard: dict) -> str:
  """The local path of shard ``url`` (a manifest entry ``shard``: its ``sha256`` and ``bytes``), downloaded and
  checked on first use. A download whose digest differs from the manifest's is a DataError (nothing is kept)."""
  name = shard["sha256"] + os.path.splitext(shard["file"])[1]
  path = os.path.join(folder(), name)
  if os.path.exists(path) and os.path.getsize(path) == shard["bytes"]:
    return path
  os.makedirs(folder(), exist_ok=True)
  aside = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
  digest = hashlib.sha256()
  try:
    with epath.Path(url).open("rb") as src, open(aside, "wb") as dst:
      while chunk := src.read(CHUNK):
        digest.update(chunk)
        dst.write(chunk)
    if digest.hexdigest() != shard["sha256"]:
      raise DataError(url, "shard checksum does not match the manifest (corrupt or changed object)",
                      "re-run tools/prepare_data.py")
    os.replace(aside, path)
  finally:
    if os.path.exists(aside):
      os.remove(aside)
  logging.info("copied %s (%.1f MB) to %s", url, shard["bytes"] / 1e6, path)
  return path

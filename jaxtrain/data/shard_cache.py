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

A manifest may come from a shared bucket that others write: its names are checked before they become paths
(:func:`check_entry`): a shard's ``file`` is a file name in the manifest's folder, its ``sha256`` a hex digest (the
copy's name here), its ``bytes`` a count. ``../../etc/x`` in either is refused, in one line, before anything is
read or written.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid

from absl import logging
from etils import epath

from jaxtrain import failures
from jaxtrain.errors import DataError

ENV = "JAXTRAIN_SHARD_CACHE"
DEFAULT = "~/.cache/jaxtrain/shards"
CHUNK = 16 << 20
_DIGEST = re.compile(r"[0-9a-f]{64}")


def check_entry(manifest: str, shard) -> None:
  """Raises a DataError naming ``manifest`` (its path or URL) unless the manifest entry ``shard`` names its file as
  a name in the manifest's folder (no folder part, not ``.`` or ``..``; what tools/prepare_data.py writes), with a
  SHA-256 hex digest and a byte count: those become the shard's path and its copy's local name."""
  fix = "re-run tools/prepare_data.py (a manifest names each shard by its file name in the folder)"
  if not isinstance(shard, dict):
    raise DataError(manifest, f"lists {str(shard)[:80]!r} as a shard, not an entry", fix)
  file, digest, size = shard.get("file"), shard.get("sha256"), shard.get("bytes")
  if not isinstance(file, str) or file in ("", ".", "..") or "/" in file or "\\" in file or "\0" in file:
    raise DataError(manifest, f"names the shard {str(file)[:80]!r}, not a file name in its folder", fix)
  if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
    raise DataError(manifest, f"gives {file} the sha256 {str(digest)[:80]!r}, not a SHA-256 hex digest", fix)
  if not isinstance(size, int) or isinstance(size, bool) or size < 0:
    raise DataError(manifest, f"gives {file} the size {str(size)[:80]!r}, not a byte count", fix)


def folder() -> str:
  return os.path.expanduser(os.environ.get(ENV) or DEFAULT)


def local_copy(url: str, shard: dict) -> str:
  """The local path of shard ``url`` (a manifest entry ``shard``: its ``sha256`` and ``bytes``), downloaded and
  checked on first use. A download whose digest differs from the manifest's is a DataError (nothing is kept), and so
  is an entry whose names are not a digest and a file name (:func:`check_entry`: nothing is written)."""
  check_entry(url.rsplit("/", 1)[0] + "/manifest.json", shard)
  name = shard["sha256"] + os.path.splitext(shard["file"])[1]
  path = os.path.join(folder(), name)
  if os.path.exists(path) and os.path.getsize(path) == shard["bytes"]:
    return path
  os.makedirs(folder(), exist_ok=True)
  aside = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
  digest = hashlib.sha256()
  side = folder()  # whose failure a failed step is: this host's disk, or the store's (the shard's URL)
  try:
    with open(aside, "wb") as dst:
      side = url
      with epath.Path(url).open("rb") as src:
        while chunk := src.read(CHUNK):
          digest.update(chunk)
          side = folder()
          dst.write(chunk)
          side = url
      side = folder()
    if digest.hexdigest() != shard["sha256"]:
      raise DataError(url, "shard checksum does not match the manifest (corrupt or changed object)",
                      "re-run tools/prepare_data.py")
    os.replace(aside, path)
  except DataError:
    raise
  except Exception as e:  # told by its cause (jaxtrain.failures): this host's disk, or the store
    failure = failures.classify(e)
    if failure is not None and failure.kind == failures.DISK_FULL:  # (a store answers no ENOSPC: this host's)
      raise DataError(folder(), f"this host's copies of the shards do not fit ({failure.reason})",
                      f"free space there, or point {ENV} at a disk with room for the prepared data "
                      f"({shard['bytes'] / 1e6:.0f} MB for this shard)") from None
    failures.reraise(e, side, f"copying the shard {url} to this host" if side != url else "copying a shard to this "
                     "host")
    raise
  finally:
    if os.path.exists(aside):
      os.remove(aside)
  logging.info("copied %s (%.1f MB) to %s", url, shard["bytes"] / 1e6, path)
  return path

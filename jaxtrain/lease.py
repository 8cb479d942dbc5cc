"""A lease on an object store (``gs://``, ``s3://``): the workdir lock where there is no flock and no rename.

The lease is one small JSON object (:class:`Lease`) naming its holder and when it expires (``expires``: the holder's
clock, Unix seconds). The holder rewrites it every ``renew_s`` seconds, each time pushing ``expires`` ``lease_s``
ahead. A contender that finds it:

- watches it; a renewal (the object's version changes) proves the holder alive: refused;
- once ``expires`` is past by its own clock with no renewal seen, takes it over: the holder crashed (SIGKILL, a lost
  host). So a scheduler's restart after a crash waits at most ``lease_s`` and then resumes. Hosts' clocks must agree
  to well within ``lease_s`` (NTP keeps cloud hosts within milliseconds); a renewal seen always wins over a clock.

Every write is conditional where the store offers it, so that of two contenders exactly one wins: the first lease is
created only if no object exists (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``), and a renewal or a takeover
replaces the object only if it is still the version read (S3 ``If-Match: <ETag>``, GCS
``ifGenerationMatch=<generation>``). Each write is read back as well: a store that ignores preconditions (some
emulators, S3-compatible servers of older vintage) is then safe against every contender that is not within the same
request's round trip.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import socket
import time

import fsspec


class Conflict(Exception):
  """A conditional write lost: the object exists (create) or changed (replace)."""


@dataclasses.dataclass
class Held:
  """A lease as read: its content and the store's version of the object (ETag or generation)."""
  content: dict
  version: str


class Store:
  """Conditional reads and writes of one object through fsspec (s3fs, gcsfs: their endpoints and credentials are
  the clients' own settings: ``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``, the standard files)."""

  def __init__(self, url: str):
    self.url = url
    self.fs, self.path = fsspec.core.url_to_fs(url)
    self.scheme = url.split("://", 1)[0]

  def read(self) -> Held | None:
    """The object and its version, None if absent. The version is read first: if the object changes in between,
    a replace with that version fails, which is the safe direction."""
    self.fs.invalidate_cache(self.path)
    try:
      info = self.fs.info(self.path)
      data = self.fs.cat_file(self.path)
    except FileNotFoundError:
      return None
    version = info.get("ETag") or info.get("generation") or info.get("etag")
    try:
      content = json.loads(data)
    except ValueError:
      content = {}
    return Held(content if isinstance(content, dict) else {}, str(version))

  def create(self, data: bytes) -> None:
    """Writes the object if there is none, else raises :class:`Conflict`. Looked for first as well, so that a store
    ignoring the precondition never overwrites a lease that is there to be seen."""
    self.fs.invalidate_cache(self.path)
    if self.fs.exists(self.path):
      raise Conflict(self.url)
    try:
      self.fs.pipe_file(self.path, data, mode="create")
    except FileExistsError:
      raise Conflict(self.url) from None

  def replace(self, data: bytes, version: str) -> None:
    """Writes the object if it is still at ``version``, else raises :class:`Conflict`."""
    try:
      if self.scheme == "s3":
        self.fs.pipe_file(self.path, data, IfMatch=version)
      elif self.scheme in ("gs", "gcs"):
        self._gcs_upload(data, ifGenerationMatch=version)
      else:  # another fsspec store: unconditional (the read-back below is then the only check)
        self.fs.pipe_file(self.path, data)
    except FileExistsError:  # gcsfs's 412
      raise Conflict(self.url) from None
    except OSError as e:  # s3fs's 412 (PreconditionFailed) is EINVAL
      if e.errno == errno.EINVAL or "pre-condition" in str(e).lower():
        raise Conflict(self.url) from None
      raise
    finally:
      self.fs.invalidate_cache(self.path)

  def _gcs_upload(self, data: bytes, **preconditions) -> None:
    """gcsfs's simple upload with a generation precondition (gcsfs exposes only ``ifGenerationMatch=0``, as
    ``mode="create"``): the JSON API's multipart upload."""
    bucket, key, _ = self.fs.split_path(self.path)
    meta = json.dumps({"name": key})
    body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
            "Content-Type: application/json\n\n").encode() + data + b"\n--==0==--"
    self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{bucket}/o", uploadType="multipart",
                 headers={"Content-Type": 'multipart/related; boundary="==0=="'}, data=body, json_out=True,
                 **preconditions)

  def delete(self) -> None:
    self.fs.rm_file(self.path)
    self.fs.invalidate_cache(self.path)


class Lease:
  """Holds the object ``url`` as a lease of ``lease_s`` seconds, renewed every ``renew_s`` by :meth:`renew`."""

  def __init__(self, url: str, lease_s: float, renew_s: float, token: str, about: dict):
    self.store = Store(url)
    self.lease_s, self.renew_s, self.token, self.about = lease_s, renew_s, token, about
    self.beat = 0
    self.version: str | None = None  # of our own object, once held

  def _content(self) -> bytes:
    now = time.time()
    return json.dumps({**self.about, "host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                       "beat": self.beat, "lease_s": self.lease_s, "renew_s": self.renew_s,
                       "renewed": now, "expires": now + self.lease_s}).encode()

  def _ours(self) -> bool:
    """Reads the object back: True (and its version noted) if it is ours."""
    held = self.store.read()
    if held is None or held.content.get("token") != self.token:
      return False
    self.version = held.version
    return True

  def acquire(self) -> dict | None:
    """Takes the lease: None when taken (``{"taken_over": content}`` when it took over an expired one), else the
    live holder's content (a renewal was seen, or another contender won). Waits at most until the lease found
    expires: ``lease_s`` by the holder's clock, and never longer than ``lease_s + renew_s`` by ours."""
    seen: Held | None = None  # the holder's object as first read
    give_up = 0.0
    while True:
      try:
        self.store.create(self._content())
        if self._ours():
          return None
      except Conflict:
        pass
      held = self.store.read()
      if held is None:
        continue  # released meanwhile: try to create it again
      if held.content.get("token") == self.token:  # our own create, seen late
        self.version = held.version
        return None
      if seen is not None and held.version != seen.version:
        return held.content  # renewed, or taken by another contender: alive
      if seen is None:
        seen = held
        lease_s = float(held.content.get("lease_s", self.lease_s))
        give_up = time.monotonic() + lease_s + float(held.content.get("renew_s", self.renew_s))
      if time.time() >= float(held.content.get("expires", 0.0)) or time.monotonic() >= give_up:
        try:  # expired: replaced only if it is still the object we watched
          self.store.replace(self._content(), held.version)
        except Conflict:
          seen = None
          continue
        if self._ours():
          return {"taken_over": held.content}
        seen = None
        continue
      time.sleep(min(0.5, max(0.05, self.renew_s / 10)))

  def renew(self) -> dict | None:
    """Pushes the expiry ahead; None when renewed, else the content of the run that took the lease over (the
    lease is then lost). A store's errors propagate: the caller retries at the next renewal."""
    self.beat += 1
    try:
      self.store.replace(self._content(), self.version)
    except Conflict:
      held = self.store.read()
      if held is not None and held.content.get("token") == self.token:  # our own write, version not yet seen
        self.version = held.version
        return None
      return held.content if held is not None else {}
    if not self._ours():
      held = self.store.read()
      return held.content if held is not None else {}
    return None

  def release(self) -> None:
    """Deletes the lease if it is still ours."""
    held = self.store.read()
    if held is not None and held.content.get("token") == self.token:
      self.store.delete()

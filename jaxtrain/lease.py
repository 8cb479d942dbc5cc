"""A lease on an object store (``gs://``, ``s3://``): the workdir lock where there is no flock and no rename.

The lease is one small JSON object (:class:`Lease`) naming its holder (host, PID, a token of its own), its
``generation`` (1 when created, one more at each takeover: the holder's identity that each checkpoint's ``meta``
records) and when it expires (``expires``: the holder's clock, Unix seconds). The holder rewrites it every ``renew_s``
seconds, each time pushing ``expires`` ``lease_s`` ahead.

**The holder's deadline.** The holder reckons how long it may write by its own monotonic clock alone:
:meth:`Lease.deadline` is ``lease_s`` after the *start* of the newest renewal the store confirmed (the write may have
reached the store any time after its start: the start is the conservative end), less a quarter of ``lease_s``
(:data:`MARGIN`: time for a write already under way, such as a checkpoint's commit, to land). Past it the holder must
stop writing (:mod:`jaxtrain.workdir` stops the run, exit 75), whether or not anyone took the lease over.

**When a contender takes over** (:meth:`Lease.acquire`), each rule safe against a contender's clock ahead or behind:

- never while the object changes: a renewal seen proves the holder alive (the contender is refused);
- after watching it unchanged for the holder's whole ``lease_s`` by the contender's own monotonic clock. The watch
  starts after the version it watches was written, so after the holder's deadline has passed by at least the margin:
  no clock of another host is read;
- at once when it expired more than :data:`CLOCK_SKEW_S` ago by the contender's wall clock: a restart long after a
  crash does not wait. Only a clock wrong by more than that allowance (NTP keeps hosts within milliseconds; the tests
  set one 90 s off) could take a live holder's lease early, and the holder's checkpoint commits are still refused
  then: each reads the lease back first (:mod:`jaxtrain.workdir`);
- at once when the caller's ``gone`` says the holder has died (:mod:`jaxtrain.workdir`: a process of this host, of
  the same boot and PID namespace, that no longer runs).

Every write is conditional where the store offers it, so that of two contenders exactly one wins: the first lease is
created only if no object exists (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``), and a renewal or a takeover
replaces the object only if it is still the version read (S3 ``If-Match: <ETag>``, GCS
``ifGenerationMatch=<generation>``). A lost condition is told by the store's answer (HTTP 412, S3's
``PreconditionFailed`` or ``ConditionalRequestConflict``), not by the client's errno, which says the same for many
other errors. Each write is read back as well: a store that ignores preconditions (some emulators, S3-compatible
servers of older vintage) is then safe against every contender that is not within the same request's round trip.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import Callable

import fsspec

from jaxtrain import _compat
from jaxtrain import failures

CLOCK_SKEW_S = 300.0  # how far hosts' wall clocks may disagree before a contender could misjudge an expiry
MARGIN = 0.25  # of lease_s: the holder stops writing this long before a watching contender may take over


class Conflict(Exception):
  """A conditional write lost: the object exists (create) or changed (replace)."""


@dataclasses.dataclass
class Held:
  """A lease as read: its content and the store's version of the object (ETag or generation)."""
  content: dict
  version: str


def _precondition_failed(e: BaseException) -> bool:
  """Whether ``e`` (or an error it was raised from) is the store's answer that a conditional write's condition did
  not hold: gcsfs's FileExistsError for a 412 (its HttpError with code 412 before 2026.x), s3fs's OSError over
  botocore's ClientError (its errno, EINVAL, is the same for many other errors: the ClientError's code tells)."""
  for x in (e, e.__cause__, e.__context__):
    if x is None:
      continue
    if isinstance(x, FileExistsError) or failures.http_status(x) == 412:
      return True
    response = getattr(x, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    if code in ("PreconditionFailed", "ConditionalRequestConflict"):  # the latter: a concurrent conditional write
      return True
  return False


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
    except Exception as e:  # noqa: BLE001 - each client raises its own; only a lost condition is a Conflict
      if _precondition_failed(e):
        raise Conflict(self.url) from None
      raise

  def replace(self, data: bytes, version: str) -> None:
    """Writes the object if it is still at ``version``, else raises :class:`Conflict`."""
    try:
      if self.scheme == "s3":
        self.fs.pipe_file(self.path, data, IfMatch=version)
      elif self.scheme in ("gs", "gcs"):
        self._gcs_upload(data, ifGenerationMatch=version)
      else:  # another fsspec store: unconditional (the read-back below is then the only check)
        self.fs.pipe_file(self.path, data)
    except Exception as e:  # noqa: BLE001 - each client raises its own; only a lost condition is a Conflict
      if _precondition_failed(e):
        raise Conflict(self.url) from None
      raise
    finally:
      self.fs.invalidate_cache(self.path)

  def _gcs_upload(self, data: bytes, **preconditions) -> None:
    """gcsfs's simple upload with a generation precondition (gcsfs exposes only ``ifGenerationMatch=0``, as
    ``mode="create"``): the JSON API's multipart upload, through gcsfs's own request method."""
    bucket, key, _ = self.fs.split_path(self.path)
    call, location = _compat.gcsfs_json_api(self.fs)
    meta = json.dumps({"name": key})
    body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
            "Content-Type: application/json\n\n").encode() + data + b"\n--==0==--"
    call("POST", f"{location}/upload/storage/v1/b/{bucket}/o", uploadType="multipart",
         headers={"Content-Type": 'multipart/related; boundary="==0=="'}, data=body, json_out=True, **preconditions)

  def delete(self) -> None:
    self.fs.rm_file(self.path)
    self.fs.invalidate_cache(self.path)


class Lease:
  """Holds the object ``url`` as a lease of ``lease_s`` seconds, renewed every ``renew_s`` by :meth:`renew`.
  ``about``: more of the holder, written into the object (when it started, how to tell whether it still runs);
  ``gone``: whether the holder a lease's content names has died (see the module's docstring), None: never known."""

  def __init__(self, url: str, lease_s: float, renew_s: float, token: str, about: dict,
               gone: Callable[[dict], bool] | None = None):
    self.store = Store(url)
    self.lease_s, self.renew_s, self.token, self.about, self.gone = lease_s, renew_s, token, about, gone
    self.beat = 0
    self.generation = 0  # ours, once held
    self.version: str | None = None  # of our own object, once held
    self.confirmed: float | None = None  # monotonic start of the newest write of ours the store confirmed

  def _content(self) -> bytes:
    now = time.time()
    return json.dumps({**self.about, "host": socket.gethostname(), "pid": os.getpid(), "token": self.token,
                       "generation": self.generation, "beat": self.beat, "lease_s": self.lease_s,
                       "renew_s": self.renew_s, "renewed": now, "expires": now + self.lease_s}).encode()

  def deadline(self) -> float:
    """The monotonic time past which this holder must not write (see the module's docstring); -inf before it held
    the lease."""
    if self.confirmed is None:
      return float("-inf")
    return self.confirmed + self.lease_s * (1 - MARGIN)

  def _ours(self, started: float) -> bool:
    """Reads the object back: True (its version noted, and the write that ``started`` then confirmed) if ours."""
    held = self.store.read()
    if held is None or held.content.get("token") != self.token:
      return False
    self.version, self.confirmed = held.version, started
    return True

  def _may_take(self, content: dict, watched_s: float) -> str | None:
    """Why a lease seen unchanged for ``watched_s`` seconds (this host's monotonic clock) may be taken over, or None
    when it may not."""
    lease_s = float(content.get("lease_s", self.lease_s))
    if watched_s >= lease_s:
      return f"did not renew its lease for {lease_s:.0f}s"
    expired = time.time() - float(content.get("expires", float("inf")))
    if expired > CLOCK_SKEW_S:
      return f"let its lease expire {expired:.0f}s ago"
    if self.gone is not None and self.gone(content):
      return "is gone (its process no longer runs on this host)"
    return None

  def acquire(self) -> dict | None:
    """Takes the lease: None when taken (``{"taken_over": content, "why": ...}`` when it took another run's over),
    else the live holder's content (a renewal was seen, or another contender won). Waits at most the holder's
    ``lease_s`` by this host's monotonic clock (see the module's docstring for when it takes over sooner)."""
    seen: Held | None = None  # the holder's object as first read
    since = 0.0  # when (monotonic) it was first read
    while True:
      started = time.monotonic()
      self.generation = 1
      try:
        self.store.create(self._content())
        if self._ours(started):
          return None
      except Conflict:
        pass
      held = self.store.read()
      if held is None:
        continue  # released meanwhile: try to create it again
      if held.content.get("token") == self.token:  # our own create, seen late
        self.version, self.confirmed = held.version, started
        return None
      if seen is not None and held.version != seen.version:
        return held.content  # renewed, or taken by another contender: alive
      if seen is None:
        seen, since = held, time.monotonic()
      why = self._may_take(held.content, time.monotonic() - since)
      if why:
        started = time.monotonic()
        self.generation = int(held.content.get("generation") or 0) + 1
        try:  # replaced only if it is still the object we watched
          self.store.replace(self._content(), held.version)
        except Conflict:
          seen = None
          continue
        if self._ours(started):
          return {"taken_over": held.content, "why": why}
        seen = None
        continue
      time.sleep(min(0.5, max(0.05, self.renew_s / 10)))

  def renew(self) -> dict | None:
    """Pushes the expiry ahead (and :meth:`deadline` with it, once the store confirms); None when the lease is still
    ours, else the content of the run that holds it now (``{}``: none). A store's errors propagate: the caller
    tries again while its deadline allows."""
    self.beat += 1
    started = time.monotonic()
    for _ in range(2):
      try:
        self.store.replace(self._content(), self.version)
      except Conflict:
        held = self.store.read()
        if held is None or held.content.get("token") != self.token:
          return held.content if held is not None else {}
        self.version = held.version  # an earlier write of ours whose answer was lost: write again over it
        continue
      if self._ours(started):
        return None
      held = self.store.read()
      return held.content if held is not None else {}
    return None  # ours, the deadline not moved: the next renewal confirms one

  def holder(self) -> dict | None:
    """The content of the lease as the store has it now (None: no lease)."""
    held = self.store.read()
    return held.content if held is not None else None

  def release(self) -> None:
    """Deletes the lease if it is still ours."""
    held = self.store.read()
    if held is not None and held.content.get("token") == self.token:
      self.store.delete()

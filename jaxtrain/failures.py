"""What a failed read or write means: one classification of the errors that storage (a local disk, a network
filesystem, an object store through any of its clients) and devices raise, by their type, errno and status code, and
what a run does about each kind.

The same fault reaches jaxtrain through several libraries, each in its own form: a 503 from Cloud Storage is
gcsfs's ``HttpError`` with ``code=503`` (after its retries), s3fs's ``OSError(EBUSY)`` over botocore's
``ClientError``, or TensorStore's ``ValueError`` "UNAVAILABLE: ... HTTP response code: 503"; a full disk is
``OSError(ENOSPC)`` from Python and "RESOURCE_EXHAUSTED ... [OS error 28: No space left on device]" from TensorStore;
a device out of memory is XLA's ``RESOURCE_EXHAUSTED``. :func:`classify` reads every form (the error, its causes and
contexts, an exception group's members) and returns one :class:`Failure` of a :data:`KINDS` kind, preferring the most
specific evidence (an errno or a status code over a status name in a message, never a guess from free words).

What a run does with each kind (:func:`outcome`, :func:`reraise`):

- the user's to fix, exit 2 with one line: ``denied`` (401/403, EACCES, EPERM, EROFS), ``missing`` (404, ENOENT: a
  bucket or folder that is not there), ``disk full`` (ENOSPC, EDQUOT, EFBIG), ``device out of memory``, ``host out
  of memory``;
- a restart cures it, exit 75: ``throttled`` (429, S3's SlowDown) and ``unreachable`` (refused, reset, timed out,
  5xx) as :data:`jaxtrain.exits.STORE_UNREACHABLE`; ``I/O`` (EIO, ESTALE, EREMOTEIO) as
  :data:`jaxtrain.exits.STORAGE_IO`;
- ``corrupt`` (DATA_LOSS, bytes that do not decode): only the reader knows what is corrupt; a checkpoint's step is
  set aside (jaxtrain.checkpoint), a data shard is the user's (exit 2).
"""

from __future__ import annotations

import dataclasses
import errno as errno_lib
import os
import re

from jaxtrain import exits
from jaxtrain.errors import UserError

DENIED = "denied"
MISSING = "missing"
DISK_FULL = "disk full"
DEVICE_OOM = "device out of memory"
HOST_OOM = "host out of memory"
THROTTLED = "throttled"
UNREACHABLE = "unreachable"
IO = "I/O"
CORRUPT = "corrupt"
KINDS = (DENIED, MISSING, DISK_FULL, DEVICE_OOM, HOST_OOM, THROTTLED, UNREACHABLE, IO, CORRUPT)
USER_KINDS = (DENIED, MISSING, DISK_FULL, DEVICE_OOM, HOST_OOM)  # exit 2
RESTART_CAUSES = {THROTTLED: exits.STORE_UNREACHABLE, UNREACHABLE: exits.STORE_UNREACHABLE, IO: exits.STORAGE_IO}

_ERRNOS = {
    **dict.fromkeys((errno_lib.EACCES, errno_lib.EPERM, errno_lib.EROFS), DENIED),
    **dict.fromkeys((errno_lib.ENOENT, errno_lib.ENOTDIR), MISSING),
    **dict.fromkeys((errno_lib.ENOSPC, errno_lib.EDQUOT, errno_lib.EFBIG), DISK_FULL),
    **dict.fromkeys((errno_lib.EIO, errno_lib.ESTALE, errno_lib.EREMOTEIO, errno_lib.ENXIO), IO),
    **dict.fromkeys((errno_lib.ECONNRESET, errno_lib.ECONNREFUSED, errno_lib.ECONNABORTED, errno_lib.ETIMEDOUT,
                     errno_lib.EPIPE, errno_lib.EHOSTUNREACH, errno_lib.ENETUNREACH, errno_lib.ENETDOWN,
                     errno_lib.ENOTCONN, errno_lib.EHOSTDOWN), UNREACHABLE),
    errno_lib.ENOMEM: HOST_OOM,
    # s3fs turns S3's SlowDown and ServiceUnavailable (and 409 conflicts) into EBUSY
    errno_lib.EBUSY: THROTTLED,
}

# Types that say a store did not answer, by name (their libraries are optional: botocore, aiohttp).
_UNREACHABLE_TYPES = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                      "ClientConnectorError", "ServerDisconnectedError", "ServerTimeoutError", "ClientPayloadError",
                      "ClientConnectionError", "IncompleteReadError", "ResponseStreamingError")
_DEVICE_ERRORS = ("JaxRuntimeError", "XlaRuntimeError")

# Status names in messages (absl's canonical codes: TensorStore's and XLA's).
_STATUS = {"PERMISSION_DENIED": DENIED, "UNAUTHENTICATED": DENIED, "NOT_FOUND": MISSING, "UNAVAILABLE": UNREACHABLE,
           "DEADLINE_EXCEEDED": UNREACHABLE, "ABORTED": UNREACHABLE, "DATA_LOSS": CORRUPT}
_STATUS_RE = re.compile(r"\b(" + "|".join([*_STATUS, "RESOURCE_EXHAUSTED"]) + r")\b")
_HTTP_RE = re.compile(r"HTTP response code: (\d{3})")  # TensorStore
_OS_ERROR_RE = re.compile(r"os_error_code='?(\d+)|\[OS error (\d+)")  # TensorStore


@dataclasses.dataclass(frozen=True)
class Failure:
  """``kind`` (one of :data:`KINDS`), the ``error`` in the chain that said so, and ``reason``: a few words for a
  message ("No space left on device", "HTTP 503")."""
  kind: str
  error: BaseException
  reason: str


def http_kind(status: int) -> str | None:
  """The kind of an HTTP status code a store answered with, None for a success or another client error."""
  if status in (401, 403):
    return DENIED
  if status == 404:
    return MISSING
  if status in (408, 429):
    return THROTTLED
  if 500 <= status <= 599:
    return UNREACHABLE
  return None


def http_status(e: BaseException) -> int | None:
  """The HTTP status a store's client error carries (gcsfs's ``HttpError.code``, botocore's ``ClientError``,
  aiohttp's ``ClientResponseError.status``, TensorStore's "HTTP response code: N"), or None."""
  code = getattr(e, "code", None)
  if type(e).__name__ == "HttpError" and isinstance(code, int):
    return code
  response = getattr(e, "response", None)
  if isinstance(response, dict):
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if isinstance(status, int):
      return status
  status = getattr(e, "status", None)
  if type(e).__name__ == "ClientResponseError" and isinstance(status, int):
    return status
  found = _HTTP_RE.search(str(e))
  return int(found.group(1)) if found else None


def _own(e: BaseException) -> tuple[int, str, str] | None:
  """``(specificity, kind, reason)`` from ``e`` alone (not its causes), or None. Specificity: a device or host out of
  memory 5, an HTTP status 4, an errno 3, a type 2, a status name in a message 1."""
  name = type(e).__name__
  text = str(e)
  if name in _DEVICE_ERRORS and "RESOURCE_EXHAUSTED" in text:
    return 5, DEVICE_OOM, "RESOURCE_EXHAUSTED"
  if isinstance(e, MemoryError):
    return 5, HOST_OOM, "MemoryError"
  status = http_status(e)  # the store's own answer: more precise than the errno a client maps it to (s3fs: EIO)
  if status is not None and http_kind(status):
    return 4, http_kind(status), f"HTTP {status}"
  code = e.errno if isinstance(e, OSError) and isinstance(e.errno, int) else None
  if code is None:
    found = _OS_ERROR_RE.search(text)
    code = int(found.group(1) or found.group(2)) if found else None
  if code in _ERRNOS:
    return 3, _ERRNOS[code], os.strerror(code)
  if name in _UNREACHABLE_TYPES or isinstance(e, (ConnectionError, TimeoutError)) or name == "ProxyError":
    return 2, UNREACHABLE, name
  # An OSError subclass without an errno: gcsfs raises FileNotFoundError(url) for a 404, OSError("Forbidden: ...")
  # for a 403 (its fixed wording, validate_response), PermissionError where fsspec maps one.
  if isinstance(e, FileNotFoundError):
    return 2, MISSING, "not found"
  if isinstance(e, PermissionError) or (type(e) is OSError and text.startswith("Forbidden: ")):
    return 2, DENIED, "forbidden"
  if name in ("NoCredentialsError", "PartialCredentialsError", "RefreshError", "DefaultCredentialsError"):
    return 2, DENIED, name
  found = _STATUS_RE.search(text)
  if found:
    word = found.group(1)
    # A bare RESOURCE_EXHAUSTED from a store (no errno: not a disk) is a quota: throttled.
    return 1, _STATUS.get(word, THROTTLED), word
  return None


def classify(e: BaseException) -> Failure | None:
  """The :class:`Failure` behind ``e``: the most specific evidence found in ``e``, its causes and contexts and an
  exception group's members (the outermost first among equals); None if nothing says storage or memory."""
  seen, todo, best = set(), [e], None
  while todo:
    x = todo.pop(0)
    if x is None or id(x) in seen:
      continue
    seen.add(id(x))
    found = _own(x)
    if found is not None and (best is None or found[0] > best[0]):
      best = (found[0], Failure(found[1], x, found[2]))
    todo += [x.__cause__, x.__context__, *getattr(x, "exceptions", ())]
  return best[1] if best else None


def outcome(failure: Failure) -> str:
  """``'user'`` (exit 2), ``'restart'`` (exit 75) or ``'corrupt'`` (the reader's to judge)."""
  if failure.kind in USER_KINDS:
    return "user"
  return "restart" if failure.kind in RESTART_CAUSES else "corrupt"


_FIXES = {
    DENIED: "give this host's credentials access to it (or fix the folder's permissions)",
    MISSING: "check that the path, or the bucket, exists",
    DISK_FULL: "free space there",
    DEVICE_OOM: "lower the memory a step needs (train.microbatches, model.remat, a smaller batch) or use more devices",
    HOST_OOM: "give the host more memory, or lower what it holds (data workers, checkpoint tiers)",
}


def describe(e: BaseException, limit: int = 240) -> str:
  """``Type: message`` on one line; a long message keeps its head and its tail (TensorStore puts the OS error at the
  end of a long one)."""
  text = " ".join(str(e).split())
  if len(text) > limit:
    text = f"{text[:limit // 3]} ... {text[-(limit - limit // 3):]}"
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def error_for(failure: Failure, subject: str, doing: str, intact: str = "") -> Exception:
  """The exception a run stops with for ``failure`` met while ``doing`` (e.g. "saving checkpoint step 6") on
  ``subject`` (a path or URL): a :class:`jaxtrain.errors.UserError` (exit 2) or a :class:`jaxtrain.exits.Restart`
  (exit 75, its cause named). ``intact``: what is known to be intact ("earlier checkpoints are intact"). Not for
  ``corrupt``, which the reader decides about."""
  kind, tail = failure.kind, f"; {intact}" if intact else ""
  if kind in USER_KINDS:
    return UserError(subject, f"{doing} failed: {kind} ({failure.reason}: {describe(failure.error)})",
                     _FIXES[kind] + tail)
  if kind in RESTART_CAUSES:
    what = "the object store did not answer" if kind == UNREACHABLE else (
        "the object store throttled the requests" if kind == THROTTLED else "the storage failed a read or write")
    return exits.Restart(f"{doing} in {subject} failed: {what} ({failure.reason}: {describe(failure.error)})"
                         f"{tail}", cause=RESTART_CAUSES[kind])
  raise ValueError(f"{kind} failures are the reader's to judge")


def reraise(e: BaseException, subject: str, doing: str, intact: str = "") -> None:
  """Raises :func:`error_for` ``e``'s failure (from ``e``) when it is one a run stops with; returns otherwise (a bug,
  or ``corrupt``: the caller's to handle)."""
  failure = classify(e)
  if failure is not None and outcome(failure) != "corrupt":
    raise error_for(failure, subject, doing, intact) from e

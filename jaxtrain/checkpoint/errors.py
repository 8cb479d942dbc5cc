"""What goes wrong with a checkpoint, and how it is told: the user's to fix (:class:`CheckpointError`, one line,
exit 2) or not (:class:`SaveFailed`); an object store that does not answer (:class:`StoreUnreachable`: a restart
cures it, exit 75); a step that reads back wrong (:class:`CorruptCheckpoint`, which the checkpointer falls back
from); a state that must not be written (:class:`NonFiniteState`). Storage failures are
recognized by their OS error or object-store status wherever they hide (:func:`storage_error`)."""

from __future__ import annotations

import errno
import os
import re

from jaxtrain import exits
from jaxtrain.errors import UserError, find_cause


class CheckpointError(UserError):
  """A checkpoint could not be written or read (disk full, permissions, nothing to restore from)."""


class SaveFailed(Exception):
  """A save failed for a reason other than the storage (not the user's to fix: a bug here or in a library).
  Its ``__cause__`` is the original error with its traceback."""


class StoreUnreachable(exits.Restart):
  """The object store holding the checkpoints did not answer (stopped, unreachable, overloaded) within the bounded
  retries of :mod:`jaxtrain.stores`: the run stops restartable (exit 75) and resumes from the newest committed
  checkpoint when the store is back."""


class CorruptCheckpoint(Exception):
  """A checkpoint's data does not match the fingerprints written with it, or holds non-finite values."""


class NonFiniteState(Exception):
  """A state with non-finite values was handed to save(): it is not written."""


# What storage failures say, as OSError (local writes from Python) or inside TensorStore's messages (its
# writes run in C++ and reach us as ValueError text naming the OS error or the object store's status).
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EFBIG, errno.EIO,
                   errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EMFILE, errno.ENFILE, errno.ETIMEDOUT)
_STORAGE_WORDS = tuple(os.strerror(n) for n in _STORAGE_ERRNOS) + (
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "NOT_FOUND", "DEADLINE_EXCEEDED", "UNAVAILABLE")


def storage_error(e: BaseException) -> BaseException | None:
  """The OS or object-store error behind ``e`` (itself, its causes or contexts, an exception group's members),
  or None if the failure did not come from the storage."""
  return find_cause(e, lambda x: isinstance(x, OSError) or bool(_os_error_code(x)) or
                    any(w in str(x) for w in _STORAGE_WORDS))


def _os_error_code(e: BaseException) -> int | None:
  if isinstance(e, OSError) and e.errno:
    return e.errno
  match = re.search(r"os_error_code='?(\d+)", str(e))  # how TensorStore reports the errno
  return int(match.group(1)) if match else None


def storage_reason(e: BaseException) -> str:
  """The storage failure in a few words ("File too large"), first in the message: TensorStore buries it in
  the middle of a long one, which describe() may shorten."""
  code = _os_error_code(e)
  if code:
    return os.strerror(code)
  return next((w for w in _STORAGE_WORDS if w in str(e)), type(e).__name__)


def describe(e: BaseException, limit: int = 240) -> str:
  """``Type: message`` on one line. TensorStore nests the OS error ("File too large", "No space left on
  device") at the end of a long message, so a long one keeps its head and its tail."""
  text = " ".join(str(e).split())
  if len(text) > limit:
    text = f"{text[:limit // 3]} ... {text[-(limit - limit // 3):]}"
  return f"{type(e).__name__}: {text}" if text else type(e).__name__

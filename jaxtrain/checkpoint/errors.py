"""What goes wrong with a checkpoint, and how it is told apart.

- The user's to fix (:class:`CheckpointError`, one line, exit 2): permissions or credentials, a full disk, a path or
  bucket that is not there, a device or host out of memory, a checkpoint of another model.
- A restart cures it (exit 75): an object store that does not answer or throttles (:class:`StoreUnreachable`), a disk
  or network filesystem that failed a read or write (:class:`StorageFailed`: EIO, ESTALE).
- A step whose own bytes are proven bad (:class:`CorruptCheckpoint`): the checkpointer sets it aside and falls back
  to the one before. Only that: a fingerprint mismatch, non-finite values, bytes that do not decode, a committed step
  with files missing (:func:`proven_corrupt`). Every other failure of a restore is raised by its cause, so that a
  store's 403, a 503, an EIO or a device out of memory never costs a readable step.
- Anything else is a bug here or in a library (:class:`SaveFailed` for a save, the error itself for a restore).
- A state that must not be written (:class:`NonFiniteState`).

Storage failures are classified by :func:`jaxtrain.failures.classify` (type, errno, status code) wherever they hide in
an exception's chain; :func:`environment_error` turns one into the exception a run stops with.
"""

from __future__ import annotations

import json
import re

from jaxtrain import exits
from jaxtrain import failures
from jaxtrain.errors import UserError, find_cause

describe = failures.describe


class CheckpointError(UserError):
  """A checkpoint could not be written or read for a reason the user fixes (permissions, a full disk, a missing path,
  out of memory, another model's checkpoint, nothing to restore from)."""


class SaveFailed(Exception):
  """A save failed for a reason other than the storage (not the user's to fix: a bug here or in a library).
  Its ``__cause__`` is the original error with its traceback."""


class StoreUnreachable(exits.Restart):
  """The object store holding the checkpoints did not answer (stopped, unreachable, overloaded, throttling) within
  the bounded retries of :mod:`jaxtrain.stores`: the run stops restartable (exit 75) and resumes from the newest
  committed checkpoint when the store is back."""

  cause = exits.STORE_UNREACHABLE


class StorageFailed(exits.Restart):
  """The disk or network filesystem holding the checkpoints failed a read or write (EIO, ESTALE): the run stops
  restartable (exit 75; the restart budget stops a failure that persists), nothing is set aside."""

  cause = exits.STORAGE_IO


class CorruptCheckpoint(Exception):
  """A checkpoint step's own bytes are bad: its data does not match the fingerprints written with it, holds non-finite
  values, does not decode, or a committed step misses files."""


class NonFiniteState(Exception):
  """A state with non-finite values was handed to save(): it is not written."""


class TierUnavailable(Exception):
  """A tier other than the persistent one cannot be read now (its disk failed a read, or ran out of memory on one
  process): the checkpointer falls back to the other tiers' steps without setting anything aside."""


def environment_error(e: BaseException, subject: str, doing: str, intact: str,
                      reading_committed: bool = False) -> Exception | None:
  """The exception a run stops with when ``e`` is a failure of the storage or the memory, not of the checkpoint's
  bytes nor a bug: :class:`CheckpointError` (exit 2), :class:`StoreUnreachable` or :class:`StorageFailed` (exit 75);
  None otherwise. ``intact``: what is known to be intact, said at the end of the line. ``reading_committed``: a file
  not found is then a committed step's file missing (its bytes are bad), not the environment's."""
  failure = failures.classify(e)
  if failure is None or failures.outcome(failure) == "corrupt" or (
      reading_committed and failure.kind == failures.MISSING):
    return None
  stop = failures.error_for(failure, subject, doing, intact)
  if isinstance(stop, UserError):
    return CheckpointError(stop.subject, stop.problem, stop.fix)
  restart = StorageFailed if failure.kind == failures.IO else StoreUnreachable
  return restart(str(stop))


# What a reader says when bytes do not decode (TensorStore's statuses and messages; Orbax's item lookup), and the
# Python errors of a file that does not parse.
_DECODE_STATUS = re.compile(r"\b(DATA_LOSS|OUT_OF_RANGE)\b")
_DECODE_WORDS = re.compile(r"Truncated|Invalid JSON|[Dd]ecod|[Cc]orrupt|[Cc]hecksum|[Mm]alformed|Unexpected end|"
                           r"not valid for value of size|was not found in the checkpoint")


def proven_corrupt(e: BaseException) -> BaseException | None:
  """The error in ``e``'s chain that proves a step's own bytes bad (a value that does not decode or parse, a truncated
  file, a checksum, an item or file of a committed step missing), or None."""
  return find_cause(e, lambda x: isinstance(x, (CorruptCheckpoint, json.JSONDecodeError, UnicodeDecodeError)) or (
      isinstance(x, (ValueError, KeyError, OSError)) and bool(_DECODE_STATUS.search(str(x)) or
                                                              _DECODE_WORDS.search(str(x)))))


def read_failure(e: BaseException, subject: str, step: int) -> Exception:
  """What a failed read of the committed ``step`` raises: the environment's failure (:func:`environment_error`),
  a :class:`CorruptCheckpoint` when its own bytes are proven bad or a file of it is missing, else ``e`` itself (a
  bug: never a reason to set a readable step aside)."""
  stop = environment_error(e, subject, f"restoring checkpoint step {step}", "nothing was set aside",
                           reading_committed=True)
  if stop is not None:
    return stop
  failure = failures.classify(e)
  bad = proven_corrupt(e) or (failure.error if failure is not None and failure.kind in (
      failures.MISSING, failures.CORRUPT) else None)
  if bad is not None:
    return CorruptCheckpoint(describe(bad))
  return e

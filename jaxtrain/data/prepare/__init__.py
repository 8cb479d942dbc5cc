"""Raw text -> tokenized, de-duplicated, shuffled ArrayRecord shards plus a manifest: :func:`prepare`.

One algorithm (:mod:`.algorithm`: scatter, near duplicates, gather, finalize; its docstring has the record formats
and the manifest), two runners on it: :mod:`.local` (this process; ``workers`` processes) and :mod:`.beam` (an
Apache Beam pipeline, ``runner``: DirectRunner locally, DaskRunner on a Dask cluster, DataflowRunner / FlinkRunner /
SparkRunner at scale). Every decision about a document is a function of its content and the seed, so the output is
the same bytes whatever the runner and worker count. :func:`bundled_corpus` prepares the bundled Shakespeare once
per cache folder.
"""

from __future__ import annotations

import hashlib
import os
import uuid

from etils import epath

from jaxtrain.data.prepare import local
from jaxtrain.data.prepare.algorithm import (FORMAT, FORMAT_PREFERENCE, FORMAT_SFT, FORMATS,  # noqa: F401
                                             MANIFEST, RECORD_FORMATS, TEXT_SPLITS, Options, encoder, finalize,
                                             make_plan)
from jaxtrain import exits
from jaxtrain import failures
from jaxtrain.errors import DataError, UserError

BUNDLED = epath.Path(__file__).parent.parent / "corpus" / "tinyshakespeare.txt"


def _beam_runner(opts: Options):
  """The Beam runner module, its ``runner`` checked. Imported here, not at the top: Apache Beam is an optional
  dependency (extra ``beam``) and slow to import."""
  try:
    from jaxtrain.data.prepare import beam
  except ImportError as e:
    if not (e.name or "").startswith("apache_beam"):
      raise
    raise DataError("--runner", "preparing on a Beam runner needs Apache Beam",
                    "pip install -e '.[beam]', or leave --runner unset to prepare in this process") from None
  beam.check(opts)
  return beam


def prepare(opts: Options) -> dict:
  """Runs the whole preparation and returns the manifest. Raises UserError (DataError) on bad input, having
  written nothing: the output appears complete (manifest last) or not at all. A failure of the storage it reads or
  writes (a disk, a store) is told by its cause (:mod:`jaxtrain.failures`): a UserError for the user's to fix
  (permissions, a full disk, a missing bucket), a :class:`jaxtrain.exits.Restart` for what running it again cures
  (a store that does not answer or throttles, an I/O error)."""
  runner = _beam_runner(opts) if opts.runner else local
  plan = make_plan(opts)
  work, output = epath.Path(plan.work), epath.Path(opts.output)
  try:
    work.mkdir(parents=True)
    try:
      entries = runner.run(plan)
      manifest = finalize(plan, entries)
      _move_into_place(work, output, opts.overwrite)
    finally:
      if work.exists():
        _remove(work)
  except (UserError, exits.Restart):
    raise
  except Exception as e:
    failures.reraise(e, opts.output, "preparing the data", "no half-written output is read (its manifest comes last)")
    raise
  return manifest


def _remove(folder: epath.Path) -> None:
  """Deletes ``folder`` and what it holds, local or on a store, as far as it can."""
  try:
    folder.rmtree(missing_ok=True)
  except OSError:
    pass


def _move_into_place(new: epath.Path, target: epath.Path, overwrite: bool) -> None:
  """Renames the finished ``new`` folder to ``target``. Without ``overwrite`` the rename fails rather than
  replace a non-empty ``target`` (another process may have just finished the same work); with it, the old
  ``target`` is moved aside first and deleted only once the new one is in place. On an object store, where a
  folder's rename is a copy of each object, see :func:`_copy_into_place`."""
  if "://" in os.fspath(target):
    return _copy_into_place(new, target, overwrite)
  old = None
  if overwrite and target.exists():
    old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
    target.rename(old)
  try:
    new.rename(target)
  except OSError:
    if old is not None:
      old.rename(target)
    raise
  if old is not None:
    _remove(old)


def _copy_into_place(new: epath.Path, target: epath.Path, overwrite: bool) -> None:
  """``new``'s files copied into ``target`` on an object store, the manifest last: a reader that finds the
  manifest finds every shard it names (an interrupted copy leaves no manifest, so the folder reads as unprepared).
  Without ``overwrite`` a ``target`` that has a manifest is refused, as a local rename onto a full folder is; with
  it, the old manifest goes first, then the old files."""
  if (target / MANIFEST).exists():
    if not overwrite:
      raise FileExistsError(f"{target} holds a prepared dataset")
    (target / MANIFEST).unlink()
    _remove(target)
  target.mkdir(parents=True, exist_ok=True)
  for f in sorted(new.iterdir(), key=lambda p: (p.name == MANIFEST, p.name)):
    f.copy(target / f.name, overwrite=True)
  _remove(new)


def bundled_corpus(cache_dir: str) -> epath.Path:
  """The bundled Shakespeare corpus, prepared (byte tokens, seed 0) on first use into ``cache_dir``, local or on an
  object store (where the manifest is written last: its presence marks the folder complete)."""
  digest = hashlib.sha256(BUNDLED.read_bytes()).hexdigest()[:12]
  target = epath.Path(os.path.expanduser(cache_dir)) / f"tinyshakespeare-{digest}"
  if not (target / MANIFEST).exists():
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
      prepare(Options(inputs=[os.fspath(BUNDLED)], output=os.fspath(target), eval_fraction=0.05, progress=False))
    except (DataError, OSError):
      if not (target / MANIFEST).exists():  # another process on this host may have won the race
        raise
  return target

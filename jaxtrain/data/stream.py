"""Raw data straight into training (``data.source=raw``): JSONL, Parquet or plain-text files, tokenized inside the
Grain pipeline, with no preparation pass (no de-duplication, no shuffle: give it pre-cleaned, pre-shuffled data).

Records. ``data.path`` (and ``data.eval_path``) is a file, a folder (recursive: .jsonl / .json, .parquet,
.txt / .text / .md) or a glob, local or any URL etils.epath reads (``gs://``). A JSONL record is a non-blank line
(its ``data.field``), a Parquet record a row (column ``data.field``), a text record a paragraph (blank-line
separated, as tools/prepare_data.py splits text). Files are taken in sorted order, records in file order; record
i of that order is document i (its id in batches' ``doc_ids`` and bad-batch reports: file and line).

Index. Every process indexes every file at start: JSONL and text with one vectorised scan for line / paragraph
starts (byte offsets and line numbers), Parquet from its footer (rows per row group; no data read). Grain has no
JSONL source, and its ``ParquetIterDataset`` is sequential (state: row group and row, every column decoded), so
neither gives the random access by document id that the lanes below need: hence the two small readers here (a
record is one slice of a memory-mapped file, or one entry of a cached row group's column).

Order, sharding, position. The B rows of the global batch are B lanes (:mod:`jaxtrain.data.packing`, the packer
of prepared data, unchanged). Lane r streams the r-th contiguous B-th of the training documents, [r N / B,
(r + 1) N / B), in file order, from its start again when it reaches its end (an epoch). A process reads only its
own lanes, rows [p B / P, (p + 1) B / P), i.e. the p-th contiguous P-th of the documents: processes read
disjoint records and, on data of many files, mostly disjoint files. Tokenization runs in the lanes, i.e. in
Grain's worker processes when ``data.num_workers`` > 0. A lane's position is two integers (document and token
offset), saved in checkpoints through :class:`jaxtrain.data.loader.TrainIterator` exactly as for prepared data;
the order depends only on the files and B, so a resumed run reads the same batches, on any number of processes.

Eval. ``data.eval_path``'s records, or else the last ``data.eval_fraction`` of ``data.path``'s (left out of
training); one pass packed in record order (at most ``eval.max_batches`` batches), like prepared data's eval split.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import json
import math
import mmap
import os
import re
import sys

import fsspec
import jax
import numpy as np
from etils import epath

from jaxtrain import paths
from jaxtrain.data import chat as chat_lib
from jaxtrain.data import loader, tokenizers
from jaxtrain.data.source import SOURCES, Documents, Folder, Source
from jaxtrain.errors import ConfigError, DataError

KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text", ".text": "text", ".md": "text"}
_GLOB = re.compile(r"[*?\[]")
_PARAGRAPH_BREAK = re.compile(rb"(?:\r?\n){2,}")


class RecordError(DataError):
  """A bad record (DataError naming file and line) that survives pickling: raised in a Grain worker process,
  it reaches the training process as itself (a plain DataError's pickle would not rebuild: three arguments)."""

  def __reduce__(self):
    return RecordError, (self.subject, self.problem, self.fix)


def _kind(path: str) -> str | None:
  return KINDS.get(os.path.splitext(path)[1].lower())


def list_files(spec: str, key: str = "data.path") -> list[str]:
  """A file, folder (recursive) or glob -> its data files, sorted. ConfigError (naming ``key``) when there are
  none."""
  spec = paths.resolve(spec)
  fix = "point it at a file, folder or glob of .jsonl / .parquet / .txt files"
  if not spec:
    raise ConfigError(key, "is empty (data.source=raw reads raw files from it)", fix)
  if _GLOB.search(spec):
    parts = spec.split("/")
    first = next(i for i, p in enumerate(parts) if _GLOB.search(p))
    base, pattern = "/".join(parts[:first]) or "/", "/".join(parts[first:])
    try:
      found = [os.fspath(p) for p in epath.Path(base).glob(pattern)]
    except (OSError, ValueError):
      found = []
    files = sorted(f for f in found if _kind(f) and epath.Path(f).is_file())
    if not files:
      raise ConfigError(key, f"{spec}: the glob matches no .jsonl / .json / .parquet / .txt / .text / .md files",
                        "check the pattern")
    return files
  root = epath.Path(spec)
  if not root.exists():
    raise ConfigError(key, f"{spec}: no such file or folder", fix)
  if not root.is_dir():
    if not _kind(spec):
      raise ConfigError(key, f"{spec}: unknown file type (not .jsonl / .json / .parquet / .txt / .text / .md)",
                        "rename it to the suffix of its format")
    return [spec]
  files = sorted(f for f in _walk(root) if _kind(f))
  if not files:
    raise ConfigError(key, f"{spec}: the folder holds no .jsonl / .json / .parquet / .txt / .text / .md files", fix)
  return files


def _walk(folder: epath.Path) -> list[str]:
  """Every file under ``folder`` (epath has no recursive glob on GCS: one listing per folder)."""
  out = []
  for p in folder.iterdir():
    if p.is_dir():
      out += _walk(p)
    else:
      out.append(os.fspath(p))
  return out


# ---------------------------------------------------------------------------------------------------- index


@dataclasses.dataclass
class _File:
  """One file's records. JSONL / text: byte spans [starts, ends) and 1-based line numbers; Parquet:
  ``row_groups`` (cumulative row count at each row group's end)."""
  path: str
  kind: str
  starts: np.ndarray | None = None
  ends: np.ndarray | None = None
  lines: np.ndarray | None = None
  row_groups: np.ndarray | None = None

  @property
  def count(self) -> int:
    return int(self.row_groups[-1]) if self.kind == "parquet" else len(self.starts)


def _open_url(url: str):
  """A file on an object store, for the lanes' reads: each lane reads its own stretch of a file forward, so the reads
  of one batch jump between up to ``global_batch`` places. An LRU of blocks keeps each lane's current block (a
  readahead cache of one block, the clients' default, refetches at every jump: gcsfs streamed 100x slower than from
  local disk)."""
  fs, path = fsspec.core.url_to_fs(url)
  return fs.open(path, "rb", block_size=_BLOCK, cache_type="blockcache", cache_options={"maxblocks": _BLOCKS})


_BLOCK, _BLOCKS = 2 << 20, 32  # per open file: at most 64 MB cached


def _parquet(path: str):
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise RecordError(path, "reading Parquet needs pyarrow", "pip install pyarrow") from None
  try:
    return pq.ParquetFile(path if not paths.is_url(path) else epath.Path(path).open("rb"))
  except Exception as e:  # noqa: BLE001 - pyarrow's errors have no common base
    raise RecordError(path, f"not a readable Parquet file ({str(e)[:100]})", "check the file") from None


def _index_file(path: str, kind: str, field: str) -> _File:
  if kind == "parquet":
    f = _parquet(path)
    if field not in f.schema_arrow.names:
      raise DataError(path, f"no column '{field}' (columns: {', '.join(f.schema_arrow.names)})",
                      "set data.field to the text column")
    rows = [f.metadata.row_group(i).num_rows for i in range(f.metadata.num_row_groups)]
    return _File(path, kind, row_groups=np.cumsum(np.asarray(rows or [0], np.int64)))
  data = epath.Path(path).read_bytes()
  newlines = np.flatnonzero(np.frombuffer(data, np.uint8) == 10)
  if kind == "jsonl":  # one record per line
    starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
    ends = np.concatenate([newlines, [len(data)]]).astype(np.int64)
    lines = np.arange(1, len(starts) + 1, dtype=np.int64)
  else:  # paragraphs: runs of text between blank lines
    spans = [0] + [x for m in _PARAGRAPH_BREAK.finditer(data) for x in m.span()] + [len(data)]
    starts, ends = np.asarray(spans[0::2], np.int64), np.asarray(spans[1::2], np.int64)
    lines = np.searchsorted(newlines, starts) + 1
  keep = ends > starts
  # Blank lines / whitespace-only paragraphs hold no document (tools/prepare_data.py skips them too). Only
  # short spans can be blank lines in practice; a long whitespace-only text paragraph is checked as well.
  for i in np.flatnonzero(keep & ((ends - starts <= 8) | (kind == "text"))):
    if not data[starts[i]:ends[i]].strip():
      keep[i] = False
  return _File(path, kind, starts[keep], ends[keep], lines[keep])


@dataclasses.dataclass
class Index:
  """The records of a list of files, numbered in file order."""
  files: list[_File]
  bounds: np.ndarray  # bounds[i]: first document id of files[i]; bounds[-1]: the total

  def __len__(self) -> int:
    return int(self.bounds[-1])

  def locate(self, doc_id: int) -> tuple[int, int]:
    """Document id -> (file number, record number in that file)."""
    f = int(np.searchsorted(self.bounds, doc_id, side="right")) - 1
    return f, doc_id - int(self.bounds[f])

  def where(self, doc_id: int) -> str:
    """``file:line`` (JSONL, text) or ``file:row N`` (Parquet) of a document."""
    f, i = self.locate(doc_id)
    file = self.files[f]
    return f"{file.path}:row {i}" if file.kind == "parquet" else f"{file.path}:{int(file.lines[i])}"


def build_index(spec: str, field: str, key: str = "data.path") -> Index:
  """The index of ``spec``'s files (cached per process: validation, training, eval and bad-batch reports share
  it). Files are indexed in parallel threads (numpy's scans and file reads release the GIL)."""
  return _build_index(paths.resolve(spec), field, key)


@functools.lru_cache(maxsize=8)
def _build_index(spec: str, field: str, key: str) -> Index:
  files = list_files(spec, key)
  with concurrent.futures.ThreadPoolExecutor(min(8, len(files))) as pool:
    indexed = list(pool.map(lambda f: _index_file(f, _kind(f), field), files))
  bounds = np.concatenate([[0], np.cumsum([f.count for f in indexed])]).astype(np.int64)
  if bounds[-1] == 0:
    raise DataError(spec, "the files hold no records (all empty or blank)", "point data.path at non-empty files")
  if bounds[-1] >= 2**31:
    raise DataError(spec, f"{bounds[-1]} records: more than the 2^31 document ids of a batch's doc_ids",
                    "split the data into runs of fewer records")
  return Index(indexed, bounds)


# --------------------------------------------------------------------------------------------------- source


class RawSource:
  """Random access to documents ``[first, first + size)`` of an :class:`Index`: ``source[i]`` is document
  ``first + i``'s token ids (int32 [n]), read and tokenized on demand. Picklable (for Grain's worker processes):
  open files and cached row groups stay behind. Raises DataError naming the file and line of a bad record."""

  def __init__(self, index: Index, field: str, tokenizer: str, first: int = 0, size: int | None = None,
               cached_row_groups: int = 64):
    self.index, self.field, self.tokenizer = index, field, tokenizer
    self.first, self.size = first, len(index) - first if size is None else size
    self.cached_row_groups = cached_row_groups
    self._reset()

  def _reset(self) -> None:
    self._maps: dict[int, object] = {}  # file number -> mmap (local) or open file (URL)
    self._row_groups: collections.OrderedDict = collections.OrderedDict()  # (file, row group) -> texts (LRU)
    self._tokenizer = None

  def __getstate__(self) -> dict:
    state = dict(self.__dict__)
    for k in ("_maps", "_row_groups", "_tokenizer"):
      state.pop(k)
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._reset()

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, i: int) -> np.ndarray:
    if self._tokenizer is None:
      self._tokenizer = tokenizers.load(self.tokenizer)
    return self._tokenizer.encode(self.text(self.first + int(i)))

  def where(self, i: int) -> str:
    """Document ``i``'s ``file:line`` (``file:row N``: Parquet), for errors that name it."""
    return self.index.where(self.first + int(i))

  def text(self, doc_id: int) -> str:
    """Document ``doc_id``'s text (by its id in the index, not in this source)."""
    f, i = self.index.locate(doc_id)
    file = self.index.files[f]
    if file.kind == "parquet":
      return self._parquet_text(f, file, i)
    raw = self._bytes(f, file, int(file.starts[i]), int(file.ends[i]))
    where = f"{file.path}:{int(file.lines[i])}"
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise RecordError(where, f"not valid UTF-8 (byte {e.start} of the record: {raw[e.start:e.start + 4]!r})",
                      "convert the file to UTF-8 (e.g. iconv -t UTF-8)") from None
    if file.kind == "text":
      return text.replace("\r\n", "\n").strip("\n")
    try:
      obj = json.loads(text)
    except json.JSONDecodeError as e:
      raise RecordError(where, f"not a JSON line ({e.msg})", "fix or remove the line") from None
    if not isinstance(obj, dict) or self.field not in obj:
      has = f"its fields: {', '.join(map(str, obj))}" if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
      chat_field = chat_lib.messages_field(obj)
      raise RecordError(where, f"no field '{self.field}' ({has})", "set data.field, or fix or remove the line"
                        if not chat_field else f"its '{chat_field}' holds chat messages, SFT data: prepare it with "
                        f"tools/prepare_data.py --messages_field={chat_field} and train on that folder")
    value = obj[self.field]
    return str(value) if value else ""

  def _bytes(self, f: int, file: _File, start: int, end: int) -> bytes:
    handle = self._maps.get(f)
    if handle is None:
      if paths.is_url(file.path):
        handle = _open_url(file.path)
      else:
        with open(file.path, "rb") as fd:
          handle = mmap.mmap(fd.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(fd.fileno()).st_size else b""
      self._maps[f] = handle
    if isinstance(handle, (mmap.mmap, bytes)):
      return handle[start:end]
    handle.seek(start)
    return handle.read(end - start)

  def _parquet_text(self, f: int, file: _File, row: int) -> str:
    group = int(np.searchsorted(file.row_groups, row, side="right"))
    texts = self._row_groups.get((f, group))
    if texts is None:
      table = _parquet(file.path).read_row_group(group, columns=[self.field])
      texts = table.column(0).to_pylist()
      self._row_groups[(f, group)] = texts
      if len(self._row_groups) > self.cached_row_groups:
        self._row_groups.popitem(last=False)
    else:
      self._row_groups.move_to_end((f, group))
    value = texts[row - (int(file.row_groups[group - 1]) if group else 0)]
    if value is not None and not isinstance(value, str):
      raise RecordError(f"{file.path}:row {row}", f"column '{self.field}' holds {type(value).__name__}, not text",
                      "set data.field to a string column")
    return value or ""


class LaneOrder:
  """The document order :class:`jaxtrain.data.packing.PackedLanes` reads (lane r takes positions r, r + B, ...):
  here lane r's k-th document is ``start_r + k mod size_r`` of its contiguous share [start_r, start_r + size_r)
  = [r N / B, (r + 1) N / B). Endless (like a repeated Grain MapDataset); two integers per lane of state stay
  PackedLanes'."""

  def __init__(self, num_docs: int, num_lanes: int):
    if num_docs < num_lanes:
      raise ValueError(f"{num_docs} documents for {num_lanes} lanes")
    self.num_docs, self.num_lanes = num_docs, num_lanes

  def __len__(self) -> int:
    return sys.maxsize  # endless: PackedLanes treats a length >= 2**62 as a repeated stream

  def __getitem__(self, position: int) -> int:
    lane, k = position % self.num_lanes, position // self.num_lanes
    start = lane * self.num_docs // self.num_lanes
    return start + k % ((lane + 1) * self.num_docs // self.num_lanes - start)

  def lane_range(self, lane: int) -> range:
    return range(lane * self.num_docs // self.num_lanes, (lane + 1) * self.num_docs // self.num_lanes)


# ------------------------------------------------------------------------------------------------- the source


def _splits(c) -> tuple[Index, int, Index | None, int, int]:
  """(train index, train documents, eval index, first eval document, eval documents)."""
  train = build_index(c.data.path, c.data.field)
  if c.data.eval_path:
    evals = build_index(c.data.eval_path, c.data.field, "data.eval_path")
    return train, len(train), evals, 0, len(evals)
  held_out = math.ceil(len(train) * c.data.eval_fraction) if c.data.eval_fraction else 0
  return train, len(train) - held_out, (train if held_out else None), len(train) - held_out, held_out


def check(c) -> None:
  """Config-time checks (before anything compiles), each one ConfigError line: the files exist, their first
  record has ``data.field``, the tokenizer fits the model, enough training records for the batch's lanes, an eval
  split when ``eval.every_steps`` asks for one."""
  if not 0 <= c.data.eval_fraction < 1:
    raise ConfigError("data.eval_fraction", f"{c.data.eval_fraction} is not in [0, 1)", "use e.g. 0.01 (or 0)")
  for key in ("data.path",) + (("data.eval_path",) if c.data.eval_path else ()):
    spec = c.data.path if key == "data.path" else c.data.eval_path
    files = list_files(spec, key)
    _check_field(files[0], c.data.field)
  _check_tokenizer(c)
  _, num_train, _, _, num_eval = _splits(c)
  if num_train < c.train.global_batch_size:
    raise ConfigError("data.path", f"{num_train} training records, fewer than the {c.train.global_batch_size} "
                      "rows of train.global_batch_size (each row streams its own share of the records)",
                      "use more data or a smaller global batch")
  if c.eval.every_steps and not num_eval and not c.eval.sets:
    raise ConfigError("eval.every_steps", "is set but data.source=raw has no eval split",
                      "set data.eval_path, or data.eval_fraction > 0 to hold out the last records of data.path")


def checked_index(spec: str, field: str, key: str) -> Index:
  """The index of ``spec``'s records after the config-time checks of :func:`check` that concern one path (files
  there, ``field`` in the first record); errors name ``key``."""
  _check_field(list_files(spec, key)[0], field)
  return build_index(spec, field, key)


def _check_field(path: str, field: str) -> None:
  """``field`` must be in the first record of a JSONL file / the columns of a Parquet file."""
  kind = _kind(path)
  if kind == "text":
    return
  if kind == "parquet":
    names = _parquet(path).schema_arrow.names
    if field not in names:
      raise ConfigError("data.field", f"'{field}' is not a column of {path} (columns: {', '.join(names)})",
                        "set data.field to the text column")
    return
  with epath.Path(path).open("rb") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}:{number}", f"not a JSON line ({str(e)[:80]})", "fix or remove the line") from None
      if not isinstance(obj, dict) or field not in obj:
        has = ", ".join(map(str, obj)) if isinstance(obj, dict) else f"a JSON {type(obj).__name__}"
        raise ConfigError("data.field", f"'{field}' is not a field of {path}:{number} (fields: {has})",
                          "set data.field to the text field")
      return


def train_dataset(c, process_index: int, process_count: int):
  """This process's share of the endless stream of packed training batches."""
  index, num_train, *_ = _splits(c)
  lanes = c.train.global_batch_size
  per_process = lanes // process_count
  source = RawSource(index, c.data.field, c.data.tokenizer, 0, num_train,
                     cached_row_groups=2 * per_process + 8)
  return loader.lanes_dataset(LaneOrder(num_train, lanes), source, seq_len=c.data.seq_len, global_batch=lanes,
                              process_index=process_index, process_count=process_count, packing=c.data.packing,
                              num_workers=c.data.num_workers, prefetch=c.data.prefetch)


def open_train(c):
  check(c)
  dataset = train_dataset(c, jax.process_index(), jax.process_count())
  return loader.TrainIterator(dataset, c.train.global_batch_size, jax.process_index(), jax.process_count())


def eval_batches(c, process_index: int, process_count: int) -> list[dict]:
  _, _, index, first, size = _splits(c)
  if not size:
    return []
  source = RawSource(index, c.data.field, c.data.tokenizer, first, size)
  batches = loader.packed_eval_batches(source, size, seq_len=c.data.seq_len, global_batch=c.train.global_batch_size,
                                       process_index=process_index, process_count=process_count,
                                       max_batches=c.eval.max_batches)
  for b in batches:  # ids in the index, like training's
    b["doc_ids"] = np.where(b["doc_ids"] >= 0, b["doc_ids"] + first, -1)
  return batches


def open_eval(c) -> list[dict]:
  return eval_batches(c, jax.process_index(), jax.process_count())


def provenance(c, step: int, doc_ids) -> dict:
  del step
  if doc_ids is None:
    return {"source": "unknown"}
  index = build_index(c.data.path, c.data.field)
  ids = sorted({int(d) for d in np.unique(doc_ids) if d >= 0})
  return {"data": c.data.path, "documents": ids, "records": [index.where(d) for d in ids]}


def document(c, split: str, doc: int | None) -> tuple[str, str]:
  files = c.data.eval_path if split == "eval" and c.data.eval_path else c.data.path
  return (build_index(files, c.data.field).where(doc) if doc is not None else files), FIX


def lane_documents(c, lane: int) -> range:
  """The document ids lane ``lane`` streams (one epoch), for tests and tools."""
  _, num_train, *_ = _splits(c)
  return LaneOrder(num_train, c.train.global_batch_size).lane_range(lane)


# --------------------------------------------------------------------------------- raw records as documents


def _check_tokenizer(c):
  """``data.tokenizer``, loaded; ConfigError if its vocabulary does not fit the model."""
  tokenizer = tokenizers.load(c.data.tokenizer)
  if tokenizer.vocab_size > c.model.vocab_size:
    raise ConfigError("data.tokenizer", f"{tokenizer.name} has {tokenizer.vocab_size} tokens but "
                      f"model.vocab_size={c.model.vocab_size}", f"set model.vocab_size >= {tokenizer.vocab_size}")
  return tokenizer


def open_folder(name: str, path: str, c, key: str, whole: bool = False, verify: bool = True) -> Folder:
  """Raw records at ``path`` (a mixture's component: its last ``data.eval_fraction`` held out; an eval set:
  every record), read with ``data.field`` and ``data.tokenizer``."""
  del verify  # (no checksums)
  index = checked_index(path, c.data.field, key)
  tokenizer = _check_tokenizer(c)
  n = len(index)
  held = n if whole else (math.ceil(n * c.data.eval_fraction) if c.data.eval_fraction else 0)
  train = RawSource(index, c.data.field, c.data.tokenizer, 0, n - held, cached_row_groups=64)
  held_out = RawSource(index, c.data.field, c.data.tokenizer, n - held, held) if held else None

  def order(c, lanes: int) -> LaneOrder:
    """Lane r streams the r-th contiguous B-th of the records, as ``data.source=raw`` does."""
    if n - held < lanes:
      raise ConfigError(f"data.mixture ({name})", f"{n - held} training records, fewer than the {lanes} rows of "
                        "train.global_batch_size (each row streams its own share)",
                        "use more data or a smaller global batch")
    return LaneOrder(n - held, lanes)

  return Folder(name, path, "raw", tokenizer.name, False, train, n - held, held_out, held, order=order,
                locate=index.where, fix=FIX)


FIX = "set data.tokenizer to the model's tokenizer"
SOURCES.register("raw", Source(
    open_train, open_eval, provenance, validate=check, reads=("field", "eval_path", "eval_fraction"),
    tokenizer=lambda c: c.data.tokenizer or "byte", document=document,
    documents=Documents(open=open_folder, check=lambda path, c, key: checked_index(path, c.data.field, key),
                        has_held_out=lambda path, c: c.data.eval_fraction > 0, fallback=True, reads=("field",),
                        tokenizer=lambda path, c: c.data.tokenizer or "byte")))

"""Raw text -> tokenized, de-duplicated, shuffled ArrayRecord shards plus a manifest.

Inputs are text files (documents separated by blank lines, or one per file), JSONL (one document per line,
a named field), Parquet (a named column), folders (recursively) and globs, local or ``gs://``.

The algorithm, which the runners (:mod:`.local`: this process and ``workers`` processes; :mod:`.beam`: an Apache
Beam pipeline) execute; :mod:`jaxtrain.data.prepare` picks one and finalizes. Every decision about a document is a function of its content and the seed (:mod:`.dedup`), so the output is the
same bytes whatever the executor, runner and worker count. Memory is bounded by a shard, not by the input:

1. **scatter** (:func:`scatter`, per input file, streaming): read, tokenize, digest (SHA-256); route by a seeded
   hash of the digest to a split (eval when its uniform draw is below ``eval_fraction``), an order key and a
   bucket (a range of keys; about ``shard_mib`` MiB of input each); append to a temporary part of the bucket.
2. **near duplicates** (optional, ``near_dup_threshold``): MinHash LSH band keys per document; in each group of
   documents sharing a band key, all but the smallest key are removed.
3. **gather** (:func:`gather`, per bucket): the bucket's parts, exact duplicates (same digest: always in the same
   bucket, so no worker holds every hash) and near duplicates removed and counted, sorted by key (the global
   shuffle), written as one shard.
4. **finalize** (:func:`finalize`): shards numbered in key order, ``manifest.json`` written last into a
   temporary sibling folder that is then renamed into place: no half-written output ever looks valid.

Pretraining data (``format: "jaxtrain.tokens.v1"``): each record is one document, its n token ids as
little-endian ``uint16`` (``uint32`` when the vocabulary needs it), n x itemsize bytes.

Supervised fine-tuning data (``--format=sft``, or auto-detected: JSONL of prompt/response pairs or chats, see
:mod:`jaxtrain.data.chat`; manifest ``format: "jaxtrain.sft.v1"`` and ``loss_mask: true``): each record is one
example, its n token ids as above followed by n ``uint8`` trained flags (1: an assistant / response token, whose
prediction is trained; 0: prompt, system, template), n x (itemsize + 1) bytes. The manifest adds
``trained_tokens`` (in total, per split and per shard) and ``sft`` (``template``: ``"chat_template"`` or
``"plain"``, the template's SHA-256, the field names). Exact duplicates are found on the record's messages.

Preference data (``--format=preference``, or auto-detected: JSONL records with ``chosen`` and ``rejected``, see
:mod:`jaxtrain.data.pairs`; manifest ``format: "jaxtrain.preference.v1"`` and ``loss_mask: true``): each record is
one pair, both sides' token ids then one uint8 flag per token (trained, which side, truncated), laid out as SFT
records; pairs longer than ``seq_len + 1`` tokens are cut from the prompt's left or dropped, counted in the
manifest's ``preference`` (``seq_len``, ``truncated``, ``dropped``, the template). Exact duplicates are found on
the pair's messages.

``manifest.json`` lists per split the shards with their document and token counts, bytes and SHA-256, and the
exact and near duplicates removed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import glob
import hashlib
import itertools
import json
import math
import os
import shutil
import struct
import tempfile
import uuid
from typing import Iterator, Sequence

import numpy as np
from etils import epath

import jaxtrain
from jaxtrain import failures
from jaxtrain.errors import DataError
from jaxtrain.data import chat, dedup, pairs, tokenizers

MANIFEST = "manifest.json"
FORMAT = "jaxtrain.tokens.v1"  # records: token ids
FORMAT_SFT = "jaxtrain.sft.v1"  # records: token ids, then one uint8 trained flag per token
FORMAT_PREFERENCE = "jaxtrain.preference.v1"  # records: a pair's token ids, then one uint8 flag per token
FORMATS = ("auto", "text", "sft", "preference")
MASKED = ("sft", "preference")  # formats whose records carry per-token flags
RECORD_FORMATS = (FORMAT, FORMAT_SFT, FORMAT_PREFERENCE)
TEXT_SPLITS = ("paragraph", "file")
_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".parquet")


@dataclasses.dataclass(frozen=True)
class Options:
  inputs: Sequence[str]
  output: str
  tokenizer: str = "byte"
  field: str = "text"
  seed: int = 0
  eval_fraction: float = 0.01
  text_split: str = "paragraph"
  shard_mib: float = 128.0
  workers: int = 0
  overwrite: bool = False
  progress: bool = True
  format: str = "auto"  # auto | text | sft | preference (auto: from the first JSONL record's fields)
  seq_len: int = 0  # preference: the training data.seq_len (longer pairs are truncated or dropped)
  prompt_field: str = "prompt"
  response_field: str = "response"
  messages_field: str = "messages"
  chat_template: str = ""  # a jinja file: overrides the tokenizer's chat template ("" = the tokenizer's, if any)
  near_dup_threshold: float = 0.0  # > 0: remove near duplicates (MinHash LSH) at this Jaccard similarity
  near_dup_ngram: int = 5  # words per shingle
  near_dup_perm: int = 128  # MinHash permutations
  runner: str = ""  # "": in this process; else an Apache Beam runner (DirectRunner, DataflowRunner, ...)
  pipeline_options: Sequence[str] = ()  # passed to Beam's PipelineOptions (e.g. --project=..., --region=...)

  @property
  def fields(self) -> chat.Fields:
    return chat.Fields(self.prompt_field, self.response_field, self.messages_field)


def expand_inputs(inputs: Sequence[str]) -> list[str]:
  """Paths, folders (recursive, known suffixes) and globs -> sorted, de-duplicated file list."""
  files = []
  for spec in inputs:
    if "://" in spec:  # gs:// and the other etils.epath file systems
      files += _expand_remote(spec)
    elif any(c in spec for c in "*?["):
      matches = sorted(glob.glob(spec, recursive=True))
      if not matches:
        raise DataError(spec, "the glob matches no files", "check the pattern")
      files += [m for m in matches if os.path.isfile(m)]
    elif os.path.isdir(spec):
      found = sorted(os.path.join(root, f) for root, _, names in os.walk(spec) for f in names
                     if f.endswith(_SUFFIXES))
      if not found:
        raise DataError(spec, "the folder holds no input files", f"put {', '.join(_SUFFIXES)} files in it")
      files += found
    elif os.path.isfile(spec):
      files.append(spec)
    else:
      raise DataError(spec, "no such file or folder", "check the --input path")
  return list(dict.fromkeys(files))


def _expand_remote(spec: str) -> list[str]:
  parts = spec.split("/")
  first_glob = next((i for i, p in enumerate(parts) if any(c in p for c in "*?[")), None)
  if first_glob is not None:
    found = sorted(os.fspath(p) for p in epath.Path("/".join(parts[:first_glob])).glob("/".join(parts[first_glob:]))
                   if p.is_file())
    if not found:
      raise DataError(spec, "the glob matches no files", "check the pattern")
    return found
  path = epath.Path(spec)
  if path.is_dir():
    found = sorted(os.fspath(p) for p in _files_under(path) if p.name.endswith(_SUFFIXES))
    if not found:
      raise DataError(spec, "the folder holds no input files", f"put {', '.join(_SUFFIXES)} files in it")
    return found
  if path.exists():
    return [spec]
  raise DataError(spec, "no such file or folder", "check the --input path")


def _files_under(folder: epath.Path) -> Iterator[epath.Path]:
  """Every file below ``folder`` on a store, listed folder by folder (etils refuses ``rglob`` on object stores, and
  its ``walk`` passes s3fs an option it does not take)."""
  for p in folder.iterdir():
    if p.is_dir():
      yield from _files_under(p)
    else:
      yield p


def _lines(path: str) -> Iterator[tuple[int, str]]:
  """(line number, line) of a UTF-8 file, streaming. Split on b'\\n' only: U+2028 may sit inside a JSON string."""
  with epath.Path(path).open("rb") as f:
    for i, raw in enumerate(f, 1):
      try:
        yield i, raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise DataError(f"{path}:{i}", f"not valid UTF-8 (byte {e.start} of the line: {raw[e.start:e.start + 4]!r})",
                        "convert the file to UTF-8 (e.g. iconv -t UTF-8)") from None


def _json_lines(path: str) -> Iterator[tuple[int, object]]:
  """(line number, parsed object) of every non-empty line of a JSONL file, streaming."""
  for i, line in _lines(path):
    if not line.strip():
      continue
    try:
      yield i, json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{i}", f"not a JSON line ({e.msg})", "fix or remove the line") from None


def read_documents(path: str, field: str, text_split: str, messages: str = "messages") -> Iterator[str]:
  """The documents of one input file, in file order, streaming (a Parquet row group, a line or a paragraph at
  a time; the whole file only for ``text_split='file'``). ``messages``: the SFT messages field (--messages_field),
  for the hint of a chat record read as text."""
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise DataError(path, "reading Parquet needs pyarrow", "pip install pyarrow") from None
    try:
      table = pq.ParquetFile(epath.Path(path).open("rb"))
    except Exception as e:
      raise DataError(path, f"not a readable Parquet file ({str(e)[:100]})", "check the file") from None
    if field not in table.schema_arrow.names:
      raise DataError(path, f"no column '{field}' (columns: {', '.join(table.schema_arrow.names)})",
                      "pass --field=COLUMN")
    for batch in table.iter_batches(columns=[field], batch_size=1024):
      yield from (d for d in batch.column(0).to_pylist() if d)
  elif path.endswith((".jsonl", ".json")):
    for i, obj in _json_lines(path):
      if not isinstance(obj, dict) or field not in obj:
        chat_field = chat.messages_field(obj)
        fix = ("pass --field=NAME naming the text field (SFT data: --prompt_field and --response_field, or "
               "--messages_field)")
        if chat_field:
          fix = f"its '{chat_field}' holds chat messages: for SFT chat data pass --format=sft" + (
              f" --messages_field={chat_field}" if chat_field != messages else "")
        raise DataError(f"{path}:{i}", f"no field '{field}' ({chat.fields_of(obj)})", fix)
      if obj[field]:
        yield str(obj[field])
  elif text_split == "file":
    text = "".join(line for _, line in _lines(path))
    if text.strip():
      yield text
  else:  # paragraphs: separated by empty lines
    paragraph = []
    for _, line in itertools.chain(_lines(path), [(0, "\n")]):
      line = line.removesuffix("\n").removesuffix("\r")
      if line:
        paragraph.append(line)
      elif paragraph:
        text, paragraph = "\n".join(paragraph), []
        if text.strip():
          yield text


def _with_fields(e: Exception, obj) -> str:
  """A record's problem with the fields it has (``... (its fields: a, b)``)."""
  problem = str(e)
  return f"{problem}, {chat.fields_of(obj)}" if problem.endswith(")") else f"{problem} ({chat.fields_of(obj)})"


def read_sft_records(path: str, fields: chat.Fields) -> Iterator[tuple[int, list[dict]]]:
  """(line number, messages) of every record of one SFT JSONL file, in file order, streaming."""
  if not path.endswith((".jsonl", ".json")):
    raise DataError(path, "SFT input must be JSONL (one prompt/response pair or chat per line)",
                    "convert it to .jsonl, or pass --format=text for pretraining text")
  for i, obj in _json_lines(path):
    try:
      yield i, chat.parse(obj, fields)
    except chat.RecordError as e:
      if chat.is_sft_object(obj, fields):
        raise DataError(f"{path}:{i}", str(e), "fix or remove the line") from None
      chat_field = chat.messages_field(obj)
      raise DataError(f"{path}:{i}", _with_fields(e, obj),
                      f"its '{chat_field}' holds chat messages: pass --messages_field={chat_field}" if chat_field else
                      "pass --prompt_field and --response_field (a pair) or --messages_field (a chat) naming its "
                      "fields, or fix or remove the line") from None


def read_pair_records(path: str, fields: chat.Fields) -> Iterator[tuple[int, tuple[list[dict], list[dict]]]]:
  """(line number, (chosen messages, rejected messages)) of every record of one preference JSONL file, streaming."""
  if not path.endswith((".jsonl", ".json")):
    raise DataError(path, "preference input must be JSONL (one chosen/rejected pair per line)",
                    "convert it to .jsonl")
  for i, obj in _json_lines(path):
    try:
      yield i, pairs.parse(obj, fields)
    except chat.RecordError as e:
      missing = str(e).startswith("no field")
      raise DataError(f"{path}:{i}", _with_fields(e, obj) if missing else str(e),
                      f"fix or remove the line (fields: '{fields.prompt}' (--prompt_field) + 'chosen' + 'rejected' "
                      "strings, or 'chosen' and 'rejected' chats; see jaxtrain/data/pairs.py)") from None


def detect_format(files: list[str], fields: chat.Fields) -> str:
  """'preference' when the first record of the first JSONL input has 'chosen' and 'rejected', 'sft' when it is a
  chat or a prompt/response pair, else 'text'."""
  for path in files:
    if path.endswith((".jsonl", ".json")):
      for _, obj in _json_lines(path):
        if pairs.is_pair_object(obj):
          return "preference"
        return "sft" if chat.is_sft_object(obj, fields) else "text"
  return "text"


@functools.cache
def encoder(tokenizer_spec: str, template_file: str) -> chat.Encoder:
  tokenizer = tokenizers.load(tokenizer_spec)
  source = epath.Path(template_file).read_text() if template_file else tokenizer.chat_template
  try:
    template = chat.ChatTemplate(source, tokenizer.special_tokens) if source else None
    return chat.Encoder(tokenizer, template)
  except ImportError as e:
    raise DataError(template_file or tokenizer_spec, f"chat templates need the '{e.name}' package",
                    f"pip install {e.name}") from None
  except Exception as e:  # jinja2 rejected the template, or the tokenizer cannot give offsets
    raise DataError(template_file or tokenizer_spec, f"unusable chat template ({type(e).__name__}: "
                    f"{str(e)[:160]})", "fix the template or pass --chat_template=FILE") from None


def _documents(path: str, opts: Options) -> Iterator[tuple[bytes, np.ndarray, "np.ndarray | None", str]]:
  """(digest, token ids, trained flags (SFT, preference) or None, text for near-duplicate search) of each document
  of one input file, streaming."""
  if opts.format == "preference":
    enc = encoder(opts.tokenizer, opts.chat_template)
    for line, (chosen, rejected) in read_pair_records(path, opts.fields):
      try:
        tokens, flags = pairs.encode(enc, chosen, rejected, opts.seq_len)
      except chat.RecordError as e:
        raise DataError(f"{path}:{line}", str(e), "fix or remove the line") from None
      yield pairs.digest(chosen, rejected), tokens, flags, pairs.text(chosen, rejected)
  elif opts.format == "sft":
    enc = encoder(opts.tokenizer, opts.chat_template)
    for line, messages in read_sft_records(path, opts.fields):
      try:
        tokens, trained = enc.encode(messages)
      except chat.RecordError as e:
        raise DataError(f"{path}:{line}", str(e), "fix or remove the line") from None
      yield chat.digest(messages), tokens, trained, "\n".join(str(m.get("content") or "") for m in messages)
  else:
    tokenizer = tokenizers.load(opts.tokenizer)
    for text in read_documents(path, opts.field, opts.text_split, opts.messages_field):
      yield hashlib.sha256(text.encode("utf-8")).digest(), tokenizer.encode(text), None, text


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a worker needs, fixed before any document is read (picklable: it travels to workers)."""
  opts: Options  # with the format resolved
  files: tuple[str, ...]
  buckets: dict  # split -> number of buckets (= shards at most) of that split
  dtype: str  # of the token ids in the records
  work: str  # the temporary output folder, renamed into place when complete

  def part(self, split: str, bucket: int, index: int, chunk: int) -> epath.Path:
    return epath.Path(self.work) / "scatter" / f"{split}-{bucket:05d}" / f"{index:06d}-{chunk:04d}.bin"


def make_plan(opts: Options) -> Plan:
  """Checks the options and inputs (raises UserError, writes nothing) and sizes the buckets: about
  ``shard_mib`` MiB of input per shard, from the input files' sizes."""
  if opts.text_split not in TEXT_SPLITS:
    raise DataError("--text_split", f"'{opts.text_split}' is not one of {', '.join(TEXT_SPLITS)}", "fix it")
  if not 0 <= opts.eval_fraction < 1:
    raise DataError("--eval_fraction", f"{opts.eval_fraction} is not in [0, 1)", "use e.g. 0.01")
  if opts.format not in FORMATS:
    raise DataError("--format", f"'{opts.format}' is not one of {', '.join(FORMATS)}", "fix it")
  if not 0 <= opts.near_dup_threshold < 1:
    raise DataError("--near_dup_threshold", f"{opts.near_dup_threshold} is not in [0, 1)",
                    "use e.g. 0.8 (Jaccard similarity of word 5-grams), or 0 for exact de-duplication only")
  for flag, v in (("--near_dup_ngram", opts.near_dup_ngram), ("--near_dup_perm", opts.near_dup_perm)):
    if v < 1:
      raise DataError(flag, f"{v} is not positive", "use the default")
  if opts.shard_mib <= 0:
    raise DataError("--shard_mib", f"{opts.shard_mib} is not positive", "use e.g. 128")
  if opts.chat_template and not epath.Path(opts.chat_template).exists():
    raise DataError(opts.chat_template, "chat template file not found", "pass an existing jinja file")
  if opts.near_dup_threshold:
    try:
      import datasketch  # noqa: F401
    except ImportError:
      raise DataError("--near_dup_threshold", "near-duplicate removal needs datasketch",
                      "pip install -e '.[beam]' (or pip install datasketch)") from None
  output = epath.Path(opts.output)
  if output.exists() and any(output.iterdir()) and not opts.overwrite:
    raise DataError(opts.output, "the output folder exists and is not empty",
                    "choose a new --output or pass --overwrite")
  files = expand_inputs(opts.inputs)
  tokenizer = tokenizers.load(opts.tokenizer)
  if opts.format == "auto":
    opts = dataclasses.replace(opts, format=detect_format(files, opts.fields))
  if opts.format in MASKED:
    encoder(opts.tokenizer, opts.chat_template)  # a bad template fails here, once
  if opts.format == "preference" and opts.seq_len <= 0:
    raise DataError("--seq_len", "is required with --format=preference (pairs longer than a training row are "
                    "truncated or dropped here)", "pass the data.seq_len you will train with, e.g. --seq_len=1024")
  size = 0
  for f in files:
    try:
      size += epath.Path(f).stat().length
    except OSError as e:
      raise DataError(f, f"cannot be read ({e.strerror or e})", "check that the file exists and is readable") from None
  per_shard = opts.shard_mib * 2**20
  buckets = {"eval": max(1, math.ceil(size * opts.eval_fraction / per_shard)),
             "train": max(1, math.ceil(size * (1 - opts.eval_fraction) / per_shard))}
  work = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
  return Plan(opts, tuple(files), buckets, np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32).name,
              os.fspath(work))


# A scattered record: uint32 length of the rest, then order key, digest, tokens, trained tokens, the record's bytes.
_LENGTH = struct.Struct("<I")
_HEADER = struct.Struct("<Q32sII")
_FLUSH_BYTES = 64 * 2**20  # a scattering worker's buffer: bounds its memory whatever the file's size


def scatter(plan: Plan, index: int) -> Iterator[tuple]:
  """Phase 1 for input file ``index``, streaming: every document tokenized, routed (:func:`dedup.route`) and
  appended to a temporary part of its (split, bucket); a part is written whenever the buffers pass 64 MiB and
  at the end. Yields ``("part", (split, bucket), path)`` per part written and, with near-duplicate removal,
  ``("band", band key, (order key, digest, split, bucket))`` per document and LSH band. Raises DataError."""
  opts, path = plan.opts, plan.files[index]
  buffers, size, chunk = collections.defaultdict(list), 0, 0

  def flush():
    for (split, bucket), records in sorted(buffers.items()):
      part = plan.part(split, bucket, index, chunk)
      try:
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(b"".join(records))
      except Exception as e:  # the output's storage, not the input file: told by its cause (jaxtrain.failures)
        failures.reraise(e, opts.output, "writing the prepared data")
        raise
      yield "part", (split, bucket), os.fspath(part)
    buffers.clear()

  try:
    for digest, tokens, trained, text in _documents(path, opts):
      if not tokens.size:
        continue
      split, bucket, key = dedup.route(digest, opts.seed, opts.eval_fraction, plan.buckets)
      if int(tokens.max()) > np.iinfo(plan.dtype).max:  # ids beyond the tokenizer's reported size: never wrapped
        raise DataError(path, f"the tokenizer gives token id {int(tokens.max())}, more than its {plan.dtype} "
                        "records hold (its ids go past its vocabulary size)", "use a tokenizer whose ids are "
                        "below its vocabulary size")
      record = tokens.astype(plan.dtype).tobytes()
      if trained is not None:
        record += trained.astype(np.uint8).tobytes()
      header = _HEADER.pack(key, digest, tokens.size, 0 if trained is None else int((trained & 1).sum()))
      buffers[(split, bucket)].append(_LENGTH.pack(len(header) + len(record)) + header + record)
      size += len(record)
      if opts.near_dup_threshold:
        for band in dedup.band_keys(text, opts.near_dup_threshold, opts.near_dup_perm, opts.near_dup_ngram):
          yield "band", band, (key, digest, split, bucket)
      if size > _FLUSH_BYTES:
        yield from flush()
        size, chunk = 0, chunk + 1
    yield from flush()
  except OSError as e:
    raise DataError(path, f"cannot be read ({e.strerror or e})", "check that the file exists and is readable") from None


def read_parts(parts) -> list[tuple[int, bytes, int, int, bytes]]:
  """The records of scattered parts: (order key, digest, tokens, trained tokens, record bytes)."""
  records = []
  for part in parts:
    data, pos = epath.Path(part).read_bytes(), 0
    while pos < len(data):
      (n,) = _LENGTH.unpack_from(data, pos)
      records.append((*_HEADER.unpack_from(data, pos + _LENGTH.size), data[pos + _LENGTH.size + _HEADER.size:
                                                                            pos + _LENGTH.size + n]))
      pos += _LENGTH.size + n
  return records


def gather(plan: Plan, split: str, bucket: int, parts, dropped) -> dict:
  """Phase 2 for one bucket: its scattered records, exact duplicates (same digest) and ``dropped`` near
  duplicates removed and counted, sorted by order key, written as one ArrayRecord shard (named by bucket;
  :func:`finalize` numbers the shards). Returns the shard's entry for the manifest (documents 0: no file)."""
  dropped = set(dropped)
  records = sorted(read_parts(sorted(parts)), key=lambda r: (r[0], r[1]))
  kept, duplicates, near, previous = [], 0, 0, None
  for r in records:
    if r[1] == previous:
      duplicates += 1
    elif r[1] in dropped:
      near += 1
    else:
      kept.append(r)
    previous = r[1]
  entry = {"split": split, "bucket": bucket, "file": None, "documents": len(kept),
           "tokens": sum(r[2] for r in kept), "duplicates": duplicates, "near_duplicates": near}
  if plan.opts.format == "preference":  # dropped pairs leave here, counted with the truncated ones
    flag = lambda r: r[4][r[2] * np.dtype(plan.dtype).itemsize]  # noqa: E731 - a record's first flag
    entry["truncated"] = sum(1 for r in kept if flag(r) & pairs.TRUNCATED)
    entry["dropped"] = sum(1 for r in kept if flag(r) & pairs.DROPPED)
    kept = [r for r in kept if not flag(r) & pairs.DROPPED]
    entry["documents"], entry["tokens"] = len(kept), sum(r[2] for r in kept)
  if plan.opts.format in MASKED:
    entry["trained_tokens"] = sum(r[3] for r in kept)
  if kept:
    entry = _write_shard(epath.Path(plan.work) / f"{split}-b{bucket:05d}.array_record", [r[4] for r in kept], entry)
  return entry


@contextlib.contextmanager
def _as_local_file(path: epath.Path, write: bool) -> Iterator[str]:
  """``path`` as a local file name, for ArrayRecord, whose C++ reader and writer open local files only: the path
  itself on a local disk; for an object store's URL a temporary local file, downloaded first (``write`` False) or
  uploaded after (``write`` True)."""
  if "://" not in os.fspath(path):
    yield os.fspath(path)
    return
  with tempfile.TemporaryDirectory(prefix="jaxtrain-shard-") as folder:
    local = os.path.join(folder, path.name)
    if not write:
      with path.open("rb") as src, open(local, "wb") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)
    yield local
    if write:
      with open(local, "rb") as src, path.open("wb") as dst:
        shutil.copyfileobj(src, dst, 16 << 20)


def _write_shard(path: epath.Path, records: list[bytes], entry: dict) -> dict:
  from array_record.python.array_record_module import ArrayRecordWriter
  with _as_local_file(path, write=True) as local:
    writer = ArrayRecordWriter(local, "group_size:1")
    for r in records:
      writer.write(r)
    writer.close()
    with open(local, "rb") as f:
      data = f.read()
  return {**entry, "file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _hold_out_one(plan: Plan, entries: list[dict]) -> list[dict]:
  """When ``eval_fraction`` > 0 drew no document (a small input), the first training document of the shuffle
  becomes the eval split, as long as one is left to train on."""
  if not plan.opts.eval_fraction or any(e["split"] == "eval" and e["documents"] for e in entries):
    return entries
  train = sorted((e for e in entries if e["split"] == "train" and e["documents"]), key=lambda e: e["bucket"])
  if sum(e["documents"] for e in train) < 2:
    return entries
  from array_record.python.array_record_module import ArrayRecordReader
  first, work, sft = train[0], epath.Path(plan.work), plan.opts.format in MASKED
  with _as_local_file(work / first["file"], write=False) as local:
    reader = ArrayRecordReader(local)
    records = reader.read_all()
    reader.close()
  (work / first["file"]).unlink()
  width = np.dtype(plan.dtype).itemsize + sft

  def counts(rs):
    out = {"documents": len(rs), "tokens": sum(len(r) // width for r in rs)}
    if sft:
      out["trained_tokens"] = sum(sum(b & 1 for b in r[-(len(r) // width):]) for r in rs)
    return out

  rest = {**first, **counts(records[1:])}  # keeps the bucket's duplicate counts, even when it is left empty
  rest = _write_shard(work / first["file"], records[1:], rest) if len(records) > 1 else {**rest, "file": None}
  held = _write_shard(work / "eval-b00000.array_record", records[:1],
                      {"split": "eval", "bucket": 0, "duplicates": 0, "near_duplicates": 0, **counts(records[:1])})
  return [e for e in entries if e is not first] + [rest, held]


def finalize(plan: Plan, entries: list[dict]) -> dict:
  """Numbers the shards (``train-00000-of-00003.array_record``, in key order), writes the manifest last and
  returns it. Raises DataError when nothing is left to train on."""
  entries = _hold_out_one(plan, entries)
  opts, sft = plan.opts, plan.opts.format in MASKED
  work, count = epath.Path(plan.work), ("documents", "tokens") + (("trained_tokens",) if sft else ())
  splits, shards = {}, []
  for split in ("eval", "train"):
    mine = sorted((e for e in entries if e["split"] == split and e["documents"]), key=lambda e: e["bucket"])
    splits[split] = {k: sum(e[k] for e in mine) for k in count}
    for i, e in enumerate(mine):
      name = f"{split}-{i:05d}-of-{len(mine):05d}.array_record"
      (work / e["file"]).rename(work / name)
      shards.append({"file": name, "split": split, **{k: e[k] for k in count + ("bytes", "sha256")}})
  totals = {k: splits["eval"][k] + splits["train"][k] for k in count}
  if not totals["documents"]:
    raise DataError(", ".join(opts.inputs), "the input holds no documents", "pass non-empty input files")
  if sft and not totals["trained_tokens"]:
    raise DataError(", ".join(opts.inputs), "no record has a trained token", "check the chat template")
  tokenizer = tokenizers.load(opts.tokenizer)
  manifest = {
      "format": {"sft": FORMAT_SFT, "preference": FORMAT_PREFERENCE}.get(opts.format, FORMAT),
      "jaxtrain_version": jaxtrain.__version__, **totals,
      "duplicates_removed": sum(e["duplicates"] for e in entries),
      "near_duplicates_removed": sum(e["near_duplicates"] for e in entries),
      "near_dup": {"threshold": opts.near_dup_threshold, "ngram": opts.near_dup_ngram,
                   "num_perm": opts.near_dup_perm} if opts.near_dup_threshold else None,
      "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "dtype": plan.dtype, "seed": opts.seed,
      "eval_fraction": opts.eval_fraction, "inputs": [os.path.basename(f) for f in plan.files],
      "splits": splits, "shards": shards,
  }
  if opts.format == "preference":
    template = encoder(opts.tokenizer, opts.chat_template).template
    manifest.update(loss_mask=True, preference={
        "seq_len": opts.seq_len, "truncated": sum(e.get("truncated", 0) for e in entries),
        "dropped": sum(e.get("dropped", 0) for e in entries),
        "template": "plain" if template is None else "chat_template",
        "chat_template_sha256": None if template is None else template.sha256, "prompt_field": opts.prompt_field})
  elif sft:
    template = encoder(opts.tokenizer, opts.chat_template).template
    manifest.update(loss_mask=True, sft={
        "template": "plain" if template is None else "chat_template",
        "chat_template_sha256": None if template is None else template.sha256,
        "prompt_field": opts.prompt_field, "response_field": opts.response_field,
        "messages_field": opts.messages_field})
  else:
    manifest.update(text_split=opts.text_split, field=opts.field)
  if (work / "scatter").exists():
    (work / "scatter").rmtree()
  (work / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
  return manifest

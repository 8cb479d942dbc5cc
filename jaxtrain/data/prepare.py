"""Raw text -> tokenized, de-duplicated, shuffled ArrayRecord shards plus a manifest.

Inputs are text files (documents separated by blank lines, or one per file), JSONL (one document per line,
a named field), Parquet (a named column), folders (recursively) and globs. The output directory appears
complete or not at all: everything is written into a temporary sibling directory that is renamed into place
at the end, so no half-written shard can ever look valid. Same inputs and seed give identical bytes.

Pretraining data (``format: "jaxtrain.tokens.v1"``): each record is one document, its n token ids as
little-endian ``uint16`` (``uint32`` when the vocabulary needs it), n x itemsize bytes.

Supervised fine-tuning data (``--format=sft``, or auto-detected: JSONL of prompt/response pairs or chats, see
:mod:`jaxtrain.data.chat`; manifest ``format: "jaxtrain.sft.v1"`` and ``loss_mask: true``): each record is one
example, its n token ids as above followed by n ``uint8`` trained flags (1: an assistant / response token, whose
prediction is trained; 0: prompt, system, template), n x (itemsize + 1) bytes. The manifest adds
``trained_tokens`` (in total, per split and per shard) and ``sft`` (``template``: ``"chat_template"`` or
``"plain"``, the template's SHA-256, the field names). Exact duplicates are found on the record's messages.

``manifest.json`` lists per split the shards with their document and token counts, bytes and SHA-256.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import uuid
from typing import Iterator, Sequence

import numpy as np
from etils import epath

import jaxtrain
from jaxtrain.config import DataError
from jaxtrain.data import chat, tokenizers

MANIFEST = "manifest.json"
FORMAT = "jaxtrain.tokens.v1"  # records: token ids
FORMAT_SFT = "jaxtrain.sft.v1"  # records: token ids, then one uint8 trained flag per token
FORMATS = ("auto", "text", "sft")
TEXT_SPLITS = ("paragraph", "file")
_SUFFIXES = (".txt", ".text", ".md", ".jsonl", ".json", ".parquet")


# One record: its token ids and, for SFT data, its per-token trained flags (None for pretraining text).
Document = tuple[np.ndarray, "np.ndarray | None"]


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
  format: str = "auto"  # auto | text | sft (auto: sft when the first JSONL record is a chat or a pair)
  prompt_field: str = "prompt"
  response_field: str = "response"
  messages_field: str = "messages"
  chat_template: str = ""  # a jinja file: overrides the tokenizer's chat template ("" = the tokenizer's, if any)

  @property
  def fields(self) -> chat.Fields:
    return chat.Fields(self.prompt_field, self.response_field, self.messages_field)


def expand_inputs(inputs: Sequence[str]) -> list[str]:
  """Paths, folders (recursive, known suffixes) and globs -> sorted, de-duplicated file list."""
  files = []
  for spec in inputs:
    if any(c in spec for c in "*?["):
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


def _decode(raw: bytes, path: str) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(path, f"not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 4]!r})",
                    "convert the file to UTF-8 (e.g. iconv -t UTF-8)") from None


def read_documents(path: str, field: str, text_split: str) -> list[str]:
  """The documents of one input file, in file order."""
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet as pq
    except ImportError:
      raise DataError(path, "reading Parquet needs pyarrow", "pip install pyarrow") from None
    try:
      table = pq.read_table(path)
    except Exception as e:
      raise DataError(path, f"not a readable Parquet file ({str(e)[:100]})", "check the file") from None
    if field not in table.column_names:
      raise DataError(path, f"no column '{field}' (columns: {', '.join(table.column_names)})",
                      "pass --field=COLUMN")
    return [d for d in table.column(field).to_pylist() if d]
  text = _decode(epath.Path(path).read_bytes(), path)
  if path.endswith((".jsonl", ".json")):
    docs = []
    for i, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{i}", f"not a JSON line ({e.msg})", "fix or remove the line") from None
      if not isinstance(obj, dict) or field not in obj:
        raise DataError(f"{path}:{i}", f"no field '{field}'", "pass --field=NAME")
      if obj[field]:
        docs.append(str(obj[field]))
    return docs
  if text_split == "file":
    return [text] if text.strip() else []
  return [p.strip("\n") for p in text.replace("\r\n", "\n").split("\n\n") if p.strip()]


def _json_lines(path: str) -> Iterator[tuple[int, object]]:
  """(line number, parsed object) of every non-empty line of a JSONL file."""
  raw = epath.Path(path).read_bytes()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    raise DataError(f"{path}:{line}", f"not valid UTF-8 (byte {e.start}: "
                    f"{raw[e.start:e.start + 4]!r})", "convert the file to UTF-8 (e.g. iconv -t UTF-8)") from None
  for i, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit inside a JSON string
    if not line.strip():
      continue
    try:
      yield i, json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path}:{i}", f"not a JSON line ({e.msg})", "fix or remove the line") from None


def read_sft_records(path: str, fields: chat.Fields) -> list[tuple[int, list[dict]]]:
  """(line number, messages) of every record of one SFT JSONL file, in file order."""
  if not path.endswith((".jsonl", ".json")):
    raise DataError(path, "SFT input must be JSONL (one prompt/response pair or chat per line)",
                    "convert it to .jsonl, or pass --format=text for pretraining text")
  records = []
  for i, obj in _json_lines(path):
    try:
      records.append((i, chat.parse(obj, fields)))
    except chat.RecordError as e:
      raise DataError(f"{path}:{i}", str(e), f"fix or remove the line (fields: '{fields.prompt}' + "
                      f"'{fields.response}', or '{fields.messages}'; see --help)") from None
  return records


def detect_format(files: list[str], fields: chat.Fields) -> str:
  """'sft' when the first record of the first JSONL input is a chat or a prompt/response pair, else 'text'."""
  for path in files:
    if path.endswith((".jsonl", ".json")):
      for _, obj in _json_lines(path):
        return "sft" if chat.is_sft_object(obj, fields) else "text"
  return "text"


@functools.cache
def _encoder(tokenizer_spec: str, template_file: str) -> chat.Encoder:
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


def _tokenize_file(args) -> tuple[str, list[tuple[bytes, Document]]]:
  path, opts = args
  try:
    if opts.format == "sft":
      encoder, docs = _encoder(opts.tokenizer, opts.chat_template), []
      for line, messages in read_sft_records(path, opts.fields):
        try:
          docs.append((chat.digest(messages), encoder.encode(messages)))
        except chat.RecordError as e:
          raise DataError(f"{path}:{line}", str(e), "fix or remove the line") from None
      return path, docs
    tokenizer = tokenizers.load(opts.tokenizer)
    return path, [(hashlib.sha256(d.encode("utf-8")).digest(), (tokenizer.encode(d), None))
                  for d in read_documents(path, opts.field, opts.text_split)]
  except DataError as e:  # returned, not raised: a worker's exception would not survive pickling
    return path, (e.subject, e.problem, e.fix)


def _tokenized(files: list[str], opts: Options) -> Iterator[tuple[str, list[tuple[bytes, Document]]]]:
  jobs = [(f, opts) for f in files]
  if opts.workers > 1 and len(files) > 1:
    with multiprocessing.get_context("spawn").Pool(opts.workers) as pool:
      yield from pool.imap(_tokenize_file, jobs)  # ordered: output does not depend on the worker count
  else:
    yield from map(_tokenize_file, jobs)


def _write_shards(directory: epath.Path, split: str, docs: list[Document], dtype, shard_mib: float) -> list:
  from array_record.python.array_record_module import ArrayRecordWriter
  masked = bool(docs) and docs[0][1] is not None
  total_bytes = sum(d.size for d, _ in docs) * (np.dtype(dtype).itemsize + masked)
  num = max(1, math.ceil(total_bytes / (shard_mib * 2**20))) if docs else 0
  shards = []
  for i, part in enumerate(np.array_split(np.arange(len(docs)), num) if num else []):
    name = f"{split}-{i:05d}-of-{num:05d}.array_record"
    writer = ArrayRecordWriter(os.fspath(directory / name), "group_size:1")
    for j in part:
      tokens, trained = docs[j]
      record = tokens.astype(dtype).tobytes()
      writer.write(record if trained is None else record + trained.astype(np.uint8).tobytes())
    writer.close()
    data = (directory / name).read_bytes()
    shards.append({"file": name, "split": split, "documents": len(part),
                   "tokens": int(sum(docs[j][0].size for j in part)), "bytes": len(data),
                   "sha256": hashlib.sha256(data).hexdigest()})
    if masked:
      shards[-1]["trained_tokens"] = int(sum(docs[j][1].sum() for j in part))
  return shards


def prepare(opts: Options) -> dict:
  """Runs the whole preparation and returns the manifest. Raises DataError on bad input."""
  if opts.text_split not in TEXT_SPLITS:
    raise DataError("--text_split", f"'{opts.text_split}' is not one of {', '.join(TEXT_SPLITS)}", "fix it")
  if not 0 <= opts.eval_fraction < 1:
    raise DataError("--eval_fraction", f"{opts.eval_fraction} is not in [0, 1)", "use e.g. 0.01")
  if opts.format not in FORMATS:
    raise DataError("--format", f"'{opts.format}' is not one of {', '.join(FORMATS)}", "fix it")
  if opts.chat_template and not epath.Path(opts.chat_template).exists():
    raise DataError(opts.chat_template, "chat template file not found", "pass an existing jinja file")
  output = epath.Path(opts.output)
  if output.exists() and any(output.iterdir()) and not opts.overwrite:
    raise DataError(opts.output, "the output folder exists and is not empty",
                    "choose a new --output or pass --overwrite")
  files = expand_inputs(opts.inputs)
  tokenizer = tokenizers.load(opts.tokenizer)
  if opts.format == "auto":
    opts = dataclasses.replace(opts, format=detect_format(files, opts.fields))
  sft = opts.format == "sft"
  if sft:
    encoder = _encoder(opts.tokenizer, opts.chat_template)  # a bad template fails here, once

  seen, docs, duplicates = set(), [], 0
  progress = _progress(len(files), opts.progress)
  try:
    for _, file_docs in _tokenized(files, opts):
      if isinstance(file_docs, tuple):  # a worker's DataError
        raise DataError(*file_docs)
      for digest, doc in file_docs:
        if digest in seen:
          duplicates += 1
        elif doc[0].size:
          seen.add(digest)
          docs.append(doc)
      progress.update(1)
  finally:
    progress.close()
  if not docs:
    raise DataError(", ".join(opts.inputs), "the input holds no documents", "pass non-empty input files")
  if sft and not any(m.any() for _, m in docs):
    raise DataError(", ".join(opts.inputs), "no record has a trained token", "check the chat template")

  order = np.random.default_rng(opts.seed).permutation(len(docs))
  n_eval = min(int(round(len(docs) * opts.eval_fraction)), len(docs) - 1)
  if opts.eval_fraction > 0 and len(docs) > 1:
    n_eval = max(n_eval, 1)
  splits = {"eval": [docs[i] for i in order[:n_eval]], "train": [docs[i] for i in order[n_eval:]]}
  dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32

  def counts(split_docs: list[Document]) -> dict:
    out = {"documents": len(split_docs), "tokens": int(sum(d.size for d, _ in split_docs))}
    if sft:
      out["trained_tokens"] = int(sum(m.sum() for _, m in split_docs))
    return out

  tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
  tmp.mkdir(parents=True)
  try:
    shards = [s for split, split_docs in splits.items()
              for s in _write_shards(tmp, split, split_docs, dtype, opts.shard_mib)]
    manifest = {
        "format": FORMAT_SFT if sft else FORMAT, "jaxtrain_version": jaxtrain.__version__,
        **counts(docs),
        "duplicates_removed": duplicates, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name, "seed": opts.seed, "eval_fraction": opts.eval_fraction,
        "inputs": [os.path.basename(f) for f in files],
        "splits": {split: counts(d) for split, d in splits.items()},
        "shards": shards,
    }
    if sft:
      template = encoder.template
      manifest.update(loss_mask=True, sft={
          "template": "plain" if template is None else "chat_template",
          "chat_template_sha256": None if template is None else template.sha256,
          "prompt_field": opts.prompt_field, "response_field": opts.response_field,
          "messages_field": opts.messages_field})
    else:
      manifest.update(text_split=opts.text_split, field=opts.field)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _move_into_place(tmp, output, opts.overwrite)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp, ignore_errors=True)
  return manifest


def _move_into_place(new: epath.Path, target: epath.Path, overwrite: bool) -> None:
  """Renames the finished ``new`` folder to ``target``. Without ``overwrite`` the rename fails rather than
  replace a non-empty ``target`` (another process may have just finished the same work); with it, the old
  ``target`` is moved aside first and deleted only once the new one is in place."""
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
    shutil.rmtree(old, ignore_errors=True)


def _progress(total: int, enabled: bool):
  from tqdm import tqdm
  return tqdm(total=total, unit="file", desc="tokenizing", disable=not enabled)


BUNDLED = epath.Path(__file__).parent / "corpus" / "tinyshakespeare.txt"


def bundled_corpus(cache_dir: str) -> epath.Path:
  """The bundled Shakespeare corpus, prepared (byte tokens, seed 0) on first use into ``cache_dir``."""
  digest = hashlib.sha256(BUNDLED.read_bytes()).hexdigest()[:12]
  target = epath.Path(os.path.expanduser(cache_dir)) / f"tinyshakespeare-{digest}"
  if not (target / MANIFEST).exists():
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
      prepare(Options(inputs=[os.fspath(BUNDLED)], output=os.fspath(target), eval_fraction=0.05,
                      progress=False))
    except (DataError, OSError):
      if not (target / MANIFEST).exists():  # another process on this host may have won the race
        raise
  return target

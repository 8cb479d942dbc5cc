"""Raw text -> tokenized, de-duplicated, shuffled ArrayRecord shards plus a manifest.

Inputs are text files (documents separated by blank lines, or one per file), JSONL (one document per line,
a named field), Parquet (a named column), folders (recursively) and globs. The output directory appears
complete or not at all: everything is written into a temporary sibling directory that is renamed into place
at the end, so no half-written shard can ever look valid. Same inputs and seed give identical bytes.

Each record is one document: its token ids as little-endian ``uint16`` (``uint32`` when the vocabulary needs
it). ``manifest.json`` lists per split the shards with their document and token counts, bytes and SHA-256.
"""

from __future__ import annotations

import dataclasses
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
from jaxtrain.data import tokenizers

MANIFEST = "manifest.json"
FORMAT = "jaxtrain.tokens.v1"
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


def _tokenize_file(args) -> tuple[str, list[tuple[bytes, np.ndarray]]]:
  path, field, text_split, tokenizer_spec = args
  tokenizer = tokenizers.load(tokenizer_spec)
  return path, [(hashlib.sha256(d.encode("utf-8")).digest(), tokenizer.encode(d))
                for d in read_documents(path, field, text_split)]


def _tokenized(files: list[str], opts: Options) -> Iterator[tuple[str, list[tuple[bytes, np.ndarray]]]]:
  jobs = [(f, opts.field, opts.text_split, opts.tokenizer) for f in files]
  if opts.workers > 1 and len(files) > 1:
    with multiprocessing.get_context("spawn").Pool(opts.workers) as pool:
      yield from pool.imap(_tokenize_file, jobs)  # ordered: output does not depend on the worker count
  else:
    yield from map(_tokenize_file, jobs)


def _write_shards(directory: epath.Path, split: str, docs: list[np.ndarray], dtype, shard_mib: float) -> list:
  from array_record.python.array_record_module import ArrayRecordWriter
  total_bytes = sum(d.size for d in docs) * np.dtype(dtype).itemsize
  num = max(1, math.ceil(total_bytes / (shard_mib * 2**20))) if docs else 0
  shards = []
  for i, part in enumerate(np.array_split(np.arange(len(docs)), num) if num else []):
    name = f"{split}-{i:05d}-of-{num:05d}.array_record"
    writer = ArrayRecordWriter(os.fspath(directory / name), "group_size:1")
    for j in part:
      writer.write(docs[j].astype(dtype).tobytes())
    writer.close()
    data = (directory / name).read_bytes()
    shards.append({"file": name, "split": split, "documents": len(part),
                   "tokens": int(sum(docs[j].size for j in part)), "bytes": len(data),
                   "sha256": hashlib.sha256(data).hexdigest()})
  return shards


def prepare(opts: Options) -> dict:
  """Runs the whole preparation and returns the manifest. Raises DataError on bad input."""
  if opts.text_split not in TEXT_SPLITS:
    raise DataError("--text_split", f"'{opts.text_split}' is not one of {', '.join(TEXT_SPLITS)}", "fix it")
  if not 0 <= opts.eval_fraction < 1:
    raise DataError("--eval_fraction", f"{opts.eval_fraction} is not in [0, 1)", "use e.g. 0.01")
  output = epath.Path(opts.output)
  if output.exists() and any(output.iterdir()) and not opts.overwrite:
    raise DataError(opts.output, "the output folder exists and is not empty",
                    "choose a new --output or pass --overwrite")
  files = expand_inputs(opts.inputs)
  tokenizer = tokenizers.load(opts.tokenizer)

  seen, docs, duplicates = set(), [], 0
  progress = _progress(len(files), opts.progress)
  for _, file_docs in _tokenized(files, opts):
    for digest, tokens in file_docs:
      if digest in seen:
        duplicates += 1
      elif tokens.size:
        seen.add(digest)
        docs.append(tokens)
    progress.update(1)
  progress.close()
  if not docs:
    raise DataError(", ".join(opts.inputs), "the input holds no documents", "pass non-empty input files")

  order = np.random.default_rng(opts.seed).permutation(len(docs))
  n_eval = min(int(round(len(docs) * opts.eval_fraction)), len(docs) - 1)
  if opts.eval_fraction > 0 and len(docs) > 1:
    n_eval = max(n_eval, 1)
  splits = {"eval": [docs[i] for i in order[:n_eval]], "train": [docs[i] for i in order[n_eval:]]}
  dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32

  tmp = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
  tmp.mkdir(parents=True)
  try:
    shards = [s for split, split_docs in splits.items()
              for s in _write_shards(tmp, split, split_docs, dtype, opts.shard_mib)]
    manifest = {
        "format": FORMAT, "jaxtrain_version": jaxtrain.__version__,
        "documents": len(docs), "tokens": int(sum(d.size for d in docs)),
        "duplicates_removed": duplicates, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
        "dtype": np.dtype(dtype).name, "seed": opts.seed, "eval_fraction": opts.eval_fraction,
        "text_split": opts.text_split, "field": opts.field, "inputs": [os.path.basename(f) for f in files],
        "splits": {split: {"documents": len(d), "tokens": int(sum(x.size for x in d))}
                   for split, d in splits.items()},
        "shards": shards,
    }
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

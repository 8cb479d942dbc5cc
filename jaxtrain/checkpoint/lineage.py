"""Where a run comes from, and the files that travel with its weights.

Every run's workdir, and every import's folder (``tools/convert_hf.py import``), holds:

- ``lineage.json``: what the run started from (``parent``: the import or the run and the step its
  ``checkpoint.restore_from`` named, with that parent's own lineage nested, so the whole chain is readable after
  its folders are gone), the data it reads (each prepared folder's manifest hash), its config, and the jaxtrain
  version and commit that started it. An import's names its Hugging Face source.
- ``hf/``: the Hugging Face side files (:data:`SIDE_FILES`: the model's ``config.json``, the tokenizer, its chat
  template and special tokens, the generation config). An import copies them from its source; a run copies its
  parent's at its start (else the tokenizer of ``data.tokenizer``), so any descendant, however far down the chain,
  generates, evaluates and exports with them without looking anything up in its parents.

Both are written once, by process 0, at the run's first start (:func:`record`); a resume leaves them as they are.
:func:`side_dir` finds a checkpoint's ``hf/`` folder, :func:`read` its lineage.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import subprocess
from typing import Any

from etils import epath

import jaxtrain
from jaxtrain import paths
from jaxtrain.checkpoint import read as read_lib

FILE = "lineage.json"
SIDE = "hf"
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # one of them makes a folder a tokenizer
MANIFEST = "manifest.json"  # a prepared data folder's (jaxtrain.data.prepare)


@functools.lru_cache(maxsize=1)
def commit() -> str | None:
  """The git commit of the jaxtrain source that runs (None: not a git checkout, e.g. an installed wheel)."""
  source = os.path.dirname(os.path.dirname(os.path.abspath(jaxtrain.__file__)))
  try:
    out = subprocess.run(["git", "-C", source, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None if out.returncode == 0 else None


def version() -> dict:
  return {"version": jaxtrain.__version__, "commit": commit()}


def workdir_of(step_dir: str, saved: dict | None = None) -> str:
  """The folder holding the checkpoint ``step_dir`` (a step folder): its workdir, or an import's folder. With the
  checkpoints kept apart (``checkpoint.dir``), the workdir the step's config names."""
  above = step_dir.rstrip("/").rsplit("/", 2)[0]
  if _has(above, FILE) or _has(above, SIDE) or not (saved or {}).get("workdir"):
    return above
  return paths.resolve(saved["workdir"])


def _has(folder: str, name: str) -> bool:
  return epath.Path(paths.join(folder, name)).exists()


def side_files_dir(step_dir: str, config: dict) -> str | None:
  """The Hugging Face side files (tokenizer, chat template, generation config, the model's config.json) of the
  checkpoint ``step_dir``: its workdir's ``hf/``, else, for a run started before lineage was recorded, its import's
  one ``checkpoint.restore_from`` back."""
  workdir = workdir_of(step_dir, config)
  return side_dir(workdir) or _legacy_side_dir(step_dir, workdir)


def side_dir(workdir: str) -> str | None:
  """``workdir``'s ``hf/`` folder, or None when it has none."""
  folder = paths.join(workdir, SIDE)
  return folder if epath.Path(folder).is_dir() else None


def run_side_dir(config: dict) -> str | None:
  """The running run's side files: its workdir's ``hf/`` (written at its first start), else its parent's."""
  found = side_dir(config["workdir"]) if config.get("workdir") else None
  restore_from = (config.get("checkpoint") or {}).get("restore_from")
  return found or (_parent_side_dir(restore_from) if restore_from else None)


_PARENT_SIDE: dict[str, str | None] = {}


def _parent_side_dir(restore_from: str) -> str | None:
  """The side files of the checkpoint ``restore_from`` names, read once per process (the data, the prompts, the
  sampler and the harness each ask at start)."""
  if restore_from not in _PARENT_SIDE:
    try:
      parent = parent_of(restore_from)
    except Exception:  # noqa: BLE001 - not cached: the start restores from it and says why it cannot
      return None
    _PARENT_SIDE[restore_from] = side_dir(parent["workdir"]) or _legacy_side_dir(parent["path"], parent["workdir"])
  return _PARENT_SIDE[restore_from]


def tokenizer_of(config: dict) -> str:
  """The tokenizer the running run's lineage carries, as a ``data.tokenizer`` value: its side folder (with the chat
  template) when that holds ``tokenizer.json``, else its ``tokenizer.model``; '' when it carries none."""
  side = run_side_dir(config)
  for name in TOKENIZER_FILES:
    if side and _has(side, name):
      return side if name == "tokenizer.json" else paths.join(side, name)
  return ""


def has_tokenizer(folder: str | None) -> bool:
  return bool(folder) and any(_has(folder, f) for f in TOKENIZER_FILES)


def read(workdir: str) -> dict | None:
  """``workdir``'s lineage (None: it has none, a run started before lineage was recorded)."""
  file = epath.Path(paths.join(workdir, FILE))
  return json.loads(file.read_text()) if file.exists() else None


def _manifests(folders: list[str]) -> dict[str, str]:
  """Each prepared data folder of ``folders`` (those with a manifest) -> the sha256 of its manifest."""
  out = {}
  for folder in folders:
    manifest = epath.Path(paths.join(folder, MANIFEST))
    if manifest.exists():
      out[folder] = "sha256:" + hashlib.sha256(manifest.read_bytes()).hexdigest()
  return out


def _copy_files(source: str, target: str, names) -> list[str]:
  copied = []
  for name in names:
    src = epath.Path(paths.join(source, name))
    if src.is_file():
      dst = epath.Path(paths.join(target, name))
      dst.parent.mkdir(parents=True, exist_ok=True)
      dst.write_bytes(src.read_bytes())
      copied.append(name)
  return copied


def _tokenizer_files(spec: str, target: str) -> list[str]:
  """A ``data.tokenizer`` (a Hugging Face tokenizer folder, a tokenizer.json, a SentencePiece model) copied into
  ``target`` under the names a Hugging Face folder gives them."""
  path = epath.Path(spec)
  if path.is_dir():
    return _copy_files(spec, target, SIDE_FILES[1:])  # not a model's config.json
  if path.is_file():
    name = "tokenizer.json" if spec.endswith(".json") else "tokenizer.model"
    epath.Path(target).mkdir(parents=True, exist_ok=True)
    epath.Path(paths.join(target, name)).write_bytes(path.read_bytes())
    return [name]
  return []


def parent_of(restore_from: str) -> dict:
  """What ``checkpoint.restore_from`` names, as a lineage records it: the step folder, its step, the workdir (or
  import folder) it lies in, its kind and that folder's own lineage."""
  step_dir = read_lib.step_dir(restore_from)
  saved = read_lib.saved_config(step_dir)
  workdir = workdir_of(step_dir, saved)
  meta_file = epath.Path(step_dir) / "meta" / "metadata"
  meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
  return {"kind": "import" if "hf_import" in meta else "run", "path": step_dir,
          "step": int(epath.Path(step_dir).name) if epath.Path(step_dir).name.isdigit() else None,
          "workdir": workdir, "lineage": read(workdir)}


def record(config: dict, data_folders: list[str] = ()) -> dict | None:
  """At a run's first start (process 0): writes ``lineage.json`` and fills ``hf/`` from the parent's (else from
  ``data.tokenizer``). ``data_folders``: the data the run reads (jaxtrain.data.read_folders), whose manifests it
  fingerprints. A workdir that has its lineage already (a resume) is left as it is. Returns what was written (None
  on a resume)."""
  workdir = config["workdir"]
  if _has(workdir, FILE):
    return None
  restore_from = (config.get("checkpoint") or {}).get("restore_from")
  parent = parent_of(restore_from) if restore_from else None
  target = paths.join(workdir, SIDE)
  copied, source = [], None
  if parent:
    source = side_dir(parent["workdir"]) or _legacy_side_dir(parent["path"], parent["workdir"])
    if source:
      copied = _copy_files(source, target, SIDE_FILES)
  tokenizer = (config.get("data") or {}).get("tokenizer") or ""
  if not has_tokenizer(target if copied else None) and tokenizer not in ("", "byte"):
    copied += _tokenizer_files(tokenizer, target)
    source = source or tokenizer
  lineage = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "jaxtrain": version(), "parent": parent, "side_files": {"from": source, "files": copied},
             "data": _manifests(list(data_folders)), "config": config}
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  epath.Path(paths.join(workdir, FILE)).write_text(json.dumps(lineage, indent=2, sort_keys=True) + "\n")
  return lineage


def record_import(output: str, source: str, dtype: str, config: dict, side_files: list[str]) -> None:
  """An import's lineage: its Hugging Face source (``output`` is being written: see jaxtrain.hf._Output)."""
  lineage = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "jaxtrain": version(), "parent": None, "import": {"source": source, "dtype": dtype},
             "side_files": {"from": source, "files": side_files}, "data": {}, "config": config}
  epath.Path(output).write_text(json.dumps(lineage, indent=2, sort_keys=True) + "\n")


def _legacy_side_dir(step_dir: str, workdir: str) -> str | None:
  """The ``hf/`` folder of a run started before lineage was recorded: its import's, one ``restore_from`` back."""
  try:
    saved = read_lib.saved_config(step_dir)
  except Exception:  # noqa: BLE001 - no config: no way back
    return None
  restore_from = (saved.get("checkpoint") or {}).get("restore_from")
  if not restore_from:
    return None
  for c in (restore_from.rstrip("/").rsplit("/", 1)[0], restore_from.rstrip("/").rsplit("/", 2)[0], restore_from):
    if side_dir(c):
      return side_dir(c)
  return None


def chain(lineage: dict | None) -> list[dict[str, Any]]:
  """The lineage as a list, this run first, then its parent, ... back to the import or fresh start."""
  out = []
  while lineage:
    parent = lineage.get("parent") or {}
    out.append({"import": (lineage.get("import") or {}).get("source"), "parent": parent.get("path"),
                "kind": parent.get("kind"), "created": lineage.get("created"),
                "jaxtrain": lineage.get("jaxtrain")})
    lineage = parent.get("lineage")
  return out

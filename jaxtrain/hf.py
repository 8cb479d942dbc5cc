"""Hugging Face checkpoints in and out (``tools/convert_hf.py``): any ``model_type`` with a registered adapter
(jaxtrain/models/hf_adapter.py; the built-in ones, in the families' folders, read Llama, Mistral, Mixtral, Qwen 2.5,
Qwen 3 (dense and MoE), Gemma 2, Gemma 3 (text), OLMoE and GPT-OSS: docs/models.md). This module does what every family
shares; the adapter of the ``model_type`` (import) or of the family (export) says the rest: the model group a
config.json gives and the config.json a model group gives, every tensor's name, param and layout, and what it
refuses.

:func:`import_model` turns a Hugging Face folder (``config.json``, ``*.safetensors`` with or
without ``model.safetensors.index.json``, tokenizer files) into ``OUT/checkpoints/0`` (a jaxtrain checkpoint that
``checkpoint.restore_from`` with ``restore_mode=params`` starts from), ``OUT/config.py`` (a config file for
``python -m jaxtrain.main``) and ``OUT/hf/`` (the source's config.json, tokenizer and generation files, which
:func:`export_model` writes back). :func:`export_model` writes a jaxtrain checkpoint (imported or trained) as such
a folder. Tensors are read and written one at a time (peak host memory: import about 1.5 x the float32 model,
export one param);
params are float32 (a bfloat16 or float16 source converts exactly, and exports back bitwise with that ``dtype``).
A torch Linear weight (``[out, in]``) is the transpose of jaxtrain's kernel read as ``[in, out]``; every other
tensor is a reshape (``adapter.Tensor.linear``). A tensor a checkpoint stores quantized is made from its parts
(``adapter.stored_as``: GPT-OSS's MXFP4 experts).

Every mistake in the input (another architecture, biases it has not, an unknown RoPE type, missing or truncated files,
an index naming files outside the folder, shapes that disagree with the config, an existing output) is a
:class:`HFError` (a UserError), raised before anything is written; outputs are built in a temporary folder next to
the output and renamed into place.

Inputs and outputs may be on an object store (``gs://``, ``s3://``). A Hugging Face folder there is copied to a
local temporary folder first (the files the import reads; safetensors' reader opens local files): local disk of
the model's size. An output there is written in place, each file whole, the file its readers open first last
(:class:`_Output`). A store that does not answer is a :class:`jaxtrain.exits.Restart` (run the same command
again: it clears the unfinished output and starts over), one that refuses the caller (403, 401: credentials,
permissions) an HFError.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from typing import Any

import fsspec
import jax
import ml_collections
import ml_dtypes
import numpy as np
from absl import logging
from etils import epath
from safetensors import SafetensorError, safe_open

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain.checkpoint import lineage
from jaxtrain import exits
from jaxtrain import models
from jaxtrain import paths
from jaxtrain import stores
from jaxtrain.config import base_config
from jaxtrain.errors import UserError
from jaxtrain.models import hf_adapter, lora
from jaxtrain.models.hf_adapter import HFError
from jaxtrain.train.state import TrainState

SIDE_FILES = lineage.SIDE_FILES  # the model's config.json and its tokenizer's, chat template's, generation's files
_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "F64": np.dtype(np.float64)}
_EXPORT_DTYPES = ("float32", "bfloat16", "float16")
# Read from the file's bytes (quantized checkpoints: DeepSeek-V3's fp8 weights, jaxtrain/models/deepseek_v3/hf.py).
_RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}


def _bf16():
  return np.dtype(ml_dtypes.bfloat16)


def _code(dtype: np.dtype) -> str:
  return "BF16" if dtype == _bf16() else {v: k for k, v in _DTYPES.items()}[np.dtype(dtype)]


# ---------------------------------------------------------------------------------------------------------------
# The config and the tensors: the adapters' (jaxtrain/models/hf_adapter.py).

def adapter(model_type: Any, where: str, architectures: Any = None) -> hf_adapter.Adapter:
  """The registered adapter of ``model_type``; HFError naming ``where`` if none reads it, or if ``architectures``
  (config.json's) names another class than the adapter's."""
  if model_type in hf_adapter.REFUSED:
    raise HFError(where, *hf_adapter.REFUSED[model_type])
  if model_type not in hf_adapter.ADAPTERS:
    raise HFError(where, f"is a {model_type!r} model ({', '.join(map(str, architectures or []))}), which jaxtrain "
                  "does not import", f"supported model_types: {', '.join(hf_adapter.ADAPTERS.names())}")
  found = hf_adapter.ADAPTERS.get(model_type)
  arch = architectures or [found.architecture]
  if arch != [found.architecture]:
    raise HFError(where, f"names the architecture {', '.join(map(str, arch))}", f"a {model_type} checkpoint to "
                  f"import is a {found.architecture}")
  return found


def _exporter(model: Any) -> hf_adapter.Adapter:
  """The adapter that writes the ``model`` group's family; HFError if none does."""
  found = hf_adapter.for_family(model.name)
  if found is None:
    raise HFError(f"model.name={model.name}", "has no Hugging Face adapter", "register one (docs/extending.md)")
  return found


def model_config(hf: dict, where: str = "config.json") -> ml_collections.ConfigDict:
  """The jaxtrain ``model`` group of a Hugging Face ``config.json`` dict (by its adapter), validated; HFError for
  anything jaxtrain does not compute the same way."""
  m = adapter(hf.get("model_type"), where, hf.get("architectures")).model_config(hf, where)
  c = base_config(model=m.name)
  c.model = m
  try:
    models.validate(c)
  except UserError as e:
    raise HFError(where, f"gives an invalid model ({e})", "check the config") from None
  return m


def hf_config(model: Any, base: dict | None = None, dtype: str = "float32") -> dict:
  """A ``config.json`` dict for the jaxtrain ``model`` group (its family's adapter), on top of ``base`` (the
  imported source's config.json, so that token ids and context length survive)."""
  return _exporter(model).hf_config(model, base, dtype)


def why_not_exportable(model: Any) -> str | None:
  """What of the ``model`` group its family's Hugging Face architecture does not compute (None: nothing)."""
  return _exporter(model).why_not_exportable(model)


def tensor_map(model: Any) -> list[hf_adapter.Tensor]:
  """Every Hugging Face tensor of the model (:class:`hf_adapter.Tensor`: name, jaxtrain path, index in a stacked
  param or None, HF shape, whether a Linear weight), by its family's adapter."""
  return _exporter(model).tensors(model)


def _get(tree: dict, path: tuple[str, ...]):
  for p in path:
    tree = tree[p]
  return tree


def to_jaxtrain(w: np.ndarray, target_shape: tuple[int, ...], is_linear: bool) -> np.ndarray:
  """An HF tensor in jaxtrain's layout (one layer's slice for stacked params)."""
  return (w.T if is_linear else w).reshape(target_shape)


def to_hf(x: np.ndarray, hf_shape: tuple[int, ...], is_linear: bool) -> np.ndarray:
  """A jaxtrain tensor (one layer's slice) in HF's layout, C-contiguous."""
  if is_linear:
    out_dim, in_dim = hf_shape
    return np.ascontiguousarray(x.reshape(in_dim, out_dim).T)
  return np.ascontiguousarray(x.reshape(hf_shape))


# ---------------------------------------------------------------------------------------------------------------
# safetensors: headers through safe_open (which checks the file is whole), data one tensor at a time.

class _Entry:
  """One tensor of a safetensors file: its shape from the header, its data read when asked (one at a time)."""
  __slots__ = ("file", "name", "shape")

  def __init__(self, file: str, name: str, shape: tuple[int, ...]):
    self.file, self.name, self.shape = file, name, shape

  def read(self) -> np.ndarray:
    # framework="flax": safetensors' numpy backend cannot hold bfloat16; on the CPU the jax array is a view.
    with safe_open(self.file, framework="flax") as f:
      if f.get_slice(self.name).get_dtype() in _RAW_DTYPES:  # which neither backend can hold: read as bytes
        return self._read_raw()
      return np.asarray(f.get_tensor(self.name))

  def _read_raw(self) -> np.ndarray:
    """The tensor's bytes (the header's ``data_offsets`` past the header) as its ml_dtypes type."""
    with open(self.file, "rb") as f:
      size = int.from_bytes(f.read(8), "little")
      entry = json.loads(f.read(size))[self.name]
      start, end = entry["data_offsets"]
      f.seek(8 + size + start)
      data = f.read(end - start)
    return np.frombuffer(data, _RAW_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def _header(path: str) -> dict[str, _Entry]:
  try:
    with safe_open(path, framework="flax") as f:  # validates the header against the file size
      return {name: _Entry(path, name, tuple(f.get_slice(name).get_shape())) for name in f.keys()}
  except (SafetensorError, OSError, ValueError) as e:
    raise HFError(path, f"is not a readable safetensors file ({' '.join(str(e).split())})",
                  "the file is truncated or corrupt: download it again") from None


INDEX = "model.safetensors.index.json"


def _weight_map(index: str) -> dict[str, str]:
  """The ``weight_map`` of the safetensors index file ``index``, every file it names checked to be a file in the
  index's folder (an index may come from anywhere: its names become paths to read, and to write a local copy to)."""
  try:
    weight_map = json.loads(open(index).read())["weight_map"]
  except (ValueError, KeyError) as e:
    raise HFError(index, f"is not a safetensors index ({e})", "download it again") from None
  if not isinstance(weight_map, dict):
    raise HFError(index, "is not a safetensors index (its weight_map is not a mapping)", "download it again")
  for name, file in weight_map.items():  # file names in the folder; read as written (a hub cache's are links)
    if not isinstance(file, str) or os.path.isabs(file) or os.path.normpath(file).split(os.sep)[0] in ("..", "."):
      raise HFError(index, f"maps {name} to {file!r}, not a file in the folder", "an index names files next to "
                    "it: download the model again, or write the entry as the file's name in the folder")
  return weight_map


def _find_weights(hf_dir: str) -> dict[str, _Entry]:
  index = os.path.join(hf_dir, INDEX)
  if os.path.exists(index):
    weight_map = _weight_map(index)
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    weight_map = None
  if not files:
    bins = [f for f in os.listdir(hf_dir) if f.endswith(".bin")]
    raise HFError(hf_dir, "holds no *.safetensors weights" + (" (only PyTorch .bin files)" if bins else ""),
                  "convert it to safetensors (save_pretrained(..., safe_serialization=True)) first")
  entries: dict[str, _Entry] = {}
  for f in files:
    path = os.path.join(hf_dir, f)
    if not os.path.exists(path):
      raise HFError(path, "is missing (named in model.safetensors.index.json)", "download it again")
    entries.update(_header(path))
  if weight_map is not None:
    absent = sorted(set(weight_map) - set(entries))
    if absent:
      raise HFError(index, f"names {absent[0]}, which its file does not hold", "download the model again")
  return entries


def _write_safetensors(path: str, tensors: list[tuple[str, tuple[int, ...], np.dtype]], produce) -> None:
  """Writes a safetensors file tensor by tensor: ``tensors`` gives name, shape and dtype in file order,
  ``produce(name)`` each array when its turn comes (so only one is in memory). Written here because
  ``safetensors.numpy.save_file`` takes every tensor at once (the whole model in host memory again) and has no
  streaming writer; the format is the library's (8-byte header length, JSON header, data), and the tests read the
  files back with transformers."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, shape, dtype in tensors:
    size = math.prod(shape) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _code(np.dtype(dtype)), "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as fh:
    fh.write(struct.pack("<Q", len(blob)))
    fh.write(blob)
    for name, shape, dtype in tensors:
      array = produce(name)
      assert array.shape == tuple(shape) and array.dtype == dtype, (name, array.shape, array.dtype)
      fh.write(array.tobytes())


# ---------------------------------------------------------------------------------------------------------------
# Output folders: on a local disk built next to the output and renamed into place; on an object store written in
# place, the file its readers open first last. Object stores' faults told apart.

UNFINISHED = ".convert_hf-unfinished"  # on a store: an output's first object, deleted once the output is complete


class _Output:
  """The folder ``output`` a conversion writes, local or on an object store; an existing one is refused (nothing is
  overwritten). Used as ``with _Output(output, last) as out:`` then ``out.path(name)`` (where Orbax writes) and
  ``with out.file(name) as local:`` (a file written to the local path ``local``, in the folder once the block ends).

  On a local disk it is built in a temporary folder next to ``output`` and renamed into place: a reader sees all of
  it or nothing. An object store has no rename of a folder (each object is copied, then deleted: every byte written
  twice, and a reader still sees a part of it meanwhile), so there it is written in place, and a part never looks
  like the whole: each file is uploaded whole once written (an object appears when its upload completes, never a
  part of it), ``last`` (the file its readers open first: an HF folder's config.json, an import's config.py) is
  uploaded last, and :data:`UNFINISHED` is written first and deleted at the end. A failure deletes what was written
  where the store still answers; what a failure leaves (the store stopped answering, the process was killed) has no
  ``last`` and holds UNFINISHED, which tells the next conversion into it that it may clear it and start over."""

  def __init__(self, output: str, last: str):
    self.on_store, self.last = stores.is_store(output), last
    if not self.on_store:
      self.output = os.path.abspath(output)
      if os.path.exists(self.output):
        raise HFError(output, "already exists", "choose a new output folder (nothing is overwritten)")
      parent = os.path.dirname(self.output)
      os.makedirs(parent, exist_ok=True)
      self.folder = tempfile.mkdtemp(prefix=f".{os.path.basename(self.output)}.tmp-", dir=parent)
      return
    self.output = self.folder = output.rstrip("/")
    with _store_faults(self.output):
      self.fs, self.root = fsspec.core.url_to_fs(self.output)
      self.fs.invalidate_cache()  # listings cached before another client (Orbax) wrote
      if self.fs.exists(self.root):
        if not self.fs.exists(f"{self.root}/{UNFINISHED}") or self.fs.exists(f"{self.root}/{last}"):
          raise HFError(output, "already exists", "choose a new output folder (nothing is overwritten)")
        logging.warning("%s: an unfinished conversion (%s): cleared, starting over", output, UNFINISHED)
        self.fs.rm(self.root, recursive=True)
      self.fs.pipe_file(f"{self.root}/{UNFINISHED}", b"")

  def path(self, *parts: str) -> str:
    """Where to write ``parts`` now (on a local disk: in the temporary folder)."""
    return paths.join(self.folder, *parts)

  def final(self, *parts: str) -> str:
    """Where ``parts`` will be once the output is complete."""
    return paths.join(self.output, *parts)

  @contextlib.contextmanager
  def file(self, name: str):
    """The local path to write the folder's file ``name`` (``a/b``: in a subfolder) to; in the folder once the block
    ends (on a store: uploaded from a temporary file, which is then deleted), not at all if it raises."""
    if not self.on_store:
      os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
      yield self.path(name)
      return
    with tempfile.TemporaryDirectory(prefix="jaxtrain-hf-") as tmp:
      local = os.path.join(tmp, os.path.basename(name))
      yield local
      with _store_faults(self.output):
        self.fs.put_file(local, f"{self.root}/{name}")

  def __enter__(self) -> "_Output":
    return self

  def __exit__(self, kind, value, tb):
    if not self.on_store:
      if kind is None:
        os.rename(self.folder, self.output)
      else:
        shutil.rmtree(self.folder, ignore_errors=True)
      return False
    if kind is None:
      with _store_faults(self.output):
        self.fs.rm_file(f"{self.root}/{UNFINISHED}")
      return False
    # Every object under the output is this conversion's: it did not exist, or was an unfinished one. The store that
    # failed the conversion may fail this too: then UNFINISHED stays, for the next conversion into it to clear.
    with contextlib.suppress(Exception):
      self.fs.invalidate_cache()
      self.fs.rm(self.root, recursive=True)
    return False


@contextlib.contextmanager
def _store_faults(where: str):
  """An object store's failure within the block as the user sees it: one a retry cures (the store did not answer,
  :func:`jaxtrain.stores.unreachable`) a Restart (exit 75), a refusal (:func:`jaxtrain.stores.refused`: 403, 401,
  a missing credential) an HFError (exit 2), both naming ``where``; UserErrors and Restarts pass. Nothing is
  told apart where ``where`` is a local path."""
  try:
    yield
  except (UserError, exits.Restart):
    raise
  except Exception as e:
    if not stores.is_store(where):
      raise
    cause = stores.unreachable(e)
    if cause is not None:
      raise exits.Restart(f"{where}: the object store did not answer ({checkpoint_lib.describe(cause)}); run the "
                          "same command again once it does (it clears an unfinished output)",
                          cause=exits.STORE_UNREACHABLE) from e
    cause = stores.refused(e)
    if cause is not None:
      raise HFError(where, f"the object store refused access ({checkpoint_lib.describe(cause)})",
                    "check the credentials (gs://: gcloud auth application-default login or "
                    "GOOGLE_APPLICATION_CREDENTIALS; s3://: AWS_ACCESS_KEY_ID / AWS_PROFILE) and the bucket's "
                    "permissions") from None
    raise


def _fetch(hf_url: str, into: str, weights: bool) -> None:
  """Copies what an import reads of the Hugging Face folder ``hf_url`` on an object store into the local folder
  ``into``: config.json, the side files and the index, then (``weights``) the weight files the index names (each a
  name in the folder, checked before it becomes a local path) or every ``*.safetensors``. safetensors' reader opens
  local files only, and the import reads each tensor where it lies in its file."""
  fs, root = fsspec.core.url_to_fs(hf_url)
  fs.invalidate_cache()
  if not weights:
    try:  # not fs.isdir, which takes a refusal (403) for "no"
      folder = fs.info(root)["type"] == "directory"
    except FileNotFoundError:
      folder = False
    if not folder:
      raise HFError(hf_url, "is not a folder", "pass --hf=a Hugging Face model folder")
    for name in dict.fromkeys(("config.json", INDEX, *SIDE_FILES)):
      if fs.exists(f"{root}/{name}"):
        fs.get_file(f"{root}/{name}", os.path.join(into, name))
    return
  if os.path.exists(os.path.join(into, INDEX)):
    weights = sorted(set(_weight_map(os.path.join(into, INDEX)).values()))
  else:
    weights = sorted(n for n in (p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
                     if n.endswith(".safetensors"))
  for name in weights:
    if fs.exists(f"{root}/{name}"):  # one named but absent: the import says which
      os.makedirs(os.path.dirname(os.path.join(into, name)), exist_ok=True)
      fs.get_file(f"{root}/{name}", os.path.join(into, name))


# ---------------------------------------------------------------------------------------------------------------
# Import.

def read_params(hf_dir: str, model: Any) -> tuple[dict, str]:
  """The jaxtrain params (nested dict of float32 numpy arrays) of an HF folder whose config gave ``model``, and
  the source weights' dtype name. Reads one tensor at a time into preallocated stacked arrays."""
  entries = _find_weights(hf_dir)
  found = _exporter(model)
  expected = found.tensors(model)
  stored = {name: how for name, *_ in expected for how in [found.stored_as(name, entries)]
            if how is not None}  # quantized: read from its parts (the tensor's own name may be one of them)
  known = {name for name, *_ in expected if name not in stored} | {p for parts, _ in stored.values() for p in parts}
  extra = sorted(n for n in entries if n not in known and not found.ignored(n, model))
  missing = sorted(known - set(entries))
  if missing or extra:
    what = f"has no {missing[0]}" if missing else f"has {extra[0]}, which a {model.name} model of this config has not"
    more = len(missing) + len(extra) - 1
    raise HFError(hf_dir, what + (f" (and {more} more)" if more else ""),
                  "the weights do not belong to this config.json")
  for name, _, _, shape, _ in expected:
    if name not in stored and entries[name].shape != shape:
      raise HFError(entries[name].file, f"{name} is {list(entries[name].shape)}, config.json says {list(shape)}",
                    "the weights do not match config.json")
  abstract = models.Model.from_config(model).abstract_params
  params = jax.tree.map(lambda a: np.empty(a.shape, np.float32), abstract)
  dtypes, written = set(), {}
  for name, path, layer, shape, is_linear in expected:
    if name in stored:
      parts, make = stored[name]
      w = make([entries[p].read() for p in parts])
      if w.shape != shape:
        raise HFError(entries[parts[0]].file, f"{name} ({' + '.join(parts)}) is {list(w.shape)}, config.json says "
                      f"{list(shape)}", "the weights do not match config.json")
    else:
      w = entries[name].read()
    dtypes.add(str(w.dtype))
    target = _get(params, path)
    where = (path, layer)
    if where in written:  # a copy of a shared tensor (DeepSeek-V3's MTP layers' embedding and head): equal, or refused
      if not np.array_equal(target if layer is None else target[layer], to_jaxtrain(
          w, target.shape if layer is None else target.shape[len(layer):], is_linear).astype(np.float32)):
        raise HFError(hf_dir, f"has {name} unequal to {written[where]}, which jaxtrain holds as one tensor",
                      "the weights do not belong to this config.json")
      continue
    written[where] = name
    if layer is None:
      target[...] = to_jaxtrain(w, target.shape, is_linear)
    else:
      target[layer] = to_jaxtrain(w, target.shape[len(layer):], is_linear)
    del w
  return params, dtypes.pop() if len(dtypes) == 1 else "float32"


def _to_jax(tree: dict) -> dict:
  """Replaces, in place and one leaf at a time, the numpy arrays of ``tree`` by XLA-owned jax arrays (each numpy
  leaf is freed once copied: peak host memory one model plus one leaf). Measured on the CPU backend:
  ``jax.device_put`` of a numpy array defers the copy, which the first computation on it (the checkpoint's
  fingerprint pass) then makes for every leaf at once; and Orbax writes jax arrays with one staging copy fewer
  than numpy arrays; ``jnp.array`` of a numpy array holds two copies; ``device_put(may_alias=False)`` one."""
  for key, value in tree.items():
    tree[key] = _to_jax(value) if isinstance(value, dict) else jax.block_until_ready(
        jax.device_put(value, may_alias=False))
  return tree


_CONFIG_PY = '''"""A jaxtrain config: the model tools/convert_hf.py imported from the Hugging Face folder SOURCE.

Fine-tune (starts from the imported params; set data.* for your data, prepared with the tokenizer in hf/):
  python -m jaxtrain.main --config=CONFIG
"""

from jaxtrain.config import base_config

SOURCE = {source!r}  # the Hugging Face folder imported
CONFIG = {path!r}  # this file


def get_config():
  c = base_config(model={family!r})
  c.workdir = {workdir!r}
  c.model.update(
{model}
  )
  # LoRA fine-tuning instead (the imported weights frozen, adapters trained; export merges them):
  # c.model.lora.update(rank=8, alpha=16.0, targets="q,k,v,o,gate,up,down")
  c.checkpoint.restore_from = {checkpoints!r}
  c.checkpoint.restore_mode = "params"
  return c
'''


def import_model(hf_dir: str, output: str) -> dict:
  """Converts the Hugging Face folder ``hf_dir`` into ``output`` (see the module docstring; either may be on an
  object store); returns a summary (params, bytes, source dtype)."""
  with contextlib.ExitStack() as stack:
    if stores.is_store(hf_dir):  # read from a local copy, made in two parts: the weights once the output is new
      source = hf_dir.rstrip("/")
      local = stack.enter_context(tempfile.TemporaryDirectory(prefix="jaxtrain-hf-"))
      stack.enter_context(_named_as(local, source))
      with _store_faults(source):
        _fetch(source, local, weights=False)
    else:
      source = local = os.path.abspath(hf_dir)
    config_file = os.path.join(local, "config.json")
    if not os.path.isdir(local):
      raise HFError(hf_dir, "is not a folder", "pass --hf=a Hugging Face model folder")
    if not os.path.exists(config_file):
      raise HFError(hf_dir, "has no config.json", "pass a Hugging Face model folder (config.json + *.safetensors)")
    try:
      hf = json.loads(open(config_file).read())
    except ValueError as e:
      raise HFError(config_file, f"is not JSON ({e})", "download it again") from None
    model = model_config(hf, config_file)
    with _Output(output, last="config.py") as out:  # refuses an existing output before any tensor is read
      if source != local:
        with _store_faults(source):
          _fetch(source, local, weights=True)
      model = _exporter(model).fitted(model, _find_weights(local))  # (what only the weights tell)
      params, dtype = read_params(local, model)
      meta = {"hf_import": {"source": source, "dtype": dtype}}
      config = base_config(model=model.name)
      config.model = model
      config.workdir = f"runs/{os.path.basename(out.output)}"
      params = _to_jax(params)
      ckpt = checkpoint_lib.PersistentTier(out.path("checkpoints"), async_save=False)  # fingerprinted
      try:
        ckpt.save(0, {"step": np.zeros((), np.int32), "params": params}, None, meta, config.to_dict(), force=True)
      except checkpoint_lib.NonFiniteState as e:
        raise HFError(hf_dir, f"holds {e}", "the source checkpoint is broken") from None
      finally:
        ckpt.close()
      nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
      count = sum(a.size for a in jax.tree.leaves(params))
      del params
      side = [f for f in SIDE_FILES if os.path.exists(os.path.join(local, f))]
      for f in side:
        with out.file(f"hf/{f}") as copy:
          shutil.copy2(os.path.join(local, f), copy)
      with out.file(lineage.FILE) as written:
        lineage.record_import(written, source, dtype, config.to_dict(), side)
      with out.file("config.py") as written, open(written, "w") as fh:  # last: the output is complete
        fh.write(_CONFIG_PY.format(  # every string a repr(): a path may hold quotes, backslashes, anything
            source=source, path=out.final("config.py"), workdir=config.workdir, family=model.name,
            model="\n".join(f"      {k}={v!r}," for k, v in model.items() if k not in ("name", "lora")),
            checkpoints=out.final("checkpoints")))
  return {"params": count, "bytes": nbytes, "source_dtype": dtype}


@contextlib.contextmanager
def _named_as(local: str, url: str):
  """A UserError raised within names ``url`` where it names ``local`` (the local copy of the folder ``url``)."""
  try:
    yield
  except UserError as e:
    raise type(e)(*(part.replace(local, url) for part in (e.subject, e.problem, e.fix))) from None


# ---------------------------------------------------------------------------------------------------------------
# Export.

def export_model(checkpoint: str, output: str, step: int | None = None, max_shard_mb: float = 5000,
                 dtype: str = "auto", tokenizer: str = "") -> dict:
  """Writes the jaxtrain checkpoint ``checkpoint`` (a workdir, its checkpoints folder or a step folder; the newest
  step unless ``step``) as an HF folder ``output``: config.json, model.safetensors (shards of at most
  ``max_shard_mb`` MB plus model.safetensors.index.json when larger) and the imported source's tokenizer and
  generation files (its lineage's ``hf/``: jaxtrain.checkpoint.lineage), or those of ``tokenizer`` (a Hugging Face
  tokenizer folder or file) instead. A checkpoint whose lineage carries no tokenizer is refused without ``tokenizer``
  (an export is a complete Hugging Face folder: transformers loads a folder without one as an empty tokenizer).
  ``dtype``: float32, bfloat16, float16 or auto (the imported source's dtype, else float32)."""
  if dtype not in _EXPORT_DTYPES + ("auto",):
    raise HFError("--dtype", f"'{dtype}' is not one of auto, {', '.join(_EXPORT_DTYPES)}", "pick one of them")
  if max_shard_mb <= 0:
    raise HFError("--max_shard_mb", f"must be > 0, got {max_shard_mb}", "fix the value")
  tokenizer = paths.resolve(tokenizer, "--tokenizer") if tokenizer else ""
  if tokenizer and not epath.Path(tokenizer).exists():
    raise HFError(f"--tokenizer={tokenizer}", "does not exist", "pass a Hugging Face tokenizer folder or its "
                  "tokenizer.json")
  if tokenizer and epath.Path(tokenizer).is_dir() and not lineage.has_tokenizer(tokenizer):
    raise HFError(f"--tokenizer={tokenizer}", "is a folder without tokenizer.json or tokenizer.model",
                  "pass a Hugging Face tokenizer folder")
  with _store_faults(checkpoint):
    return _export(checkpoint, output, step, max_shard_mb, dtype, tokenizer)


def _export(checkpoint: str, output: str, step: int | None, max_shard_mb: float, dtype: str, tokenizer: str) -> dict:
  step_dir = checkpoint_lib.step_dir(checkpoint, step)
  config = checkpoint_lib.saved_config(step_dir)
  name = (config.get("model") or {}).get("name")
  exporter = hf_adapter.for_family(name)
  if exporter is None:
    families = sorted({a.family for _, a in hf_adapter.ADAPTERS.items()})
    raise HFError(step_dir, f"holds a '{name}' model", f"only {', '.join(families)} checkpoints can be exported")
  model = models.defaults(name)
  model.update(**{k: v for k, v in config["model"].items() if k in model})
  why = exporter.why_not_exportable(model)
  if why:
    raise HFError(step_dir, f"holds a {name} model that {why}", f"only what the {exporter.model_type} "
                  "architecture computes can be exported")
  side = checkpoint_lib.side_files_dir(step_dir, config)
  if not tokenizer and not lineage.has_tokenizer(side):
    raise HFError(step_dir, "carries no tokenizer (" + (f"{side} has neither {' nor '.join(lineage.TOKENIZER_FILES)}"
                  if side else "its run and the runs it started from have no hf/ folder") + ")",
                  "pass --tokenizer=a Hugging Face tokenizer folder (an export without one loads as an empty "
                  "tokenizer)")
  meta_file = epath.Path(step_dir) / "meta" / "metadata"  # local or on an object store
  meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
  if dtype == "auto":
    dtype = (meta.get("hf_import") or {}).get("dtype", "float32")
    dtype = dtype if dtype in _EXPORT_DTYPES else "float32"
  np_dtype = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
  base_file = epath.Path(side) / "config.json" if side else None
  base = json.loads(base_file.read_text()) if base_file and base_file.exists() else None
  with _Output(output, last="config.json") as out:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    abstract = models.Model.from_config(model).abstract_params
    adapted = lora.active(model)

    def restore_leaf(path: tuple[str, ...]) -> np.ndarray:
      """One param of the checkpoint (fingerprint-checked), with a LoRA run's adapters merged into it."""
      wanted = {}
      lora._set(wanted, path, _get(abstract, path))
      adapter = (lora.KEY, *path[:-1])
      if adapted and path[-1] == lora.KERNEL and lora._has(abstract, adapter):
        lora._set(wanted, adapter, _get(abstract, adapter))
      wanted = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), wanted)
      target = TrainState(step=jax.ShapeDtypeStruct((), np.int32, sharding=device), params=wanted, opt_state={})
      restored, _ = checkpoint_lib.restore_from(step_dir, target, params_only=True, subset=True)
      # A LoRA run's checkpoint holds base + adapters: written as the merged plain weights (W + alpha/rank A B).
      params = lora.merge(restored["params"], model.lora) if adapted else restored["params"]
      return np.asarray(_get(params, path))

    # One param (all layers of a stacked one) in host memory at a time, not the whole model (Orbax restores a
    # tree at once): the tensors are written grouped by param, so each is restored once.
    tensors = exporter.tensors(model)
    order = list(dict.fromkeys(path for _, path, _, _, _ in tensors))
    tensors.sort(key=lambda t: order.index(t[1]))
    by_name = {name: (path, layer, shape, is_linear) for name, path, layer, shape, is_linear in tensors}
    current: dict[tuple[str, ...], np.ndarray] = {}

    def produce(name):
      path, layer, shape, is_linear = by_name[name]
      if path not in current:
        current.clear()
        current[path] = restore_leaf(path)
      x = current[path]
      return to_hf(x if layer is None else x[layer], shape, is_linear).astype(np_dtype)

    limit = max_shard_mb * 1e6
    shards, size = [[]], 0
    for name, _, _, shape, _ in tensors:
      nbytes = math.prod(shape) * np_dtype.itemsize
      if shards[-1] and size + nbytes > limit:
        shards.append([])
        size = 0
      shards[-1].append((name, shape, np_dtype))
      size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
      file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      with out.file(file) as written:
        _write_safetensors(written, shard, produce)
      weight_map.update({name: file for name, _, _ in shard})
    total = sum(math.prod(s) * np_dtype.itemsize for _, s, _ in (t for shard in shards for t in shard))
    if len(shards) > 1:
      with out.file(INDEX) as written, open(written, "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    carried = {}  # name -> where from: the lineage's side files, the tokenizer's over them
    tokenizer_dir = tokenizer if tokenizer and epath.Path(tokenizer).is_dir() else None
    for folder in filter(None, (side, tokenizer_dir)):
      carried.update({f: epath.Path(folder) / f for f in SIDE_FILES[1:] if (epath.Path(folder) / f).exists()})
    if tokenizer and not tokenizer_dir:
      name = "tokenizer.json" if tokenizer.endswith(".json") else "tokenizer.model"
      carried = {f: p for f, p in carried.items() if f not in lineage.TOKENIZER_FILES}
      carried[name] = epath.Path(tokenizer)
    for f, source in carried.items():
      with out.file(f) as written:
        source.copy(written)
    with out.file("config.json") as written, open(written, "w") as fh:  # last: what a reader opens first
      json.dump(exporter.hf_config(model, base, dtype), fh, indent=2)
  return {"step_dir": step_dir, "bytes": total, "shards": len(shards), "dtype": dtype}

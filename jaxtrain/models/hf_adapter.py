"""The Hugging Face adapter contract: how one ``model_type`` of a Hugging Face ``config.json`` maps onto a jaxtrain
family, both ways, and the registry that jaxtrain/hf.py reads (:data:`ADAPTERS`, by ``model_type``).

jaxtrain/hf.py does what every family shares (finding and streaming safetensors, sharded writing, the tokenizer and
generation files, the output folder built aside and renamed into place) and asks the checkpoint's adapter for the
rest: the model group a config.json gives, the config.json a model group gives, every tensor's name, jaxtrain param
and layout, and what of a model group the architecture does not compute. An adapter lives in its family's folder
(``jaxtrain/models/llama/hf.py``, ``jaxtrain/models/moe/hf.py``) or in any module a user imports
(``tests/gpt2_family.py``); one ``register`` call adds it.
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import ml_collections

from jaxtrain.errors import UserError
from jaxtrain.registry import Registry


class HFError(UserError):
  """A Hugging Face folder or checkpoint the converter cannot take (printed as one line, exit code 2)."""


class Tensor(NamedTuple):
  """One Hugging Face tensor and where it lives in jaxtrain's params."""
  name: str  # the Hugging Face name
  path: tuple[str, ...]  # the jaxtrain param
  index: tuple[int, ...] | None  # where it sits in a stacked param: (layer,), (layer, expert); None: the whole param
  shape: tuple[int, ...]  # the Hugging Face shape
  linear: bool  # a torch Linear weight ([out, in]): the transpose of jaxtrain's kernel as [in, out]; else a reshape


class Adapter(abc.ABC):
  """One Hugging Face ``model_type`` (``architecture`` its transformers class) read as, and written from, the jaxtrain
  family ``family``. hf.py has checked the model_type and the ``architectures`` field before it calls
  :meth:`model_config`, and validates the model group after it."""
  model_type: str
  family: str
  architecture: str

  @abc.abstractmethod
  def model_config(self, hf: dict, where: str) -> ml_collections.ConfigDict:
    """The family's ``model`` group of a ``config.json`` dict; :class:`HFError` (naming ``where``) for anything the
    family does not compute the same way."""

  @abc.abstractmethod
  def hf_config(self, model: Any, base: dict | None, dtype: str) -> dict:
    """The ``config.json`` dict of the ``model`` group, on top of ``base`` (the imported source's config.json, None
    for a model trained from scratch), ``torch_dtype`` ``dtype``."""

  @abc.abstractmethod
  def tensors(self, model: Any) -> list[Tensor]:
    """Every tensor of the model's Hugging Face checkpoint, in file order."""

  def why_not_exportable(self, model: Any) -> str | None:
    """What of the ``model`` group the architecture does not compute (None: nothing), as "sets model.x=..."."""
    del model
    return None

  def stored_as(self, name: str, names: Any) -> tuple[list[str], Any] | None:
    """How a checkpoint whose tensor names are ``names`` holds the tensor ``name`` when not as itself (quantized):
    the names of its parts (``name`` itself may be one: a quantized weight beside its scales) and ``make(arrays) ->
    np.ndarray`` (the tensor, from the parts read in that order); None: as itself."""
    del name, names
    return None

  def fitted(self, model: Any, names: Any) -> Any:
    """The ``model`` group of a source checkpoint whose tensor names are ``names``, where the weights tell what
    config.json does not (DeepSeek-V3's multi-token-prediction layers: present or not); ``model`` by default."""
    del names
    return model

  def ignored(self, name: str, model: Any) -> bool:
    """Whether a tensor of a source checkpoint that :meth:`tensors` does not name is skipped (a buffer, a tied
    copy); else the import refuses the folder."""
    del name, model
    return False


ADAPTERS: Registry[Adapter] = Registry("model_type", "Hugging Face model_type",
                                       how="jaxtrain.models.hf_adapter.register")
REFUSED: dict[str, tuple[str, str]] = {}  # model_type -> (what it is, what to do instead): named, not read


def register(adapter: Adapter) -> Adapter:
  """Registers ``adapter`` under its ``model_type`` (then tools/convert_hf.py imports such checkpoints, and exports
  its family's)."""
  return ADAPTERS.register(adapter.model_type, adapter)


def refuse(model_type: str, problem: str, fix: str) -> None:
  """A ``model_type`` the import names with its own line instead of "not supported" (a multimodal sibling)."""
  REFUSED[model_type] = (problem, fix)


def for_family(name: str) -> Adapter | None:
  """The adapter that exports family ``name`` (the first registered, by model_type, that reads it), or None."""
  return next((a for _, a in ADAPTERS.items() if a.family == name), None)


def require_ints(hf: dict, where: str, keys) -> None:
  """HFError naming ``where`` and every key of ``keys`` that the config.json dict ``hf`` lacks as an integer."""
  missing = [k for k in keys if not isinstance(hf.get(k), int)]
  if missing:
    raise HFError(where, f"has no integer {', '.join(missing)}", "pass a complete config.json")


def rope_of(hf: dict) -> dict:
  """The RoPE parameters of a config.json dict: transformers 5 writes ``rope_parameters`` (``rope_theta`` inside),
  4.x and the hub's files ``rope_theta`` and ``rope_scaling``."""
  return dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})


def default_or_yarn_rope(hf: dict, where: str, family: str) -> dict:
  """:func:`rope_of` for a family that takes default or YaRN RoPE only; HFError naming ``where`` for another type."""
  rope = rope_of(hf)
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ("default", "yarn"):
    raise HFError(where, f"uses RoPE type {rope_type!r}", f"{family} imports take default or yarn RoPE")
  return rope


def inherited(base: dict | None, *also: str) -> dict:
  """The source's config.json keys an export keeps: all but the RoPE, dtype and version keys it writes anew, the
  source's own modeling code (``auto_map``: the export carries no code) and ``also``."""
  dropped = ("rope_parameters", "rope_scaling", "rope_theta", "torch_dtype", "dtype", "transformers_version",
             "auto_map", *also)
  return {k: v for k, v in (base or {}).items() if k not in dropped}


def yarn_from_hf(rope: dict, where: str, mscale: bool = False) -> dict:
  """A Hugging Face ``rope_scaling`` / ``rope_parameters`` of type default or yarn as jaxtrain's model keys
  (``mscale``: DeepSeek's two attention-scale keys too); one HFError line naming a missing key."""
  if rope.get("rope_type", rope.get("type", "default")) != "yarn":
    return {"rope_scaling": ""}
  try:
    keys = dict(rope_scaling="yarn", rope_scaling_factor=float(rope["factor"]),
                rope_original_max_positions=int(rope["original_max_position_embeddings"]),
                rope_yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
                rope_yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
                rope_yarn_truncate=bool(rope.get("truncate", True)))
    if mscale:
      keys.update(rope_yarn_mscale=float(rope.get("mscale") or 0.0),
                  rope_yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
  except (KeyError, TypeError) as e:
    raise HFError(where, f"has YaRN RoPE without {e.args[0]}", "pass a complete config.json") from None
  return keys


def yarn_to_hf(model: Any, **extra) -> dict | None:
  """The ``rope_scaling`` a model group with YaRN RoPE writes (plus the family's ``extra`` keys); None without."""
  if model.get("rope_scaling") != "yarn":
    return None
  return {"rope_type": "yarn", "factor": model.rope_scaling_factor, "beta_fast": model.rope_yarn_beta_fast,
          "beta_slow": model.rope_yarn_beta_slow, **extra,
          "original_max_position_embeddings": model.rope_original_max_positions}


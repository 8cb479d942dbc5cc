"""Hugging Face checkpoints in and out (``tools/convert_hf.py``): Llama, Mixtral, Qwen 2.5, Qwen 3 (dense and MoE),
Mistral, Gemma 2, Gemma 3 (text) and OLMoE, by the ``model_type`` of their ``config.json`` (:data:`ARCHITECTURES`:
each is a jaxtrain family, docs/models.md).

:func:`import_model` turns a Hugging Face folder (``config.json``, ``*.safetensors`` with or
without ``model.safetensors.index.json``, tokenizer files) into ``OUT/checkpoints/0`` (a jaxtrain checkpoint that
``checkpoint.restore_from`` with ``restore_mode=params`` starts from), ``OUT/config.py`` (a config file for
``python -m jaxtrain.main``) and ``OUT/hf/`` (the source's config.json, tokenizer and generation files, which
:func:`export_model` writes back). :func:`export_model` writes a jaxtrain checkpoint (imported or trained) as such
a folder. Tensors are read and written one at a time (peak host memory: import about 1.5 x the float32 model,
export one param);
params are float32 (a bfloat16 or float16 source converts exactly, and exports back bitwise with that ``dtype``).

Layouts: HF Linear weights are ``[out, in]``; jaxtrain kernels are ``[in, ...out]`` (q/k/v ``[d, heads,
head_dim]``, o ``[heads, head_dim, d]``, MLP ``[in, out]``), stacked over a leading layers axis. A Mixtral
(``MixtralForCausalLM``, the hub's per-expert ``block_sparse_moe.experts.E.w1/w2/w3`` tensors) is the ``moe``
family: router ``[d, E]``, experts stacked ``[layers, E, in, out]`` (Qwen 3 MoE's and OLMoE's ``mlp.experts.E.
{gate,up,down}_proj`` alike). Gemma's four norms per layer: ``input_layernorm`` -> ``attn_norm``,
``post_attention_layernorm`` -> ``post_attn_norm`` (on the attention's output, unlike Llama's, which is the MLP's
input norm), ``pre_feedforward_layernorm`` -> ``mlp_norm``, ``post_feedforward_layernorm`` -> ``post_mlp_norm``;
their ``1 + w`` weights are stored as they are (jaxtrain's RMSNorm adds the 1: ``model.norm_plus_one``). jaxtrain's RoPE
rotates the two halves of head_dim, which is HF's ``rotate_half`` convention: q and k need no permutation.

Every mistake in the input (another architecture, biases it has not, an unknown RoPE type, missing or truncated files,
an index naming files outside the folder, shapes that disagree with the config, an existing output) is a
:class:`HFError` (a UserError), raised before anything is written; outputs are built in a temporary folder next to
the output and renamed into place.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from typing import Any

import jax
import ml_collections
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import models
from jaxtrain.config import base_config
from jaxtrain.errors import UserError
from jaxtrain.models import attention, lora
from jaxtrain.train.state import TrainState

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "added_tokens.json")
_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "F64": np.dtype(np.float64)}
_EXPORT_DTYPES = ("float32", "bfloat16", "float16")


class HFError(UserError):
  """A Hugging Face folder or checkpoint the converter cannot take (printed as one line, exit code 2)."""


def _bf16():
  return np.dtype(ml_dtypes.bfloat16)


def _code(dtype: np.dtype) -> str:
  return "BF16" if dtype == _bf16() else {v: k for k, v in _DTYPES.items()}[np.dtype(dtype)]


# ---------------------------------------------------------------------------------------------------------------
# The config.

# model_type -> (jaxtrain family, architecture class). The families are jaxtrain.models.families' flags over the
# Llama and MoE decoders.
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "mixtral": ("moe", "MixtralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "olmoe": ("olmoe", "OlmoeForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
}
GEMMA_TYPES = ("gemma2", "gemma3_text")
MOE_TYPES = ("mixtral", "qwen3_moe", "olmoe")


def _model_type(family: str) -> str:
  for model_type, (name, _) in ARCHITECTURES.items():
    if name == family:
      return model_type
  raise KeyError(family)


def _windows(hf: dict, where: str) -> tuple[int, int]:
  """``(sliding_window, global_every)`` of an HF config: its ``layer_types`` (transformers 4.5x+) when given, else
  Mistral's rule (a ``sliding_window`` applies to every layer); Qwen's ``use_sliding_window`` gates its window."""
  window = hf.get("sliding_window") or 0
  if "use_sliding_window" in hf and not hf["use_sliding_window"]:
    window = 0
  types = hf.get("layer_types")
  if not types:
    return window, 0
  local = [t == "sliding_attention" for t in types]
  if not any(local):
    return 0, 0
  if not window:
    raise HFError(where, "has sliding_attention layers and no sliding_window", "pass a complete config.json")
  if all(local):
    return window, 0
  every = local.index(False) + 1  # the first global layer is layer every - 1
  if local != [(i + 1) % every != 0 for i in range(len(local))]:
    raise HFError(where, "interleaves local and global layers in a pattern other than every Nth layer global",
                  "only such patterns (Gemma's, Mistral's all-local) are supported")
  return window, every


def model_config(hf: dict, where: str = "config.json") -> ml_collections.ConfigDict:
  """The jaxtrain ``model`` group of a Hugging Face ``config.json`` dict (one of :data:`ARCHITECTURES`); HFError
  for anything jaxtrain does not compute the same way."""
  model_type = hf.get("model_type")
  if model_type == "gemma3":
    raise HFError(where, "is a multimodal Gemma 3 (Gemma3ForConditionalGeneration)", "import a text-only "
                  "checkpoint (model_type gemma3_text, Gemma3ForCausalLM, e.g. gemma-3-1b-pt)")
  if model_type not in ARCHITECTURES:
    raise HFError(where, f"is a {model_type!r} model ({', '.join(map(str, hf.get('architectures') or []))}), "
                  f"which jaxtrain does not import", f"supported model_types: {', '.join(ARCHITECTURES)}")
  family, cls = ARCHITECTURES[model_type]
  arch = hf.get("architectures") or [cls]
  if arch != [cls]:
    raise HFError(where, f"names the architecture {', '.join(map(str, arch))}", f"a {model_type} checkpoint to "
                  f"import is a {cls}")
  if model_type == "qwen2" and hf.get("attention_bias") is False:  # Qwen 2 always has q/k/v biases
    raise HFError(where, "sets attention_bias=false for a qwen2 model", "pass the model's own config.json")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key) and model_type != "qwen2":
      raise HFError(where, f"sets {key}=true", f"jaxtrain's {family} has no biases there; not supported")
  activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
  expected = "gelu_pytorch_tanh" if model_type in GEMMA_TYPES else "silu"
  if activation != expected:
    raise HFError(where, f"uses the activation {activation!r}", f"only {expected} {model_type} MLPs are supported")
  if hf.get("clip_qkv") is not None:
    raise HFError(where, f"sets clip_qkv={hf['clip_qkv']}", "clipped q/k/v projections are not supported")
  if model_type == "qwen3_moe" and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
    raise HFError(where, "mixes dense and sparse layers (decoder_sparse_step / mlp_only_layers)",
                  "only Qwen 3 MoE models whose every layer is sparse are supported")
  missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                         "intermediate_size") if not isinstance(hf.get(k), int)]
  if missing:
    raise HFError(where, f"has no integer {', '.join(missing)}", "pass a complete config.json")
  # transformers 5 writes rope_parameters (with rope_theta inside); 4.x writes rope_theta and rope_scaling.
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  local_rope = {}
  if "full_attention" in rope:  # Gemma 3: RoPE per layer type
    rope, local_rope = dict(rope["full_attention"] or {}), dict(rope.get("sliding_attention") or {})
    if local_rope.get("rope_type", "default") != "default":
      raise HFError(where, f"scales the local layers' RoPE ({local_rope['rope_type']})", "only unscaled local "
                    "RoPE is supported")
  theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    raise HFError(where, f"sets partial_rotary_factor={rope['partial_rotary_factor']}",
                  "only full-head RoPE is supported")
  heads = hf["num_attention_heads"]
  window, every = _windows(hf, where)
  m = models.defaults(family)
  m.update(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
           num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
           head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
           rope_theta=float(theta), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
           tie_embeddings=bool(hf.get("tie_word_embeddings", model_type in GEMMA_TYPES)), sliding_window=window,
           global_every=every)
  if model_type in GEMMA_TYPES:
    m.update(attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
             final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
             query_scale=float(hf.get("query_pre_attn_scalar", m.head_dim)) ** -0.5,
             rope_local_theta=float(local_rope.get("rope_theta", 0.0)))
  if model_type in MOE_TYPES:  # transformers' load-balancing loss is experts_per_token x jaxtrain's (models/moe.py)
    k = int(hf.get("num_experts_per_tok", 2))
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 8
    m.update(num_experts=int(experts), experts_per_token=k,
             expert_mlp_dim=hf["moe_intermediate_size"] if model_type == "qwen3_moe" else hf["intermediate_size"],
             router_scores="softmax", normalize_topk=bool(hf.get("norm_topk_prob", True)),
             load_balance_weight=float(hf.get("router_aux_loss_coef", 0.02)) * k, router_z_weight=0.0)
  if rope_type == "llama3":
    try:
      m.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
               rope_low_freq_factor=float(rope["low_freq_factor"]),
               rope_high_freq_factor=float(rope["high_freq_factor"]),
               rope_original_max_positions=int(rope["original_max_position_embeddings"]))
    except KeyError as e:
      raise HFError(where, f"has llama3 RoPE scaling without {e.args[0]}", "pass a complete config.json") from None
  elif rope_type == "linear":
    m.update(rope_scaling="linear", rope_scaling_factor=float(rope.get("factor", 1.0)))
  elif rope_type != "default":
    raise HFError(where, f"uses RoPE type {rope_type!r}", "only default, linear and llama3 RoPE are supported")
  c = base_config(model=m.name)
  c.model = m
  try:
    models.validate(c)
  except UserError as e:
    raise HFError(where, f"gives an invalid model ({e})", "check the config") from None
  return m


def hf_config(model: Any, base: dict | None = None, dtype: str = "float32") -> dict:
  """A ``config.json`` dict for the jaxtrain ``model`` group (its family's architecture), on top of ``base`` (the
  imported source's config.json, so that token ids and context length survive): the architecture keys are
  jaxtrain's, RoPE is written as ``rope_theta`` + ``rope_scaling`` (read by transformers 4.45+ and 5)."""
  model_type = _model_type(model.name)
  out = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "rope_theta",
                                                            "torch_dtype", "dtype", "transformers_version")}
  out.update(architectures=[ARCHITECTURES[model_type][1]], model_type=model_type, vocab_size=model.vocab_size,
             hidden_size=model.d_model, intermediate_size=model.mlp_dim, num_hidden_layers=model.num_layers,
             num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
             hidden_act="silu", rms_norm_eps=model.norm_eps, rope_theta=model.rope_theta,
             tie_word_embeddings=bool(model.tie_embeddings), torch_dtype=dtype)
  if model_type in ("llama", "qwen3", "qwen3_moe", "olmoe") + GEMMA_TYPES:
    out.update(attention_bias=False)
  if model_type == "llama":
    out.update(mlp_bias=False)
  windows = attention.layer_windows(model)
  out["sliding_window"] = model.sliding_window or None
  if model_type in ("qwen2", "qwen3", "qwen3_moe"):
    out.update(use_sliding_window=bool(model.sliding_window), max_window_layers=0)
  if model_type in GEMMA_TYPES:
    scalar = model.query_scale ** -2 if model.query_scale else model.head_dim
    out.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
               query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
               attn_logit_softcapping=model.attn_softcap or None, final_logit_softcapping=model.final_softcap or None)
  if model_type in ("qwen2", "qwen3") + GEMMA_TYPES:  # (Qwen 3 MoE's config has no layer_types)
    out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows]
  if model_type in MOE_TYPES:
    out.update(num_local_experts=model.num_experts, num_experts_per_tok=model.experts_per_token,
               router_aux_loss_coef=model.load_balance_weight / model.experts_per_token)
    if model_type == "mixtral":
      out.update(intermediate_size=model.expert_mlp_dim)
    elif model_type == "olmoe":  # its intermediate_size is the experts'
      out.update(num_experts=model.num_experts, intermediate_size=model.expert_mlp_dim,
                 norm_topk_prob=bool(model.normalize_topk), clip_qkv=None)
    else:
      out.update(num_experts=model.num_experts, moe_intermediate_size=model.expert_mlp_dim,
                 norm_topk_prob=bool(model.normalize_topk), decoder_sparse_step=1, mlp_only_layers=[])
  out.setdefault("max_position_embeddings", model.rope_original_max_positions * (
      int(model.rope_scaling_factor) if model.get("rope_scaling") else 1))
  out.setdefault("initializer_range", 0.02)
  scaling = {"llama3": {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                        "low_freq_factor": model.rope_low_freq_factor,
                        "high_freq_factor": model.rope_high_freq_factor,
                        "original_max_position_embeddings": model.rope_original_max_positions},
             "linear": {"rope_type": "linear", "factor": model.rope_scaling_factor}}.get(model.get("rope_scaling"))
  if model_type == "gemma3_text":  # RoPE per layer type, as transformers 5 writes it
    out.pop("rope_theta")
    out["rope_parameters"] = {"full_attention": {**(scaling or {"rope_type": "default"}),
                                                 "rope_theta": model.rope_theta},
                              "sliding_attention": {"rope_type": "default",
                                                    "rope_theta": model.rope_local_theta or model.rope_theta}}
  else:
    out["rope_scaling"] = scaling
  return out


# The attention variants each architecture computes: ``True`` must be on, ``False`` may be (else off).
_GEMMA = {"norm_plus_one": True, "embed_scale": True, "sandwich_norms": True, "sliding_window": False,
          "global_every": False, "query_scale": False}
_VARIANTS = {"llama": {}, "mistral": {"sliding_window": False}, "mixtral": {"sliding_window": False},
             "qwen2": {"qkv_bias": True, "sliding_window": False, "global_every": False},
             "qwen3": {"qk_norm": "head", "sliding_window": False, "global_every": False},
             "qwen3_moe": {"qk_norm": "head"}, "olmoe": {"qk_norm": "full"},
             "gemma2": {**_GEMMA, "attn_softcap": False, "final_softcap": False},
             "gemma3_text": {**_GEMMA, "qk_norm": "head", "rope_local_theta": False}}
_VARIANT_FLAGS = ("qkv_bias", "qk_norm", "sliding_window", "global_every", "attn_softcap", "final_softcap",
                  "query_scale", "rope_local_theta", "norm_plus_one", "embed_scale", "sandwich_norms")


def why_not_exportable(model: Any) -> str | None:
  """What of the ``model`` group its family's Hugging Face architecture does not compute (None: nothing)."""
  model_type = _model_type(model.name)
  allowed = _VARIANTS[model_type]
  for flag in _VARIANT_FLAGS:
    if model.get(flag) and flag not in allowed:
      return f"sets model.{flag}={model.get(flag)}, which {model_type} has not"
    if allowed.get(flag) and model.get(flag) != allowed[flag]:
      return f"has model.{flag}={model.get(flag)!r}, where {model_type} always has {allowed[flag]!r}"
  activation = "gelu_tanh" if model_type in GEMMA_TYPES else "silu"
  if model.get("mlp_activation", "silu") != activation:
    return f"sets model.mlp_activation={model.mlp_activation}, where {model_type} has {activation}"
  if model_type in MOE_TYPES and (model.num_shared_experts or model.first_dense_layers
                                  or model.router_scores != "softmax"
                                  or (model_type == "mixtral" and not model.normalize_topk)):
    return ("is not Mixtral / Qwen 3 MoE-shaped (shared experts, dense first layers, sigmoid scores or unnormalized "
            "top-k)")
  return None


# ---------------------------------------------------------------------------------------------------------------
# Tensor names and layouts.

def tensor_map(model: Any) -> list[tuple[str, tuple[str, ...], tuple[int, ...] | None, tuple[int, ...], bool]]:
  """``(hf_name, jaxtrain path, index or None, hf_shape, is_linear)`` for every tensor of the model: ``index`` is
  where the tensor sits in a stacked param (``(layer,)``, or ``(layer, expert)`` for an MoE's experts). A linear
  weight (``[out, in]`` in HF) is the transpose of jaxtrain's kernel reshaped to ``[in, out]``."""
  model_type = _model_type(model.name)
  d, n, k, h, v = model.d_model, model.num_heads, model.num_kv_heads, model.head_dim, model.vocab_size
  f = model.expert_mlp_dim if model_type in MOE_TYPES else model.mlp_dim
  out = [("model.embed_tokens.weight", ("embed", "embedding"), None, (v, d), False),
         ("model.norm.weight", ("final_norm", "scale"), None, (d,), False)]
  if not model.tie_embeddings:
    out.append(("lm_head.weight", ("lm_head", "kernel"), None, (v, d), True))
  per_layer = [("self_attn.q_proj.weight", ("attn", "q", "kernel"), (n * h, d), True),
               ("self_attn.k_proj.weight", ("attn", "k", "kernel"), (k * h, d), True),
               ("self_attn.v_proj.weight", ("attn", "v", "kernel"), (k * h, d), True),
               ("self_attn.o_proj.weight", ("attn", "o", "kernel"), (d, n * h), True)]
  if model.qkv_bias:
    per_layer += [(f"self_attn.{x}_proj.bias", ("attn", x, "bias"), (heads * h,), False)
                  for x, heads in (("q", n), ("k", k), ("v", k))]
  if model.qk_norm:  # per head ([head_dim]) or over the whole projection ([heads x head_dim], OLMoE's)
    width = {"head": (h, h), "full": (n * h, k * h)}[model.qk_norm]
    per_layer += [(f"self_attn.{x}_norm.weight", ("attn", f"{x}_norm", "scale"), (w,), False)
                  for x, w in zip("qk", width)]
  if model_type == "mixtral":  # the router, then w1 (gate), w3 (up), w2 (down) of every expert
    per_layer.append(("block_sparse_moe.gate.weight", ("moe", "router"), (model.num_experts, d), True))
    experts = [("block_sparse_moe.experts.{e}.w1", ("moe", "gate"), (f, d)),
               ("block_sparse_moe.experts.{e}.w3", ("moe", "up"), (f, d)),
               ("block_sparse_moe.experts.{e}.w2", ("moe", "down"), (d, f))]
  elif model_type in ("qwen3_moe", "olmoe"):
    per_layer.append(("mlp.gate.weight", ("moe", "router"), (model.num_experts, d), True))
    experts = [(f"mlp.experts.{{e}}.{x}_proj", ("moe", x), shape) for x, shape in
               (("gate", (f, d)), ("up", (f, d)), ("down", (d, f)))]
  else:
    per_layer += [("mlp.gate_proj.weight", ("mlp", "gate", "kernel"), (f, d), True),
                  ("mlp.up_proj.weight", ("mlp", "up", "kernel"), (f, d), True),
                  ("mlp.down_proj.weight", ("mlp", "down", "kernel"), (d, f), True)]
    experts = []
  # Gemma's post_attention_layernorm is on the attention's output; Llama's is the MLP's input norm.
  norms = ([("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attn_norm"),
            ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "post_mlp_norm")]
           if model.get("sandwich_norms") else [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")])
  for i in range(model.num_layers):
    for name, path, shape, is_linear in per_layer:
      out.append((f"model.layers.{i}.{name}", ("layers", *path), (i,), shape, is_linear))
    for e in range(model.num_experts if experts else 0):
      for name, path, shape in experts:
        out.append((f"model.layers.{i}.{name.format(e=e)}.weight", ("layers", *path), (i, e), shape, True))
    for name, ours in norms:
      out.append((f"model.layers.{i}.{name}.weight", ("layers", ours, "scale"), (i,), (d,), False))
  return out


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
      return np.asarray(f.get_tensor(self.name))


def _header(path: str) -> dict[str, _Entry]:
  try:
    with safe_open(path, framework="flax") as f:  # validates the header against the file size
      return {name: _Entry(path, name, tuple(f.get_slice(name).get_shape())) for name in f.keys()}
  except (SafetensorError, OSError, ValueError) as e:
    raise HFError(path, f"is not a readable safetensors file ({' '.join(str(e).split())})",
                  "the file is truncated or corrupt: download it again") from None


def _find_weights(hf_dir: str) -> dict[str, _Entry]:
  index = os.path.join(hf_dir, "model.safetensors.index.json")
  if os.path.exists(index):
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
# Output folders: built next to the output, renamed into place.

class _Staging:
  def __init__(self, output: str):
    self.output = os.path.abspath(output)
    if os.path.exists(self.output):
      raise HFError(output, "already exists", "choose a new output folder (nothing is overwritten)")
    parent = os.path.dirname(self.output)
    os.makedirs(parent, exist_ok=True)
    self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(self.output)}.tmp-", dir=parent)

  def __enter__(self) -> str:
    return self.tmp

  def __exit__(self, kind, value, tb):
    if kind is None:
      os.rename(self.tmp, self.output)
    else:
      shutil.rmtree(self.tmp, ignore_errors=True)
    return False


# ---------------------------------------------------------------------------------------------------------------
# Import.

def read_params(hf_dir: str, model: Any) -> tuple[dict, str]:
  """The jaxtrain params (nested dict of float32 numpy arrays) of an HF folder whose config gave ``model``, and
  the source weights' dtype name. Reads one tensor at a time into preallocated stacked arrays."""
  entries = _find_weights(hf_dir)
  expected = tensor_map(model)
  known = {name for name, *_ in expected}
  extra = sorted(n for n in entries if n not in known and not n.endswith("rotary_emb.inv_freq")
                 and not (model.tie_embeddings and n == "lm_head.weight"))
  missing = sorted(known - set(entries))
  if missing or extra:
    what = f"has no {missing[0]}" if missing else f"has {extra[0]}, which a {model.name} model of this config has not"
    more = len(missing) + len(extra) - 1
    raise HFError(hf_dir, what + (f" (and {more} more)" if more else ""),
                  "the weights do not belong to this config.json")
  for name, _, _, shape, _ in expected:
    if entries[name].shape != shape:
      raise HFError(entries[name].file, f"{name} is {list(entries[name].shape)}, config.json says {list(shape)}",
                    "the weights do not match config.json")
  abstract = models.Model.from_config(model).abstract_params
  params = jax.tree.map(lambda a: np.empty(a.shape, np.float32), abstract)
  dtypes = set()
  for name, path, layer, _, is_linear in expected:
    w = entries[name].read()
    dtypes.add(str(w.dtype))
    target = _get(params, path)
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
  """Converts the Hugging Face folder ``hf_dir`` into ``output`` (see the module docstring); returns a summary
  (params, bytes, source dtype)."""
  config_file = os.path.join(hf_dir, "config.json")
  if not os.path.isdir(hf_dir):
    raise HFError(hf_dir, "is not a folder", "pass --hf=a Hugging Face model folder")
  if not os.path.exists(config_file):
    raise HFError(hf_dir, "has no config.json", "pass a Hugging Face model folder (config.json + *.safetensors)")
  try:
    hf = json.loads(open(config_file).read())
  except ValueError as e:
    raise HFError(config_file, f"is not JSON ({e})", "download it again") from None
  model = model_config(hf, config_file)
  staging = _Staging(output)  # refuses an existing output before any tensor is read
  with staging as tmp:
    params, dtype = read_params(hf_dir, model)
    meta = {"hf_import": {"source": os.path.abspath(hf_dir), "dtype": dtype}}
    config = base_config(model=model.name)
    config.model = model
    config.workdir = f"runs/{os.path.basename(staging.output)}"
    params = _to_jax(params)
    ckpt = checkpoint_lib.PersistentTier(os.path.join(tmp, "checkpoints"), async_save=False)  # fingerprinted
    try:
      ckpt.save(0, {"step": np.zeros((), np.int32), "params": params}, None, meta, config.to_dict(), force=True)
    except checkpoint_lib.NonFiniteState as e:
      raise HFError(hf_dir, f"holds {e}", "the source checkpoint is broken") from None
    finally:
      ckpt.close()
    nbytes = sum(a.nbytes for a in jax.tree.leaves(params))
    count = sum(a.size for a in jax.tree.leaves(params))
    del params
    os.makedirs(os.path.join(tmp, "hf"))
    for f in SIDE_FILES:
      if os.path.exists(os.path.join(hf_dir, f)):
        shutil.copy2(os.path.join(hf_dir, f), os.path.join(tmp, "hf", f))
    with open(os.path.join(tmp, "config.py"), "w") as fh:
      fh.write(_CONFIG_PY.format(  # every string a repr(): a path may hold quotes, backslashes, anything
          source=os.path.abspath(hf_dir),
          path=os.path.join(staging.output, "config.py"), workdir=config.workdir, family=model.name,
          model="\n".join(f"      {k}={v!r}," for k, v in model.items() if k not in ("name", "lora")),
          checkpoints=os.path.join(staging.output, "checkpoints")))
  return {"params": count, "bytes": nbytes, "source_dtype": dtype}


# ---------------------------------------------------------------------------------------------------------------
# Export.

def export_model(checkpoint: str, output: str, step: int | None = None, max_shard_mb: float = 5000,
                 dtype: str = "auto") -> dict:
  """Writes the jaxtrain checkpoint ``checkpoint`` (a workdir, its checkpoints folder or a step folder; the newest
  step unless ``step``) as an HF folder ``output``: config.json, model.safetensors (shards of at most
  ``max_shard_mb`` MB plus model.safetensors.index.json when larger) and the imported source's tokenizer and
  generation files. ``dtype``: float32, bfloat16, float16 or auto (the imported source's dtype, else float32)."""
  if dtype not in _EXPORT_DTYPES + ("auto",):
    raise HFError("--dtype", f"'{dtype}' is not one of auto, {', '.join(_EXPORT_DTYPES)}", "pick one of them")
  if max_shard_mb <= 0:
    raise HFError("--max_shard_mb", f"must be > 0, got {max_shard_mb}", "fix the value")
  step_dir = checkpoint_lib.step_dir(checkpoint, step)
  config = checkpoint_lib.saved_config(step_dir)
  name = (config.get("model") or {}).get("name")
  families = [family for family, _ in ARCHITECTURES.values()]
  if name not in families:
    raise HFError(step_dir, f"holds a '{name}' model", f"only {', '.join(families)} checkpoints can be exported")
  model = models.defaults(name)
  model.update(**{k: v for k, v in config["model"].items() if k in model})
  why = why_not_exportable(model)
  if why:
    raise HFError(step_dir, f"holds a {name} model that {why}", f"only what the {_model_type(name)} "
                  "architecture computes can be exported")
  side = checkpoint_lib.side_files_dir(step_dir, config)
  meta_file = os.path.join(step_dir, "meta", "metadata")
  meta = json.loads(open(meta_file).read()) if os.path.exists(meta_file) else {}
  if dtype == "auto":
    dtype = (meta.get("hf_import") or {}).get("dtype", "float32")
    dtype = dtype if dtype in _EXPORT_DTYPES else "float32"
  np_dtype = _bf16() if dtype == "bfloat16" else np.dtype(dtype)
  base = json.loads(open(os.path.join(side, "config.json")).read()) if side and os.path.exists(
      os.path.join(side, "config.json")) else None
  with _Staging(output) as tmp:
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
    tensors = tensor_map(model)
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
      _write_safetensors(os.path.join(tmp, file), shard, produce)
      weight_map.update({name: file for name, _, _ in shard})
    total = sum(math.prod(s) * np_dtype.itemsize for _, s, _ in (t for shard in shards for t in shard))
    if len(shards) > 1:
      with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as fh:
      json.dump(hf_config(model, base, dtype), fh, indent=2)
    if side:
      for f in SIDE_FILES:
        if f != "config.json" and os.path.exists(os.path.join(side, f)):
          shutil.copy2(os.path.join(side, f), os.path.join(tmp, f))
  return {"step_dir": step_dir, "bytes": total, "shards": len(shards), "dtype": dtype}

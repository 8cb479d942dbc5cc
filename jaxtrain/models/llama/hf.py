"""The Hugging Face adapters of the Llama-shaped model_types: ``llama``, ``mistral``, ``qwen2``, ``qwen3``,
``gemma2`` and ``gemma3_text`` (each a :class:`LlamaShaped` with its differences as fields; the MoE ones extend it in
jaxtrain/models/moe/hf.py).

Layouts: HF Linear weights are ``[out, in]``; jaxtrain kernels are ``[in, ...out]`` (q/k/v ``[d, heads, head_dim]``,
o ``[heads, head_dim, d]``, MLP ``[in, out]``), stacked over a leading layers axis. Gemma's four norms per layer:
``input_layernorm`` -> ``attn_norm``, ``post_attention_layernorm`` -> ``post_attn_norm`` (on the attention's output,
unlike Llama's, which is the MLP's input norm), ``pre_feedforward_layernorm`` -> ``mlp_norm``,
``post_feedforward_layernorm`` -> ``post_mlp_norm``; their ``1 + w`` weights are stored as they are (jaxtrain's
RMSNorm adds the 1: ``model.norm_plus_one``). jaxtrain's RoPE rotates the two halves of head_dim, which is HF's
``rotate_half`` convention: q and k need no permutation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from jaxtrain.models import attention, core, hf_adapter
from jaxtrain.models.hf_adapter import HFError, Tensor

# The attention variants (jaxtrain.models.llama flags) an architecture may compute; see LlamaShaped.variants.
VARIANT_FLAGS = ("qkv_bias", "qk_norm", "sliding_window", "global_every", "attn_softcap", "final_softcap",
                 "query_scale", "rope_local_theta", "norm_plus_one", "embed_scale", "sandwich_norms")


def windows(hf: dict, where: str) -> tuple[int, int]:
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


@dataclasses.dataclass(frozen=True)
class LlamaShaped(hf_adapter.Adapter):
  """A Llama-shaped ``model_type``.

  variants: the attention variants it computes: ``True`` (or a value) must be on (set to it), ``False`` may be;
    a flag of :data:`VARIANT_FLAGS` not named must be off.
  gemma: Gemma's block (GeGLU with tanh, four norms per layer, tied by default, soft-caps and query scale keys).
  qkv_bias: q/k/v biases always (Qwen 2); otherwise a config.json with ``attention_bias`` or ``mlp_bias`` is refused.
  fixed: keys config.json always has, written on export (``attention_bias=False``).
  qwen_window: Qwen's ``use_sliding_window`` and ``max_window_layers`` keys.
  layer_types: writes ``layer_types`` (one attention kind per layer).
  rope_per_layer_type: RoPE written as ``rope_parameters`` per layer type (Gemma 3, as transformers 5 writes it).
  partial_rotary: config.json's ``partial_rotary_factor`` read and written (``model.partial_rotary_factor``, GLM-4.5's);
    otherwise one other than 1 is refused.
  """
  model_type: str
  family: str
  architecture: str
  variants: dict = dataclasses.field(default_factory=dict)
  gemma: bool = False
  qkv_bias: bool = False
  fixed: dict = dataclasses.field(default_factory=dict)
  qwen_window: bool = False
  layer_types: bool = False
  rope_per_layer_type: bool = False
  partial_rotary: bool = False

  @property
  def activation(self) -> tuple[str, str]:
    """(transformers' name, jaxtrain's ``model.mlp_activation``)."""
    return ("gelu_pytorch_tanh", "gelu_tanh") if self.gemma else ("silu", "silu")

  # --- import -------------------------------------------------------------------------------------------------

  def _check(self, hf: dict, where: str) -> None:
    """What of config.json jaxtrain does not compute (before anything is read)."""
    if self.qkv_bias and hf.get("attention_bias") is False:
      raise HFError(where, f"sets attention_bias=false for a {self.model_type} model", "pass the model's own "
                    "config.json")
    for key in ("attention_bias", "mlp_bias"):  # (q, k, v biases where a variant may have them: qkv_bias)
      if hf.get(key) and not self.qkv_bias and not (key == "attention_bias" and "qkv_bias" in self.variants):
        raise HFError(where, f"sets {key}=true", f"jaxtrain's {self.family} has no biases there; not supported")
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if activation != self.activation[0]:
      raise HFError(where, f"uses the activation {activation!r}", f"only {self.activation[0]} {self.model_type} "
                    "MLPs are supported")
    if hf.get("clip_qkv") is not None:
      raise HFError(where, f"sets clip_qkv={hf['clip_qkv']}", "clipped q/k/v projections are not supported")
    hf_adapter.require_ints(hf, where, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "intermediate_size"))

  def _family_keys(self, hf: dict, where: str) -> dict:
    """The model keys of the family beyond the Llama-shaped ones (the MoE adapters' experts)."""
    del hf, where
    return {}

  def model_config(self, hf: dict, where: str) -> ml_collections.ConfigDict:
    self._check(hf, where)
    rope = hf_adapter.rope_of(hf)
    local_rope = {}
    if "full_attention" in rope:  # Gemma 3: RoPE per layer type
      rope, local_rope = dict(rope["full_attention"] or {}), dict(rope.get("sliding_attention") or {})
      if local_rope.get("rope_type", "default") != "default":
        raise HFError(where, f"scales the local layers' RoPE ({local_rope['rope_type']})", "only unscaled local "
                      "RoPE is supported")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    partial = float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)
    if partial != 1.0 and not self.partial_rotary:
      raise HFError(where, f"sets partial_rotary_factor={partial}", "only full-head RoPE is supported")
    heads = hf["num_attention_heads"]
    window, every = windows(hf, where)
    m = core.defaults(self.family)
    m.update(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
             num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
             head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
             rope_theta=float(theta), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
             tie_embeddings=bool(hf.get("tie_word_embeddings", self.gemma)), sliding_window=window,
             global_every=every, **({"partial_rotary_factor": partial} if self.partial_rotary else {}))
    if self.gemma:
      m.update(attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
               final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
               query_scale=float(hf.get("query_pre_attn_scalar", m.head_dim)) ** -0.5,
               rope_local_theta=float(local_rope.get("rope_theta", 0.0)))
    m.update(**self._family_keys(hf, where))
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
    return m

  def ignored(self, name: str, model: Any) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (bool(model.tie_embeddings) and name == "lm_head.weight")

  # --- export -------------------------------------------------------------------------------------------------

  def _family_fields(self, model: Any) -> dict:
    """The config.json keys of the family beyond the Llama-shaped ones (the MoE adapters' experts)."""
    del model
    return {}

  def hf_config(self, model: Any, base: dict | None, dtype: str) -> dict:
    """RoPE is written as ``rope_theta`` + ``rope_scaling`` (read by transformers 4.45+ and 5), so that token ids and
    context length of the source survive."""
    out = hf_adapter.inherited(base)
    out.update(architectures=[self.architecture], model_type=self.model_type, vocab_size=model.vocab_size,
               hidden_size=model.d_model, intermediate_size=model.mlp_dim, num_hidden_layers=model.num_layers,
               num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
               hidden_act="silu", rms_norm_eps=model.norm_eps, rope_theta=model.rope_theta,
               tie_word_embeddings=bool(model.tie_embeddings), torch_dtype=dtype)
    out.update(self.fixed)
    windows_ = attention.layer_windows(model)
    out["sliding_window"] = model.sliding_window or None
    if self.qwen_window:
      out.update(use_sliding_window=bool(model.sliding_window), max_window_layers=0)
    if self.gemma:
      scalar = model.query_scale ** -2 if model.query_scale else model.head_dim
      out.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                 query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
                 attn_logit_softcapping=model.attn_softcap or None,
                 final_logit_softcapping=model.final_softcap or None)
    if self.layer_types:
      out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows_]
    if self.partial_rotary:
      out["partial_rotary_factor"] = model.partial_rotary_factor
    out.update(self._family_fields(model))
    out.setdefault("max_position_embeddings", model.rope_original_max_positions * (
        int(model.rope_scaling_factor) if model.get("rope_scaling") else 1))
    out.setdefault("initializer_range", 0.02)
    scaling = {"llama3": {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                          "low_freq_factor": model.rope_low_freq_factor,
                          "high_freq_factor": model.rope_high_freq_factor,
                          "original_max_position_embeddings": model.rope_original_max_positions},
               "linear": {"rope_type": "linear", "factor": model.rope_scaling_factor}}.get(model.get("rope_scaling"))
    if self.rope_per_layer_type:
      out.pop("rope_theta")
      out["rope_parameters"] = {"full_attention": {**(scaling or {"rope_type": "default"}),
                                                   "rope_theta": model.rope_theta},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": model.rope_local_theta or model.rope_theta}}
    else:
      out["rope_scaling"] = scaling
    return out

  def why_not_exportable(self, model: Any) -> str | None:
    for flag in VARIANT_FLAGS:
      if model.get(flag) and flag not in self.variants:
        return f"sets model.{flag}={model.get(flag)}, which {self.model_type} has not"
      if self.variants.get(flag) and model.get(flag) != self.variants[flag]:
        return f"has model.{flag}={model.get(flag)!r}, where {self.model_type} always has {self.variants[flag]!r}"
    if model.get("mlp_activation", "silu") != self.activation[1]:
      return f"sets model.mlp_activation={model.mlp_activation}, where {self.model_type} has {self.activation[1]}"
    return None

  # --- tensors ------------------------------------------------------------------------------------------------

  def _mlp(self, model: Any) -> tuple[list[tuple], list[tuple]]:
    """(per-layer MLP tensors as ``(name, path, shape, linear)``, per-expert ones as ``(name with {e}, path,
    shape)``): the dense SwiGLU's gate, up and down projections here."""
    d, f = model.d_model, model.mlp_dim
    return [("mlp.gate_proj.weight", ("mlp", "gate", "kernel"), (f, d), True),
            ("mlp.up_proj.weight", ("mlp", "up", "kernel"), (f, d), True),
            ("mlp.down_proj.weight", ("mlp", "down", "kernel"), (d, f), True)], []

  def _attention(self, model: Any) -> list[tuple]:
    """A layer's attention tensors as ``(name, path, shape, linear)``: q, k, v, o, their biases, the QK-norms."""
    d, n, k, h = model.d_model, model.num_heads, model.num_kv_heads, model.head_dim
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
    return per_layer

  def tensors(self, model: Any) -> list[Tensor]:
    d, v = model.d_model, model.vocab_size
    out = [Tensor("model.embed_tokens.weight", ("embed", "embedding"), None, (v, d), False),
           Tensor("model.norm.weight", ("final_norm", "scale"), None, (d,), False)]
    if not model.tie_embeddings:
      out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), None, (v, d), True))
    per_layer = self._attention(model)
    mlp, experts = self._mlp(model)
    per_layer += mlp
    # Gemma's post_attention_layernorm is on the attention's output; Llama's is the MLP's input norm.
    norms = ([("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attn_norm"),
              ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "post_mlp_norm")]
             if model.get("sandwich_norms") else [("input_layernorm", "attn_norm"),
                                                  ("post_attention_layernorm", "mlp_norm")])
    for i in range(model.num_layers):
      for name, path, shape, linear in per_layer:
        out.append(Tensor(f"model.layers.{i}.{name}", ("layers", *path), (i,), shape, linear))
      for e in range(model.num_experts if experts else 0):
        for name, path, shape in experts:
          out.append(Tensor(f"model.layers.{i}.{name.format(e=e)}.weight", ("layers", *path), (i, e), shape, True))
      for name, ours in norms:
        out.append(Tensor(f"model.layers.{i}.{name}.weight", ("layers", ours, "scale"), (i,), (d,), False))
    return out


_GEMMA = {"norm_plus_one": True, "embed_scale": True, "sandwich_norms": True, "sliding_window": False,
          "global_every": False, "query_scale": False}
_NO_BIAS = {"attention_bias": False}
_WINDOWS = {"sliding_window": False, "global_every": False}

for _adapter in (
    LlamaShaped("llama", "llama", "LlamaForCausalLM", fixed={**_NO_BIAS, "mlp_bias": False}),
    LlamaShaped("mistral", "mistral", "MistralForCausalLM", variants={"sliding_window": False}),
    LlamaShaped("qwen2", "qwen2", "Qwen2ForCausalLM", variants={"qkv_bias": True, **_WINDOWS}, qkv_bias=True,
                qwen_window=True, layer_types=True),
    LlamaShaped("qwen3", "qwen3", "Qwen3ForCausalLM", variants={"qk_norm": "head", **_WINDOWS}, fixed=_NO_BIAS,
                qwen_window=True, layer_types=True),
    LlamaShaped("gemma2", "gemma2", "Gemma2ForCausalLM", variants={**_GEMMA, "attn_softcap": False,
                                                                   "final_softcap": False},
                gemma=True, fixed=_NO_BIAS, layer_types=True),
    LlamaShaped("gemma3_text", "gemma3", "Gemma3ForCausalLM", variants={**_GEMMA, "qk_norm": "head",
                                                                        "rope_local_theta": False},
                gemma=True, fixed=_NO_BIAS, layer_types=True, rope_per_layer_type=True)):
  hf_adapter.register(_adapter)
del _adapter
hf_adapter.refuse("gemma3", "is a multimodal Gemma 3 (Gemma3ForConditionalGeneration)", "import a text-only "
                  "checkpoint (model_type gemma3_text, Gemma3ForCausalLM, e.g. gemma-3-1b-pt)")

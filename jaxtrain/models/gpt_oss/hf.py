"""The Hugging Face adapter of ``gpt_oss`` (transformers' ``GptOssForCausalLM``), bf16 (or float32) checkpoints.

Tensors per layer, as the checkpoint names them: the attention's ``q/k/v/o_proj`` weights and biases (Llama's
layouts, jaxtrain/models/llama/hf.py), ``self_attn.sinks`` ``[heads]``, the router ``mlp.router.weight`` ``[E, d]``
(a Linear) and ``.bias``, and the experts stacked as jaxtrain stacks them: ``mlp.experts.gate_up_proj`` ``[E, d,
2f]`` (``[in, out]``, gate and up interleaved: jaxtrain's ``gate_up`` is that array), ``gate_up_proj_bias`` ``[E,
2f]``, ``down_proj`` ``[E, f, d]``, ``down_proj_bias`` ``[E, d]``. The released checkpoints (openai/gpt-oss-20b,
-120b) store ``gate_up_proj`` and ``down_proj`` in MXFP4 (``quantization_config.quant_method=mxfp4``): ``*_blocks``
``[E, out, in / 32, 16]`` uint8, two 4-bit E2M1 values a byte (low nibble first), and ``*_scales`` ``[E, out, in /
32]`` uint8, a power of two (``2^(s - 127)``) per 32 values. The import dequantizes them (:func:`dequantize_mxfp4`,
numpy, one expert at a time) to bfloat16, bitwise transformers' ``convert_moe_packed_tensors``; an export writes
them unquantized (bf16 for the released checkpoints, whose other tensors are bf16). Another quantization is refused
in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
import ml_dtypes
import numpy as np

from jaxtrain.models import attention, core, hf_adapter
from jaxtrain.models.hf_adapter import HFError, Tensor
from jaxtrain.models.llama.hf import windows

QUANTIZED_FIX = ("dequantize it to bf16 first (transformers' from_pretrained with its quantizer's dequantize option, "
                 "then save_pretrained), or import a bf16 copy")
FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    np.float32)
MXFP4_TENSORS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """MXFP4 ``blocks`` ``[E, out, groups, 16]`` uint8 and ``scales`` ``[E, out, groups]`` uint8 -> ``[E, groups x 32,
  out]`` bfloat16 (``[in, out]`` per expert, the layout of the checkpoint's unquantized tensor): value ``j`` of a
  group is the E2M1 code in nibble ``j % 2`` of byte ``j // 2`` times ``2^(scale - 127)`` (exact in bfloat16)."""
  experts, out_dim, groups, _ = blocks.shape
  result = np.empty((experts, groups * 32, out_dim), ml_dtypes.bfloat16)
  for e in range(experts):  # one expert's float32 values at a time
    b = blocks[e].astype(np.uint8)
    values = np.stack([FP4_E2M1[b & 0x0F], FP4_E2M1[b >> 4]], axis=-1).reshape(out_dim, groups, 32)
    values = np.ldexp(values, scales[e].astype(np.int32)[..., None] - 127)
    result[e] = values.reshape(out_dim, groups * 32).T.astype(ml_dtypes.bfloat16)
  return result


@dataclasses.dataclass(frozen=True)
class GptOssAdapter(hf_adapter.Adapter):
  model_type: str = "gpt_oss"
  family: str = "gpt_oss"
  architecture: str = "GptOssForCausalLM"

  def model_config(self, hf: dict, where: str) -> ml_collections.ConfigDict:
    quant = hf.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "mxfp4":
      raise HFError(where, f"is quantized ({quant.get('quant_method', 'quantization_config')})", QUANTIZED_FIX)
    if hf.get("attention_bias") is False:
      raise HFError(where, "sets attention_bias=false", "GPT-OSS always has attention biases; pass the model's own "
                    "config.json")
    if (hf.get("hidden_act") or "silu") != "silu":
      raise HFError(where, f"uses the activation {hf['hidden_act']!r}", "GPT-OSS experts use their clamped SwiGLU")
    hf_adapter.require_ints(hf, where, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "intermediate_size", "num_local_experts"))
    rope = hf_adapter.default_or_yarn_rope(hf, where, "GPT-OSS")
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
      if rope.get(key) is not None:
        raise HFError(where, f"sets YaRN's {key}", "only GPT-OSS's YaRN (attention factor from the factor) is "
                      "supported")
    heads = hf["num_attention_heads"]
    window, every = windows(hf, where)
    k = int(hf.get("num_experts_per_tok") or hf.get("experts_per_token") or 4)
    m = core.defaults(self.family)
    m.update(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
             num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
             head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
             rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 150_000.0))),
             norm_eps=float(hf.get("rms_norm_eps", 1e-5)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
             sliding_window=window, global_every=every, num_experts=hf["num_local_experts"], experts_per_token=k,
             expert_mlp_dim=hf["intermediate_size"], swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
             swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
             load_balance_weight=float(hf.get("router_aux_loss_coef", 0.0)) * k)
    m.update(hf_adapter.yarn_from_hf(rope, where))
    return m

  def hf_config(self, model: Any, base: dict | None, dtype: str) -> dict:
    out = hf_adapter.inherited(base, "quantization_config")
    out.update(architectures=[self.architecture], model_type=self.model_type, vocab_size=model.vocab_size,
               hidden_size=model.d_model, intermediate_size=model.expert_mlp_dim,
               num_hidden_layers=model.num_layers, num_attention_heads=model.num_heads,
               num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim, hidden_act="silu",
               rms_norm_eps=model.norm_eps, tie_word_embeddings=bool(model.tie_embeddings), attention_bias=True,
               num_local_experts=model.num_experts, num_experts_per_tok=model.experts_per_token,
               swiglu_alpha=model.swiglu_alpha, swiglu_limit=model.swiglu_limit,
               router_aux_loss_coef=model.load_balance_weight / model.experts_per_token,
               sliding_window=model.sliding_window or None, torch_dtype=dtype, rope_theta=model.rope_theta,
               layer_types=["sliding_attention" if w else "full_attention" for w in attention.layer_windows(model)])
    if "experts_per_token" in out:  # the hub's own copy of k
      out["experts_per_token"] = model.experts_per_token
    out["rope_scaling"] = hf_adapter.yarn_to_hf(model, truncate=bool(model.rope_yarn_truncate))
    out.setdefault("max_position_embeddings", int(model.rope_original_max_positions * (
        model.rope_scaling_factor if model.rope_scaling == "yarn" else 1)))
    out.setdefault("initializer_range", 0.02)
    return out

  def why_not_exportable(self, model: Any) -> str | None:
    for key in ("qkv_bias", "out_bias", "attention_sinks"):
      if not model.get(key):
        return f"sets model.{key}=False, where gpt_oss always has it"
    return None

  def stored_as(self, name: str, names: Any) -> tuple[list[str], Any] | None:
    """The experts' MXFP4 ``*_blocks`` and ``*_scales`` (:func:`dequantize_mxfp4`)."""
    parts = [f"{name}_blocks", f"{name}_scales"]
    if name.endswith(MXFP4_TENSORS) and all(p in names for p in parts):
      return parts, lambda arrays: dequantize_mxfp4(*arrays)
    return None

  def ignored(self, name: str, model: Any) -> bool:
    return name.endswith("rotary_emb.inv_freq")

  def tensors(self, model: Any) -> list[Tensor]:
    d, n, k, h, v = model.d_model, model.num_heads, model.num_kv_heads, model.head_dim, model.vocab_size
    e, f = model.num_experts, model.expert_mlp_dim
    out = [Tensor("model.embed_tokens.weight", ("embed", "embedding"), None, (v, d), False),
           Tensor("model.norm.weight", ("final_norm", "scale"), None, (d,), False)]
    if not model.tie_embeddings:
      out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), None, (v, d), True))
    per_layer = [("self_attn.q_proj.weight", ("attn", "q", "kernel"), (n * h, d), True),
                 ("self_attn.q_proj.bias", ("attn", "q", "bias"), (n * h,), False),
                 ("self_attn.k_proj.weight", ("attn", "k", "kernel"), (k * h, d), True),
                 ("self_attn.k_proj.bias", ("attn", "k", "bias"), (k * h,), False),
                 ("self_attn.v_proj.weight", ("attn", "v", "kernel"), (k * h, d), True),
                 ("self_attn.v_proj.bias", ("attn", "v", "bias"), (k * h,), False),
                 ("self_attn.o_proj.weight", ("attn", "o", "kernel"), (d, n * h), True),
                 ("self_attn.o_proj.bias", ("attn", "o", "bias"), (d,), False),
                 ("self_attn.sinks", ("attn", "sinks"), (n,), False),
                 ("mlp.router.weight", ("moe", "router"), (e, d), True),
                 ("mlp.router.bias", ("moe", "router_bias"), (e,), False),
                 ("mlp.experts.gate_up_proj", ("moe", "gate_up"), (e, d, 2 * f), False),
                 ("mlp.experts.gate_up_proj_bias", ("moe", "gate_up_bias"), (e, 2 * f), False),
                 ("mlp.experts.down_proj", ("moe", "down"), (e, f, d), False),
                 ("mlp.experts.down_proj_bias", ("moe", "down_bias"), (e, d), False),
                 ("input_layernorm.weight", ("attn_norm", "scale"), (d,), False),
                 ("post_attention_layernorm.weight", ("mlp_norm", "scale"), (d,), False)]
    return [t for i in range(model.num_layers) for t in (
        Tensor(f"model.layers.{i}.{name}", ("layers", *path), (i,), shape, linear)
        for name, path, shape, linear in per_layer)] + out


hf_adapter.register(GptOssAdapter())

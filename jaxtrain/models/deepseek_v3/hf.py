"""The Hugging Face adapter of ``deepseek_v3`` (transformers' ``DeepseekV3ForCausalLM``).

Tensors per layer, as the hub's checkpoints name them: ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``
(or ``q_proj`` without a query rank), ``kv_a_proj_with_mqa`` ``[kv_lora_rank + qk_rope_head_dim, d]`` (jaxtrain's
``kv_a``), ``kv_a_layernorm``, ``kv_b_proj`` ``[heads x (qk_nope + v), kv_lora_rank]``, ``o_proj``; the first
``first_k_dense_replace`` layers' ``mlp.{gate,up,down}_proj`` (jaxtrain's ``dense_layers``), the others' router
``mlp.gate.weight`` ``[E, d]``, its ``mlp.gate.e_score_correction_bias`` (``score_bias``), per-expert
``mlp.experts.E.{gate,up,down}_proj`` (transformers fuses them when loading) and ``mlp.shared_experts.*``.

The multi-token-prediction modules the released checkpoints carry as layers ``num_hidden_layers`` and after
(``num_nextn_predict_layers``; transformers' model has none and ignores them) are imported as jaxtrain's ``mtp``
modules (``model.mtp_depth``: the number of such layers the weights hold, whatever config.json says, so a checkpoint
saved by transformers, which drops them, imports without) and exported back: each one's ``enorm``, ``hnorm``,
``eh_proj`` ``[d, 2d]``, a MoE decoder layer's tensors (named as a layer's) and ``shared_head.norm`` (jaxtrain's
``post_norm``); its ``embed_tokens`` and ``shared_head.head`` are copies of the model's embedding and head (the
module shares them): imported only if bitwise equal to them (jaxtrain/hf.py refuses a checkpoint whose copies
differ), exported as those.

The released checkpoints (deepseek-ai/DeepSeek-V3, -R1) store their linear weights in fp8 (``quantization_config``:
``quant_method=fp8``, ``fmt=e4m3``, ``weight_block_size=[128, 128]``): a ``float8_e4m3fn`` ``weight`` and a float32
``weight_scale_inv`` per 128 x 128 block. The import dequantizes them (:func:`dequantize_fp8_blocks`: the weight
times its block's scale, as transformers' fp8 dequantization and DeepSeek's ``weight_dequant`` compute it) to
bfloat16; an export writes them unquantized. Another quantization is refused in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
import ml_dtypes
import numpy as np

from jaxtrain.models import core, hf_adapter
from jaxtrain.models.hf_adapter import HFError, Tensor

FP8_BLOCK = (128, 128)  # the released checkpoints' weight_block_size (another is refused)
QUANTIZED_FIX = ("dequantize it to bf16 first (transformers' from_pretrained with its quantizer's dequantize option, "
                 "then save_pretrained), or import a bf16 copy")


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
  """An fp8 ``weight`` ``[out, in]`` times its ``scale_inv`` ``[ceil(out / b0), ceil(in / b1)]`` per ``block``
  (float32 products), as bfloat16."""
  out_dim, in_dim = weight.shape
  scale = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block[0], axis=0), block[1], axis=1)
  return (weight.astype(np.float32) * scale[:out_dim, :in_dim]).astype(ml_dtypes.bfloat16)


@dataclasses.dataclass(frozen=True)
class DeepseekV3Adapter(hf_adapter.Adapter):
  """DeepSeek-V3's architecture, registered for two ``model_type``s: ``deepseek_v3``, and Kimi K2's ``kimi_k2`` (its
  checkpoints name their own modeling code in ``auto_map``), read as it is. An export is ``deepseek_v3``'s (the
  family's first adapter), without ``auto_map``, which transformers loads with its own ``DeepseekV3ForCausalLM`` and
  no remote code."""
  model_type: str = "deepseek_v3"
  family: str = "deepseek_v3"
  architecture: str = "DeepseekV3ForCausalLM"

  def model_config(self, hf: dict, where: str) -> ml_collections.ConfigDict:
    quant = hf.get("quantization_config") or {}
    if quant and (quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3"
                  or list(quant.get("weight_block_size") or ()) != list(FP8_BLOCK)):
      raise HFError(where, f"is quantized ({quant.get('quant_method', 'quantization_config')}"
                    f"{', ' + quant['fmt'] if quant.get('fmt') else ''})", "only DeepSeek's fp8 e4m3 128 x 128 blocks "
                    "are dequantized on import; " + QUANTIZED_FIX)
    for key in ("attention_bias", "mlp_bias"):
      if hf.get(key):
        raise HFError(where, f"sets {key}=true", "DeepSeek-V3 has no biases there; not supported")
    if (hf.get("hidden_act") or "silu") != "silu":
      raise HFError(where, f"uses the activation {hf['hidden_act']!r}", "DeepSeek-V3's MLPs are SwiGLU (silu)")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
      raise HFError(where, f"routes with {hf.get('scoring_func', 'sigmoid')} / {hf.get('topk_method', 'noaux_tc')}",
                    "only DeepSeek-V3's sigmoid scores with the choice bias (noaux_tc) are supported")
    if hf.get("moe_layer_freq", 1) != 1:
      raise HFError(where, f"sets moe_layer_freq={hf['moe_layer_freq']}", "only every layer after the dense first "
                    "ones routed (moe_layer_freq=1) is supported")
    hf_adapter.require_ints(hf, where, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "intermediate_size", "moe_intermediate_size", "kv_lora_rank",
                                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    rope = hf_adapter.default_or_yarn_rope(hf, where, "DeepSeek-V3")
    if rope.get("attention_factor") is not None:
      raise HFError(where, "sets YaRN's attention_factor", "only YaRN's factor with mscale / mscale_all_dim is "
                    "supported")
    m = core.defaults(self.family)
    m.update(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
             num_heads=hf["num_attention_heads"], mlp_dim=hf["intermediate_size"],
             tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
             q_lora_rank=int(hf.get("q_lora_rank") or 0), kv_lora_rank=hf["kv_lora_rank"],
             qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
             v_head_dim=hf["v_head_dim"], rope_interleave=bool(hf.get("rope_interleave", True)),
             rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0))), **routing_from_hf(hf))
    m.update(hf_adapter.yarn_from_hf(rope, where, mscale=True))
    return m

  def hf_config(self, model: Any, base: dict | None, dtype: str) -> dict:
    out = hf_adapter.inherited(base, "quantization_config")
    out.update(architectures=[self.architecture], model_type=self.model_type, vocab_size=model.vocab_size,
               hidden_size=model.d_model, intermediate_size=model.mlp_dim, num_hidden_layers=model.num_layers,
               num_attention_heads=model.num_heads, num_key_value_heads=model.num_heads,
               q_lora_rank=model.q_lora_rank or None, kv_lora_rank=model.kv_lora_rank,
               qk_nope_head_dim=model.qk_nope_head_dim, qk_rope_head_dim=model.qk_rope_head_dim,
               v_head_dim=model.v_head_dim, rope_interleave=bool(model.rope_interleave), hidden_act="silu",
               rms_norm_eps=model.norm_eps, tie_word_embeddings=bool(model.tie_embeddings), attention_bias=False,
               torch_dtype=dtype, rope_theta=model.rope_theta, **routing_to_hf(model))
    yarn = model.rope_scaling == "yarn"
    out["rope_scaling"] = hf_adapter.yarn_to_hf(model, mscale=model.rope_yarn_mscale or None,
                                                mscale_all_dim=model.rope_yarn_mscale_all_dim or None,
                                                **({} if model.rope_yarn_truncate else {"truncate": False}))
    out.setdefault("max_position_embeddings", int(model.rope_original_max_positions * (
        model.rope_scaling_factor if yarn else 1)))
    out.setdefault("initializer_range", 0.02)
    out["num_nextn_predict_layers"] = int(model.mtp_depth)  # the MTP modules exported (layers num_layers..)
    return out

  def stored_as(self, name: str, names: Any) -> tuple[list[str], Any] | None:
    """A linear weight in DeepSeek's fp8 blocks: its ``weight`` and ``weight_scale_inv``
    (:func:`dequantize_fp8_blocks`)."""
    parts = [name, f"{name}_scale_inv"]
    if name.endswith(".weight") and parts[1] in names:
      return parts, lambda arrays: dequantize_fp8_blocks(*arrays, FP8_BLOCK)
    return None

  def ignored(self, name: str, model: Any) -> bool:
    """(MTP layers past ``mtp_depth``: none once :meth:`fitted` has counted them.)"""
    return name.endswith("rotary_emb.inv_freq") or mtp_layer(name, model, first=model.num_layers + model.mtp_depth)

  def fitted(self, model: Any, names: Any) -> Any:
    """``model`` with ``mtp_depth`` the number of MTP layers (``model.layers.{num_layers + j}.eh_proj.weight``, j
    from 0 on) the checkpoint holds."""
    depth = 0
    while f"model.layers.{model.num_layers + depth}.eh_proj.weight" in names:
      depth += 1
    if depth == model.mtp_depth:
      return model
    model = model.copy_and_resolve_references()
    model.mtp_depth = depth
    return model

  def tensors(self, model: Any) -> list[Tensor]:
    d, n = model.d_model, model.num_heads
    qk, rank, rope = model.qk_nope_head_dim + model.qk_rope_head_dim, model.kv_lora_rank, model.qk_rope_head_dim
    if model.q_lora_rank:
      r = model.q_lora_rank
      attn = [("self_attn.q_a_proj.weight", ("attn", "q_a", "kernel"), (r, d), True),
              ("self_attn.q_a_layernorm.weight", ("attn", "q_norm", "scale"), (r,), False),
              ("self_attn.q_b_proj.weight", ("attn", "q_b", "kernel"), (n * qk, r), True)]
    else:
      attn = [("self_attn.q_proj.weight", ("attn", "q", "kernel"), (n * qk, d), True)]
    attn += [("self_attn.kv_a_proj_with_mqa.weight", ("attn", "kv_a", "kernel"), (rank + rope, d), True),
             ("self_attn.kv_a_layernorm.weight", ("attn", "kv_norm", "scale"), (rank,), False),
             ("self_attn.kv_b_proj.weight", ("attn", "kv_b", "kernel"),
              (n * (model.qk_nope_head_dim + model.v_head_dim), rank), True),
             ("self_attn.o_proj.weight", ("attn", "o", "kernel"), (d, n * model.v_head_dim), True)]
    return layer_tensors(model, attn)


def routing_from_hf(hf: dict) -> dict:
  """The model keys of a config.json's DeepSeek MoE (GLM-4.5's too): routed and shared experts, groups, the weights'
  scale and normalization, the dense first layers; no auxiliary losses (the choice bias balances)."""
  return dict(num_experts=int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0),
              experts_per_token=int(hf.get("num_experts_per_tok") or 8), expert_mlp_dim=hf["moe_intermediate_size"],
              num_shared_experts=int(hf.get("n_shared_experts") or 0),
              first_dense_layers=int(hf.get("first_k_dense_replace") or 0), num_groups=int(hf.get("n_group") or 1),
              topk_groups=int(hf.get("topk_group") or 1),
              routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
              normalize_topk=bool(hf.get("norm_topk_prob", True)), load_balance_weight=0.0, router_z_weight=0.0)


def routing_to_hf(model: Any) -> dict:
  """The config.json keys of the model group's DeepSeek MoE (:func:`routing_from_hf`'s)."""
  return dict(n_routed_experts=model.num_experts, num_experts_per_tok=model.experts_per_token,
              moe_intermediate_size=model.expert_mlp_dim, n_shared_experts=model.num_shared_experts,
              first_k_dense_replace=model.first_dense_layers, n_group=model.num_groups,
              topk_group=model.topk_groups, routed_scaling_factor=model.routed_scaling_factor,
              norm_topk_prob=bool(model.normalize_topk))


def mtp_layer(name: str, model: Any, first: int | None = None) -> bool:
  """Whether ``name`` is a tensor of the multi-token-prediction modules the released checkpoints carry as layers
  ``num_layers`` and after (``model.layers.{num_layers + j}.*``; transformers' model has none), or of those from
  layer ``first`` on."""
  parts = name.split(".")
  return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
          and int(parts[2]) >= (model.num_layers if first is None else first))


def layer_tensors(model: Any, attn: list[tuple]) -> list[Tensor]:
  """Every tensor of a DeepSeek-MoE-shaped checkpoint (GLM-4.5's too) whose layers' attention tensors are ``attn``
  (``(name, path under the layer, shape, linear)`` each): the embedding, final norm and head, and per layer its
  attention, the first ``first_dense_layers`` layers' dense MLP (jaxtrain's ``dense_layers``) or the others' router,
  choice bias, shared experts (``layers``), the two norms, and the routed experts one by one; then, where the model
  group has ``mtp_depth`` > 0, each multi-token-prediction module's layer ``num_layers + j`` (the module docstring:
  ``mtp``, its copies of the embedding and head mapped onto the model's own)."""
  d, v = model.d_model, model.vocab_size
  e, f, k = model.num_experts, model.expert_mlp_dim, model.first_dense_layers
  out = [Tensor("model.embed_tokens.weight", ("embed", "embedding"), None, (v, d), False),
         Tensor("model.norm.weight", ("final_norm", "scale"), None, (d,), False)]
  if not model.tie_embeddings:
    out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), None, (v, d), True))
  norms = [("input_layernorm.weight", ("attn_norm", "scale"), (d,), False),
           ("post_attention_layernorm.weight", ("mlp_norm", "scale"), (d,), False)]
  dense = [(f"mlp.{x}_proj.weight", ("mlp", x, "kernel"), shape, True)
           for x, shape in (("gate", (model.mlp_dim, d)), ("up", (model.mlp_dim, d)), ("down", (d, model.mlp_dim)))]
  routed = [("mlp.gate.weight", ("moe", "router"), (e, d), True),
            ("mlp.gate.e_score_correction_bias", ("moe", "score_bias"), (e,), False)]
  s = model.num_shared_experts * f
  if s:
    routed += [(f"mlp.shared_experts.{x}_proj.weight", ("moe", "shared", x, "kernel"), shape, True)
               for x, shape in (("gate", (s, d)), ("up", (s, d)), ("down", (d, s)))]
  expert = [(x, (f, d) if x != "down" else (d, f)) for x in ("gate", "up", "down")]
  depth = int(model.get("mtp_depth", 0))
  for i in range(model.num_layers + depth):
    stack, j = (("dense_layers",), i) if i < k else (("layers",), i - k) if i < model.num_layers else (
        ("mtp", "block"), i - model.num_layers)
    if i >= model.num_layers:  # a multi-token-prediction module: its own tensors, then its decoder layer's
      head = (("lm_head", "kernel"), True) if not model.tie_embeddings else (("embed", "embedding"), False)
      for name, path, index, shape, linear in [
          ("enorm.weight", ("mtp", "enorm", "scale"), (j,), (d,), False),
          ("hnorm.weight", ("mtp", "hnorm", "scale"), (j,), (d,), False),
          ("eh_proj.weight", ("mtp", "eh_proj", "kernel"), (j,), (d, 2 * d), True),
          ("shared_head.norm.weight", ("mtp", "post_norm", "scale"), (j,), (d,), False),
          ("embed_tokens.weight", ("embed", "embedding"), None, (v, d), False),
          ("shared_head.head.weight", head[0], None, (v, d), head[1])]:
        out.append(Tensor(f"model.layers.{i}.{name}", path, index, shape, linear))
    for name, path, shape, linear in attn + (dense if i < k else routed) + norms:
      out.append(Tensor(f"model.layers.{i}.{name}", (*stack, *path), (j,), shape, linear))
    for x in range(e if i >= k else 0):
      for name, shape in expert:
        out.append(Tensor(f"model.layers.{i}.mlp.experts.{x}.{name}_proj.weight", (*stack, "moe", name), (j, x),
                          shape, True))
  return out


hf_adapter.register(DeepseekV3Adapter())
hf_adapter.register(DeepseekV3Adapter(model_type="kimi_k2"))

"""The Hugging Face adapter of ``qwen3_next`` (transformers' ``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B), a
:class:`~jaxtrain.models.moe.hf.MoeShaped` one (config.json's Llama keys with ``partial_rotary_factor``, the router and
per-expert tensors of Qwen 3 MoE: ``mlp.gate.weight``, ``mlp.experts.E.{gate,up,down}_proj``) with Qwen3-Next's keys
and layer kinds.

Tensors per layer i (group ``i // full_attention_interval`` of jaxtrain's layer stack; within it the DeltaNet stack's
layer ``i % full_attention_interval``, or the group's full-attention layer): a full-attention layer's
``self_attn.{q,k,v,o}_proj`` and ``q_norm`` / ``k_norm`` (Llama's layouts, jaxtrain/models/llama/hf.py; ``q_proj``
``[heads x 2 head_dim, d]``: each head's query, then its gate), or a DeltaNet layer's ``linear_attn.in_proj_qkvz``
``[k_heads x (2 dk + 2 (v_heads / k_heads) dv), d]``, ``in_proj_ba``, ``conv1d.weight`` ``[channels, 1, K]``,
``dt_bias``, ``A_log``, ``norm.weight`` and ``out_proj`` (jaxtrain keeps the checkpoint's grouping:
jaxtrain/models/qwen3_next/model.py); then the MoE's router and experts, ``mlp.shared_expert.{gate,up,down}_proj``
and ``mlp.shared_expert_gate.weight`` ``[1, d]``, and the two norms (``1 + w``, stored as they are). config.json must
place its full-attention layers every ``full_attention_interval`` layers (``layer_types``) and make every layer
sparse (``decoder_sparse_step`` 1, no ``mlp_only_layers``); the multi-token-prediction weights (``mtp.*``) are
skipped on import.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

from jaxtrain.models import hf_adapter
from jaxtrain.models.hf_adapter import HFError, Tensor
from jaxtrain.models.llama.hf import LlamaShaped
from jaxtrain.models.moe.hf import MoeShaped

# config.json's DeltaNet keys and jaxtrain's
_LINEAR_KEYS = (("linear_num_key_heads", "linear_k_heads"), ("linear_num_value_heads", "linear_v_heads"),
                ("linear_key_head_dim", "linear_k_dim"), ("linear_value_head_dim", "linear_v_dim"),
                ("linear_conv_kernel_dim", "linear_conv_kernel"))


def layer_types(layers: int, every: int) -> list[str]:
  return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)]


def full_attention_every(hf: dict) -> int:
  """config.json's ``full_attention_interval``, or where ``layer_types`` (what transformers writes) has its first
  full-attention layer."""
  types_ = list(hf.get("layer_types") or [])
  if "full_attention" in types_:
    return types_.index("full_attention") + 1
  return int(hf.get("full_attention_interval") or 4)


@dataclasses.dataclass(frozen=True)
class Qwen3NextAdapter(MoeShaped):
  model_type: str = "qwen3_next"
  family: str = "qwen3_next"
  architecture: str = "Qwen3NextForCausalLM"
  variants: dict = dataclasses.field(default_factory=lambda: {"qk_norm": "head", "norm_plus_one": True})
  fixed: dict = dataclasses.field(default_factory=lambda: {"attention_bias": False})
  expert_size: str = "moe_intermediate_size"
  sparse_step: bool = True
  partial_rotary: bool = True

  def _check(self, hf: dict, where: str) -> None:
    if hf.get("quantization_config"):
      raise HFError(where, f"is quantized ({hf['quantization_config'].get('quant_method', 'quantization_config')})",
                    "import the bf16 checkpoint (Qwen/Qwen3-Next-80B-A3B-Instruct, not -FP8)")
    hf_adapter.require_ints(hf, where, [k for k, _ in _LINEAR_KEYS] + ["num_experts", "moe_intermediate_size"])
    every = full_attention_every(hf)
    if list(hf.get("layer_types") or layer_types(hf["num_hidden_layers"], every)) != layer_types(
        hf["num_hidden_layers"], every):
      raise HFError(where, "places its full-attention layers (layer_types) other than every "
                    "full_attention_interval layers", "only Qwen3-Next's pattern is supported")
    super()._check(hf, where)

  def _family_keys(self, hf: dict, where: str) -> dict:
    k = int(hf.get("num_experts_per_tok", 10))
    return dict(num_experts=hf["num_experts"], experts_per_token=k, expert_mlp_dim=hf["moe_intermediate_size"],
                normalize_topk=bool(hf.get("norm_topk_prob", True)), router_z_weight=0.0,
                load_balance_weight=float(hf.get("router_aux_loss_coef", 0.001)) * k,
                shared_mlp_dim=int(hf.get("shared_expert_intermediate_size") or 0),
                full_attention_every=full_attention_every(hf),
                **{ours: hf[theirs] for theirs, ours in _LINEAR_KEYS})

  def _family_fields(self, model: Any) -> dict:
    return dict(num_experts=model.num_experts, num_experts_per_tok=model.experts_per_token,
                moe_intermediate_size=model.expert_mlp_dim, norm_topk_prob=bool(model.normalize_topk),
                router_aux_loss_coef=model.load_balance_weight / model.experts_per_token,
                shared_expert_intermediate_size=model.shared_mlp_dim, decoder_sparse_step=1, mlp_only_layers=[],
                full_attention_interval=model.full_attention_every,
                layer_types=layer_types(model.num_layers, model.full_attention_every), sliding_window=None,
                **{theirs: model[ours] for theirs, ours in _LINEAR_KEYS})

  def hf_config(self, model: Any, base: dict | None, dtype: str) -> dict:
    out = super().hf_config(model, base, dtype)
    del out["sliding_window"]
    return out

  def why_not_exportable(self, model: Any) -> str | None:
    return LlamaShaped.why_not_exportable(self, model)

  def ignored(self, name: str, model: Any) -> bool:
    return super().ignored(name, model) or name.startswith("mtp.")

  def _linear_attention(self, model: Any) -> list[tuple]:
    d, nk, nv, dk, dv = (model.d_model, model.linear_k_heads, model.linear_v_heads, model.linear_k_dim,
                         model.linear_v_dim)
    channels = 2 * nk * dk + nv * dv
    return [("linear_attn.in_proj_qkvz.weight", ("attn", "qkvz", "kernel"), (2 * nk * dk + 2 * nv * dv, d), True),
            ("linear_attn.in_proj_ba.weight", ("attn", "ba", "kernel"), (2 * nv, d), True),
            ("linear_attn.conv1d.weight", ("attn", "conv"), (channels, 1, model.linear_conv_kernel), False),
            ("linear_attn.dt_bias", ("attn", "dt_bias"), (nv,), False),
            ("linear_attn.A_log", ("attn", "A_log"), (nv,), False),
            ("linear_attn.norm.weight", ("attn", "norm"), (dv,), False),
            ("linear_attn.out_proj.weight", ("attn", "o", "kernel"), (d, nv * dv), True)]

  def tensors(self, model: Any) -> list[Tensor]:
    d, every = model.d_model, model.full_attention_every
    outer = model.copy_and_resolve_references()
    outer.num_layers = 0
    out = LlamaShaped.tensors(self, outer)  # the embedding, the final norm, the head
    full = [(name, path, (2 * shape[0], shape[1]) if name.startswith("self_attn.q_proj") else shape, linear)
            for name, path, shape, linear in self._attention(model)]
    router, experts = self._mlp(model)
    shared = [(name.replace("mlp.", "mlp.shared_expert."), ("moe", "shared", "mlp", *path[1:]), shape, linear)
              for name, path, shape, linear in LlamaShaped._mlp(self, types.SimpleNamespace(
                  d_model=d, mlp_dim=model.shared_mlp_dim))[0]] if model.shared_mlp_dim else []
    if shared:
      shared.append(("mlp.shared_expert_gate.weight", ("moe", "shared", "gate"), (1, d), True))
    norms = [("input_layernorm.weight", ("attn_norm", "scale"), (d,), False),
             ("post_attention_layernorm.weight", ("mlp_norm", "scale"), (d,), False)]
    for i in range(model.num_layers):
      group, part = divmod(i, every)
      kind, index = (("full",), (group,)) if part == every - 1 else (("linear",), (group, part))
      mixer = full if kind == ("full",) else self._linear_attention(model)
      for name, path, shape, linear in mixer + router + shared + norms:
        out.append(Tensor(f"model.layers.{i}.{name}", ("layers", *kind, *path), index, shape, linear))
      for e in range(model.num_experts):
        for name, path, shape in experts:
          out.append(Tensor(f"model.layers.{i}.{name.format(e=e)}.weight", ("layers", *kind, *path), (*index, e),
                            shape, True))
    return out


hf_adapter.register(Qwen3NextAdapter())

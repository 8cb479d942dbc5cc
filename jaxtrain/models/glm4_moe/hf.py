"""The Hugging Face adapter of ``glm4_moe`` (transformers' ``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air, GLM-4.6).

Made of two others' parts: config.json's Llama-shaped keys and the attention's tensors are Llama's
(jaxtrain/models/llama/hf.py ``LlamaShaped``: ``self_attn.{q,k,v}_proj`` with their biases when ``attention_bias``,
``q_norm`` / ``k_norm`` per head when ``use_qk_norm``, ``partial_rotary_factor``), the MoE's keys and the layers'
tensors DeepSeek-V3's (jaxtrain/models/deepseek_v3/hf.py: ``n_routed_experts``, ``n_group``, ...; the dense first
layers' ``mlp.*_proj``, the others' router ``mlp.gate.weight``, ``e_score_correction_bias``, per-expert and shared
experts). The multi-token-prediction layer the released checkpoints carry as layer ``num_hidden_layers``
(``num_nextn_predict_layers``) is skipped on import. A quantized checkpoint is refused in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.models import hf_adapter
from jaxtrain.models.deepseek_v3 import hf as deepseek_hf
from jaxtrain.models.hf_adapter import HFError, Tensor
from jaxtrain.models.llama.hf import LlamaShaped


@dataclasses.dataclass(frozen=True)
class Glm4MoeAdapter(LlamaShaped):
  model_type: str = "glm4_moe"
  family: str = "glm4_moe"
  architecture: str = "Glm4MoeForCausalLM"
  variants: dict = dataclasses.field(default_factory=lambda: {"qkv_bias": False, "qk_norm": False})
  partial_rotary: bool = True

  def _check(self, hf: dict, where: str) -> None:
    if hf.get("quantization_config"):
      raise HFError(where, f"is quantized ({hf['quantization_config'].get('quant_method', 'quantization_config')})",
                    "import the bf16 checkpoint (zai-org/GLM-4.5-Air, not -FP8)")
    hf_adapter.require_ints(hf, where, ["moe_intermediate_size"])
    super()._check(hf, where)

  def _family_keys(self, hf: dict, where: str) -> dict:
    return dict(qkv_bias=bool(hf.get("attention_bias")), qk_norm="head" if hf.get("use_qk_norm") else "",
                **deepseek_hf.routing_from_hf(hf))

  def _family_fields(self, model: Any) -> dict:
    return dict(attention_bias=bool(model.qkv_bias), use_qk_norm=bool(model.qk_norm),
                **deepseek_hf.routing_to_hf(model))

  def hf_config(self, model: Any, base: dict | None, dtype: str) -> dict:
    out = super().hf_config(model, base, dtype)
    del out["sliding_window"]  # (GLM has no window: a model with one is refused by why_not_exportable)
    out.setdefault("num_nextn_predict_layers", 0)  # the MTP layer is not exported
    return out

  def why_not_exportable(self, model: Any) -> str | None:
    if model.qk_norm not in ("", "head"):
      return f"sets model.qk_norm={model.qk_norm}, where glm4_moe normalizes each head (head) or none"
    return super().why_not_exportable(model)

  def ignored(self, name: str, model: Any) -> bool:
    return super().ignored(name, model) or deepseek_hf.mtp_layer(name, model)

  def tensors(self, model: Any) -> list[Tensor]:
    return deepseek_hf.layer_tensors(model, self._attention(model))


hf_adapter.register(Glm4MoeAdapter())

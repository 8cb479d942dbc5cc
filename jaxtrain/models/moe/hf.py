"""The Hugging Face adapters of the Mixture-of-Experts model_types: ``mixtral`` (``MixtralForCausalLM``, the hub's
per-expert ``block_sparse_moe.experts.E.w1/w2/w3`` tensors; the ``moe`` family), ``qwen3_moe`` and ``olmoe``
(``mlp.experts.E.{gate,up,down}_proj``). Llama-shaped attention and norms (jaxtrain/models/llama/hf.py), then the
router ``[d, E]`` and the experts stacked ``[layers, E, in, out]``. transformers' load-balancing loss is
experts_per_token x jaxtrain's (jaxtrain/models/moe/model.py), so its coefficient is converted both ways.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.models import hf_adapter
from jaxtrain.models.hf_adapter import HFError
from jaxtrain.models.llama.hf import LlamaShaped

_MIXTRAL = (("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}."),
            (("w1", "gate"), ("w3", "up"), ("w2", "down")))  # the router; each expert's gate, up, down
_QWEN = (("mlp.gate.weight", "mlp.experts.{e}."), (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")))


@dataclasses.dataclass(frozen=True)
class MoeShaped(LlamaShaped):
  """A Llama-shaped ``model_type`` whose MLPs are routed experts.

  names: (router tensor, expert prefix with ``{e}``) and each expert weight's (HF name, jaxtrain param).
  expert_size: the config.json key of the experts' hidden size.
  fields: what config.json says of the experts beyond ``num_local_experts`` and ``num_experts_per_tok``: a
    ``num_experts`` copy, ``norm_topk_prob`` (else always normalized), fixed keys.
  sparse_step: config.json may make layers dense (``decoder_sparse_step``, ``mlp_only_layers``): refused unless
    every layer is sparse.
  """
  names: tuple = _QWEN
  expert_size: str = "intermediate_size"
  num_experts_key: bool = True
  norm_topk_key: bool = True
  moe_fixed: dict = dataclasses.field(default_factory=dict)
  sparse_step: bool = False

  def _check(self, hf: dict, where: str) -> None:
    if self.sparse_step and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
      raise HFError(where, "mixes dense and sparse layers (decoder_sparse_step / mlp_only_layers)",
                    "only Qwen 3 MoE models whose every layer is sparse are supported")
    super()._check(hf, where)

  def _family_keys(self, hf: dict, where: str) -> dict:
    k = int(hf.get("num_experts_per_tok", 2))
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 8
    return dict(num_experts=int(experts), experts_per_token=k, expert_mlp_dim=hf[self.expert_size],
                router_scores="softmax", normalize_topk=bool(hf.get("norm_topk_prob", True)),
                load_balance_weight=float(hf.get("router_aux_loss_coef", 0.02)) * k, router_z_weight=0.0)

  def _family_fields(self, model: Any) -> dict:
    out = dict(num_local_experts=model.num_experts, num_experts_per_tok=model.experts_per_token,
               router_aux_loss_coef=model.load_balance_weight / model.experts_per_token)
    if self.num_experts_key:
      out.update(num_experts=model.num_experts)
    out[self.expert_size] = model.expert_mlp_dim
    if self.norm_topk_key:
      out.update(norm_topk_prob=bool(model.normalize_topk))
    out.update(self.moe_fixed)
    return out

  def why_not_exportable(self, model: Any) -> str | None:
    why = super().why_not_exportable(model)
    if why is None and (model.num_shared_experts or model.first_dense_layers or model.router_scores != "softmax"
                        or (not self.norm_topk_key and not model.normalize_topk)):
      why = ("is not Mixtral / Qwen 3 MoE-shaped (shared experts, dense first layers, sigmoid scores or unnormalized "
             "top-k)")
    return why

  def _mlp(self, model: Any) -> tuple[list[tuple], list[tuple]]:
    d, f = model.d_model, model.expert_mlp_dim
    (router, prefix), weights = self.names
    shapes = {"gate": (f, d), "up": (f, d), "down": (d, f)}
    return ([(router, ("moe", "router"), (model.num_experts, d), True)],
            [(prefix + hf_name, ("moe", ours), shapes[ours]) for hf_name, ours in weights])


hf_adapter.register(MoeShaped("mixtral", "moe", "MixtralForCausalLM", variants={"sliding_window": False},
                              names=_MIXTRAL, num_experts_key=False, norm_topk_key=False))
hf_adapter.register(MoeShaped("qwen3_moe", "qwen3_moe", "Qwen3MoeForCausalLM", variants={"qk_norm": "head"},
                              fixed={"attention_bias": False}, qwen_window=True, expert_size="moe_intermediate_size",
                              sparse_step=True, moe_fixed={"decoder_sparse_step": 1, "mlp_only_layers": []}))
hf_adapter.register(MoeShaped("olmoe", "olmoe", "OlmoeForCausalLM", variants={"qk_norm": "full"},
                              fixed={"attention_bias": False}, moe_fixed={"clip_qkv": None}))

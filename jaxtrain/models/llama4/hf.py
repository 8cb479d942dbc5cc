"""The Hugging Face adapter of ``llama4_text`` (transformers' ``Llama4ForCausalLM``: Llama 4's text model), a
:class:`~jaxtrain.models.llama.hf.LlamaShaped` one (config.json's Llama keys, RoPE with Llama 3's scaling, the
attention's tensors and the dense layers' MLP as Llama's) with Llama 4's keys and layer kinds.

Tensors per layer i (group ``i // moe_every`` of jaxtrain's layer stack): the attention's ``self_attn.{q,k,v,o}_proj``
and the two norms (Llama's layouts, jaxtrain/models/llama/hf.py; q and k as the checkpoint pairs their dims:
jaxtrain de-interleaves them when it turns them), then a dense layer's ``feed_forward.{gate,up,down}_proj``, or a
MoE layer's ``feed_forward.router.weight`` ``[E, d]`` (a Linear), ``feed_forward.experts.gate_up_proj`` ``[E, d, 2f]``
(``[in, out]``, gate then up: jaxtrain's ``gate_up`` ``[E, d, 2, f]`` reshaped), ``experts.down_proj`` ``[E, f, d]``
and ``feed_forward.shared_expert.{gate,up,down}_proj``. config.json's ``no_rope_layers`` must be one NoPE layer every
N (``global_every``) and ``moe_layers`` every ``interleave_moe_layer_step``-th layer; other patterns are refused in
one line, as is the multimodal ``llama4`` (``Llama4ForConditionalGeneration``).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import ml_collections

from jaxtrain.models import hf_adapter
from jaxtrain.models.hf_adapter import HFError, Tensor
from jaxtrain.models.llama.hf import LlamaShaped
from jaxtrain.models.llama4.model import rope_layers


@dataclasses.dataclass(frozen=True)
class Llama4Text(LlamaShaped):
  model_type: str = "llama4_text"
  family: str = "llama4"
  architecture: str = "Llama4ForCausalLM"
  variants: dict = dataclasses.field(default_factory=lambda: {"global_every": False})
  fixed: dict = dataclasses.field(default_factory=lambda: {"attention_bias": False})

  def _family_keys(self, hf: dict, where: str) -> dict:
    layers = hf["num_hidden_layers"]
    rope = [bool(r) for r in (hf.get("no_rope_layers") or [1] * layers)][:layers]
    every = 0 if all(rope) else rope.index(False) + 1
    if rope != [not (every and (i + 1) % every == 0) for i in range(layers)]:
      raise HFError(where, "places its NoPE layers (no_rope_layers) other than one every N layers",
                    "only Llama 4's pattern (no_rope_layer_interval) is supported")
    step = int(hf.get("interleave_moe_layer_step") or 1)
    moe_layers = hf.get("moe_layers")
    if moe_layers is None:
      moe_layers = list(range(step - 1, layers, step))
    if step not in (1, 2) or layers % step or list(moe_layers) != list(range(step - 1, layers, step)):
      raise HFError(where, f"places its MoE layers other than every layer or every other one (moe_layers "
                    f"{moe_layers}, interleave_moe_layer_step {step})", "only Scout's and Maverick's are supported")
    for key in ("quantization_config", "router_jitter_noise"):
      if hf.get(key):
        raise HFError(where, f"sets {key}", "not supported (import an unquantized checkpoint)")
    k = int(hf.get("num_experts_per_tok") or 1)
    return dict(mlp_dim=int(hf.get("intermediate_size_mlp") or 16384), expert_mlp_dim=hf["intermediate_size"],
                num_experts=int(hf.get("num_local_experts") or 16), experts_per_token=k, moe_every=step,
                global_every=every, attention_chunk_size=int(hf.get("attention_chunk_size") or 0),
                qk_l2_norm=bool(hf.get("use_qk_norm", True)),
                attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
                floor_scale=int(hf.get("floor_scale") or 8192), attn_scale=float(hf.get("attn_scale", 0.1)),
                norm_eps=float(hf.get("rms_norm_eps", 1e-5)))

  def model_config(self, hf: dict, where: str) -> ml_collections.ConfigDict:
    if hf.get("attention_chunk_size") is None and not all(hf.get("no_rope_layers") or [1]):
      raise HFError(where, "has NoPE layers and no attention_chunk_size", "only chunked Llama 4 models are supported")
    return super().model_config(hf, where)

  def _family_fields(self, model: Any) -> dict:
    rope = rope_layers(model)
    return dict(intermediate_size=model.expert_mlp_dim, intermediate_size_mlp=model.mlp_dim,
                num_local_experts=model.num_experts, num_experts_per_tok=model.experts_per_token,
                interleave_moe_layer_step=model.moe_every,
                moe_layers=list(range(model.moe_every - 1, model.num_layers, model.moe_every)),
                no_rope_layers=[int(r) for r in rope], no_rope_layer_interval=model.global_every or 4,
                attention_chunk_size=model.attention_chunk_size or None,
                layer_types=["chunked_attention" if r and model.attention_chunk_size else "full_attention"
                             for r in rope],
                use_qk_norm=bool(model.qk_l2_norm), attn_temperature_tuning=bool(model.attn_temperature_tuning),
                floor_scale=model.floor_scale, attn_scale=model.attn_scale, router_aux_loss_coef=0.0,
                router_jitter_noise=0.0, output_router_logits=False, sliding_window=None)

  def tensors(self, model: Any) -> list[Tensor]:
    d, v, e, f = model.d_model, model.vocab_size, model.num_experts, model.expert_mlp_dim
    out = [Tensor("model.embed_tokens.weight", ("embed", "embedding"), None, (v, d), False),
           Tensor("model.norm.weight", ("final_norm", "scale"), None, (d,), False)]
    if not model.tie_embeddings:
      out.append(Tensor("lm_head.weight", ("lm_head", "kernel"), None, (v, d), True))
    dense = [(name.replace("mlp.", "feed_forward."), path, shape, linear)
             for name, path, shape, linear in self._mlp(model)[0]]
    shared = [(name.replace("mlp.", "feed_forward.shared_expert."), ("moe", "shared", *path[1:]), shape, linear)
              for name, path, shape, linear in self._mlp(types.SimpleNamespace(d_model=d, mlp_dim=f))[0]]
    sparse = [("feed_forward.router.weight", ("moe", "router"), (e, d), True),
              ("feed_forward.experts.gate_up_proj", ("moe", "gate_up"), (e, d, 2 * f), False),
              ("feed_forward.experts.down_proj", ("moe", "down"), (e, f, d), False), *shared]
    norms = [("input_layernorm.weight", ("attn_norm", "scale"), (d,), False),
             ("post_attention_layernorm.weight", ("mlp_norm", "scale"), (d,), False)]
    for i in range(model.num_layers):
      group, part = divmod(i, model.moe_every)
      kind = "sparse" if part == model.moe_every - 1 else "dense"
      for name, path, shape, linear in self._attention(model) + (sparse if kind == "sparse" else dense) + norms:
        out.append(Tensor(f"model.layers.{i}.{name}", ("layers", kind, *path), (group,), shape, linear))
    return out


hf_adapter.register(Llama4Text())
hf_adapter.refuse("llama4", "is Llama 4's multimodal checkpoint (Llama4ForConditionalGeneration)", "import its text "
                  "model: a Llama4ForCausalLM checkpoint (model_type llama4_text)")

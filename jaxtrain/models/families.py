"""The open model families that are the Llama decoder (or the MoE one) with other attention variants switched on.

Each is registered as its own ``model.name`` (its defaults the published models' settings, its Hugging Face
``model_type`` for jaxtrain/hf.py) over the same module: the differences are flags of jaxtrain.models.llama
(``qkv_bias``, ``qk_norm``, ``sliding_window``, ``global_every``, ``attn_softcap``, ``final_softcap``,
``query_scale``), not copies of the code. docs/models.md has the table of what each supports.

- ``qwen2``: Qwen 2 / 2.5: biases on the q, k, v projections; RoPE theta 1e6.
- ``qwen3``: Qwen 3 dense: QK-norm (RMSNorm of each query and key head), no biases; RoPE theta 1e6.
- ``qwen3_moe``: Qwen 3 MoE: the ``moe`` family with QK-norm; softmax router, top-k renormalized, no shared experts.
- ``mistral``: Mistral 7B (v0.1): sliding-window attention (4096) on every layer.
- ``olmoe``: OLMoE: the ``moe`` family with QK-norm over the whole q and k projections, softmax router, top-k
  weights as they are (not renormalized).
- ``gemma2``: Gemma 2: Gemma's block (RMSNorm scaled by 1 + w, GeGLU with tanh, embeddings scaled by sqrt(d_model),
  norms on the attention's and MLP's outputs too, tied head), local (4096) and global layers alternating, attention
  logits soft-capped at 50 and final logits at 30, queries scaled by ``query_pre_attn_scalar ** -0.5``.
- ``gemma3``: Gemma 3 (text): Gemma's block with QK-norm and no soft-caps; five local layers (window 1024, RoPE
  theta 10000) to one global (theta 1e6).
"""

from __future__ import annotations

import dataclasses

from jaxtrain import models
from jaxtrain.models import llama, moe

def _preset(base: str, **keys) -> models.Family:
  """The family ``base`` with other defaults for its own keys."""
  family = models.get(base)
  unknown = set(keys) - set(family.defaults())
  if unknown:
    raise ValueError(f"{sorted(unknown)} are not keys of the '{base}' family")
  return dataclasses.replace(family, defaults=lambda: {**family.defaults(), **keys})


_QWEN = dict(rope_theta=1_000_000.0, norm_eps=1e-6)

models.register("qwen2", _preset("llama", qkv_bias=True, **_QWEN))
models.register("qwen3", _preset("llama", qk_norm="head", **_QWEN))
models.register("qwen3_moe", _preset("moe", qk_norm="head", router_scores="softmax", normalize_topk=True,
                                     router_z_weight=0.0, **_QWEN))
models.register("mistral", _preset("llama", sliding_window=4096, rope_theta=10_000.0))

models.register("olmoe", _preset("moe", qk_norm="full", router_scores="softmax", normalize_topk=False,
                                 rope_theta=10_000.0, norm_eps=1e-5))

_GEMMA = dict(norm_plus_one=True, mlp_activation="gelu_tanh", embed_scale=True, sandwich_norms=True,
              tie_embeddings=True, norm_eps=1e-6, query_scale=256 ** -0.5)
models.register("gemma2", _preset("llama", sliding_window=4096, global_every=2, attn_softcap=50.0, final_softcap=30.0,
                                  rope_theta=10_000.0, **_GEMMA))
models.register("gemma3", _preset("llama", qk_norm="head", sliding_window=1024, global_every=6, rope_theta=1_000_000.0,
                                  rope_local_theta=10_000.0, **_GEMMA))

del llama, moe  # imported so that the base families are registered first

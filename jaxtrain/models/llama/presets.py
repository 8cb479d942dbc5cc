"""The open families that are the Llama decoder with other attention variants switched on, each registered as its
own ``model.name`` (its defaults the published models' settings) over the same module: the differences are flags of
jaxtrain/models/llama/model.py (``qkv_bias``, ``qk_norm``, ``sliding_window``, ``global_every``, ``attn_softcap``,
``final_softcap``, ``query_scale``), not copies of the code. docs/models.md has the table of what each supports.

- ``qwen2``: Qwen 2 / 2.5: biases on the q, k, v projections; RoPE theta 1e6.
- ``qwen3``: Qwen 3 dense: QK-norm (RMSNorm of each query and key head), no biases; RoPE theta 1e6.
- ``mistral``: Mistral 7B (v0.1): sliding-window attention (4096) on every layer.
- ``gemma2``: Gemma 2: Gemma's block (RMSNorm scaled by 1 + w, GeGLU with tanh, embeddings scaled by sqrt(d_model),
  norms on the attention's and MLP's outputs too, tied head), local (4096) and global layers alternating, attention
  logits soft-capped at 50 and final logits at 30, queries scaled by ``query_pre_attn_scalar ** -0.5``.
- ``gemma3``: Gemma 3 (text): Gemma's block with QK-norm and no soft-caps; five local layers (window 1024, RoPE
  theta 10000) to one global (theta 1e6).
"""

from __future__ import annotations

from jaxtrain.models import core
from jaxtrain.models.llama import model

QWEN = dict(rope_theta=1_000_000.0, norm_eps=1e-6)
_GEMMA = dict(norm_plus_one=True, mlp_activation="gelu_tanh", embed_scale=True, sandwich_norms=True,
              tie_embeddings=True, norm_eps=1e-6, query_scale=256 ** -0.5)

core.register("qwen2", core.preset("llama", qkv_bias=True, **QWEN))
core.register("qwen3", core.preset("llama", qk_norm="head", **QWEN))
core.register("mistral", core.preset("llama", sliding_window=4096, rope_theta=10_000.0))
core.register("gemma2", core.preset("llama", sliding_window=4096, global_every=2, attn_softcap=50.0,
                                    final_softcap=30.0, rope_theta=10_000.0, **_GEMMA))
core.register("gemma3", core.preset("llama", qk_norm="head", sliding_window=1024, global_every=6,
                                    rope_theta=1_000_000.0, rope_local_theta=10_000.0, **_GEMMA))
del model  # imported so that the base family is registered first

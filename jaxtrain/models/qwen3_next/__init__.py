"""The Qwen3-Next family, in one folder: the hybrid decoder of gated DeltaNet and gated full attention layers, every
one a MoE with a gated shared expert, with its keys, checks, FLOPs and recurrent-state decoding (``model.py``:
``model.name=qwen3_next``), built from the ``moe`` family's stack and router and Llama's parts, and its Hugging Face
adapter (``hf.py``: ``qwen3_next``). Importing the package registers both; the decoder's names are re-exported here.
The published size is configs/qwen3_next_80b_a3b.py."""

from jaxtrain.models.qwen3_next import hf
from jaxtrain.models.qwen3_next.model import (AXIS_KEYS, GatedAttention, GatedDeltaNet, Group, HybridCache, MoE,
                                              Qwen3Next, activation_estimate, chunked_delta_rule, defaults,
                                              flops_per_token, param_counts, recurrent_delta_rule, validate)

__all__ = ["AXIS_KEYS", "GatedAttention", "GatedDeltaNet", "Group", "HybridCache", "MoE", "Qwen3Next",
           "activation_estimate", "chunked_delta_rule", "defaults", "flops_per_token", "hf", "param_counts",
           "recurrent_delta_rule", "validate"]

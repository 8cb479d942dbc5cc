"""The DeepSeek-V3 family, in one folder: the decoder with its keys, checks, FLOPs, activation estimate and KV-cache
decoding (``model.py``: ``model.name=deepseek_v3``) and its Hugging Face adapter (``hf.py``: ``deepseek_v3``).
Importing the package registers both; the decoder's names are re-exported here."""

from jaxtrain.models.deepseek_v3 import hf
from jaxtrain.models.deepseek_v3.model import (AXIS_KEYS, MLA, Block, DeepseekV3, MoE, activation_estimate,
                                               cache_bytes_per_token, defaults, flops_per_token, param_counts,
                                               qk_head_dim, validate)

__all__ = ["AXIS_KEYS", "MLA", "Block", "DeepseekV3", "MoE", "activation_estimate", "cache_bytes_per_token",
           "defaults", "flops_per_token", "hf", "param_counts", "qk_head_dim", "validate"]

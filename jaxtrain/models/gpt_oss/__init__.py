"""The GPT-OSS family, in one folder: the decoder with its keys, checks, FLOPs, activation estimate and KV-cache
decoding (``model.py``: ``model.name=gpt_oss``) and its Hugging Face adapter (``hf.py``: ``gpt_oss``). Importing the
package registers both; the decoder's names are re-exported here. The published sizes are configs/gpt_oss_20b.py
and configs/gpt_oss_120b.py."""

from jaxtrain.models.gpt_oss import hf
from jaxtrain.models.gpt_oss.model import (AXIS_KEYS, Block, GptOss, MoE, activation_estimate, clamped_swiglu,
                                           defaults, flops_per_token, param_counts, validate)

__all__ = ["AXIS_KEYS", "Block", "GptOss", "MoE", "activation_estimate", "clamped_swiglu", "defaults",
           "flops_per_token", "hf", "param_counts", "validate"]

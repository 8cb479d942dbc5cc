"""The Llama 4 family (text), in one folder: the decoder with its keys, checks, FLOPs, activation estimate and KV-cache
decoding (``model.py``: ``model.name=llama4``), built from the Llama, MoE and attention parts, and its Hugging Face
adapter (``hf.py``: ``llama4_text``). Importing the package registers both; the decoder's names are re-exported here.
The published size is configs/llama4_scout.py."""

from jaxtrain.models.llama4 import hf
from jaxtrain.models.llama4.model import (AXIS_KEYS, Attention, Group, Llama4, MoE, activation_estimate, defaults,
                                          flops_per_token, param_counts, rope_layers, validate)

__all__ = ["AXIS_KEYS", "Attention", "Group", "Llama4", "MoE", "activation_estimate", "defaults", "flops_per_token",
           "hf", "param_counts", "rope_layers", "validate"]

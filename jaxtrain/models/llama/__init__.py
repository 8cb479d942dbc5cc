"""The Llama-shaped families, in one folder: the decoder with its keys, checks, FLOPs, activation estimate and
KV-cache decoding (``model.py``: ``model.name=llama``), the families that are its flags (``presets.py``: Qwen 2 / 2.5,
Qwen 3, Mistral, Gemma 2, Gemma 3), and their Hugging Face adapters (``hf.py``: one per ``model_type``). Importing
the package registers all of them; the decoder's names are re-exported here (``llama.Llama``, ``llama.lookup``)."""

from jaxtrain.models.llama import hf, presets
from jaxtrain.models.llama.model import (AXIS_KEYS, MLP, MLP_ACTIVATIONS, QK_NORMS, ROPE_SCALINGS, Attention, Block,
                                         Llama, RMSNorm, activation_estimate, defaults, flops_per_token, lookup,
                                         norm, rope, rope_frequencies, rope_scaling, validate)

__all__ = ["AXIS_KEYS", "MLP", "MLP_ACTIVATIONS", "QK_NORMS", "ROPE_SCALINGS", "Attention", "Block", "Llama",
           "RMSNorm", "activation_estimate", "defaults", "flops_per_token", "hf", "lookup", "norm", "presets", "rope",
           "rope_frequencies", "rope_scaling", "validate"]

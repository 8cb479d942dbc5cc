"""Model families: the contract every family meets and the functional view of a model (``core.py``, its names
re-exported here: ``models.register``, ``models.Family``, ``models.Model``), and the built-in families, one folder
each, imported here so that they are registered: ``llama/`` (Llama, Qwen 2 / 2.5, Qwen 3, Mistral, Gemma 2 and 3),
``moe/`` (Mixtral-shaped MoE, Qwen 3 MoE, OLMoE), ``gpt_oss/`` (GPT-OSS), ``deepseek_v3/`` (DeepSeek-V3),
``glm4_moe/`` (GLM-4.5), ``llama4/`` (Llama 4, text) and ``qwen3_next/`` (Qwen3-Next). A folder holds the module, its presets, FLOPs and activation estimate, its KV-cache
decoding and its Hugging Face adapters (``hf_adapter.py``'s contract). docs/extending.md adds a family from outside the package.
"""

from jaxtrain.models.core import (ACTIVATION_NAMES, DTYPES, FAMILIES, LAYER_INPUT, REMAT, SHARED, Family, Model,
                                  Output, Remat, axis_key, defaults, dense_flops_per_token, get,
                                  matmul_flops_per_token, names, preset, register, remat_layer, validate)
from jaxtrain.models import deepseek_v3, glm4_moe, gpt_oss, llama, llama4, moe, qwen3_next  # the built-in families: registered on import

__all__ = ["ACTIVATION_NAMES", "DTYPES", "FAMILIES", "LAYER_INPUT", "REMAT", "SHARED", "Family", "Model", "Output",
           "Remat", "axis_key", "deepseek_v3", "defaults", "dense_flops_per_token", "get", "glm4_moe", "gpt_oss",
           "llama", "llama4",
           "matmul_flops_per_token", "moe", "names", "preset", "qwen3_next", "register", "remat_layer", "validate"]

"""The Mixture-of-Experts families, in one folder: the decoder with its keys, checks, FLOPs, activation estimate and
KV-cache decoding (``model.py``: ``model.name=moe``, Mixtral's shape), the families that are its flags
(``presets.py``: Qwen 3 MoE, OLMoE), and their Hugging Face adapters (``hf.py``: ``mixtral``, ``qwen3_moe``,
``olmoe``). Importing the package registers all of them; the decoder's names are re-exported here."""

from jaxtrain.models.moe import hf, presets
from jaxtrain.models.moe.model import (AXIS_KEYS, ROUTER_SCORES, Block, MoE, MoeLM, activation_estimate, defaults,
                                       flops_per_token, param_counts, router_losses, validate)

__all__ = ["AXIS_KEYS", "ROUTER_SCORES", "Block", "MoE", "MoeLM", "activation_estimate", "defaults",
           "flops_per_token", "hf", "param_counts", "presets", "router_losses", "validate"]

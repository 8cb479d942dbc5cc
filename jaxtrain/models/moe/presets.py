"""The open Mixture-of-Experts families that are the ``moe`` decoder with other flags, each its own ``model.name``
(its defaults the published models' settings) over the same module (docs/models.md has the table):

- ``qwen3_moe``: Qwen 3 MoE: QK-norm per head, softmax router, top-k renormalized, no shared experts.
- ``olmoe``: OLMoE: QK-norm over the whole q and k projections, softmax router, top-k weights as they are (not
  renormalized).
"""

from __future__ import annotations

from jaxtrain.models import core
from jaxtrain.models.llama import presets as llama_presets
from jaxtrain.models.moe import model

core.register("qwen3_moe", core.preset("moe", qk_norm="head", router_scores="softmax", normalize_topk=True,
                                       router_z_weight=0.0, **llama_presets.QWEN))
core.register("olmoe", core.preset("moe", qk_norm="full", router_scores="softmax", normalize_topk=False,
                                   rope_theta=10_000.0, norm_eps=1e-5))
del model  # imported so that the base family is registered first

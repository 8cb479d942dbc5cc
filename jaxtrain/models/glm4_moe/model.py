"""GLM-4.5's decoder (``model.name=glm4_moe``; transformers' ``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air, GLM-4.6),
composed of other families' parts with nothing of its own:

* Attention: Llama's grouped-query attention (jaxtrain/models/llama) with its variants ``qkv_bias`` (GLM's
  ``attention_bias``) and ``qk_norm=head`` (``use_qk_norm``), and partial rotary (``partial_rotary_factor``, GLM-4.5:
  0.5): RoPE turns only the first ``head_dim x factor`` dims of each query and key head, their two halves paired as
  transformers' ``rotate_half`` does, and the rest pass (llama.rope); the softmax scale stays ``1 / sqrt(head_dim)``.
* Feed-forward: the first ``first_dense_layers`` layers Llama's dense SwiGLU (``mlp_dim``), the others DeepSeek-V3's
  MoE (jaxtrain/models/deepseek_v3: sigmoid scores, the choice bias ``score_bias`` that only picks, expert groups
  ``num_groups`` / ``topk_groups``, ``normalize_topk``, ``routed_scaling_factor``, ``num_shared_experts``), balanced by
  the bias's update (``bias_update_speed``: jaxtrain.optim.balance_update) as DeepSeek-V3 is.
* The stack, its pipeline methods and KV-cache decoding (the paged cache too): the ``moe`` family's
  (jaxtrain/models/moe), with the MoE block above.

FLOPs, the activation estimate, parameter counts and the axis map are the ``moe`` family's.
"""

from __future__ import annotations

import ml_collections

from jaxtrain.errors import ConfigError
from jaxtrain.models import core
from jaxtrain.models.deepseek_v3 import model as deepseek
from jaxtrain.models.llama import model as llama
from jaxtrain.models.moe import model as moe


def defaults() -> dict:
  """The GLM-4.5 family's ``model`` keys: the ``moe`` family's (sigmoid scores always, so no ``router_scores``),
  DeepSeek-V3's routing keys and partial rotary; GLM-4.5-Air's settings at a small size (configs/glm4_5_air.py has
  the published one)."""
  keys = dict(moe.defaults(), qkv_bias=True, partial_rotary_factor=0.5, rope_theta=1_000_000.0, norm_eps=1e-5,
              num_shared_experts=1, first_dense_layers=1, expert_mlp_dim=32, normalize_topk=True,
              load_balance_weight=0.0, router_z_weight=0.0,
              num_groups=1,  # n_group: experts in this many groups, each scored by its two best
              topk_groups=1,  # topk_group: the groups whose experts may be chosen
              routed_scaling_factor=1.0,
              # the auxiliary-loss-free balancing, as DeepSeek-V3's (its keys: docs/models.md)
              bias_update_speed=0.001, bias_feedback_weight=1.0)
  del keys["router_scores"]
  return keys


def validate(cfg) -> None:
  moe.validate(ml_collections.ConfigDict({**cfg.to_dict(), "router_scores": "sigmoid"}))
  deepseek.validate_routing(cfg)
  factor = cfg.partial_rotary_factor
  rotary = int(cfg.head_dim * factor)
  if not 0 < factor <= 1 or rotary < 2 or rotary % 2:
    raise ConfigError("model.partial_rotary_factor", f"{factor} of model.head_dim={cfg.head_dim} turns {rotary} "
                      "dims", "RoPE turns pairs of dims: choose a factor in (0, 1] that gives an even count")


class Block(moe.Block):
  """Llama's attention (biases, QK-norm, partial rotary: its keys) and DeepSeek-V3's MoE."""
  moe_class = deepseek.MoE


class Glm4Moe(moe.MoeLM):
  """The ``moe`` family's decoder with :class:`Block` as its MoE layers."""
  block = Block


core.register("glm4_moe", core.Family(module=Glm4Moe, defaults=defaults, flops_per_token=moe.flops_per_token,
                                        validate=validate, axis_keys=moe.AXIS_KEYS,
                                        activation_estimate=moe.activation_estimate, quantizable=True,
                                        qk_clip=llama.qk_clip))

"""Llama 4's text decoder (``model.name=llama4``; transformers' ``Llama4ForCausalLM``, Scout and Maverick): Llama's
grouped-query attention with chunked local layers and global NoPE layers, and MoE layers of one shared and E routed
SwiGLU experts, interleaved with dense layers. Built from the other families' parts; what is its own is a key.

Per layer (as transformers' ``modeling_llama4.py``):

* Attention kinds, by ``global_every`` (N; transformers' ``no_rope_layers``, one NoPE layer every
  ``no_rope_layer_interval``): layers N-1, 2N-1, ... are global NoPE layers, the others local RoPE layers.
  A local layer turns q and k by RoPE (Llama 3's scaling, ``rope_scaling=llama3``; the checkpoint pairs each head's
  dims as interleaved ``(2i, 2i + 1)``, transformers' complex form, so q and k are de-interleaved first: a
  permutation of both, which no score sees), L2-normalizes them per head without weights (``qk_l2_norm``: ``x /
  sqrt(mean(x^2) + norm_eps)``, after RoPE) and attends within its chunk of ``attention_chunk_size`` positions
  (jaxtrain/models/attention.py's ``Variant.chunk``). A global layer has no RoPE and no norm, attends to every key,
  and with ``attn_temperature_tuning`` scales its queries by ``1 + attn_scale * log(1 + floor((p + 1) /
  floor_scale))`` at position p.
* Feed-forward: every ``moe_every``-th layer (``interleave_moe_layer_step``: 1 Scout, 2 Maverick) a MoE, the others
  a dense SwiGLU of ``mlp_dim`` (``intermediate_size_mlp``). The MoE's router takes the k largest logits ``x W_r``;
  each chosen expert's INPUT is ``x`` times ``sigmoid(logit)`` (jaxtrain/parallel/experts.py ``weigh_inputs``) and
  its output is summed as it is; one shared SwiGLU expert of ``expert_mlp_dim`` every token uses is added. The
  experts' ``gate_up`` is stored ``[E, d, 2, f]``: the checkpoint's ``[E, d, 2f]`` (gate, then up) reshaped.

The layer scan steps over groups of ``moe_every`` layers (the dense one, then the MoE one), each group's kinds its
input; decoding scans the static cache likewise (``[layers / moe_every, moe_every, ...]``), so the paged cache of
continuous batching is not taken (refused in one line). The router's losses and load metrics are the ``moe``
family's; transformers trains none of them (``load_balance_weight`` 0 by default).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxtrain.errors import ConfigError, check_positive
from jaxtrain.models import attention, core
from jaxtrain.models.attention import KV_AXES
from jaxtrain.models.llama import model as llama
from jaxtrain.models.moe import model as moe
from jaxtrain.parallel import experts
from jaxtrain.sharding import constrain


def defaults() -> dict:
  """The Llama 4 family's ``model`` keys: Llama's (``mlp_dim``: the dense layers' hidden size) and these; the values
  are Llama 4 Scout's but for its size (configs/llama4_scout.py has that)."""
  return dict(
      llama.defaults(),
      num_layers=4, mlp_dim=128,
      # RoPE's theta and scaling: "" (none) | llama3 (Llama 4: factor 16, low and high frequency factors 1, 8192)
      rope_theta=500_000.0, rope_scaling="llama3", rope_scaling_factor=16.0, rope_low_freq_factor=1.0,
      rope_high_freq_factor=1.0, rope_original_max_positions=8192,
      global_every=4,  # every 4th layer (3, 7, ...) a global NoPE layer, the others local RoPE layers; 0: all local
      attention_chunk_size=8192,  # a local layer attends within its chunk of this many positions; 0: no chunks
      qk_l2_norm=True,  # the local layers' q and k L2-normalized per head (no weights), after RoPE
      attn_temperature_tuning=True,  # the global layers' queries scaled up with their position
      floor_scale=8192,
      attn_scale=0.1,
      moe_every=1,  # every Nth layer (N-1, 2N-1, ...) a MoE, the others dense: 1 (Scout) or 2 (Maverick)
      num_experts=4,
      experts_per_token=1,
      expert_mlp_dim=64,  # each routed expert's hidden size, and the shared expert's
      moe_impl="dropless",  # dropless | capacity (jaxtrain/parallel/experts.py)
      capacity_factor=1.25,
      load_balance_weight=0.0,
      router_z_weight=0.0,
  )


OTHER_FAMILIES = ("qkv_bias", "qk_norm", "sliding_window", "attn_softcap", "final_softcap", "query_scale",
                  "rope_local_theta", "norm_plus_one", "embed_scale", "sandwich_norms")


def validate(cfg) -> None:
  check_positive({"model": cfg}, [f"model.{k}" for k in ("num_layers", "d_model", "num_heads", "num_kv_heads",
                                                          "head_dim", "mlp_dim", "num_experts", "experts_per_token",
                                                          "expert_mlp_dim", "capacity_factor", "moe_every")])
  check_positive({"model": cfg}, [f"model.{k}" for k in ("global_every", "attention_chunk_size",
                                                          "load_balance_weight", "router_z_weight")], allow_zero=True)
  if cfg.num_heads % cfg.num_kv_heads:
    raise ConfigError("model.num_kv_heads", f"{cfg.num_kv_heads} does not divide model.num_heads={cfg.num_heads}",
                      "grouped-query attention needs num_heads to be a multiple of num_kv_heads")
  other = [k for k in OTHER_FAMILIES if cfg.get(k)]
  if other or cfg.mlp_activation != "silu":
    key = f"model.{other[0]}" if other else "model.mlp_activation"
    raise ConfigError(key, "is another family's option; Llama 4 has no such thing",
                      f"leave {key} at its default with model.name={cfg.name}")
  if cfg.moe_every not in (1, 2) or cfg.num_layers % cfg.moe_every:
    raise ConfigError("model.moe_every", f"is {cfg.moe_every} with model.num_layers={cfg.num_layers}",
                      "every layer a MoE (1) or every other one (2, of an even number of layers) is supported")
  if cfg.global_every and not cfg.attention_chunk_size:
    raise ConfigError("model.global_every", "sets NoPE layers and model.attention_chunk_size is 0 (no local layers "
                      "to tell them from)", "set model.attention_chunk_size, or global_every=0")
  if cfg.attn_temperature_tuning:
    check_positive({"model": cfg}, ["model.floor_scale", "model.attn_scale"])
  if cfg.rope_scaling not in ("", "llama3"):
    raise ConfigError("model.rope_scaling", f"'{cfg.rope_scaling}' is not '' (none) or llama3",
                      "set model.rope_scaling to '' or llama3")
  if cfg.rope_scaling == "llama3":
    check_positive({"model": cfg}, [f"model.{k}" for k in ("rope_scaling_factor", "rope_low_freq_factor",
                                                            "rope_high_freq_factor", "rope_original_max_positions")])
    if cfg.rope_high_freq_factor < cfg.rope_low_freq_factor:
      raise ConfigError("model.rope_high_freq_factor", f"{cfg.rope_high_freq_factor} is less than "
                        f"model.rope_low_freq_factor={cfg.rope_low_freq_factor}", "Llama 4: both 1")
  if cfg.experts_per_token > cfg.num_experts:
    raise ConfigError("model.experts_per_token", f"{cfg.experts_per_token} is more than model.num_experts="
                      f"{cfg.num_experts}", "route each token to at most num_experts experts")
  if cfg.moe_impl not in experts.MODES:
    raise ConfigError("model.moe_impl", f"'{cfg.moe_impl}' is not one of {', '.join(experts.MODES)}",
                      "set model.moe_impl=dropless or capacity")


def rope_layers(cfg) -> list[bool]:
  """Whether each layer is a local RoPE layer (else a global NoPE one): transformers' ``no_rope_layers``."""
  return [not (cfg.global_every and (i + 1) % cfg.global_every == 0) for i in range(cfg.num_layers)]


def _expert_params(abstract_params) -> int:
  routed = abstract_params["layers"]["sparse"]["moe"]
  return routed["gate_up"].size + routed["down"].size


def param_counts(cfg, abstract_params) -> tuple[int, int]:
  """(total, active) parameters: active counts k of the E routed experts per token (and everything else)."""
  total = sum(a.size for a in jax.tree.leaves(abstract_params))
  return total, int(round(total - _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts)))


def flops_per_token(cfg, seq_len: int, abstract_params) -> float:
  """PaLM's formula over the parameters a token uses (k of the E routed experts), a local layer's attention term
  over its chunk of keys instead of the whole sequence."""
  weights = core.dense_flops_per_token(abstract_params, 0, num_layers=0, attention_width=0,
                                       tied_embeddings=cfg.tie_embeddings)
  routed = 6 * _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts)
  keys = sum(min(seq_len, c) if c else seq_len for c in attention.layer_chunks(cfg))
  return weights - routed + 12 * cfg.num_heads * cfg.head_dim * keys


def activation_estimate(cfg, rows: int, seq_len: int, tensor: int, context: int = 1) -> dict[str, int]:
  """The ``moe`` family's estimate with the shared expert (every layer counted as a MoE one)."""
  return moe.activation_estimate(ml_collections.ConfigDict({**cfg.to_dict(), "num_shared_experts": 1}), rows,
                                 seq_len, tensor, context)


AXIS_KEYS = {**llama.AXIS_KEYS, "experts": "num_experts", "expert_mlp": "expert_mlp_dim"}


def l2_norm(x, eps: float):
  """``x / sqrt(mean(x^2) + eps)`` over the last dim, in float32 (transformers' ``Llama4TextL2Norm``)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Attention(llama.Attention):
  """Llama's attention with Llama 4's positions: RoPE and the L2 norm on local layers, temperature on global ones
  (the module docstring); the chunks are llama.Attention's (``attention_chunk_size``)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    super().__init__(cfg, dtype, rngs)
    self.l2, self.eps = bool(cfg.qk_l2_norm), float(cfg.norm_eps)
    self.tuning = (float(cfg.floor_scale), float(cfg.attn_scale)) if cfg.attn_temperature_tuning else None

  def rotate(self, q, k, positions, freq, q_scale, local):
    """``local``: a traced bool (this layer's kind), or None when every layer is a local one."""
    def turned(x):  # interleaved pairs (transformers' complex form) de-interleaved, then Llama's rotation
      x = llama.rope(jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1), positions, freq=freq)
      return l2_norm(x, self.eps) if self.l2 else x

    q_local, k_local = turned(q), turned(k)
    if local is not None:
      if self.tuning is not None:
        floor, strength = self.tuning
        t = jnp.log1p(jnp.floor((positions.astype(jnp.float32) + 1.0) / floor)) * strength + 1.0
        q = (q * t[..., None, None]).astype(q.dtype)
      q_local, k_local = jnp.where(local, q_local, q), jnp.where(local, k_local, k)
    return (q_local * q_scale).astype(q.dtype) if q_scale != 1.0 else q_local, k_local


class MoE(moe.MoE):
  """Llama 4's router and experts: the k largest logits, each chosen expert's input weighted by its sigmoid; the
  shared expert of the ``moe`` family's (one, of ``expert_mlp_dim``)."""
  weigh_inputs = True

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    super().__init__(types.SimpleNamespace(**{**dict(cfg.items()), "num_shared_experts": 1, "router_scores": "sigmoid",
                                              "normalize_topk": False}), dtype, rngs)

  def init_experts(self, d: int, e: int, f: int, rngs: nnx.Rngs) -> None:
    """``gate_up`` ``[E, d, 2, f]`` (gate, then up: the checkpoint's ``[E, d, 2f]``), ``down`` ``[E, f, d]``."""
    init = nnx.initializers.normal(0.02)
    self.gate_up = nnx.Param(nnx.with_partitioning(init, ("experts", "embed", None, "expert_mlp"))(
        rngs.params(), (e, d, 2, f)))
    self.down = nnx.Param(nnx.with_partitioning(init, ("experts", "expert_mlp", "embed"))(rngs.params(), (e, f, d)))

  def expert_weights(self):
    gate_up = self.gate_up[...]
    return gate_up[:, :, 0], gate_up[:, :, 1], self.down[...]

  def route(self, x):
    """(logits, the sigmoid scores normalized to sum 1 (the router losses' probabilities), the k largest logits'
    ids, their sigmoids)."""
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...])
    top, ids = jax.lax.top_k(logits, self.k)
    scores = jax.nn.sigmoid(logits)
    return logits, scores / jnp.sum(scores, axis=-1, keepdims=True), ids, jax.nn.sigmoid(top)


class DenseBlock(llama.Block):
  attention_class = Attention


class MoeBlock(moe.Block):
  attention_class = Attention
  moe_class = MoE


class Group(nnx.Module):
  """One step of the layer scan: ``moe_every`` layers, a dense one first when 2 (``dense``), then a MoE one
  (``sparse``). ``local``: the layers' kinds ``[moe_every]`` (None: all local)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    self.dense = DenseBlock(cfg, dtype, rngs) if cfg.moe_every == 2 else None
    self.sparse = MoeBlock(cfg, dtype, rngs)

  def __call__(self, x, positions, segment_ids, cache=None, local=None):
    """``(x, aux losses, metrics)``; with a ``cache`` ``(k, v, slots)`` (``k``, ``v``: the group's ``[moe_every,
    ...]`` of the static cache) ``(x, (k, v))``."""
    kinds = (None, None) if local is None else (local[0], local[-1])
    if cache is None:
      if self.dense is not None:
        x = self.dense(x, positions, segment_ids, local=kinds[0])
      return self.sparse(x, positions, segment_ids, local=kinds[1])
    k, v, slots = cache
    written = []
    if self.dense is not None:
      x, kv = self.dense(x, positions, segment_ids, (k[0], v[0], slots), kinds[0])
      written.append(kv)
    x, kv = self.sparse(x, positions, segment_ids, (k[-1], v[-1], slots), kinds[1])
    return x, tuple(jnp.stack(a) for a in zip(*written, kv))


class Llama4(moe.MoeLM):
  """The ``moe`` family's decoder (embedding, layer scan, head) over groups of layers (:class:`Group`)."""
  paged_cache = False  # the static cache only: its layer scan steps over groups of cache layers
  block = Group

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    super().__init__(cfg, rngs=rngs)
    rope, self.per_group = rope_layers(cfg), cfg.moe_every
    self.kinds = (None if all(rope) else
                  tuple(tuple(rope[i:i + self.per_group]) for i in range(0, len(rope), self.per_group)))

  @staticmethod
  def moe_layer_count(cfg) -> int:
    return cfg.num_layers // cfg.moe_every

  def layer_kinds(self):
    """Each group's layers' kinds ``[groups, moe_every]`` (True: local RoPE, False: global NoPE), None: all local."""
    return None if self.kinds is None else jnp.asarray(self.kinds)

  def _decode(self, tokens, positions, segment_ids, cache):
    """The static cache's layers ``[layers, ...]`` scanned as ``[groups, moe_every, ...]``."""
    slots = cache.write_slots(segment_ids, positions)
    graphdef, per = nnx.graphdef(self.layers), self.per_group

    def group(h, weights, k, v, kinds):
      return nnx.merge(graphdef, weights)(h, positions, segment_ids, (k, v, slots), kinds)

    grouped = (None, None, *KV_AXES)
    k, v = (constrain(a.reshape(-1, per, *a.shape[1:]), grouped) for a in (cache.k, cache.v))
    x, (k, v) = slots.scan_layers(group, llama.lookup(self.embed, tokens), nnx.state(self.layers), k, v,
                                  self.layer_kinds())
    k, v = (constrain(a.reshape(-1, *a.shape[2:]), (None, *KV_AXES)) for a in (k, v))
    return self.head(x), slots.advanced(k, v, tokens.shape[1])


core.register("llama4", core.Family(module=Llama4, defaults=defaults, flops_per_token=flops_per_token,
                                      validate=validate, axis_keys=AXIS_KEYS,
                                      activation_estimate=activation_estimate, quantizable=True))

"""DeepSeek-V3's decoder (``model.name=deepseek_v3``; Kimi K2, DeepSeek-R1 and Moonlight share it): multi-head latent
attention and a MoE of many small sigmoid-routed experts, group-limited, with shared experts, the first layers dense.

Per layer (as transformers' ``modeling_deepseek_v3.py``):

* Multi-head latent attention (MLA). Queries: ``x W_q`` ``[heads, qk_nope_head_dim + qk_rope_head_dim]``, or with
  ``q_lora_rank`` > 0 through a low-rank bottleneck: ``RMSNorm(x W_qa) W_qb``. Keys and values: ``x W_kva`` gives the
  latent ``c`` ``[kv_lora_rank]`` and one RoPE key ``k_rope`` ``[qk_rope_head_dim]`` shared by every head;
  ``RMSNorm(c) W_kvb`` gives each head's key part without position (``qk_nope_head_dim``) and its value
  (``v_head_dim``). A head's query and key are ``[nope | rope]``: RoPE turns only the last ``qk_rope_head_dim`` dims
  (DeepSeek's checkpoints lay them out as interleaved pairs, ``rope_interleave``: de-interleaved here before the
  rotation, as transformers does). The softmax scale is ``1 / sqrt(qk head dim)`` times YaRN's ``mscale^2``
  (:class:`~jaxtrain.models.llama.model.Yarn` with ``mscale`` / ``mscale_all_dim``). The latent norms' epsilon is
  1e-6 (transformers' default; the released models' ``rms_norm_eps`` too).
* The attention runs through jaxtrain's backends (jaxtrain/models/attention.py) with the values zero-padded to the
  qk head dim (or the queries and keys to the value head dim, whichever is smaller): the padded dims add 0 to every
  score or give 0 outputs, which are cut off, so any backend that takes an explicit scale (``variant=``) computes
  MLA exactly. A backend without one is refused at validation.
* Routing (float32): ``s = sigmoid(x W_r)`` ``[E]``; the choice adds a per-expert bias ``b`` (``score_bias``:
  transformers' ``e_score_correction_bias``, not trained by gradients); the E experts form ``num_groups`` groups,
  each scored by the sum of its two best ``s + b``, and only the ``topk_groups`` best groups' experts compete for the
  k places; the weights are the chosen experts' ``s`` (not ``s + b``), divided by their sum (``normalize_topk``) and
  times ``routed_scaling_factor``. ``num_shared_experts`` SwiGLU experts every token uses are added. The first
  ``first_dense_layers`` layers have a dense SwiGLU of ``mlp_dim`` instead.

The experts run in jaxtrain/parallel/experts.py (dropless or with a capacity; sharded over ``expert``); the auxiliary
losses and load metrics are the ``moe`` family's (jaxtrain/models/moe/model.py; DeepSeek-V3 trains with
``load_balance_weight`` 0 and the bias instead, and the sequence-wise balance loss ``seq_aux`` at a tiny weight:
``seq_aux_weight``).

Decoding (``mla_cache``) keeps, per token and layer, either the normalized latent and the turned rope key
(``latent``: ``kv_lora_rank + qk_rope_head_dim`` values, DeepSeek-V3's 576 against full keys and values' 128 heads x
2 x 192) and attends with ``W_kvb`` absorbed: each head's query without position becomes ``q_nope W_k^T`` in the
latent's space, so the scores are ``[q_nope W_k^T | q_rope] . [c | k_rope]`` (one key "head" shared by all query
heads), the softmax-weighted sum of the latents is taken to each head's value by ``W_v`` before ``W_o``; or every
head's full keys and values (``full``: the training path's own tensors). :func:`cache_bytes_per_token` gives both.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from flax import nnx

from jaxtrain.errors import ConfigError, check_positive
from jaxtrain.models import attention, core, quantization
from jaxtrain.models.attention import KVCache, attend, attend_cached
from jaxtrain.models.llama import model as llama
from jaxtrain.models.moe import model as moe
from jaxtrain.parallel import experts
from jaxtrain.sharding import constrain

MLA_CACHES = ("latent", "full")
LATENT_NORM_EPS = 1e-6  # the q and kv latents' RMSNorm (transformers' DeepseekV3RMSNorm default)


def defaults() -> dict:
  """The DeepSeek-V3 family's ``model`` keys (DeepSeek-V3's settings at a small size; configs/deepseek_v3_671b.py
  has the published one)."""
  return dict(
      num_layers=2,
      d_model=64,
      num_heads=4,
      mlp_dim=256,  # the dense first layers' SwiGLU
      tie_embeddings=False,
      norm_eps=1e-6,
      # Multi-head latent attention
      q_lora_rank=32,  # 0: a plain query projection (DeepSeek-V2-Lite); else x -> q_lora_rank -> RMSNorm -> heads
      kv_lora_rank=32,  # the compressed key/value latent
      qk_nope_head_dim=16,  # each head's key/query dims without position (from the latent)
      qk_rope_head_dim=8,  # the dims RoPE turns (the key's shared by all heads)
      v_head_dim=16,
      rope_interleave=True,  # the RoPE dims stored as interleaved pairs (DeepSeek's checkpoints)
      mla_cache="latent",  # decoding's cache: latent (the latent and the rope key a token) | full (every head's k, v)
      rope_theta=10_000.0,
      **llama.yarn_defaults("", 40.0, 4096, truncate=True),
      rope_yarn_mscale=1.0,  # YaRN's mscale and mscale_all_dim (DeepSeek's; 0 = unset)
      rope_yarn_mscale_all_dim=1.0,
      # DeepSeek MoE
      num_experts=8,  # routed experts per MoE layer
      experts_per_token=2,  # k
      expert_mlp_dim=32,
      num_shared_experts=1,
      first_dense_layers=1,
      num_groups=2,  # n_group: experts in this many groups
      topk_groups=1,  # topk_group: the groups whose experts may be chosen
      routed_scaling_factor=2.5,
      normalize_topk=True,
      moe_impl="dropless",  # dropless | capacity (jaxtrain/parallel/experts.py)
      capacity_factor=1.25,
      load_balance_weight=0.0,
      router_z_weight=0.0,
      # Auxiliary-loss-free balancing: each choice bias moves by this much a step towards the mean load
      # (jaxtrain.optim.balance_update; DeepSeek-V3: 0.001, then 0 for the last 500B tokens); 0: the bias stays
      bias_update_speed=0.001,
      bias_feedback_weight=1.0,  # the weight of the zero-valued aux loss that carries the load to the bias: keep 1
      # DeepSeek-V3's complementary sequence-wise balance loss (aux loss ``seq_aux``, jaxtrain/models/moe's
      # sequence_balance_loss; the report's alpha: 0.0001). 0: not computed at all (existing runs unchanged)
      seq_aux_weight=0.0,
      # Multi-token prediction: D modules after the stack, module k predicting token t + 1 + k (aux loss ``mtp``,
      # the mean over the modules; DeepSeek-V3: D = 1, weight 0.3 then 0.1); not run when decoding. Imported from
      # and exported as a checkpoint's layers num_hidden_layers.. (jaxtrain/models/deepseek_v3/hf.py)
      mtp_depth=0,
      mtp_weight=0.3,
      # QK-clip (Kimi K2's MuonClip, with optim.name=muon; any optimizer takes it): after each applied update, every
      # attention head whose largest logit in the step's batch exceeded this is scaled back to it (:func:`qk_clip`;
      # Kimi K2: 100). 0: off, and nothing is measured
      qk_clip=0.0,
  )


def qk_head_dim(cfg) -> int:
  return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


def validate(cfg) -> None:
  check_positive({"model": cfg}, [f"model.{k}" for k in (
      "num_layers", "d_model", "num_heads", "mlp_dim", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
      "v_head_dim", "num_experts", "experts_per_token", "expert_mlp_dim", "capacity_factor")])
  check_positive({"model": cfg}, [f"model.{k}" for k in ("q_lora_rank", "num_shared_experts", "first_dense_layers",
                                                          "load_balance_weight", "router_z_weight", "mtp_depth",
                                                          "mtp_weight", "seq_aux_weight")],
                 allow_zero=True)
  validate_routing(cfg)
  if cfg.qk_rope_head_dim % 2:
    raise ConfigError("model.qk_rope_head_dim", f"{cfg.qk_rope_head_dim} is odd", "RoPE turns pairs of dims: make it "
                      "even")
  if cfg.rope_scaling not in ("", "yarn"):
    raise ConfigError("model.rope_scaling", f"'{cfg.rope_scaling}' is not '' (none) or yarn",
                      "set model.rope_scaling to '' or yarn")
  if cfg.rope_scaling == "yarn":
    check_positive({"model": cfg}, ["model.rope_scaling_factor", "model.rope_original_max_positions"])
  if cfg.first_dense_layers >= cfg.num_layers:
    raise ConfigError("model.first_dense_layers", f"{cfg.first_dense_layers} leaves no MoE layer of "
                      f"model.num_layers={cfg.num_layers}", "make it smaller than num_layers")
  if cfg.moe_impl not in experts.MODES:
    raise ConfigError("model.moe_impl", f"'{cfg.moe_impl}' is not one of {', '.join(experts.MODES)}",
                      "set model.moe_impl=dropless or capacity")
  if cfg.mla_cache not in MLA_CACHES:
    raise ConfigError("model.mla_cache", f"'{cfg.mla_cache}' is not one of {', '.join(MLA_CACHES)}",
                      "set model.mla_cache=latent or full")
  if not attention.takes_variants(cfg.attention):
    raise ConfigError("model.attention", f"the backend '{cfg.attention}' takes no explicit softmax scale, which "
                      "multi-head latent attention needs (its head dims are padded to one size)",
                      "use auto, xla, blockwise or splash, or give the backend a variant= parameter")
  width = max(qk_head_dim(cfg), cfg.v_head_dim)
  if cfg.attention == "cudnn" and (width > attention.CUDNN_MAX_HEAD_DIM or width % 8):
    raise ConfigError("model.attention", f"'cudnn' needs a head dim that is a multiple of 8 up to "
                      f"{attention.CUDNN_MAX_HEAD_DIM} and MLA's is {width} (max of qk_nope_head_dim + "
                      "qk_rope_head_dim and v_head_dim)", "use blockwise or xla")


def validate_routing(cfg) -> None:
  """The checks of DeepSeek-V3's routing keys (group-limited sigmoid scores with the choice bias; GLM-4.5's too)."""
  check_positive({"model": cfg}, [f"model.{k}" for k in ("num_groups", "topk_groups", "routed_scaling_factor")])
  check_positive({"model": cfg}, ["model.bias_update_speed"], allow_zero=True)
  if cfg.bias_update_speed and cfg.bias_feedback_weight <= 0:
    raise ConfigError("model.bias_feedback_weight", f"is {cfg.bias_feedback_weight}: the load no longer reaches the "
                      "choice biases, which model.bias_update_speed moves", "leave it at 1 (or set "
                      "bias_update_speed=0 to keep the biases fixed)")
  if cfg.num_experts % cfg.num_groups:
    raise ConfigError("model.num_groups", f"{cfg.num_groups} does not divide model.num_experts={cfg.num_experts}",
                      "make the expert groups equal")
  if cfg.num_groups > 1 and cfg.num_experts // cfg.num_groups < 2:
    raise ConfigError("model.num_groups", f"{cfg.num_groups} groups of {cfg.num_experts} experts leave fewer than "
                      "2 a group (a group is scored by its two best experts)", "use fewer groups")
  if cfg.topk_groups > cfg.num_groups:
    raise ConfigError("model.topk_groups", f"{cfg.topk_groups} is more than model.num_groups={cfg.num_groups}",
                      "choose at most num_groups groups")
  if cfg.experts_per_token > cfg.topk_groups * (cfg.num_experts // cfg.num_groups):
    raise ConfigError("model.experts_per_token", f"{cfg.experts_per_token} is more than the "
                      f"{cfg.topk_groups * (cfg.num_experts // cfg.num_groups)} experts of model.topk_groups="
                      f"{cfg.topk_groups} groups", "route each token to at most the chosen groups' experts")


# A latent cache's layer ``[batch, max_len, 1, width]`` (or a paged pool's ``[pages, page_size, 1, width]``) is split
# over the batch only: its one key "head" is not a ``kv_heads`` axis.
LATENT_AXES = ("batch", None, None, None)


def _param(names):
  return nnx.with_partitioning(nnx.initializers.normal(0.02), names)


class MLA(nnx.Module):
  """Multi-head latent attention (the module docstring)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d, n = cfg.d_model, cfg.num_heads
    self.nope, self.rope_dim, self.v_dim, self.rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                                       cfg.kv_lora_rank)
    qk = self.nope + self.rope_dim
    kw = dict(dtype=dtype, param_dtype=jnp.float32, einsum_op=quantization.einsum(cfg.quantization), rngs=rngs)
    linear = dict(use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                  dot_general=quantization.dot_general(cfg.quantization))
    if cfg.q_lora_rank:
      self.q = None
      self.q_a = nnx.Linear(d, cfg.q_lora_rank, kernel_init=_param(("embed", None)), **linear)
      self.q_norm = llama.RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype, None)
      # The latent dims are named ``embed`` in the up-projections: split over fsdp as a projection's input dim.
      self.q_b = nnx.Einsum("btr,rnh->btnh", (cfg.q_lora_rank, n, qk),
                            kernel_init=_param(("embed", "heads", "head_dim")), **kw)
    else:
      self.q, self.q_a, self.q_norm, self.q_b = (
          nnx.Einsum("btd,dnh->btnh", (d, n, qk), kernel_init=_param(("embed", "heads", "head_dim")), **kw),
          None, None, None)
    self.kv_a = nnx.Linear(d, self.rank + self.rope_dim, kernel_init=_param(("embed", None)), **linear)
    self.kv_norm = llama.RMSNorm(self.rank, LATENT_NORM_EPS, dtype, None)
    self.kv_b = nnx.Einsum("btr,rnh->btnh", (self.rank, n, self.nope + self.v_dim),
                           kernel_init=_param(("embed", "heads", "head_dim")), **kw)
    self.o = nnx.Einsum("btnh,nhd->btd", (n, self.v_dim, d), kernel_init=_param(("heads", "head_dim", "embed")), **kw)
    self.theta, self.scaling, self.backend = cfg.rope_theta, llama.rope_scaling(cfg), cfg.attention
    self.interleave, self.block_size = bool(cfg.rope_interleave), cfg.attention_block_size
    yarn = self.scaling if isinstance(self.scaling, llama.Yarn) else None
    self.rope_scale = yarn.attention_factor if yarn else 1.0
    self.scale = qk ** -0.5 * (yarn.softmax_factor if yarn else 1.0)
    self.latent_cache = cfg.mla_cache == "latent"
    self.qk_clip = bool(cfg.qk_clip)  # sow each head's largest logit (attention.max_logits) for QK-clip

  def _rope(self, x, positions):
    """RoPE of the last dim of ``x`` ``[b, t, heads, qk_rope_head_dim]`` (interleaved pairs de-interleaved first)."""
    if self.interleave:
      x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    freq = llama.rope_frequencies(self.rope_dim, self.theta, self.scaling)
    return llama.rope(x, positions, freq=freq, scale=self.rope_scale)

  def queries(self, x, positions):
    """``(q_nope [b, t, n, nope], q_rope [b, t, n, rope])``, the rope part turned."""
    q = self.q(x) if self.q is not None else self.q_b(self.q_norm(self.q_a(x)))
    q = checkpoint_name(q, "query_proj")
    return q[..., :self.nope], self._rope(q[..., self.nope:], positions)

  def latent(self, x, positions):
    """``(normalized latent [b, t, kv_lora_rank], turned rope key [b, t, 1, rope])``: what the cache of a
    compressed-cache decoder would keep."""
    kv = checkpoint_name(self.kv_a(x), "key_proj")
    return self.kv_norm(kv[..., :self.rank]), self._rope(kv[..., None, self.rank:], positions)

  def keys_values(self, c, k_rope):
    """Every head's ``(key [b, t, n, qk], value [b, t, n, v])`` from the latent and the shared rope key."""
    kv = checkpoint_name(self.kv_b(c), "value_proj")
    k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope.astype(k_nope.dtype), (*k_nope.shape[:-1], self.rope_dim))],
                        axis=-1)
    return k, v

  def _padded(self, q, k, v):
    """q, k and v at one head dim (zeros appended: exact, see the module docstring)."""
    width = max(q.shape[-1], v.shape[-1])

    def pad(x):
      return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
    return pad(q), pad(k), pad(v)

  def _decode_latent(self, q_nope, q_rope, c, k_rope, segment_ids, positions, cache):
    """Attention over the latent cache (``cache``: ``(latents [b, S, 1, rank], rope keys [b, S, 1, rope], slots)``)
    with ``W_kvb`` absorbed into the queries and the outputs (the module docstring); the output and the updated
    ``(latents, rope keys)``."""
    c_cache, rope_cache, slots = cache
    c_all, rope_all = (slots.write(c_cache, c[:, :, None], LATENT_AXES),
                       slots.write(rope_cache, k_rope, LATENT_AXES))
    w = self.kv_b.kernel[...].astype(q_nope.dtype)  # [rank, heads, nope + v]
    q_latent = jnp.einsum("btnh,rnh->btnr", q_nope, w[..., :self.nope])
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    c_seen, rope_seen = slots.view(c_all, LATENT_AXES), slots.view(rope_all, LATENT_AXES)
    keys = jnp.concatenate([c_seen, rope_seen.astype(c_seen.dtype)], axis=-1)  # one key "head": [b, S, 1, rank + rope]
    values = jnp.pad(c_seen, [(0, 0)] * 3 + [(0, self.rope_dim)])  # the latents, at the keys' width
    out = attend_cached(q, keys, values, segment_ids, positions, slots.kv_segment_ids, slots.kv_positions,
                        attention.Variant(scale=self.scale))[..., :self.rank]
    out = jnp.einsum("btnr,rnh->btnh", out, w[..., self.nope:])
    return self.o(out), (c_all, rope_all)

  def __call__(self, x, positions, segment_ids, cache=None):
    """As llama.Attention's (``cache``: ``(k, v, slots)``: with ``mla_cache=full`` every head's full keys and
    values padded to one head dim, with ``latent`` the latents and the rope keys); returns the output, and with a
    cache the updated ``(k, v)``."""
    q_nope, q_rope = self.queries(x, positions)
    c, k_rope = self.latent(x, positions)
    if cache is not None and self.latent_cache:
      return self._decode_latent(q_nope, q_rope, c, k_rope, segment_ids, positions, cache)
    k, v = self.keys_values(c, k_rope)
    q, k, v = self._padded(jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1), k, v)
    q = constrain(q, ("batch", "length", "heads", "head_dim"))
    k, v = (constrain(a, ("batch", "length", "heads", "head_dim")) for a in (k, v))
    variant = attention.Variant(scale=self.scale)
    if self.qk_clip and cache is None:
      core.sow_max_logit(self, attention.max_logits(q, k, segment_ids, positions, variant, self.block_size))
    if cache is not None:
      k_cache, v_cache, slots = cache
      k, v = slots.write(k_cache, k), slots.write(v_cache, v)
      out = attend_cached(q, slots.view(k), slots.view(v), segment_ids, positions, slots.kv_segment_ids,
                          slots.kv_positions, variant)
      return self.o(out[..., :self.v_dim]), (k, v)
    out = attend(self.backend, q, k, v, segment_ids, positions, self.block_size, variant)
    out = constrain(out[..., :self.v_dim], ("batch", "length", "heads", "head_dim"))
    return checkpoint_name(self.o(out), "out_proj")


class MoE(moe.MoE):
  """DeepSeek's routed experts (group-limited sigmoid routing with the choice bias) and shared experts."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    super().__init__(types.SimpleNamespace(**dict(cfg.items()), router_scores="sigmoid"), dtype, rngs)
    self.score_bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32), out_sharding=(None,))
    self.groups, self.topk_groups, self.factor = cfg.num_groups, cfg.topk_groups, float(cfg.routed_scaling_factor)
    self.feedback = bool(cfg.bias_update_speed)

  def __call__(self, x, segment_ids, decoding: bool = False):
    """moe.MoE's, and with a bias update speed the aux loss ``bias_feedback``: 0, its gradient with respect to the
    choice bias this layer's load minus the mean load (the optimizer moves the bias by its sign:
    jaxtrain.optim.balance_update)."""
    y, aux, metrics = super().__call__(x, segment_ids, decoding)
    if self.feedback and not decoding:
      load = jnp.stack([metrics[f"moe/load/e{i:02d}"] for i in range(self.score_bias.shape[0])])
      deviation = jax.lax.stop_gradient(load - jnp.mean(load))
      pull = jnp.sum(self.score_bias[...] * deviation)
      aux["bias_feedback"] = pull - jax.lax.stop_gradient(pull)
    return y, aux, metrics

  def route(self, x):
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...])
    scores = jax.nn.sigmoid(logits)
    choice = scores + jax.lax.stop_gradient(self.score_bias[...])  # the bias picks experts, never weighs them
    if self.groups > 1:
      grouped = choice.reshape(*choice.shape[:-1], self.groups, -1)
      group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
      _, best = jax.lax.top_k(group_scores, self.topk_groups)
      keep = jnp.sum(jax.nn.one_hot(best, self.groups, dtype=jnp.int32), axis=-2) > 0
      choice = jnp.where(jnp.repeat(keep, grouped.shape[-1], axis=-1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, self.k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if self.normalize:
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return logits, probs, ids, weights * self.factor


class Block(nnx.Module):
  """attn_norm, MLA, mlp_norm, then the dense SwiGLU (``dense``) or the MoE."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs, dense: bool = False):
    self.attn_norm = llama.norm(cfg, dtype)
    self.attn = MLA(cfg, dtype, rngs)
    self.mlp_norm = llama.norm(cfg, dtype)
    self.mlp = llama.MLP(cfg, dtype, rngs) if dense else None
    self.moe = None if dense else MoE(cfg, dtype, rngs)

  def __call__(self, x, positions, segment_ids, cache=None):
    """Dense: ``x``; MoE: ``(x, aux losses, metrics)``; with a ``cache`` (decoding) ``(x, (k, v))``."""
    if cache is not None:
      attn, kv = self.attn(self.attn_norm(x), positions, segment_ids, cache)
      x = x + attn
      y = self.mlp(self.mlp_norm(x)) if self.moe is None else self.moe(self.mlp_norm(x), segment_ids, True)[0]
      return constrain(x + y, ("batch", "length", "embed")), kv
    x = x + self.attn(self.attn_norm(x), positions, segment_ids)
    if self.moe is None:
      return constrain(x + self.mlp(self.mlp_norm(x)), ("batch", "length", "embed"))
    y, aux, metrics = self.moe(self.mlp_norm(x), segment_ids)
    return constrain(x + y, ("batch", "length", "embed")), aux, metrics


def _dense_block(cfg, dtype, rngs):
  return Block(cfg, dtype, rngs, dense=True)


class MTPModule(nnx.Module):
  """One multi-token-prediction module (DeepSeek-V3 technical report, section 2.2), as the released checkpoints'
  layer ``num_hidden_layers + k - 1`` holds it (``enorm``, ``hnorm``, ``eh_proj``, a MoE decoder layer,
  ``shared_head.norm``: here ``post_norm``; its ``embed_tokens`` and ``shared_head.head`` are the model's own):
  ``h_k = Block(eh_proj([enorm(Emb(t_{i+k})) | hnorm(h_{k-1})]))``, its logits the shared head's of
  ``post_norm(h_k)``; ``h_k`` (before ``post_norm``) is the next module's input."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    self.enorm, self.hnorm, self.post_norm = llama.norm(cfg, dtype), llama.norm(cfg, dtype), llama.norm(cfg, dtype)
    self.eh_proj = nnx.Linear(2 * cfg.d_model, cfg.d_model, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
                              kernel_init=_param((None, "embed")), rngs=rngs)
    self.block = Block(cfg, dtype, rngs)

  def __call__(self, h, embedded, positions, segment_ids):
    """``(h_k, the block's aux losses, its metrics)``: its router's losses and load count among the model's MoE
    layers' (the choice bias of its router moves by its load like the stack's)."""
    x = self.eh_proj(jnp.concatenate([self.enorm(embedded), self.hnorm(h)], axis=-1))
    return self.block(x, positions, segment_ids)


def mtp_targets(tokens, positions, segment_ids, k: int):
  """Module k's (1-based) inputs and targets at each position i: ``(t_{i+k}, t_{i+k+1}, valid)``, valid where
  ``t_{i+k+1}`` is in the row and of i's document (the row's last k + 1 positions and a document's last k + 1
  tokens have none)."""
  length = tokens.shape[1]

  def ahead(a, n):
    return jnp.concatenate([a[:, n:], jnp.zeros_like(a[:, :n])], axis=1) if n < length else jnp.zeros_like(a)
  valid = ((ahead(segment_ids, k + 1) == segment_ids) & (segment_ids != 0)
           & (ahead(positions, k + 1) == positions + k + 1) & (jnp.arange(length) < length - k - 1))
  return ahead(tokens, k), ahead(tokens, k + 1), valid


class DeepseekV3(moe.MoeLM):
  """The ``moe`` family's decoder (its layer scan, pipeline methods and decoding) with MLA blocks: embedding,
  ``first_dense_layers`` dense blocks, the stacked MoE blocks ``layers``, final norm and head."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                           embedding_init=_param(("vocab", "embed")), rngs=rngs)
    self.dense_layers = (core.stacked(cfg, dtype, rngs, _dense_block, cfg.first_dense_layers, "dense_layers")
                         if cfg.first_dense_layers else None)
    self.layers = core.stacked(cfg, dtype, rngs, Block, cfg.num_layers - cfg.first_dense_layers, "layers")
    self.final_norm = llama.norm(cfg, dtype)
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
        kernel_init=_param(("embed", "vocab")), rngs=rngs)
    self.remat = cfg.remat
    self.moe_layers = cfg.num_layers - cfg.first_dense_layers
    # Stacked like the layers, its leading axis ``mtp_layers`` (no rule shards it); run one module at a time.
    self.mtp = core.stacked(cfg, dtype, rngs, MTPModule, cfg.mtp_depth, "mtp_layers") if cfg.mtp_depth else None

  def __call__(self, tokens, positions, segment_ids, cache: KVCache | None = None):
    """The ``moe`` family's forward; with ``mtp_depth`` also the aux loss ``mtp``: the mean over the modules of
    their mean token cross-entropy (:func:`mtp_targets`), and the modules' MoE blocks among the MoE layers whose
    mean the router losses and load metrics are (their choice biases balanced like the stack's). Decoding never
    runs the modules."""
    if cache is not None or self.mtp is None:
      return super().__call__(tokens, positions, segment_ids, cache)
    x, extras = self.stack(tokens, positions, segment_ids)
    loss, aux, metrics, maxima = self.mtp_loss(x, tokens, positions, segment_ids)
    n, depth = self.moe_layers, len(aux)

    def mean(main, mine):  # (the stack's are its layers' mean already): the mean over its n and the depth blocks
      return {k: (v * n + sum(m[k] for m in mine)) / (n + depth) for k, v in main.items()}
    return core.Output(self.head(x), {**mean(extras["aux_losses"], aux), "mtp": loss},
                       mean(extras["metrics"], metrics), {**extras["maxima"], **maxima})

  def mtp_logits(self, x, tokens, positions, segment_ids):
    """Each module k's ``(logits of t_{i+k+1} at each position i, its block's aux losses, its metrics, its sown
    maxima)`` from the stack's output ``x`` (before the final norm; the first module takes it normalized by
    ``final_norm``), the embedding and head the model's."""
    h, out = self.final_norm(x), []
    graphdef, stacked = nnx.graphdef(self.mtp), nnx.state(self.mtp)
    for k in range(1, jax.tree.leaves(stacked)[0].shape[0] + 1):
      inputs, _, _ = mtp_targets(tokens, positions, segment_ids, k)
      module = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k - 1], stacked))
      (h, aux, metrics), maxima = core.capturing_maxima(module, "mtp/", h, llama.lookup(self.embed, inputs),
                                                        positions, segment_ids)
      normed = module.post_norm(h)
      out.append((self.embed.attend(normed) if self.lm_head is None else self.lm_head(normed), aux, metrics, maxima))
    return out

  def mtp_loss(self, x, tokens, positions, segment_ids):
    """``(the multi-token-prediction loss, [each module's block's aux losses], [its metrics], the modules' sown
    maxima stacked)`` (:meth:`mtp_logits`; each module's mean token cross-entropy over its valid targets,
    :func:`mtp_targets`, then the mean)."""
    losses, aux, metrics, maxima = [], [], [], []
    for k, (logits, block_aux, block_metrics, sown) in enumerate(self.mtp_logits(x, tokens, positions, segment_ids),
                                                                 1):
      _, targets, valid = mtp_targets(tokens, positions, segment_ids, k)
      logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
      mask = valid.astype(jnp.float32)
      losses.append(jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0))
      aux.append(block_aux)
      metrics.append(block_metrics)
      maxima.append(sown)
    return sum(losses) / len(losses), aux, metrics, jax.tree.map(lambda *a: jnp.stack(a), *maxima)

  @classmethod
  def init_cache(cls, cfg, batch: int, max_len: int) -> KVCache:
    """``mla_cache=latent``: every layer's latents (``k``, ``[layers, batch, max_len, 1, kv_lora_rank]``) and rope
    keys (``v``, ``[..., 1, qk_rope_head_dim]``); ``full``: every head's keys and values (``[..., heads, max(qk,
    v) head dim]``)."""
    dtype = jnp.dtype(cfg.dtype)
    if cfg.mla_cache == "full":
      return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_heads, max(qk_head_dim(cfg), cfg.v_head_dim),
                           dtype)
    slots = jnp.zeros((batch, max_len), jnp.int32)
    return KVCache(jnp.zeros((cfg.num_layers, batch, max_len, 1, cfg.kv_lora_rank), dtype),
                   jnp.zeros((cfg.num_layers, batch, max_len, 1, cfg.qk_rope_head_dim), dtype), slots, slots,
                   jnp.zeros((), jnp.int32))

  def _decode(self, tokens, positions, segment_ids, cache):
    """The ``moe`` family's decoding (full keys and values), or over the latent cache: both stacks in turn, each
    layer writing its new latents and rope keys (unsplit but for the batch)."""
    if not self.layers.attn.latent_cache:
      return super()._decode(tokens, positions, segment_ids, cache)
    slots = cache.write_slots(segment_ids, positions)
    # (the cache's k and v stacks hold the latents and the rope keys)
    x, (c, rope) = core.decode_stacks((self.dense_layers, self.layers), slots, llama.lookup(self.embed, tokens),
                                      cache.k, cache.v, positions, segment_ids)
    return self.head(x), slots.advanced(c, rope, tokens.shape[1])


def cache_bytes_per_token(cfg) -> dict[str, int]:
  """Decoding's cache per token (all layers, the compute dtype): ``latent`` (the latent and the rope key) and
  ``full`` (every head's keys and values at the padded head dim)."""
  item, layers = jnp.dtype(cfg.dtype).itemsize, cfg.num_layers
  return {"latent": layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * item,
          "full": layers * 2 * cfg.num_heads * max(qk_head_dim(cfg), cfg.v_head_dim) * item}


def _expert_params(abstract_params) -> int:
  return sum(abstract_params["layers"]["moe"][name].size for name in ("gate", "up", "down"))


def param_counts(cfg, abstract_params) -> tuple[int, int]:
  """(total, active) parameters: active counts k of the E routed experts per token (and everything else)."""
  total = sum(a.size for a in jax.tree.leaves(abstract_params))
  return total, int(round(total - _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts)))


def flops_per_token(cfg, seq_len: int, abstract_params) -> float:
  """PaLM's formula over the parameters a token uses (k of the E routed experts), the attention term with the
  queries' and keys' head dim (scores) and the values' (outputs): ``6 layers seq_len heads (qk + v)``."""
  dense = core.dense_flops_per_token(abstract_params, 0, num_layers=0, attention_width=0,
                                     tied_embeddings=cfg.tie_embeddings)
  routed = 6 * _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts)
  return dense - routed + 6 * cfg.num_layers * seq_len * cfg.num_heads * (qk_head_dim(cfg) + cfg.v_head_dim)


def activation_estimate(cfg, rows: int, seq_len: int, tensor: int, context: int = 1) -> dict[str, int]:
  """The ``moe`` family's estimate with MLA's attention as grouped-query attention of ``num_heads`` key/value heads
  at the padded head dim (what the backends see; the latent projections' activations are not counted)."""
  view = types.SimpleNamespace(**{**dict(cfg.items()), "num_kv_heads": cfg.num_heads,
                                  "head_dim": max(qk_head_dim(cfg), cfg.v_head_dim),
                                  "mlp_dim": (cfg.experts_per_token + cfg.num_shared_experts) * cfg.expert_mlp_dim})
  return llama.activation_estimate(view, rows, seq_len, tensor, context,
                                   routed_mlp=cfg.experts_per_token * cfg.expert_mlp_dim, router=cfg.num_experts)


AXIS_KEYS = {"embed": "d_model", "heads": "num_heads", "mlp": "mlp_dim", "vocab": "vocab_size",
             "layers": "num_layers", "experts": "num_experts", "expert_mlp": "expert_mlp_dim"}

def qk_clip(cfg, params, maxima, keep):
  """QK-clip (Kimi K2's MuonClip, arXiv:2507.20534 section 2.1) of every MLA whose per-head largest logits ``S``
  ``maxima`` holds (by its path in ``params``: ``"layers/attn"`` ``[layers, heads]``): where ``keep`` and
  ``S > model.qk_clip``, with ``g = qk_clip / S``, the head's query and key parts without position (``q_b``'s, or
  ``q``'s, first ``qk_nope_head_dim`` dims; ``kv_b``'s key dims) are scaled by ``sqrt(g)`` and its query's rope part
  by ``g``, so that each logit of the head is ``g`` times what it was; the rope key (shared by every head) and the
  values are left alone. Every other head's weights stay bitwise as they were (a factor of exactly 1)."""
  nope = cfg.qk_nope_head_dim
  params, heads = core.clipped_heads(cfg, params, maxima, keep)
  for attn, gain in heads:  # gain: [layers, heads]
    root = jnp.sqrt(gain)
    query = attn["q_b"] if cfg.q_lora_rank else attn["q"]
    dims = query["kernel"].shape[-1]
    by_dim = jnp.where(jnp.arange(dims) < nope, root[..., None], gain[..., None])  # [layers, heads, qk]
    query["kernel"] = query["kernel"] * by_dim[:, None]
    kv = attn["kv_b"]["kernel"]
    kv_dims = jnp.where(jnp.arange(kv.shape[-1]) < nope, root[..., None], 1.0)  # the values' dims: 1
    attn["kv_b"]["kernel"] = kv * kv_dims[:, None]
  return params


core.register("deepseek_v3", core.Family(module=DeepseekV3, defaults=defaults, flops_per_token=flops_per_token,
                                           validate=validate, axis_keys=AXIS_KEYS,
                                           activation_estimate=activation_estimate, quantizable=True,
                                           qk_clip=qk_clip))

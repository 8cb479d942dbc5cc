"""Mixture-of-Experts decoder (``model.name=moe``): Llama's attention, and feed-forward blocks of E routed SwiGLU
experts of which each token uses k (Mixtral, OLMoE, Qwen-MoE, DeepSeek-MoE), optionally shared experts every
token uses (DeepSeek) and dense first layers.

Routing (per token, float32): router logits ``x W_r`` ``[E]``; scores ``softmax`` (Mixtral, OLMoE) or ``sigmoid``
(DeepSeek-V3) of them; the top-k scores are the expert weights, divided by their sum when
``normalize_topk`` (Mixtral) or kept (OLMoE). The experts run in jaxtrain/parallel/experts.py (dropless or with
a capacity; sharded over the ``expert`` mesh axis with all-to-all).

Auxiliary losses (mean over the MoE layers and the real tokens of a forward), in the objective times their
``model.<name>_weight``:
* ``load_balance``: Switch / GShard's ``E * sum_e f_e P_e``, f_e the fraction of the k-choices that went to
  expert e and P_e the mean router probability of e (scores normalized to sum 1). 1.0 when perfectly even
  (transformers' Mixtral ``load_balancing_loss_func`` is k times this).
* ``router_z``: ST-MoE's router z-loss, the mean of ``logsumexp(router logits)^2``.
* ``seq_aux`` (only where the model group has a ``seq_aux_weight`` above 0: DeepSeek-V3's): DeepSeek-V3's
  sequence-wise balance loss (:func:`sequence_balance_loss`).

Metrics: ``moe/load/eNN`` the fraction of choices that went to expert NN (mean over MoE layers; sums to 1),
``moe/load_max`` the largest expert's load times E (1.0 = even), ``moe/dropped`` the fraction of choices dropped
by capacity.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import ConfigError, check_positive
from jaxtrain.models import attention, core, quantization, scans
from jaxtrain.models.llama import model as llama
from jaxtrain.models.attention import KV_AXES, KVCache
from jaxtrain.parallel import experts
from jaxtrain.sharding import constrain

ROUTER_SCORES = ("softmax", "sigmoid")


def defaults() -> dict:
  """The MoE family's ``model`` keys: Llama's (``mlp_dim`` is the dense first layers' hidden size) and these."""
  return dict(
      llama.defaults(),
      num_experts=8,  # routed experts per MoE layer
      experts_per_token=2,  # k
      expert_mlp_dim=128,  # hidden size of each expert's SwiGLU
      num_shared_experts=0,  # DeepSeek-style experts every token uses (one SwiGLU of num x expert_mlp_dim)
      first_dense_layers=0,  # the first N of num_layers are dense Llama blocks (DeepSeek: 1)
      router_scores="softmax",  # softmax | sigmoid
      normalize_topk=True,  # divide the k expert weights by their sum
      moe_impl="dropless",  # dropless (ragged_dot) | capacity (overflow dropped, counted)
      capacity_factor=1.25,  # capacity mode: slots per expert = ceil(factor * assignments / num_experts)
      load_balance_weight=0.01,
      router_z_weight=0.001,
  )


def validate(cfg) -> None:
  llama.validate(cfg)
  check_positive({"model": cfg}, [f"model.{k}" for k in ("num_experts", "experts_per_token", "expert_mlp_dim",
                                                          "capacity_factor")])
  check_positive({"model": cfg}, ["model.num_shared_experts", "model.first_dense_layers", "model.load_balance_weight",
                                  "model.router_z_weight"], allow_zero=True)
  if cfg.experts_per_token > cfg.num_experts:
    raise ConfigError("model.experts_per_token", f"{cfg.experts_per_token} is more than model.num_experts="
                      f"{cfg.num_experts}", "route each token to at most num_experts experts")
  if cfg.first_dense_layers >= cfg.num_layers:
    raise ConfigError("model.first_dense_layers", f"{cfg.first_dense_layers} leaves no MoE layer of "
                      f"model.num_layers={cfg.num_layers}", "make it smaller than num_layers (or use model.name=llama)")
  if cfg.router_scores not in ROUTER_SCORES:
    raise ConfigError("model.router_scores", f"'{cfg.router_scores}' is not one of {', '.join(ROUTER_SCORES)}",
                      "set model.router_scores=softmax or sigmoid")
  dense_only = [k for k in ("sandwich_norms", "embed_scale", "final_softcap") if cfg.get(k)]
  if dense_only or cfg.mlp_activation != "silu":
    key = f"model.{dense_only[0]}" if dense_only else "model.mlp_activation"
    raise ConfigError(key, "is a dense-family option (Gemma's block); the MoE family's experts are SwiGLU blocks "
                      "without it", f"leave {key} at its default with model.name={cfg.name}")
  if attention.mixed_layers(cfg):
    raise ConfigError("model.global_every", "interleaved local and global layers are a dense-family feature",
                      "use model.global_every=0 (every layer local) or a dense family")
  if cfg.moe_impl not in experts.MODES:
    raise ConfigError("model.moe_impl", f"'{cfg.moe_impl}' is not one of {', '.join(experts.MODES)}",
                      "set model.moe_impl=dropless or capacity")


def _expert_params(abstract_params) -> int:
  moe = abstract_params["layers"]["moe"]
  return sum(moe[name].size for name in ("gate", "up", "down"))


def param_counts(cfg, abstract_params) -> tuple[int, int]:
  """(total, active) parameters: active counts k of the E routed experts per token (and everything else)."""
  total = sum(a.size for a in jax.tree.leaves(abstract_params))
  inactive = _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts)
  return total, int(round(total - inactive))


def flops_per_token(cfg, seq_len: int, abstract_params) -> float:
  """PaLM's dense formula over the parameters a token uses: the k routed experts (and shared ones), not all E."""
  dense = core.dense_flops_per_token(abstract_params, seq_len, num_layers=cfg.num_layers,
                                     attention_width=cfg.num_heads * cfg.head_dim,
                                     tied_embeddings=cfg.tie_embeddings)
  return dense - 6 * _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts)


def activation_estimate(cfg, rows: int, seq_len: int, tensor: int, context: int = 1) -> dict[str, int]:
  """Llama's estimate with the MLP's hidden activations those of the k routed (+ shared) experts per token (the
  dense first layers counted alike; the dispatch buffers of jaxtrain/parallel/experts.py are not counted). The
  routed experts' matmuls carry the expert dimension as a batch dimension (jaxtrain/parallel/experts.py: ragged_dot
  or a batched einsum), so ``save_dots`` recomputes them; it keeps the float32 router logits."""
  return llama.activation_estimate(types.SimpleNamespace(**{**cfg.to_dict(), "mlp_dim": _token_mlp_dim(cfg)}),
                                   rows, seq_len, tensor, context,
                                   routed_mlp=cfg.experts_per_token * cfg.expert_mlp_dim, router=cfg.num_experts)


def _token_mlp_dim(cfg) -> int:
  return (cfg.experts_per_token + cfg.num_shared_experts) * cfg.expert_mlp_dim


AXIS_KEYS = {**llama.AXIS_KEYS, "experts": "num_experts", "expert_mlp": "expert_mlp_dim"}


def _param(names):
  return nnx.with_partitioning(nnx.initializers.normal(0.02), names)


def router_losses(logits, probs, ids, valid) -> tuple[dict, jax.Array]:
  """({load_balance, router_z}, load ``[E]``) over the real tokens (``valid``) of ``[batch, length]``: logits and
  probabilities ``[batch, length, E]``, the chosen experts ``ids`` ``[batch, length, k]``. load_e is the fraction of
  the k-choices that went to expert e (f_e); load_balance = E sum_e f_e P_e, P_e the mean probability of e."""
  num_experts, k = logits.shape[-1], ids.shape[-1]
  mask = valid.astype(jnp.float32)
  tokens = jnp.maximum(jnp.sum(mask), 1.0)
  load = jnp.einsum("btke,bt->e", jax.nn.one_hot(ids, num_experts), mask) / (tokens * k)
  importance = jnp.einsum("bte,bt->e", probs, mask) / tokens
  z = jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2 * mask) / tokens
  return {"load_balance": num_experts * jnp.sum(load * importance), "router_z": z}, load


def sequence_balance_loss(probs, ids, valid) -> jax.Array:
  """DeepSeek-V3's complementary sequence-wise balance loss (technical report, eq. 17-20) without its weight alpha:
  per sequence (a row of the batch; its T real tokens, ``valid``) ``sum_e f_e P_e``, f_e = E / (k T) times the
  number of the row's tokens that chose expert e, P_e the mean over them of e's score normalized over the experts
  (``probs``); the mean over the rows that hold a real token. 1.0 when every row's load and scores are even."""
  num_experts, k = probs.shape[-1], ids.shape[-1]
  mask = valid.astype(jnp.float32)
  tokens = jnp.sum(mask, axis=-1)  # [b]
  counts = jnp.einsum("btke,bt->be", jax.nn.one_hot(ids, num_experts), mask)
  f = counts * num_experts / (k * jnp.maximum(tokens, 1.0))[:, None]
  p = jnp.einsum("bte,bt->be", probs, mask) / jnp.maximum(tokens, 1.0)[:, None]
  rows = (tokens > 0).astype(jnp.float32)
  return jnp.sum(jnp.sum(f * p, axis=-1) * rows) / jnp.maximum(jnp.sum(rows), 1.0)


def load_metrics(load, dropped, ids, valid) -> dict:
  """A MoE layer's metrics: each expert's share of the routed tokens (``moe/load/eNN``), the largest share times the
  expert count (``moe/load_max``, 1 when balanced) and the share of assignments dropped over capacity."""
  num_experts = load.shape[0]
  return {**{f"moe/load/e{i:02d}": load[i] for i in range(num_experts)}, "moe/load_max": num_experts * jnp.max(load),
          "moe/dropped": dropped.astype(jnp.float32) / (jnp.maximum(jnp.sum(valid), 1) * ids.shape[-1])}


class MoE(nnx.Module):
  """Router + E routed SwiGLU experts (+ shared experts)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d, e, f = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim
    self.router = nnx.Param(_param(("embed", None))(rngs.params(), (d, e)))
    self.init_experts(d, e, f, rngs)
    self.shared = llama.MLP(types.SimpleNamespace(d_model=d, mlp_dim=cfg.num_shared_experts * f,
                                                  quantization=cfg.quantization), dtype,
                            rngs) if cfg.num_shared_experts else None
    self.k, self.scores, self.normalize = cfg.experts_per_token, cfg.router_scores, cfg.normalize_topk
    self.impl, self.capacity_factor = cfg.moe_impl, cfg.capacity_factor
    # DeepSeek-V3's sequence-wise balance loss (its own aux loss ``seq_aux``) only with a weight: none at all without.
    self.seq_aux = bool(getattr(cfg, "seq_aux_weight", 0.0))
    # The experts' matmuls (quantized with model.quantization; the router's stays float32).
    self.ragged_dot, self.einsum = quantization.ragged_dot(cfg.quantization), quantization.einsum(cfg.quantization)

  # Whether each chosen expert's input is weighted by its routing weight (Llama 4), instead of its output.
  weigh_inputs = False

  def init_experts(self, d: int, e: int, f: int, rngs: nnx.Rngs) -> None:
    """The E routed experts' stacked weights: SwiGLU's gate and up ``[E, d, f]``, down ``[E, f, d]``."""
    self.gate = nnx.Param(_param(("experts", "embed", "expert_mlp"))(rngs.params(), (e, d, f)))
    self.up = nnx.Param(_param(("experts", "embed", "expert_mlp"))(rngs.params(), (e, d, f)))
    self.down = nnx.Param(_param(("experts", "expert_mlp", "embed"))(rngs.params(), (e, f, d)))

  def expert_weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The experts' (gate, up, down), as jaxtrain/parallel/experts.py's ``moe_ffn`` takes them."""
    return self.gate[...], self.up[...], self.down[...]

  def route(self, x):
    """(router logits ``[b, t, E]`` float32, probabilities ``[b, t, E]`` (sum 1), top-k ids, top-k weights)."""
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...])
    scores = jax.nn.softmax(logits, axis=-1) if self.scores == "softmax" else jax.nn.sigmoid(logits)
    weights, ids = jax.lax.top_k(scores, self.k)
    if self.normalize:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    probs = scores if self.scores == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
    return logits, probs, ids, weights

  def __call__(self, x, segment_ids, decoding: bool = False):
    """(output, {aux losses}, {metrics}) for this layer. Decoding is always dropless (a capacity computed from a
    few new tokens would drop some of them)."""
    logits, probs, ids, weights = self.route(x)
    valid = segment_ids != 0
    y, dropped = experts.moe_ffn(x, ids, weights, valid, *self.expert_weights(),
                                 mode="dropless" if decoding else self.impl, capacity_factor=self.capacity_factor,
                                 ragged_dot=self.ragged_dot, einsum=self.einsum, weigh_inputs=self.weigh_inputs)
    y = constrain(y, ("batch", "length", "embed"))
    if self.shared is not None:
      y = y + self.shared(x)
    aux, load = router_losses(logits, probs, ids, valid)
    if self.seq_aux and not decoding:
      aux["seq_aux"] = sequence_balance_loss(probs, ids, valid)
    return y, aux, load_metrics(load, dropped, ids, valid)


class Block(nnx.Module):
  moe_class = MoE  # the routed experts (a family's own router: jaxtrain/models/glm4_moe)
  attention_class = llama.Attention  # the attention (a family's own: jaxtrain/models/llama4)

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    self.attn_norm = llama.norm(cfg, dtype)
    self.attn = self.attention_class(cfg, dtype, rngs)
    self.mlp_norm = llama.norm(cfg, dtype)
    self.moe = self.moe_class(cfg, dtype, rngs)

  def __call__(self, x, positions, segment_ids, cache=None, local=None):
    """``(x, aux losses, metrics)``; with a ``cache`` (decoding, see llama.Attention) ``(x, (k, v))``. ``local``:
    the layer's kind where the stack mixes them (llama.Attention)."""
    if cache is not None:
      attn, kv = self.attn(self.attn_norm(x), positions, segment_ids, cache, local)
      x = x + attn
      y, _, _ = self.moe(self.mlp_norm(x), segment_ids, decoding=True)
      return constrain(x + y, ("batch", "length", "embed")), kv
    x = x + self.attn(self.attn_norm(x), positions, segment_ids, local=local)
    y, aux, metrics = self.moe(self.mlp_norm(x), segment_ids)
    return constrain(x + y, ("batch", "length", "embed")), aux, metrics


class MoeLM(nnx.Module):
  """Embedding, ``first_dense_layers`` Llama blocks (run by :meth:`embed_tokens`, before any pipeline stage), the
  stacked MoE blocks ``layers`` (the pipeline splits these), final norm and head."""
  paged_cache = True  # decodes with a paged cache too (llama.Llama's note)
  block = Block  # the MoE layers' block (another family's: jaxtrain/models/glm4_moe)

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                           embedding_init=_param(("vocab", "embed")), rngs=rngs)
    # The dense stack's leading axis is named ``dense_layers``: no rule shards it (not over pipeline stages).
    self.dense_layers = (core.stacked(cfg, dtype, rngs, llama.Block, cfg.first_dense_layers, "dense_layers")
                         if cfg.get("first_dense_layers") else None)
    self.layers = core.stacked(cfg, dtype, rngs, self.block, self.moe_layer_count(cfg), "layers")
    self.final_norm = llama.norm(cfg, dtype)
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
        kernel_init=_param(("embed", "vocab")), rngs=rngs)
    self.remat = cfg.remat
    self.moe_layers = self.moe_layer_count(cfg)

  @staticmethod
  def moe_layer_count(cfg) -> int:
    """How many MoE blocks ``layers`` stacks (the steps of the layer scan; a family's own: jaxtrain/models/llama4)."""
    return cfg.num_layers - cfg.first_dense_layers

  def _remat(self, fn):
    return core.remat_layer(fn, self.remat)

  def embed_tokens(self, tokens, positions, segment_ids):
    """The embedding and the dense first layers (so a pipeline splits only the MoE stack)."""
    return self.embedded(tokens, positions, segment_ids)[0]

  def embedded(self, tokens, positions, segment_ids):
    """:meth:`embed_tokens`'s ``x`` and the dense layers' sown maxima (``{"dense_layers/<path>": [layers, ...]}``,
    core.Output's)."""
    x = llama.lookup(self.embed, tokens)
    if self.dense_layers is None:
      return x, {}
    graphdef = nnx.graphdef(self.dense_layers)

    def layer(w, h, side):
      return core.capturing_maxima(nnx.merge(graphdef, w), "dense_layers/", h, *side)
    layer = self._remat(layer)
    x, maxima = jax.lax.scan(lambda h, w: layer(w, h, (positions, segment_ids)), x, nnx.state(self.dense_layers),
                             unroll=scans.unroll())
    return x, maxima

  def apply_layer(self, weights, x, side, kind=None):
    """One MoE layer: ``(x, {"aux_losses": ..., "metrics": ...})``, each already divided by the number of MoE
    layers, so that their sum over the stack is the mean. ``kind``: its entry of :meth:`layer_kinds`."""
    graphdef = nnx.graphdef(self.layers)
    n = self.moe_layers

    def layer(w, h, side, kind):
      (h, aux, metrics), maxima = core.capturing_maxima(nnx.merge(graphdef, w), "layers/", h, *side,
                                                        **({} if kind is None else {"local": kind}))
      extras = {"aux_losses": {k: v / n for k, v in aux.items()}, "metrics": {k: v / n for k, v in metrics.items()}}
      return h, {**extras, "maxima": maxima} if maxima else extras
    return self._remat(layer)(weights, x, side, kind)

  def layer_kinds(self):
    """The layer scan's per-layer input besides the weights (a family whose layers differ: jaxtrain/models/llama4);
    None: every layer alike."""
    return None

  def head(self, x):
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return constrain(logits, ("batch", "length", "vocab"))  # in the compute dtype: see jaxtrain.train.losses

  def __call__(self, tokens, positions, segment_ids, cache: KVCache | None = None):
    """An Output (logits, the router losses, the load metrics); with a ``cache`` (decoding, see jaxtrain/models)
    ``(logits, cache)``."""
    if cache is not None:
      return self._decode(tokens, positions, segment_ids, cache)
    x, extras = self.stack(tokens, positions, segment_ids)
    return core.Output(self.head(x), extras["aux_losses"], extras["metrics"], extras["maxima"])

  def stack(self, tokens, positions, segment_ids):
    """The embedded tokens through every layer: ``(x before the final norm, {aux_losses, metrics} summed over the
    layers, and maxima: every stack's sown maxima, by path)``."""
    x, maxima = self.embedded(tokens, positions, segment_ids)
    x, extras = scan_layers(self, x, (positions, segment_ids))
    return x, {**extras, "maxima": {**maxima, **extras.get("maxima", {})}}


  @classmethod
  def init_cache(cls, cfg, batch: int, max_len: int) -> KVCache:
    """An empty cache for every layer (the dense first ones, then the MoE ones)."""
    return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))

  def _decode(self, tokens, positions, segment_ids, cache):
    """A forward with a ``cache`` (an attention.KVCache or PagedKVCache: the slots API of KVCache's docstring)."""
    slots = cache.write_slots(segment_ids, positions)
    stacked_axes = (None, *KV_AXES)
    k, v = constrain(cache.k, stacked_axes), constrain(cache.v, stacked_axes)
    # (the dense first layers, then the MoE ones: one cache stack)
    x, (k, v) = core.decode_stacks((self.dense_layers, self.layers), slots, llama.lookup(self.embed, tokens), k, v,
                                   positions, segment_ids)
    return self.head(x), slots.advanced(constrain(k, stacked_axes), constrain(v, stacked_axes), tokens.shape[1])

core.register("moe", core.Family(module=MoeLM, defaults=defaults, flops_per_token=flops_per_token,
                                   validate=validate, axis_keys=AXIS_KEYS,
                                   activation_estimate=activation_estimate, quantizable=True, qk_clip=llama.qk_clip))


def scan_layers(module, x, side):
  """``x`` through ``module.layers``, a stack of MoE blocks scanned with ``module.apply_layer(weights, x, side,
  kind)`` over ``module.layer_kinds()``: ``(x, {aux_losses, metrics} summed over the layers)`` (this family's stack,
  and GPT-OSS's)."""
  kinds = module.layer_kinds()
  first = None if kinds is None else kinds[0]
  shapes = jax.eval_shape(lambda w, h: module.apply_layer(w, h, side, first)[1],
                          jax.tree.map(lambda a: a[0], nnx.state(module.layers)), x)
  zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), {k: v for k, v in shapes.items() if k != "maxima"})

  def body(carry, xs):
    h, extras = carry
    h, new = module.apply_layer(xs[0], h, side, xs[1])
    maxima = new.pop("maxima", {})  # (each layer's own: stacked by the scan, never summed)
    return (h, jax.tree.map(jnp.add, extras, new)), maxima

  (x, extras), maxima = jax.lax.scan(body, (x, zero), (nnx.state(module.layers), kinds), unroll=scans.unroll())
  return x, {**extras, "maxima": maxima} if maxima else extras

"""OpenAI's GPT-OSS decoder (``model.name=gpt_oss``): Llama's grouped-query attention with biases on every projection,
attention sinks and YaRN RoPE, sliding-window (128) and full layers alternating, and feed-forward blocks of E routed
experts with biases and a clamped SwiGLU, of which each token uses k.

Per layer (as transformers' ``modeling_gpt_oss.py``):

* Attention: q, k, v and o projections with biases; a learned logit per head (``sinks``) joins every softmax's
  denominator (jaxtrain/models/attention.py); even layers (0, 2, ...) see the ``sliding_window`` keys before them,
  odd ones every key (``global_every=2``); RoPE with YaRN scaling (``rope_scaling=yarn``, jaxtrain/models/llama's
  :class:`~jaxtrain.models.llama.model.Yarn`).
* Router: ``x W_r + b_r`` ``[E]``; the k largest logits, softmaxed among themselves, are the expert weights.
* Expert e: ``[gate, up] = x W_gu[e] + b_gu[e]`` (``gate_up`` stores them interleaved, gate at even columns, as the
  Hugging Face checkpoint does), ``gate = min(gate, limit)``, ``up = clip(up, -limit, limit)``,
  ``h = (up + 1) * gate * sigmoid(alpha * gate)``, output ``h W_d[e] + b_d[e]`` (alpha 1.702, limit 7).

The experts run in jaxtrain/parallel/experts.py (dropless or with a capacity; sharded over the ``expert`` mesh axis)
as an :class:`~jaxtrain.parallel.experts.ExpertMLP`; the output bias is added outside it, weighted per token (under
tensor parallelism the experts' outputs are summed over shards, which would sum the bias too). The router's
auxiliary losses and load metrics are the ``moe`` family's (jaxtrain/models/moe/model.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxtrain.errors import ConfigError, check_positive
from jaxtrain.models import attention, core, quantization
from jaxtrain.models.attention import KVCache
from jaxtrain.models.llama import model as llama
from jaxtrain.models.moe import model as moe
from jaxtrain.parallel import experts
from jaxtrain.sharding import constrain


def defaults() -> dict:
  """The GPT-OSS family's ``model`` keys: Llama's (``mlp_dim`` unused: every layer is routed) and these; the values
  are gpt-oss-20b's but for its size (configs/gpt_oss_20b.py has that)."""
  return dict(
      llama.defaults(),
      qkv_bias=True,
      out_bias=True,  # a bias on the attention's output projection
      attention_sinks=True,  # a learned logit per head in every softmax's denominator
      sliding_window=128,
      global_every=2,  # layers 0, 2, ... local, 1, 3, ... global
      rope_theta=150_000.0,
      **llama.yarn_defaults("yarn", 32.0, 4096, truncate=False),
      num_experts=8,
      experts_per_token=2,
      expert_mlp_dim=128,
      swiglu_alpha=1.702,  # the gate's sigmoid gain
      swiglu_limit=7.0,  # gate clamped above, up both ways
      moe_impl="dropless",  # dropless | capacity (jaxtrain/parallel/experts.py)
      capacity_factor=1.25,
      load_balance_weight=0.0,  # transformers' router_aux_loss_coef / k (the moe family's loss)
      router_z_weight=0.0,
  )


ROPE_SCALINGS = ("", "yarn")


def validate(cfg) -> None:
  plain = cfg.copy_and_resolve_references()
  plain.rope_scaling = ""  # YaRN is checked here; the rest as Llama's
  llama.validate(plain)
  check_positive({"model": cfg}, [f"model.{k}" for k in ("num_experts", "experts_per_token", "expert_mlp_dim",
                                                          "capacity_factor", "swiglu_alpha", "swiglu_limit")])
  check_positive({"model": cfg}, ["model.load_balance_weight", "model.router_z_weight"], allow_zero=True)
  if cfg.experts_per_token > cfg.num_experts:
    raise ConfigError("model.experts_per_token", f"{cfg.experts_per_token} is more than model.num_experts="
                      f"{cfg.num_experts}", "route each token to at most num_experts experts")
  if cfg.rope_scaling not in ROPE_SCALINGS:
    raise ConfigError("model.rope_scaling", f"'{cfg.rope_scaling}' is not one of '' (none), yarn",
                      "set model.rope_scaling to '' or yarn")
  if cfg.rope_scaling == "yarn":
    check_positive({"model": cfg}, [f"model.{k}" for k in ("rope_scaling_factor", "rope_original_max_positions",
                                                            "rope_yarn_beta_fast", "rope_yarn_beta_slow")])
  gemma = [k for k in ("sandwich_norms", "embed_scale", "final_softcap", "attn_softcap", "norm_plus_one",
                       "qk_norm") if cfg.get(k)]
  if gemma or cfg.mlp_activation != "silu":
    key = f"model.{gemma[0]}" if gemma else "model.mlp_activation"
    raise ConfigError(key, "is another family's option; GPT-OSS has no such thing", f"leave {key} at its default "
                      f"with model.name={cfg.name}")
  if cfg.moe_impl not in experts.MODES:
    raise ConfigError("model.moe_impl", f"'{cfg.moe_impl}' is not one of {', '.join(experts.MODES)}",
                      "set model.moe_impl=dropless or capacity")


def _expert_params(abstract_params) -> int:
  m = abstract_params["layers"]["moe"]
  return sum(m[name].size for name in ("gate_up", "gate_up_bias", "down", "down_bias"))


def param_counts(cfg, abstract_params) -> tuple[int, int]:
  """(total, active) parameters: active counts k of the E routed experts per token and everything else but the
  input embedding table (a lookup, not a matmul), as the GPT-OSS model card counts them."""
  total = sum(a.size for a in jax.tree.leaves(abstract_params))
  inactive = _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts)
  embedding = 0 if cfg.tie_embeddings else abstract_params["embed"]["embedding"].size
  return total, int(round(total - inactive - embedding))


def flops_per_token(cfg, seq_len: int, abstract_params) -> float:
  """Llama's (a local layer's attention over its window) over the parameters a token uses: k of the E experts."""
  return (llama.flops_per_token(cfg, seq_len, abstract_params)
          - 6 * _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts))


def activation_estimate(cfg, rows: int, seq_len: int, tensor: int, context: int = 1) -> dict[str, int]:
  """The ``moe`` family's estimate (no shared experts, no dense first layers)."""
  return moe.activation_estimate(ml_collections.ConfigDict({**cfg.to_dict(), "num_shared_experts": 0}), rows,
                                 seq_len, tensor, context)


AXIS_KEYS = {**llama.AXIS_KEYS, "experts": "num_experts", "expert_mlp": "expert_mlp_dim"}


def _param(names):
  return nnx.with_partitioning(nnx.initializers.normal(0.02), names)


def clamped_swiglu(gate_up, alpha: float, limit: float):
  """GPT-OSS's gated activation of interleaved ``[..., 2f]`` (gate at even columns, up at odd): ``(clip(up) + 1) *
  g * sigmoid(alpha * g)``, ``g = min(gate, limit)``, up clipped to ``[-limit, limit]``."""
  gate, up = gate_up[..., ::2], gate_up[..., 1::2]
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class MoE(nnx.Module):
  """Router with a bias + E experts with biases and the clamped SwiGLU."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d, e, f = cfg.d_model, cfg.num_experts, cfg.expert_mlp_dim
    self.router = nnx.Param(_param(("embed", None))(rngs.params(), (d, e)))
    self.router_bias = nnx.Param(_param((None,))(rngs.params(), (e,)))
    self.gate_up = nnx.Param(_param(("experts", "embed", "expert_mlp"))(rngs.params(), (e, d, 2 * f)))
    self.gate_up_bias = nnx.Param(jnp.zeros((e, 2 * f), jnp.float32), out_sharding=("experts", "expert_mlp"))
    self.down = nnx.Param(_param(("experts", "expert_mlp", "embed"))(rngs.params(), (e, f, d)))
    self.down_bias = nnx.Param(jnp.zeros((e, d), jnp.float32), out_sharding=("experts", "embed"))
    self.k, self.alpha, self.limit = cfg.experts_per_token, float(cfg.swiglu_alpha), float(cfg.swiglu_limit)
    self.impl, self.capacity_factor = cfg.moe_impl, cfg.capacity_factor
    self.ragged_dot, self.einsum = quantization.ragged_dot(cfg.quantization), quantization.einsum(cfg.quantization)

  def route(self, x):
    """(router logits ``[b, t, E]`` float32, probabilities ``[b, t, E]``, top-k ids, top-k weights): the k largest
    logits softmaxed among themselves (transformers' order; the same as the full softmax's top k renormalized)."""
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), self.router[...]) + self.router_bias[...]
    top, ids = jax.lax.top_k(logits, self.k)
    return logits, jax.nn.softmax(logits, axis=-1), ids, jax.nn.softmax(top, axis=-1)

  def _expert(self, rows, weights, matmul, bias):
    gate_up, gate_up_bias, down = weights
    return matmul(clamped_swiglu(matmul(rows, gate_up) + bias(gate_up_bias), self.alpha, self.limit), down)

  def __call__(self, x, segment_ids, decoding: bool = False):
    """(output, {aux losses}, {metrics}), as the ``moe`` family's MoE."""
    logits, probs, ids, weights = self.route(x)
    valid = segment_ids != 0
    mlp = experts.ExpertMLP((self.gate_up[...], self.gate_up_bias[...], self.down[...]),
                            (("experts", None, "expert_mlp"), ("experts", "expert_mlp"),
                             ("experts", "expert_mlp", None)), self._expert)
    y, dropped = experts.moe_ffn(x, ids, weights, valid, None, None, None, mlp=mlp,
                                 mode="dropless" if decoding else self.impl, capacity_factor=self.capacity_factor,
                                 ragged_dot=self.ragged_dot, einsum=self.einsum)
    # The output bias of each chosen expert, weighted (0 for padding, which the experts leave at 0 too).
    chosen = jnp.einsum("btk,btke->bte", weights * valid[..., None], jax.nn.one_hot(ids, self.down_bias.shape[0]))
    bias = jnp.einsum("bte,ed->btd", chosen, self.down_bias[...])
    y = constrain(y + bias.astype(y.dtype), ("batch", "length", "embed"))
    aux, load = moe.router_losses(logits, probs, ids, valid)
    return y, aux, moe.load_metrics(load, dropped, ids, valid)


class Block(moe.Block):
  """The ``moe`` family's block (attention with sinks and windows: llama.Attention) with GPT-OSS's MoE."""
  moe_class = MoE


class GptOss(nnx.Module):
  """Embedding, the stacked blocks ``layers`` (each layer's kind, local or global, an input of the layer scan), final
  norm and untied head."""
  paged_cache = True  # decodes with a paged cache too (llama.Llama's note)

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                           embedding_init=_param(("vocab", "embed")), rngs=rngs)
    self.layers = core.stacked(cfg, dtype, rngs, Block, cfg.num_layers)
    self.final_norm = llama.norm(cfg, dtype)
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
        kernel_init=_param(("embed", "vocab")), rngs=rngs)
    self.remat = cfg.remat
    self.local = tuple(bool(w) for w in attention.layer_windows(cfg)) if attention.mixed_layers(cfg) else None
    self.num_layers = cfg.num_layers

  def embed_tokens(self, tokens, positions=None, segment_ids=None):
    del positions, segment_ids
    return llama.lookup(self.embed, tokens)

  def layer_kinds(self):
    return None if self.local is None else jnp.asarray(self.local)

  def apply_layer(self, weights, x, side, local=None):
    """One layer: ``(x, {"aux_losses": ..., "metrics": ...})``, each divided by the number of layers (their sum
    over the stack is the mean)."""
    graphdef, n = nnx.graphdef(self.layers), self.num_layers

    def layer(w, h, side, local):
      h, aux, metrics = nnx.merge(graphdef, w)(h, *side, local=local)
      return h, {"aux_losses": {k: v / n for k, v in aux.items()}, "metrics": {k: v / n for k, v in metrics.items()}}
    return core.remat_layer(layer, self.remat)(weights, x, side, local)

  def head(self, x):
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return constrain(logits, ("batch", "length", "vocab"))

  def __call__(self, tokens, positions, segment_ids, cache: KVCache | None = None):
    """An Output (logits, the router losses, the load metrics); with a ``cache`` ``(logits, cache)``."""
    if cache is not None:
      return self._decode(tokens, positions, segment_ids, cache)
    x, extras = moe.scan_layers(self, self.embed_tokens(tokens), (positions, segment_ids))
    return core.Output(self.head(x), extras["aux_losses"], extras["metrics"])

  # Decoding as Llama's: the same cache and layer scan over the blocks (their kinds: sliding or full).
  init_cache = classmethod(llama.Llama.init_cache.__func__)
  _decode = llama.Llama._decode


core.register("gpt_oss", core.Family(module=GptOss, defaults=defaults, flops_per_token=flops_per_token,
                                       validate=validate, axis_keys=AXIS_KEYS,
                                       activation_estimate=activation_estimate, quantizable=True))

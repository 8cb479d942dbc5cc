"""Qwen3-Next's decoder (``model.name=qwen3_next``; transformers' ``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B), a
hybrid of gated DeltaNet linear attention and gated full attention, every layer a MoE. Built from the ``moe``
family's stack and router; what is its own is here. Per layer (as transformers' ``modeling_qwen3_next.py``):

* Token mixer, by ``full_attention_every`` (N; transformers' ``full_attention_interval``): layers N-1, 2N-1, ... gated
  full attention, the others gated DeltaNet.
* Gated full attention (:class:`GatedAttention`): q's projection gives each head its query and an output gate
  (``[d, heads, 2 head_dim]``: query, then gate), QK RMSNorm per head, RoPE on the first ``partial_rotary_factor``
  of each head (llama.rope), grouped-query attention, the output times ``sigmoid(gate)`` before ``o``.
* Gated DeltaNet (:class:`GatedDeltaNet`): ``x`` (padding zeroed) projected to q, k (``linear_k_heads`` x
  ``linear_k_dim``), v and the output gate z (``linear_v_heads`` x ``linear_v_dim``; each k head serves
  ``linear_v_heads / linear_k_heads`` consecutive v heads), and per v head b and a; q, k and v through a causal
  depthwise conv of ``linear_conv_kernel`` taps and SiLU; q and k L2-normalized per head (q times
  ``linear_k_dim ** -0.5``); ``beta = sigmoid(b)``, the decay ``g = -exp(A_log) softplus(a + dt_bias)``; the delta
  rule ``S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - k_t exp(g_t) S_{t-1})^T``, ``o_t = q_t S_t``, per v head; the
  output RMSNorm-ed per head (weight ``w``, not ``1 + w``) times ``silu(z)``, then ``o``. The recurrence in two
  forms, equal to each other: :func:`chunked_delta_rule` (training, prefill: chunks of ``deltanet_chunk`` tokens, as
  transformers' ``torch_chunk_gated_delta_rule``) and :func:`recurrent_delta_rule` (one token a step, decoding).
  Both restart at a document's first token (position 0 or a new segment id), so packed rows are exact; so does the
  conv (a tap never reaches into another document).
* Norms: zero-centred RMSNorm (``1 + w``, ``norm_plus_one``) for the layers' two, q's and k's, and the final one.
* Feed-forward: the ``moe`` family's softmax router, top-k renormalized (``normalize_topk``), SwiGLU experts, and a
  shared expert of ``shared_mlp_dim`` every token uses, its output times ``sigmoid(x w_g)`` (:class:`MoE`).

The layer scan steps over groups of N layers (:class:`Group`: N - 1 DeltaNet layers, a stack of their own scanned
inside, then the full-attention one). Decoding carries :class:`HybridCache`: the static KV cache of the full-attention
layers (``[layers / N, ...]``) and each DeltaNet layer's last conv inputs and recurrent state (the paged cache of
continuous batching is not taken). Context parallelism is refused: the recurrence runs along the whole sequence.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from jaxtrain.errors import ConfigError, check_positive
from jaxtrain.models import attention, core, quantization
from jaxtrain.models.attention import KVCache
from jaxtrain.models.llama import model as llama
from jaxtrain.models.moe import model as moe
from jaxtrain.sharding import constrain


def defaults() -> dict:
  """The Qwen3-Next family's ``model`` keys: the ``moe`` family's (softmax router always, no dense first layers, the
  shared expert its own size) and these; Qwen3-Next-80B-A3B's settings at a small size (configs/qwen3_next_80b_a3b.py
  has the published one)."""
  keys = dict(
      moe.defaults(),
      num_layers=4, head_dim=16, norm_plus_one=True, norm_eps=1e-6, rope_theta=10_000_000.0, qk_norm="head",
      num_experts=8, experts_per_token=2, expert_mlp_dim=32, load_balance_weight=0.0, router_z_weight=0.0,
      full_attention_every=4,  # every Nth layer (N-1, 2N-1, ...) gated full attention, the others gated DeltaNet
      partial_rotary_factor=0.25,  # RoPE on this part of each full-attention head
      shared_mlp_dim=32,  # the shared expert's hidden size (gated by sigmoid(x w_g)); 0: none
      linear_k_heads=2,  # the DeltaNet's q and k heads
      linear_v_heads=4,  # its v heads: a multiple of linear_k_heads
      linear_k_dim=16,
      linear_v_dim=16,
      linear_conv_kernel=4,  # the causal depthwise conv's taps on q, k and v
      deltanet_chunk=64,  # the chunked form's chunk (training, prefill)
  )
  for key in ("num_shared_experts", "first_dense_layers", "router_scores"):
    del keys[key]
  return keys


OTHER_FAMILIES = ("qkv_bias", "sliding_window", "global_every", "attn_softcap", "final_softcap", "query_scale",
                  "rope_local_theta", "embed_scale", "sandwich_norms")


def validate(cfg) -> None:
  moe.validate(ml_collections.ConfigDict({**cfg.to_dict(), "num_shared_experts": 0, "first_dense_layers": 0,
                                          "router_scores": "softmax"}))
  check_positive({"model": cfg}, [f"model.{k}" for k in ("full_attention_every", "linear_k_heads", "linear_v_heads",
                                                          "linear_k_dim", "linear_v_dim", "linear_conv_kernel",
                                                          "deltanet_chunk")])
  check_positive({"model": cfg}, ["model.shared_mlp_dim"], allow_zero=True)
  other = [k for k in OTHER_FAMILIES if cfg.get(k)]
  if other:
    raise ConfigError(f"model.{other[0]}", "is another family's option; Qwen3-Next's layers have none",
                      f"leave it at its default with model.name={cfg.name}")
  if cfg.qk_norm != "head" or not cfg.norm_plus_one:
    raise ConfigError("model.qk_norm" if cfg.qk_norm != "head" else "model.norm_plus_one",
                      "is fixed in Qwen3-Next (QK-norm per head, zero-centred norms)",
                      "set model.qk_norm=head and model.norm_plus_one=true")
  if cfg.num_layers % cfg.full_attention_every:
    raise ConfigError("model.full_attention_every", f"{cfg.full_attention_every} does not divide model.num_layers="
                      f"{cfg.num_layers}", "the layer scan steps over groups of that many layers")
  if cfg.linear_v_heads % cfg.linear_k_heads:
    raise ConfigError("model.linear_v_heads", f"{cfg.linear_v_heads} is not a multiple of model.linear_k_heads="
                      f"{cfg.linear_k_heads}", "each k head serves the same number of v heads")
  factor = cfg.partial_rotary_factor
  rotary = int(cfg.head_dim * factor)
  if not 0 < factor <= 1 or rotary < 2 or rotary % 2:
    raise ConfigError("model.partial_rotary_factor", f"{factor} of model.head_dim={cfg.head_dim} turns {rotary} "
                      "dims", "RoPE turns pairs of dims: choose a factor in (0, 1] that gives an even count")


def param_counts(cfg, abstract_params) -> tuple[int, int]:
  """(total, active) parameters: active counts k of the E routed experts per token (and everything else)."""
  total = sum(a.size for a in jax.tree.leaves(abstract_params))
  return total, int(round(total - _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts)))


def _expert_params(abstract_params) -> int:
  return sum(block["moe"][name].size for block in abstract_params["layers"].values() for name in ("gate", "up", "down"))


def flops_per_token(cfg, seq_len: int, abstract_params) -> float:
  """PaLM's formula over the parameters a token uses (k of the E routed experts), the attention term over the
  full-attention layers only, and the DeltaNet's chunked recurrence: per v head and token about ``4 chunk (dk + dv)
  + 8 dk dv`` multiply-adds (its intra-chunk matrices and the state's read and write), times 3 for the backward."""
  weights = core.dense_flops_per_token(abstract_params, 0, num_layers=0, attention_width=0,
                                       tied_embeddings=cfg.tie_embeddings)
  routed = 6 * _expert_params(abstract_params) * (1 - cfg.experts_per_token / cfg.num_experts)
  full = cfg.num_layers // cfg.full_attention_every
  dk, dv, chunk = cfg.linear_k_dim, cfg.linear_v_dim, min(cfg.deltanet_chunk, seq_len)
  delta = 6 * (cfg.num_layers - full) * cfg.linear_v_heads * (2 * chunk * (dk + dv) + 4 * dk * dv)
  return weights - routed + 12 * full * cfg.num_heads * cfg.head_dim * seq_len + delta


AXIS_KEYS = {**moe.AXIS_KEYS}


def _param(names):
  return nnx.with_partitioning(nnx.initializers.normal(0.02), names)


# --- the delta rule ------------------------------------------------------------------------------------------------


def l2_normalized(x, eps: float = 1e-6):
  """``x / sqrt(sum(x^2) + eps)`` over the last dim (transformers' ``l2norm``, the FLA library's)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def document_starts(positions, segment_ids):
  """``[batch, length]`` bool: a document's first token (position 0, or a segment id other than the previous
  token's). The recurrence and the conv restart there."""
  previous = jnp.concatenate([segment_ids[:, :1], segment_ids[:, :-1]], axis=1)
  return (positions == 0) | (segment_ids != previous)


def recurrent_delta_rule(q, k, v, g, beta, starts, state=None):
  """The gated delta rule one token at a time (transformers' ``torch_recurrent_gated_delta_rule``), float32: q, k
  ``[b, t, h, dk]`` (normalized, q scaled), v ``[b, t, h, dv]``, g and beta ``[b, t, h]``, ``starts`` ``[b, t]`` (the
  state is zeroed there), ``state`` ``[b, h, dk, dv]`` (None: zeros). ``(out [b, t, h, dv], state)``."""
  b, _, h, dk = k.shape
  state = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if state is None else state
  keep = jnp.exp(g) * (1.0 - starts[..., None].astype(jnp.float32))

  def step(s, xs):
    q_t, k_t, v_t, keep_t, beta_t = xs
    s = s * keep_t[..., None, None]
    delta = (v_t - jnp.einsum("bhk,bhkv->bhv", k_t, s)) * beta_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("bhk,bhkv->bhv", q_t, s)

  state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, keep, beta)))
  return jnp.moveaxis(out, 0, 1), state


def unit_lower_inverse(lower):
  """``(I + lower)^-1`` of strictly lower-triangular ``[..., n, n]`` matrices (the chunk's UT transform), as the
  product ``(I - L)(I + L^2)(I + L^4)...``: the series ``sum_k (-L)^k``, which ends at ``k = n - 1`` (``L^n = 0``),
  in ``log2 n`` squarings and products, matmuls all. (Not ``lax.linalg.triangular_solve``: on CPU jaxlib 0.10's
  batched solve waits on the thread pool that runs it, which deadlocks a program whose two branches both solve.)"""
  n = lower.shape[-1]
  inverse, power = jnp.eye(n, dtype=lower.dtype) - lower, lower
  for _ in range(max(n - 1, 1).bit_length() - 1):
    power = power @ power
    inverse = inverse + inverse @ power
  return inverse


def chunked_delta_rule(q, k, v, g, beta, starts, state=None, chunk: int = 64):
  """The gated delta rule by chunks of ``chunk`` tokens (transformers' ``torch_chunk_gated_delta_rule``): within a
  chunk the UT transform (a unit lower-triangular solve) and masked matmuls, across chunks a scan of the state.
  Arguments and result as :func:`recurrent_delta_rule`'s, which it equals. A document start inside a chunk cuts
  the chunk's decays there: the pairs across it are masked, and the state entering the chunk reaches only the
  tokens before the first start."""
  b, t, h, dk = k.shape
  dv = v.shape[-1]
  pad = -t % chunk
  n = (t + pad) // chunk

  def chunks(x):  # [b, t, h, ...] -> [b, h, n, chunk, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, chunk, *x.shape[2:]), 3, 1)

  q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
  count = jnp.cumsum(jnp.pad(starts, [(0, 0), (0, pad)]).reshape(b, 1, n, chunk).astype(jnp.int32), axis=-1)
  cum = jnp.cumsum(g, axis=-1)
  causal = jnp.tril(jnp.ones((chunk, chunk), bool))
  pairs = causal & (count[..., :, None] == count[..., None, :])  # j <= i in the same document
  diff = cum[..., :, None] - cum[..., None, :]
  decay = jnp.where(pairs, jnp.exp(jnp.where(pairs, diff, 0.0)), 0.0)
  carried = (count == 0).astype(jnp.float32)  # the tokens the entering state reaches
  k_beta, v_beta = k * beta[..., None], v * beta[..., None]
  strict = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
  lower = jnp.where(strict, jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay, 0.0)
  inverse = unit_lower_inverse(lower)
  grown = jnp.exp(cum) * carried
  values, k_decayed = inverse @ v_beta, inverse @ (k_beta * grown[..., None])
  intra = jnp.einsum("...ik,...jk->...ij", q, k) * decay
  q_state = q * grown[..., None]
  to_end = jnp.exp(cum[..., -1:] - cum) * (count == count[..., -1:])
  k_state = k * to_end[..., None]
  chunk_decay = jnp.exp(cum[..., -1]) * carried[..., -1]
  state = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state

  def step(s, xs):
    values_c, k_decayed_c, q_c, intra_c, k_c, decay_c = xs
    new = values_c - k_decayed_c @ s
    out = q_c @ s + intra_c @ new
    return s * decay_c[..., None, None] + jnp.swapaxes(k_c, -1, -2) @ new, out

  state, out = jax.lax.scan(step, state, tuple(jnp.moveaxis(a, 2, 0) for a in (values, k_decayed, q_state, intra,
                                                                                 k_state, chunk_decay)))
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
  return jnp.swapaxes(out, 1, 2), state


def causal_conv(x, w, starts, previous=None):
  """The causal depthwise conv of x ``[b, t, ...]`` with taps ``w`` ``[K, ...]`` (the last on the token itself), a
  tap never reaching across a document start (``starts`` ``[b, t]``) nor before the row (zeros; ``previous``: the
  row's last K - 1 inputs instead, decoding). ``(out, the last K - 1 inputs)``."""
  taps, (b, t) = w.shape[0], x.shape[:2]
  if previous is None:
    previous = jnp.zeros((b, taps - 1, *x.shape[2:]), x.dtype)
  whole = jnp.concatenate([previous.astype(x.dtype), x], axis=1)
  count = jnp.cumsum(jnp.concatenate([jnp.zeros((b, taps - 1), jnp.int32), starts.astype(jnp.int32)], axis=1), 1)
  here = count[:, taps - 1:]
  out = sum(whole[:, j:j + t] * w[j] * (count[:, j:j + t] == here).reshape(b, t, *[1] * (x.ndim - 2))
            for j in range(taps))
  return out, whole[:, t:]


class GatedDeltaNet(nnx.Module):
  """Qwen3-Next's linear attention (the module docstring). Params in the checkpoint's layouts: ``qkvz`` ``[d,
  k_heads, 2 dk + 2 (v_heads / k_heads) dv]`` (each k head's q, k, then its v heads' v and z), ``ba`` ``[d, k_heads, 2
  v_heads / k_heads]``, ``conv`` ``[2 k_heads dk + v_heads dv, K]`` (q's channels, k's, v's), ``A_log``, ``dt_bias``
  ``[v_heads]``, ``norm`` ``[dv]``, ``o`` ``[v_heads, dv, d]``. The k heads take the logical axis ``kv_heads``, the
  v heads ``heads`` (split alike over tensor, each k head with its v heads)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d, nk, nv, dk, dv = cfg.d_model, cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    r = nv // nk
    kw = dict(dtype=dtype, param_dtype=jnp.float32, einsum_op=quantization.einsum(cfg.quantization), rngs=rngs)
    self.qkvz = nnx.Einsum("btd,dnw->btnw", (d, nk, 2 * dk + 2 * r * dv), kernel_init=_param(("embed", "kv_heads",
                                                                                              None)), **kw)
    self.ba = nnx.Einsum("btd,dnw->btnw", (d, nk, 2 * r), kernel_init=_param(("embed", "kv_heads", None)), **kw)
    self.conv = nnx.Param(_param((None, None))(rngs.params(), (2 * nk * dk + nv * dv, cfg.linear_conv_kernel)))
    # A = exp(A_log) drawn in [0.01, 1) (transformers draws [0.01, 16): at its upper end a head forgets within a
    # token, and the decay's gradient all but vanishes)
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (nv,), jnp.float32, 0.01, 1.0)),
                           out_sharding=("heads",))
    self.dt_bias = nnx.Param(jnp.ones((nv,), jnp.float32), out_sharding=("heads",))
    self.norm = nnx.Param(jnp.ones((dv,), jnp.float32), out_sharding=("head_dim",))
    self.o = nnx.Einsum("btnh,nhd->btd", (nv, dv, d), kernel_init=_param(("heads", "head_dim", "embed")), **kw)
    self.dims, self.eps, self.chunk = (nk, nv, dk, dv), float(cfg.norm_eps), int(cfg.deltanet_chunk)

  def __call__(self, x, positions, segment_ids, cache=None, local=None):
    """The mixer's output; with a ``cache`` ``((conv q, k, v inputs), state)`` (decoding: this layer's) also the
    updated cache."""
    del local
    nk, nv, dk, dv = self.dims
    b, t, _ = x.shape
    x = x * (segment_ids != 0)[..., None].astype(x.dtype)  # padding in no state (transformers zeroes it too)
    qkvz, ba = self.qkvz(x), self.ba(x)
    r = nv // nk
    q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    v, z = v.reshape(b, t, nv, dv), z.reshape(b, t, nv, dv)
    beta = jax.nn.sigmoid(ba[..., :r].reshape(b, t, nv).astype(jnp.float32))
    a = ba[..., r:].reshape(b, t, nv).astype(jnp.float32)
    g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
    starts = document_starts(positions, segment_ids)
    w = self.conv[...].T.astype(x.dtype)  # [K, channels]
    weights = (w[:, :nk * dk].reshape(-1, nk, dk), w[:, nk * dk:2 * nk * dk].reshape(-1, nk, dk),
               w[:, 2 * nk * dk:].reshape(-1, nv, dv))
    previous, state = (None,) * 3, None
    if cache is not None:
      previous, state = cache
    conved = [causal_conv(a_, w_, starts, p_) for a_, w_, p_ in zip((q, k, v), weights, previous)]
    q, k, v = (jax.nn.silu(c).astype(jnp.float32) for c, _ in conved)
    q, k = (jnp.repeat(l2_normalized(a_), r, axis=2) for a_ in (q, k))
    q = q * dk ** -0.5
    if cache is not None and t == 1:
      out, state = recurrent_delta_rule(q, k, v, g, beta, starts, state)
    else:
      out, state = chunked_delta_rule(q, k, v, g, beta, starts, state, self.chunk)
    out = out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + self.eps) * self.norm[...]
    out = (out * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
    y = self.o(constrain(out, ("batch", "length", "heads", "head_dim")))
    if cache is None:
      return y
    return y, (tuple(last for _, last in conved), state)


class GatedAttention(nnx.Module):
  """Qwen3-Next's full attention (the module docstring): ``q`` ``[d, heads, 2 head_dim]`` (each head's query, then
  its gate), k, v and o as Llama's, QK-norm per head, partial rotary."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d, n, kv, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kw = dict(dtype=dtype, param_dtype=jnp.float32, einsum_op=quantization.einsum(cfg.quantization), rngs=rngs)
    self.q = nnx.Einsum("btd,dnh->btnh", (d, n, 2 * h), kernel_init=_param(("embed", "heads", "head_dim")), **kw)
    self.k, self.v = (nnx.Einsum("btd,dnh->btnh", (d, kv, h), kernel_init=_param(("embed", "kv_heads", "head_dim")),
                                 **kw) for _ in range(2))
    self.o = nnx.Einsum("btnh,nhd->btd", (n, h, d), kernel_init=_param(("heads", "head_dim", "embed")), **kw)
    self.q_norm, self.k_norm = llama.norm(cfg, dtype, h, "head_dim"), llama.norm(cfg, dtype, h, "head_dim")
    self.freq = (int(h * cfg.partial_rotary_factor), float(cfg.rope_theta))
    self.backend, self.block_size = cfg.attention, cfg.attention_block_size

  def __call__(self, x, positions, segment_ids, cache=None, local=None):
    """As llama.Attention's: with a ``cache`` ``(k, v, slots)`` also the updated ``(k, v)``."""
    del local
    query, gate = jnp.split(self.q(x), 2, axis=-1)
    h = gate.shape[-1]
    freq = llama.rope_frequencies(*self.freq)
    # The scores' scale folded into q's rotation (as llama.Attention does), unless the backend scales by itself.
    folded = cache is not None or attention.takes_variants(self.backend)
    q = llama.rope(self.q_norm(query), positions, freq=freq, scale=h ** -0.5 if folded else 1.0)
    k, v = llama.rope(self.k_norm(self.k(x)), positions, freq=freq), self.v(x)
    variant = attention.Variant(scale=1.0) if folded else attention.PLAIN
    if cache is not None:
      k_cache, v_cache, slots = cache
      k, v = slots.write(k_cache, k), slots.write(v_cache, v)
      out = attention.attend_cached(q, slots.view(k), slots.view(v), segment_ids, positions, slots.kv_segment_ids,
                                    slots.kv_positions, variant)
    else:
      out = attention.attend(self.backend, q, k, v, segment_ids, positions, self.block_size, variant)
    out = out * jax.nn.sigmoid(gate)
    y = self.o(constrain(out, ("batch", "length", "heads", "head_dim")))
    return y if cache is None else (y, (k, v))


class SharedExpert(nnx.Module):
  """The shared SwiGLU expert of ``shared_mlp_dim``, its output times ``sigmoid(x w_g)`` (``gate`` ``[d, 1]``)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    self.mlp = llama.MLP(types.SimpleNamespace(d_model=cfg.d_model, mlp_dim=cfg.shared_mlp_dim,
                                               quantization=cfg.quantization), dtype, rngs)
    self.gate = nnx.Param(_param(("embed", None))(rngs.params(), (cfg.d_model, 1)))

  def __call__(self, x):
    return jax.nn.sigmoid(jnp.einsum("btd,do->bto", x, self.gate[...].astype(x.dtype))) * self.mlp(x)


class MoE(moe.MoE):
  """The ``moe`` family's softmax router and experts, with :class:`SharedExpert`."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    super().__init__(types.SimpleNamespace(**{**dict(cfg.items()), "num_shared_experts": 0,
                                              "router_scores": "softmax"}), dtype, rngs)
    self.shared = nnx.data(SharedExpert(cfg, dtype, rngs)) if cfg.shared_mlp_dim else None


class LinearBlock(moe.Block):
  attention_class = GatedDeltaNet
  moe_class = MoE


class FullBlock(moe.Block):
  attention_class = GatedAttention
  moe_class = MoE


class Group(nnx.Module):
  """One step of the layer scan: ``full_attention_every - 1`` DeltaNet layers (``linear``, a stack on the axis
  ``linear_layers``, scanned; None when every layer is a full-attention one), then a full-attention one (``full``)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    self.linear = (core.stacked(cfg, dtype, rngs, LinearBlock, cfg.full_attention_every - 1, "linear_layers")
                   if cfg.full_attention_every > 1 else None)
    self.full = FullBlock(cfg, dtype, rngs)
    self.size = cfg.full_attention_every

  def __call__(self, x, positions, segment_ids, cache=None, local=None):
    """``(x, aux losses, metrics)``, each the mean over the group's layers; with a ``cache`` ``(k, v, slots,
    (conv inputs, states))`` (the group's slices of :class:`HybridCache`) ``(x, (k, v, conv inputs, states))``."""
    del local
    graphdef = None if self.linear is None else nnx.graphdef(self.linear)
    if cache is not None:
      k, v, slots, linear = cache
      if graphdef is not None:
        x, linear = jax.lax.scan(lambda h, xs: nnx.merge(graphdef, xs[0])(h, positions, segment_ids, xs[1]), x,
                                 (nnx.state(self.linear), linear))
      x, (k, v) = self.full(x, positions, segment_ids, (k, v, slots))
      return x, (k, v, linear)
    extras = []
    if graphdef is not None:
      def layer(h, weights):
        h, aux, metrics = nnx.merge(graphdef, weights)(h, positions, segment_ids)
        return h, (aux, metrics)
      x, stacked = jax.lax.scan(layer, x, nnx.state(self.linear))
      extras.append(jax.tree.map(lambda a: jnp.sum(a, axis=0), stacked))
    x, aux, metrics = self.full(x, positions, segment_ids)
    aux, metrics = jax.tree.map(lambda *a: sum(a) / self.size, *extras, (aux, metrics))
    return x, aux, metrics


@dataclasses.dataclass(frozen=True)
class HybridCache(KVCache):
  """:class:`~jaxtrain.models.attention.KVCache` of the full-attention layers (``k``, ``v``: ``[layers / N, batch,
  max_len, kv_heads, head_dim]``) and the DeltaNet layers' own (``[layers / N, N - 1, batch, ...]``): ``conv``, the
  last ``linear_conv_kernel - 1`` inputs of the conv on q, k and v (compute dtype), and ``state``, the delta rule's
  ``[v_heads, dk, dv]`` (float32)."""
  conv: tuple = ()
  state: jax.Array | None = None


jax.tree_util.register_dataclass(HybridCache, data_fields=["k", "v", "segment_ids", "positions", "index", "conv",
                                                           "state"], meta_fields=[])


class Qwen3Next(moe.MoeLM):
  """The ``moe`` family's decoder (embedding, layer scan, head) over groups of layers (:class:`Group`)."""
  paged_cache = False  # its cache holds recurrent states beside the keys and values
  block = Group

  @staticmethod
  def moe_layer_count(cfg) -> int:
    return cfg.num_layers // cfg.full_attention_every

  @classmethod
  def init_cache(cls, cfg, batch: int, max_len: int) -> HybridCache:
    groups, linear, dtype = cfg.num_layers // cfg.full_attention_every, cfg.full_attention_every - 1, jnp.dtype(
        cfg.dtype)
    kv = KVCache.zeros(groups, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype)
    nk, nv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    lead = (groups, linear, batch, cfg.linear_conv_kernel - 1)
    conv = (jnp.zeros((*lead, nk, dk), dtype), jnp.zeros((*lead, nk, dk), dtype), jnp.zeros((*lead, nv, dv), dtype))
    return HybridCache(**{f.name: getattr(kv, f.name) for f in dataclasses.fields(KVCache)}, conv=conv,
                       state=jnp.zeros((groups, linear, batch, nv, dk, dv), jnp.float32))

  def _decode(self, tokens, positions, segment_ids, cache):
    slots = cache.write_slots(segment_ids, positions)
    graphdef = nnx.graphdef(self.layers)

    def group(h, xs):
      weights, k, v, linear = xs
      return nnx.merge(graphdef, weights)(h, positions, segment_ids, (k, v, slots, linear))

    x, (k, v, (conv, state)) = jax.lax.scan(group, llama.lookup(self.embed, tokens),
                                            (nnx.state(self.layers), cache.k, cache.v, (cache.conv, cache.state)))
    return self.head(x), dataclasses.replace(slots.advanced(k, v, tokens.shape[1]), conv=conv, state=state)


def activation_estimate(cfg, rows: int, seq_len: int, tensor: int, context: int = 1) -> dict[str, int]:
  """The ``moe`` family's estimate with the shared expert counted as one of ``expert_mlp_dim`` (every layer as an
  attention one; the DeltaNet's chunk matrices are not counted)."""
  return moe.activation_estimate(ml_collections.ConfigDict({**cfg.to_dict(), "num_shared_experts": 1}), rows,
                                 seq_len, tensor, context)


core.register("qwen3_next", core.Family(module=Qwen3Next, defaults=defaults, flops_per_token=flops_per_token,
                                          validate=validate, axis_keys=AXIS_KEYS,
                                          activation_estimate=activation_estimate, quantizable=True,
                                          context_parallel=False))

"""Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, scanned layer stack.

Knows only logical axis names; see jaxtrain/sharding.py for how they map onto the mesh.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.errors import ConfigError, check_positive
from jaxtrain.models import attention, core, fusion, quantization, scans
from jaxtrain.models.attention import KV_AXES, KVCache, attend, attend_cached
from jaxtrain.sharding import constrain, mesh_axes

_INIT = nnx.initializers.normal(0.02)


def defaults() -> dict:
  """The Llama family's own ``model`` keys (the shared ones are in jaxtrain.models)."""
  return dict(
      num_layers=2,
      d_model=64,
      num_heads=4,
      num_kv_heads=2,  # grouped-query attention: a divisor of num_heads
      head_dim=16,
      mlp_dim=256,
      tie_embeddings=False,
      rope_theta=10_000.0,
      # RoPE frequency scaling: "" (none) or "llama3" (Llama 3.1-3.3: low frequencies divided by
      # rope_scaling_factor, high ones kept, a smooth ramp between; as transformers' "llama3" rope_type)
      rope_scaling="",
      rope_scaling_factor=8.0,
      rope_low_freq_factor=1.0,
      rope_high_freq_factor=4.0,
      rope_original_max_positions=8192,
      norm_eps=1e-5,
      # Attention variants (off by default; the Qwen, Mistral and Gemma families set them: docs/models.md).
      qkv_bias=False,  # biases on the q, k, v projections (Qwen 2 / 2.5)
      qk_norm="",  # RMSNorm of queries and keys before RoPE: "" off | head (each head: Qwen 3, Gemma 3) | full
      # (the whole q and k projections: OLMoE, OLMo 2)
      sliding_window=0,  # local attention: a query sees the keys less than this many positions back; 0 = off
      global_every=0,  # with a window: every Nth layer (N-1, 2N-1, ...) global, the others local; 0 = all local
      attn_softcap=0.0,  # attention-logit soft-cap: scores -> c tanh(scores / c); 0 = off (Gemma 2)
      final_softcap=0.0,  # the same on the output logits; 0 = off (Gemma 2)
      query_scale=0.0,  # the scores' scale; 0 = 1 / sqrt(head_dim)
      rope_local_theta=0.0,  # the local layers' RoPE theta, unscaled (Gemma 3: 10000); 0 = rope_theta as global
      # Gemma's block (Gemma 2 / 3)
      norm_plus_one=False,  # RMSNorm scales by 1 + w (w initialized to 0) instead of w
      mlp_activation="silu",  # the gated MLP's activation: silu (SwiGLU) | gelu_tanh (GeGLU, tanh-approximate)
      embed_scale=False,  # the embeddings (not the tied head) multiplied by sqrt(d_model)
      sandwich_norms=False,  # an RMSNorm on the attention's and the MLP's outputs too, before the residual add
      # QK-clip (Kimi K2's MuonClip with optim.name=muon): after each applied update, every query head whose largest
      # logit in the step's batch passed this is scaled back to it (:func:`qk_clip`); 0: off, nothing measured
      qk_clip=0.0,
  )


ROPE_SCALINGS = ("", "llama3", "linear")
QK_NORMS = ("", "head", "full")
MLP_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def validate(cfg) -> None:
  check_positive({"model": cfg}, [f"model.{k}" for k in ("num_layers", "d_model", "num_heads", "num_kv_heads",
                                                          "head_dim", "mlp_dim")])
  if cfg.num_heads % cfg.num_kv_heads:
    raise ConfigError("model.num_kv_heads", f"{cfg.num_kv_heads} does not divide model.num_heads={cfg.num_heads}",
                      "grouped-query attention needs num_heads to be a multiple of num_kv_heads")
  check_positive({"model": cfg}, [f"model.{k}" for k in ("sliding_window", "global_every", "attn_softcap",
                                                          "final_softcap", "query_scale")], allow_zero=True)
  if cfg.global_every and not cfg.sliding_window:
    raise ConfigError("model.global_every", f"is {cfg.global_every} but model.sliding_window is 0 (no local layers)",
                      "set model.sliding_window, or global_every=0")
  check_positive({"model": cfg}, ["model.rope_local_theta"], allow_zero=True)
  if cfg.qk_norm not in QK_NORMS:
    raise ConfigError("model.qk_norm", f"'{cfg.qk_norm}' is not one of '' (off), head, full",
                      "set model.qk_norm to '', head or full")
  if cfg.mlp_activation not in MLP_ACTIVATIONS:
    raise ConfigError("model.mlp_activation", f"'{cfg.mlp_activation}' is not one of {', '.join(MLP_ACTIVATIONS)}",
                      "set model.mlp_activation to silu or gelu_tanh")
  if cfg.rope_scaling not in ROPE_SCALINGS:
    raise ConfigError("model.rope_scaling", f"'{cfg.rope_scaling}' is not one of '' (none), llama3, linear",
                      "set model.rope_scaling to '', llama3 or linear")
  if cfg.rope_scaling == "linear":
    check_positive({"model": cfg}, ["model.rope_scaling_factor"])
  if cfg.rope_scaling == "llama3":
    check_positive({"model": cfg}, [f"model.{k}" for k in ("rope_scaling_factor", "rope_low_freq_factor",
                                                            "rope_high_freq_factor", "rope_original_max_positions")])
    if cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor:
      raise ConfigError("model.rope_high_freq_factor", f"{cfg.rope_high_freq_factor} is not greater than "
                        f"model.rope_low_freq_factor={cfg.rope_low_freq_factor}",
                        "llama3 RoPE scaling needs high_freq_factor > low_freq_factor (Llama 3.1: 4 and 1)")


def flops_per_token(cfg, seq_len: int, abstract_params) -> float:
  """PaLM's formula (:func:`jaxtrain.models.dense_flops_per_token`), a local layer's attention term over its window
  of keys instead of the whole sequence."""
  weights = core.dense_flops_per_token(abstract_params, 0, num_layers=0, attention_width=0,
                                       tied_embeddings=cfg.tie_embeddings)
  keys = sum(min(seq_len, w) if w else seq_len for w in attention.layer_windows(cfg))
  return weights + 12 * cfg.num_heads * cfg.head_dim * keys


def activation_estimate(cfg, rows: int, seq_len: int, tensor: int, context: int = 1, *, routed_mlp: int = 0,
                        router: int = 0) -> dict[str, int]:
  """Per device, for ``rows`` local rows of one microbatch (tools/estimate.py states the assumptions): the
  activations kept for the backward pass, the largest transient on top of them, and the bytes of the tensor-parallel
  all-reduces (2 per layer forward, 2 backward, of the b x t x d residual stream) and of the context-parallel
  all-gathers of keys and values. With context parallelism a device holds ``seq_len / context`` tokens of each row
  and attends them to all ``seq_len`` keys. ``routed_mlp``: the part of ``mlp_dim`` a token gets from matmuls with
  a batch dimension (a MoE's routed experts: neither tagged by name nor kept by ``save_dots``, which keeps only
  matmul outputs without one); ``router``: the width (float32 elements per token) of one more matmul output
  ``save_dots`` keeps (a MoE's router logits)."""
  b, full, d, f = rows, seq_len, cfg.d_model, cfg.mlp_dim
  unrouted = (f - routed_mlp) // tensor  # the MLP width of matmuls without a batch dimension
  seq = full // context
  backend = cfg.attention  # a concrete backend (tools/estimate.py resolves auto for its target platform)
  heads, kv_heads = cfg.num_heads // tensor, cfg.num_kv_heads // tensor
  h, kv = heads * cfg.head_dim, kv_heads * cfg.head_dim
  act_bytes = jnp.dtype(cfg.dtype).itemsize
  per_layer = b * seq * d  # the layer's input
  # The tagged projections (models.ACTIVATION_NAMES), and what save_dots keeps: q, k, v, the attention output
  # projection, gate and up (down's output is not read by the backward: XLA drops it).
  width = {"query_proj": h, "key_proj": kv, "value_proj": kv, "out_proj": d, "mlp_gate": unrouted,
           "mlp_up": unrouted, "mlp_down": 0, core.LAYER_INPUT: d,
           "dots": h + 2 * kv + d + 2 * unrouted + router * 4 // act_bytes}  # (down: read by no backward)
  policy = core.REMAT.get(cfg.remat)
  saved = ("dots",) if policy is None else getattr(policy, "saved", ())
  offloaded = getattr(policy, "offloaded", ())
  per_layer += b * seq * sum(width[n] for n in saved)
  if core.LAYER_INPUT in offloaded:  # offload_full: the layer's input waits in host memory instead
    per_layer -= b * seq * d
  host_per_layer = b * seq * sum(width[n] for n in offloaded)
  if cfg.remat == "none":  # and every elementwise intermediate, and what the attention backend keeps
    per_layer += b * seq * (4 * d + 3 * f // tensor) + attention.saved_bytes(backend, b, heads, seq, full,
                                                                          act_bytes) // act_bytes
  # On top of them, the larger of two phases' transients. The head's, first in the backward pass: the logits and
  # their gradient (jaxtrain.train.losses: both in the compute dtype, 4 bytes a logit for bfloat16, read as float32
  # in one pass) and the full float32 gradient of the output projection before it is reduce-scattered (the
  # embedding's is summed into each device's own slice of the table under FSDP: llama.lookup). Then one layer at a
  # time: its attention backend's transient and its weights gathered in the compute dtype (and the next layer's,
  # prefetched).
  head = b * seq * cfg.vocab_size // tensor * 2 * act_bytes + cfg.vocab_size * d // tensor * 4
  layer_weights = (d * (2 * h + 2 * kv) + 3 * d * f // tensor + 2 * d) * act_bytes
  layer = max(attention.transient_bytes(backend, b, heads, seq, full, cfg.attention_block_size, act_bytes, window)
              for window in set(attention.layer_windows(cfg)))  # local and global layers: the larger
  transient = max(head, layer + 2 * layer_weights)
  kv_gathers = 3 if cfg.remat != "none" else 2  # forward, the backward's recompute, the gradients' reduce-scatter
  return {"activation_bytes": cfg.num_layers * per_layer * act_bytes, "transient_bytes": transient,
          "host_activation_bytes": cfg.num_layers * host_per_layer * act_bytes,
          "tensor_allreduce_bytes": 4 * cfg.num_layers * b * seq * d * act_bytes,
          "context_allgather_bytes": kv_gathers * cfg.num_layers * b * full * 2 * kv * act_bytes}


AXIS_KEYS = {"embed": "d_model", "heads": "num_heads", "kv_heads": "num_kv_heads", "head_dim": "head_dim",
             "mlp": "mlp_dim", "vocab": "vocab_size", "layers": "num_layers"}


def _param(names):
  return nnx.with_partitioning(_INIT, names)


def yarn_defaults(scaling: str, factor: float, original_max_positions: int, truncate: bool) -> dict:
  """A family's YaRN keys for its defaults (:class:`Yarn`'s: DeepSeek-V3's, GPT-OSS's): ``rope_scaling`` ("" (none)
  or yarn), the factor over the original positions, the ramp's betas (32 and 1) and ``rope_yarn_truncate``
  (transformers' ``truncate``: the ramp's ends rounded to whole dims)."""
  return dict(rope_scaling=scaling, rope_scaling_factor=factor, rope_original_max_positions=original_max_positions,
              rope_yarn_beta_fast=32.0, rope_yarn_beta_slow=1.0, rope_yarn_truncate=truncate)


class Yarn(NamedTuple):
  """YaRN RoPE scaling (Peng et al. 2023, arXiv:2309.00071) as transformers' ``_compute_yarn_parameters`` computes
  it: frequencies interpolated (divided by ``factor``) below a ramp between the dims that rotate ``beta_slow`` and
  ``beta_fast`` times over ``original`` positions, extrapolated (kept) above it; cos and sin scaled by
  :meth:`attention_factor` (so the scores by its square). DeepSeek's form (``mscale``, ``mscale_all_dim``; 0 = unset)
  changes that factor and scales the softmax too (:meth:`softmax_factor`; jaxtrain/models/deepseek_v3)."""
  factor: float
  beta_fast: float
  beta_slow: float
  original: int
  truncate: bool
  mscale: float = 0.0
  mscale_all_dim: float = 0.0

  def _mscale(self, m: float = 1.0) -> float:
    return 0.1 * m * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

  @property
  def attention_factor(self) -> float:
    """cos and sin's factor: ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set (DeepSeek:
    1 when they are equal), else ``0.1 ln(factor) + 1`` (transformers' ``_compute_yarn_parameters``)."""
    if self.mscale and self.mscale_all_dim:
      return self._mscale(self.mscale) / self._mscale(self.mscale_all_dim)
    return self._mscale()

  @property
  def softmax_factor(self) -> float:
    """What the softmax scale is multiplied by: ``mscale(factor, mscale_all_dim)^2`` when ``mscale_all_dim`` is set
    (transformers' ``yarn_apply_mscale`` of DeepSeek), else 1."""
    return self._mscale(self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

  def frequencies(self, head_dim: int, theta: float):
    def dim_of(rotations):  # the dim that rotates this many times over the original context
      return head_dim * math.log(self.original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    base = theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    extrapolated = 1 - jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    return (1.0 / (self.factor * base)) * (1 - extrapolated) + (1.0 / base) * extrapolated


def rope_frequencies(head_dim: int, theta: float, scaling: tuple[float, float, float, int] | None = None):
  """The ``head_dim // 2`` rotary frequencies (float32). ``scaling``: ``(factor, low_freq_factor,
  high_freq_factor, original_max_positions)`` of Llama 3's scheme, computed as transformers'
  ``_compute_llama3_parameters`` does: wavelengths longer than ``original / low_freq_factor`` are divided by
  ``factor``, those shorter than ``original / high_freq_factor`` kept, and those between interpolated."""
  half = head_dim // 2
  if isinstance(scaling, Yarn):
    return scaling.frequencies(head_dim, theta)
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if scaling is None:
    return freq
  if isinstance(scaling, float):  # linear: every frequency divided by the factor (position interpolation)
    return freq / scaling
  factor, low, high, original = scaling
  wavelen = 2 * jnp.pi / freq
  scaled = jnp.where(wavelen > original / low, freq / factor, freq)
  smooth = (original / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < original / high) & ~(wavelen > original / low)
  return jnp.where(medium, smoothed, scaled)


def rope_scaling(cfg) -> tuple[float, float, float, int] | float | None:
  """The ``scaling`` argument of :func:`rope` for the model group ``cfg`` (None without RoPE scaling; linear
  scaling: its factor)."""
  if not cfg.get("rope_scaling"):
    return None
  if cfg.rope_scaling == "linear":
    return float(cfg.rope_scaling_factor)
  if cfg.rope_scaling == "yarn":  # (the keys of jaxtrain/models/gpt_oss)
    return Yarn(float(cfg.rope_scaling_factor), float(cfg.rope_yarn_beta_fast), float(cfg.rope_yarn_beta_slow),
                int(cfg.rope_original_max_positions), bool(cfg.rope_yarn_truncate),
                float(cfg.get("rope_yarn_mscale", 0.0)), float(cfg.get("rope_yarn_mscale_all_dim", 0.0)))
  return (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
          cfg.rope_original_max_positions)


def rope(x: jax.Array, positions: jax.Array, theta: float | None = None,
         scaling: tuple[float, float, float, int] | float | None = None, *, freq: jax.Array | None = None,
         scale: float = 1.0) -> jax.Array:
  """Rotary embedding of x [batch, length, heads, head_dim] at integer positions [batch, length]: the head_dim
  is split in halves (x1, x2) rotated pairwise, the convention of Hugging Face's ``rotate_half`` (so HF Llama
  q/k weights need no permutation). ``scaling``: see :func:`rope_frequencies`; ``freq``: the frequencies
  themselves, instead of ``theta`` and ``scaling``; ``scale``: multiplies the result, folded into the rotation's
  cos and sin (the queries' attention scale, at no cost of its own; every platform alike). ``cos x scale`` is
  rounded to x's dtype once, as ``cos`` is: within the rounding of rotating and then scaling, and bitwise that for
  a power-of-two scale (head_dim 64 or 256: ``tests/test_models.py``). Fewer ``freq`` than half the head_dim:
  partial rotary (GLM-4.5's ``partial_rotary_factor``, as transformers' ``apply_rotary_pos_emb``): the first
  ``2 len(freq)`` dims are rotated (their halves paired), the rest pass times ``scale``."""
  freq = rope_frequencies(x.shape[-1], theta, scaling) if freq is None else freq
  if 2 * freq.shape[-1] < x.shape[-1]:
    turned, rest = x[..., :2 * freq.shape[-1]], x[..., 2 * freq.shape[-1]:]
    return jnp.concatenate([rope(turned, positions, freq=freq, scale=scale),
                            rest if scale == 1.0 else rest * jnp.asarray(scale, x.dtype)], axis=-1)
  angle = positions[..., None].astype(jnp.float32) * freq  # [b, t, half], float32: exact up to 2^24 positions
  # The rotation itself in x's dtype, as transformers (and MaxText) compute it: for bfloat16 no float32 copies of
  # q and k (forward, and their gradients backward) for XLA to write.
  sin, cos = ((f(angle) * scale)[:, :, None, :].astype(x.dtype) for f in (jnp.sin, jnp.cos))
  if x.dtype == jnp.bfloat16 and attention.target_platform() == "tpu":
    # rotate_half(x) = (-x2, x1) as a matmul with a signed permutation (exact: one +-1 per column, float32
    # accumulation): on TPU the MXU moves the halves, and q and k stay whole 128-lane rows that the projections
    # write in the attention kernel's layout. Split into 64-wide halves, the compiler stores q and k sequence-minor
    # and copies them twice into the kernel's layout (Llama 3 8B: -0.35 ms a layer on v5p, for 0.4% more FLOPs).
    half = x.shape[-1] // 2
    rotation = np.zeros((2 * half, 2 * half), np.float32)
    rotation[np.arange(half) + half, np.arange(half)] = -1
    rotation[np.arange(half), np.arange(half) + half] = 1
    # Heads as the matmul's batch dimension: remat policies that keep matmuls without one (save_dots) do not keep
    # this rotation's output, which the backward pass never reads.
    rotation = jnp.broadcast_to(jnp.asarray(rotation, x.dtype), (x.shape[2], *rotation.shape))
    rotated = jnp.einsum("btnh,nhk->btnk", x, rotation, preferred_element_type=x.dtype)
    return x * jnp.concatenate([cos, cos], -1) + rotated * jnp.concatenate([sin, sin], -1)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_rows(table, tokens, dtype):
  """``table[tokens]`` in ``dtype``: the table cast first, so the gathered rows are read and written in the compute
  dtype (Llama 3 8B on v5p-128, a float32 gather and its layout copies: 0.7 ms of the step's estimate), bitwise the
  float32 rows cast (a gather copies values; the cast is elementwise). The gradient is summed in float32 all the
  same (a token seen a thousand times in a batch adds a thousand rows, which bfloat16 would round). Ids are clamped
  into the table (XLA's gather does that itself: no select): the global batch is checked for ids outside
  ``model.vocab_size`` where it is assembled (jaxtrain.data), and :func:`lookup` clamps the same way on every path,
  so no program, on any platform or layout, reads another row than another does for any id."""
  return jnp.take(table.astype(dtype), tokens, axis=0, mode="clip")


def _take_rows_forward(table, tokens, dtype):
  return _take_rows(table, tokens, dtype), (table, tokens)


def _take_rows_backward(dtype, residuals, g):
  table, tokens = residuals  # (the table itself: only its shape and sharding are read)
  rows = jax.vjp(lambda t: jnp.take(t, tokens, axis=0, mode="clip"), table)[1]
  return rows(g.astype(table.dtype))[0], None


_take_rows.defvjp(_take_rows_forward, _take_rows_backward)


def lookup(embed: nnx.Embed, tokens, where_the_table_is: bool = True):
  """The token embeddings ``[batch, length, embed]`` in the embedding's compute dtype.

  With the table's embed dim split over mesh axes that also split the batch (FSDP), each device holds a slice of
  every row, so the lookup is done where the table is: the token ids are all-gathered over those axes (4 bytes a
  token), each device looks its slice up for all of them, and one all-to-all gives each device its own tokens' rows
  whole (b x t x d bytes in the compute dtype). The gradient goes back the same way and is summed into each
  device's own slice of the table: neither the table (Llama 3 8B: 1 GB in bfloat16) nor its float32 gradient is
  ever gathered or all-reduced whole. A table split over ``vocab`` (tensor parallelism) looks up the ids in its
  range and sums the parts over those axes. Otherwise (the table's embed dim whole: data parallelism) the local
  tokens' rows are read from the table.

  Every platform takes the same path for a layout (Llama 3 8B on v5p-128: 11.8 GB and 4.9 ms less per step than
  the gathered table, benchmarks/NOTES.md), so that no platform sums the table's gradient in another order than
  another: the two paths' gradients differ by float32 summation order for ids seen on several devices, and a
  training run carries such a difference on (benchmarks/NOTES.md, "The TPU program's numerics on the CPU mesh").
  ``where_the_table_is=False``: the gathered table whatever the layout (tests compare the two). Every path gives the
  same rows and, within float32 summation order, the same gradient for every id: ``table[clip(id, 0, vocab - 1)]``
  (:func:`_take_rows`)."""
  table = embed.embedding[...]
  mesh = jax.sharding.get_abstract_mesh()
  if where_the_table_is and not mesh.empty:
    from flax import linen as nn  # the rules context's resolver, as jaxtrain.sharding.constrain uses
    vocab_axes, embed_axes = (mesh_axes(e) for e in nn.logical_to_mesh_axes(("vocab", "embed")))
    vocab_axes = tuple(a for a in vocab_axes if mesh.shape[a] > 1)  # (an axis of 1 splits nothing: no masking)
    batch_axes, length_axes = (mesh_axes(e) for e in nn.logical_to_mesh_axes(("batch", "length")))
    if embed_axes and all(a in batch_axes for a in embed_axes) and any(mesh.shape[a] > 1 for a in embed_axes):
      return _lookup_where_the_table_is(table, tokens, embed.dtype, embed_axes, vocab_axes, batch_axes, length_axes)
  return constrain(_take_rows(constrain(table, ("vocab", None)), tokens, embed.dtype), ("batch", "length", "embed"))


def _lookup_where_the_table_is(table, tokens, dtype, shared, vocab_axes, batch_axes, length_axes):
  from jax.sharding import PartitionSpec as P

  def spec(*entries):
    return P(*[(e if len(e) > 1 else e[0]) if e else None for e in entries])

  vocab = table.shape[0]

  def local(table, tokens):
    ids = jax.lax.all_gather(tokens, shared, axis=0, tiled=True)  # [b x n, t]: every token of the n devices
    if vocab_axes:  # this device's rows are [first, first + rows) of the vocabulary
      ids = jnp.clip(ids, 0, vocab - 1)  # as a gather from the whole table clamps (_take_rows): one owner per id
      rows = table.shape[0]
      first = jax.lax.axis_index(vocab_axes) * rows
      mine = (ids >= first) & (ids < first + rows)
      found = jnp.where(mine[..., None], _take_rows(table, jnp.where(mine, ids - first, 0), dtype), 0)
      found = jax.lax.psum(found, vocab_axes)
    else:
      found = _take_rows(table, ids, dtype)  # [b x n, t, d / n]
    # Exchanged as n leading blocks (block i of the result: device i's slice of the embed dim for this device's
    # tokens), then put in column order. The backward pass then sends the gradient's column blocks from one
    # chunk-major copy; exchanged along the embed dim itself, the TPU compiler wrote two transposing copies for it
    # (Llama 3 8B on v5p-128: 0.4 ms a step less, benchmarks/NOTES.md).
    n = found.shape[0] // tokens.shape[0]
    blocks = jax.lax.all_to_all(found.reshape(n, -1, *found.shape[1:]), shared, 0, 0, tiled=True)
    return jnp.moveaxis(blocks, 0, 2).reshape(*blocks.shape[1:3], -1)  # [b, t, d]

  return jax.shard_map(local, in_specs=(spec(vocab_axes, shared), spec(batch_axes, length_axes)),
                       out_specs=spec(batch_axes, length_axes, ()))(table, tokens)


class RMSNorm(nnx.Module):
  """RMSNorm in float32 over the trailing ``dim`` (an int, or a shape: several trailing axes normalized together),
  scaled by ``w`` (or by ``1 + w``, Gemma's, with ``w`` initialized to 0). ``axis``: the logical name(s) of ``w``."""

  def __init__(self, dim: int | tuple[int, ...], eps: float, dtype, axis: str | tuple[str, ...] = "embed",
               plus_one: bool = False):
    shape, names = (dim, axis) if isinstance(dim, tuple) else ((dim,), (axis,))
    init = jnp.zeros if plus_one else jnp.ones
    self.scale = nnx.Param(init(shape, jnp.float32), out_sharding=names)
    self.eps, self.dtype, self.plus_one = eps, dtype, plus_one

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    axes = tuple(range(-self.scale.ndim, 0))
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + self.eps)
    return (y * (1.0 + self.scale[...] if self.plus_one else self.scale[...])).astype(self.dtype)


def norm(cfg, dtype, dim: int | tuple[int, ...] | None = None, axis: str | tuple[str, ...] = "embed") -> RMSNorm:
  """The family's RMSNorm over ``dim`` (default d_model)."""
  return RMSNorm(dim or cfg.d_model, cfg.norm_eps, dtype, axis, bool(cfg.get("norm_plus_one")))


class Attention(nnx.Module):
  """Grouped-query attention with RoPE. GPT-OSS's keys (jaxtrain/models/gpt_oss): ``out_bias`` (a bias on the output
  projection), ``attention_sinks`` (a learned logit per head in the softmax: jaxtrain/models/attention.py), YaRN
  RoPE (:class:`Yarn`). GLM-4.5's (jaxtrain/models/glm4_moe): ``partial_rotary_factor`` (RoPE on the first part of
  each head only: :func:`rope`)."""

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    kw = dict(dtype=dtype, param_dtype=jnp.float32, einsum_op=quantization.einsum(cfg.quantization), rngs=rngs)

    def proj(heads, names):
      bias = dict(bias_shape=(heads, h), bias_init=nnx.with_partitioning(nnx.initializers.zeros, names[1:]))
      return nnx.Einsum("btd,dnh->btnh", (d, heads, h), kernel_init=_param(names),
                        **(bias if cfg.get("qkv_bias") else {}), **kw)
    self.q = proj(n, ("embed", "heads", "head_dim"))
    self.k = proj(k, ("embed", "kv_heads", "head_dim"))
    self.v = proj(k, ("embed", "kv_heads", "head_dim"))
    out_bias = dict(bias_shape=(d,), bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))
    self.o = nnx.Einsum("btnh,nhd->btd", (n, h, d), kernel_init=_param(("heads", "head_dim", "embed")),
                        **(out_bias if cfg.get("out_bias") else {}), **kw)
    self.sinks = nnx.Param(_param(("heads",))(rngs.params(), (n,))) if cfg.get("attention_sinks") else None
    self.q_norm, self.k_norm = {
        "head": lambda: (norm(cfg, dtype, h, "head_dim"), norm(cfg, dtype, h, "head_dim")),
        "full": lambda: (norm(cfg, dtype, (n, h), ("heads", "head_dim")),
                         norm(cfg, dtype, (k, h), ("kv_heads", "head_dim"))),
    }.get(cfg.get("qk_norm") or "", lambda: (None, None))()
    self.theta, self.scaling, self.backend = cfg.rope_theta, rope_scaling(cfg), cfg.attention
    # YaRN scales cos and sin (both q and k) by its attention factor; folded into their rotations.
    self.rope_scale = self.scaling.attention_factor if isinstance(self.scaling, Yarn) else 1.0
    self.local_theta = cfg.get("rope_local_theta", 0.0)  # local layers: this theta, unscaled (0: as global ones)
    # The dims RoPE turns, the first of each head (GLM-4.5's partial_rotary_factor; the rest pass: see rope).
    self.rotary_dim = int(h * cfg.get("partial_rotary_factor", 1.0))
    self.block_size = cfg.attention_block_size
    windows = sorted(set(attention.layer_windows(cfg)))
    self.window = windows[-1]  # the local layers' window (0: none)
    self.chunk = max(attention.layer_chunks(cfg))  # the local layers' attention chunk (0: none; Llama 4)
    self.mixed = attention.mixed_layers(cfg)
    variant = attention.variant(cfg)
    self.softcap, self.scale = variant.softcap, variant.scale
    self.qk_clip = bool(cfg.get("qk_clip"))  # sow each head's largest logit (attention.max_logits) for QK-clip

  def __call__(self, x, positions, segment_ids, cache=None, local=None):
    """``cache``: None (training), or ``(k, v, slots)`` for decoding: this layer's cached keys and values ``[batch,
    max_len, kv_heads, head_dim]`` and the KVCache whose segment ids and positions already hold the new tokens;
    the new keys and values are written (``slots.write``: at ``slots.index``, or to a paged cache's pages) and the
    queries attend over the cache (``slots.view``). ``local``: in a
    stack that interleaves local and global layers, whether this one is local (a traced bool: the layer scan's
    input); otherwise every layer is the same kind and it is None. Returns the output, and with a cache also the
    updated ``(k, v)``."""
    # The projections are tagged for remat policies that keep them by name (models.ACTIVATION_NAMES).
    q, k, v = self.q(x), self.k(x), self.v(x)
    q, k = checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj")
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    freq = rope_frequencies(self.rotary_dim, self.theta, self.scaling)
    if self.local_theta and self.window:  # local layers rotate at their own theta
      local_freq = rope_frequencies(self.rotary_dim, self.local_theta)
      freq = local_freq if not self.mixed else jnp.where(local, local_freq, freq)
    # The scores' scale is applied to the queries in their rotation, where it costs nothing, and the backends then
    # scale by 1 (the TPU cost model prices a separate q x scale at 0.08 ms a layer of Llama 3 8B on v6e); a
    # backend registered without variants scales by 1 / sqrt(head_dim) itself, so its queries are left unscaled.
    scale = self.scale
    if attention.takes_variants(self.backend):
      q_scale, scale = attention.Variant(scale=self.scale).scale_for(q.shape[-1]), 1.0
    else:
      q_scale = 1.0
    q, k = self.rotate(q, k, positions, freq, q_scale, local)
    sinks = None if self.sinks is None else self.sinks[...]
    q = constrain(q, ("batch", "length", "heads", "head_dim"))
    k = constrain(k, ("batch", "length", "kv_heads", "head_dim"))
    v = constrain(checkpoint_name(v, "value_proj"), ("batch", "length", "kv_heads", "head_dim"))
    if cache is not None:
      k_cache, v_cache, slots = cache
      k, v = slots.write(k_cache, k), slots.write(v_cache, v)
      window, chunk = ((self.window, self.chunk) if local is None else
                       (jnp.where(local, self.window, 0), jnp.where(local, self.chunk, 0)))
      out = attend_cached(q, slots.view(k), slots.view(v), segment_ids, positions, slots.kv_segment_ids,
                          slots.kv_positions, attention.Variant(window, self.softcap, scale, chunk), sinks)
      return self.o(constrain(out, ("batch", "length", "heads", "head_dim"))), (k, v)

    if self.qk_clip:  # the logits before any soft-cap, over what each layer's kind lets a query see
      window, chunk = ((self.window, self.chunk) if local is None else
                       (jnp.where(local, self.window, 0), jnp.where(local, self.chunk, 0)))
      core.sow_max_logit(self, attention.max_logits(q, k, segment_ids, positions,
                                                    attention.Variant(window, 0.0, scale, chunk), self.block_size))

    def run(window, chunk):  # causal, never across documents
      return attend(self.backend, q, k, v, segment_ids, positions, self.block_size,
                    attention.Variant(window, self.softcap, scale, chunk), sinks)
    if self.mixed and local is None:
      raise ValueError("a stack of local and global layers passes each layer's kind (local=) to its attention")
    # Interleaved local and global layers: both kinds compiled, one run per layer (each keeps its own shape of
    # work: a local layer's blockwise or splash attention skips the keys outside its window).
    out = (jax.lax.cond(local, lambda: run(self.window, self.chunk), lambda: run(0, 0)) if self.mixed
           else run(self.window, self.chunk))
    return checkpoint_name(self.o(constrain(out, ("batch", "length", "heads", "head_dim"))), "out_proj")

  def rotate(self, q, k, positions, freq, q_scale, local):
    """q and k turned by RoPE at ``freq``, the queries times ``q_scale`` (the scores' scale, folded into their
    rotation). ``local``: see :meth:`__call__` (a family's own rotation reads it: jaxtrain/models/llama4)."""
    del local
    if self.rope_scale != 1.0:
      return rope(q, positions, freq=freq, scale=q_scale * self.rope_scale), rope(k, positions, freq=freq,
                                                                                  scale=self.rope_scale)
    return rope(q, positions, freq=freq, scale=q_scale), rope(k, positions, freq=freq)


class MLP(nnx.Module):
  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    kw = dict(use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
              dot_general=quantization.dot_general(cfg.quantization))
    self.gate = nnx.Linear(cfg.d_model, cfg.mlp_dim, kernel_init=_param(("embed", "mlp")), **kw)
    self.up = nnx.Linear(cfg.d_model, cfg.mlp_dim, kernel_init=_param(("embed", "mlp")), **kw)
    self.down = nnx.Linear(cfg.mlp_dim, cfg.d_model, kernel_init=_param(("mlp", "embed")), **kw)
    self.activation = MLP_ACTIVATIONS[getattr(cfg, "mlp_activation", "silu")]

  def __call__(self, x):
    gate, up = checkpoint_name(self.gate(x), "mlp_gate"), checkpoint_name(self.up(x), "mlp_up")
    h = constrain(self.activation(gate) * up, ("batch", "length", "mlp"))
    if attention.target_platform() == "tpu":  # not fused into the down projection, nor its gradient into gate's
      h = fusion.materialize(h)
    return checkpoint_name(self.down(h), "mlp_down")


class Block(nnx.Module):
  attention_class = Attention  # the attention (a family's own: jaxtrain/models/llama4)

  def __init__(self, cfg, dtype, rngs: nnx.Rngs):
    self.attn_norm = norm(cfg, dtype)
    self.attn = self.attention_class(cfg, dtype, rngs)
    self.mlp_norm = norm(cfg, dtype)
    self.mlp = MLP(cfg, dtype, rngs)
    # Gemma's sandwich: the attention's and the MLP's outputs normalized too, before the residual add.
    self.post_attn_norm, self.post_mlp_norm = ((norm(cfg, dtype), norm(cfg, dtype)) if cfg.get("sandwich_norms")
                                               else (None, None))

  def _post(self, norm_, y):
    return y if norm_ is None else norm_(y)

  def __call__(self, x, positions, segment_ids, cache=None, local=None):
    """With a ``cache`` (see Attention) returns ``(x, (k, v))``. ``local``: see Attention."""
    if cache is not None:
      attn, kv = self.attn(self.attn_norm(x), positions, segment_ids, cache, local)
      x = x + self._post(self.post_attn_norm, attn)
      x = x + self._post(self.post_mlp_norm, self.mlp(self.mlp_norm(x)))
      return constrain(x, ("batch", "length", "embed")), kv
    x = x + self._post(self.post_attn_norm, self.attn(self.attn_norm(x), positions, segment_ids, local=local))
    x = x + self._post(self.post_mlp_norm, self.mlp(self.mlp_norm(x)))
    return constrain(x, ("batch", "length", "embed"))


class Llama(nnx.Module):
  # Decodes with any cache of the slots API (attention.KVCache's docstring), a paged one included (continuous
  # batching: jaxtrain.sampling.ContinuousGenerator).
  paged_cache = True

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                           embedding_init=_param(("vocab", "embed")), rngs=rngs)
    self.layers = core.stacked(cfg, dtype, rngs, Block, cfg.num_layers)
    self.final_norm = norm(cfg, dtype)
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=jnp.float32,
        kernel_init=_param(("embed", "vocab")), rngs=rngs)
    self.remat = cfg.remat
    self.embed_scale = cfg.d_model ** 0.5 if cfg.get("embed_scale") else None
    self.final_softcap = float(cfg.get("final_softcap", 0.0))
    # Interleaved local and global layers: each layer's kind is an input of the layer scan (None: all alike).
    self.local = (tuple(bool(w) for w in attention.layer_windows(cfg)) if attention.mixed_layers(cfg) else None)

  def embed_tokens(self, tokens, positions=None, segment_ids=None):
    del positions, segment_ids  # RoPE: positions enter in attention
    x = lookup(self.embed, tokens)
    if self.embed_scale is not None:  # Gemma: sqrt(d_model), rounded to the compute dtype as transformers does
      x = x * jnp.asarray(self.embed_scale, x.dtype)
    return x

  def apply_layer(self, weights, x, side, local=None):
    """One layer of the stack ``self.layers`` (``weights``: its slice of the stacked state) on x, with
    side = (positions, segment_ids) and ``local`` (see Attention). Rematerialized per ``model.remat``."""
    return self.layer_with_maxima(weights, x, side, local)[0]

  def layer_with_maxima(self, weights, x, side, local=None):
    """:meth:`apply_layer`'s ``x`` and the maxima the layer sowed (core.capturing_maxima: QK-clip's)."""
    graphdef = nnx.graphdef(self.layers)

    def layer(w, h, side, local):
      return core.capturing_maxima(nnx.merge(graphdef, w), "layers/", h, *side, local=local)
    return core.remat_layer(layer, self.remat)(weights, x, side, local)

  def head(self, x):
    x = self.final_norm(x)
    if attention.target_platform() == "tpu":  # its backward not fused into the head's input gradient
      x = fusion.cotangent_barrier(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    if self.final_softcap:  # Gemma 2: c tanh(logits / c), in float32
      logits = (self.final_softcap * jnp.tanh(logits.astype(jnp.float32) / self.final_softcap)).astype(logits.dtype)
    return constrain(logits, ("batch", "length", "vocab"))  # in the compute dtype: see jaxtrain.train.losses

  def layer_kinds(self):
    """The layer scan's per-layer input besides the weights: each layer's ``local`` flag (a bool array), or None
    when all layers are alike."""
    return None if self.local is None else jnp.asarray(self.local)

  def __call__(self, tokens, positions, segment_ids, cache: KVCache | None = None):
    """Logits ``[batch, length, vocab]``; with a ``cache`` (decoding, see jaxtrain/models), ``(logits, cache)``:
    the tokens' keys and values are written at ``cache.index`` and they attend over the cache."""
    if cache is not None:
      return self._decode(tokens, positions, segment_ids, cache)
    x = self.embed_tokens(tokens, positions)
    stacked = nnx.state(self.layers)
    x, maxima = jax.lax.scan(lambda h, xs: self.layer_with_maxima(xs[0], h, (positions, segment_ids), xs[1]), x,
                             (stacked, self.layer_kinds()), unroll=scans.unroll())
    return core.Output(self.head(x), maxima=maxima) if maxima else self.head(x)

  @classmethod
  def init_cache(cls, cfg, batch: int, max_len: int) -> KVCache:
    """An empty cache of ``max_len`` slots per row (keys and values in the compute dtype)."""
    return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))

  def _decode(self, tokens, positions, segment_ids, cache):
    """A forward with a ``cache`` (an attention.KVCache or PagedKVCache: the slots API of KVCache's docstring)."""
    slots = cache.write_slots(segment_ids, positions)
    graphdef = nnx.graphdef(self.layers)
    stacked_axes = (None, *KV_AXES)  # the layer stack of keys or values: never split over pipeline stages here

    def layer(h, weights, k, v, local):
      return nnx.merge(graphdef, weights)(h, positions, segment_ids, (k, v, slots), local)

    x = self.embed_tokens(tokens, positions)
    k, v = constrain(cache.k, stacked_axes), constrain(cache.v, stacked_axes)
    x, (k, v) = slots.scan_layers(layer, x, nnx.state(self.layers), k, v, self.layer_kinds())
    return self.head(x), slots.advanced(constrain(k, stacked_axes), constrain(v, stacked_axes), tokens.shape[1])


def qk_clip(cfg, params, maxima, keep):
  """QK-clip of grouped-query attention (Kimi K2's rule, arXiv:2507.20534, for heads that share their keys): a head
  whose largest logit ``S`` passed ``model.qk_clip`` (``g`` = threshold / S, :func:`core.clipped_heads`) has its
  query's weights and bias scaled by ``g``, so that every logit of the head is ``g`` times what it was; the keys,
  shared by a group of query heads, and the values are left alone, and every other head bitwise as it was."""
  params, heads = core.clipped_heads(cfg, params, maxima, keep)
  for attn, gain in heads:  # gain: [layers, heads]; q's kernel [layers, embed, heads, head_dim], bias [.., heads, ..]
    attn["q"]["kernel"] = attn["q"]["kernel"] * gain[:, None, :, None]
    if "bias" in attn["q"]:
      attn["q"]["bias"] = attn["q"]["bias"] * gain[..., None]
  return params


core.register("llama", core.Family(module=Llama, defaults=defaults, flops_per_token=flops_per_token,
                                     validate=validate, axis_keys=AXIS_KEYS,
                                     activation_estimate=activation_estimate, quantizable=True, qk_clip=qk_clip))

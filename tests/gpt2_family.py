"""A GPT-2 model family registered from outside the package, complete: learned absolute positions, LayerNorm with
bias, GELU MLP with biases, multi-head attention (q, k, v one fused projection, as GPT-2's ``c_attn``), tied
embeddings; its own config keys, checks and FLOPs, an auxiliary loss (PaLM's z-loss on the logits, weighted by
``model.z_loss_weight``) and a metric, KV-cache decoding, and its Hugging Face adapter (``model_type`` gpt2,
``GPT2LMHeadModel``). Nothing under jaxtrain/ knows about it: importing this module registers the family and the
adapter (tests/test_gpt2_family.py trains, generates, imports and exports it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain import models
from jaxtrain.errors import ConfigError
from jaxtrain.models import hf_adapter
from jaxtrain.models.attention import KVCache, attend, attend_cached, write_kv
from jaxtrain.models.hf_adapter import HFError, Tensor
from jaxtrain.sharding import constrain

_INIT = nnx.initializers.normal(0.02)


def _param(names):
  return nnx.with_partitioning(_INIT, names)


def defaults() -> dict:
  return dict(num_layers=2, d_model=64, num_heads=4, mlp_dim=256, n_positions=1024, norm_eps=1e-5,
              z_loss_weight=1e-4)


def validate(cfg) -> None:
  if cfg.d_model % cfg.num_heads:
    raise ConfigError("model.num_heads", f"{cfg.num_heads} does not divide model.d_model={cfg.d_model}",
                      "choose a divisor")


def flops_per_token(cfg, seq_len, abstract_params) -> float:
  return models.dense_flops_per_token(abstract_params, seq_len, num_layers=cfg.num_layers,
                                      attention_width=cfg.d_model, tied_embeddings=True)


def _layer_norm(cfg, dtype, rngs):
  return nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=jnp.float32, rngs=rngs,
                       scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                       bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)))


class Block(nnx.Module):
  def __init__(self, cfg, dtype, rngs):
    d, n = cfg.d_model, cfg.num_heads
    h = d // n
    kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    self.ln_1 = _layer_norm(cfg, dtype, rngs)
    self.c_attn = nnx.Einsum("btd,dcnh->btcnh", (d, 3, n, h), (3, n, h),  # q, k, v: [.., 3, heads, head_dim]
                             kernel_init=_param(("embed", None, "heads", "head_dim")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, (None, "heads", "head_dim")), **kw)
    self.o = nnx.Einsum("btnh,nhd->btd", (n, h, d), (d,), kernel_init=_param(("heads", "head_dim", "embed")),
                        bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), **kw)
    self.ln_2 = _layer_norm(cfg, dtype, rngs)
    self.fc = nnx.Linear(d, cfg.mlp_dim, kernel_init=_param(("embed", "mlp")),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)), **kw)
    self.proj = nnx.Linear(cfg.mlp_dim, d, kernel_init=_param(("mlp", "embed")),
                           bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), **kw)
    self.backend = cfg.attention

  def __call__(self, x, positions, segment_ids, cache=None):
    """``cache``: None (training: absolute positions were added at the embedding, attention is causal by order), or
    ``(k, v, slots)`` for decoding (jaxtrain/models/core.py): the new keys and values are written at
    ``slots.index``, the queries attend over the cache, and ``(x, (k, v))`` is returned."""
    qkv = self.c_attn(self.ln_1(x))
    q, k, v = (constrain(qkv[:, :, i], ("batch", "length", "heads", "head_dim")) for i in range(3))
    if cache is None:
      out = attend(self.backend, q, k, v, segment_ids)
    else:
      k_cache, v_cache, slots = cache
      k, v = write_kv(k_cache, k, slots.index), write_kv(v_cache, v, slots.index)
      out = attend_cached(q, k, v, segment_ids, positions, slots.segment_ids, slots.positions)
    x = x + self.o(constrain(out, ("batch", "length", "heads", "head_dim")))
    h = constrain(jax.nn.gelu(self.fc(self.ln_2(x)), approximate=True), ("batch", "length", "mlp"))
    x = constrain(x + self.proj(h), ("batch", "length", "embed"))
    return x if cache is None else (x, (k, v))


class GPT2(nnx.Module):
  def __init__(self, cfg, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                         embedding_init=_param(("vocab", "embed")), rngs=rngs)
    self.pos_embed = nnx.Param(_INIT(rngs.params(), (cfg.n_positions, cfg.d_model)), out_sharding=(None, "embed"))

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_layers(rngs):
      return Block(cfg, dtype, rngs)

    self.layers = make_layers(rngs)
    self.ln_f = _layer_norm(cfg, dtype, rngs)
    self.remat, self.dtype = cfg.remat, dtype

  def embed_tokens(self, tokens, positions, segment_ids=None):
    del segment_ids
    table = constrain(self.pos_embed[...], (None, None))  # gathered before the lookup, as Llama's embedding
    x = self.wte(tokens) + jnp.take(table, positions, axis=0).astype(self.dtype)
    return constrain(x, ("batch", "length", "embed"))

  def apply_layer(self, weights, x, side):
    graphdef = nnx.graphdef(self.layers)

    def layer(w, h, side):
      return nnx.merge(graphdef, w)(h, *side)
    if self.remat != "none":
      layer = jax.checkpoint(layer, policy=models.REMAT.get(self.remat), prevent_cse=False)
    return layer(weights, x, side)

  def head(self, x):
    logits = constrain(self.wte.attend(self.ln_f(x)).astype(jnp.float32), ("batch", "length", "vocab"))
    lse = jax.nn.logsumexp(logits, axis=-1)
    return models.Output(logits, aux_losses={"z_loss": jnp.mean(lse ** 2)},
                         metrics={"max_logit": jnp.mean(jnp.max(logits, axis=-1))})

  def __call__(self, tokens, positions, segment_ids, cache: KVCache | None = None):
    x = self.embed_tokens(tokens, positions)
    if cache is not None:
      return self._decode(x, positions, segment_ids, cache)
    x, _ = jax.lax.scan(lambda h, w: (self.apply_layer(w, h, (positions, segment_ids)), None), x,
                        nnx.state(self.layers))
    return self.head(x)

  @classmethod
  def init_cache(cls, cfg, batch: int, max_len: int) -> KVCache:
    return KVCache.zeros(cfg.num_layers, batch, max_len, cfg.num_heads, cfg.d_model // cfg.num_heads,
                         jnp.dtype(cfg.dtype))

  def _decode(self, x, positions, segment_ids, cache: KVCache):
    slots = cache.write_slots(segment_ids, positions)
    graphdef = nnx.graphdef(self.layers)

    def layer(h, xs):
      weights, k, v = xs
      return nnx.merge(graphdef, weights)(h, positions, segment_ids, (k, v, slots))
    x, (k, v) = jax.lax.scan(layer, x, (nnx.state(self.layers), cache.k, cache.v))
    return self.head(x), dataclasses.replace(slots, k=k, v=v, index=slots.index + x.shape[1])


models.register("gpt2", models.Family(module=GPT2, defaults=defaults, validate=validate,
                                      flops_per_token=flops_per_token,
                                      axis_keys={"embed": "d_model", "heads": "num_heads", "mlp": "mlp_dim",
                                                 "vocab": "vocab_size", "layers": "num_layers"}))


# The Hugging Face adapter ---------------------------------------------------------------------------------------


class GPT2Adapter(hf_adapter.Adapter):
  """transformers' ``GPT2LMHeadModel``: its Conv1D weights are ``[in, out]`` (a reshape of jaxtrain's kernels, no
  transpose); ``c_attn`` is q, k and v fused ``[d, 3 d]``, as this family's ``c_attn`` ``[d, 3, heads, head_dim]``.
  Refused: another activation than GPT-2's tanh GELU, unscaled or per-layer-scaled attention scores, cross
  attention, an untied head."""
  model_type, family, architecture = "gpt2", "gpt2", "GPT2LMHeadModel"

  def model_config(self, hf, where):
    activation = hf.get("activation_function", "gelu_new")
    refused = {"activation_function": activation not in ("gelu_new", "gelu_pytorch_tanh"),
               "scale_attn_weights": not hf.get("scale_attn_weights", True),
               "scale_attn_by_inverse_layer_idx": bool(hf.get("scale_attn_by_inverse_layer_idx")),
               "add_cross_attention": bool(hf.get("add_cross_attention")),
               "tie_word_embeddings": not hf.get("tie_word_embeddings", True)}
    for key, bad in refused.items():
      if bad:
        raise HFError(where, f"sets {key}={hf[key]!r}", "jaxtrain's gpt2 family computes GPT-2's own block only")
    keys = ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")
    missing = [k for k in keys if not isinstance(hf.get(k), int)]
    if missing:
      raise HFError(where, f"has no integer {', '.join(missing)}", "pass a complete config.json")
    m = models.defaults("gpt2")
    m.update(vocab_size=hf["vocab_size"], d_model=hf["n_embd"], num_layers=hf["n_layer"], num_heads=hf["n_head"],
             mlp_dim=hf.get("n_inner") or 4 * hf["n_embd"], n_positions=hf["n_positions"],
             norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)))
    return m

  def hf_config(self, model, base, dtype):
    out = {k: v for k, v in (base or {}).items() if k not in ("torch_dtype", "dtype", "transformers_version")}
    out.update(architectures=[self.architecture], model_type=self.model_type, vocab_size=model.vocab_size,
               n_embd=model.d_model, n_layer=model.num_layers, n_head=model.num_heads, n_inner=model.mlp_dim,
               n_positions=model.n_positions, layer_norm_epsilon=model.norm_eps, activation_function="gelu_new",
               scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, add_cross_attention=False,
               tie_word_embeddings=True, torch_dtype=dtype)
    return out

  def tensors(self, model):
    d, f = model.d_model, model.mlp_dim
    out = [Tensor("transformer.wte.weight", ("wte", "embedding"), None, (model.vocab_size, d), False),
           Tensor("transformer.wpe.weight", ("pos_embed",), None, (model.n_positions, d), False)]
    per_layer = [("ln_1.weight", ("ln_1", "scale"), (d,)), ("ln_1.bias", ("ln_1", "bias"), (d,)),
                 ("attn.c_attn.weight", ("c_attn", "kernel"), (d, 3 * d)),
                 ("attn.c_attn.bias", ("c_attn", "bias"), (3 * d,)),
                 ("attn.c_proj.weight", ("o", "kernel"), (d, d)), ("attn.c_proj.bias", ("o", "bias"), (d,)),
                 ("ln_2.weight", ("ln_2", "scale"), (d,)), ("ln_2.bias", ("ln_2", "bias"), (d,)),
                 ("mlp.c_fc.weight", ("fc", "kernel"), (d, f)), ("mlp.c_fc.bias", ("fc", "bias"), (f,)),
                 ("mlp.c_proj.weight", ("proj", "kernel"), (f, d)), ("mlp.c_proj.bias", ("proj", "bias"), (d,))]
    for i in range(model.num_layers):
      out += [Tensor(f"transformer.h.{i}.{name}", ("layers", *path), (i,), shape, False)
              for name, path, shape in per_layer]
    return out + [Tensor("transformer.ln_f.weight", ("ln_f", "scale"), None, (d,), False),
                  Tensor("transformer.ln_f.bias", ("ln_f", "bias"), None, (d,), False)]

  def ignored(self, name, model):
    # the tied head, and the causal-mask buffers older GPT-2 checkpoints hold
    return name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias"))


hf_adapter.register(GPT2Adapter())

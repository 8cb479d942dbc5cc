"""A GPT-2-style model family registered from outside the package: learned absolute positions, LayerNorm with
bias, GELU MLP with biases, multi-head attention, tied embeddings; its own config keys, checks and FLOPs, and an
auxiliary loss (PaLM's z-loss on the logits, weighted by ``model.z_loss_weight``) and a metric. Nothing under
jaxtrain/ knows about it: importing this module registers it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain import models
from jaxtrain.errors import ConfigError
from jaxtrain.models.attention import attend
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
    bias = nnx.with_partitioning(nnx.initializers.zeros, ("heads", "head_dim"))
    self.ln_1 = _layer_norm(cfg, dtype, rngs)
    self.q, self.k, self.v = (nnx.Einsum("btd,dnh->btnh", (d, n, h), (n, h), bias_init=bias,
                                         kernel_init=_param(("embed", "heads", "head_dim")), **kw) for _ in range(3))
    self.o = nnx.Einsum("btnh,nhd->btd", (n, h, d), (d,), kernel_init=_param(("heads", "head_dim", "embed")),
                        bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), **kw)
    self.ln_2 = _layer_norm(cfg, dtype, rngs)
    self.fc = nnx.Linear(d, cfg.mlp_dim, kernel_init=_param(("embed", "mlp")),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)), **kw)
    self.proj = nnx.Linear(cfg.mlp_dim, d, kernel_init=_param(("mlp", "embed")),
                           bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), **kw)
    self.backend = cfg.attention

  def __call__(self, x, positions, segment_ids):
    del positions  # absolute positions are added once, at the embedding
    y = self.ln_1(x)
    q, k, v = (constrain(p(y), ("batch", "length", "heads", "head_dim")) for p in (self.q, self.k, self.v))
    x = x + self.o(constrain(attend(self.backend, q, k, v, segment_ids), ("batch", "length", "heads", "head_dim")))
    h = constrain(jax.nn.gelu(self.fc(self.ln_2(x)), approximate=True), ("batch", "length", "mlp"))
    return constrain(x + self.proj(h), ("batch", "length", "embed"))


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

  def __call__(self, tokens, positions, segment_ids):
    x = self.embed_tokens(tokens, positions)
    x, _ = jax.lax.scan(lambda h, w: (self.apply_layer(w, h, (positions, segment_ids)), None), x,
                        nnx.state(self.layers))
    return self.head(x)


models.register("gpt2", models.Family(module=GPT2, defaults=defaults, validate=validate,
                                      flops_per_token=flops_per_token,
                                      axis_keys={"embed": "d_model", "heads": "num_heads", "mlp": "mlp_dim",
                                                 "vocab": "vocab_size", "layers": "num_layers"}))

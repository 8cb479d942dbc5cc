"""The Llama model: published parameter counts, causality, document masking, remat, dtypes, registry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import cpu_50m, llama3_1b, llama3_8b, llama3_70b, tiny
from jaxtrain import models
from jaxtrain.train import trainer

PUBLISHED = [(llama3_1b, 1_235_814_400), (llama3_8b, 8_030_261_248), (llama3_70b, 70_553_706_496)]


@pytest.mark.parametrize("module,published", PUBLISHED)
def test_parameter_counts_match_published(module, published):
  n = models.Model.from_config(module.get_config().model).num_params()
  assert abs(n - published) / published < 0.01, (n, published)


def test_cpu_configs_sizes():
  assert 45e6 < models.Model.from_config(cpu_50m.get_config().model).num_params() < 55e6
  assert models.Model.from_config(tiny.get_config().model).num_params() < 2e6


def _model_and_params(**overrides):
  cfg = tiny.get_config().model
  cfg.update(num_layers=2, **overrides)
  model = models.Model.from_config(cfg)
  return model, jax.jit(model.init)(jax.random.key(0))


def _inputs(tokens):
  tokens = jnp.asarray(tokens, jnp.int32)
  b, t = tokens.shape
  return tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32)


def test_causal():
  model, params = _model_and_params()
  tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
  changed = tokens.copy()
  changed[:, 10:] = (changed[:, 10:] + 1) % 256
  a = model.apply(params, *_inputs(tokens))
  b = model.apply(params, *_inputs(changed))
  np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
  assert not np.allclose(a[:, 10:], b[:, 10:])


def test_attention_stays_within_document():
  model, params = _model_and_params()
  tokens = np.random.default_rng(0).integers(0, 256, (1, 16))
  segments = np.array([[1] * 6 + [2] * 10], np.int32)
  positions = np.array([list(range(6)) + list(range(10))], np.int32)
  other = tokens.copy()
  other[0, :6] = (other[0, :6] + 7) % 256  # change only the first document
  a = model.apply(params, jnp.asarray(tokens), positions, segments)
  b = model.apply(params, jnp.asarray(other), positions, segments)
  np.testing.assert_allclose(a[0, 6:], b[0, 6:], atol=1e-6)  # the second document does not see the first
  assert not np.allclose(a[0, :6], b[0, :6])


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_same_values_and_grads(remat):
  model, params = _model_and_params()
  remat_model, _ = _model_and_params(remat=remat)
  tokens = _inputs(np.random.default_rng(0).integers(0, 256, (2, 16)))
  loss = lambda m: jax.jit(jax.value_and_grad(lambda p: jnp.mean(m.apply(p, *tokens) ** 2)))
  (l1, g1), (l2, g2) = loss(model)(params), loss(remat_model)(params)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), g1, g2)


def test_bf16_compute_keeps_fp32_params():
  model, params = _model_and_params(dtype="bfloat16")
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  fp32_model, _ = _model_and_params()
  tokens = _inputs(np.random.default_rng(0).integers(0, 256, (2, 16)))
  logits, ref = model.apply(params, *tokens), fp32_model.apply(params, *tokens)
  assert logits.dtype == jnp.float32
  assert 0 < float(jnp.max(jnp.abs(logits - ref))) < 0.1  # really computed in bf16, and close


def test_tied_embeddings_share_the_table():
  model, params = _model_and_params(tie_embeddings=True)
  assert "lm_head" not in params
  untied, _ = _model_and_params()
  assert untied.num_params() - model.num_params() == 128 * 256


@models.register("bigram_test")
class Bigram(nnx.Module):
  """A model added from outside the package: only logical axis names, no core edits."""

  def __init__(self, cfg, *, rngs):
    self.table = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.vocab_size)) * 0.02,
                           out_sharding=("vocab", "embed"))

  def __call__(self, tokens, positions, segment_ids):
    return self.table[...][tokens]


def test_registered_model_trains(make_config):
  config = make_config(fsdp=8)
  config.model.name = "bigram_test"
  config.optim.lr = 0.1
  config.train.steps = 10
  state, history = trainer.train(config)
  assert state.params["table"].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
  assert history[-1]["loss"] < history[0]["loss"]

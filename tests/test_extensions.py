"""Extension seams: a model family registered from outside the package (tests/gpt2_family.py) trains sharded and
pipelined with no file under jaxtrain/ edited for it; its FLOPs, auxiliary loss and metric reach the run."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import metrics, models
from jaxtrain.config import ConfigError, base_config
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.metrics import read_records
from jaxtrain.train import trainer
from tests import forked
from tests import gpt2_family  # noqa: F401 - registers the family "gpt2"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt2_config(workdir, steps=4, **mesh):
  c = base_config(model="gpt2")
  c.workdir = str(workdir)
  c.model.update(num_layers=4, d_model=64, num_heads=4, mlp_dim=128, n_positions=64, z_loss_weight=1e-2)
  c.data.update(seq_len=32, source="synthetic")
  c.train.update(steps=steps, global_batch_size=16, log_every=1)
  c.optim.update(lr=3e-3, warmup_steps=1)
  c.mesh.update(data=1, fsdp=1, tensor=1)
  c.mesh.update(**mesh)
  return c


def test_family_config_is_its_own():
  c = base_config(model="gpt2")
  assert set(c.model.keys()) == set(models.SHARED) | set(gpt2_family.defaults())
  assert "n_positions" in c.model and "num_kv_heads" not in c.model and "rope_theta" not in c.model
  c.model.num_heads = 5
  with pytest.raises(ConfigError, match="model.num_heads: 5 does not divide model.d_model=64"):
    trainer.build(c)
  llama_keys = base_config()  # a llama model group with the name of another family: named as such
  llama_keys.model.name = "gpt2"
  with pytest.raises(ConfigError, match="model.name: the model group has the keys of another family"):
    trainer.build(llama_keys)


def _reference_objective(model, params, batch, weight):
  out = model.forward(params, batch["inputs"], batch["positions"], batch["segment_ids"])
  ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["targets"])
  mask = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(ce * mask) / jnp.sum(mask) + weight * out.aux_losses["z_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [1, 2])
def test_aux_loss_reaches_the_gradient(tmp_path, microbatches):
  """The step's gradient is that of cross-entropy + z_loss_weight x z-loss, with or without accumulation."""
  norms = {}
  for weight in (0.0, 0.5):
    c = gpt2_config(tmp_path, fsdp=8)
    c.model.z_loss_weight = weight
    c.train.microbatches = microbatches
    run = trainer.build(c)
    assert run.aux_weights == {"z_loss": weight}
    state = trainer.init_state(run)
    batch = next(SyntheticSource(32, 256, 16, 0, 0, 1))
    batch = {k: jnp.asarray(v) for k, v in batch.items() if k != "doc_ids"}
    ref = jax.jit(jax.grad(lambda p, b, w=weight: _reference_objective(run.model, p, b, w)))(state.params, batch)
    _, m = trainer.compile_step(run)(state, batch, np.bool_(False))
    norms[weight] = float(m["grad_norm"])
    assert norms[weight] == pytest.approx(float(jax.jit(optax.tree.norm)(ref)), rel=2e-5)  # one program, not eager
  assert abs(norms[0.5] - norms[0.0]) > 1e-3 * norms[0.0]  # the aux term moved the gradient


@pytest.mark.slow
def test_gpt2_trains_sharded_and_pipelined_alike(tmp_path):
  """Data x FSDP x tensor (2, 2, 2) and a 2-stage pipeline give the same losses; params sharded by their logical
  names; the z-loss and the model's metric are logged; MFU's FLOPs are the family's own."""
  state, sharded = trainer.train(gpt2_config(tmp_path / "sharded", data=2, fsdp=2, tensor=2))
  spec = state.params["layers"]["fc"]["kernel"].sharding.spec
  assert spec == P("pipeline", "fsdp", "tensor")  # layers over stages (1 here), embed, mlp
  assert state.params["pos_embed"].sharding.spec == P(None, "fsdp")
  _, pipelined = trainer.train(gpt2_config(tmp_path / "pipelined", pipeline=2, fsdp=4))
  np.testing.assert_allclose([h["loss"] for h in pipelined], [h["loss"] for h in sharded], rtol=2e-5)
  np.testing.assert_allclose([h["aux_loss/z_loss"] for h in pipelined], [h["aux_loss/z_loss"] for h in sharded],
                             rtol=2e-5)
  assert sharded[-1]["loss"] < sharded[0]["loss"]

  records = [r for r in read_records(tmp_path / "sharded") if "loss" in r]
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert all(math.isfinite(r["aux_loss/z_loss"]) and r["aux_loss/z_loss"] > 0 for r in records)
  assert all(math.isfinite(r["max_logit"]) for r in records)
  # The first step's z-loss is that of the initial params on the first batch (computed here independently).
  run = trainer.build(gpt2_config(tmp_path / "ref", data=2, fsdp=2, tensor=2))
  params = jax.device_get(trainer.init_state(run).params)
  batch = next(SyntheticSource(32, 256, 16, 0, 0, 1))
  out = run.model.forward(params, batch["inputs"], batch["positions"], batch["segment_ids"])
  assert records[0]["aux_loss/z_loss"] == pytest.approx(float(out.aux_losses["z_loss"]), rel=1e-5)

  # FLOPs: GPT-2's own count (6 N without the position table, the tied table once + attention 12 L d T).
  n = run.model.num_params() - 64 * 64  # the 64 x 64 position table is no matmul
  flops = 6 * n + 12 * 4 * 64 * 32
  assert metrics.flops_per_token(run.model, 32) == flops
  for r in records:  # tflops_per_device x step_time = FLOPs of one step per device
    assert r["tflops_per_device"] * r["step_time"] * 1e12 == pytest.approx(flops * 16 * 32 / 8, rel=1e-9)


@pytest.mark.slow
def test_command_line_picks_the_family_and_its_keys(tmp_path):
  """--config.model.name=gpt2 on a config file that starts from Llama swaps in GPT-2's model group, so its own
  keys can be set on the same command line; a Llama-only key is then unknown."""
  config_file = tmp_path / "with_gpt2.py"
  config_file.write_text("from tests import gpt2_family  # noqa: F401\nfrom configs import tiny\n\n\n"
                         "def get_config():\n  return tiny.get_config()\n")
  base = ["-m", "jaxtrain.main", f"--config={config_file}", "--config.model.name=gpt2"]
  ok = forked.run(base + ["--config.model.n_positions=128", "--config.model.num_layers=2", "--config.dry_run=True",
                          f"--config.workdir={tmp_path / 'run'}"])
  assert ok.returncode == 0, ok.stderr[-2000:]
  info = [line for line in ok.stdout.splitlines() if line.startswith("{")]
  params = json.loads(info[-1])["params"]
  # GPT-2's defaults for every model key the command line left alone (tiny.py's Llama sizes are gone with its group)
  assert params == _gpt2_params(gpt2_family.defaults() | {"n_positions": 128, "num_layers": 2}, vocab=256)
  bad = forked.run(base + ["--config.model.num_kv_heads=2"])
  assert bad.returncode == 2
  assert bad.stderr.strip().splitlines()[-1].startswith("jaxtrain: error: model.num_kv_heads: unknown config key")


def _gpt2_params(cfg, vocab):
  d, f, layers = cfg["d_model"], cfg["mlp_dim"], cfg["num_layers"]
  per_layer = 2 * 2 * d + 4 * (d * d + d) + (d * f + f) + (f * d + d)
  return vocab * d + cfg["n_positions"] * d + layers * per_layer + 2 * d


@pytest.mark.slow
def test_attention_backends_agree_and_one_registers_from_outside():
  from jaxtrain.models import attention
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k1, (2, 16, 4, 8))
  k, v = jax.random.normal(k2, (2, 16, 2, 8)), jax.random.normal(k3, (2, 16, 2, 8))
  segments = jnp.array([[1] * 10 + [2] * 6, [1] * 16])
  ref = attention.attend("reference", q, k, v, segments)
  np.testing.assert_allclose(attention.attend("xla", q, k, v, segments), ref, rtol=1e-5, atol=1e-5)
  # Row 0's token 10 starts document 2: it sees only itself, so its output is its own value vector.
  np.testing.assert_allclose(ref[0, 10], jnp.repeat(v[0, 10], 2, axis=0), rtol=1e-6)

  calls = []

  @attention.BACKENDS.register("counting_test")
  def counting(q, k, v, segment_ids, positions, block_size):
    calls.append(q.shape)
    return attention.xla(q, k, v, segment_ids, positions)

  c = base_config()
  c.model.attention = "counting_test"
  model = models.Model.from_config(c.model)
  tokens = jnp.zeros((1, 8), jnp.int32)
  logits = model.apply(model.init(jax.random.key(0)), tokens, tokens, tokens)
  assert logits.shape == (1, 8, 256) and calls == [(1, 8, 4, 16)]  # traced once: the layers are scanned
  c.model.attention = "flash_nope"
  with pytest.raises(ConfigError, match="model.attention: 'flash_nope' is not a registered attention backend; "
                                        "use one of auto, blockwise, counting_test, cudnn, reference, splash, xla"):
    models.validate(c)


def test_a_data_source_registers_from_outside(make_config):
  """A source is one registration: its stream trains, its position is checkpointed, and validation knows it."""
  from jaxtrain import data as data_lib
  opened = []

  def open_train(c):
    source = SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size, 7, 0, 1)
    opened.append(source)
    return source

  data_lib.SOURCES.register("seven_test", data_lib.Source(
      open_train=open_train, open_eval=lambda c: [], provenance=lambda c, step, doc_ids: {"source": "seven"},
      reads_path=False))
  config = make_config(fsdp=8)
  config.data.source = "seven_test"
  config.train.steps = 3
  _, history = trainer.train(config)
  assert [h["step"] for h in history] == [1, 2, 3] and len(opened) == 1
  assert opened[0].get_state() == {"step": 3}  # the loop consumed exactly its three batches
  config.data.source, config.data.path = "seven_test", "/somewhere"
  with pytest.raises(ConfigError, match="data.path: is set but data.source='seven_test' ignores it"):
    trainer.build(config)
  config.data.source, config.data.path = "parquet_nope", ""
  with pytest.raises(ConfigError, match="data.source: 'parquet_nope' is not a registered data source; use one of "
                                        "arrayrecord, prompts, raw, seven_test, synthetic"):
    trainer.build(config)

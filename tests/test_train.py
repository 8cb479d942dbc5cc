"""The train step: sharded == unsharded, gradient accumulation, loss masking, determinism, overfitting."""

import itertools
import json

import jax
import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain import metrics as metrics_lib
from jaxtrain import models
from jaxtrain import optim
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.train import state as state_lib
from jaxtrain.train import step as step_lib
from jaxtrain.train import trainer


def _losses(history):
  return np.array([h["loss"] for h in history])


@pytest.mark.parametrize("family,overrides", [
    ("llama", []), ("gemma2", []), ("qwen3_moe", []), ("llama", ["model.lora.rank=4", "optim.name=muon"]),
    ("qwen3", ["optim.name=adafactor"]), ("mistral", ["optim.name=lion"]), ("gpt_oss", [])])
def test_abstract_state_equals_the_shapes_of_the_real_init(family, overrides):
  """state.abstract builds the state's shapes from the model's abstract params and the optimizer's init without
  tracing the model's init: the same tree, shapes and dtypes as the init itself, for every kind of model, LoRA
  (adapters under params['lora'], a masked optimizer) and optimizers with factored or per-leaf state."""
  config = config_lib.load_file(f"configs/tiny_family.py:{family}", overrides)
  model = models.Model.from_config(config.model)
  tx = optim.make(config.optim, 100, model.trainable_mask())
  real = jax.eval_shape(lambda: state_lib._init(model, tx, jax.random.key(0)))
  abstract = state_lib.abstract(model, tx)
  assert jax.tree.structure(abstract) == jax.tree.structure(real)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), real)


@pytest.mark.slow
def test_sharded_equals_single_device(make_config, tmp_path):
  sharded = make_config(data=2, fsdp=2, tensor=2)
  single = make_config()
  single.workdir = str(tmp_path / "single")
  _, h8 = trainer.train(sharded)
  _, h1 = trainer.train(single, devices=jax.devices()[:1])
  assert len(h8) == len(h1) == 5
  np.testing.assert_allclose(_losses(h8), _losses(h1), rtol=1e-5)
  assert _losses(h8)[-1] < _losses(h8)[0]


def test_same_seed_same_run_and_metrics_file(make_config, tmp_path):
  config = make_config(fsdp=8)
  _, first = trainer.train(config)
  again = make_config(fsdp=8)
  again.workdir = str(tmp_path / "again")  # a fresh run (the same workdir would resume from its checkpoint)
  _, second = trainer.train(again)
  assert len(first) == 5 and [h["loss"] for h in first] == [h["loss"] for h in second]
  lines = [json.loads(l) for l in open(f"{config.workdir}/metrics.jsonl")]
  assert [l["step"] for l in lines] == [1, 2, 3, 4, 5]
  for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time", "tokens"):
    assert key in lines[0]
  assert lines[0]["tokens"] == 16 * 32 and lines[0]["tokens_per_sec"] > 0
  assert json.loads(open(f"{config.workdir}/config.json").read())["mesh"]["fsdp"] == 8


def _one_step(config, batch):
  run = trainer.build(config)
  step = trainer.compile_step(run)
  state = trainer.init_state(run)
  state, metrics = step(state, data_lib.to_global(batch, run.batch_sharding), np.bool_(False))
  return jax.device_get(state.params), jax.device_get(metrics)


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [2, 4])
def test_gradient_accumulation_matches_big_batch(make_config, microbatches):
  batch = next(SyntheticSource(32, 256, 16, seed=3))
  batch["loss_mask"][:5, 20:] = 0  # unequal real-token counts per microbatch: weighting must be by tokens
  one = make_config(data=2, fsdp=2, tensor=2)
  accumulated = make_config(data=2, fsdp=2, tensor=2)
  accumulated.train.microbatches = microbatches
  params1, m1 = _one_step(one, batch)
  params_k, m_k = _one_step(accumulated, batch)
  np.testing.assert_allclose(m_k["loss"], m1["loss"], rtol=1e-6)
  assert m_k["tokens"] == m1["tokens"] == 16 * 32 - 5 * 12
  np.testing.assert_allclose(m_k["grad_norm"], m1["grad_norm"], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), params_k, params1)


def test_loss_mask_excludes_targets(make_config):
  config = make_config(fsdp=8)
  run = trainer.build(config)
  state = trainer.init_state(run)
  batch = next(SyntheticSource(32, 256, 16, seed=1))
  batch["loss_mask"][:, 16:] = 0
  other = {k: v.copy() for k, v in batch.items()}
  other["targets"][:, 16:] = 7  # masked targets may be anything
  loss = jax.jit(lambda p, b: step_lib.loss_fn(run.model, p, b))
  with jax.set_mesh(run.mesh):
    (s1, n1), (s2, n2) = loss(state.params, batch), loss(state.params, other)
  assert float(n1) == float(n2) == 16 * 16
  assert float(s1) == float(s2)
  # The loss is the mean token cross-entropy over the unmasked targets.
  logits = run.model.apply(state.params, batch["inputs"], batch["positions"], batch["segment_ids"])
  logp = jax.nn.log_softmax(np.asarray(logits), axis=-1)
  nll = -np.take_along_axis(np.asarray(logp), batch["targets"][..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(float(s1), nll[:, :16].sum(), rtol=1e-5)


@pytest.mark.slow
def test_tiny_overfits_one_batch(tmp_path):
  from configs import tiny  # the real tiny config, trained on one repeated batch
  config = tiny.get_config()
  config.workdir = str(tmp_path)
  config.train.update(steps=40, log_every=10, global_batch_size=4)
  config.data.seq_len = 32
  config.mesh.update(fsdp=1, data=-1)
  batch = next(SyntheticSource(config.data.seq_len, config.model.vocab_size, 4, seed=0))
  batch["inputs"] = np.random.default_rng(0).integers(0, 256, batch["inputs"].shape).astype(np.int32)
  batch["targets"] = np.random.default_rng(1).integers(0, 256, batch["targets"].shape).astype(np.int32)
  _, history = trainer.train(config, devices=jax.devices()[:1], data=itertools.repeat(batch))
  losses = _losses(history)
  assert losses[-1] < 0.1 * losses[0], losses


def test_a_record_cut_by_a_kill_is_dropped_when_the_run_resumes(make_config, tmp_path):
  """A SIGKILL while a record is appended leaves half a line: the resumed run cuts it, and the file stays JSON
  Lines (a reader that parses every line keeps working)."""
  config = make_config()
  config.metrics.tensorboard = False
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "lo')
  writer = metrics_lib.MetricWriter(str(tmp_path), 5, 1, config.metrics, {})
  writer.write(2, {"eval_loss": 5.25})
  writer.close()
  assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1, "loss": 5.5},
                                                                          {"step": 2, "eval_loss": 5.25}]


@pytest.mark.parametrize("batch, least, limit, shards, expected", [
    (8, 0, 0, 8, 1),  # no limit: train.microbatches (0: 1)
    (8, 2, 0, 8, 2),
    (8, 0, 1, 8, 1),  # 8 rows over 8 devices: 1 each
    (8, 0, 1, 4, 2),  # the same batch on 4 devices: 2 microbatches of 4 rows
    (16, 0, 2, 2, 4),  # 16 rows, 2 devices, at most 2 each: 4 of 4 rows
    (16, 0, 3, 2, 4),  # 3 per device is not reachable evenly: 2 (4 microbatches)
    (16, 8, 2, 2, 8),  # at least train.microbatches
    (12, 0, 1, 4, 3),  # 12 rows on 4 devices: 3 microbatches of 4
    (8, 0, 1, 16, None),  # fewer rows than devices: no split keeps every device busy
])
def test_max_rows_per_device_picks_the_fewest_microbatches_that_keep_to_it(batch, least, limit, shards, expected):
  from jaxtrain.config import base_config
  from jaxtrain.errors import ConfigError
  from jaxtrain.train import run
  train = base_config().train
  train.update(global_batch_size=batch, microbatches=least, max_rows_per_device=limit)
  if expected is None:
    with pytest.raises(ConfigError, match=r"^train.max_rows_per_device: no split of train.global_batch_size=8 into "
                                          r"microbatches \(at least 1\) puts at most 1 row\(s\) on each of the 16"):
      run.microbatches_for(train, shards)
  else:
    assert run.microbatches_for(train, shards) == expected

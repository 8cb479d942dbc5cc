"""Pipeline parallelism: pipelined == unpipelined (loss and gradients), memory per stage, checkpoints that do
not depend on the split, validation."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtrain import data as data_lib
from jaxtrain import models
from jaxtrain import sharding
from jaxtrain.config import ConfigError
from jaxtrain.parallel import pipeline as pipeline_lib
from jaxtrain.train import run as run_lib
from jaxtrain.train import step as step_lib
from jaxtrain.train import trainer
from tests.conftest import resumable_copy, small_config

LAYERS = 8  # divides 2 and 4 stages x 2 repeats


def _packed_batch(rows=16, seq=32, vocab=256, seed=0):
  """Rows of two packed documents with restarting positions, and unequal real-token counts per row."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (rows, seq + 1))
  cut = rng.integers(4, seq - 4, rows)
  segment_ids = np.where(np.arange(seq + 1) < cut[:, None], 1, 2)
  positions = np.where(segment_ids == 1, np.arange(seq + 1), np.arange(seq + 1) - cut[:, None])
  segment_ids[: rows // 4, seq // 2:] = 0  # padding at the end of a quarter of the rows
  return data_lib.batch.from_packed(tokens, segment_ids, positions)


def _config(tmp_path, schedule="gpipe", microbatches=0, **mesh):
  c = small_config(tmp_path, **mesh)
  c.model.num_layers = LAYERS
  c.pipeline.schedule = schedule
  c.train.microbatches = microbatches
  return c


def _loss_and_grads(config, batch, devices, params=None):
  """(mean loss, real tokens, gradients, run) of ``config`` on ``devices``: from ``params`` (e.g. one device's, put on
  the run's shardings), else from the run's own init (an init compiled for that mesh: about as costly as the
  gradient's own compile)."""
  return _loss_grads_and_params(config, batch, devices, params)[:4]


def _loss_grads_and_params(config, batch, devices, params=None):
  """:func:`_loss_and_grads` and, last, the params it started from (on the host)."""
  run = trainer.build(config, devices)
  if params is None:
    params = trainer.init_state(run).params
  else:
    params = jax.device_put(params, run.state_shardings.params)
  fn = jax.jit(jax.value_and_grad(lambda p, b: step_lib.loss_fn(run.model, p, b, run.pipeline_schedule), has_aux=True))
  with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
    (loss_sum, tokens), grads = fn(params, data_lib.to_global(batch, run.batch_sharding))
  return float(loss_sum / tokens), float(tokens), jax.device_get(grads), run, jax.device_get(params)


def assert_trains_like_one_device(config, layouts, batch=None, one_device_params=False):
  """``config(name, **mesh)``: a config on that mesh; ``layouts``: ``(mesh, model keys)`` pairs. Each layout's loss
  and every gradient (relative to the gradient's largest entry) within 1e-5 of one device's, on ``batch`` (default:
  :func:`_packed_batch`). ``one_device_params``: each layout starts from one device's initial params put on its
  shardings instead of compiling its own init (which the trainer's sharded runs against one device check: e.g.
  tests/test_moe.py::test_expert_parallel_training_equals_one_device)."""
  batch = _packed_batch() if batch is None else batch
  ref_loss, ref_tokens, ref_grads, _, ref_params = _loss_grads_and_params(config("one"), batch, jax.devices()[:1])
  for i, (mesh, keys) in enumerate(layouts):
    c = config(str(i), **mesh)
    c.model.update(**keys)
    loss, tokens, grads, _ = _loss_and_grads(c, batch, jax.devices()[:int(np.prod(list(mesh.values())))],
                                             ref_params if one_device_params else None)
    assert tokens == ref_tokens
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=f"{mesh} {keys}")
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
      scale = np.max(np.abs(r))
      err = np.max(np.abs(g - r)) / scale if scale else np.max(np.abs(g))
      assert err < 1e-5, f"{mesh} {keys} {jax.tree_util.keystr(path)}: relative gradient error {err:.2e}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The unpipelined model on one device: the loss and gradients every pipelined layout must reproduce."""
  config = _config(tmp_path_factory.mktemp("ref"))
  loss, tokens, grads, _, params = _loss_grads_and_params(config, _packed_batch(), jax.devices()[:1])
  return loss, tokens, grads, params


CASES = [  # (mesh, devices, schedule, remat, microbatches); alone = only the pipeline axis, on that many devices
    (dict(pipeline=2), 2, "gpipe", "none", 4),
    (dict(pipeline=2, data=2, tensor=2), 8, "gpipe", "save_dots", 4),
    (dict(pipeline=4, tensor=2), 8, "circular", "none", 4),
    (dict(pipeline=2, fsdp=4), 8, "circular", "full", 4),
    (dict(pipeline=4), 4, "1f1b", "none", 2),  # fewer microbatches than stages: 1f1b allows it
    (dict(pipeline=2, data=2, tensor=2), 8, "1f1b", "save_dots", 4),
    (dict(pipeline=2, fsdp=4), 8, "1f1b", "full", 4),  # 4 units through 3 stash slots
    (dict(pipeline=4, tensor=2), 8, "interleaved_1f1b", "none", 4),
    (dict(pipeline=2, fsdp=2), 4, "interleaved_1f1b", "save_dots", 4),  # 8 units through 7 slots
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,devices,schedule,remat,microbatches", CASES,
                         ids=[f"{'x'.join(f'{k}{v}' for k, v in m.items())}-{s}-{r}-m{n}" for m, _, s, r, n in CASES])
def test_pipelined_loss_and_grads_equal_unpipelined(reference, tmp_path, mesh, devices, schedule, remat, microbatches):
  """From the reference's initial params put on the layout's shardings (no init compiled per layout); the circular
  schedule over fsdp from its own init: a pipelined init holds the unpipelined one's values (also the trainer's runs
  in test_checkpoints_resume_bitwise_and_across_pipeline_splits)."""
  ref_loss, ref_tokens, ref_grads, ref_params = reference
  config = _config(tmp_path, schedule, microbatches=microbatches, **mesh)
  config.model.remat = remat
  own_init = schedule == "circular" and "fsdp" in mesh
  loss, tokens, grads, run = _loss_and_grads(config, _packed_batch(), jax.devices()[:devices],
                                             None if own_init else ref_params)
  assert run.pipeline_schedule.stages == mesh["pipeline"]
  assert run.pipeline_schedule.kind == schedule
  assert run.pipeline_schedule.repeats == (2 if schedule in ("circular", "interleaved_1f1b") else 1)
  assert tokens == ref_tokens
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), strict=True):
    err = np.max(np.abs(g - r)) / np.max(np.abs(r))
    assert err < 1e-5, f"{jax.tree_util.keystr(path)}: relative gradient error {err:.2e}"


def test_circular_all_to_all_tables_cover_every_group():
  """The weight exchange of the circular schedule puts group r*S + s in slot r of stage s, for shapes where
  stages and repeats share factors or not."""
  for stages, repeats in [(2, 2), (2, 4), (4, 2), (4, 3), (3, 4), (8, 2)]:
    send, recv = pipeline_lib._all_to_all_tables(stages, repeats)
    cap = send.shape[2]
    for d in range(stages):
      for r in range(repeats):
        j, pos = divmod(int(recv[d, r]), cap)
        source_slot = int(send[j, d, pos])
        assert j * repeats + source_slot == r * stages + d


@pytest.mark.slow
def test_bf16_pipeline_close_to_fp32(reference, tmp_path):
  """bf16 compute through the circular pipeline: the loss and every layer's gradient match the fp32
  unpipelined reference up to bf16 rounding (measured: cosine > 0.9998, norms within 0.3%), so a layer that
  is skipped, repeated or fed the wrong weights (zero or different gradients) fails."""
  bf16 = _config(tmp_path, "circular", microbatches=4, pipeline=2, fsdp=4)
  bf16.model.dtype = "bfloat16"
  ref_loss, ref_tokens, ref_grads, ref_params = reference
  loss16, tokens, grads16, _ = _loss_and_grads(bf16, _packed_batch(), jax.devices(), ref_params)
  assert tokens == ref_tokens
  assert loss16 == pytest.approx(ref_loss, rel=1e-3)
  cosines = []
  for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads16), jax.tree.leaves(ref_grads), strict=True):
    assert g.dtype == np.float32
    rows = LAYERS if path[0].key == "layers" else 1  # the stacked layers: each layer's slice on its own
    for i, (a, b) in enumerate(zip(np.reshape(g, (rows, -1)), np.reshape(r, (rows, -1)))):
      cosines.append(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
      norm_ratio = np.linalg.norm(a) / np.linalg.norm(b)
      where = f"{jax.tree_util.keystr(path)}[{i}]"
      assert cosines[-1] > 0.999 and abs(norm_ratio - 1) < 0.02, \
          f"{where}: cosine {cosines[-1]:.5f}, norm ratio {norm_ratio:.4f}"
  assert min(cosines) < 1 - 1e-5  # really computed in bf16: fp32 pipelined gradients give 1 - 2e-7


def test_layer_params_per_device_with_four_stages(tmp_path):
  config = _config(tmp_path, "circular", pipeline=4, data=2)
  run = trainer.build(config)
  state = trainer.init_state(run)
  device = jax.devices()[0]

  def on_device(tree):
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
               if s.device == device)

  # Exactly a quarter of the stack (and of its Adam moments): split over the 4 stages, replicated over data.
  layers = state.params["layers"]
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(layers))
  assert on_device(layers) == total // 4
  moments = [t for t in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(t, "mu")]
  assert len(moments) == 1
  assert on_device(moments[0].mu["layers"]) == on_device(moments[0].nu["layers"]) == total // 4
  # What the start (and a dry run) reports of the schedule: 4 microbatches (the default: the stage count) x 2 rounds
  # + 3 iterations, each stage input kept
  assert run_lib.report(run)["pipeline"] == {"schedule": "circular", "stages": 4, "repeats": 2, "microbatches": 4,
                                             "bubble": 3 / 11, "in_flight": 11}


@pytest.mark.slow
def test_checkpoints_resume_bitwise_and_across_pipeline_splits(tmp_path):
  """1F1B over 2 stages, resumed from its step-2 checkpoint, equals its uninterrupted run bitwise (what a resume
  restores does not depend on the schedule; the schedule's program is deterministic). And the splits do not
  matter: pipeline=2 (1F1B) -> pipeline=4 (interleaved 1F1B) -> no pipeline, each resuming the previous one's
  checkpoint, give the losses and params of one unpipelined run. Each run on as many devices as its stages (the
  unpipelined ones on one)."""
  def config(workdir, steps, schedule="gpipe", **mesh):
    c = _config(workdir, schedule, **mesh)
    c.train.steps = steps
    c.optim.update(warmup_steps=1, decay_steps=4)  # the same schedule whichever run stops where
    c.checkpoint.every_steps = 2  # (and the last step): the resumes below start at 2 and 3
    return c

  def losses(history):
    return [h["loss"] for h in history]

  ref = config(tmp_path / "ref", 4)
  ref.checkpoint.verify = False  # (nothing restores the reference's saves: no fingerprint program compiled for it)
  ref_state, reference = trainer.train(ref, devices=jax.devices()[:1])
  _, first = trainer.train(config(tmp_path / "1f1b", 4, "1f1b", pipeline=2), devices=jax.devices()[:2])
  _, again = trainer.train(config(resumable_copy(tmp_path / "1f1b", tmp_path / "again", 2), 4, "1f1b", pipeline=2),
                           devices=jax.devices()[:2])
  assert [h["step"] for h in again] == [3, 4] and losses(again) == losses(first)[2:]  # bitwise
  split = resumable_copy(tmp_path / "1f1b", tmp_path / "split", 2)
  _, second = trainer.train(config(split, 3, "interleaved_1f1b", pipeline=4), devices=jax.devices()[:4])
  state, third = trainer.train(config(split, 4), devices=jax.devices()[:1])
  assert [h["step"] for h in first[:2] + second[:1] + third] == [1, 2, 3, 4]
  np.testing.assert_allclose(losses(first[:2] + second[:1] + third), losses(reference), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(jax.device_get(state.params)), jax.tree.leaves(jax.device_get(ref_state.params))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class Flat(nnx.Module):
  """A model with no layer stack: it cannot be split into stages."""

  def __init__(self, cfg, *, rngs):
    self.table = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.vocab_size)) * 0.02,
                           out_sharding=("vocab", "embed"))

  def __call__(self, tokens, positions, segment_ids):
    return self.table[...][tokens]


models.register("flat_test", models.Family(module=Flat))


@pytest.mark.parametrize("change,message", [
    (dict(pipeline=2, layers=3), "model.num_layers: 3 layers do not split evenly into 2 stages"),
    (dict(pipeline=2, schedule="circular", layers=6), "model.num_layers: 6 layers do not split evenly into 2 "
                                                      "stages x 2 repeats"),
    (dict(pipeline=4, microbatches=2), "train.microbatches: 2 microbatches are fewer than the 4 pipeline stages"),
    (dict(pipeline=2, microbatches=3), "train.microbatches: 3 is not a multiple of the 2 pipeline stages"),
    (dict(pipeline=2, model="flat_test"), "mesh.pipeline: model 'flat_test' cannot be split into pipeline "
                                          "stages: it has no embed_tokens, apply_layer, head methods"),
    (dict(pipeline=2, rules="stage=data"), "sharding.rules: 'stage' must map to the pipeline mesh axis"),
    (dict(pipeline=2, microbatches=4, batch=12), "train.global_batch_size: each of the 4 microbatches has 3 rows"),
    (dict(pipeline=2, schedule="interleaved_1f1b", layers=6), "model.num_layers: 6 layers do not split evenly into "
                                                              "2 stages x 2 repeats"),
    (dict(pipeline=4, schedule="interleaved_1f1b", microbatches=6, layers=8),
     "train.microbatches: 6 is not a multiple of the 4 pipeline stages"),
    (dict(pipeline=4, schedule="interleaved_1f1b", microbatches=2, layers=8),
     "train.microbatches: 2 microbatches are fewer than the 4 pipeline stages"),
    (dict(pipeline=4, schedule="1f1b", seq=30), "data.seq_len: 30 tokens do not split evenly over the 4 pipeline "
                                                "stages (1f1b runs the head on 1/4 of them on each)"),
])
def test_pipeline_config_mistakes(tmp_path, change, message):
  c = small_config(tmp_path, pipeline=change["pipeline"], fsdp=-1)
  c.model.num_layers = change.get("layers", 4)
  if "model" in change:
    c.model = models.defaults(change["model"])
  c.pipeline.schedule = change.get("schedule", "gpipe")
  c.train.microbatches = change.get("microbatches", 0)
  c.train.global_batch_size = change.get("batch", 16)
  c.data.seq_len = change.get("seq", c.data.seq_len)
  c.sharding.rules = change.get("rules", "")
  with pytest.raises(ConfigError) as e:
    trainer.build(c)
  assert message in str(e.value)


def test_schedule_bubble_formula_and_activations_in_flight():
  assert pipeline_lib.Schedule(stages=4, repeats=1, microbatches=4).bubble == pytest.approx(3 / 7)
  assert pipeline_lib.Schedule(stages=4, repeats=2, microbatches=8).bubble == pytest.approx(3 / 19)
  assert pipeline_lib.Schedule(stages=4, repeats=2, microbatches=8).iterations == 19
  # gpipe / circular keep every iteration's stage input; the 1f1b schedules at most 2 R S - 1, whatever M
  assert [pipeline_lib.Schedule(4, 1, m, "gpipe").in_flight for m in (8, 32)] == [11, 35]
  assert [pipeline_lib.Schedule(4, 1, m, "1f1b").in_flight for m in (2, 8, 32)] == [2, 7, 7]
  assert [pipeline_lib.Schedule(4, 2, m, "interleaved_1f1b").in_flight for m in (4, 32)] == [8, 15]

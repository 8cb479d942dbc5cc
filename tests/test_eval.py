"""Eval during training: the logged eval loss is the token-mean cross entropy of that step's params over the
held-out split, logged at the multiples of eval.every_steps and at the last step, over eval.max_batches
batches, and the same with the layer stack pipelined."""

import json
import math
import os

import jax
import numpy as np
import optax
import pytest

from jaxtrain import data as data_lib
from jaxtrain import models
from jaxtrain.data import loader, prepare
from jaxtrain.train import trainer
from tests.conftest import small_config

STEPS, EVERY = 5, 2  # evaluated after steps 2 and 4, and after the last (5, not a multiple of 2)
LIMIT = 3  # eval.max_batches of the limited run
MESH = dict(data=2, fsdp=2, tensor=2)  # the eval batches are sharded over data and fsdp


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """A twentieth of the bundled Shakespeare with 7% of its paragraphs held out: 5 eval batches of 16 x 32
  targets, the last one two rows (so a mean of batch means would weigh its 64 tokens like 500)."""
  folder = tmp_path_factory.mktemp("eval-data")
  text = prepare.BUNDLED.read_text()
  (folder / "shakespeare.txt").write_text(text[:text.index("\n\n", len(text) // 20)] + "\n")
  out = folder / "prepared"
  prepare.prepare(prepare.Options(inputs=[os.fspath(folder / "shakespeare.txt")], output=os.fspath(out),
                                  eval_fraction=0.07, progress=False))
  return os.fspath(out)


def _config(workdir, corpus, max_batches=0, **mesh):
  c = small_config(workdir, **mesh)
  c.data.update(source="arrayrecord", path=corpus)
  c.train.steps = STEPS
  c.eval.update(every_steps=EVERY, max_batches=max_batches)
  c.metrics.tensorboard = False
  c.checkpoint.verify = False  # one compile fewer; the final save is not what these tests look at
  return c


def _train(config):
  """(final params on the host, eval records by step, every record of metrics.jsonl in order)."""
  state, _ = trainer.train(config)
  with open(os.path.join(config.workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return jax.device_get(state.params), {r["step"]: r for r in records if "eval_loss" in r}, records


@pytest.fixture(scope="module")
def plain(tmp_path_factory, corpus):
  config = _config(tmp_path_factory.mktemp("plain"), corpus, **MESH)
  return (config, *_train(config))


@pytest.fixture(scope="module")
def eval_batches(plain):
  """The whole eval split as the data module batches it for the plain run."""
  return data_lib.open_eval(plain[0])


def _direct_eval(config, params, batches):
  """(mean cross entropy over the real target tokens, their count): one device, no trainer, float64 sums."""
  model = models.Model.from_config(config.model)

  @jax.jit
  def token_losses(params, inputs, positions, segment_ids, targets):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, inputs, positions, segment_ids),
                                                           targets)

  total = tokens = 0.0
  for b in batches:
    losses = np.asarray(token_losses(params, b["inputs"], b["positions"], b["segment_ids"], b["targets"]))
    total += float(np.sum(losses.astype(np.float64) * b["loss_mask"]))
    tokens += float(np.sum(b["loss_mask"]))
  return total / tokens, tokens


def _split_targets(root, row):
  """Real targets of the eval split cut into rows of ``row`` tokens, from its documents alone: every token
  but the first of each document piece, a piece ending at a row boundary that falls inside a document."""
  source = loader.TokenSource(root, loader.load_manifest(root), "eval")
  starts = set(np.cumsum([0] + [len(source[i]) for i in range(len(source))]).tolist())
  total = max(starts)
  cuts = sum(1 for b in range(row, total, row) if b not in starts)
  return total - len(source) - cuts


def test_eval_loss_is_the_token_mean_over_the_eval_split(plain, eval_batches, corpus):
  config, params, by_step, _ = plain
  rows, width = config.train.global_batch_size, config.data.seq_len
  assert len(eval_batches) == 5 and all(b["inputs"].shape == (rows, width) for b in eval_batches)
  assert eval_batches[-1]["loss_mask"][:2].sum(axis=1).all() and eval_batches[-1]["loss_mask"][2:].sum() == 0
  loss, tokens = _direct_eval(config, params, eval_batches)
  last = by_step[STEPS]  # the params trainer.train returns are the last step's
  assert last["eval_tokens"] == tokens == _split_targets(corpus, width + 1)
  np.testing.assert_allclose(last["eval_loss"], loss, rtol=1e-5)
  assert last["eval_perplexity"] == math.exp(last["eval_loss"])


def test_eval_logged_at_multiples_of_every_steps_and_the_last_step(plain, eval_batches):
  config, _, by_step, records = plain
  # Each eval once, right after the train record of its step (log_every=1), never at a step it did not eval.
  assert [(r["step"], "eval_loss" in r) for r in records] == [
      (1, False), (2, False), (2, True), (3, False), (4, False), (4, True), (5, False), (5, True)]
  # ... and of that step's params: replay the run's first steps outside the loop.
  run = trainer.build(config)
  step_fn, state = trainer.compile_step(run), trainer.init_state(run)
  data = data_lib.open_train(run.config)
  try:
    for step in range(1, 5):
      state, _ = step_fn(state, data_lib.to_global(next(data), run.batch_sharding), np.bool_(False))
      if step % EVERY == 0:
        loss, tokens = _direct_eval(config, jax.device_get(state.params), eval_batches)
        assert by_step[step]["eval_tokens"] == tokens
        np.testing.assert_allclose(by_step[step]["eval_loss"], loss, rtol=1e-5)
  finally:
    data_lib.close(data)


def test_eval_max_batches(tmp_path, corpus, plain, eval_batches):
  config = _config(tmp_path, corpus, max_batches=LIMIT, **MESH)
  params, by_step, _ = _train(config)
  assert sorted(by_step) == [2, 4, STEPS]
  counts = [float(b["loss_mask"].sum()) for b in eval_batches]
  assert min(counts[:LIMIT + 1]) > 0  # one batch more or fewer would change the count
  loss, _ = _direct_eval(config, params, eval_batches[:LIMIT])
  assert [r["eval_tokens"] for r in by_step.values()] == [sum(counts[:LIMIT])] * 3
  np.testing.assert_allclose(by_step[STEPS]["eval_loss"], loss, rtol=1e-5)
  # The eval does not touch training: the same params as the full-split run.
  jax.tree.map(np.testing.assert_array_equal, params, plain[1])


@pytest.mark.slow
def test_pipelined_eval_equals_unpipelined(tmp_path, corpus, plain, eval_batches):
  reference = plain[2]
  config = _config(tmp_path, corpus, pipeline=2, data=2, tensor=2)  # 2 microbatches, 1 layer per stage
  params, by_step, _ = _train(config)
  assert sorted(by_step) == [2, 4, STEPS]
  for step, r in by_step.items():
    assert r["eval_tokens"] == reference[step]["eval_tokens"]
    np.testing.assert_allclose(r["eval_loss"], reference[step]["eval_loss"], rtol=1e-5)
  loss, _ = _direct_eval(config, params, eval_batches)  # and on the pipelined run's own final params
  np.testing.assert_allclose(by_step[STEPS]["eval_loss"], loss, rtol=1e-5)

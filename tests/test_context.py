"""Context parallelism (mesh.context): the sequence split over devices gives one device's losses on packed data,
alone and with fsdp, tensor and pipeline parallelism; activations are really split (each device holds its share
of the tokens, keys and values are all-gathered); the load-balanced chunk order; one-line validation; docs/models.md's
column agrees with what each family registers. (The MoE families' run: tests/test_moe.py's expert2_context2_fsdp2.)"""

import dataclasses
import pathlib
import re

import jax
import numpy as np
import pytest

from jaxtrain import models
from jaxtrain.config import ConfigError, base_config, validate_values
from jaxtrain.parallel import context
from jaxtrain.train import trainer
from tests.conftest import small_config


def _config(workdir, attention="xla", **mesh):
  c = small_config(workdir, **mesh)
  c.data.update(source="arrayrecord", path="", seq_len=64)  # the bundled corpus: packed documents
  c.train.update(steps=5, global_batch_size=8)
  c.model.update(attention=attention, attention_block_size=16)
  c.checkpoint.every_steps = 0
  c.metrics.tensorboard = False
  return c


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  _, history = trainer.train(_config(tmp_path_factory.mktemp("one")), devices=jax.devices()[:1])
  return [h["loss"] for h in history]


@pytest.mark.parametrize("mesh", [
    dict(context=2, fsdp=4),
    dict(context=4, fsdp=2, attention="blockwise"),
    dict(context=8),
    dict(context=2, fsdp=2, tensor=2),
    dict(context=2, pipeline=2, fsdp=2),
], ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
@pytest.mark.slow
def test_context_parallel_losses_equal_one_device(tmp_path, one_device, mesh):
  config = _config(tmp_path, **mesh)
  if mesh.get("pipeline", 1) > 1:
    config.train.microbatches = 2
  _, history = trainer.train(config)
  assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
  np.testing.assert_allclose([h["loss"] for h in history], one_device, rtol=1e-5)


def test_the_sequence_is_split_and_keys_are_gathered(tmp_path):
  run = trainer.build(_config(tmp_path, context=4, fsdp=2))
  assert run.batch_sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp", "expert"), "context")
  hlo = trainer.compile_step(run).as_text()
  # Embeddings of a device's own tokens: 8 rows / (data x fsdp) = 4, 64 tokens / 4 = 16 of them, 64 wide.
  assert re.search(r"f32\[4,16,64\]", hlo)
  assert "all-gather" in hlo and not re.search(r"f32\[4,64,64\]", hlo)  # no full-length residual stream


def test_load_balanced_order():
  order = context.balance_order(16, 4)  # 8 chunks of 2: device i holds chunks i and 7 - i
  assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  # Each device's causal work (sum over its queries of the keys before them) is the same.
  work = [sum(int(q) + 1 for q in part) for part in order.reshape(4, 4)]
  assert len(set(work)) == 1
  assert context.balance_order(16, 1).tolist() == list(range(16))


def test_validation_is_one_line(monkeypatch):
  c = base_config()
  c.workdir = "/tmp/unused"
  c.mesh.context, c.data.seq_len = 4, 100
  with pytest.raises(ConfigError, match=r"mesh.context: data.seq_len=100 does not split into 2 x 4 equal chunks.*"
                                        "make data.seq_len a multiple of 8"):
    validate_values(c)
  for name in ("moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"):  # the MoE families split the sequence too
    c = base_config(model=name)
    c.workdir, c.mesh.context = "/tmp/unused", 2
    validate_values(c)
  # A family that registers context_parallel=False (what it can do, not its name) is refused in one line.
  monkeypatch.setitem(models.FAMILIES._entries, "no_context",  # noqa: SLF001 - removed again after the test
                      dataclasses.replace(models.get("llama"), context_parallel=False))
  c = base_config(model="no_context")
  c.workdir, c.mesh.context = "/tmp/unused", 2
  with pytest.raises(ConfigError, match=r"^mesh.context: the 'no_context' model family cannot split the sequence "
                                        r"over devices \(it registers context_parallel=False\).*set mesh.context=1"):
    validate_values(c)
  c.mesh.context = 1
  validate_values(c)


def test_the_models_page_says_which_families_split_the_sequence():
  """docs/models.md's "context parallel" column: "yes" for exactly the families whose registration says
  context_parallel, and every built-in family in a row (not the ones tests register)."""
  page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
  table = page.split("| family | train |", 1)[1].split("\n\n", 1)[0]
  header, rows = ("| family | train |" + table).splitlines()[0], table.splitlines()[2:]
  column = [c.strip() for c in header.strip("|").split("|")].index("context parallel")
  said = {}
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    for name in cells[0].split(","):
      said[name.strip()] = cells[column]
  assert sorted(said) == [n for n in models.names() if models.get(n).module.__module__.startswith("jaxtrain.")]
  for name, cell in said.items():
    assert cell == ("yes" if models.get(name).context_parallel else "no"), (name, cell)

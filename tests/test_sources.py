"""A data source added from tests/ only (tests/counting_source.py, no file under jaxtrain/ touched): its own keys
under data.<name> with their checks, a train stream whose position checkpoints hold, and a mixture that takes it as
a component through SOURCES."""

import dataclasses

import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain import sampling
from jaxtrain.data import folders, prepare
from jaxtrain.errors import ConfigError
from jaxtrain.train import trainer
from tests import forked
from tests.conftest import small_config


@pytest.fixture
def counting(monkeypatch):
  """The counting source registered for one test (the registry as it was afterwards)."""
  monkeypatch.setattr(data_lib.SOURCES, "_entries", dict(data_lib.SOURCES._entries))
  from tests import counting_source
  data_lib.SOURCES.register(counting_source.NAME, counting_source.SOURCE)
  return counting_source


def _losses(history) -> dict[int, float]:
  return {h["step"]: h["loss"] for h in history if "loss" in h}


def test_a_source_from_tests_trains_resumes_where_it_was_and_checks_its_own_keys(counting, tmp_path):
  def config(workdir, steps):
    c = small_config(workdir, fsdp=8)  # made after the source registered: data.counting_test is a group
    c.data.source, c.data.counting_test.stride = "counting_test", 3
    c.train.steps, c.checkpoint.every_steps, c.metrics.tensorboard = steps, 2, False
    return c

  straight = _losses(trainer.train(config(tmp_path / "straight", 4))[1])
  trainer.train(config(tmp_path / "resumed", 2))
  resumed = _losses(trainer.train(config(tmp_path / "resumed", 4))[1])
  assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
  assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]  # the checkpoint held its position
  assert straight[4] < straight[1]  # it learns: counting is predictable

  resolved = config_lib.resolve(config(tmp_path / "straight", 4))
  assert sampling.tokenizer_for(resolved).where == "byte-level"  # generation asks the source for its tokenizer
  data_lib.SOURCES.register("counting_test", dataclasses.replace(counting.SOURCE, tokenizer=lambda c: None))
  with pytest.raises(sampling.GenerateError, match="^data.source=counting_test: generation does not know this "
                                                   "source's tokenizer; pass --tokenizer=FILE$"):
    sampling.tokenizer_for(resolved)

  c = config(tmp_path / "bad", 4)
  c.data.counting_test.length = 1
  with pytest.raises(ConfigError) as e:
    config_lib.resolve(c)
  assert str(e.value) == ("data.counting_test.length: 1 tokens make no next-token prediction; set it to 2 or more")
  c = config(tmp_path / "unread", 4)
  c.data.source = "synthetic"
  with pytest.raises(ConfigError, match=r"^data.counting_test.stride: is set but data.source='synthetic' does not "
                                        r"read it; set data.source=counting_test \(or mix it in: "
                                        r"data.mixture='x@counting_test=path:weight'\), or leave it at 1$"):
    config_lib.resolve(c)


def test_a_mixture_takes_the_new_source_as_a_component(counting, tmp_path):
  """``name@source=path``: the component is opened by the named source (its documents, its order, its eval split,
  its provenance), mixed with a prepared folder; the recorded form keeps the source."""
  c = small_config(tmp_path)
  text = str(prepare.bundled_corpus(c.data.cache_dir))
  c.data.source, c.data.seq_len, c.train.global_batch_size = "arrayrecord", 64, 8
  c.data.mixture = f"nums@counting_test=anything:0.5,text={text}:0.5"
  c.data.counting_test.stride = 5
  c.eval.every_steps = 10
  c = config_lib.resolve(c)
  assert c.data.mixture.startswith("nums@counting_test=/") and c.data.mixture.endswith(f",text={text}:0.5")
  it = data_lib.open_train(c)
  try:
    batches = [next(it) for _ in range(4)]
  finally:
    data_lib.close(it)
  rows = 0
  for b in batches:
    for r in range(8):
      if b["sources"][r, 0] != 0:  # component ids in name order: nums 0, text 1
        continue
      rows += 1
      tokens, segments = b["inputs"][r], b["segment_ids"][r]
      same = segments[1:] == segments[:-1]
      assert np.all((tokens[1:] - tokens[:-1])[same] % 256 == 5)  # the counting documents, stride 5
  assert 0 < rows < 32  # both components read
  assert folders.source_of(str(tmp_path / "texts.jsonl"), "", "k") == "raw"  # unnamed: still raw records
  report = data_lib.provenance(c, 1, batches[0]["doc_ids"])["mixture"]
  assert report["nums"]["where"][0].startswith("counting document ")
  assert [s.name for s in data_lib.eval_sets(c)][0] == "nums"  # its held-out documents, evaluated by name
  assert sampling.tokenizer_for(c).where == "byte-level"  # both components' sources say 'byte'
  unknown = dataclasses.replace(counting.SOURCE.documents, tokenizer=lambda path, c: None)
  data_lib.SOURCES.register("counting_test", dataclasses.replace(counting.SOURCE, documents=unknown))
  with pytest.raises(sampling.GenerateError, match="^data.mixture: generation does not know the tokenizer of every "
                                                   "component; pass --tokenizer=FILE$"):
    sampling.tokenizer_for(c)
  c.data.mixture, c.data.counting_test.stride = "nums@nowhere_test=anything:1", 1
  with pytest.raises(ConfigError, match="data.mixture \\(nums\\): 'nowhere_test' is not a registered data source"):
    config_lib.resolve(c)


_CONFIG = '''
from tests import counting_source  # registers data.source=counting_test and its keys
from tests.conftest import small_config


def get_config():
  c = small_config("unused")
  c.data.source = "counting_test"
  return c
'''


def test_the_new_sources_keys_are_command_line_flags(tmp_path):
  """End to end: the config file registers the source; its key is a flag; a bad value is one line, exit 2."""
  config_file = tmp_path / "counting_config.py"
  config_file.write_text(_CONFIG)
  r = forked.run(["-m", "jaxtrain.main", f"--config={config_file}", f"--config.workdir={tmp_path / 'run'}",
                  "--config.data.counting_test.stride=300"])
  errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert r.returncode == 2 and errors == ["jaxtrain: error: data.counting_test.stride: 300 is not in [1, "
                                          "model.vocab_size); set e.g. 1"], r.stderr[-3000:]
  assert "Traceback" not in r.stderr

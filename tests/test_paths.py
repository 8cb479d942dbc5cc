"""Every path a user gives is resolved once, at start: relative to the current folder, ~, absolute, gs://, s3://."""

import os

import pytest

from jaxtrain import config as config_lib
from jaxtrain import paths


def test_resolve_makes_local_paths_absolute_and_leaves_urls(monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert paths.resolve("runs/x") == str(tmp_path / "runs" / "x")
  assert paths.resolve("./runs/../data") == str(tmp_path / "data")
  assert paths.resolve("~/.cache/jaxtrain") == str(tmp_path / "home" / ".cache" / "jaxtrain")
  assert paths.resolve("/abs/olute") == "/abs/olute"
  assert paths.resolve("gs://bucket/run1") == "gs://bucket/run1"
  assert paths.resolve("") == ""
  assert paths.join("gs://bucket/run1/", "checkpoints") == "gs://bucket/run1/checkpoints"
  assert paths.join("/a/b", "checkpoints") == "/a/b/checkpoints"


@pytest.mark.parametrize("tokenizer,expected", [("byte", "byte"), ("", ""), ("tok/t.json", "{cwd}/tok/t.json"),
                                                ("gs://b/t.model", "gs://b/t.model")])
def test_config_paths_are_resolved_once_and_recorded(monkeypatch, tmp_path, tokenizer, expected):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  c = config_lib.base_config()
  c.workdir, c.data.path, c.data.tokenizer = "runs/tiny", "data/corpus", tokenizer
  c.checkpoint.restore_from = "~/other/checkpoints"
  resolved = config_lib.resolve(c)
  assert resolved.workdir == str(tmp_path / "runs" / "tiny")
  assert resolved.checkpoint.dir == str(tmp_path / "runs" / "tiny" / "checkpoints")
  assert resolved.checkpoint.restore_from == str(tmp_path / "home" / "other" / "checkpoints")
  assert resolved.data.path == str(tmp_path / "data" / "corpus")
  assert resolved.data.cache_dir == str(tmp_path / "home" / ".cache" / "jaxtrain")
  assert resolved.data.tokenizer == expected.format(cwd=tmp_path)
  assert c.workdir == "runs/tiny"  # the caller's config is left alone
  os.chdir("/")
  assert config_lib.resolve(resolved).to_dict() == resolved.to_dict()  # resolving twice changes nothing


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_object_store_workdir_keeps_its_scheme(scheme):
  c = config_lib.base_config()
  c.workdir = f"{scheme}://bucket/run1"
  resolved = config_lib.resolve(c)
  assert resolved.workdir == f"{scheme}://bucket/run1"
  assert resolved.checkpoint.dir == f"{scheme}://bucket/run1/checkpoints"


def test_warmup_longer_than_the_schedule_is_clipped_with_a_warning(caplog):
  c = config_lib.base_config()
  c.train.steps, c.optim.warmup_steps = 12, 100
  with caplog.at_level("WARNING"):
    resolved = config_lib.resolve(c)
  assert resolved.optim.warmup_steps == 12 and c.optim.warmup_steps == 100
  assert "optim.warmup_steps=100 is longer than the 12-step schedule" in caplog.text
  c.optim.decay_steps = 50  # the schedule's horizon when set
  assert config_lib.resolve(c).optim.warmup_steps == 50

"""Checkpoint tiers from outside jaxtrain/: the in-memory tier of tests/memory_tier.py, registered by importing it
and picked by ``checkpoint.tiers``, is saved to on its cadence, resumed from when it holds the newest step (falling
back from a step that does not read back) and told to forget an abandoned timeline, as the built-in tiers are."""

import numpy as np
import pytest

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import config as config_lib
from jaxtrain.metrics import read_records
from jaxtrain.train import trainer
from tests import memory_tier
from tests.conftest import small_config


class Crash(Exception):
  """Stands for a process killed at a save."""


def _config(workdir, tiers=("persistent", "memory")):
  c = small_config(workdir, fsdp=8)
  c.train.steps = 8
  c.checkpoint.update(every_steps=4, tiers=tiers)
  return c


def _losses(workdir):
  return {r["step"]: r["loss"] for r in read_records(workdir) if "loss" in r}  # a re-run step keeps its last value


def test_a_tier_registered_from_tests_is_saved_to_and_resumed_from(tmp_path, monkeypatch, caplog):
  reference, _ = trainer.train(_config(tmp_path / "reference", tiers=("persistent",)))
  saved, save = [], memory_tier.MemoryTier.save

  def crash_at_7(self, step, *args, **kwargs):
    if step == 7:
      raise Crash()
    saved.append(step)
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(memory_tier.MemoryTier, "save", crash_at_7)
  with pytest.raises(Crash):
    trainer.train(_config(tmp_path / "run"))
  monkeypatch.setattr(memory_tier.MemoryTier, "save", save)
  store = memory_tier.STORE[str(tmp_path / "run" / "checkpoints")]
  # Every step the persistent tier (every 4) does not take, the newest two kept.
  assert saved == [1, 2, 3, 5, 6] and sorted(store) == [5, 6]
  assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [4]
  # Step 6 no longer reads back: set aside, and the run resumes from 5, the newest step a tier restores.
  host, position, meta = store[6]
  host.params["embed"]["embedding"][0, 0] += 1.0
  caplog.clear()
  with caplog.at_level("INFO"):
    state, _ = trainer.train(_config(tmp_path / "run"))
  assert "memory checkpoint step 6 cannot be restored (params/embed/embedding does not match its fingerprint)" \
      in caplog.text
  assert f"resumed from checkpoint step 5 (memory tier, {tmp_path / 'run' / 'checkpoints'})" in caplog.text
  assert sorted(store) == [6, 7]  # step 6 of the resumed timeline, not the dropped one
  assert _losses(tmp_path / "run") == _losses(tmp_path / "reference")
  for a, b in zip(*(np.asarray(x) for x in (state.params["embed"]["embedding"],
                                            reference.params["embed"]["embedding"]))):
    np.testing.assert_array_equal(a, b)


def test_an_unregistered_tier_is_one_line_naming_the_registered_ones(tmp_path):
  c = _config(tmp_path, tiers=("persistent", "nvme"))
  with pytest.raises(config_lib.ConfigError, match=r"checkpoint.tiers: 'nvme' is not a registered checkpoint tier"
                     r"; use one of local, memory, persistent, or register yours with jaxtrain.checkpoint.TIERS"):
    checkpoint_lib.validate(c)
  c.checkpoint.tiers = ("memory", "persistent")
  with pytest.raises(config_lib.ConfigError, match="'persistent' first"):
    checkpoint_lib.validate(c)

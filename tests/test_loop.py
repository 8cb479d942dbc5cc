"""The training loop (jaxtrain.train.loop): its decisions alone (NaN policies, rollback limits, eval and checkpoint
cadences, the one-step-late metrics buffer, the state saved with each checkpoint), then whole runs: the counts a
rollback restores, the step in flight at a rollback before the first checkpoint, eval labels whatever saves."""

import json
import pathlib

import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain.checkpoint import checkpoint_due
from jaxtrain import monitor
from jaxtrain.metrics import read_records
from jaxtrain.train import hooks, loop, trainer
from tests.conftest import count_dispatched_steps
from tests.test_monitor import Poisoned  # batch `bad` (0-based) has a NaN in its loss mask: no tokens counted

TOKENS = 16 * 32  # target tokens of one small_config step (every synthetic position is a target)


# Decisions, no model --------------------------------------------------------------------------------------------


def test_nan_policies_are_a_registry_that_validation_reads(monkeypatch):
  assert {"skip", "rollback", "stop"} <= set(monitor.NAN_POLICIES.names())
  config = config_lib.base_config()
  config.monitor.nan_policy = "halve_lr"
  with pytest.raises(config_lib.ConfigError, match=r"monitor.nan_policy: 'halve_lr' is not a registered NaN policy"):
    monitor.validate(config)
  monkeypatch.setitem(monitor.NAN_POLICIES._entries, "halve_lr", monitor.rollback_policy)  # one registration
  monitor.validate(config)
  judge = loop.NonFiniteSteps("halve_lr", max_consecutive=3, last_step=10)
  assert judge.observe(4, True, set()) == "rollback"


def _actions(policy: str, fetched: list[tuple[int, bool]], known=(), max_consecutive=3, last_step=10):
  judge, known = loop.NonFiniteSteps(policy, max_consecutive, last_step), set(known)
  return [judge.observe(step, nonfinite, known) for step, nonfinite in fetched], judge.streak, known


def test_skip_escalates_after_max_consecutive_new_non_finite_steps_or_one_at_the_last_step():
  # Steps 2-4 new and in a row: the third escalates; 5 is finite (the streak resets); 9 alone goes on; 10 is last.
  fetched = [(1, False), (2, True), (3, True), (4, True), (5, False), (9, True), (10, True)]
  actions, streak, known = _actions("skip", fetched)
  assert actions == [None, "skip", "skip", "escalate", None, "skip", "escalate"]
  assert streak == 2 and known == {2, 3, 4, 9, 10}
  # Known bad steps replayed after a rollback (still non-finite) neither count nor reset the streak.
  actions, streak, _ = _actions("skip", [(2, True), (3, True), (4, True), (5, True), (6, True), (7, True)],
                                known={2, 3, 4})
  assert actions == [None, None, None, "skip", "skip", "escalate"] and streak == 3


def test_rollback_and_stop_policies_act_on_each_new_non_finite_step_only():
  fetched = [(1, False), (2, True), (2, True), (3, False), (4, True)]
  assert _actions("rollback", fetched)[0] == [None, "rollback", None, None, "rollback"]
  assert _actions("stop", fetched)[0] == [None, "stop", None, None, "stop"]


def test_rollback_limits():
  limits = loop.RollbackLimits(max_rollbacks=2, bad_batches="/run/bad_batches.jsonl")
  limits.check("rollback", 5, "a non-finite step", [])  # nothing to go back to: the update is skipped, go on
  with pytest.raises(loop.TrainingStopped) as e:
    limits.check("escalate", 5, "3 non-finite step(s) in a row", [])
  assert str(e.value) == ("step 5: 3 non-finite step(s) in a row and no checkpoint to roll back to; nothing was "
                          "saved: lower optim.lr or fix the data, or save earlier with checkpoint.every_steps")
  limits.check("rollback", 4, "a non-finite step", [3])
  limits.check("rollback", 5, "a non-finite step", [3])
  with pytest.raises(loop.TrainingStopped) as e:
    limits.check("rollback", 6, "a non-finite step", [3])
  assert str(e.value) == ("step 6: a non-finite step again after 2 rollback(s) to checkpoint step 3; the checkpoints "
                          "are intact (steps: [3]): look at /run/bad_batches.jsonl, lower optim.lr or fix the data")
  limits.check("escalate", 9, "3 non-finite step(s) in a row", [3, 6])  # another checkpoint: its own count
  with pytest.raises(loop.TrainingStopped, match="again after 1 rollback"):
    limits.check("escalate", 12, "3 non-finite step(s) in a row", [3, 6])


def test_eval_and_checkpoint_cadences():
  assert [s for s in range(1, 12) if hooks.due(s, every=4, last=11)] == [4, 8, 11]
  assert not any(hooks.due(s, every=0, last=11) for s in range(1, 12))
  every_3 = [s for s in range(1, 12) if s % 3 == 0]
  assert [checkpoint_due(s, 11, s == 5, lambda s: s in every_3) for s in range(1, 12)] == [
      None, None, "periodic", None, "forced", "periodic", None, None, "periodic", None, "forced"]
  # (forced, streak, skipped) -> saved?
  assert [loop.may_save(*case) for case in [(False, 0, False), (True, 0, False), (False, 0, True), (True, 0, True),
                                            (False, 1, False), (True, 2, True)]] == [True, True, False, True,
                                                                                      False, False]


def test_metrics_buffer_hands_over_each_step_one_step_late():
  buffer = loop.MetricsBuffer()
  assert buffer.push(1, {"loss": np.float32(2.5), "tokens": np.float32(512)}) is None
  assert buffer.push(2, {"loss": np.float32(2.25), "tokens": np.float32(np.nan)}) == (1, {"loss": 2.5,
                                                                                        "tokens": 512.0})
  assert buffer.flush() == (2, {"loss": 2.25, "tokens": 0.0})  # a NaN loss mask counts no tokens
  assert buffer.flush() is None
  buffer.push(3, {"loss": 1.0})
  buffer.clear()
  assert buffer.push(4, {"loss": 1.0}) is None


# The checkpoint meta of the code before LoopState: every key still read, every key still written.
OLD_META = {"jaxtrain_version": "0.1.0", "step": 6, "mesh": {"data": 1, "pipeline": 1, "fsdp": 8, "tensor": 1},
            "loss": 4.5, "tokens_seen": 2560, "seed": 0, "wall_time": 12.5, "saved_at": 1.7e9, "bad_steps": [5],
            "skipped_steps": 2, "fingerprints": {}}


def test_loop_state_is_saved_and_restored_as_one_unit_under_the_old_keys():
  counts = loop.LoopState.from_meta(OLD_META, step=6)
  assert counts == loop.LoopState(step=6, tokens_seen=2560, skipped_steps=2, bad_steps={5}, wall_time=12.5)
  assert loop.LoopState.from_meta({}, step=0) == loop.LoopState()
  run_meta = loop.RunMeta("0.1.0", OLD_META["mesh"], seed=0, loss=4.5, saved_at=1.7e9)
  # Every old key is still written, next to the layout keys added since (an elastic restart compares them).
  assert loop.checkpoint_meta(run_meta, counts) == {**{k: v for k, v in OLD_META.items() if k != "fingerprints"},
                                                    "processes": 1, "microbatches": 1}
  # A checkpoint without those keys compares only its mesh with the run's layout.
  now = loop.RunMeta("0.2.0", {"data": 1, "pipeline": 1, "fsdp": 4, "tensor": 1}, seed=0, loss=None, saved_at=2e9,
                     processes=1, microbatches=2)
  assert now.layout_changes(OLD_META) == ["mesh {'data': 1, 'pipeline': 1, 'fsdp': 8, 'tensor': 1} -> {'data': 1, "
                                          "'pipeline': 1, 'fsdp': 4, 'tensor': 1}"]
  assert now.layout_changes({**OLD_META, "processes": 2, "microbatches": 1})[::2] == ["processes 2 -> 1",
                                                                                      "microbatches 1 -> 2"]
  # A rollback to that checkpoint from step 9: its step and tokens; bad steps, skips and wall time kept.
  later = loop.LoopState(step=9, tokens_seen=4096, skipped_steps=3, bad_steps={5, 8}, wall_time=20.0)
  assert later.rewound_to(counts) == loop.LoopState(step=6, tokens_seen=2560, skipped_steps=3, bad_steps={5, 8},
                                                    wall_time=20.0)


# Whole runs ------------------------------------------------------------------------------------------------------


def _config(make_config, steps, every_steps, policy="skip"):
  config = make_config(fsdp=8)
  config.train.steps = steps
  config.optim.update(schedule="constant", warmup_steps=0)
  config.checkpoint.every_steps = every_steps
  config.monitor.nan_policy = policy
  config.metrics.tensorboard = False
  return config


def _meta(workdir, step) -> dict:
  return json.loads((pathlib.Path(workdir) / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def _logged(workdir) -> list[tuple[int, str]]:
  return [(r["step"], "eval" if "eval_loss" in r else "train") for r in read_records(workdir)]


def test_a_rollback_restores_tokens_seen_with_the_state(make_config, caplog):
  """Step 5 is non-finite under nan_policy=rollback: back to checkpoint 3, replay 4-8 (5 skipped). The checkpoints
  after it count each step of their history once: not the rolled-back steps 4 and 5 again."""
  config = _config(make_config, steps=8, every_steps=3, policy="rollback")
  with caplog.at_level("WARNING"):
    state, history = trainer.train(config, data=Poisoned(4, 32, 256, 16, 0))
  assert "rollback at step 5 (a non-finite step): back to checkpoint step 3" in caplog.text
  assert int(state.step) == 8
  assert [s for s, _ in _logged(config.workdir)] == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
  metas = {step: _meta(config.workdir, step) for step in (3, 6, 8)}
  # Step 5 (the NaN mask) counts no tokens; every other step of the history, once.
  assert {s: m["tokens_seen"] for s, m in metas.items()} == {3: 3 * TOKENS, 6: 5 * TOKENS, 8: 7 * TOKENS}
  # Step 5's update was dropped twice: when it failed and when its replay skipped it.
  assert {s: (m["step"], m["skipped_steps"], m["bad_steps"]) for s, m in metas.items()} == {
      3: (3, 0, []), 6: (6, 2, [5]), 8: (8, 2, [5])}
  assert 0 < metas[3]["wall_time"] < metas[6]["wall_time"] < metas[8]["wall_time"]  # time spent keeps counting
  assert history[-1]["skipped_steps"] == 2


def test_a_rollback_before_the_first_checkpoint_keeps_the_step_in_flight(make_config, caplog):
  """Step 2 is non-finite under nan_policy=rollback with nothing saved yet: its update is skipped and the run goes
  on. Step 3, dispatched when that was decided, is still fetched, counted, logged and evaluated."""
  config = _config(make_config, steps=5, every_steps=0, policy="rollback")
  config.eval.every_steps = 3
  with caplog.at_level("WARNING"):
    _, history = trainer.train(config, data=Poisoned(1, 32, 256, 16, 0))
  assert "rollback at step 2: no checkpoint yet; the update was skipped instead" in caplog.text
  assert _logged(config.workdir) == [(1, "train"), (2, "train"), (3, "train"), (3, "eval"), (4, "train"),
                                     (5, "train"), (5, "eval")]
  assert [h["step"] for h in history] == [1, 2, 3, 4, 5]
  meta = _meta(config.workdir, 5)
  assert (meta["tokens_seen"], meta["skipped_steps"], meta["bad_steps"]) == (4 * TOKENS, 1, [2])


def test_eval_is_logged_under_its_step_whatever_the_checkpoints(make_config, tmp_path):
  """Eval every 2 steps, checkpoints every 3: steps that evaluate and save (6, 8), only evaluate (2, 4), only save
  (3). Each eval is logged once, right after its step's record, labelled with that step, with the value an
  eval of that step's params gives (a reference run evaluating every step, saving only at the end)."""
  reference = _config(make_config, steps=8, every_steps=0)
  reference.workdir = str(tmp_path / "reference")
  reference.eval.every_steps = 1
  trainer.train(reference)
  evals = {r["step"]: r["eval_loss"] for r in read_records(reference.workdir) if "eval_loss" in r}
  assert sorted(evals) == list(range(1, 9))
  assert all(abs(evals[s + 1] - evals[s]) > 1e-5 * evals[s] for s in range(1, 8))  # a step off would show

  config = _config(make_config, steps=8, every_steps=3)
  config.workdir = str(tmp_path / "run")
  config.eval.every_steps = 2
  trainer.train(config)
  assert _logged(config.workdir) == [(1, "train"), (2, "train"), (2, "eval"), (3, "train"), (4, "train"),
                                     (4, "eval"), (5, "train"), (6, "train"), (6, "eval"), (7, "train"),
                                     (8, "train"), (8, "eval")]
  assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir()) == [3, 6, 8]
  logged = {r["step"]: r["eval_loss"] for r in read_records(config.workdir) if "eval_loss" in r}
  np.testing.assert_allclose([logged[s] for s in (2, 4, 6, 8)], [evals[s] for s in (2, 4, 6, 8)], rtol=1e-6)


def test_each_step_is_fetched_after_the_next_is_dispatched_except_before_a_save(make_config, monkeypatch):
  """The overlap that keeps the loop at the speed of a hand-written one: the host reads step N's metrics while the
  device runs N+1; only a step about to be saved is read before the next one starts."""
  dispatched, fetched, fetch = count_dispatched_steps(monkeypatch), [], loop._fetch

  def recorded(held):
    if held is not None:
      fetched.append((held[0], dispatched[0]))
    return fetch(held)

  monkeypatch.setattr(loop, "_fetch", recorded)
  trainer.train(_config(make_config, steps=5, every_steps=2))
  # (step fetched, steps dispatched by then): 2 and 4 save every 2 steps, 5 is the last.
  assert fetched == [(1, 2), (2, 2), (3, 4), (4, 4), (5, 5)]

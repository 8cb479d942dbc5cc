"""GRPO (train.objective=grpo): the sampler's log-probabilities against the training forward's, each policy loss
(rl.loss: grpo, dapo, dr_grpo, gspo) against a float64 implementation of its paper, DAPO's overlong shaping and
dynamic sampling, the reward pool (rl.reward_workers: the trainer's scores, a failure costing one completion one
reward, no process left), sharded equal to one device, the prompt stream's position, bad input, and (slow) a 2-process
job equal to one process with a reward drawn at random, docs/post_training.md's letter-reversal commands as written
(a tiny model whose held-out reward rises), resumed bitwise after a SIGKILL."""

import json
import os
import pathlib
import runpy
import shlex
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain import sampling
from jaxtrain import sharding as sharding_lib
from jaxtrain.data import prompts as prompts_lib
from jaxtrain.errors import ConfigError
from jaxtrain.metrics import read_records
from jaxtrain.train import objectives, start, trainer
from jaxtrain.train.objectives import grpo, policy_losses, rollout
from jaxtrain.train.objectives import rewards as rewards_lib
from jaxtrain.train.objectives.logprobs import token_logps
from tests import forked, grpo_rewards, multiprocess, readme
from tests.conftest import small_config
from tests.test_moe import moe_config

# The task (tools/letter_prompts.py, docs/post_training.md's GRPO example): "xy>" -> "yx" then a newline; 48 pairs
# train, 16 held out (each letter seen in both places). MODEL: configs/grpo_letters.py's.
MODEL = {"num_layers": 2, "d_model": 64, "num_heads": 8, "num_kv_heads": 4, "head_dim": 16, "mlp_dim": 128,
         "vocab_size": 256}
# The page's commands (a unique part of each): the prompts written, the format fine-tuned, GRPO from it.
LETTERS_DATA, LETTERS_SFT, LETTERS_GRPO = ("tools/letter_prompts.py", "configs/grpo_letters.py:sft",
                                           "configs/grpo_letters.py:grpo")


def write_task(folder: pathlib.Path) -> pathlib.Path:
  runpy.run_path(str(readme.ROOT / "tools" / "letter_prompts.py"))["write"](folder)
  return folder


def grpo_config(workdir, task_dir: pathlib.Path, **mesh):
  c = small_config(workdir, **mesh)
  c.train.update(objective="grpo", steps=4, global_batch_size=64, log_every=1)
  c.data.update(source="prompts", path=str(task_dir / "train.jsonl"), seq_len=8)
  c.rl.update(group_size=8, max_new_tokens=4, stop=("\n",), kl_weight=0.04)
  c.optim.update(lr=1e-3, warmup_steps=0, schedule="constant")
  c.checkpoint.verify = False  # (nothing restores these runs' checkpoints: no fingerprint program compiled)
  return c


def grpo_flags(data: pathlib.Path) -> list[str]:
  """The same run as :func:`grpo_config`, as jaxtrain.main's flags (for configs/tiny.py)."""
  return ["--config=configs/tiny.py", *[f"--config.model.{k}={v}" for k, v in MODEL.items()],
          "--config.train.objective=grpo", "--config.train.global_batch_size=64", "--config.train.log_every=1",
          "--config.data.source=prompts", f"--config.data.path={data / 'train.jsonl'}", "--config.data.seq_len=8",
          "--config.rl.group_size=8", "--config.rl.max_new_tokens=4", "--config.rl.stop=('\\n',)",
          "--config.optim.warmup_steps=0", "--config.optim.schedule=constant", "--config.optim.lr=0.001",
          "--config.mesh.fsdp=1", "--config.mesh.data=-1"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return write_task(tmp_path_factory.mktemp("grpo_task"))


# Pieces ---------------------------------------------------------------------------------------------------------


def test_group_advantages_and_loss_equal_a_float64_implementation():
  """Advantages: (r - group mean) / (sample std + 1e-4); the loss: the clipped surrogate plus the k3 KL, per
  completion the mean over its tokens, then the mean over completions; computed again here in float64."""
  rng = np.random.default_rng(0)
  rewards = rng.integers(0, 2, 16).astype(np.float64)
  adv = grpo.group_advantages(rewards, 4)
  for g in range(4):
    r = rewards[4 * g:4 * g + 4]
    np.testing.assert_allclose(adv[4 * g:4 * g + 4], (r - r.mean()) / (np.std(r, ddof=1) + 1e-4), rtol=1e-6)
  rows, t = 16, 6
  mask = (np.arange(t)[None] >= rng.integers(1, 5, (rows, 1))).astype(np.float32)
  logps, old, ref = (rng.normal(-2, 0.3, (rows, t)).astype(np.float32) * mask for _ in range(3))
  batch = {"loss_mask": mask, "old_logps": old, "ref_logps": ref, "advantages": adv}
  loss, aux = jax.jit(lambda lp, b: grpo.grpo_loss(lp, b, 0.2, 0.04))(logps, batch)
  lp, o, rf, a = (np.asarray(x, np.float64) for x in (logps, old, ref, adv))
  ratio = np.exp(lp - o)
  surrogate = -np.minimum(ratio * a[:, None], np.clip(ratio, 0.8, 1.2) * a[:, None])
  kl = np.exp(rf - lp) - (rf - lp) - 1
  per_seq = ((surrogate + 0.04 * kl) * mask).sum(1) / mask.sum(1)
  np.testing.assert_allclose(float(loss), per_seq.mean(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(aux["rl/kl"]), (kl * mask).sum() / mask.sum(), rtol=1e-5, atol=1e-7)
  clipped = (np.clip(ratio, 0.8, 1.2) * a[:, None] < ratio * a[:, None]) & (mask > 0)
  np.testing.assert_allclose(float(aux["rl/clip_fraction"]), clipped.sum() / mask.sum(), rtol=1e-6)


# The policy losses (rl.loss): each against a float64 implementation of its paper's formula ------------------------

L_MAX = 10  # rl.max_new_tokens of the loss tests (dr_grpo divides by it)


def _loss_inputs(seed: int = 2):
  """16 rows (4 groups of 4: rewards of both signs and one group of equal rewards) of 12 positions, each row's
  completion 1 to 10 tokens at its end; log-ratios of spread 0.3 (token ratios well outside [0.8, 1.2]) and, in
  rows 0-5, of 1e-5 (sequence ratios inside gspo's [1 - 3e-4, 1 + 4e-4])."""
  rng = np.random.default_rng(seed)
  rows, t = 16, 12
  rewards = rng.normal(0, 1, rows)
  rewards[4:8] = 0.7  # a degenerate group: advantages exactly 0
  mask = (np.arange(t)[None] >= t - rng.integers(1, L_MAX + 1, (rows, 1))).astype(np.float32)
  logps = rng.normal(-2, 0.5, (rows, t)).astype(np.float32) * mask
  spread = np.where(np.arange(rows)[:, None] < 6, 1e-5, 0.3)
  old = (logps + rng.normal(0, 1, (rows, t)) * spread).astype(np.float32) * mask
  ref = (logps + rng.normal(0, 0.2, (rows, t))).astype(np.float32) * mask
  return rewards, logps, old, ref, mask


def _paper_advantages(name, rewards, g):
  r = np.asarray(rewards, np.float64).reshape(-1, g)
  centered = r - r.mean(1, keepdims=True)
  adv = centered if name == "dr_grpo" else centered / (r.std(1, ddof=1, keepdims=True) + 1e-4)
  return np.where(np.ptp(r, axis=1, keepdims=True) == 0, 0.0, adv).reshape(-1)


def _paper_loss(name, logps, old, ref, adv, mask, kl_weight):
  """(loss, rl/kl, rl/clip_fraction, d loss / d logps, the loss of the terms' absolute values) in float64, from the
  papers' formulas (the gradient by hand: d rho/d logp = rho; the clipped term's is 0 where it is taken; d k3/d logp
  = 1 - exp(ref - logp)). rl/kl is 0 without a KL term."""
  lp, o, rf, a, m = (np.asarray(x, np.float64) for x in (logps, old, ref, adv, mask))
  real = m > 0
  n, b = real.sum(1), len(a)
  k3 = np.where(real, np.exp(rf - lp) - (rf - lp) - 1, 0.0)
  kl = k3.sum() / n.sum() if kl_weight else 0.0
  dk3 = np.where(real, 1 - np.exp(rf - lp), 0.0)
  if name == "gspo":
    s = np.exp(np.where(real, lp - o, 0.0).sum(1) / n)
    clipped = np.clip(s, 1 - 3e-4, 1 + 4e-4)
    taken = clipped * a < s * a
    per_seq = -np.minimum(s * a, clipped * a) + kl_weight * k3.sum(1) / n
    ds = np.where(taken, 0.0, -a * s)[:, None] * real / n[:, None]  # d/dlogp of -min(s A, clip(s) A)
    grad = (ds + kl_weight * dk3 / n[:, None]) / b
    return per_seq.mean(), kl, taken.mean(), grad, np.abs(per_seq).mean()
  high = 0.28 if name == "dapo" else 0.2
  rho = np.exp(lp - o)
  clipped = np.clip(rho, 0.8, 1 + high)
  taken = (clipped * a[:, None] < rho * a[:, None]) & real
  terms = np.where(real, -np.minimum(rho * a[:, None], clipped * a[:, None]) + kl_weight * k3, 0.0)
  dterms = np.where(real & ~taken, -a[:, None] * rho, 0.0) + kl_weight * dk3
  weight = 1 / (b * n[:, None]) if name == "grpo" else 1 / n.sum() if name == "dapo" else 1 / (b * L_MAX)
  return (terms * weight).sum(), kl, taken.sum() / n.sum(), dterms * weight, (np.abs(terms) * weight).sum()


@pytest.mark.parametrize("kl_weight", [0.0, 0.04])
@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_each_policy_loss_equals_a_float64_implementation_of_its_paper(name, kl_weight):
  """rl.loss=<name> through its registry entry, as the update calls it (the rl group's keys at their defaults): its
  advantages, loss, rl/kl, rl/clip_fraction and gradient wrt the log-probs against the paper's formula computed
  again here in float64 (policy_losses' docstring): random rows of 1 to 10 completion tokens, advantages of both
  signs and a group of equal rewards, ratios inside and outside the clip range. The loss sums float32 terms of both
  signs: its error is measured against the same sum of their absolute values (float32's own bound), the metrics'
  and the gradient's against their own values (the gradient's largest element)."""
  entry = policy_losses.LOSSES.get(name)
  rl = config_lib.base_config().rl
  rl.update(loss=name, max_new_tokens=L_MAX, kl_weight=kl_weight)
  rewards, logps, old, ref, mask = _loss_inputs()
  adv = entry.advantages(rewards, 4)
  want_adv = _paper_advantages(name, rewards, 4)
  assert adv.dtype == np.float32 and (adv[4:8] == 0).all()
  np.testing.assert_allclose(adv, want_adv, rtol=1e-6, atol=1e-7)
  batch = {"loss_mask": mask, "old_logps": old, "ref_logps": ref, "advantages": adv}
  (loss, aux), grad = jax.jit(jax.value_and_grad(lambda lp, b: entry.loss(lp, b, rl), has_aux=True))(logps, batch)
  want, kl, clip, want_grad, scale = _paper_loss(name, logps, old, ref, adv, mask, kl_weight)
  errors = {"loss": abs(float(loss) - want) / scale, "rl/kl": abs(float(aux["rl/kl"]) - kl) / max(kl, 1e-30),
            "rl/clip_fraction": abs(float(aux["rl/clip_fraction"]) - clip) / clip,
            "grad": float(np.abs(np.asarray(grad, np.float64) - want_grad).max() / np.abs(want_grad).max())}
  print(name, kl_weight, f"loss {float(loss):.6g} (relative to itself {abs(float(loss) - want) / abs(want):.1e})",
        {k: f"{v:.1e}" for k, v in errors.items()})
  assert 0 < clip < 1 and (kl > 0) == (kl_weight > 0)  # (some terms clipped, some not; the KL term there or not)
  assert float(aux["rl/kl"]) == 0 if not kl_weight else errors["rl/kl"] < 1e-6
  assert all(e < 1e-6 for e in errors.values()), errors


def test_grpo_loss_is_bitwise_what_it_was():
  """rl.loss=grpo, moved to policy_losses, computes what grpo.grpo_loss computed before (its code as it was, here):
  the same bits of the loss, its metrics and its gradient; grpo.py's names are the same functions."""
  import jax.numpy as jnp

  def before(logps, batch, clip_epsilon, kl_weight):
    real = batch["loss_mask"] > 0
    adv = batch["advantages"][:, None]
    ratio = jnp.exp(jnp.where(real, logps - batch["old_logps"], 0.0))
    clipped = jnp.clip(ratio, 1 - clip_epsilon, 1 + clip_epsilon)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    kl = jnp.zeros_like(logps)
    if kl_weight:
      d = jnp.where(real, batch["ref_logps"] - logps, 0.0)
      kl = jnp.exp(d) - d - 1
      per_token = per_token + kl_weight * kl
    tokens = jnp.sum(real, axis=1).astype(jnp.float32)
    per_sequence = jnp.sum(jnp.where(real, per_token, 0.0), axis=1) / jnp.maximum(tokens, 1.0)
    loss = jnp.mean(per_sequence)
    count = jnp.maximum(jnp.sum(tokens), 1.0)
    taken = real & (clipped * adv < ratio * adv)
    return loss, {"rl/kl": jnp.sum(jnp.where(real, kl, 0.0)) / count,
                  "rl/clip_fraction": jnp.sum(taken.astype(jnp.float32)) / count}

  assert grpo.grpo_loss is policy_losses.grpo_loss and grpo.group_advantages is policy_losses.group_advantages
  rewards, logps, old, ref, mask = _loss_inputs(3)
  batch = {"loss_mask": mask, "old_logps": old, "ref_logps": ref, "advantages": grpo.group_advantages(rewards, 4)}
  for kl_weight in (0.0, 0.04):
    got, was = (jax.jit(jax.value_and_grad(lambda lp, b, f=f, w=kl_weight: f(lp, b, 0.2, w), has_aux=True))(
        logps, batch) for f in (grpo.grpo_loss, before))
    assert all((np.asarray(x) == np.asarray(y)).all() for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(was)))


def test_overlong_shaping_is_dapos_formula_added_before_the_advantages():
  """DAPO's soft overlong punishment, L_max = 16, L_cache = 4: 0 up to 12 tokens, (12 - |y|) / 4 from 13 to 16 (-1
  at 16); off at 0. score_once adds it to the summed reward before the advantages and logs rl/reward/overlong."""
  from jaxtrain.train.objectives import rewards as rewards_lib
  lengths = np.arange(17)
  want = [0.0 if y <= 12 else (12 - y) / 4 for y in lengths]
  assert policy_losses.overlong_penalty(lengths, 16, 4).tolist() == want
  assert policy_losses.overlong_penalty(lengths, 16, 4)[-1] == -1 and not policy_losses.overlong_penalty(
      lengths, 16, 0).any()
  assert policy_losses.overlong_penalty(np.array([0, 8, 16]), 16, 16).tolist() == [0.0, -0.5, -1.0]
  ones = rewards_lib.Reward("one", 2.0, lambda completions, records: [1.0] * len(completions))
  lengths = np.array([3, 13, 14, 16, 5, 6, 7, 8])
  shaping = policy_losses.overlong_penalty(lengths, 16, 4)
  adv, metrics = grpo.score_once([ones], ["x"] * 8, [{}] * 8, 4, shaping={"overlong": shaping})
  assert (adv == policy_losses.group_advantages(2.0 + shaping, 4)).all() and (adv[4:] == 0).all()
  assert metrics == {"rl/reward_mean": float(np.mean(2.0 + shaping)), "rl/reward_std": float(np.std(2.0 + shaping)),
                     "rl/reward/one": 1.0, "rl/reward/overlong": float(shaping.mean())}
  adv, _ = grpo.score_once([ones], ["x"] * 8, [{}] * 8, 4, policy_losses.centered_advantages, {"overlong": shaping})
  assert (adv == policy_losses.centered_advantages(2.0 + shaping, 4)).all()


# DAPO's dynamic sampling ------------------------------------------------------------------------------------------


class _StandIn:
  """What Trainer._dynamic_sampling reads of its trainer: the config, the prompts table (10 records), a rollout
  (row r's completion: its record's index and r, as text) and rewards: equal in a group unless ``varied(record,
  rollout)`` (the rollout's number, 0 the step's own), then 0 and 1."""

  def __init__(self, dynamic: bool, rounds: int = 3, varied=lambda record, rollout: record % 2 == 1):
    self.config = config_lib.base_config()
    self.config.rl.update(group_size=2, dynamic_sampling=dynamic, dynamic_sampling_rounds=rounds)
    self.config.train.seed = 3
    ids = [np.array([97 + i], np.int32) for i in range(10)]
    self.table = prompts_lib.PromptSet("t.jsonl", [{"prompt": chr(97 + i)} for i in range(10)], ids,
                                       [chr(97 + i) for i in range(10)])
    self.varied, self.seeds = varied, []

  def _rollout(self, params, host, seed):
    self.seeds.append(seed)
    done = object.__new__(grpo.Completions)
    records = prompts_lib.record_indices(host)
    done.tokens = np.stack([records, np.arange(len(records))], 1)
    done.produced, done.logps = np.full(len(records), 2), np.zeros((len(records), 2), np.float32)
    done.texts = [f"{i}:{r}" for r, i in enumerate(records)]
    return done

  def _rewarded(self, host, done):
    records = prompts_lib.record_indices(host)
    varied = [self.varied(int(i), len(self.seeds) - 1) for i in records]
    rewards = np.where(varied, np.arange(len(records)) % 2, 1.0)
    return policy_losses.group_advantages(rewards, 2), {"rl/reward_mean": float(rewards.mean()),
                                                        "rl/reward_failures": 1.0}  # (one a rollout: all counted)


def _dynamic_sampling(stand_in, step=4):
  """Trainer._dynamic_sampling on the stand-in after its step's own rollout of records 0-3: (its result, (the rows
  and completions it was given))."""
  host = {k: v for k, v in prompts_lib.rows(stand_in.table.ids, np.repeat([0, 1, 2, 3], 2), 1).items()
          if k in ("inputs", "positions", "segment_ids", "targets")}
  done = stand_in._rollout(None, host, grpo.sampling_seed(3, step))
  advantages, metrics = stand_in._rewarded(host, done)
  return grpo.Trainer._dynamic_sampling(stand_in, None, step, host, done, advantages, metrics), (host, done)


def test_dynamic_sampling_refills_degenerate_groups_in_order_from_rounds_seeded_by_seed_step_round():
  """The pieces: degenerate groups are those whose advantages are all exactly 0 (equal rewards, 0.1 included, whose
  mean is not 0.1 exactly, are); the i-th degenerate group takes the i-th varied group of the new rollout; round k's
  prompts and sampling seed derive from (seed, step, k), round 0's seed is the step's own. The Trainer's loop, on
  stand-ins: groups 0 and 2 (even records) are refilled, prompt rows, completions and advantages together, by the
  first two varied groups of round 1's prompts; the same again gives the same; without rl.dynamic_sampling nothing
  changes; rounds stop at rl.dynamic_sampling_rounds, degenerate groups left as they are."""
  rewards = np.array([1, 1, 1, 0, 1, 0, .1, .1, .1, 2, 2, 2.5])  # (the mean of three 0.1 is not 0.1)
  assert grpo.degenerate_groups(grpo.group_advantages(rewards, 3), 3).tolist() == [True, False, True, False]
  assert grpo.degenerate_groups(policy_losses.centered_advantages(rewards, 3), 3).tolist() == [True, False, True,
                                                                                                 False]
  assert grpo.degenerate_groups(np.array([0, 0, 0, 1e-9], np.float32), 2).tolist() == [True, False]
  assert grpo.refill(np.array([0, 1, 1, 0, 1], bool), np.array([1, 0, 1, 0, 0], bool)) == [(1, 1), (2, 3), (4, 4)]
  assert grpo.refill(np.array([1, 1], bool), np.array([1, 0], bool)) == [(0, 1)]
  assert grpo.refill(np.array([1, 1], bool), np.array([1, 1], bool)) == []
  assert grpo.refill_seed(3, 5, 0) == grpo.sampling_seed(3, 5)
  assert len({grpo.refill_seed(3, s, k) for s in (5, 6) for k in range(4)}) == 8
  drawn = grpo.refill_prompts(3, 5, 1, 48, 8)
  assert (drawn == grpo.refill_prompts(3, 5, 1, 48, 8)).all() and len(set(drawn.tolist())) == 8 and drawn.max() < 48
  for other in ((3, 5, 2), (3, 6, 1), (4, 5, 1)):
    assert not (drawn == grpo.refill_prompts(*other, 48, 8)).all(), other
  assert set(grpo.refill_prompts(3, 5, 1, 3, 8).tolist()) <= {0, 1, 2}  # (fewer records than groups: repeats)

  stand_in = _StandIn(dynamic=True)
  (host, done, advantages, metrics), (host0, done0) = _dynamic_sampling(stand_in)
  fresh = grpo.refill_prompts(3, 4, 1, 10, 4).tolist()  # (varied groups first: 7, 9, 2, 6)
  sources = [j for j, i in enumerate(fresh) if i % 2 == 1][:2]
  assert len(sources) == 2, fresh  # (round 1 has varied groups enough for both)
  want = [fresh[sources[0]]] * 2 + [1, 1] + [fresh[sources[1]]] * 2 + [3, 3]
  assert prompts_lib.record_indices(host).tolist() == want, (fresh, host)
  texts = [f"{fresh[j]}:{2 * j + r}" for j in sources for r in (0, 1)]
  assert done.texts == [*texts[:2], *done0.texts[2:4], *texts[2:], *done0.texts[6:]]
  assert (done.tokens[:, 0] == want).all() and (host["inputs"][:, -1] == 97 + np.array(want)).all()
  assert not grpo.degenerate_groups(advantages, 2).any()
  assert prompts_lib.record_indices(host0).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # (the inputs are not changed)
  assert {k: v for k, v in metrics.items() if k != "rl/dynamic_sampling_s"} == {
      "rl/reward_mean": 0.75, "rl/degenerate_groups": 0.0, "rl/degenerate_groups_rollout": 2.0,
      "rl/sampling_rounds": 1.0, "rl/reward_failures": 2.0}
  assert stand_in.seeds == [grpo.sampling_seed(3, 4), grpo.refill_seed(3, 4, 1)]
  again = _dynamic_sampling(_StandIn(dynamic=True))[0]
  assert again[1].texts == done.texts and (again[2] == advantages).all()

  off, (host0, done0) = _dynamic_sampling(_StandIn(dynamic=False))
  assert off[0] is host0 and off[1] is done0
  assert off[3]["rl/degenerate_groups"] == off[3]["rl/degenerate_groups_rollout"] == 2
  assert off[3]["rl/sampling_rounds"] == 0
  stuck = _StandIn(dynamic=True, rounds=2, varied=lambda record, rollout: rollout == 0 and record % 2 == 1)
  (_, _, advantages, metrics), _ = _dynamic_sampling(stuck)
  assert metrics["rl/sampling_rounds"] == 2 and metrics["rl/degenerate_groups"] == 2 and len(stuck.seeds) == 3
  assert metrics["rl/reward_failures"] == 3  # (the step's rollout's and both rounds')


def test_the_reward_pool_scores_as_the_trainers_process_and_a_failure_costs_one_completion_one_reward(tmp_path,
                                                                                                       caplog):
  """rl.reward_workers=2, rl.reward_timeout_s=0.5. Well-behaved rewards (exact_match, format, letters) score in the
  pool bitwise what they score in the trainer's process, and score_once's advantages are those too. A completion
  whose reward ends its worker (os._exit(3), SIGSEGV), hangs (a process it started too), raises, or returns NaN or a
  string scores 0 for that reward alone, each warned of once (the reward, the completion, the cause) and counted
  exactly; the other completions and rewards score as in the trainer's process. The call takes about the timeout,
  not the hang; the hung workers and what they started were killed, every worker ended was replaced (2, none a
  zombie); closed, nothing the pool started is left."""
  psutil = pytest.importorskip("psutil")
  rl = grpo.defaults()
  rl.update(rewards="exact_match,format=0.1,tests.grpo_rewards:misbehaving=0.5", reward_workers=2,
            reward_timeout_s=0.5)
  rewards = rewards_lib.load(rl)
  texts = [f"{'ab' * (i % 4)} #### {i % 3}" for i in range(24)]
  records = [{"answer": str(i % 2), "pid_file": str(tmp_path / "pid")} for i in range(24)]
  pool = rewards_lib.open_pool(rewards, rl, start=True)
  assert rewards_lib.open_pool(rewards, rl) is pool  # (one per rl group: the trainer's is the evaluator's)
  started = []
  try:
    total, parts, failures = pool.score(texts, records)
    want_total, want_parts = rewards_lib.score(rewards, texts, records)
    assert total.tobytes() == want_total.tobytes() and parts.keys() == want_parts.keys(), (total, want_total)
    assert all(parts[k].tobytes() == want_parts[k].tobytes() for k in parts), (parts, want_parts)
    assert len(set(parts["exact_match"])) > 1 and len(set(parts["misbehaving"])) > 1  # (the values vary)
    assert failures == {"exact_match": 0, "format": 0, "misbehaving": 0}
    advantages, metrics = grpo.score_once(rewards, texts, records, 8, pool=pool)
    want_advantages, want_metrics = grpo.score_once(rewards, texts, records, 8)
    assert advantages.tobytes() == want_advantages.tobytes()
    assert metrics == {**want_metrics, "rl/reward_failures": 0.0, "rl/reward_failures/exact_match": 0.0,
                       "rl/reward_failures/format": 0.0, "rl/reward_failures/misbehaving": 0.0}

    bad = {1: "crash", 4: "hang", 7: "raise", 10: "nan", 13: "segv", 16: "crash", 19: "text", 22: "hang_child"}
    causes = {1: "its worker exited with code 3", 4: "took longer than rl.reward_timeout_s=0.5s (its worker was "
              "killed)", 7: "raised ValueError: cannot run 'raise'", 10: "returned nan",
              13: "its worker was killed by SIGSEGV", 16: "its worker exited with code 3",
              19: "did not return numbers (ValueError: could not convert string to float: 'seven')"}
    causes[22] = causes[4]
    failing = [bad.get(i, t) for i, t in enumerate(texts)]
    t0 = time.monotonic()
    with caplog.at_level("WARNING"):
      total, parts, failures = pool.score(failing, records)
    took = time.monotonic() - t0
    assert took < 10, took  # (the hangs sleep for 600 s)
    assert failures == {"exact_match": 0, "format": 0, "misbehaving": len(bad)}
    said = [r.getMessage() for r in caplog.records if "scored 0" in r.getMessage()]
    assert said == [f"reward misbehaving: completion {i} scored 0: {cause}" for i, cause in sorted(causes.items())]
    in_process = {**rewards_lib.score(rewards[:2], failing, records)[1],  # (exact_match and format fail nowhere)
                  "misbehaving": np.array([0.0 if i in bad else grpo_rewards.letters([t], [{}])[0]
                                           for i, t in enumerate(failing)])}
    assert all(parts[k].tobytes() == in_process[k].tobytes() for k in parts), (parts, in_process)
    assert total.tobytes() == (parts["exact_match"] + 0.1 * parts["format"] + 0.5 * parts["misbehaving"]).tobytes()
    started = [psutil.Process(pool.pid), *psutil.Process(pool.pid).children(recursive=True)]
    workers = started[1:]
    assert len(workers) == 2 and all(w.status() != psutil.STATUS_ZOMBIE for w in workers), workers
    sleeper = int((tmp_path / "pid").read_text())  # what the hung reward started: killed with its worker
    deadline = time.monotonic() + 5
    while psutil.pid_exists(sleeper) and psutil.Process(sleeper).status() != psutil.STATUS_ZOMBIE:
      assert time.monotonic() < deadline, "the hung reward's process lives on"
      time.sleep(0.05)
  finally:
    pool.close()
  assert pool.pid is None
  assert not psutil.wait_procs(started, timeout=5)[1]  # (none left alive)


# A trainer whose reward hangs (for 60 s: rl.reward_timeout_s) in a process it started.
_HUNG_TRAINER = """
import sys
from jaxtrain.train.objectives import grpo, rewards
rl = grpo.defaults()
rl.update(rewards="tests.grpo_rewards:misbehaving", reward_workers=1, reward_timeout_s=60)
rewards.open_pool(rewards.load(rl), rl).score(["hang_child"], [{"pid_file": sys.argv[1]}])
"""


def test_a_trainer_killed_while_a_reward_hangs_leaves_no_process_behind(tmp_path):
  """SIGKILL to a trainer (no close, no atexit) while its reward hangs in the pool: the pool's process, its worker
  and what the reward started all end within seconds."""
  psutil = pytest.importorskip("psutil")
  pid_file = tmp_path / "pid"
  trainer_process = subprocess.Popen([sys.executable, "-c", _HUNG_TRAINER, str(pid_file)], cwd=readme.ROOT)
  try:
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
      assert trainer_process.poll() is None and time.monotonic() < deadline, "the reward did not start"
      time.sleep(0.05)
    started = psutil.Process(trainer_process.pid).children(recursive=True)
    # The pool's process, its worker, the reward's own.
    assert len(started) == 3 and started[-1].pid == int(pid_file.read_text()), started
  finally:
    trainer_process.kill()
    trainer_process.wait()
  alive = psutil.wait_procs(started, timeout=10)[1]
  assert all(p.status() == psutil.STATUS_ZOMBIE for p in alive), alive  # (a zombie is dead, its parent not ours)


def test_reward_failure_lines_are_limited_per_minute_and_the_rest_counted_in_one_line(caplog):
  warnings = rewards_lib._Warnings(lines=3, window_s=0.2)
  with caplog.at_level("WARNING"):
    for i in range(10):
      warnings.say(f"failure {i}")
    warnings.flush()
    said = [r.getMessage() for r in caplog.records]
    assert said == ["failure 0", "failure 1", "failure 2"]
    time.sleep(0.25)
    warnings.flush()
    said = [r.getMessage() for r in caplog.records]
  assert len(said) == 4 and said[3].startswith("7 more reward failures in the last 0s, not shown"), said


@pytest.mark.parametrize("key,value,message", [
    ("reward_workers", -1, "rl.reward_workers: must be >= 0, got -1"),
    ("reward_timeout_s", 0.0, "rl.reward_timeout_s: must be > 0 and finite, got 0.0"),
    ("reward_timeout_s", float("inf"), "rl.reward_timeout_s: must be > 0 and finite, got inf")])
def test_reward_pool_keys_out_of_range_are_one_line(tmp_path, key, value, message):
  c = small_config(tmp_path)
  c.rl[key] = value
  with pytest.raises(ConfigError) as e:
    grpo.validate(c)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_prompt_stream_repeats_each_prompt_per_group_and_resumes_where_it_was(task, tmp_path):
  c = config_lib.resolve(grpo_config(tmp_path, task))
  stream = prompts_lib.open_train(c)
  first = [prompts_lib.record_indices(next(stream)) for _ in range(3)]
  assert all((b.reshape(8, 8) == b.reshape(8, 8)[:, :1]).all() for b in first)  # groups of 8 rows, one prompt
  assert len({int(i) for b in first for i in b}) == 24  # 3 steps x 8 prompts, none repeated within an epoch
  saved = stream.get_state()
  later = [prompts_lib.record_indices(next(stream)) for _ in range(4)]  # crosses into the second epoch
  resumed = prompts_lib.open_train(c)
  resumed.set_state(resumed.resplit([saved, saved]))
  assert all((a == prompts_lib.record_indices(next(resumed))).all() for a in later)
  # Two processes: each takes its half of the same global rows.
  halves = [prompts_lib.PromptStream(stream.prompts, 5, 64, 8, c.train.seed, p, 2) for p in range(2)]
  glued = np.concatenate([prompts_lib.record_indices(next(h)) for h in halves])
  assert (glued == first[0]).all()


@pytest.fixture(scope="module")
def sharded_losses(task, tmp_path_factory):
  """The first GRPO step's loss (and the scoring's log-probs) of one fixed batch on several meshes."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(97, 105, (64, 9)).astype(np.int32)
  advantages = grpo.group_advantages(rng.integers(0, 2, 64).astype(np.float64), 8)
  out = {}
  for name, mesh, rank in (("one", dict(data=1, fsdp=1), 0), ("fsdp_tensor", dict(fsdp=2, tensor=2), 0),
                           ("one_lora", dict(data=1, fsdp=1), 4), ("fsdp_tensor_lora", dict(fsdp=2, tensor=2), 4)):
    c = grpo_config(tmp_path_factory.mktemp(name), task, **mesh)
    c.model.update(**MODEL)
    if rank:
      c.model.lora.update(rank=rank, alpha=8.0)
    c = config_lib.resolve(c)
    devices = jax.devices()[:4 if mesh.get("fsdp") == 2 else 1]
    run = trainer.build(c, devices)
    state = start.starting_state(run)
    if rank:  # adapters not at their zero start, so that they count
      state = state.replace(params=jax.tree_util.tree_map_with_path(
          lambda p, x: x + 0.01 if "lora" in jax.tree_util.keystr(p) else x, state.params))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.tile(np.arange(8), (64, 1)),
             "segment_ids": np.ones((64, 8), np.int32),
             "loss_mask": (np.arange(8)[None] >= 4).repeat(64, 0).astype(np.float32),
             "advantages": advantages}
    abstract = objectives.of(c).abstract_batch(run)
    on = {k: jax.device_put(np.asarray(v, abstract[k].dtype), abstract[k].sharding) for k, v in batch.items()}
    logps = jax.jit(lambda p, b: token_logps(run.model, p, b))(state.params, on)
    on.update(old_logps=logps - 0.3 * on["loss_mask"], ref_logps=logps + 0.1 * on["loss_mask"])
    step = trainer.compile_step(run)
    with jax.set_mesh(run.mesh):
      _, metrics = step(state, on, np.bool_(False))
    out[name] = {k: float(v) for k, v in jax.device_get(metrics).items()}
  return out


def test_sharded_grpo_loss_equals_one_device(sharded_losses):
  for sharded, one in (("fsdp_tensor", "one"), ("fsdp_tensor_lora", "one_lora")):
    for key in ("loss", "rl/kl", "grad_norm"):
      assert abs(sharded_losses[sharded][key] - sharded_losses[one][key]) < 1e-5, (sharded, key, sharded_losses)
  assert sharded_losses["one"]["rl/kl"] > 0 and sharded_losses["one"]["rl/clip_fraction"] > 0  # terms present


@pytest.mark.parametrize("lora_rank,mesh,temperatures", [(0, {}, (1.0, 0.7)), (4, {"fsdp": 2, "tensor": 2}, (1.3,))])
def test_sampler_logps_equal_the_training_forward(task, tmp_path, lora_rank, mesh, temperatures):
  """The KV-cache sampler's log-probability of each token it samples equals the training forward's for the same row
  at the rollout's temperature (the logits divided by it on both sides): bitwise on one device at temperatures 1
  and 0.7 (the decode step attends over the training row's slots, so its reductions are the training forward's),
  and within 1e-5 with LoRA (the sampler merges the adapters once, the training forward in its step), a nucleus
  cut, and fsdp x tensor, where XLA partitions the two programs' contractions differently (docs/post_training.md).
  A generator that does not ask for log-probabilities returns what it always did."""
  c = grpo_config(tmp_path, task, **mesh)
  c.model.update(**MODEL)
  c.model.lora.update(rank=lora_rank, alpha=8.0)
  run = trainer.build(config_lib.resolve(c), jax.devices()[:int(np.prod(list(mesh.values())))])
  params = start.starting_state(run).params
  if lora_rank:  # adapters not at their zero start, so that they count
    params = jax.tree_util.tree_map_with_path(lambda p, x: x + 0.05 if "lora" in jax.tree_util.keystr(p) else x,
                                              params)
  table = prompts_lib.load(c.data.path, run.config)
  top_p = 0.9 if lora_rank else 1.0
  for temperature in temperatures:
    run.config.rl.update(temperature=temperature, top_p=top_p)
    gen = grpo.rollout_generator(run, 64, (10,))
    batch = gen.batch([table.ids[i % len(table.ids)] for i in range(64)])
    with jax.set_mesh(run.mesh):
      done = grpo.Completions(gen(params, batch, seed=3), (10,), prompts_lib._tokenizer("byte"))
    if lora_rank:  # the rollout layout: the 4 KV heads over 4 devices, LoRA merged into it
      assert gen.layout.tensor == 4 and "lora" not in gen.layout.abstract
      q = gen.layout.abstract["layers"]["attn"]["q"]["kernel"]  # [layers, embed, heads, head_dim]: heads split
      assert q.sharding.shard_shape(q.shape) == (2, 64, 2, 16), q.sharding
      plain = sampling.Generator(run.model, run.mesh, run.rules, run.state_shardings.params, rows=64, prompt_len=5,
                                 max_new_tokens=4, sampling=sampling.Sampling(temperature, 0, top_p), eos_ids=(10,))
      with jax.set_mesh(run.mesh):
        again = plain(params, batch, seed=3)
      assert len(again) == 3 and (np.asarray(again[0]) == done.tokens).all()  # (tokens, produced, state) as before
    host = {"inputs": batch.tokens, "positions": batch.positions, "segment_ids": batch.segment_ids}
    rows = grpo.update_batch(host, done, np.zeros(64, np.float32))
    with jax.set_mesh(run.mesh):
      trained = np.asarray(jax.jit(lambda p, b: token_logps(run.model, p, b, temperature=temperature))(params, rows))
    mismatch = grpo.Trainer._mismatch(trained, done, 5)
    if mesh:
      assert mismatch < 1e-5, mismatch
    else:
      assert mismatch == 0.0, (temperature, mismatch)
    assert np.abs(done.logps).sum() > 1  # (real log-probabilities were compared)


def test_rollout_layout_casts_kernels_once_splits_over_kv_heads_and_refuses_what_does_not_fit(task, tmp_path):
  """The rollout layout (rl.rollout_tensor) of a bfloat16 model on fsdp 4: by default tensor-parallel over its 4 KV
  heads, the kernels and the embedding table cast to bfloat16 (bitwise the cast the forward makes), the norm scales
  left float32; a size that does not divide the devices or the model is one line naming the key."""
  c = grpo_config(tmp_path, task, fsdp=4)
  c.model.update(**MODEL, dtype="bfloat16")
  run = trainer.build(config_lib.resolve(c), jax.devices()[:4])
  layout = rollout.Layout(run, 64)
  assert layout.tensor == 4 and dict(layout.mesh.shape)["data"] == 1
  params = start.starting_state(run).params
  put = jax.device_get(layout.put(params))
  host = jax.device_get(params)
  assert put["embed"]["embedding"].dtype == np.dtype("bfloat16")
  assert (put["layers"]["mlp"]["up"]["kernel"] == host["layers"]["mlp"]["up"]["kernel"].astype("bfloat16")).all()
  assert put["final_norm"]["scale"].dtype == np.float32
  half = sharding_lib.total_bytes(run.model.abstract_params) / 2  # (bfloat16: half the float32 bytes; norms stay)
  assert half / 4 <= layout.weight_bytes() < half / 4 * 1.05, layout.weight_bytes()
  for asked, said in ((3, "rl.rollout_tensor: 3 does not divide the 4 devices"),
                      (8, "rl.rollout_tensor: 8 does not divide the 4 devices")):
    run.config.rl.update(rollout_tensor=asked)
    with pytest.raises(config_lib.ConfigError) as e:
      rollout.Layout(run, 64)
    assert str(e.value).startswith(said), str(e.value)
  run.config.rl.update(rollout_tensor=0)
  assert rollout.Layout(run, 64).put(params) is params  # the training layout


def test_a_lora_run_on_fsdp_x_tensor_measures_kl_against_the_adapters_off_reference(task, tmp_path):
  """GRPO with LoRA on fsdp x tensor: the reference is the base with the adapters off (no copy), so at step 1 (the
  adapters' B at 0) the policy is the reference and the KL is exactly 0; after updates it is not. Every step's
  sampler log-probabilities equal the training forward's within 1e-5. With rl.dynamic_sampling (a reward that about
  half the groups get equal: tests.grpo_rewards:starts_lower): fewer groups of equal rewards are trained than the
  rollouts drew (at step 1 the step's own rollout is what a run without dynamic sampling trains), and the refilled
  rows' log-probabilities, each completion with its prompt, match too."""
  c = grpo_config(tmp_path, task, fsdp=2, tensor=2)
  c.model.update(**MODEL)
  c.model.lora.update(rank=4, alpha=8.0)
  c.train.update(steps=3)
  c.rl.update(rewards="tests.grpo_rewards:starts_lower", dynamic_sampling=True)
  c.optim.update(lr=1e-2)
  _, history = trainer.train(config_lib.resolve(c), devices=jax.devices()[:4])
  assert grpo.reference_mode(c) == "adapters_off"
  kl = [h["rl/kl"] for h in history]
  assert kl[0] == 0.0 and kl[-1] > 0, kl
  assert max(h["rl/logp_mismatch"] for h in history) < 1e-5
  trained, drawn = ([h[k] for h in history] for k in ("rl/degenerate_groups", "rl/degenerate_groups_rollout"))
  print(f"degenerate groups trained {trained}, drawn {drawn}, rounds {[h['rl/sampling_rounds'] for h in history]}")
  assert all(t <= d for t, d in zip(trained, drawn)) and trained[0] < drawn[0], (trained, drawn)
  assert all(np.isfinite(h["loss"]) and h["rl/completion_length"] >= 1 for h in history)


def test_a_moe_models_router_losses_are_in_the_policy_loss(task, tmp_path):
  """GRPO on a MoE model: the first update's policy loss is 0 (the ratio is 1 and a group's advantages sum to 0),
  so its loss is the router's auxiliary losses weighted by their keys, as the language model's step adds them, and
  they are logged (aux_loss/<name>)."""
  c = grpo_config(tmp_path, task)
  c.model = moe_config(tmp_path, steps=1).model
  c.train.update(steps=1)
  c.rl.update(rewards="tests.grpo_rewards:letters", kl_weight=0.0)
  _, history = trainer.train(config_lib.resolve(c), devices=jax.devices()[:1])
  first = history[0]
  aux = {n: first[f"aux_loss/{n}"] for n in ("load_balance", "router_z")}
  assert all(v > 0 for v in aux.values()) and first["rl/reward_std"] > 0, first
  want = c.model.load_balance_weight * aux["load_balance"] + c.model.router_z_weight * aux["router_z"]
  assert abs(first["loss"] - want) < 1e-6, (first["loss"], want)


@pytest.mark.parametrize("dynamic_sampling", [False, True])  # the rewards while the devices update; before it
def test_rollouts_ahead_are_the_policy_a_step_back_and_its_log_probabilities_divide_the_ratio(task, tmp_path,
                                                                                               dynamic_sampling):
  """rl.max_staleness=1: a fresh start first fills the state's queue with the starting policy's rollout; after step
  s the queue holds the rollout of step s + 1's prompts, sampled and scored by the policy step s started from: its
  old log-probabilities are that policy's training forward's, bitwise, and not the updated policy's. Step 2 trains the
  queued rollout of its own prompts, produced by the starting policy: its loss is the policy loss of the step-1
  policy on that rollout with the starting policy's log-probabilities in the ratio. With dynamic sampling (whose
  refills roll out by the policy the step starts from) the rewards come before the update; without, while the
  devices score and update."""
  c = grpo_config(tmp_path, task, data=1, fsdp=1)
  c.model.update(**MODEL)
  c.rl.update(max_staleness=1, rewards="tests.grpo_rewards:letters", kl_weight=0.0, dynamic_sampling=dynamic_sampling)
  c.optim.update(lr=1e-2)
  run = trainer.build(config_lib.resolve(c), jax.devices()[:1])
  objective = objectives.of(run.config)
  step = objective.step_fn(run, trainer.compile_step)
  try:
    state, stream = start.init_state(run), objective.open_train(run.config)
    params, queues, history = [], [], []
    for _ in range(2):
      params.append(jax.device_get(state.params))
      state, metrics = step(state, objective.to_global(run, next(stream)), np.bool_(False))
      queues.append(jax.device_get(state.extra["rollouts"]))
      history.append(jax.device_get(metrics))
    params.append(jax.device_get(state.params))
  finally:
    step.close()
  rows = sharding_lib.batch_sharding(run.mesh, run.rules, ndim=1)
  oldest = [{k: v[0] for k, v in q.items()} for q in queues]  # the queue's one rollout after step 1, after step 2

  def logps(p, batch):  # the trainer's own scoring program
    batch = {k: jax.device_put(v, run.batch_sharding if v.ndim == 2 else rows) for k, v in batch.items()
             if k not in ("old_logps", "ref_logps")}
    with jax.set_mesh(run.mesh):
      return np.asarray(step.score(jax.device_put(p, run.state_shardings.params), batch)[0])

  width = prompts_lib.prompt_width(run.config)
  for s, batch in enumerate(oldest, start=1):  # after step s: step s + 1's prompts, by the policy before step s
    assert np.array_equal(batch["inputs"][:, :width], stream.batch(s)["inputs"])
    assert batch["loss_mask"].sum() > 0 and np.any(batch["advantages"] != 0)
    np.testing.assert_array_equal(batch["old_logps"], logps(params[s - 1], batch))
    assert np.abs(batch["old_logps"] - logps(params[s], batch)).max() > 1e-4  # (the update moved them)
  with jax.set_mesh(run.mesh):
    loss, _ = jax.jit(lambda p, b: policy_losses.LOSSES.get("grpo").loss(token_logps(run.model, p, b), b, run.config.rl))(
        params[1], oldest[0])
  np.testing.assert_allclose(history[1]["loss"], loss, rtol=1e-6)


def test_updates_per_batch_update_the_optimizer_twice_and_count_one_step(task, tmp_path, caplog):
  """rl.updates_per_batch=2: two optimizer updates per rollout (the optimizer's own count is 4 after 2 steps, the
  second update of a batch sees a ratio away from 1), one loop and TrainState step each. The console line and the
  run's last line show GRPO's own figure, the mean reward (the objective's console_metrics). The rewards run in a
  pool of one worker (rl.reward_workers=1), none failing, and the pool's processes end with the run."""
  c = grpo_config(tmp_path, task, data=1, fsdp=1)
  c.model.update(**MODEL)
  c.train.update(steps=2)
  c.rl.update(updates_per_batch=2, rewards="tests.grpo_rewards:letters", clip_epsilon=0.01, reward_workers=1)
  c.optim.update(lr=1e-2)
  with caplog.at_level("INFO"):
    state, history = trainer.train(config_lib.resolve(c), devices=jax.devices()[:1])
  assert int(state.step) == 2 and [h["step"] for h in history] == [1, 2]
  said = [r.getMessage() for r in caplog.records]
  reward = f"rl/reward_mean {history[-1]['rl/reward_mean']:.4f}"
  assert [m for m in said if m.startswith("step 2/2 | loss ") and f"| {reward} |" in m], said[-5:]
  assert [m for m in said if m.startswith("done: step 2/2, loss ") and f", {reward}" in m], said[-5:]
  leaves = jax.tree_util.tree_leaves_with_path(state.opt_state)
  counts = [int(x) for p, x in leaves if "count" in jax.tree_util.keystr(p)]
  assert counts and set(counts) == {4}, counts
  assert all(h["rl/clip_fraction"] > 0 for h in history)  # (the mean over the two updates: the second one clips)
  assert [h["rl/reward_failures"] for h in history] == [0.0, 0.0]
  assert not [p for p in rewards_lib._POOLS if p.pid is not None]  # (closed at the run's end)




# Logged every step; what two runs of the same job must agree on (timings aside).
COMPARED = ("loss", "grad_norm", "lr", "rl/reward_mean", "rl/reward_std", "rl/reward/flaky_coin", "rl/kl",
            "rl/clip_fraction", "rl/completion_length", "rl/logp_mismatch")


@pytest.mark.slow  # a 2-process job and a 1-process run
def test_two_processes_train_as_one_on_a_reward_drawn_at_random_and_stop_as_one_when_it_fails(task, tmp_path):
  """A 2-process job (1 device each) logs, bitwise, what one process on 2 devices (the same mesh) logs at every
  step, with a reward drawn at random at every call (tests.grpo_rewards:flaky_coin, seeded by the process index:
  process 0 draws what the lone process draws, process 1 other values). The rewards are drawn on process 0 alone and
  broadcast; drawn on each process, process 1's rows would train on advantages of other draws than process 0's and
  the logged ones (jax's device_put stops such a job at step 1 as a bug). At step 4 the reward fails (NaN) on process
  0: it ends with the reward's one line and exit 2, and process 1, waiting for the rewards, with the same code and
  line; the 1-process run ends with that line too."""
  # The rollout layout one tensor-parallel group over both devices, across the two processes (by default it stays
  # within a process, so that the two jobs would sample on different layouts).
  flags = [*grpo_flags(task), "--config.rl.rewards=tests.grpo_rewards:flaky_coin", "--config.train.steps=5",
           "--config.rl.rollout_tensor=2",
           "--config.checkpoint.every_steps=5", "--config.distributed.heartbeat_timeout_s=5"]
  two = multiprocess.start_main([*flags, f"--config.workdir={tmp_path / 'two'}"], local_devices=1)
  one = multiprocess.start_main([*flags, f"--config.workdir={tmp_path / 'one'}"], num_processes=1, local_devices=2)
  codes = multiprocess.wait_all([*two, *one], 300)
  errs = [p.err_path.read_text() for p in (*two, *one)]
  assert codes == [2, 2, 2], [e[-2000:] for e in errs]
  line = "reward flaky_coin: returned a non-finite value; return finite floats"
  said = [[x for x in e.splitlines() if x.startswith("jaxtrain: error:")] for e in errs]
  assert said == [[f"jaxtrain: error: {line}"], [f"jaxtrain: error: process 0 stopped the job: {line}"],
                  [f"jaxtrain: error: {line}"]], said
  assert not any("Traceback" in e or "a process of the job is gone" in e for e in errs), errs
  # Steps 1 and 2 were logged before step 4 failed (metrics are fetched one step late).
  logged = {name: {r["step"]: tuple(r[k] for k in COMPARED) for r in read_records(tmp_path / name) if "loss" in r}
            for name in ("one", "two")}
  assert sorted(logged["one"])[:2] == [1, 2] and logged["two"] == logged["one"], logged
  assert all(values[COMPARED.index("rl/reward_std")] > 0 for values in logged["one"].values())  # (coins differed)


def test_bad_input_is_one_line_exit_2_nothing_written(task, tmp_path):
  """Every record of the prompts files is checked for the fields its rewards read (not the first alone): a record
  without its answer, or an rl.answer_field that names no field, is one line naming the file, line and field; an
  rl.loss that is not registered is one line naming the losses there are."""
  base = grpo_flags(task)
  lines = (task / "train.jsonl").read_text().splitlines()
  (tmp_path / "unanswered.jsonl").write_text("\n".join([*lines[:5], "", json.dumps({"prompt": "ab>"}), *lines[5:]]))
  held_out = (task / "held_out.jsonl").read_text().splitlines()
  (tmp_path / "held_out.jsonl").write_text("\n".join([*held_out[:3], json.dumps({"prompt": "ab>", "ans": "ba"})]))
  cases = [  # (flags, what the line names)
      (["--config=configs/tiny.py", "--config.train.objective=grpo"], "data.source"),
      ([*base, "--config.rl.rewards=no_such_module:reward"], "rl.rewards: 'no_such_module:reward': module"),
      ([*base, "--config.rl.rewards=tests.grpo_rewards:wrong_shape"], "reward wrong_shape: returned shape (3,)"),
      ([*base, "--config.rl.rewards=exact_match,nope=2"], "rl.rewards: 'nope' is not a registered reward"),
      ([*base, f"--config.data.path={tmp_path / 'unanswered.jsonl'}"],
       "unanswered.jsonl:7: has no 'answer' field, which reward exact_match reads (its fields: prompt); add 'answer' "
       "to every record, or set rl.answer_field to the field that holds it"),
      ([*base, "--config.rl.answer_field=answr"], "train.jsonl:1: has no 'answr' field, which reward exact_match "
       "reads (its fields: prompt, answer)"),
      ([*base, f"--config.data.eval_path={tmp_path / 'held_out.jsonl'}", "--config.eval.every_steps=2"],
       "held_out.jsonl:4: has no 'answer' field, which reward exact_match reads (its fields: prompt, ans)"),
      ([*base, "--config.rl.loss=ppo"], "rl.loss: 'ppo' is not a registered policy loss; use one of dapo, dr_grpo, "
       "grpo, gspo, or register yours with jaxtrain.train.objectives.policy_losses.LOSSES.register"),
  ]
  workdirs = [tmp_path / f"run{i}" for i in range(len(cases))]
  results = forked.run_many([["-m", "jaxtrain.main", *flags, f"--config.workdir={w}"]
                             for (flags, _), w in zip(cases, workdirs)])
  for (flags, message), result, workdir in zip(cases, results, workdirs):
    errors = [line for line in result.stderr.splitlines() if line.startswith("jaxtrain: error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and message in errors[0], (message, result.stderr[-2000:])
    assert not workdir.exists()


# End to end (slow) ----------------------------------------------------------------------------------------------


def _page_command(part: str, folder: pathlib.Path, *extra: str) -> str:
  """docs/post_training.md's command containing ``part``, run as written (plus ``extra`` flags) in ``folder`` on one
  device, as a CPU has: forked (tests/forked.py) from a process with the libraries imported; returns its output."""
  command = readme.command(part)
  argv = shlex.split(command)
  assert argv[0] == "python", command
  env = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=1"}
  r = forked.run([*argv[1:], *extra], env, timeout=600, cwd=folder)
  assert r.returncode == 0, f"{command}\n{r.stdout[-1000:]}\n{r.stderr[-3000:]}"
  return r.stdout + r.stderr


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
  """A fresh folder (the repository's configs/ and tools/ linked in) where the page's first two commands have run:
  the prompts written, the format fine-tuned (runs/letters_sft)."""
  folder = tmp_path_factory.mktemp("letters")
  for name in ("configs", "tools"):
    (folder / name).symlink_to(readme.ROOT / name)
  assert "48 training and 16 held-out prompts -> data/letters" in _page_command(LETTERS_DATA, folder)
  assert "done: step 60/60" in _page_command(LETTERS_SFT, folder)
  return folder


@pytest.fixture(scope="module")
def sft(letters):
  return letters / "runs" / "letters_sft" / "checkpoints"


@pytest.mark.slow
def test_grpo_raises_the_held_out_reward(letters, task):
  """docs/post_training.md's GRPO example as written (one device; every step logged): from the model fine-tuned
  briefly to the format (held-out reward < 0.5 at the first eval), GRPO raises the mean reward on held-out prompts
  by >= 0.3 within 100 steps, with the sampler's log-probabilities equal to the training forward's within 1e-5 at
  every step. The page's data are the suite's task."""
  for name in ("train", "held_out", "sft"):
    assert (letters / "data" / "letters" / f"{name}.jsonl").read_text() == (task / f"{name}.jsonl").read_text()
  assert "done: step 100/100" in _page_command(LETTERS_GRPO, letters, "--config.train.log_every=1")
  records = read_records(letters / "runs" / "grpo_letters")
  evals = {r["step"]: r["eval_reward_mean"] for r in records if "eval_reward_mean" in r}
  history = [r for r in records if "loss" in r]
  mismatch = max(h["rl/logp_mismatch"] for h in history)
  print("held-out reward: " + ", ".join(f"step {s} {v:.3f}" for s, v in evals.items())
        + f"; rl/logp_mismatch max {mismatch:.2e}")
  assert sorted(evals) == [20, 40, 60, 80, 100] and [h["step"] for h in history] == list(range(1, 101))
  first = evals[20]
  assert first < 0.5
  assert max(evals.values()) - first >= 0.3, evals
  assert mismatch < 1e-5
  assert all(h["rl/completion_length"] >= 1 for h in history)


@pytest.mark.slow
def test_sigkill_mid_run_resumes_to_bitwise_the_same_rewards_and_losses(task, sft, tmp_path):
  """Rollouts one step ahead (rl.max_staleness=1), killed once step 3's checkpoint is committed and resumed from it,
  log bitwise what the uninterrupted run logs: the checkpoint holds the queued rollout (the policy that produced it is
  gone), and each rollout's sampling key and prompts are its prompts' step's. (An on-policy resume needs a subset of
  this: the same state, prompts and keys, without the queue.)"""
  flags = [*grpo_flags(task), f"--config.checkpoint.restore_from={sft}", "--config.train.steps=8",
           "--config.checkpoint.every_steps=3", "--config.rl.max_staleness=1"]
  full, killed = tmp_path / "full", tmp_path / "killed"
  r = forked.run(["-m", "jaxtrain.main", *flags, f"--config.workdir={full}"])
  assert r.returncode == 0, r.stderr[-3000:]
  p = forked.popen(["-m", "jaxtrain.main", *flags, f"--config.workdir={killed}"])
  deadline = time.time() + 300
  while p.poll() is None and time.time() < deadline and not (killed / "checkpoints" / "3").is_dir():
    time.sleep(0.01)  # killed once step 3's checkpoint is committed (orbax renames it into place), steps later
  assert p.poll() is None, "the run finished before it could be killed"
  p.send_signal(signal.SIGKILL)
  p.communicate(timeout=60)
  r = forked.run(["-m", "jaxtrain.main", *flags, f"--config.workdir={killed}"])
  assert r.returncode == 0 and "resumed from checkpoint step" in r.stderr, r.stderr[-3000:]
  keys = ("loss", "grad_norm", "rl/reward_mean", "rl/reward_std", "rl/kl", "rl/completion_length")
  last = lambda w: {rec["step"]: tuple(rec[k] for k in keys) for rec in read_records(w) if "loss" in rec}  # noqa
  assert last(killed) == last(full) and sorted(last(full)) == list(range(1, 9))

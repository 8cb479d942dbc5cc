"""``grpo``: reinforcement learning with verifiable rewards, Group Relative Policy Optimization (Shao et al. 2024,
DeepSeekMath), and the ``rl`` config group.

A step (one loop step, one rollout):
  1. rollout: the step's prompts (``data.source=prompts``, :mod:`jaxtrain.data.prompts`: ``train.global_batch_size /
     rl.group_size`` prompts, each ``rl.group_size`` times) are completed by the current policy with jaxtrain's
     KV-cache sampler (:class:`jaxtrain.sampling.Generator`) on the rollout layout (:mod:`.rollout`,
     ``rl.rollout_tensor``: the weights cast to the compute dtype once and split over tensor-parallel groups): at
     ``rl.temperature`` within the nucleus ``rl.top_p``, up to ``rl.max_new_tokens`` tokens or a stop token
     (``rl.stop`` and the tokenizer's EOS). Row r of step s draws with a key derived from (``train.seed``, s): a
     resumed run samples what the uninterrupted one did.
  2. rewards, on the host of process 0 (:func:`score_once`): ``rl.rewards`` (:mod:`.rewards`; with
     ``rl.reward_workers`` > 0 in a pool of worker processes, each completion alone under ``rl.reward_timeout_s``, a
     failure scoring 0), weighted and summed per completion; the advantage of completion i of a group is
     ``(r_i - mean(r)) / (std(r) + 1e-4)`` over its group (sample std, ddof=1; ``rl.loss``'s advantages,
     :mod:`.policy_losses`, and ``rl.overlong_buffer``'s shaping added to the sum first); the advantages and the
     reward metrics are broadcast to every other process.
     With ``rl.dynamic_sampling``, groups of equal rewards are refilled from more rollouts (see its section below).
  3. scoring: the training forward (:func:`.logprobs.token_logps`) gives the completion tokens' log-probabilities
     under the policy (the "old" ones the ratio divides by) and under the reference (``rl.reference``: the starting
     params frozen, or with LoRA the base with the adapters off), both of the tempered distribution the rollout
     drew from (the logits divided by ``rl.temperature`` on both sides, :func:`.logprobs.tempered_logps`).
     ``rl/logp_mismatch`` is the largest difference between the sampler's log-probability of a sampled token and
     the training forward's: the same arithmetic (torchtitan's lesson), the decode step attending over the training
     row's slots; 0 where XLA compiles both programs' contractions alike (one device, and the meshes
     docs/post_training.md lists), else ~1e-6 in float32.
  4. ``rl.updates_per_batch`` optimizer updates on the batch, each minimizing (per token t of completion i, with
     ``ratio = exp(logp - old_logp)``)
       ``-min(ratio A_i, clip(ratio, 1 - eps, 1 + eps) A_i) + kl_weight (exp(ref - logp) - (ref - logp) - 1)``
     (the clipped surrogate, the k3 estimator of KL(policy || reference)), averaged over each completion's tokens,
     then over the completions: every completion weighs the same, whatever its length (the GRPO paper's
     aggregation; a token-level mean would let long completions dominate). That is ``rl.loss=grpo``; ``dapo``,
     ``dr_grpo`` and ``gspo`` are in :mod:`.policy_losses`.

Steps and the schedule: the loop's step and ``TrainState.step`` count rollouts (checkpoints, resume and the sampling
keys follow them). The optimizer takes ``rl.updates_per_batch`` updates per step, all in the step's one program, and
its learning-rate schedule counts updates: its default horizon is ``train.steps x rl.updates_per_batch`` updates, and
``optim.warmup_steps`` and ``optim.decay_steps`` count updates.

Google's Tunix computes the same loss (its advantages, the clipped ratio and k3 are what this module computes); its
learner drives its own rollout engine and NNX models through its RL cluster, so jaxtrain computes the formulas in its
own sharded step instead of importing it.

Metrics per step: ``loss`` (the objective), ``rl/reward_mean``, ``rl/reward_std``, ``rl/reward/<name>``,
``rl/reward_failures`` and ``rl/reward_failures/<name>`` (with the reward pool: completions scored 0), ``rl/kl``
(the mean k3 per completion token, against the reference), ``rl/clip_fraction`` (completion tokens whose clipped
term was taken), ``rl/degenerate_groups``, ``rl/degenerate_groups_rollout``, ``rl/sampling_rounds`` and
``rl/dynamic_sampling_s`` (dynamic sampling), ``rl/completion_length`` (mean tokens per completion, its stop token
included),
``rl/logp_mismatch``, ``rl/rollout_s`` and ``rl/rollout_tokens_per_s`` (new tokens per second of sampling),
``rl/update_s`` and ``rl/update_tokens_per_s`` (row tokens per second of scoring and updating), ``rl/step_s`` (the
whole step, as the trainer saw it). Evaluation
(``eval.every_steps``): the held-out prompts of ``data.eval_path``, one completion each with the rollout's sampling
and a fixed key, scored: ``eval_reward_mean`` and ``eval_reward/<name>``.
"""

from __future__ import annotations

import copy
import functools
import math
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import optim
from jaxtrain import sampling
from jaxtrain import sharding
from jaxtrain.data import prompts as prompts_lib
from jaxtrain.errors import ConfigError, check_positive
from jaxtrain.models import lora
from jaxtrain.train import step as step_lib
from jaxtrain.train.objectives import policy_losses
from jaxtrain.train.objectives import rewards as rewards_lib
from jaxtrain.train.objectives import rollout as rollout_lib
from jaxtrain.train.objectives.base import OBJECTIVES, Objective
from jaxtrain.train.objectives.logprobs import (REFERENCES, Reference, tempered_logps, token_logps,
                                               token_logps_and_aux, weighted_aux)

# The losses live in policy_losses (rl.loss); GRPO's own names stay importable from here.
ADVANTAGE_EPS = policy_losses.ADVANTAGE_EPS
group_advantages, grpo_loss = policy_losses.group_advantages, policy_losses.grpo_loss
EVAL_SEED = 2**20  # the held-out evaluation's sampling key, the same at every eval


def defaults() -> ml_collections.ConfigDict:
  """The ``rl`` config group (read by ``train.objective=grpo``)."""
  return ml_collections.ConfigDict(dict(
      group_size=8,  # completions per prompt (a group); train.global_batch_size counts completions
      temperature=1.0,  # rollout sampling
      top_p=1.0,
      max_new_tokens=64,  # at most this many new tokens per completion (data.seq_len + 1 - this: the prompt's room)
      stop=(),  # strings, each one token of the tokenizer, that end a completion (besides the tokenizer's EOS)
      # rewards (jaxtrain/train/objectives/rewards.py): registered names or module.path:function, =weight each
      rewards="exact_match",
      answer_field="answer",  # exact_match: the record's field holding the answer
      format_regex=r".*####\s*\S+\s*",  # format: the whole completion must match it
      # Where the rewards run: 0, in the trainer's process; N, in a pool of N worker processes, each completion
      # alone within reward_timeout_s seconds (a failure: that completion's reward 0, warned of and counted).
      reward_workers=0,
      reward_timeout_s=10.0,
      kl_weight=0.04,  # the k3 KL penalty's weight (0: none, and no reference is computed)
      # The policy loss (jaxtrain/train/objectives/policy_losses.py): grpo | dapo | dr_grpo | gspo.
      loss="grpo",
      clip_epsilon=0.2,  # the ratio is clipped to [1 - eps, 1 + eps] (dapo: its lower bound)
      clip_epsilon_high=0.28,  # dapo's clip-higher: the ratio's upper bound is 1 + this
      gspo_clip_epsilon=3e-4,  # gspo: the sequence ratio is clipped to [1 - this, 1 + gspo_clip_epsilon_high]
      gspo_clip_epsilon_high=4e-4,
      # DAPO's overlong reward shaping: the last this many of rl.max_new_tokens cost up to -1 reward (0: off).
      overlong_buffer=0,
      # DAPO's dynamic sampling: groups of equal rewards are refilled from up to dynamic_sampling_rounds more
      # rollouts of other prompts (any loss).
      dynamic_sampling=False,
      dynamic_sampling_rounds=3,
      updates_per_batch=1,  # optimizer updates per rollout batch (old log-probs kept)
      # The sampler's own layout (jaxtrain/train/objectives/rollout.py): the weights in the compute dtype, split over
      # tensor-parallel groups of this many devices and replicated across them. -1: the model's KV heads, at most a
      # slice; 0: the training layout.
      rollout_tensor=-1,
      # Continuous batching (jaxtrain.sampling.ContinuousGenerator): this many slots decode the rollout's rows as a
      # queue, a finished slot taking the next row at once, over a paged KV cache; 0: the static batch.
      rollout_slots=0,
      # Asynchronous rollouts: step s trains the rollout of its prompts that the policy of step s - 1 - K produced, K
      # steps ahead, the ratio taken against that policy's log-probabilities; the K rollouts ahead are in the train
      # state (checkpointed). 0: on-policy, each step's rollout by its own policy.
      max_staleness=0,
      reference="",  # frozen | adapters_off (LoRA only); empty: adapters_off with LoRA, else frozen
  ))


def validate(config) -> None:
  """The ``rl`` group's own ranges (its relations to the rest of the config: :meth:`GRPO.validate`)."""
  rl = config.rl
  check_positive(config, ["rl.max_new_tokens", "rl.updates_per_batch", "rl.clip_epsilon", "rl.temperature"])
  check_positive(config, ["rl.kl_weight"], allow_zero=True)
  policy_losses.LOSSES.check(config)
  check_positive(config, ["rl.clip_epsilon_high", "rl.gspo_clip_epsilon", "rl.gspo_clip_epsilon_high"])
  check_positive(config, ["rl.overlong_buffer", "rl.dynamic_sampling_rounds", "rl.max_staleness"], allow_zero=True)
  if not rl.gspo_clip_epsilon < 1:
    raise ConfigError("rl.gspo_clip_epsilon", f"must be < 1, got {rl.gspo_clip_epsilon}",
                      "the sequence ratio's lower bound is 1 - this (the paper: 3e-4)")
  if rl.overlong_buffer > rl.max_new_tokens:
    raise ConfigError("rl.overlong_buffer", f"{rl.overlong_buffer} is more than rl.max_new_tokens="
                      f"{rl.max_new_tokens}", "give at most rl.max_new_tokens (DAPO: a fifth of it), or 0 for off")
  if rl.rollout_tensor < -1:
    raise ConfigError("rl.rollout_tensor", f"must be -1, 0 or a device count, got {rl.rollout_tensor}",
                      "-1 lets jaxtrain choose, 0 keeps the training layout")
  if rl.group_size < 2:
    raise ConfigError("rl.group_size", f"must be >= 2, got {rl.group_size}", "advantages compare a group's "
                      "completions: sample at least 2 per prompt")
  if not 0 < rl.top_p <= 1:
    raise ConfigError("rl.top_p", f"must be in (0, 1], got {rl.top_p}", "use 1 for no nucleus cut")
  if rl.reference and rl.reference not in REFERENCES:
    raise ConfigError("rl.reference", f"'{rl.reference}' is not one of {', '.join(REFERENCES)}",
                      "leave it empty for the default")
  if isinstance(rl.stop, str) or not all(isinstance(s, str) and s for s in rl.stop):
    raise ConfigError("rl.stop", f"{rl.stop!r} is not a tuple of non-empty strings", "e.g. \"('\\n',)\"")
  if rl.reward_workers < 0:
    raise ConfigError("rl.reward_workers", f"must be >= 0, got {rl.reward_workers}",
                      "0 runs the rewards in the trainer's process, N > 0 in a pool of N worker processes")
  if not 0 < rl.reward_timeout_s < math.inf:
    raise ConfigError("rl.reward_timeout_s", f"must be > 0 and finite, got {rl.reward_timeout_s}",
                      "give the seconds one completion's reward may take in the pool (rl.reward_workers > 0)")


def stop_ids(config, tok) -> tuple[int, ...]:
  """The token ids that end a completion: ``rl.stop``'s (each must be one token), the tokenizer's EOS, and the ids
  that end a row in jaxtrain.generate and the harness too (the run's lineage's generation config:
  jaxtrain.sampling.tokenizer_for)."""
  out = []
  for text in config.rl.stop:
    ids = np.asarray(tok.encode(text))
    if ids.size != 1:
      raise ConfigError("rl.stop", f"{text!r} is {ids.size} tokens of the tokenizer, not one",
                        "give stop strings that are single tokens")
    out.append(int(ids[0]))
  eos = getattr(tok, "special_tokens", {}).get("eos_token")
  if eos:
    ids = np.asarray(tok.encode(eos))
    if ids.size == 1:
      out.append(int(ids[0]))
  try:
    out += sampling.tokenizer_for(config).eos_ids
  except sampling.GenerateError:  # a source whose tokenizer generation does not know: its EOS above is all
    pass
  return tuple(dict.fromkeys(out))


def reference_mode(config) -> str:
  return config.rl.reference or Reference.default_mode(config)


def _host(x) -> np.ndarray:
  """A global array's value on this host (gathered from every process on several)."""
  if jax.process_count() == 1:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def score_once(rewards: list[rewards_lib.Reward], texts: list[str], records: list[dict], group_size: int,
               advantages: policy_losses.Advantages = group_advantages, shaping: dict[str, np.ndarray] | None = None,
               pool: rewards_lib.RewardPool | None = None) -> tuple[np.ndarray, dict[str, float]]:
  """(The advantages of the step's completions, float32 ``[n]``; the reward metrics ``rl/reward_mean``,
  ``rl/reward_std``, ``rl/reward/<name>``), computed on process 0 alone and broadcast to the others. Each process
  places its own rows of the advantages from its own copy, so the copies must be the same: computed on each
  process, a reward that does not answer the same twice (code run under a timeout) would train each process's rows
  on other draws than the logged ones (jax's device_put stops the job at copies that differ, as a bug), and a costly
  reward would run once per process. A reward that fails on process 0 ends the job there, and jaxtrain.main tells
  the other processes, waiting in the broadcast, to stop with its line and code. ``advantages``: the loss's
  (rl.loss); ``shaping``: name -> per-completion terms added to the summed reward before the advantages, logged as
  ``rl/reward/<name>`` (rl.overlong_buffer's, from the completions' lengths: the same on every process).
  ``pool``: rl.reward_workers' (:func:`.rewards.open_pool`, given on every process, started on process 0 alone): the
  rewards run there, a failed completion scores 0 for that reward, and the failures are counted,
  ``rl/reward_failures`` and ``rl/reward_failures/<name>``."""
  shaping = dict(shaping or {})
  n, names = len(texts), [r.name for r in rewards] + list(shaping)
  counted = [r.name for r in rewards] if pool is not None else []  # (the same on every process)
  # Advantages, reward mean and std, each reward's mean; with the pool, the failures, all and each reward's.
  packed = np.zeros(n + 2 + len(names) + (1 + len(counted) if counted else 0), np.float64)
  if jax.process_index() == 0:
    if pool is None:
      total, parts = rewards_lib.score(rewards, texts, records)
    else:
      total, parts, failures = pool.score(texts, records)
    for k, v in shaping.items():
      parts[k] = np.asarray(v, np.float64)
      total = total + parts[k]
    packed[:n + 2 + len(names)] = [*advantages(total, group_size), total.mean(), total.std(),
                                   *(parts[k].mean() for k in names)]
    if counted:
      packed[n + 2 + len(names):] = [sum(failures.values()), *(failures[k] for k in counted)]
  if jax.process_count() > 1:
    # As its bits: with 64-bit types off a float64 array would travel as float32 (and int32 adds the others' 0s
    # exactly), so that every process logs what one process alone would.
    packed = np.asarray(multihost_utils.broadcast_one_to_all(packed.view(np.int32))).view(np.float64)
  metrics = {"rl/reward_mean": float(packed[n]), "rl/reward_std": float(packed[n + 1]),
             **{f"rl/reward/{k}": float(v) for k, v in zip(names, packed[n + 2:])}}
  if counted:
    metrics["rl/reward_failures"] = float(packed[n + 2 + len(names)])
    metrics.update({f"rl/reward_failures/{k}": float(v) for k, v in zip(counted, packed[n + 3 + len(names):])})
  return packed[:n].astype(np.float32), metrics


def sampling_seed(seed: int, step: int) -> int:
  """The rollout key's seed for (``train.seed``, loop step): the same on every restart."""
  return int(np.random.SeedSequence([seed, step]).generate_state(1)[0]) >> 1


class Completions:
  """Sampled rows as the host sees them: token ids ``[rows, n]``, how many each produced (a stop token included),
  the sampler's log-probabilities ``[rows, n]``, and their texts (up to, not including, a stop token)."""

  def __init__(self, result, stops: tuple[int, ...], tok):
    self.tokens, self.produced, self.logps = (_host(x) for x in result[:3])
    self.texts = []
    for row, n in zip(self.tokens, self.produced):
      ids = row[:n].tolist()
      if ids and ids[-1] in stops:
        ids = ids[:-1]
      self.texts.append(tok.decode(ids))


def update_batch(prompt: dict[str, np.ndarray], done: Completions, advantages: np.ndarray) -> dict[str, np.ndarray]:
  """The training rows: each the left-padded prompt then its completion, ``seq_len + 1`` tokens as inputs and
  targets; the loss mask on the completion's tokens (a stop token included); ``advantages`` per row."""
  tokens = np.concatenate([prompt["inputs"], done.tokens], axis=1)
  rows, width = prompt["inputs"].shape
  n = done.tokens.shape[1]
  lengths = prompt["segment_ids"].sum(1)
  new = np.arange(n)[None, :] < done.produced[:, None]
  positions = np.concatenate([prompt["positions"], lengths[:, None] + np.arange(n)[None, :]], axis=1)
  segments = np.concatenate([prompt["segment_ids"], new.astype(np.int32)], axis=1)
  trained = np.concatenate([np.zeros((rows, width), bool), new], axis=1)
  return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
          "loss_mask": trained[:, 1:].astype(np.float32),
          "positions": np.where(segments > 0, positions, 0)[:, :-1].astype(np.int32),
          "segment_ids": segments[:, :-1].astype(np.int32), "advantages": advantages.astype(np.float32)}


@OBJECTIVES.register("grpo")
class GRPO(Objective):
  """Group Relative Policy Optimization on the ``rl`` group's settings (see the module docstring)."""

  UPDATE_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids", "advantages", "old_logps",
                 "ref_logps")
  console_metrics = ("rl/reward_mean", "eval_reward_mean")

  def validate(self, config) -> None:
    c = config
    if c.data.source != "prompts" or not c.data.path:
      raise ConfigError("data.source", f"train.objective=grpo needs prompts, got data.source='{c.data.source}'"
                        + ("" if c.data.source != "prompts" else " without data.path"),
                        "set data.source=prompts and data.path to a JSONL file of {\"prompt\": ..., \"answer\": ...}")
    if c.train.global_batch_size % c.rl.group_size:
      raise ConfigError("train.global_batch_size", f"{c.train.global_batch_size} completions do not make groups of "
                        f"rl.group_size={c.rl.group_size}", "use a multiple of rl.group_size")
    if prompts_lib.prompt_width(c) < 1:
      raise ConfigError("rl.max_new_tokens", f"{c.rl.max_new_tokens} leaves no room for a prompt in data.seq_len="
                        f"{c.data.seq_len}", "raise data.seq_len or lower rl.max_new_tokens")
    for key, what in (("mesh.pipeline", "pipeline stages"), ("mesh.context", "context parallelism")):
      if c.mesh[key.split(".")[1]] not in (1,):
        raise ConfigError(key, f"train.objective=grpo has no {what}", f"set {key}=1")
    for key in ("microbatches", "max_rows_per_device"):
      if c.train[key] > (1 if key == "microbatches" else 0):
        raise ConfigError(f"train.{key}", "train.objective=grpo updates on the whole batch at once",
                          f"leave train.{key} at 0")
    if reference_mode(c) == "adapters_off" and not lora.active(c.model):
      raise ConfigError("rl.reference", "adapters_off needs LoRA (model.lora.rank > 0)", "use frozen, or LoRA")
    if c.eval.every_steps and not c.data.eval_path:
      raise ConfigError("eval.every_steps", "train.objective=grpo evaluates held-out prompts, and data.eval_path "
                        "is empty", "set data.eval_path to a JSONL file of held-out prompts, or eval.every_steps=0")
    # Everything the rollouts need, before anything is written: the prompts, every record with the fields its
    # rewards read (rewards.check_records), the stop tokens, the rewards (each called once on the first record, so
    # that one that fails or returns the wrong shape is one line now).
    rewards = rewards_lib.load(c.rl)
    table = prompts_lib.load(c.data.path, c)
    tables = [table] + ([prompts_lib.load(c.data.eval_path, c, "data.eval_path")] if c.data.eval_path else [])
    for t in tables:
      rewards_lib.check_records(rewards, t.records, t.where)
    stop_ids(c, prompts_lib._tokenizer(prompts_lib.tokenizer_spec(c)))
    record = table.records[0]
    rewards_lib.score(rewards, ["", table.texts[0]], [record, record])

  def abstract_batch(self, run) -> dict[str, jax.ShapeDtypeStruct]:
    """The scored rollout an update trains on; none with ``rl.max_staleness`` (the step trains the oldest rollout of
    the state's queue, :meth:`state_extra`)."""
    return {} if run.config.rl.max_staleness else self.update_batch_shapes(run)

  @classmethod
  def update_batch_shapes(cls, run) -> dict[str, jax.ShapeDtypeStruct]:
    """A scored rollout's arrays (:data:`UPDATE_KEYS`), laid out as the step's batch."""
    b, t = run.config.train.global_batch_size, run.config.data.seq_len
    rows = sharding.batch_sharding(run.mesh, run.rules, ndim=1)
    out = {k: jax.ShapeDtypeStruct((b, t), jnp.float32 if k in ("loss_mask", "old_logps", "ref_logps") else jnp.int32,
                                   sharding=run.batch_sharding) for k in cls.UPDATE_KEYS if k != "advantages"}
    out["advantages"] = jax.ShapeDtypeStruct((b,), jnp.float32, sharding=rows)
    return out

  def state_extra(self, config, mesh, rules):
    """With ``rl.max_staleness`` K: the scored rollouts of the K steps to come (``rollouts``: each array of
    :data:`UPDATE_KEYS` with a leading dim K, oldest first, rows over the batch axes), and ``filled`` (0 until the
    first step has produced them)."""
    k = config.rl.max_staleness
    if not k:
      return None
    b, t = config.train.global_batch_size, config.data.seq_len

    def queued(shape, dtype):
      spec = sharding.batch_sharding(mesh, rules, ndim=len(shape)).spec
      return jax.ShapeDtypeStruct((k, *shape), dtype, sharding=NamedSharding(mesh, P(None, *spec)))
    rollouts = {key: queued((b,) if key == "advantages" else (b, t),
                            jnp.float32 if key in ("loss_mask", "old_logps", "ref_logps", "advantages") else jnp.int32)
                for key in self.UPDATE_KEYS}
    return {"filled": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())), "rollouts": rollouts}

  def open_train(self, config):
    return prompts_lib.open_train(config)

  def make_train_step(self, run):
    """``(state, batch, skip) -> (state, metrics)``: ``rl.updates_per_batch`` updates on one scored batch, the step
    counter advanced by one (see the module docstring on the schedule)."""
    c, model = run.config, run.model
    updates = c.rl.updates_per_batch
    tx, schedule = run.tx, run.lr_schedule
    if updates > 1:  # the schedule counts updates (the same optimizer state's structure)
      tx = optim.make(c.optim, c.train.steps * updates, model.trainable_mask(), model.logical_specs, model.balance())
      schedule = optim.schedule(c.optim, c.train.steps * updates)
    _, update_shardings = step_lib.trained_shardings_of(model, run.state_shardings)
    policy_loss = policy_losses.LOSSES.get(c.rl.loss).loss

    def objective(params, batch):  # the policy loss, plus the model's auxiliary losses (a MoE router's) weighted
      logps, aux_losses = token_logps_and_aux(model, params, batch, temperature=c.rl.temperature)
      loss, aux = policy_loss(logps, batch, c.rl)
      return loss + weighted_aux(aux_losses, run.aux_weights), {
          **aux, **{f"aux_loss/{k}": v for k, v in aux_losses.items()}}

    def train_step(state, batch, skip):
      if c.rl.max_staleness:  # the oldest rollout of the queue (the trainer then pushes the step's own)
        batch = jax.tree.map(lambda q: q[0], state.extra["rollouts"])
      step = state.step
      tokens = jnp.sum(batch["loss_mask"])
      history = []
      for i in range(updates):
        (loss, aux), grads = step_lib.value_and_trained_grad(model, objective, state.params, batch)
        state, metrics = step_lib.apply_update(model, tx, schedule, state.replace(step=step * updates + i), grads,
                                               loss, 1.0, skip, update_shardings)
        history.append({**metrics, **aux})
      mean = {k: sum(m[k] for m in history) / updates for k in history[0]}
      mean["nonfinite"] = jnp.max(jnp.stack([m["nonfinite"] for m in history]))
      mean["skipped"] = jnp.max(jnp.stack([m["skipped"] for m in history]))
      mean["loss"] = history[0]["loss"]  # the objective at the rollout's params
      return state.replace(step=step + 1), {**mean, "tokens": tokens}

    return train_step

  def step_fn(self, run, compile_step):
    return Trainer(run, compile_step(run))

  def make_evaluator(self, run):
    c = run.config
    if not c.data.eval_path:
      return None
    table = prompts_lib.load(c.data.eval_path, c, "data.eval_path")
    tok = prompts_lib._tokenizer(prompts_lib.tokenizer_spec(c))
    stops = stop_ids(c, tok)
    # Rows padded to a multiple of the devices: they split over the rollout layout's groups, whatever its size.
    generator = rollout_generator(run, -(-len(table.ids) // run.mesh.size) * run.mesh.size, stops)
    batch = generator.batch(table.ids)
    rewards = rewards_lib.load(c.rl)
    # (The Trainer's, with rl.reward_workers > 0: its process on process 0 alone, which scores for every process.)
    pool = rewards_lib.open_pool(rewards, c.rl, start=jax.process_index() == 0)

    def evaluate(params):
      with jax.set_mesh(run.mesh):
        result = generator(params, batch, seed=EVAL_SEED + c.train.seed)

      def fetch() -> dict[str, float]:  # on every process: scored on process 0 and broadcast, as a step's rewards
        done = Completions(result, stops, tok)
        _, said = score_once(rewards, done.texts[:batch.count], table.records, 1, lambda r, g: np.zeros_like(r),
                             pool=pool)
        out = {"eval_reward_mean": said["rl/reward_mean"],
               **{f"eval_reward/{r.name}": said[f"rl/reward/{r.name}"] for r in rewards}}
        if pool is not None:
          out["eval_reward_failures"] = said["rl/reward_failures"]
        return out

      return fetch

    return evaluate


def rollout_generator(run, rows: int, stops: tuple[int, ...]) -> rollout_lib.Rollout:
  """The rollout sampler for ``rows`` rows on the rollout layout (``rl.rollout_tensor``, :mod:`.rollout`), compiled
  once; called with the policy's params as the train state holds them."""
  c = run.config
  layout = rollout_lib.Layout(run, rows)
  kw = dict(prompt_len=prompts_lib.prompt_width(c), max_new_tokens=c.rl.max_new_tokens,
            sampling=sampling.Sampling(c.rl.temperature, 0, c.rl.top_p), eos_ids=stops,
            token_logp=functools.partial(tempered_logps, temperature=c.rl.temperature))
  slots = int(c.rl.get("rollout_slots", 0))
  if slots:  # continuous batching: the rows are a queue for this many slots
    _, shards = sharding.batch_shards(dict(layout.mesh.shape), layout.rules)
    if slots < 0 or slots % shards:
      raise ConfigError("rl.rollout_slots", f"must be 0 or a positive multiple of the rollout's {shards} batch "
                        f"shards, got {slots}", f"use a multiple of {shards}, or 0 for the static batch")
    return rollout_lib.Rollout(layout, sampling.ContinuousGenerator(
        run.model, layout.mesh, layout.rules, layout.abstract, requests=rows, slots=slots, **kw))
  return rollout_lib.Rollout(layout, sampling.Generator(run.model, layout.mesh, layout.rules, layout.abstract,
                                                        rows=rows, **kw))


# DAPO's dynamic sampling (rl.dynamic_sampling) -----------------------------------------------------------------------
# After a step's rollout is scored, a group whose rewards are all equal (its advantages exactly 0: no policy
# gradient) is "degenerate". Round k = 1, 2, ... (at most rl.dynamic_sampling_rounds) rolls the whole batch out again,
# same shape, same compiled sampler, for prompts drawn from the prompts table, and its groups whose rewards vary
# replace degenerate ones, in order. The prompts and the sampling key of round k derive from (train.seed, step, k)
# (round 0 is the step's own), and which groups are degenerate from the broadcast advantages: every process, and a
# resumed run, refills the same groups with the same completions.


def degenerate_groups(advantages: np.ndarray, group_size: int) -> np.ndarray:
  """Per group (consecutive ``group_size`` rows): whether its advantages are all exactly 0."""
  return np.all(np.asarray(advantages).reshape(-1, group_size) == 0, axis=1)


def refill_seed(seed: int, step: int, round_: int) -> int:
  """The sampling seed of rollout ``round_`` of loop step ``step``; round 0: the step's own (:func:`sampling_seed`)."""
  if round_ == 0:
    return sampling_seed(seed, step)
  return int(np.random.SeedSequence([seed, step, round_]).generate_state(1)[0]) >> 1


def refill_prompts(seed: int, step: int, round_: int, records: int, groups: int) -> np.ndarray:
  """The record indices of round ``round_``'s prompts, one per group, from a table of ``records``: without
  repeats when the table has enough (else with), drawn by a generator seeded from (seed, step, round)."""
  rng = np.random.default_rng([seed, step, round_])
  return rng.permutation(records)[:groups] if records >= groups else rng.integers(0, records, groups)


def refill(degenerate: np.ndarray, fresh_degenerate: np.ndarray) -> list[tuple[int, int]]:
  """``(slot, source)`` pairs: the degenerate groups, in order, each take the next group of the new rollout whose
  rewards vary (``fresh_degenerate`` false); degenerate groups left over stay."""
  return list(zip(np.flatnonzero(degenerate).tolist(), np.flatnonzero(~np.asarray(fresh_degenerate)).tolist()))


def take_groups(into: tuple[dict, Completions, np.ndarray], source: tuple[dict, Completions, np.ndarray],
                pairs: list[tuple[int, int]], group_size: int) -> tuple[dict, Completions, np.ndarray]:
  """``into`` (prompt rows, completions, advantages) with group ``slot`` replaced by ``source``'s group ``source``
  for each pair (new arrays: the inputs are not changed)."""
  if not pairs:
    return into
  (host, done, adv), (fresh_host, fresh, fresh_adv) = into, source
  dst = np.concatenate([np.arange(s * group_size, (s + 1) * group_size) for s, _ in pairs])
  src = np.concatenate([np.arange(s * group_size, (s + 1) * group_size) for _, s in pairs])

  def put(a, b):
    a = np.array(a, copy=True)
    a[dst] = np.asarray(b)[src]
    return a
  merged = copy.copy(done)
  merged.tokens, merged.produced, merged.logps = (put(getattr(done, k), getattr(fresh, k))
                                                  for k in ("tokens", "produced", "logps"))
  merged.texts = list(done.texts)
  for d, s in zip(dst, src):
    merged.texts[d] = fresh.texts[s]
  return {k: put(v, fresh_host[k]) for k, v in host.items()}, merged, put(adv, fresh_adv)


class Trainer:
  """What the loop calls each step (``(state, prompt batch, skip) -> (state, metrics)``): rollout, rewards,
  scoring, update (see the module docstring). Compiles the sampler and the scoring program at construction; the
  update is the trainer's compiled :meth:`GRPO.make_train_step`."""

  def __init__(self, run, update):
    c = self.config = run.config
    self.run, self.update = run, update
    self.tok = prompts_lib._tokenizer(prompts_lib.tokenizer_spec(c))
    self.stops = stop_ids(c, self.tok)
    self.table = prompts_lib.load(c.data.path, c)
    self.rewards = rewards_lib.load(c.rl)
    # rl.reward_workers > 0: the pool on every process (score_once's metrics), its process started on process 0
    # alone (it scores for all), now: it builds the rewards while the programs compile.
    self.pool = rewards_lib.open_pool(self.rewards, c.rl, start=jax.process_index() == 0)
    self.generator = rollout_generator(run, c.train.global_batch_size, self.stops)
    layout = self.generator.layout
    logging.info("rl: rollouts on %s, %.1f MiB of weights a device", layout.describe(), layout.weight_bytes() / 2**20)
    self.reference = Reference(run, reference_mode(c)) if c.rl.kl_weight else None
    batch = GRPO.update_batch_shapes(run)
    scored = {k: v for k, v in batch.items() if k not in ("old_logps", "ref_logps")}
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          run.model.abstract_params, run.state_shardings.params)
    extra = self.reference.abstract_extra(run) if self.reference else ()
    with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
      self.score = jax.jit(self._score).lower(params, scored, *extra).compile()
    self.ahead = c.rl.max_staleness
    if self.ahead:  # the prompt stream's steps to come (global rows), and the queue's push
      self.lookahead = prompts_lib.PromptStream(self.table, prompts_lib.prompt_width(c), c.train.global_batch_size,
                                                c.rl.group_size, c.train.seed)
      queue = jax.tree.map(lambda a: a.sharding, run.state_extra)
      self.push = jax.jit(_push, donate_argnums=0, out_shardings=queue).lower(run.state_extra, batch).compile()

  def close(self) -> None:
    """The run is over, whatever ended it: the reward pools' processes stop (jaxtrain.train.trainer calls it)."""
    rewards_lib.close_pools()

  def _score(self, params, batch, *extra):
    """(The policy's per-token log-probabilities, the reference's; zeros without a KL term)."""
    t = self.config.rl.temperature
    logps = token_logps(self.run.model, params, batch, temperature=t)
    if self.reference is None:
      return logps, jnp.zeros_like(logps)
    return logps, token_logps(self.run.model, self.reference.params(params, *extra), batch, temperature=t)

  def _rewarded(self, host: dict, done: Completions) -> tuple[np.ndarray, dict[str, float]]:
    """:func:`score_once` of these rows: ``rl.loss``'s advantages, with ``rl.overlong_buffer``'s shaping."""
    c = self.config
    records = [self.table.records[i] for i in prompts_lib.record_indices(host)]
    shaping = ({"overlong": policy_losses.overlong_penalty(done.produced, c.rl.max_new_tokens, c.rl.overlong_buffer)}
               if c.rl.overlong_buffer else None)
    return score_once(self.rewards, done.texts, records, c.rl.group_size,
                      policy_losses.LOSSES.get(c.rl.loss).advantages, shaping, self.pool)

  def _rollout(self, params, host: dict, seed: int) -> Completions:
    """The completions of the prompt rows ``host`` by the policy ``params`` (as the train state holds them) with the
    sampling key of ``seed``: the step's own rollout, and dynamic sampling's refills."""
    rows = host["inputs"].shape[0]
    batch = sampling.Batch(host["inputs"], host["positions"], host["segment_ids"], host["segment_ids"].sum(1),
                           np.ones((rows,), np.int32), rows)
    with jax.set_mesh(self.run.mesh):
      return Completions(self.generator(params, batch, seed), self.stops, self.tok)

  def _dynamic_sampling(self, params, step: int, host: dict, done: Completions, advantages: np.ndarray,
                        metrics: dict) -> tuple[dict, Completions, np.ndarray, dict]:
    """DAPO's dynamic sampling (``rl.dynamic_sampling``; see its section above): the step's rows, completions and
    advantages with degenerate groups refilled, and ``metrics`` with ``rl/degenerate_groups`` (left in the trained
    batch), ``rl/degenerate_groups_rollout`` (in the step's own rollout), ``rl/sampling_rounds`` (extra rollouts) and
    ``rl/dynamic_sampling_s``. The reward metrics stay the step's own rollout's (the policy on the stream's
    prompts, as without dynamic sampling), but for the reward pool's failures (``rl/reward_failures*``), which count
    every round's. Off: the counts alone, nothing changed."""
    c, g, t0 = self.config, self.config.rl.group_size, time.perf_counter()
    degenerate = degenerate_groups(advantages, g)
    first, rounds = int(degenerate.sum()), 0
    while c.rl.dynamic_sampling and degenerate.any() and rounds < c.rl.dynamic_sampling_rounds:
      rounds += 1
      ids = refill_prompts(c.train.seed, step, rounds, len(self.table.records), degenerate.size)
      fresh_host = prompts_lib.rows(self.table.ids, np.repeat(ids, g), host["inputs"].shape[1])
      fresh = self._rollout(params, fresh_host, refill_seed(c.train.seed, step, rounds))
      fresh_advantages, fresh_metrics = self._rewarded(fresh_host, fresh)
      metrics = {**metrics, **{k: metrics.get(k, 0.0) + v for k, v in fresh_metrics.items()
                               if k.startswith("rl/reward_failures")}}
      pairs = refill(degenerate, degenerate_groups(fresh_advantages, g))
      host, done, advantages = take_groups((host, done, advantages), (fresh_host, fresh, fresh_advantages), pairs, g)
      degenerate[np.asarray([slot for slot, _ in pairs], np.int64)] = False
    return host, done, advantages, {**metrics, "rl/degenerate_groups": float(degenerate.sum()),
                                    "rl/degenerate_groups_rollout": float(first), "rl/sampling_rounds": float(rounds),
                                    "rl/dynamic_sampling_s": time.perf_counter() - t0}

  def _scored(self, params, host: dict, done: Completions, advantages: np.ndarray) -> dict:
    """The update batch of these rows on the devices, with the policy's (``params``) and the reference's
    log-probabilities of it (dispatched, not waited for)."""
    run = self.run
    local = update_batch(host, done, advantages)
    rows_sharding = sharding.batch_sharding(run.mesh, run.rules, ndim=1)
    on_device = {k: jax.device_put(v, rows_sharding if k == "advantages" else run.batch_sharding)
                 for k, v in local.items()}
    with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
      old, ref = self.score(params, on_device, *(self.reference.extra if self.reference else ()))
    return {**on_device, "old_logps": old, "ref_logps": ref}

  def _produce(self, params, step: int, host: dict) -> tuple[dict, Completions, dict]:
    """The rollout of prompt rows ``host`` (those of loop step ``step``) by ``params``, its rewards (with dynamic
    sampling) and its scoring: (the update batch on the devices, the completions, the reward metrics)."""
    t0 = time.perf_counter()
    done = self._rollout(params, host, sampling_seed(self.config.train.seed, step))
    own = _rollout_metrics(done, time.perf_counter() - t0)
    batch, done, metrics = self._produce_rewarded(params, step, host, done)
    return batch, done, {**metrics, **own}

  def __call__(self, state, prompt: dict, skip):
    run = self.run
    t0 = time.perf_counter()
    step = int(jax.device_get(state.step)) + 1
    host = {k: _host(prompt[k]) for k in ("inputs", "positions", "segment_ids", "targets")}
    if self.ahead:
      return self._ahead(state, host, step, skip)
    rows = host["inputs"].shape[0]
    batch, done, metrics = self._produce(state.params, step, host)
    t1 = time.perf_counter()
    with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
      mismatch = self._mismatch(_host(batch["old_logps"]), done, host["inputs"].shape[1])
      state, step_metrics = self.update(state, batch, skip)
      jax.block_until_ready(step_metrics)
    return state, self._metrics(step_metrics, metrics, done, mismatch, rows, t0, t1)

  def _metrics(self, step_metrics: dict, metrics: dict, done: Completions, mismatch: float, rows: int, t0: float,
               t1: float) -> dict:
    """A step's metrics: its update's, its rollout's (``metrics``: rewards, :func:`_rollout_metrics`), the
    timings."""
    c, update_s = self.config, time.perf_counter() - t1
    return {**step_metrics, **metrics, "rl/step_s": time.perf_counter() - t0,
            "rl/completion_length": float(done.produced.mean()), "rl/logp_mismatch": mismatch,
            "rl/update_s": update_s, "rl/update_tokens_per_s": rows * c.data.seq_len * c.rl.updates_per_batch / update_s}

  # Asynchronous rollouts (rl.max_staleness = K) ------------------------------------------------------------------
  # The state's queue holds the scored rollouts of the prompts of steps s .. s + K - 1 when step s starts (empty at a
  # fresh start: the first step fills it with the starting policy's). Step s rolls out the prompts of step s + K by
  # the policy it starts with (θ_{s-1}), scores them under it (the behaviour log-probabilities the ratio divides by,
  # by the training forward, before the update donates θ_{s-1}), updates on the queue's oldest (the prompts of step
  # s, produced by θ_{s-1-K}), computes the new rollout's rewards on the host while the devices score and update,
  # and pushes it. The queue is in the checkpoint, and each rollout's sampling key is its prompts' step's: a resumed
  # run trains what the uninterrupted one does. The step's reward, length and mismatch metrics are its new rollout's.

  def _ahead(self, state, host: dict, step: int, skip):
    c, run, t0 = self.config, self.run, time.perf_counter()
    rows = host["inputs"].shape[0]
    expected = np.repeat(self.lookahead.indices(step - 1), c.rl.group_size)
    if not np.array_equal(prompts_lib.record_indices(host), expected):  # the loop's stream and the lookahead's
      raise RuntimeError(f"step {step}: the prompt stream is not where the rollouts ahead were produced from")
    if not int(jax.device_get(state.extra["filled"])):  # a fresh start: the starting policy's rollouts first
      for ahead in range(step, step + self.ahead):
        batch, _, _ = self._produce(state.params, ahead, self.lookahead.batch(ahead - 1))
        state = state.replace(extra=self.push(state.extra, batch))
      logging.info("rl: %d rollout(s) ahead produced by the starting policy (rl.max_staleness)", self.ahead)
    produced = step + self.ahead
    host = self.lookahead.batch(produced - 1)
    done = self._rollout(state.params, host, sampling_seed(c.train.seed, produced))
    own, t1 = _rollout_metrics(done, time.perf_counter() - t0), time.perf_counter()
    if c.rl.dynamic_sampling:  # its refills roll out by θ_{s-1}: the rewards before the update
      batch, done, metrics = self._produce_rewarded(state.params, produced, host, done)
    else:
      batch = self._scored(state.params, host, done, np.zeros(rows, np.float32))
    with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
      state, step_metrics = self.update(state, {}, skip)
    if not c.rl.dynamic_sampling:
      advantages, metrics = self._rewarded(host, done)  # on the host, while the devices score and update
      _, _, _, metrics = self._dynamic_sampling(None, produced, host, done, advantages, metrics)
      batch["advantages"] = jax.device_put(advantages, batch["advantages"].sharding)
    with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
      mismatch = self._mismatch(_host(batch["old_logps"]), done, host["inputs"].shape[1])
      state = state.replace(extra=self.push(state.extra, batch))
      jax.block_until_ready((step_metrics, state.extra))
    return state, self._metrics(step_metrics, {**metrics, **own}, done, mismatch, rows, t0, t1)

  def _produce_rewarded(self, params, step: int, host: dict, done: Completions) -> tuple[dict, Completions, dict]:
    """:meth:`_produce` from its rollout ``done`` on: rewards, dynamic sampling, scoring."""
    advantages, metrics = self._rewarded(host, done)
    host, done, advantages, metrics = self._dynamic_sampling(params, step, host, done, advantages, metrics)
    return self._scored(params, host, done, advantages), done, metrics

  @staticmethod
  def _mismatch(old: np.ndarray, done: Completions, width: int) -> float:
    """The largest |sampler log-prob - training forward's| over the completion tokens."""
    n = done.tokens.shape[1]
    new = np.arange(n)[None, :] < done.produced[:, None]
    trained = old[:, width - 1:width - 1 + n]  # target t = token t + 1: completion token i is target width - 1 + i
    return float(np.max(np.abs(np.where(new, trained - done.logps, 0.0)), initial=0.0))



def _rollout_metrics(done: Completions, seconds: float) -> dict[str, float]:
  """``rl/rollout_s`` and ``rl/rollout_tokens_per_s`` of one rollout (the step's own: dynamic sampling's refills
  are timed in ``rl/dynamic_sampling_s``)."""
  return {"rl/rollout_s": seconds, "rl/rollout_tokens_per_s": float(done.produced.sum()) / seconds}


def _push(extra: dict, batch: dict) -> dict:
  """The queue of rollouts ahead with its oldest dropped (the step trained it) and ``batch`` appended."""
  return {"filled": jnp.ones((), jnp.int32),
          "rollouts": {k: jnp.concatenate([q[1:], batch[k][None]]) for k, q in extra["rollouts"].items()}}

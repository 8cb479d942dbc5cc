"""The policy-gradient losses of ``train.objective=grpo``, by name (``rl.loss``): :data:`LOSSES`, each entry a
:class:`PolicyLoss`, which knows how a group's rewards become advantages (on process 0's host, numpy) and the
per-batch loss (in the compiled update, jax).

Notation: completion i of a batch of G-sized groups, its completion tokens t (``loss_mask`` > 0, a stop token
included), ``|o_i|`` their count; the policy's per-token log-probabilities ``logp``, the rollout policy's
``old_logp`` (the ratio divides by them) and the reference's ``ref_logp``; ``A_i`` the advantage of completion i;
``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1`` the per-token estimate of KL(policy || reference), weighted
by ``rl.kl_weight`` (0: no term, and no reference is computed).

  grpo     Shao et al. 2024, DeepSeekMath (arXiv:2402.03300):
           A_i = (r_i - mean(r)) / (std(r) + 1e-4)   (the group's sample std, ddof 1)
           L = 1/B sum_i 1/|o_i| sum_t [ -min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i) + beta k3_it ],
           rho_it = exp(logp_it - old_logp_it); eps = rl.clip_epsilon.
  dapo     Yu et al. 2025, DAPO (arXiv:2503.14476): GRPO's advantages;
           L = 1/sum_i |o_i| sum_i sum_t [ -min(rho_it A_i, clip(rho_it, 1-eps_low, 1+eps_high) A_i) (+ beta k3_it) ]
           (clip-higher: eps_low = rl.clip_epsilon, eps_high = rl.clip_epsilon_high; token-level aggregation over
           the whole batch). DAPO drops the KL term: for its recipe set rl.kl_weight=0. Its overlong reward shaping
           (:func:`overlong_penalty`, rl.overlong_buffer) and dynamic sampling (rl.dynamic_sampling) are keys of
           their own, usable with any loss (jaxtrain.train.objectives.grpo).
  dr_grpo  Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (arXiv:2503.20783):
           A_i = r_i - mean(r)   (no division by the std)
           L = 1/B sum_i 1/L_max sum_t [ -min(rho_it A_i, clip(rho_it, 1-eps, 1+eps) A_i) + beta k3_it ],
           L_max = rl.max_new_tokens, a constant: no length normalization.
  gspo     Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071): GRPO's advantages;
           s_i = exp(1/|o_i| sum_t (logp_it - old_logp_it)),
           L = 1/B sum_i [ -min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i) + beta 1/|o_i| sum_t k3_it ],
           eps_low = rl.gspo_clip_epsilon (3e-4, the paper's), eps_high = rl.gspo_clip_epsilon_high (4e-4).

Every loss returns ``(loss, {"rl/kl", "rl/clip_fraction"})``: ``rl/kl`` the mean k3 per completion token of the
batch (0 without a KL term), ``rl/clip_fraction`` the completion tokens (gspo: the completions) whose clipped term
was taken. A row without completion tokens adds 0 to the sums (and counts in B).

GSPO has keys of its own for its clip range, not the token-level ``rl.clip_epsilon``: its ratio is a geometric mean
over a completion's tokens, far closer to 1 than a token's, so the paper clips it about 3 orders of magnitude
tighter (3e-4, 4e-4 against 0.2, 0.28); a shared key would clip almost nothing when a run switches
``rl.loss=gspo``, or need a default that depends on another key. Two keys, each with the paper's default, keep
``rl.loss=gspo`` the paper's recipe as it is.

To add one::

  from jaxtrain.train.objectives.policy_losses import LOSSES, PolicyLoss, group_advantages
  LOSSES.register("mine", PolicyLoss(group_advantages, lambda logps, batch, rl: my_loss(logps, batch, rl.kl_weight)))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.registry import Registry

ADVANTAGE_EPS = 1e-4  # as Tunix and TRL: a group whose rewards are all equal has advantages 0, not 0 / 0

Advantages = Callable[[np.ndarray, int], np.ndarray]
Loss = Callable[[jax.Array, dict, Any], tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
  """``advantages(rewards [n] float64, group_size) -> float32 [n]`` (groups: consecutive rows; on the host) and
  ``loss(logps [rows, seq], batch, rl) -> (loss, aux)`` (traced in the update; ``rl``: the config group, read for
  the loss's own keys at trace time)."""
  advantages: Advantages
  loss: Loss


LOSSES: Registry[PolicyLoss] = Registry("rl.loss", "policy loss",
                                        "jaxtrain.train.objectives.policy_losses.LOSSES.register")


# Advantages (numpy, float64 arithmetic, float32 out) ---------------------------------------------------------------


def _grouped(rewards, group_size: int) -> tuple[np.ndarray, np.ndarray]:
  grouped = np.asarray(rewards, np.float64).reshape(-1, group_size)
  return grouped, np.ptp(grouped, axis=1, keepdims=True) == 0


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
  """``(r - group mean) / (group std + 1e-4)`` per completion (float32; groups: consecutive ``group_size`` rows;
  std with ddof=1). A group whose rewards are all equal has advantages exactly 0 (its mean rounded, ``r - mean``
  might not be): what dynamic sampling tells degenerate groups by."""
  grouped, same = _grouped(rewards, group_size)
  adv = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + ADVANTAGE_EPS)
  return np.where(same, 0.0, adv).reshape(-1).astype(np.float32)


def centered_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
  """``r - group mean`` per completion (Dr. GRPO: no division by the std, which weighs groups of nearly equal
  rewards up); float32, exactly 0 for a group of equal rewards."""
  grouped, same = _grouped(rewards, group_size)
  return np.where(same, 0.0, grouped - grouped.mean(1, keepdims=True)).reshape(-1).astype(np.float32)


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer: int) -> np.ndarray:
  """DAPO's soft overlong punishment (Yu et al. 2025, overlong reward shaping), float64 per completion of
  ``lengths`` tokens, with ``L_max = max_new_tokens`` and ``L_cache = buffer`` (0: all zeros):
    0                                    if |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max   (-1 at L_max)
    -1                                   if |y| > L_max"""
  lengths = np.asarray(lengths, np.float64)
  if buffer <= 0:
    return np.zeros_like(lengths)
  start = float(max_new_tokens - buffer)
  return np.where(lengths <= start, 0.0, np.where(lengths <= max_new_tokens, (start - lengths) / buffer, -1.0))


# Losses (jax) --------------------------------------------------------------------------------------------------------


def _k3(logps, batch, real, kl_weight: float):
  """Per token, the k3 estimator of KL(policy || reference), ``exp(ref - logp) - (ref - logp) - 1`` (0 on padding);
  zeros without a KL term."""
  if not kl_weight:
    return jnp.zeros_like(logps)
  d = jnp.where(real, batch["ref_logps"] - logps, 0.0)
  return jnp.exp(d) - d - 1


def _token_terms(logps, batch, low: float, high: float, kl_weight: float):
  """(real tokens, advantages [rows, 1], ratio, clipped ratio, per-token surrogate plus ``kl_weight`` k3, k3)."""
  real = batch["loss_mask"] > 0
  adv = batch["advantages"][:, None]
  ratio = jnp.exp(jnp.where(real, logps - batch["old_logps"], 0.0))
  clipped = jnp.clip(ratio, 1 - low, 1 + high)
  per_token = -jnp.minimum(ratio * adv, clipped * adv)
  kl = _k3(logps, batch, real, kl_weight)
  if kl_weight:
    per_token = per_token + kl_weight * kl
  return real, adv, ratio, clipped, per_token, kl


def _token_aux(real, adv, ratio, clipped, kl, count) -> dict:
  taken = real & (clipped * adv < ratio * adv)
  return {"rl/kl": jnp.sum(jnp.where(real, kl, 0.0)) / count,
          "rl/clip_fraction": jnp.sum(taken.astype(jnp.float32)) / count}


def grpo_loss(logps, batch, clip_epsilon: float, kl_weight: float) -> tuple[jax.Array, dict]:
  """GRPO (see the module docstring) from the policy's per-token log-probabilities ``logps`` ``[rows, seq]`` and the
  batch's ``old_logps``, ``ref_logps``, ``advantages`` and ``loss_mask``: (the loss, ``{rl/kl, rl/clip_fraction}``,
  means over the completion tokens). Each completion weighs the same, whatever its length."""
  real, adv, ratio, clipped, per_token, kl = _token_terms(logps, batch, clip_epsilon, clip_epsilon, kl_weight)
  tokens = jnp.sum(real, axis=1).astype(jnp.float32)
  per_sequence = jnp.sum(jnp.where(real, per_token, 0.0), axis=1) / jnp.maximum(tokens, 1.0)
  loss = jnp.mean(per_sequence)
  count = jnp.maximum(jnp.sum(tokens), 1.0)
  return loss, _token_aux(real, adv, ratio, clipped, kl, count)


def dapo_loss(logps, batch, clip_low: float, clip_high: float, kl_weight: float) -> tuple[jax.Array, dict]:
  """DAPO: the ratio clipped to ``[1 - clip_low, 1 + clip_high]``, the per-token terms summed over the batch's
  completion tokens over their count (a long completion weighs by its tokens); the KL term only if ``kl_weight``."""
  real, adv, ratio, clipped, per_token, kl = _token_terms(logps, batch, clip_low, clip_high, kl_weight)
  count = jnp.maximum(jnp.sum(real).astype(jnp.float32), 1.0)
  loss = jnp.sum(jnp.where(real, per_token, 0.0)) / count
  return loss, _token_aux(real, adv, ratio, clipped, kl, count)


def dr_grpo_loss(logps, batch, clip_epsilon: float, kl_weight: float, max_new_tokens: int) -> tuple[jax.Array, dict]:
  """Dr. GRPO: per completion the sum of its per-token terms over the constant ``max_new_tokens`` (no length
  normalization), then the mean over completions."""
  real, adv, ratio, clipped, per_token, kl = _token_terms(logps, batch, clip_epsilon, clip_epsilon, kl_weight)
  per_sequence = jnp.sum(jnp.where(real, per_token, 0.0), axis=1) / float(max_new_tokens)
  loss = jnp.mean(per_sequence)
  count = jnp.maximum(jnp.sum(real).astype(jnp.float32), 1.0)
  return loss, _token_aux(real, adv, ratio, clipped, kl, count)


def gspo_loss(logps, batch, clip_low: float, clip_high: float, kl_weight: float) -> tuple[jax.Array, dict]:
  """GSPO: the sequence-level ratio ``s_i = exp(mean_t(logp - old_logp))`` clipped to ``[1 - clip_low, 1 +
  clip_high]``, ``-min(s_i A_i, clip(s_i) A_i)`` per completion plus ``kl_weight`` x its mean k3, the mean over
  completions; ``rl/clip_fraction``: the completions whose clipped term was taken."""
  real = batch["loss_mask"] > 0
  adv = batch["advantages"]
  tokens = jnp.sum(real, axis=1).astype(jnp.float32)
  per_row = jnp.maximum(tokens, 1.0)
  ratio = jnp.exp(jnp.sum(jnp.where(real, logps - batch["old_logps"], 0.0), axis=1) / per_row)
  clipped = jnp.clip(ratio, 1 - clip_low, 1 + clip_high)
  per_sequence = -jnp.minimum(ratio * adv, clipped * adv)
  kl = _k3(logps, batch, real, kl_weight)
  if kl_weight:
    per_sequence = per_sequence + kl_weight * jnp.sum(jnp.where(real, kl, 0.0), axis=1) / per_row
  present = tokens > 0
  loss = jnp.mean(jnp.where(present, per_sequence, 0.0))
  taken = present & (clipped * adv < ratio * adv)
  return loss, {"rl/kl": jnp.sum(jnp.where(real, kl, 0.0)) / jnp.maximum(jnp.sum(tokens), 1.0),
                "rl/clip_fraction": jnp.sum(taken.astype(jnp.float32))
                / jnp.maximum(jnp.sum(present.astype(jnp.float32)), 1.0)}


LOSSES.register("grpo", PolicyLoss(
    group_advantages, lambda logps, batch, rl: grpo_loss(logps, batch, rl.clip_epsilon, rl.kl_weight)))
LOSSES.register("dapo", PolicyLoss(
    group_advantages,
    lambda logps, batch, rl: dapo_loss(logps, batch, rl.clip_epsilon, rl.clip_epsilon_high, rl.kl_weight)))
LOSSES.register("dr_grpo", PolicyLoss(
    centered_advantages,
    lambda logps, batch, rl: dr_grpo_loss(logps, batch, rl.clip_epsilon, rl.kl_weight, rl.max_new_tokens)))
LOSSES.register("gspo", PolicyLoss(
    group_advantages,
    lambda logps, batch, rl: gspo_loss(logps, batch, rl.gspo_clip_epsilon, rl.gspo_clip_epsilon_high,
                                       rl.kl_weight)))

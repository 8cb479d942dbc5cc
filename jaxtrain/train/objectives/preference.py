"""Preference optimization: ``dpo``, ``simpo`` and ``orpo`` (``train.objective``), and their config group
``preference``.

Each step reads a batch of B pairs (:mod:`jaxtrain.data.preference`: ``chosen_*`` and ``rejected_*`` rows, one
pair per row index) and computes, for each side, the sum ``logp`` of its response tokens' log-probabilities under
the policy (:func:`jaxtrain.train.objectives.logprobs.token_logps`, the training forward; one forward over the 2B
rows, each pair's two rows adjacent, so that no row leaves its device) and their count ``n``. With
``h = (logp_c - ref_c) - (logp_r - ref_r)`` (``ref``: the same sums under the reference model), ``s`` the
logistic function:

- ``dpo``, ``preference.loss=sigmoid`` (DPO, Rafailov et al. 2023; with ``label_smoothing`` e, cDPO):
  ``-(1 - e) log s(beta h) - e log s(-beta h)``; rewards ``beta (logp - ref)``.
- ``dpo``, ``preference.loss=ipo`` (IPO, Azar et al. 2023, length-normalized as TRL computes it):
  ``(h' - 1 / (2 beta))^2``, ``h'`` being ``h`` with each side's log-ratio divided by its ``n``; rewards
  ``beta (logp - ref) / n``.
- ``simpo`` (SimPO, Meng et al. 2024; no reference): ``-(1 - e) log s(beta (logp_c / n_c - logp_r / n_r) - gamma)
  - e log s(-(...))``; rewards ``beta logp / n``.
- ``orpo`` (ORPO, Hong et al. 2024; no reference): the mean cross-entropy over all chosen response tokens of the
  batch, minus ``lambda`` times the mean over pairs of ``log s(log odds_c - log odds_r)``, ``odds = p / (1 - p)``,
  ``p = exp(logp / n)``; rewards ``lambda logp / n``.

The loss is the mean over pairs (ORPO's NLL: over tokens), the same with microbatches (accumulated as ``lm``
accumulates: each microbatch's share of the whole batch's mean). The reference of ``dpo``
(``preference.reference``): ``frozen`` (a copy of the starting params, :class:`.logprobs.Reference`),
``adapters_off`` (with LoRA: the policy's base without its adapters, no copy), ``precomputed`` (read with the
batch: ``tools/reference_logps.py`` wrote them into the data folder), ``auto`` (adapters_off with LoRA, else
frozen). Metrics: ``rewards/{chosen,rejected,margin,accuracy}`` and ``logps/{chosen,rejected}`` (means over the
step's pairs; accuracy: the share with the chosen reward above the rejected), and the same over the held-out pairs
as ``eval_*`` with ``eval_loss``.
"""

from __future__ import annotations

import json
import weakref

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import sharding
from jaxtrain.data import batch as batch_lib
from jaxtrain.data import loader
from jaxtrain.data import preference as data_lib
from jaxtrain.errors import ConfigError, DataError
from jaxtrain.models import lora, scans
from jaxtrain.parallel import context as context_lib
from jaxtrain.parallel.pipeline import split_microbatches
from jaxtrain.train import start
from jaxtrain.train import state as state_lib
from jaxtrain.train import step as step_lib
from jaxtrain.train.objectives import logprobs
from jaxtrain.train.objectives.base import OBJECTIVES, Objective

KINDS = ("dpo", "simpo", "orpo")
LOSSES = ("sigmoid", "ipo")
REFERENCES = ("auto", "frozen", "adapters_off", "precomputed")
# Which objectives read which keys (a key set for another objective is an error).
READERS = {"beta": ("dpo", "simpo"), "loss": ("dpo",), "label_smoothing": ("dpo", "simpo"),
           "simpo_gamma": ("simpo",), "orpo_lambda": ("orpo",), "reference": ("dpo",)}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
           "logps/rejected")


def defaults() -> ml_collections.ConfigDict:
  """The ``preference`` config group (read by ``train.objective=dpo|simpo|orpo``)."""
  return ml_collections.ConfigDict(dict(
      beta=0.1,  # dpo, simpo: the inverse temperature of the implicit reward (SimPO's papers use 2 to 2.5)
      loss="sigmoid",  # dpo: sigmoid (DPO; cDPO with label_smoothing) | ipo
      label_smoothing=0.0,  # dpo (sigmoid), simpo: the assumed share of flipped labels (cDPO), in [0, 0.5)
      simpo_gamma=0.5,  # simpo: the target reward margin
      orpo_lambda=0.1,  # orpo: the weight of the odds-ratio term against the chosen responses' NLL
      reference="auto",  # dpo: auto | frozen | adapters_off (LoRA) | precomputed (tools/reference_logps.py)
  ))


def validate(config) -> None:
  p, kind, own = config.preference, config.train.objective, defaults()
  for key, readers in READERS.items():
    if kind not in readers and p[key] != own[key]:
      raise ConfigError(f"preference.{key}", f"is set but train.objective={kind} does not read it",
                        f"set train.objective={'|'.join(readers)}, or leave it at {own[key]!r}")
  if kind not in KINDS:
    return
  if p.beta <= 0:
    raise ConfigError("preference.beta", f"must be > 0, got {p.beta}", "use e.g. 0.1 (dpo) or 2 (simpo)")
  for key, choices in (("loss", LOSSES), ("reference", REFERENCES)):
    if p[key] not in choices:
      raise ConfigError(f"preference.{key}", f"'{p[key]}' is not one of {', '.join(choices)}", "pick one of them")
  if not 0 <= p.label_smoothing < 0.5:
    raise ConfigError("preference.label_smoothing", f"{p.label_smoothing} is not in [0, 0.5)", "use e.g. 0.1")
  if p.label_smoothing and p.loss == "ipo":
    raise ConfigError("preference.label_smoothing", "is not read by preference.loss=ipo",
                      "set it to 0, or use preference.loss=sigmoid")
  for key in ("simpo_gamma", "orpo_lambda"):
    if p[key] < 0:
      raise ConfigError(f"preference.{key}", f"must be >= 0, got {p[key]}", "fix the value")
  if p.reference == "adapters_off" and not lora.active(config.model):
    raise ConfigError("preference.reference", "adapters_off needs LoRA (model.lora.rank > 0): without adapters "
                      "there is nothing to switch off", "set preference.reference=auto or frozen")
  if config.mesh.pipeline * config.mesh.dcn_pipeline > 1:
    raise ConfigError("mesh.pipeline", f"train.objective={kind} does not run pipelined (its step is one forward of "
                      "both sides per microbatch)", "set mesh.pipeline=1 and mesh.dcn_pipeline=1")
  if config.data.source != "arrayrecord" or config.data.mixture or not config.data.path:
    raise ConfigError("data.path", f"train.objective={kind} reads one folder of preference pairs",
                      "prepare one with tools/prepare_data.py --format=preference and set data.path to it "
                      "(data.source=arrayrecord, no data.mixture)")
  if config.eval.sets:
    raise ConfigError("eval.sets", f"is not read by train.objective={kind} (it evaluates the folder's held-out pairs)",
                      "clear eval.sets")


def reference_mode(config) -> str | None:
  """The reference of ``config`` (``frozen``, ``adapters_off``, ``precomputed``), or None (reference-free)."""
  if config.train.objective != "dpo":
    return None
  mode = config.preference.reference
  return logprobs.Reference.default_mode(config) if mode == "auto" else mode


# ------------------------------------------------------------------------------------------------ the losses


def pair_losses(kind: str, p, logp_c, logp_r, n_c, n_r, ref_c=None, ref_r=None):
  """Per pair: (the loss, the chosen reward, the rejected reward) from the sequences' summed log-probs (``logp``),
  response token counts (``n``) and, for ``dpo``, the reference's sums. ORPO's NLL term is not included (it is
  token-weighted over the whole batch: :func:`nll_term`). ``p``: the ``preference`` config group."""
  e = p.label_smoothing

  def smooth(x):  # -log s(x), with label smoothing e: the labels flipped with probability e (cDPO)
    return -(1 - e) * jax.nn.log_sigmoid(x) - e * jax.nn.log_sigmoid(-x)

  if kind == "dpo":
    ratio_c, ratio_r = logp_c - ref_c, logp_r - ref_r
    if p.loss == "ipo":
      ratio_c, ratio_r = ratio_c / jnp.maximum(n_c, 1.0), ratio_r / jnp.maximum(n_r, 1.0)
      return (ratio_c - ratio_r - 1 / (2 * p.beta)) ** 2, p.beta * ratio_c, p.beta * ratio_r
    return smooth(p.beta * (ratio_c - ratio_r)), p.beta * ratio_c, p.beta * ratio_r
  mean_c, mean_r = logp_c / jnp.maximum(n_c, 1.0), logp_r / jnp.maximum(n_r, 1.0)
  if kind == "simpo":
    reward_c, reward_r = p.beta * mean_c, p.beta * mean_r
    return smooth(reward_c - reward_r - p.simpo_gamma), reward_c, reward_r
  # orpo: log odds = log p - log(1 - p) with log p = mean (< 0): log1p(-exp(mean)) is exact near 0 and -inf.
  log_odds = (mean_c - mean_r) - (jnp.log1p(-jnp.exp(mean_c)) - jnp.log1p(-jnp.exp(mean_r)))
  return -p.orpo_lambda * jax.nn.log_sigmoid(log_odds), p.orpo_lambda * mean_c, p.orpo_lambda * mean_r


def pair_sums(model, params, batch, context: int = 1):
  """(summed response log-probs, response token counts), each float32 [B, 2] (chosen, rejected), of ``batch``'s
  pairs under ``params``: one forward over the 2B rows, row 2i chosen and 2i+1 rejected; and that forward's
  auxiliary losses (a MoE router's: the policy's step adds them, weighted)."""
  b, t = batch["chosen_inputs"].shape
  rows = {k: sharding.constrain(jnp.stack([batch["chosen_" + k], batch["rejected_" + k]], 1).reshape(2 * b, t),
                                ("batch", "length")) for k in batch_lib.KEYS}
  rows = context_lib.balance(rows, context)
  logps, aux = logprobs.token_logps_and_aux(model, params, rows)
  return jnp.sum(logps, -1).reshape(b, 2), jnp.sum(rows["loss_mask"].astype(jnp.float32), -1).reshape(b, 2), aux


def pair_statistics(kind: str, p, sums, counts, ref=None, weight=None) -> dict:
  """Sums over pairs (``weight``: each pair's, default 1) of the loss terms and metrics: ``loss`` (the pair losses),
  ``nll`` (ORPO: the chosen tokens' summed cross-entropy) and each of :data:`METRICS`, summed."""
  ref_c, ref_r = (ref[:, 0], ref[:, 1]) if ref is not None else (None, None)
  losses, reward_c, reward_r = pair_losses(kind, p, sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1], ref_c, ref_r)
  w = jnp.ones_like(losses) if weight is None else weight
  total = lambda x: jnp.sum(jnp.where(w > 0, x, 0.0) * w)  # noqa: E731 - padded pairs: selected away
  return {"loss": total(losses), "nll": -total(sums[:, 0]),
          "rewards/chosen": total(reward_c), "rewards/rejected": total(reward_r),
          "rewards/margin": total(reward_c - reward_r),
          "rewards/accuracy": total((reward_c > reward_r).astype(jnp.float32)),
          "logps/chosen": total(sums[:, 0]), "logps/rejected": total(sums[:, 1])}


def objective_value(kind: str, p, stats: dict, pairs, chosen_tokens):
  """The mean objective (or a microbatch's share of it): summed pair losses / ``pairs``, plus for ORPO the chosen
  tokens' summed cross-entropy / ``chosen_tokens`` (both the whole batch's, at least 1)."""
  value = stats["loss"] / jnp.maximum(pairs, 1.0)
  if kind == "orpo":
    value = value + stats["nll"] / jnp.maximum(chosen_tokens, 1.0)
  return value


# -------------------------------------------------------------------------------------------- the objective

# One reference per run, shared by its step and its evaluator (a frozen copy is the size of the params).
_REFERENCES: dict[int, tuple] = {}


def _reference(run):
  """The run's :class:`.logprobs.Reference` (None: reference-free, or precomputed)."""
  mode = reference_mode(run.config)
  if mode not in logprobs.REFERENCES:
    return None
  held = _REFERENCES.get(id(run))
  if held is None or held[0]() is not run:
    held = (weakref.ref(run), logprobs.Reference(run, mode))
    _REFERENCES[id(run)] = held
    weakref.finalize(run, _REFERENCES.pop, id(run), None)
  return held[1]


class Preference(Objective):
  """A preference objective (its kind: :attr:`kind`, one of :data:`KINDS`)."""
  kind = ""
  console_metrics = ("rewards/accuracy", "rewards/margin", "eval_rewards/accuracy", "eval_rewards/margin")

  def validate(self, config) -> None:
    validate(config)

  def abstract_batch(self, run) -> dict[str, jax.ShapeDtypeStruct]:
    b, t = run.config.train.global_batch_size, run.config.data.seq_len
    example = batch_lib.from_tokens(np.zeros((1, t + 1), np.int32))
    out = {f"{side}_{k}": jax.ShapeDtypeStruct((b, t), v.dtype, sharding=run.batch_sharding)
           for side in data_lib.SIDES for k, v in example.items()}
    if reference_mode(run.config) == "precomputed":
      for side in data_lib.SIDES:
        out[f"reference_{side}"] = jax.ShapeDtypeStruct((b,), jnp.float32, sharding=_pair_sharding(run))
    return out

  def abstract_extra(self, run) -> tuple:
    """With a frozen reference: its params' shapes, laid out like the params (no copy is made)."""
    if reference_mode(run.config) != "frozen":
      return ()
    shardings = logprobs.without_adapters(run.state_shardings.params)
    abstract = logprobs.without_adapters(state_lib.abstract(run.model, run.tx).params)
    return (jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings),)

  def open_train(self, config):
    if reference_mode(config) == "precomputed":
      check_precomputed(config)
    return data_lib.stream(config, reference_mode(config) == "precomputed")

  def to_global(self, run, local_batch: dict) -> dict:
    data_lib.check_ids(local_batch, run.config.model.vocab_size, run.config.data.path)
    return _to_global(run, local_batch, self.abstract_batch(run))

  def make_train_step(self, run):
    kind, p, model, mode = self.kind, run.config.preference, run.model, reference_mode(run.config)
    microbatches, context = run.microbatches, context_lib.shards(run.mesh)
    trained_shardings, update_shardings = step_lib.trained_shardings_of(model, run.state_shardings)
    aux_metrics = tuple(f"aux_loss/{name}" for name in run.aux_weights)

    def reference_sums(params, batch, extra):
      """The reference's sums: read with the batch, or a forward with the frozen params (``extra``) or the policy's
      without its adapters, never differentiated."""
      if mode == "precomputed":
        return jnp.stack([batch["reference_chosen"], batch["reference_rejected"]], 1)
      if mode is None:
        return None
      ref_params = extra[0] if mode == "frozen" else logprobs.without_adapters(params)
      return jax.lax.stop_gradient(pair_sums(model, jax.lax.stop_gradient(ref_params), batch, context)[0])

    def objective(params, batch, ref, pairs, chosen_tokens):
      sums, counts, aux = pair_sums(model, params, batch, context)
      stats = pair_statistics(kind, p, sums, counts, ref)
      # The model's auxiliary losses (a MoE router's), weighted as the language model's step weighs them: each
      # microbatch's by its share of the pairs, so that their sum is the batch's mean.
      share = sums.shape[0] / jnp.maximum(pairs, 1.0)
      stats.update({f"aux_loss/{k}": v * share for k, v in aux.items()})
      return objective_value(kind, p, stats, pairs, chosen_tokens) + share * logprobs.weighted_aux(
          aux, run.aux_weights), stats

    def grads_of(params, batch, extra, pairs, chosen_tokens):
      ref = reference_sums(params, batch, extra)
      (value, stats), grads = step_lib.value_and_trained_grad(model, objective, params, batch, ref, pairs,
                                                              chosen_tokens)
      return value, stats, grads

    def train_step(state, batch, skip, *extra):
      pairs = jnp.float32(batch["chosen_inputs"].shape[0])
      chosen_tokens = jnp.sum(batch["chosen_loss_mask"].astype(jnp.float32))
      if microbatches == 1:
        value, stats, grads = grads_of(state.params, batch, extra, pairs, chosen_tokens)
      else:
        def accumulate(carry, microbatch):
          out = grads_of(state.params, microbatch, extra, pairs, chosen_tokens)
          return jax.tree.map(jnp.add, carry, out), None
        zero_grads = jax.tree.map(jnp.zeros_like, model.split_trainable(state.params)[0])
        if trained_shardings is not None:
          zero_grads = jax.lax.with_sharding_constraint(zero_grads, trained_shardings)
        zero_stats = {k: jnp.zeros((), jnp.float32) for k in ("loss", "nll", *METRICS, *aux_metrics)}
        (value, stats, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zero_stats, zero_grads),
                                                split_microbatches(batch, microbatches), unroll=scans.unroll())
      state, metrics = step_lib.apply_update(model, run.tx, run.lr_schedule, state, grads, value, 1.0, skip,
                                             update_shardings)
      metrics.update({k: stats[k] / pairs for k in METRICS}, **{k: stats[k] for k in aux_metrics}, tokens=jnp.sum(
          batch["chosen_loss_mask"] + batch["rejected_loss_mask"]).astype(jnp.float32))
      return state, metrics

    return train_step

  def step_fn(self, run, compile_step):
    reference = _reference(run)
    extra = reference.extra if reference else ()
    compiled = compile_step(run, self.make_train_step(run), self.abstract_extra(run))
    return lambda state, batch, skip: compiled(state, batch, skip, *extra)

  def make_evaluator(self, run):
    """``params -> fetch``: the loss and metrics over the folder's held-out pairs (``eval_loss``,
    ``eval_rewards/accuracy``, ...; pair-weighted, ORPO's NLL token-weighted)."""
    kind, p, model, config = self.kind, run.config.preference, run.model, run.config
    local = data_lib.eval_batches(config, reference_mode(config) == "precomputed")[:config.eval.max_batches or None]
    if not local:
      logging.warning("eval.every_steps=%d but %s holds no held-out pairs (its eval split is empty): no eval",
                      config.eval.every_steps, config.data.path)
      return None
    shapes = {**self.abstract_batch(run),
              "pair_weight": jax.ShapeDtypeStruct((config.train.global_batch_size,), jnp.float32,
                                                  sharding=_pair_sharding(run))}
    batches = [_to_global(run, b, shapes) for b in local]
    reference, mode = _reference(run), reference_mode(config)
    extra = reference.extra if reference else ()
    context = context_lib.shards(run.mesh)

    def sums_of(params, batch, *extra):
      sums, counts, _ = pair_sums(model, params, batch, context)
      if mode == "precomputed":
        ref = jnp.stack([batch["reference_chosen"], batch["reference_rejected"]], 1)
      elif mode is not None:
        ref = pair_sums(model, extra[0] if mode == "frozen" else logprobs.without_adapters(params), batch, context)[0]
      else:
        ref = None
      stats = pair_statistics(kind, p, sums, counts, ref, batch["pair_weight"])
      w = batch["pair_weight"]
      return {**stats, "pairs": jnp.sum(w), "chosen_tokens": jnp.sum(counts[:, 0] * w)}

    shardings_of = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
    evaluate_batch = jax.jit(sums_of, in_shardings=(run.state_shardings.params, shardings_of(shapes),
                                                    *map(shardings_of, self.abstract_extra(run))))

    def evaluate(params):
      with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
        parts = [evaluate_batch(params, b, *extra) for b in batches]

      def fetch() -> dict[str, float]:
        total = {k: sum(float(x[k]) for x in parts) for k in parts[0]}
        pairs = max(total["pairs"], 1.0)
        loss = total["loss"] / pairs
        if kind == "orpo":
          loss += total["nll"] / max(total["chosen_tokens"], 1.0)
        return {"eval_loss": loss, "eval_pairs": total["pairs"],
                **{f"eval_{k}": total[k] / pairs for k in METRICS}}

      return fetch

    return evaluate


# ------------------------------------------------------------------------ precomputed reference log-probs


def reference_of(config) -> dict:
  """What a run's reference model is (precomputed log-probs are valid only for the same): where its params start."""
  return {"model": config.model.name, "restore_from": config.checkpoint.restore_from,
          "restore_mode": config.checkpoint.restore_mode, "seed": config.train.seed}


def check_precomputed(config) -> None:
  """The data folder's precomputed log-probs were computed for this run's reference (DataError otherwise)."""
  path = epath.Path(config.data.path) / data_lib.REFERENCE_INFO
  info = json.loads(path.read_text()) if path.exists() else {}
  if info.get("reference") != reference_of(config):
    raise DataError(config.data.path, f"its precomputed reference log-probs ({data_lib.REFERENCE_INFO}) are "
                    f"{'missing' if not info else 'of another reference model: ' + json.dumps(info.get('reference'))}",
                    "run tools/reference_logps.py with this run's config first")


def compute_reference(run) -> dict[str, np.ndarray]:
  """Every pair's summed response log-probs under the reference model of ``run`` (:func:`jaxtrain.train.trainer.
  build`'s): its starting params without adapters (:func:`jaxtrain.train.start.starting_state`), per split
  (float32 [pairs, 2]), computed on the run's mesh with the training forward, and written into the data folder
  (process 0) for ``preference.reference=precomputed``."""
  config = run.config
  params = logprobs.without_adapters(start.starting_state(run, role="the frozen reference model:").params)
  shapes = {k: v for k, v in Preference().abstract_batch(run).items() if not k.startswith("reference_")}
  shardings_of = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
  param_shardings = logprobs.without_adapters(run.state_shardings.params)
  sums_of = jax.jit(lambda p, b: pair_sums(run.model, p, b, context_lib.shards(run.mesh))[0],
                    in_shardings=(param_shardings, shardings_of(shapes)))
  manifest = data_lib.check(config)
  b = config.train.global_batch_size
  lanes = np.asarray(loader.process_lanes(b, jax.process_index(), jax.process_count()))
  out = {}
  for split in sorted({s["split"] for s in manifest["shards"]}):
    source = data_lib.Pairs(config.data.path, manifest, split)
    parts = []
    for first in range(0, len(source), b):
      indices = np.arange(first, first + b) % len(source)
      local = data_lib.make_batch(source, indices[lanes], config.data.seq_len)
      with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
        sums = sums_of(params, _to_global(run, local, shapes))
      parts.append(np.asarray(multihost_utils.process_allgather(sums, tiled=True)))
    out[split] = np.concatenate(parts)[:len(source)].astype(np.float32)
  if jax.process_index() == 0:
    for split, values in out.items():
      data_lib.write_reference(config.data.path, split, values, {"reference": reference_of(config),
                                                                 "seq_len": config.data.seq_len})
  return out


def _pair_sharding(run) -> NamedSharding:
  """A [B] array's: split over the batch axes as the rows are."""
  return NamedSharding(run.mesh, P(run.batch_sharding.spec[0]))


def _to_global(run, local_batch: dict, shapes: dict) -> dict:
  """This process's rows of a preference batch -> global arrays laid out as ``shapes`` (host-side fields stay)."""
  return {k: jax.make_array_from_process_local_data(s.sharding, local_batch[k]) for k, s in shapes.items()}


@OBJECTIVES.register("dpo")
class DPO(Preference):
  """Direct preference optimization against a reference model (sigmoid, cDPO or IPO)."""
  kind = "dpo"


@OBJECTIVES.register("simpo")
class SimPO(Preference):
  """SimPO: length-normalized rewards and a target margin, no reference model."""
  kind = "simpo"


@OBJECTIVES.register("orpo")
class ORPO(Preference):
  """ORPO: the chosen responses' NLL plus an odds-ratio preference term, no reference model."""
  kind = "orpo"

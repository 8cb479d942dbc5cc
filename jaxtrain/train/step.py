"""The training step: next-token loss plus the model's weighted auxiliary losses, gradient accumulation over
microbatches (or the pipelined forward), optimizer update, and the finiteness guard."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from jaxtrain import integrity
from jaxtrain import loss_scale as loss_scale_lib
from jaxtrain import optim
from jaxtrain.models import Model, Output, scans
from jaxtrain.parallel import context as context_lib
from jaxtrain.parallel import pipeline as pipeline_lib
from jaxtrain.parallel.pipeline import split_microbatches
from jaxtrain.train import losses as losses_lib
from jaxtrain.train import offload
from jaxtrain.train import state as state_lib
from jaxtrain.train.state import TrainState


def _losses(out, batch, sources: int = 0, z_loss: bool = False) -> dict:
  """What one forward contributes: summed token losses, its auxiliary losses and metrics (one microbatch's); with
  ``sources`` > 0 (a data mixture's components: ``batch["sources"]``), also each component's summed token losses
  and real target tokens (``by_source``: two [sources] arrays); with ``z_loss``, the summed squared log normalizers
  of the real target tokens (``z_sum``). Masked tokens are selected away, never multiplied by 0: whatever their
  logits, they add 0 to every sum and their gradient is 0 (``inf * 0`` would be NaN)."""
  out = Output.of(out)
  mask = batch["loss_mask"].astype(jnp.float32)
  real = mask > 0
  if z_loss:
    losses, log_z = losses_lib.cross_entropy_and_log_normalizer(out.logits, batch["targets"])
  else:
    losses = losses_lib.cross_entropy(out.logits, batch["targets"])
  counted = jnp.where(real, losses, 0.0) * mask
  result = {"loss_sum": jnp.sum(counted), "tokens": jnp.sum(mask), "aux": out.aux_losses,
            "metrics": out.metrics, "forwards": 1.0, "maxima": out.maxima}
  if z_loss:
    log_z = jnp.where(real, log_z, 0.0)  # (selected before the square: its gradient 2 log Z x 0 is then 0, not NaN)
    result["z_sum"] = jnp.sum(log_z * log_z * mask)
  if sources:
    of_source = (batch["sources"][..., None] == jnp.arange(sources)).astype(jnp.float32)  # [b, t, sources]
    result["by_source"] = (jnp.einsum("bt,bts->s", counted, of_source), jnp.einsum("bt,bts->s", mask, of_source))
  return result


def forward_losses(model: Model, params, batch, pipeline: pipeline_lib.Schedule | None = None,
                   sources: int = 0, z_loss: bool = False, weigh=None) -> dict:
  """``{loss_sum, tokens, aux: {name: sum}, metrics: {name: sum}, forwards[, by_source][, z_sum][, value]}`` over the
  batch: with a pipeline schedule the model runs pipelined (jaxtrain.parallel.pipeline.forward), and aux losses and
  metrics are summed over its microbatches (``forwards`` of them); divide by ``forwards`` for their mean. With
  ``weigh(out) -> scalar``, a linear function of those sums (constants times leaves; no division by a leaf), also
  ``value``: ``weigh(out)``, the one entry to differentiate (with a 1f1b schedule the others carry no gradient:
  the schedule computes value's gradient itself)."""
  head_loss = functools.partial(_losses, sources=sources, z_loss=z_loss)
  if pipeline is not None:
    def merged(out, layer_extras):
      if layer_extras:  # the layers' aux losses and metrics (a MoE router's), summed like the head's
        out = {**out, "aux": {**out["aux"], **layer_extras["aux_losses"]},
               "metrics": {**out["metrics"], **layer_extras["metrics"]}}
      return out
    out, layer_extras, value = pipeline_lib.forward(model, params, batch, pipeline, head_loss,
                                                    weigh and (lambda t, e: weigh(merged(t, e))))
    if pipeline.scheduled_backward:  # its head runs on 1/S of each microbatch's tokens on each stage (S calls)
      out = {**out, "forwards": jnp.float32(pipeline.microbatches)}
    out = merged(out, layer_extras)
  else:
    out = head_loss(model.forward(params, batch["inputs"], batch["positions"], batch["segment_ids"]), batch)
    value = weigh(out) if weigh else None
  return out if weigh is None else {**out, "value": value}


def loss_fn(model: Model, params, batch, pipeline: pipeline_lib.Schedule | None = None):
  """(sum of token cross-entropies over the loss mask, number of real target tokens); differentiate the first."""
  out = forward_losses(model, params, batch, pipeline, weigh=lambda out: out["loss_sum"])
  return out["value"], out["tokens"]


def aux_loss_names(model: Model, seq_len: int) -> list[str]:
  """The auxiliary losses ``model`` returns (from its forward's shapes; nothing is computed)."""
  tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  out = jax.eval_shape(lambda p, t: Output.of(model.bind(p)(t, t, t)), model.abstract_params, tokens)
  return sorted(out.aux_losses)


def make_train_step(model: Model, tx: optax.GradientTransformation, lr_schedule: optax.Schedule,
                    microbatches: int, state_shardings: TrainState | None = None,
                    pipeline: pipeline_lib.Schedule | None = None, aux_weights: dict[str, float] | None = None,
                    context: int = 1, sources: tuple[str, ...] = (), z_loss_weight: float = 0.0):
  """``(state, batch, skip) -> (state, metrics)``. The objective is the mean over all real target tokens of the
  whole batch of the token cross-entropy, plus ``sum(aux_weights[n] * mean aux loss n)`` over the model's
  auxiliary losses, plus ``z_loss_weight`` times the mean over the real target tokens of ``(log Z)^2``, Z being
  the softmax's normalizer (PaLM's output z-loss, which keeps log Z near 0; with a weight of 0 there is no such
  term in the program); k microbatches give the same update as one batch k times larger: accumulated one after the
  other, or, with a ``pipeline`` schedule, flowing through its stages together. The update is applied only if
  the loss, the gradient norm and every element of the new params and optimizer state are finite (one fused
  reduction per device, :func:`jaxtrain.integrity.all_finite`) and ``skip`` (a host-side decision: a known
  bad batch being replayed) is false; otherwise params and optimizer state stay as they were and only the step
  counter advances. With ``context`` > 1 shards of the sequence (context parallelism) the batch's tokens are first
  put in the load-balanced order (jaxtrain.parallel.context.balance). Metrics: ``loss`` (the cross-entropy),
  ``aux_loss/<name>``, ``z_loss`` (the mean ``(log Z)^2``, unweighted; with a z-loss weight only), the model's own
  metrics, ...;
  with ``sources`` (a data mixture's component names; the batch then carries ``sources``), ``mix/<name>`` (the
  component's share of the step's real target tokens) and ``loss/<name>`` (its mean token loss; NaN when the step
  holds none of its tokens: :func:`host_metrics` drops it)."""
  aux_weights = aux_weights or {}
  # Only the trained params are differentiated, updated and checked (LoRA: the adapters; the frozen base is
  # passed through untouched, bitwise); without LoRA that is all of them.
  trained_shardings, update_shardings = trained_shardings_of(model, state_shardings)
  passes = 1 if pipeline is not None else microbatches

  scaler = tx if isinstance(tx, loss_scale_lib.LossScaled) else None  # float16: the loss scaled (optim.loss_scale)

  def objective(params, batch, tokens, scale=None):
    """(Summed token losses + z_loss_weight x summed (log Z)^2 + (tokens / passes) x the weighted aux losses) /
    tokens, ``tokens`` being the real target tokens of the whole batch (at least 1 in the division): the mean
    objective, or a microbatch's share of it. Divided here, the gradient comes out of the backward pass divided (no
    pass of its own over it)."""
    # A 1f1b pipeline computes the gradient of this (linear) function inside its schedule: the mean's divisor
    # (the forwards) is then the constant it equals, not the sum (a leaf) the other paths divide by.
    forwards = pipeline.microbatches if pipeline is not None and pipeline.scheduled_backward else None

    def weigh(out):
      value = out["loss_sum"]
      if z_loss_weight:  # (no term at all with a weight of 0)
        value = value + z_loss_weight * out["z_sum"]
      if aux_weights:  # (no term at all without aux losses: the same program as a plain language model)
        value = value + tokens / passes * sum(w * out["aux"][n] / (forwards or out["forwards"])
                                              for n, w in aux_weights.items())
      value = value / jnp.maximum(tokens, 1.0)
      return value if scale is None else value * scale

    out = forward_losses(model, params, batch, pipeline, len(sources), bool(z_loss_weight), weigh)
    return out.pop("value"), out

  def grad_fn(params, batch, tokens, scale):  # the gradient with respect to the trained params only
    return value_and_trained_grad(model, objective, params, batch, tokens, scale)

  def train_step(state: TrainState, batch, skip):
    batch = context_lib.balance(batch, context)
    tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))  # the batch's real target tokens
    scale = state.opt_state.scale if scaler else None
    if passes == 1:
      (_, out), grads = grad_fn(state.params, batch, tokens, scale)
      aux = jax.tree.map(lambda v: v / out["forwards"], (out["aux"], out["metrics"]))
      maxima = out["maxima"]
    else:
      def accumulate(carry, microbatch):
        (_, out), g = grad_fn(state.params, microbatch, tokens, scale)
        mean = jax.tree.map(lambda v: v / out["forwards"], (out["aux"], out["metrics"]))
        summed = jax.tree.map(jnp.add, carry[:-1], (out["loss_sum"], out["tokens"], mean, g, out.get("by_source"),
                                                    out.get("z_sum")))
        return (*summed, jax.tree.map(jnp.maximum, carry[-1], out["maxima"])), None
      zero_grads = jax.tree.map(jnp.zeros_like, model.split_trainable(state.params)[0])
      if trained_shardings is not None:
        zero_grads = jax.lax.with_sharding_constraint(zero_grads, trained_shardings)
      micro = split_microbatches(batch, microbatches)
      first = jax.tree.map(lambda a: a[0], micro)
      shapes = jax.eval_shape(lambda: forward_losses(model, state.params, first, pipeline, len(sources),
                                                     bool(z_loss_weight)))
      zero_aux, zero_by_source = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32),
                                              ((shapes["aux"], shapes["metrics"]), shapes.get("by_source")))
      zero_z = jnp.zeros((), jnp.float32) if z_loss_weight else None
      lowest = jax.tree.map(lambda a: jnp.full(a.shape, -jnp.inf, jnp.float32), shapes["maxima"])
      init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zero_aux, zero_grads, zero_by_source, zero_z,
              lowest)
      (loss_sum, counted, aux, grads, by_source, z_sum, maxima), _ = jax.lax.scan(accumulate, init, micro,
                                                                                   unroll=scans.unroll())
      aux = jax.tree.map(lambda v: v / microbatches, aux)
      out = {"loss_sum": loss_sum, "tokens": counted, "by_source": by_source, "z_sum": z_sum}
    if scaler:
      grads = jax.tree.map(lambda g: g / scale, grads)
    state, metrics = apply_update(model, tx, lr_schedule, state, grads, out["loss_sum"], out["tokens"], skip,
                                  update_shardings, scaler)
    if maxima:  # model.qk_clip: the heads whose logits went past it scaled back, where the update was applied
      state, clip_metrics = qk_clip(model, state, maxima, metrics["skipped"] == 0)
      metrics.update(clip_metrics)
    denom = jnp.maximum(out["tokens"], 1.0)
    aux_losses, model_metrics = aux
    metrics = {**metrics, "tokens": out["tokens"], **{f"aux_loss/{k}": v for k, v in aux_losses.items()},
               **model_metrics}
    if z_loss_weight:
      metrics["z_loss"] = out["z_sum"] / denom
    if sources:
      source_loss, source_tokens = out["by_source"]
      for i, name in enumerate(sources):
        metrics[f"mix/{name}"] = source_tokens[i] / denom
        metrics[f"loss/{name}"] = jnp.where(source_tokens[i] > 0, source_loss[i] / jnp.maximum(source_tokens[i], 1.0),
                                            jnp.nan)
    return state, metrics

  return train_step


def qk_clip(model: Model, state: TrainState, maxima: dict, applied) -> tuple[TrainState, dict]:
  """``state`` with its params QK-clipped by the step's per-head largest logits ``maxima`` where ``applied`` (the
  family's rule: :meth:`jaxtrain.models.Model.qk_clip`), and the metrics ``attn/max_logit`` (the largest logit of
  the step) and ``qk_clip/heads`` (the heads scaled back)."""
  threshold = float(model.cfg.qk_clip)
  largest = jnp.max(jnp.stack([jnp.max(m) for m in maxima.values()]))
  clipped = sum(jnp.sum(jnp.isfinite(m) & (m > threshold)) for m in maxima.values())
  metrics = {"attn/max_logit": largest, "qk_clip/heads": jnp.where(applied, clipped, 0).astype(jnp.float32)}
  return state.replace(params=model.qk_clip(state.params, maxima, applied)), metrics


def trained_shardings_of(model: Model, state_shardings: TrainState | None):
  """(The trained params' shardings, (those, the optimizer state's)) for :func:`apply_update`'s finiteness check;
  (None, None) without shardings."""
  if state_shardings is None:
    return None, None
  trained = model.split_trainable(state_shardings.params)[0]
  return trained, (trained, state_shardings.opt_state)


def value_and_trained_grad(model: Model, fn, params, *args):
  """``jax.value_and_grad(fn, has_aux=True)`` with respect to the trained params only (LoRA: the adapters; the
  frozen base is passed through untouched, bitwise; without LoRA, all of them): ``((value, aux), grads)``, grads
  shaped like the trained params. ``fn(params, *args) -> (value, aux)``."""
  trained, frozen = model.split_trainable(params)
  return jax.value_and_grad(lambda t: fn(model.join_trainable(t, frozen), *args), has_aux=True)(trained)


# The optax states that count the updates a learning-rate schedule is evaluated at: scale_by_schedule's (every
# optimizer that takes a schedule as its lr: adamw, lion, adafactor, muon's two parts, sgd) and inject_hyperparams'.
SCHEDULE_STATES = (optax.ScaleByScheduleState, optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)


def schedule_count(opt_state):
  """The updates the optimizer has applied, as its learning-rate schedule counts them: the ``count`` of the first of
  :data:`SCHEDULE_STATES` found in ``opt_state`` (all of them move together: an update replaces the whole state or
  none of it), or None for an optimizer without one (a constant lr)."""
  for kind in SCHEDULE_STATES:
    found = optax.tree_utils.tree_get_all_with_path(opt_state, kind.__name__)
    if found:
      return found[0][1].count
  return None


def apply_update(model: Model, tx: optax.GradientTransformation, lr_schedule: optax.Schedule, state: TrainState,
                 grads, loss_sum, count, skip, update_shardings=None,
                 scaler: loss_scale_lib.LossScaled | None = None) -> tuple[TrainState, dict]:
  """The optimizer step every objective ends with: ``grads`` (of the trained params) applied to ``state`` only if
  the loss (``loss_sum / max(count, 1)``: the mean over what ``count`` counts), the gradient norm and every element
  of the new trained params and optimizer state are finite (one fused reduction per device,
  :func:`jaxtrain.integrity.all_finite`) and ``skip`` (a host-side decision: a known bad batch being replayed) is
  false; otherwise params and optimizer state stay as they were and only the step counter advances. Returns the new
  state and ``{loss, grad_norm, lr, nonfinite, skipped}``; ``lr`` is the rate the update was computed with, the
  schedule at the optimizer's own count (:func:`schedule_count`), which a step that is not applied does not
  advance. With a loss ``scaler`` (``grads`` already unscaled), an overflow of the scaled gradients skips the step
  and adjusts the scale; a dynamic scale handles it (halving), and only a non-finite loss, or gradients that
  overflow at the smallest scale (1), count as ``nonfinite`` for the NaN policy; a static scale never moves, so
  there every overflow is ``nonfinite``. Metrics ``loss_scale`` (the scale this step used) and ``overflow`` are
  added."""
  trained, frozen = model.split_trainable(state.params)
  old_opt_state, host_shardings, streamed = state.opt_state, None, None
  if update_shardings is not None and state_lib.offloaded(update_shardings[1]):
    # optim.offload_state: the moments live in host memory between steps. They come over for the update once the
    # gradients are there (the barrier: no copy starts before the backward is done, so they never share the device
    # with its activations), the new ones go back, and the arithmetic is the very same as without offload. An
    # elementwise optimizer's update streams over the stacked layers, one layer's state on the device at a time
    # (jaxtrain/train/offload.py); any other brings the whole state over, and its peak does not drop
    # (docs/parallelism.md).
    host_shardings = update_shardings[1]
    streamed = offload.plan(tx, model, state.params, state.opt_state, host_shardings)
    grads, old_opt_state = jax.lax.optimization_barrier((grads, old_opt_state))
    if streamed is None:
      device_shardings = state_lib.on_device(host_shardings)
      old_opt_state = jax.device_put(old_opt_state, device_shardings)
      update_shardings = (update_shardings[0], device_shardings)
  # The optimizer sees the whole params tree (frozen params: zero gradients it ignores, no state).
  full_grads = model.join_trainable(grads, jax.tree.map(jnp.zeros_like, frozen))
  loss, grad_norm = loss_sum / jnp.maximum(count, 1.0), optax.tree.norm(grads)

  def verdict(states_finite):
    """(finite, nonfinite, grads finite) given whether every element of the new trained params and state is."""
    if scaler is None:
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & states_finite
      return finite, ~finite, None
    grads_ok = jnp.isfinite(grad_norm) & states_finite
    finite = jnp.isfinite(loss) & grads_ok
    if scaler.dynamic:  # an overflow halves the scale and the next step tries again, unless it is 1 already
      return finite, ~jnp.isfinite(loss) | (~grads_ok & (state.opt_state.scale <= 1.0)), grads_ok
    # a static scale never moves: the next batch overflows like this one, and only the NaN policy can act
    return finite, ~finite, grads_ok

  if streamed is not None:
    norm = optim.clip_norm_of(tx, full_grads, old_opt_state, state.params)
    decided = {}

    def decide(states_finite):
      decided["finite"], decided["nonfinite"], decided["grads_finite"] = verdict(states_finite)
      return decided["finite"] & ~skip

    params, opt_state, apply = offload.update(model, tx, streamed, state.params, full_grads, old_opt_state,
                                              host_shardings, norm, decide)
    finite, nonfinite, grads_finite = decided["finite"], decided["nonfinite"], decided["grads_finite"]
    host_shardings = None  # (already there)
  else:
    updates, opt_state = tx.update(full_grads, old_opt_state, state.params)
    new_trained = optax.apply_updates(trained, model.split_trainable(updates)[0])
    finite, nonfinite, grads_finite = verdict(integrity.all_finite((new_trained, opt_state), update_shardings))
  apply = finite & ~skip
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)  # noqa: E731
  # The lr this update was computed with: the schedule at the optimizer's own count, not at the loop's step (a step
  # that is not applied leaves the count where it was, so after one the two differ for good). A step not applied
  # logs that same rate, the one its batch would have had and the next applied update uses: 0 would say the
  # schedule dropped, which it did not (``skipped`` says the update was dropped), and would bend every plot of it.
  counted = schedule_count(old_opt_state)
  metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(state.step if counted is None else counted),
             "nonfinite": nonfinite.astype(jnp.float32), "skipped": (~apply).astype(jnp.float32)}
  if streamed is None:
    params = model.join_trainable(keep(new_trained, trained), frozen)
    opt_state = keep(opt_state, old_opt_state)
  if scaler is not None:
    metrics.update(loss_scale=state.opt_state.scale, overflow=(jnp.isfinite(loss) & ~grads_finite).astype(jnp.float32))
    opt_state = scaler.adjust(opt_state, finite)
  if host_shardings is not None:
    opt_state = jax.device_put(opt_state, host_shardings)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics  # extra: as it was


def host_metrics(values: dict[str, float]) -> dict[str, float]:
  """A step's fetched metrics as logged: a component's ``loss/<name>`` is left out when the step holds none of its
  tokens."""
  return {k: v for k, v in values.items() if not (k.startswith("loss/") and math.isnan(v)
                                                  and values.get("mix/" + k[5:]) == 0.0)}


def make_eval_step(model: Model, pipeline: pipeline_lib.Schedule | None = None, context: int = 1):
  """``(params, batch) -> (sum of token losses, real target tokens)`` for eval loss and perplexity."""
  return lambda params, batch: loss_fn(model, params, context_lib.balance(batch, context), pipeline)

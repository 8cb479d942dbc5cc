"""The training step: next-token loss, gradient accumulation over microbatches, optimizer update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxtrain import integrity
from jaxtrain import sharding
from jaxtrain.models import Model
from jaxtrain.parallel import pipeline as pipeline_lib
from jaxtrain.train.state import TrainState


def loss_fn(model: Model, params, batch, pipeline: pipeline_lib.Schedule | None = None):
  """(sum of token cross-entropies over the loss mask, number of real target tokens). With a pipeline
  schedule the layer stack runs pipelined over ``pipeline.microbatches`` microbatches of the batch."""
  if pipeline is not None:
    return _pipelined_loss(model, params, batch, pipeline)
  logits = model.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
  return _token_losses(logits, batch)


def _token_losses(logits, batch):
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(losses * mask), jnp.sum(mask)


def _pipelined_loss(model: Model, params, batch, schedule: pipeline_lib.Schedule):
  """Embed the batch, run the layers pipelined, then head and loss S microbatches at a time, one on each
  stage (so no stage repeats another's head, and only S microbatches' logits exist at once)."""
  module = model.bind(params)
  m, s = schedule.microbatches, schedule.stages
  micro = split_microbatches(batch, m)
  x = split_microbatches(module.embed_tokens(batch["inputs"]), m)
  x = pipeline_lib.run(module.apply_layer, params["layers"], model.logical_specs["layers"], x,
                       (micro["positions"], micro["segment_ids"]), schedule, ("batch", "length", "embed"))

  def by_stage(a, axes):  # [M, ...] -> [M / S, S, ...], microbatch c S + j on stage j
    return sharding.constrain(a.reshape(m // s, s, *a.shape[1:]), (None, "stage") + axes)

  per_stage_loss = jax.vmap(lambda x, b: _token_losses(module.head(x), b),
                            spmd_axis_name=pipeline_lib.stage_axis())

  @jax.checkpoint
  def head_loss(carry, inputs):
    return jax.tree.map(lambda total, part: total + part.sum(), carry, per_stage_loss(*inputs)), None

  zero = jnp.zeros((), jnp.float32)
  chunks = (by_stage(x, ("batch", "length", "embed")), jax.tree.map(lambda a: by_stage(a, ("batch", None)), micro))
  (loss_sum, tokens), _ = jax.lax.scan(head_loss, (zero, zero), chunks)
  return loss_sum, tokens


def split_microbatches(batch, num: int):
  """[B, ...] -> [num, B/num, ...]. Microbatch j takes rows j, j+num, ..., so every device keeps its rows."""
  def split(x):
    x = x.reshape(x.shape[0] // num, num, *x.shape[1:]).swapaxes(0, 1)
    return sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))
  return jax.tree.map(split, batch)


def make_train_step(model: Model, tx: optax.GradientTransformation, lr_schedule: optax.Schedule,
                    microbatches: int, state_shardings: TrainState | None = None,
                    pipeline: pipeline_lib.Schedule | None = None):
  """``(state, batch, skip) -> (state, metrics)``. The loss is the mean over all real target tokens of the
  whole batch, so k microbatches give the same update as one batch k times larger: accumulated one after the
  other, or, with a ``pipeline`` schedule, flowing through its stages together. The update is applied only if
  the loss, the gradient norm and every element of the new params and optimizer state are finite (one fused
  reduction per device, :func:`jaxtrain.integrity.all_finite`) and ``skip`` (a host-side decision: a known
  bad batch being replayed) is false; otherwise params and optimizer state stay as they were and only the step
  counter advances."""
  grad_fn = jax.value_and_grad(lambda p, b: loss_fn(model, p, b, pipeline), has_aux=True)
  param_shardings = state_shardings.params if state_shardings is not None else None
  update_shardings = (param_shardings, state_shardings.opt_state) if state_shardings is not None else None

  def train_step(state: TrainState, batch, skip):
    if microbatches == 1 or pipeline is not None:
      (loss_sum, tokens), grads = grad_fn(state.params, batch)
    else:
      def accumulate(carry, microbatch):
        (loss, n), g = grad_fn(state.params, microbatch)
        return jax.tree.map(jnp.add, carry, (loss, n, g)), None
      zero_grads = jax.tree.map(jnp.zeros_like, state.params)
      if param_shardings is not None:
        zero_grads = jax.lax.with_sharding_constraint(zero_grads, param_shardings)
      init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zero_grads)
      (loss_sum, tokens, grads), _ = jax.lax.scan(accumulate, init, split_microbatches(batch, microbatches))
    denom = jnp.maximum(tokens, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    loss, grad_norm = loss_sum / denom, optax.tree.norm(grads)
    finite = (jnp.isfinite(loss) & jnp.isfinite(grad_norm)
              & integrity.all_finite((params, opt_state), update_shardings))
    apply = finite & ~skip
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)  # noqa: E731
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr_schedule(state.step), "tokens": tokens,
               "nonfinite": (~finite).astype(jnp.float32), "skipped": (~apply).astype(jnp.float32)}
    return TrainState(step=state.step + 1, params=keep(params, state.params),
                      opt_state=keep(opt_state, state.opt_state)), metrics

  return train_step


def make_eval_step(model: Model, pipeline: pipeline_lib.Schedule | None = None):
  """``(params, batch) -> (sum of token losses, real target tokens)`` for eval loss and perplexity."""
  return lambda params, batch: loss_fn(model, params, batch, pipeline)

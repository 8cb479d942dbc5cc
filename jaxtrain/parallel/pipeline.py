"""Pipeline parallelism over the ``stage`` logical axis (the ``pipeline`` mesh axis): one SPMD program.

The layer stack is a pytree of arrays with a leading ``layers`` axis of L layers, stored the same way with or
without a pipeline (so checkpoints do not depend on the split). With S stages and R repeats the stack is
viewed as ``[R, S, K]`` groups of K = L / (R S) layers: group ``r S + s`` runs on stage s in round r.
R = 1 (``gpipe``, ``1f1b``): stage s holds layers ``[s K, (s+1) K)``, the stored sharding, so the view is free.
R > 1 (``circular``, ``interleaved_1f1b``): stage s runs the non-adjacent groups s, S + s, ... (virtual stages);
one all-to-all over the pipeline axis moves the weights from their stored blocks into that view inside the step,
and its transpose moves the gradients back.

All stages run in lockstep, ``jax.vmap`` over the stage axis with ``spmd_axis_name`` so each device computes
only its stage; activations move between neighbouring stages by a collective permute (a roll of the stage
axis). The schedules differ in when a microbatch's backward pass runs, and so in what is kept alive:

- ``gpipe`` / ``circular`` (:func:`run`): the forward loop of R M + S - 1 iterations, differentiated by autodiff.
  Iteration i: stage 0 takes microbatch ``i mod M`` from a buffer that holds every microbatch's latest
  activations; stage s > 0 takes what stage s - 1 produced at i - 1; the last stage writes its output back to the
  buffer, where stage 0 picks it up for the next round (circular). Each stage iteration is rematerialized, so the
  backward keeps every iteration's stage input: R M + S - 1 microbatch activations per stage, growing with M.
- ``1f1b`` / ``interleaved_1f1b`` (:func:`scheduled`): the backward is written into the schedule. Each tick every
  stage runs one forward unit (K layers on one microbatch) and one backward unit, and the last stage computes the
  head, the loss and its gradient for the microbatch it just finished, so that microbatch's backward starts at
  once. Forward unit k (microbatch ``c S + k mod S`` of round ``(k mod R S) div S`` for chunk ``c = k div R S``,
  Megatron's interleaved order) runs on stage s at tick ``k + s``; backward unit j (the rounds in reverse) at tick
  ``R S - 1 + j + S - 1 - s``. Only stage inputs of units in flight are kept: at most ``2 R S - 1`` (whatever
  M is), and the gradients are summed as they come. Warm-up ticks run forward units only and cool-down ticks
  backward units only, so the program's cost is (R M + S - 1)(f + b) for a unit's forward f and backward b: the
  same bubble as GPipe / circular, (S - 1) / (R M + S - 1), at a fraction of the memory. The embedding runs at the
  first stage's forward unit and its gradient at the first stage's backward unit, so no [M, ...] activation
  buffer exists. The step's objective must be linear in what the head and the layers sum (it is: sums of token
  losses, z-losses and router losses, each times a constant), so each microbatch's gradient is computed with
  its share of the objective's coefficients, in the forward pass (a ``jax.custom_vjp``; the backward rule scales
  the summed gradients by the incoming cotangent).

``1f1b`` differs from Megatron's (at most S - s microbatches in flight on stage s) by the lockstep: a hop between
stages takes a whole tick in both directions, so stage s keeps ``2 (S - s) - 1``; the bound does not grow with M.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import linen as nn

from jaxtrain import sharding
from jaxtrain.errors import ConfigError, check_choice, check_positive
from jaxtrain.models import scans
from jaxtrain.sharding import constrain


SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b")
REPEATING = ("circular", "interleaved_1f1b")  # the schedules with virtual stages (pipeline.repeats)
SCHEDULED_BACKWARD = ("1f1b", "interleaved_1f1b")  # the backward written into the schedule: memory bounded in M
ACTIVATION_AXES = ("batch", "length", "embed")  # the logical axes of one microbatch's activations


def defaults() -> ml_collections.ConfigDict:
  """The ``pipeline`` config group (pipeline parallelism)."""
  # Pipeline parallelism: the layer stack split into mesh.pipeline x mesh.dcn_pipeline stages.
  return ml_collections.ConfigDict(dict(
      # gpipe | circular (each stage holds `repeats` non-adjacent groups of layers) | 1f1b | interleaved_1f1b
      # (1f1b with `repeats` virtual stages). The 1f1b ones keep at most 2 x repeats x stages - 1 microbatches'
      # stage inputs alive, whatever the microbatch count; gpipe and circular keep every microbatch's.
      schedule="gpipe",
      repeats=2,  # circular and interleaved_1f1b; bubble (S - 1) / (repeats x microbatches + S - 1) for S stages
  ))


def validate(config) -> None:
  check_choice(config, "pipeline.schedule", SCHEDULES)
  check_positive(config, ["pipeline.repeats"])


@dataclasses.dataclass(frozen=True)
class Schedule:
  stages: int
  repeats: int  # 1 = gpipe / 1f1b; > 1 = circular / interleaved_1f1b
  microbatches: int
  kind: str = ""  # one of SCHEDULES; "" = gpipe (repeats 1) or circular

  def __post_init__(self):
    if not self.kind:
      object.__setattr__(self, "kind", "circular" if self.repeats > 1 else "gpipe")

  @property
  def scheduled_backward(self) -> bool:
    """Whether the backward pass is written into the schedule (:func:`scheduled`) rather than autodiff of
    :func:`run`."""
    return self.kind in SCHEDULED_BACKWARD

  @property
  def iterations(self) -> int:
    """Iterations (ticks) that run a forward unit somewhere: R M + S - 1."""
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """Fraction of stage-iterations that do no useful work: (S - 1) / (R M + S - 1), for every schedule."""
    return (self.stages - 1) / self.iterations

  @property
  def in_flight(self) -> int:
    """Stage inputs (one microbatch's activations each) a stage keeps for its backward pass, at most: every
    iteration's for gpipe / circular, 2 R S - 1 for the 1f1b schedules (fewer if there are fewer units)."""
    if self.scheduled_backward:
      return min(2 * self.repeats * self.stages - 1, self.repeats * self.microbatches)
    return self.iterations

  def describe(self) -> str:
    return {"gpipe": "GPipe", "circular": f"circular x {self.repeats} repeats", "1f1b": "1F1B",
            "interleaved_1f1b": f"interleaved 1F1B x {self.repeats} virtual stages"}[self.kind]


def schedule_from_config(config, stages: int, num_layers: int) -> Schedule:
  """The schedule for ``stages`` pipeline stages (the mesh's ``pipeline`` size), validated."""
  p, m = config.pipeline, config.train.microbatches or stages
  kind = p.schedule
  repeats = p.repeats if kind in REPEATING else 1
  if num_layers % (stages * repeats):
    what = f"{stages} stages" + (f" x {repeats} repeats" if kind in REPEATING else "")
    raise ConfigError("model.num_layers", f"{num_layers} layers do not split evenly into {what}",
                      f"make num_layers a multiple of {stages * repeats}, or change mesh.pipeline"
                      + (" / pipeline.repeats" if kind in REPEATING else ""))
  if kind in SCHEDULED_BACKWARD and config.data.seq_len % stages:  # (the head's tokens are split over the stages)
    raise ConfigError("data.seq_len", f"{config.data.seq_len} tokens do not split evenly over the {stages} pipeline "
                      f"stages ({kind} runs the head on 1/{stages} of them on each)",
                      f"make seq_len a multiple of {stages}, or use pipeline.schedule=gpipe")
  if kind == "1f1b":  # any count works (one microbatch finishes per tick); fewer than the stages is a large bubble
    return Schedule(stages=stages, repeats=1, microbatches=m, kind=kind)
  if m < stages:
    raise ConfigError("train.microbatches", f"{m} microbatches are fewer than the {stages} pipeline stages",
                      f"use at least {stages} (2-4x the stage count keeps the bubble small)"
                      + (", or pipeline.schedule=1f1b" if kind == "gpipe" else ""))
  if m % stages:  # gpipe / circular: the head runs S microbatches at a time; interleaved: rounds in groups of S
    raise ConfigError("train.microbatches", f"{m} is not a multiple of the {stages} pipeline stages",
                      f"use a multiple of {stages}" + (", or pipeline.schedule=1f1b" if kind == "gpipe" else ""))
  return Schedule(stages=stages, repeats=repeats, microbatches=m, kind=kind)


def _stage_order(w: jax.Array, spec, stages: int, repeats: int) -> jax.Array:
  """[L, ...] with stage s holding layer groups sR .. sR + R - 1 (layer order, as stored) -> the same shape
  with stage s holding groups s, S + s, ..., (R - 1) S + s in that order (what the circular schedule runs).

  One all-to-all over the pipeline axis; its transpose carries the gradients back. (Left to XLA, this
  reshape-reshard becomes an all-gather of the whole stack on every device.)
  """
  mesh_spec = nn.logical_to_mesh_axes(tuple(spec))
  if mesh_spec[0] != "pipeline":
    raise ValueError(f"the layer stack must be sharded over 'pipeline' on its first axis: {spec} -> {mesh_spec}")
  send, recv = _all_to_all_tables(stages, repeats)
  k = w.shape[0] // (stages * repeats)

  def exchange(local):  # local: [R K, ...], groups d R + a for a in 0..R-1, d = this stage
    d = jax.lax.axis_index("pipeline")
    groups = local.reshape(repeats, k, *local.shape[1:])
    outgoing = groups[jnp.asarray(send)[d]]  # [S, cap, K, ...]: chunk j goes to stage j
    incoming = jax.lax.all_to_all(outgoing, "pipeline", 0, 0, tiled=True)
    incoming = incoming.reshape(-1, *incoming.shape[2:])  # [S cap, K, ...]
    return incoming[jnp.asarray(recv)[d]].reshape(local.shape)

  return jax.shard_map(exchange, in_specs=mesh_spec, out_specs=mesh_spec)(w)


def _all_to_all_tables(stages: int, repeats: int) -> tuple[np.ndarray, np.ndarray]:
  """Index tables for :func:`_stage_order`. Group g is stored on stage g // R (slot g % R) and needed on
  stage g % S (slot g // S). ``send[d, j]``: stage d's slots bound for stage j (padded to the same count);
  ``recv[d, r]``: where stage d finds the group for its slot r among what it received."""
  s_, r_ = stages, repeats
  bound = [[[a for a in range(r_) if (d * r_ + a) % s_ == j] for j in range(s_)] for d in range(s_)]
  cap = max(len(slots) for row in bound for slots in row)
  send = np.array([[(slots + [0] * cap)[:cap] for slots in row] for row in bound], np.int32)
  recv = np.zeros((s_, r_), np.int32)
  for d in range(s_):
    for r in range(r_):
      g = r * s_ + d
      j, a = g // r_, g % r_
      recv[d, r] = j * cap + bound[j][d].index(a)
  return send, recv


def stage_axis() -> str | tuple[str, ...] | None:
  """The mesh axis the ``stage`` logical axis maps to under the current rules."""
  return nn.logical_to_mesh_axes(("stage",))[0]


def _as_groups(w: jax.Array, spec, stages: int, repeats: int) -> jax.Array:
  """[L, ...] in layer order -> [R, S, K, ...], group r S + s at [r, s] on stage s."""
  k = w.shape[0] // (repeats * stages)
  if repeats > 1:
    w = _stage_order(w, spec, stages, repeats)
  w = w.reshape(stages, repeats, k, *w.shape[1:]).swapaxes(0, 1)  # stage-major blocks: a local view
  return constrain(w, (None, "stage", None) + tuple(spec)[1:])


def _stage_fn(layer: Callable, stacked: Any, x_shape: jax.ShapeDtypeStruct, side: Any):
  """``(unit(w, x, side) -> (y, extras), zero extras, whether the layers return extras)``: a unit applies K layers (``w``: their [K, ...] slice of
  the stack) to one microbatch, summing what the layers return besides x (a MoE layer's auxiliary losses and
  metrics; ``()`` for layers that return x alone)."""
  one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)
  probe = jax.eval_shape(layer, one_layer, x_shape,
                         jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), side))
  has_extras = isinstance(probe, tuple)
  no_extras = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), probe[1]) if has_extras else ()

  def with_extras(w_layer, carry, side):
    h, extras = carry
    out = layer(w_layer, h, side)
    return (out[0], jax.tree.map(jnp.add, extras, out[1])) if has_extras else (out, extras)

  def unit(w, x, side):
    out, _ = jax.lax.scan(lambda carry, w_layer: (with_extras(w_layer, carry, side), None), (x, no_extras), w,
                          unroll=scans.unroll())
    return out

  return unit, no_extras, has_extras


def _round(w: Any, rnd) -> Any:
  """One stage's [R, K, ...] weights -> round ``rnd``'s [K, ...]."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, rnd, 0, keepdims=False), w)


def run(layer: Callable[[Any, jax.Array, Any], jax.Array], stacked: Any, specs: Any, x: jax.Array, side: Any,
        schedule: Schedule, activation_axes: tuple[str, ...]) -> jax.Array:
  """The layer stack applied to every microbatch, pipelined (gpipe / circular: differentiated by autodiff).

  ``layer(weights, x, side) -> x`` applies one layer; ``stacked`` holds every layer's weights with a leading
  L axis and ``specs`` their logical PartitionSpecs (same structure, first name ``layers``). ``x`` is
  ``[M, ...]`` (microbatches of activations, logical axes ``activation_axes`` after the M axis) and
  ``side`` a pytree of ``[M, ...]`` per-microbatch inputs that every layer reads (positions, segment ids).
  Returns the last layer's output for every microbatch, ``[M, ...]``. A layer that returns ``(x, extras)`` (a
  pytree of scalars: a MoE layer's auxiliary losses and metrics) makes it return ``(x, sum of extras over every
  layer and microbatch)``; the bubble's idle stage-iterations add nothing.
  """
  s_, r_, m_ = schedule.stages, schedule.repeats, schedule.microbatches
  weights = jax.tree.map(lambda w, spec: _as_groups(w, spec, s_, r_), stacked, specs)
  stage_act = ("stage",) + tuple(activation_axes)
  micro_act = (None,) + tuple(activation_axes)
  unit, no_extras, has_extras = _stage_fn(layer, stacked, jax.ShapeDtypeStruct(x.shape[1:], x.dtype), side)

  @jax.checkpoint  # remat per stage iteration: only the stage's input is kept for the backward pass
  def stage(w, rnd, x, side):  # one stage, one iteration: its K layers of round ``rnd`` on one microbatch
    return unit(_round(w, rnd), x, side)

  stages = jax.vmap(stage, in_axes=(1, 0, 0, 0), spmd_axis_name=stage_axis())
  ids = jnp.arange(s_)
  is_first = (ids == 0).reshape((s_,) + (1,) * (x.ndim - 1))

  def iteration(carry, i):
    buffer, previous, extras = carry  # [M, ...] latest activations per microbatch; [S, ...] last iteration's
    first = jax.lax.dynamic_index_in_dim(buffer, i % m_, 0, keepdims=True)  # outputs; extras summed so far
    shifted = constrain(jnp.roll(previous, 1, axis=0), stage_act)  # stage s gets s - 1's: a collective permute
    inputs = jnp.where(is_first, first, shifted)
    micro = (i - ids) % m_
    rnd = jnp.clip((i - ids) // m_, 0, r_ - 1)
    outputs, stage_extras = stages(weights, rnd, inputs, jax.tree.map(lambda a: a[micro], side))
    outputs = constrain(outputs, stage_act)
    working = (i - ids >= 0) & (i - ids < r_ * m_)  # [S]: stages not idling in the bubble
    extras = jax.tree.map(lambda t, e: t + jnp.sum(jnp.where(working, e, 0), axis=0), extras, stage_extras)
    done = i - (s_ - 1)  # the microbatch-round the last stage just finished, if >= 0
    slot = jnp.maximum(done, 0) % m_
    kept = jax.lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)
    buffer = jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(done >= 0, outputs[-1], kept), slot, 0)
    return (constrain(buffer, micro_act), outputs, extras), None

  previous = jnp.zeros((s_,) + x.shape[1:], x.dtype)
  carry = (constrain(x, micro_act), constrain(previous, stage_act), no_extras)
  (x, _, extras), _ = jax.lax.scan(iteration, carry, jnp.arange(schedule.iterations), unroll=scans.unroll())
  return (constrain(x, micro_act), extras) if has_extras else constrain(x, micro_act)


def split_microbatches(batch, num: int):
  """[B, ...] -> [num, B/num, ...]. Microbatch j takes rows j, j+num, ..., so every device keeps its rows."""
  def split(x):
    x = x.reshape(x.shape[0] // num, num, *x.shape[1:]).swapaxes(0, 1)
    return sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))
  return jax.tree.map(split, batch)


def forward(model, params, batch, schedule: Schedule, head_loss: Callable[[Any, dict], Any],
            weigh: Callable[[Any, Any], jax.Array] | None = None):
  """A stageable model's forward and loss, pipelined (see jaxtrain.models for the stageable contract). Returns
  ``(total, extras, value)``: the sum of ``head_loss(head_output, microbatch) -> pytree of scalars`` over all
  microbatches, the layers' extras summed over layers and microbatches (None if the layers return none; see
  :func:`run`), and ``weigh(total, extras)`` (None without ``weigh``).

  gpipe / circular: embed the batch, run the layer stack over ``schedule.microbatches`` microbatches through the
  stages (:func:`run`), then the head and ``head_loss`` S microbatches at a time, one on each stage (no stage
  repeats another's head, and only S microbatches' logits exist at once); everything differentiable by autodiff.

  1f1b / interleaved_1f1b (:func:`scheduled`): ``head_loss`` must return sums over tokens (it runs on 1/S of a
  microbatch's tokens on each stage, and the stages' sums are added); ``weigh`` must be linear (a sum of the
  leaves times constants);
  the gradient is computed inside the schedule, and only ``value`` carries it (``total`` and ``extras`` are
  constants to autodiff). Without ``weigh`` (evaluation) the same schedule runs forward units only."""
  if schedule.scheduled_backward:
    return scheduled(model, params, batch, schedule, head_loss, weigh)
  params = model.effective_params(params)  # LoRA: merged weights (jaxtrain/models/lora.py), the stack included
  module = model.bind(params)
  m, s = schedule.microbatches, schedule.stages
  micro = split_microbatches(batch, m)
  x = split_microbatches(module.embed_tokens(batch["inputs"], batch["positions"], batch["segment_ids"]), m)
  x = run(module.apply_layer, params["layers"], model.logical_specs["layers"], x,
          (micro["positions"], micro["segment_ids"]), schedule, ACTIVATION_AXES)
  x, extras = x if isinstance(x, tuple) else (x, None)

  def by_stage(a, axes):  # [M, ...] -> [M / S, S, ...], microbatch c S + j on stage j
    return sharding.constrain(a.reshape(m // s, s, *a.shape[1:]), (None, "stage") + axes)

  def one(x, b):
    return head_loss(module.head(x), b)

  per_stage = jax.vmap(one, spmd_axis_name=stage_axis())

  @jax.checkpoint
  def chunk(total, inputs):
    return jax.tree.map(lambda t, part: t + part.sum(0), total, per_stage(*inputs)), None

  chunks = (by_stage(x, ACTIVATION_AXES), jax.tree.map(lambda a: by_stage(a, ("batch", None)), micro))
  first = jax.tree.map(lambda a: a[0, 0], chunks)  # one microbatch: the shapes of what head_loss returns
  zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(one, *first))
  total, _ = jax.lax.scan(chunk, zero, chunks, unroll=scans.unroll())
  return total, extras, (None if weigh is None else weigh(total, extras))



def scheduled(model, params, batch, schedule: Schedule, head_loss: Callable[[Any, dict], Any],
              weigh: Callable[[Any, Any], jax.Array] | None = None):
  """:func:`forward` for the 1f1b schedules (the tick plan is in this module's docstring).

  With ``weigh`` the gradient of ``weigh(total, extras)`` is computed by the schedule itself: each tick's
  backward units get their output cotangent from the next stage (or from the head's gradient, scaled by
  weigh's coefficient of each head sum), and their layers' extras get weigh's coefficient of each extra. The
  coefficients are weigh's gradient, taken once (it is linear, so they do not depend on the sums)."""
  s_, r_, m_ = schedule.stages, schedule.repeats, schedule.microbatches
  su, units = s_ * r_, r_ * m_
  warmup, forward_end = su - 1, units + s_ - 1  # ticks [0, warmup): forward units only; < forward_end: some
  end = units + su + s_ - 2  # the first stage's last backward unit runs at end - 1
  slots = schedule.in_flight  # the stash: stage inputs of the units in flight, unit k in slot k mod slots (and a
  # spare slot the idle stages write to)
  spmd = stage_axis()

  params = model.effective_params(params)  # LoRA: merged weights (the base frozen); autodiff carries it back
  stacked, specs = params["layers"], model.logical_specs["layers"]
  rest = {k: v for k, v in params.items() if k != "layers"}  # embedding, final norm, head
  rest_specs = {k: model.logical_specs[k] for k in rest}
  # The head and the embedding are bound to the rest alone (the stack as shapes: they never read it), so the
  # custom_vjp below closes over no traced value.
  stack_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), stacked)
  layer = model.bind(params).apply_layer  # reads only its weights argument (and the stack's graph)
  micro = split_microbatches(batch, m_)

  def bound(rest):
    return model.bind({**rest, "layers": stack_shapes})

  def embed(rest, b):
    return bound(rest).embed_tokens(b["inputs"], b["positions"], b["segment_ids"])

  def head(rest, y, b):
    return head_loss(bound(rest).head(y), b)

  def take(tree, i):  # microbatch i (a scalar) or one per stage (an [S] vector) of a [M, ...] pytree
    return jax.tree.map(lambda a: a[i], tree)

  first = take(micro, 0)
  x_shape = jax.eval_shape(embed, rest, first)
  side_of = lambda b: (b["positions"], b["segment_ids"])  # noqa: E731
  unit, no_extras, has_extras = _stage_fn(layer, stacked, x_shape, side_of(micro))
  zero_total = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(head, rest, x_shape, first))
  stage_act, stash_axes = ("stage",) + ACTIVATION_AXES, ("stage", None) + ACTIVATION_AXES
  ids = jnp.arange(s_)
  per_stage = lambda mask, like: mask.reshape((s_,) + (1,) * (like.ndim - 1))  # noqa: E731
  masked = lambda valid, tree: jax.tree.map(lambda v: jnp.where(valid, v, jnp.zeros_like(v)), tree)  # noqa: E731
  add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731

  def forward_unit(k):  # forward unit k (any int array) -> (valid, round, microbatch)
    kc = jnp.clip(k, 0, units - 1)
    q = kc % su
    return (k >= 0) & (k < units), q // s_, kc // su * s_ + q % s_

  def backward_unit(j):  # backward unit j -> (valid, round, microbatch, its forward unit)
    jc = jnp.clip(j, 0, units - 1)
    q = jc % su
    rnd = r_ - 1 - q // s_
    return (j >= 0) & (j < units), rnd, jc // su * s_ + q % s_, jc // su * su + rnd * s_ + q % s_

  def forward_one(w, rnd, x, side):  # one stage's forward unit
    return unit(_round(w, rnd), x, side)

  def backward_one(w, acc, rnd, x, side, g_y, ct_extras, valid):  # one stage's backward unit, summed into acc
    _, vjp = jax.vjp(lambda w_r, x: unit(w_r, x, side), _round(w, rnd), x)
    g_w, g_x = vjp((g_y, ct_extras))
    acc = jax.tree.map(lambda a, g: jax.lax.dynamic_update_index_in_dim(
        a, jax.lax.dynamic_index_in_dim(a, rnd, 0, keepdims=False) + jnp.where(valid, g, jnp.zeros_like(g)), rnd, 0),
        acc, g_w)
    return acc, jnp.where(valid, g_x, jnp.zeros_like(g_x))

  forward_stages = jax.vmap(forward_one, in_axes=(1, 0, 0, 0), spmd_axis_name=spmd)
  backward_stages = jax.vmap(backward_one, in_axes=(1, 1, 0, 0, 0, 0, None, 0), out_axes=(1, 0),
                             spmd_axis_name=spmd)
  put = jax.vmap(lambda buf, slot, x: jax.lax.dynamic_update_index_in_dim(buf, x, slot, 0), spmd_axis_name=spmd)
  get = jax.vmap(lambda buf, slot: jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False), spmd_axis_name=spmd)

  def head_grads(rest, y, b, ct):  # (the head's sums, their gradient for rest, for y) on one microbatch
    total, vjp = jax.vjp(lambda rest, y: head(rest, y, b), rest, y)
    return (total, *vjp(ct))

  # The head works token by token (norm, projection, token losses): the last stage's microbatch is split along its
  # tokens over the S stages (schedule_from_config: S divides the length), so each tick's head costs 1/S of a
  # microbatch's on every stage (as gpipe's head, which runs S microbatches at a time, one per stage) instead of a
  # whole one. Its gradient is summed per stage, and over the stages once, at the end.
  head_stages = jax.vmap(head_grads, (None, 0, 0, None), spmd_axis_name=spmd)

  def to_stages(a, axes):  # [rows, T, ...] -> [S, rows, T / S, ...], tokens [j T / S, (j + 1) T / S) on stage j
    a = a.reshape(a.shape[0], s_, a.shape[1] // s_, *a.shape[2:]).swapaxes(0, 1)
    return constrain(a, ("stage",) + tuple(axes) + (None,) * (a.ndim - 1 - len(axes)))

  def from_stages(a):
    a = a.swapaxes(0, 1)
    return a.reshape(a.shape[0], -1, *a.shape[3:])

  def tick(grouped, rest, micro, coefs, carry, t, *, fwd: bool, with_head: bool, bwd: bool, keep: bool):
    """One tick: every stage's forward unit (``fwd``), the last stage's head (``with_head``: its gradient too
    when ``bwd``), every stage's backward unit (``bwd``); ``keep``: stash the forward units' inputs."""
    carry = dict(carry)
    g_head = None
    if fwd:
      valid, rnd, mb = forward_unit(t - ids)
      shifted = constrain(jnp.roll(carry["y"], 1, axis=0), stage_act)  # stage s gets s - 1's: a collective permute
      new = per_stage((ids == 0) & (rnd == 0), shifted)  # the first stage's round 0 starts from the embedding
      x = constrain(jnp.where(new, embed(rest, take(micro, mb[0]))[None].astype(shifted.dtype), shifted), stage_act)
      y, extras = forward_stages(grouped, rnd, x, side_of(take(micro, mb)))
      carry["y"] = constrain(y, stage_act)
      if has_extras:
        carry["extras"] = jax.tree.map(lambda a, e: a + jnp.sum(jnp.where(valid, e, 0), axis=0),
                                       carry["extras"], extras)
      if keep:
        # (an idle stage writes to the spare slot: its unit index would alias a unit in flight)
        carry["stash"] = constrain(put(carry["stash"], jnp.where(valid, (t - ids) % slots, slots), x), stash_axes)
      if with_head:  # the last stage finished microbatch mb[-1] if it ran its last round
        done = valid[-1] & (rnd[-1] == r_ - 1)
        y, b = carry["y"][-1], take(micro, mb[-1])
        y, b = to_stages(y, ACTIVATION_AXES), jax.tree.map(lambda a: to_stages(a, ACTIVATION_AXES[:2]), b)
        if bwd:
          total, g_rest, g_head = head_stages(rest, y, b, coefs[0])
          carry["g_head"] = add(carry["g_head"], masked(done, g_rest))
          g_head = from_stages(g_head)
        else:
          total = jax.vmap(head, (None, 0, 0), spmd_axis_name=spmd)(rest, y, b)
        total = jax.tree.map(lambda a: jnp.sum(a, axis=0), total)
        carry["total"] = add(carry["total"], masked(done, total))
    if bwd:
      valid, rnd, mb, k = backward_unit(t - warmup - (s_ - 1 - ids))
      g = constrain(jnp.roll(carry["g"], -1, axis=0), stage_act)  # stage s gets s + 1's
      if g_head is not None:  # the last stage's last round starts from the head's gradient (same microbatch)
        g = jnp.where(per_stage((ids == s_ - 1) & (rnd == r_ - 1), g), g_head[None].astype(g.dtype), g)
      x = get(carry["stash"], k % slots)
      carry["g_w"], g_x = backward_stages(grouped, carry["g_w"], rnd, x, side_of(take(micro, mb)), g, coefs[1],
                                          valid)
      carry["g"] = constrain(g_x, stage_act)
      # The first stage's round 0 ends in the embedding: its gradient for that microbatch.
      _, vjp = jax.vjp(lambda rest: embed(rest, take(micro, mb[0])), rest)
      (g_rest,) = vjp(jnp.where(valid[0] & (rnd[0] == 0), g_x[0], jnp.zeros_like(g_x[0])).astype(x_shape.dtype))
      carry["g_rest"] = add(carry["g_rest"], g_rest)
    return carry, None

  def ticks(grouped, rest, micro, coefs, carry, start, stop, **kind):
    body = lambda c, t: tick(grouped, rest, micro, coefs, c, t, **kind)  # noqa: E731
    return jax.lax.scan(body, carry, jnp.arange(start, stop), unroll=scans.unroll())[0]

  act = jnp.zeros((s_,) + x_shape.shape, x_shape.dtype)
  start = {"y": constrain(act, stage_act), "total": zero_total, "extras": no_extras}

  def forward_only(grouped, rest, micro):
    carry = ticks(grouped, rest, micro, None, start, 0, warmup, fwd=True, with_head=False, bwd=False, keep=False)
    carry = ticks(grouped, rest, micro, None, carry, warmup, forward_end, fwd=True, with_head=True, bwd=False,
                  keep=False)
    return carry["total"], carry["extras"]

  def with_gradients(grouped, rest, micro, coefs):
    zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
    carry = {**start, "g": constrain(act, stage_act),
             "stash": constrain(jnp.zeros((s_, slots + 1) + x_shape.shape, x_shape.dtype), stash_axes),
             "g_w": jax.tree.map(lambda g, spec: constrain(g, (None, "stage", None) + tuple(spec)[1:]),
                                 zeros(grouped), specs),
             "g_rest": jax.tree.map(lambda g, spec: constrain(g, tuple(spec)), zeros(rest), rest_specs)}
    carry["g_head"] = jax.tree.map(lambda g, spec: constrain(jnp.zeros((s_,) + g.shape, g.dtype),
                                                             ("stage",) + tuple(spec)), rest, rest_specs)
    carry = ticks(grouped, rest, micro, coefs, carry, 0, warmup, fwd=True, with_head=False, bwd=False, keep=True)
    carry = ticks(grouped, rest, micro, coefs, carry, warmup, forward_end, fwd=True, with_head=True, bwd=True,
                  keep=True)
    carry = ticks(grouped, rest, micro, coefs, carry, forward_end, end, fwd=False, with_head=False, bwd=True,
                  keep=False)
    g_head = jax.tree.map(lambda g: jnp.sum(g, axis=0), carry["g_head"])
    g_rest = jax.tree.map(lambda g, spec: constrain(g, tuple(spec)), add(carry["g_rest"], g_head), rest_specs)
    return carry["total"], carry["extras"], carry["g_w"], g_rest

  grouped = jax.tree.map(lambda w, spec: _as_groups(w, spec, s_, r_), stacked, specs)
  extras_or_none = lambda extras: extras if has_extras else None  # noqa: E731
  if weigh is None:  # evaluation (autodiff through it works, with gpipe's memory)
    total, extras = forward_only(grouped, rest, micro)
    return total, extras_or_none(extras), None

  def value_of(total, extras):
    return weigh(total, extras_or_none(extras))

  @jax.custom_vjp
  def pipelined(grouped, rest, micro, coefs):
    total, extras = forward_only(grouped, rest, micro)
    return value_of(total, extras), (total, extras)

  def pipelined_fwd(grouped, rest, micro, coefs):
    total, extras, g_w, g_rest = with_gradients(grouped, rest, micro, coefs)
    return (value_of(total, extras), (total, extras)), (g_w, g_rest)

  def pipelined_bwd(gradients, cotangents):  # the gradients of value, times value's cotangent
    ct = cotangents[0]
    return (*jax.tree.map(lambda g: g * ct.astype(g.dtype), gradients), None, None)

  pipelined.defvjp(pipelined_fwd, pipelined_bwd)
  coefs = jax.grad(value_of, argnums=(0, 1))(zero_total, no_extras)  # linear: the same at any point
  value, (total, extras) = pipelined(grouped, rest, micro, coefs)
  total, extras = jax.lax.stop_gradient((total, extras))
  return total, extras_or_none(extras), value

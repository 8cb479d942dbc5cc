"""Pipeline parallelism over the ``stage`` logical axis (the ``pipeline`` mesh axis): one SPMD program.

The layer stack is a pytree of arrays with a leading ``layers`` axis of L layers, stored the same way with or
without a pipeline (so checkpoints do not depend on the split). With S stages and R repeats the stack is
viewed as ``[R, S, K]`` groups of K = L / (R S) layers: group ``r S + s`` runs on stage s in round r.
R = 1 is GPipe (stage s holds layers ``[s K, (s+1) K)``, the stored sharding, so the view is free);
R > 1 is the circular schedule (stage s runs the non-adjacent groups s, S + s, ...; one all-to-all over the
pipeline axis moves the weights from their stored blocks into that view inside the step, and its transpose
moves the gradients back).

All stages run in lockstep, ``jax.vmap`` over the stage axis with ``spmd_axis_name`` so each device computes
only its stage. Iteration i: stage 0 takes microbatch ``i mod M`` from a buffer that holds every microbatch's
latest activations; stage s > 0 takes what stage s - 1 produced at i - 1 (a collective permute); the last
stage writes its output back to the buffer, where stage 0 picks it up for the next round. Stage s works on
microbatch ``(i - s) mod M`` of round ``(i - s) div M``, so R M + S - 1 iterations finish every microbatch
and the bubble (iterations a stage idles) is (S - 1) / (R M + S - 1). M >= S keeps a microbatch's next
round from starting before its previous round has left the last stage. The backward pass is autodiff of
this loop; each stage iteration is rematerialized, so only stage inputs are kept between the passes.
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
from jaxtrain.sharding import constrain


def defaults() -> ml_collections.ConfigDict:
  """The ``pipeline`` config group (pipeline parallelism)."""
  # Pipeline parallelism: the layer stack split into mesh.pipeline x mesh.dcn_pipeline stages.
  return ml_collections.ConfigDict(dict(
      schedule="gpipe",  # gpipe | circular (each stage holds `repeats` non-adjacent groups of layers)
      repeats=2,  # circular only; bubble (S - 1) / (repeats x microbatches + S - 1) for S stages
  ))


def validate(config) -> None:
  check_choice(config, "pipeline.schedule", ("gpipe", "circular"))
  check_positive(config, ["pipeline.repeats"])


@dataclasses.dataclass(frozen=True)
class Schedule:
  stages: int
  repeats: int  # 1 = GPipe; > 1 = circular
  microbatches: int

  @property
  def iterations(self) -> int:
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """Fraction of stage-iterations that do no useful work: (S - 1) / (R M + S - 1)."""
    return (self.stages - 1) / self.iterations


def schedule_from_config(config, stages: int, num_layers: int) -> Schedule:
  """The schedule for ``stages`` pipeline stages (the mesh's ``pipeline`` size), validated."""
  p, m = config.pipeline, config.train.microbatches or stages
  repeats = p.repeats if p.schedule == "circular" else 1
  if num_layers % (stages * repeats):
    what = f"{stages} stages" + (f" x {repeats} repeats" if p.schedule == "circular" else "")
    raise ConfigError("model.num_layers", f"{num_layers} layers do not split evenly into {what}",
                      f"make num_layers a multiple of {stages * repeats}, or change mesh.pipeline"
                      + (" / pipeline.repeats" if p.schedule == "circular" else ""))
  if m < stages:
    raise ConfigError("train.microbatches", f"{m} microbatches are fewer than the {stages} pipeline stages",
                      f"use at least {stages} (2-4x the stage count keeps the bubble small)")
  if m % stages:  # the head and loss run one microbatch per stage, S at a time
    raise ConfigError("train.microbatches", f"{m} is not a multiple of the {stages} pipeline stages",
                      f"use a multiple of {stages}")
  return Schedule(stages=stages, repeats=repeats, microbatches=m)


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


def run(layer: Callable[[Any, jax.Array, Any], jax.Array], stacked: Any, specs: Any, x: jax.Array, side: Any,
        schedule: Schedule, activation_axes: tuple[str, ...]) -> jax.Array:
  """The layer stack applied to every microbatch, pipelined.

  ``layer(weights, x, side) -> x`` applies one layer; ``stacked`` holds every layer's weights with a leading
  L axis and ``specs`` their logical PartitionSpecs (same structure, first name ``layers``). ``x`` is
  ``[M, ...]`` (microbatches of activations, logical axes ``activation_axes`` after the M axis) and
  ``side`` a pytree of ``[M, ...]`` per-microbatch inputs that every layer reads (positions, segment ids).
  Returns the last layer's output for every microbatch, ``[M, ...]``. A layer that returns ``(x, extras)`` (a
  pytree of scalars: a MoE layer's auxiliary losses and metrics) makes it return ``(x, sum of extras over every
  layer and microbatch)``; the bubble's idle stage-iterations add nothing.
  """
  s_, r_, m_ = schedule.stages, schedule.repeats, schedule.microbatches

  def as_groups(w, spec):  # [L, ...] in layer order -> [R, S, K, ...], group r S + s at [r, s] on stage s
    k = w.shape[0] // (r_ * s_)
    if r_ > 1:
      w = _stage_order(w, spec, s_, r_)
    w = w.reshape(s_, r_, k, *w.shape[1:]).swapaxes(0, 1)  # stage-major blocks: a local view
    return constrain(w, (None, "stage", None) + tuple(spec)[1:])

  weights = jax.tree.map(as_groups, stacked, specs)
  stage_act = ("stage",) + tuple(activation_axes)
  micro_act = (None,) + tuple(activation_axes)

  one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)
  probe = jax.eval_shape(layer, one_layer, jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                         jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), side))
  has_extras = isinstance(probe, tuple)
  no_extras = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), probe[1]) if has_extras else ()

  def with_extras(w_layer, carry, side):
    h, extras = carry
    out = layer(w_layer, h, side)
    return (out[0], jax.tree.map(jnp.add, extras, out[1])) if has_extras else (out, extras)

  @jax.checkpoint  # remat per stage iteration: only the stage's input is kept for the backward pass
  def stage(w, rnd, x, side):  # one stage, one iteration: its K layers of round ``rnd`` on one microbatch
    w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, rnd, 0, keepdims=False), w)
    out, _ = jax.lax.scan(lambda carry, w_layer: (with_extras(w_layer, carry, side), None), (x, no_extras), w)
    return out

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
  (x, _, extras), _ = jax.lax.scan(iteration, carry, jnp.arange(schedule.iterations))
  return (constrain(x, micro_act), extras) if has_extras else constrain(x, micro_act)


def split_microbatches(batch, num: int):
  """[B, ...] -> [num, B/num, ...]. Microbatch j takes rows j, j+num, ..., so every device keeps its rows."""
  def split(x):
    x = x.reshape(x.shape[0] // num, num, *x.shape[1:]).swapaxes(0, 1)
    return sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))
  return jax.tree.map(split, batch)


def forward(model, params, batch, schedule: Schedule, head_loss: Callable[[Any, dict], Any]):
  """A stageable model's forward and loss, pipelined (see jaxtrain.models for the stageable contract): embed
  the batch, run the layer stack over ``schedule.microbatches`` microbatches through the stages, then the head
  and ``head_loss(head_output, batch_chunk) -> pytree of scalars`` S microbatches at a time, one on each stage
  (no stage repeats another's head, and only S microbatches' logits exist at once). Returns the sum of
  ``head_loss`` over all microbatches, and the layers' extras summed over layers and microbatches (None if the
  layers return none; see :func:`run`)."""
  params = model.effective_params(params)  # LoRA: merged weights (jaxtrain/models/lora.py), the stack included
  module = model.bind(params)
  m, s = schedule.microbatches, schedule.stages
  micro = split_microbatches(batch, m)
  x = split_microbatches(module.embed_tokens(batch["inputs"], batch["positions"], batch["segment_ids"]), m)
  x = run(module.apply_layer, params["layers"], model.logical_specs["layers"], x,
          (micro["positions"], micro["segment_ids"]), schedule, ("batch", "length", "embed"))
  x, extras = x if isinstance(x, tuple) else (x, None)

  def by_stage(a, axes):  # [M, ...] -> [M / S, S, ...], microbatch c S + j on stage j
    return sharding.constrain(a.reshape(m // s, s, *a.shape[1:]), (None, "stage") + axes)

  def one(x, b):
    return head_loss(module.head(x), b)

  per_stage = jax.vmap(one, spmd_axis_name=stage_axis())

  @jax.checkpoint
  def chunk(total, inputs):
    return jax.tree.map(lambda t, part: t + part.sum(0), total, per_stage(*inputs)), None

  chunks = (by_stage(x, ("batch", "length", "embed")), jax.tree.map(lambda a: by_stage(a, ("batch", None)), micro))
  first = jax.tree.map(lambda a: a[0, 0], chunks)  # one microbatch: the shapes of what head_loss returns
  zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(one, *first))
  total, _ = jax.lax.scan(chunk, zero, chunks)
  return total, extras

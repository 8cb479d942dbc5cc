"""The optimizer update streamed a layer at a time over a state in host memory (``optim.offload_state``).

With the whole state brought to the device for the update, the step's peak holds it twice (the finiteness guard
keeps the old and the new state alive together) on top of the params and gradients: offloading then lowers what
the device holds between steps, not the peak. Here the update runs over the stacked layers (params whose leading
logical axis is ``layers``) one layer at a time, in a ``lax.scan`` whose iteration brings that layer's moments over
(a slice of the host arrays), updates them and sends the new ones back; the other params (embeddings, final norm,
head) are updated together after, their state copied over in slices whose start waits for the gradients
(:func:`_held_copy`: a whole-array copy has nothing to wait for, and the compiler would start it while the backward
pass runs, adding it to that peak). The device holds one layer's state, old and new, at a time (or the other
params'); the compiler issues the loop's slices of the host arrays as asynchronous copies, so the transfers run
under the layers' (small) updates.

The guard needs to know whether *every* new element is finite before it keeps any: a first pass computes the
would-be update of every layer and reduces its finiteness (the moments come over, nothing goes back), the second
computes it again and keeps it or the old state, per element (``jnp.where``). The state crosses the host link twice
towards the device and once back.

Exact: the optimizer is elementwise (:data:`jaxtrain.optim.ELEMENTWISE`), so ``tx.update`` over a layer's slice of
the params, gradients and state is that slice of the whole update, computed by the same expressions; the only
quantity over all of them, the clipping's global norm, is computed first over the whole gradients by the clipping's
own expression (:func:`jaxtrain.optim.clip_norm_of`) and given to every slice's clipping
(:func:`jaxtrain.optim.clipping_by`). The shared scalars (step counts, the loss scale) are the same input to every
slice and come out of the other params' update. tests/test_offload.py checks the losses, params and moments
bitwise against a run without offload, with the clipping active.

Not streamed (:func:`plan` is None; the whole state comes over, as before): an optimizer that is not elementwise, a
state leaf not shaped like its param, stacked layers sharded over their layer axis (pipeline stages).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import optim

SHARED = "shared"  # a scalar state leaf (a step count, the loss scale): the same for every slice


class Plan(NamedTuple):
  """Per leaf of the params (and of their gradients) and of the optimizer state: the length of the layer stack the
  leaf is streamed over (its leading axis), None for a leaf updated whole, :data:`SHARED` for a scalar state leaf."""
  params: list
  state: list


def plan(tx, model, params, opt_state, opt_shardings) -> Plan | None:
  """How the update of ``opt_state`` (laid out by ``opt_shardings``) streams over ``params``' stacked layers, or
  None where it cannot (see the module docstring)."""
  if not optim.elementwise(tx):
    return None
  is_spec = lambda x: isinstance(x, P)  # noqa: E731
  logical = jax.tree.leaves(model.logical_specs, is_leaf=is_spec)
  with_path = jax.tree_util.tree_leaves_with_path(params)
  if len(logical) != len(with_path):
    return None
  groups, by_path = [], {}
  for (path, p), spec in zip(with_path, logical):
    group = p.shape[0] if p.ndim and len(spec) and spec[0] == "layers" else None
    groups.append(group)
    by_path[tuple(path)] = (tuple(p.shape), group)
  state = []
  for (path, s), sharding in zip(jax.tree_util.tree_leaves_with_path(opt_state), jax.tree.leaves(opt_shardings),
                                 strict=True):
    if not s.ndim:
      state.append(SHARED)
      continue
    found = next((by_path[tuple(path[i:])] for i in range(len(path)) if tuple(path[i:]) in by_path), None)
    if found is None or found[0] != tuple(s.shape):
      return None  # not a per-element state
    if found[1] is not None and _split(sharding) > 1:
      return None  # the layer axis is sharded (pipeline stages): a slice would span devices
    state.append(found[1])
  if not any(g not in (None, SHARED) for g in state):
    return None
  return Plan(groups, state)


def _split(sharding: NamedSharding) -> int:
  """Over how many devices the leading axis of an array laid out by ``sharding`` is split."""
  entry = tuple(sharding.spec)[0] if len(sharding.spec) else None
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return math.prod(sharding.mesh.shape[a] for a in axes)


def _empty(x):
  """What a slice that does not hold ``x`` gives the optimizer in its place: no elements (elementwise: nothing)."""
  return jnp.zeros((0,), x.dtype)


def _finite(leaves) -> jax.Array:
  found = [jnp.all(jnp.isfinite(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
  return jnp.logical_and.reduce(jnp.stack(found)) if found else jnp.bool_(True)


def _held_copy(x, ready, sharding: NamedSharding):
  """``x`` (host) copied to the device (``sharding``) in two dynamic slices whose start waits for ``ready`` (an
  int32 0 computed from the gradients): a whole-array copy has nothing to wait for, and the compiler starts it while
  the backward pass runs, adding it to that peak. A leaf with no axis to halve (unsplit, even) is copied whole."""
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  axes = [a for a in range(x.ndim) if x.shape[a] >= 2 and x.shape[a] % 2 == 0
          and _split(NamedSharding(sharding.mesh, P(spec[a]))) == 1]
  if not axes:
    return jax.device_put(x, sharding)
  axis, half = axes[0], x.shape[axes[0]] // 2
  parts = [jax.device_put(jax.lax.dynamic_slice_in_dim(x, ready + start, half, axis), sharding)
           for start in (0, half)]
  return jnp.concatenate(parts, axis)


def _slice_sharding(s: NamedSharding, memory_kind: str) -> NamedSharding:
  return NamedSharding(s.mesh, P(*tuple(s.spec)[1:]), memory_kind=memory_kind)


def update(model, tx, the_plan: Plan, params, full_grads, host_state, host_shardings, norm, decide):
  """The streamed update: ``(new params, new optimizer state, apply)``. ``params``: all of them (on the device),
  ``full_grads`` shaped like them (frozen params' zero), ``host_state`` the state in host memory laid out by
  ``host_shardings``; ``norm`` the clipping's global norm (None without clipping); ``decide(finite) -> apply``
  turns "every element of the new trained params and state is finite" into whether the update is kept. The new
  state's arrays are in host memory, its scalars on the device; where ``apply`` is false, params and state are the
  old ones, bitwise."""
  p_leaves, p_tree = jax.tree.flatten(params)
  g_leaves = jax.tree.leaves(full_grads)
  s_leaves, s_tree = jax.tree.flatten(host_state)
  shardings = jax.tree.leaves(host_shardings)
  n = len(p_leaves)
  trained = set(jax.tree.leaves(model.split_trainable(jax.tree.unflatten(p_tree, list(range(n))))[0]))
  # A frozen param (LoRA's base) takes no part: the optimizer gives it a zero update and keeps no state for it.
  group = [g if k in trained else SHARED for k, g in enumerate(the_plan.params)]
  device = [s.with_memory_kind("device") for s in shardings]

  def slice_update(ps, gs, ss):
    """tx.update over one slice (leaf lists): (new params, new state) leaf lists."""
    with optim.clipping_by(norm):
      updates, new_state = tx.update(jax.tree.unflatten(p_tree, gs), jax.tree.unflatten(s_tree, ss),
                                     jax.tree.unflatten(p_tree, ps))
    new_params = [optax.apply_updates(p, u) if k in trained else p
                  for k, (p, u) in enumerate(zip(ps, jax.tree.leaves(updates)))]
    return new_params, jax.tree.leaves(new_state)

  def checked(new_params, new_state):
    return _finite([x for k, x in enumerate(new_params) if k in trained] + new_state)

  stacks = sorted({g for g in group + the_plan.state if g not in (None, SHARED)})
  # 0, known only once every gradient is (their norm is never below 0; NaN is let through too)
  total = optax.tree.norm(full_grads)
  ready = jnp.where(jnp.isnan(total) | (total >= 0), 0, 1).astype(jnp.int32)

  def layer_pass(length, apply):
    """Over the stack of ``length`` layers: all finite (apply None), or the kept new (params, state) stacks."""
    ps_k = [k for k in range(n) if group[k] == length]
    ss_k = [k for k, g in enumerate(the_plan.state) if g == length]

    def body(carry, xs):
      # The check pass reads the layer's params as a slice (xs); the update's writes the kept ones into the stack
      # it carries, in place (the params are donated: no second copy of the stacked params).
      (finite, stack), (i, px, gx, sx) = carry, xs
      if stack is not None:
        px = [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in stack]
      sx = [jax.device_put(x, _slice_sharding(shardings[k], "device")) for x, k in zip(sx, ss_k)]
      at_p, at_s = dict(zip(ps_k, px)), dict(zip(ss_k, sx))
      grads_of = dict(zip(ps_k, gx))
      ps = [at_p[k] if k in at_p else _empty(p_leaves[k]) for k in range(n)]
      gs = [grads_of[k] if k in grads_of else _empty(g_leaves[k]) for k in range(n)]
      ss = [at_s[k] if k in at_s else s_leaves[k] if g == SHARED else _empty(s_leaves[k])
            for k, g in enumerate(the_plan.state)]
      new_p, new_s = slice_update(ps, gs, ss)
      if apply is None:
        return (finite & checked(new_p, new_s), None), None
      stack = [jax.lax.dynamic_update_index_in_dim(x, jnp.where(apply, new_p[k], at_p[k]), i, 0)
               for x, k in zip(stack, ps_k)]
      kept_s = [jax.device_put(jnp.where(apply, new_s[k], at_s[k]),
                               _slice_sharding(shardings[k], shardings[k].memory_kind)) for k in ss_k]
      return (finite, stack), kept_s

    params_in = [p_leaves[k] for k in ps_k]
    xs = (jnp.arange(length), params_in if apply is None else [], [g_leaves[k] for k in ps_k],
          [s_leaves[k] for k in ss_k])
    (finite, stack), ys = jax.lax.scan(body, (jnp.bool_(True), None if apply is None else params_in), xs)
    return finite if apply is None else (dict(zip(ps_k, stack)), dict(zip(ss_k, ys)))

  def rest_pass(apply):
    """Over the params outside the stacks (embeddings, final norm, head) and the shared scalars."""
    whole = [k for k in range(n) if group[k] is None]
    ps = [p_leaves[k] if group[k] is None else _empty(p_leaves[k]) for k in range(n)]
    gs = [g_leaves[k] if group[k] is None else _empty(g_leaves[k]) for k in range(n)]
    old_s = {k: s_leaves[k] if g == SHARED else _held_copy(s_leaves[k], ready, device[k])
             for k, g in enumerate(the_plan.state) if g in (None, SHARED)}
    ss = [old_s[k] if k in old_s else _empty(s_leaves[k]) for k in range(len(s_leaves))]
    new_p, new_s = slice_update(ps, gs, ss)
    if apply is None:
      return checked(new_p, new_s)
    return ({k: jnp.where(apply, new_p[k], p_leaves[k]) for k in whole},
            {k: jnp.where(apply, new_s[k], old) for k, old in old_s.items()})

  finite = rest_pass(None)
  for length in stacks:
    finite = finite & layer_pass(length, None)
  apply = decide(finite)
  new_p, new_s = rest_pass(apply)
  for length in stacks:
    stacked_p, stacked_s = layer_pass(length, apply)
    new_p.update(stacked_p)
    new_s.update(stacked_s)
  new_params = jax.tree.unflatten(p_tree, [new_p.get(k, p) for k, p in enumerate(p_leaves)])
  new_state = jax.tree.unflatten(s_tree, [jax.device_put(new_s[k], s) for k, s in enumerate(shardings)])
  return new_params, new_state, apply

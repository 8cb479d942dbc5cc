"""A Mixture-of-Experts feed-forward: every token to its k experts and back, the experts sharded over ``expert``.

:func:`moe_ffn` takes the activations ``x`` ``[batch, length, embed]``, the routing (each token's k expert ids and
their weights, computed by the model in the ordinary sharded program) and the stacked SwiGLU expert weights
``[experts, embed, expert_mlp]`` / ``[experts, expert_mlp, embed]``, and returns ``sum_j weight_j * expert_j(x)``
per token. It runs in ``jax.shard_map`` over the whole mesh with the layouts the logical-axis rules give (the batch
over data, fsdp and expert; the experts over ``expert``, their hidden dim over ``tensor``; the weights' embed dim is
all-gathered over fsdp at the boundary, and its gradient reduce-scattered), so each device holds E / ep experts:

* Each device sorts its tokens' (token, expert) assignments by expert and sends each to the device holding that
  expert with one ``all_to_all`` over the expert axes; the receiver runs its experts and a second ``all_to_all``
  returns the outputs, which are weighted and summed per token. The tensor axis splits each expert's hidden dim
  (a ``psum`` at the end, as a Megatron MLP). Without expert sharding (ep = 1) there is no collective at all.
* ``dropless``: every assignment is computed, the experts as one grouped matmul over the sorted tokens
  (``jax.lax.ragged_dot``: a real grouped kernel on TPU and GPU; XLA:CPU lowers it to a dense matmul over all E
  experts, so on CPU it costs E / k times the FLOPs). Static shapes need a worst case: with ep > 1 each device's
  send buffer has room for all of its assignments per destination (ep x the bytes actually needed; XLA:CPU has
  no ``ragged_all_to_all``, which would ship only the real rows).
* ``capacity`` (GShard / Switch): each device gives each expert ``capacity = ceil(capacity_factor * S / E)`` slots
  (S: its assignments); assignments beyond an expert's slots, in token order (token t's j-th choice before token
  t + 1's), are dropped (the token keeps its residual and its other experts) and counted. The experts then run as
  one batched matmul ``[E, capacity, ...]`` and the all-to-all ships exactly the slot buffers.

Tokens marked invalid (padding) are not dispatched and do not count as dropped.

Another expert feed-forward than SwiGLU (GPT-OSS's: biases, a clamped gate) is an :class:`ExpertMLP`: its stacked
weights with their logical axes, and the function of one expert's rows given the grouped or batched matmul.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from jaxtrain.sharding import mesh_axes

MODES = ("dropless", "capacity")


def capacity(assignments: int, num_experts: int, factor: float) -> int:
  """Slots per expert per device for ``assignments`` local (token, expert) pairs."""
  return max(1, math.ceil(factor * assignments / num_experts))


@dataclasses.dataclass(frozen=True)
class ExpertMLP:
  """An expert feed-forward other than SwiGLU.

  weights: the stacked weights, each ``[E, ...]``; axes: their logical axes inside the experts' ``shard_map`` (the
    embed dim None: gathered at the boundary, as SwiGLU's); apply: ``(rows, weights, matmul, bias) -> out``, where
    ``matmul(h, w)`` multiplies each row by its expert's ``w`` (grouped or batched) and ``bias(b)`` gives each row
    its expert's slice of ``b`` ``[E, n]`` (0 for rows of no expert). Under tensor parallelism ``apply`` sees its
    shard of the hidden dim and the outputs are summed over it: an output bias belongs outside (it would be summed
    once per shard).
  """
  weights: tuple
  axes: tuple
  apply: Callable[..., Any]


def _swiglu(x, weights, matmul, bias):
  del bias
  gate, up, down = weights
  return matmul(jax.nn.silu(matmul(x, gate)) * matmul(x, up), down)


def _grouped(x, weights, group_sizes, row_experts, ragged_dot=jax.lax.ragged_dot, apply=_swiglu):
  """Rows of ``x`` sorted by expert, ``group_sizes[e]`` of them for expert e (rows past the groups give 0; their
  ``row_experts`` is E)."""
  num = group_sizes.shape[0]

  def bias(b):
    return jnp.where((row_experts < num)[:, None], b[jnp.minimum(row_experts, num - 1)], 0).astype(x.dtype)
  return apply(x, weights, lambda h, w: ragged_dot(h, w, group_sizes), bias)


def _batched(x, weights, einsum=jnp.einsum, apply=_swiglu):
  """``x`` ``[experts, rows, embed]``: each expert on its own rows."""
  return apply(x, weights, lambda h, w: einsum("ecd,edf->ecf", h, w), lambda b: b[:, None, :].astype(x.dtype))


def _dropless(xs, e, weights, num_experts, expert_axes, ep, ragged_dot=jax.lax.ragged_dot, apply=_swiglu):
  """Outputs ``[S, D]`` of the S assignments (token ``a // k`` to expert ``e[a]``; ``e = E`` marks one not to
  compute) in assignment order; local experts ``gate/up/down`` are those of this device's expert shard."""
  s, el = e.shape[0], num_experts // ep
  order = jnp.argsort(e, stable=True)  # assignments grouped by expert; invalid ones (e = E) last
  sorted_e = e[order]
  rows = xs[order]
  if ep == 1:
    out_sorted = _grouped(rows, weights, jnp.bincount(e, length=num_experts), sorted_e, ragged_dot, apply)
    return jnp.zeros_like(out_sorted).at[order].set(out_sorted)
  # To the devices holding the experts: destination d = e // el gets a block of up to S rows (the worst case).
  dest = sorted_e // el  # non-decreasing; ep for invalid assignments (dropped by the scatter)
  starts = jnp.cumsum(jnp.bincount(dest, length=ep)) - jnp.bincount(dest, length=ep)
  slot = jnp.arange(s) - starts[jnp.minimum(dest, ep - 1)]
  send = jnp.zeros((ep, s, xs.shape[1]), xs.dtype).at[dest, slot].set(rows, mode="drop")
  send_e = jnp.full((ep, s), el, jnp.int32).at[dest, slot].set(sorted_e % el, mode="drop")  # el: empty row
  recv = jax.lax.all_to_all(send, expert_axes, 0, 0, tiled=True).reshape(ep * s, -1)
  recv_e = jax.lax.all_to_all(send_e, expert_axes, 0, 0, tiled=True).reshape(ep * s)
  local_order = jnp.argsort(recv_e, stable=True)
  computed = _grouped(recv[local_order], weights, jnp.bincount(recv_e, length=el), recv_e[local_order], ragged_dot,
                      apply)
  done = jnp.zeros_like(computed).at[local_order].set(computed).reshape(ep, s, -1)
  back = jax.lax.all_to_all(done, expert_axes, 0, 0, tiled=True)  # back[d]: my rows that device d computed
  out_sorted = back.at[dest, slot].get(mode="fill", fill_value=0)
  return jnp.zeros_like(out_sorted).at[order].set(out_sorted)


def _capacity(xs, e, weights, num_experts, expert_axes, ep, factor, einsum=jnp.einsum, apply=_swiglu):
  """As :func:`_dropless`, with at most ``capacity`` assignments per expert on this device; also returns how many
  valid assignments were dropped."""
  s, d = xs.shape
  c = capacity(s, num_experts, factor)
  valid = e < num_experts
  one = jax.nn.one_hot(e, num_experts, dtype=jnp.int32)  # invalid rows are all zero
  position = jnp.sum((jnp.cumsum(one, axis=0) - 1) * one, axis=-1)  # among earlier assignments to its expert
  keep = valid & (position < c)
  slot = jnp.where(keep, e * c + position, num_experts * c)  # out of range: not dispatched
  buf = jnp.zeros((num_experts * c, d), xs.dtype).at[slot].set(xs, mode="drop").reshape(num_experts, c, d)
  if ep == 1:
    out = _batched(buf, weights, einsum, apply)
  else:
    el = num_experts // ep
    recv = jax.lax.all_to_all(buf.reshape(ep, el, c, d), expert_axes, 0, 0, tiled=True)  # [source, el, c, d]
    done = _batched(recv.swapaxes(0, 1).reshape(el, ep * c, d), weights, einsum, apply)
    out = jax.lax.all_to_all(done.reshape(el, ep, c, d).swapaxes(0, 1), expert_axes, 0, 0, tiled=True)
  out = out.reshape(num_experts * c, d).at[slot].get(mode="fill", fill_value=0)
  return out, jnp.sum(valid & ~keep)


def moe_ffn(x, expert_ids, expert_weights, valid, gate, up, down, *, mode: str = "dropless",
            capacity_factor: float = 1.25, ragged_dot=jax.lax.ragged_dot, einsum=jnp.einsum,
            mlp: ExpertMLP | None = None, weigh_inputs: bool = False):
  """``sum_j expert_weights[..., j] * expert_{expert_ids[..., j]}(x)`` per token, and the number of valid
  assignments dropped (0 when dropless).

  x: ``[batch, length, embed]``; expert_ids / expert_weights: ``[batch, length, k]``; valid: ``[batch, length]``
  bool (False: not dispatched, output 0); gate / up: ``[E, embed, expert_mlp]``; down: ``[E, expert_mlp, embed]``.
  Under a mesh (``jax.set_mesh``) and logical-axis rules it runs sharded as the module docstring says; otherwise
  on the one device it is given. ``ragged_dot`` / ``einsum``: the experts' matmuls (dropless / capacity), with
  jax.lax.ragged_dot's and jnp.einsum's signatures (jaxtrain.models.quantization gives quantized ones). ``mlp``:
  another expert feed-forward than SwiGLU (:class:`ExpertMLP`; then gate, up and down are None).
  ``weigh_inputs``: ``sum_j expert_{expert_ids[..., j]}(expert_weights[..., j] * x)`` instead (Llama 4's: each
  expert's input weighted, its output summed as it is).
  """
  dtype = x.dtype
  if mlp is None:
    mlp = ExpertMLP((gate, up, down), (("experts", None, "expert_mlp"),) * 2 + (("experts", "expert_mlp", None),),
                    _swiglu)
  weights = tuple(w.astype(dtype) for w in mlp.weights)
  num_experts, k = weights[0].shape[0], expert_ids.shape[-1]
  e = jnp.where(valid[..., None], expert_ids, num_experts).astype(jnp.int32)

  def local(x, e, w, weights, expert_axes=(), ep=1, tensor_axes=(), batch_axes=()):
    b, t, dm = x.shape
    xs = jnp.repeat(x.reshape(b * t, dm), k, axis=0)  # one row per assignment: token a // k
    if weigh_inputs:
      xs = xs * w.reshape(b * t * k, 1).astype(xs.dtype)
    flat_e = e.reshape(b * t * k)
    if mode == "dropless":
      out = _dropless(xs, flat_e, weights, num_experts, expert_axes, ep, ragged_dot, mlp.apply)
      dropped = jnp.zeros((), jnp.int32)
    else:
      out, dropped = _capacity(xs, flat_e, weights, num_experts, expert_axes, ep, capacity_factor, einsum,
                               mlp.apply)
    y = jnp.sum(out.reshape(b, t, k, dm) * (1 if weigh_inputs else w[..., None].astype(out.dtype)), axis=2)
    if tensor_axes:
      y = jax.lax.psum(y, tensor_axes)
    if batch_axes:
      dropped = jax.lax.psum(dropped, batch_axes)
    return y.astype(dtype), dropped

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(x, e, expert_weights, weights)
  x_spec = nn.logical_to_mesh_axes(("batch", "length", None))  # also the routing's [batch, length, k]
  weight_specs = tuple(nn.logical_to_mesh_axes(a) for a in mlp.axes)  # embed gathered at the boundary
  gate_up_spec = nn.logical_to_mesh_axes(("experts", None, "expert_mlp"))
  expert_axes, tensor_axes = mesh_axes(gate_up_spec[0]), mesh_axes(gate_up_spec[2])
  batch_axes = tuple(a for entry in x_spec for a in mesh_axes(entry))
  ep = math.prod(mesh.shape[a] for a in expert_axes)
  if num_experts % ep:
    raise ValueError(f"{num_experts} experts do not split over {expert_axes} of size {ep}")

  def sharded(x, e, w, weights):
    return local(x, e, w, weights, expert_axes, ep, tensor_axes, batch_axes)

  # Every mesh axis is manual inside; the axes not in a spec hold replicas (the same values).
  return jax.shard_map(sharded, in_specs=(x_spec, x_spec, x_spec, weight_specs),
                       out_specs=(x_spec, P()), check_vma=False)(x, e, expert_weights, weights)


def all_to_all_bytes(cfg, tokens_per_device: int, ep: int, itemsize: int, *, microbatches: int = 1,
                     moe_layers: int | None = None) -> dict:
  """The all-to-all traffic of one device in one train step (forward and backward), from the buffer sizes above.

  ``cfg``: the ``model`` config (num_experts, experts_per_token, d_model, moe_impl, capacity_factor, num_layers,
  first_dense_layers, remat); ``tokens_per_device``: the tokens of one microbatch on one device (local rows x
  seq_len), so S = tokens x k assignments; ``ep``: the product of the expert axes; ``itemsize``: bytes of the
  compute dtype; ``moe_layers``: the MoE layers one device runs (default: all; a pipeline stage runs its share),
  each once per microbatch.

  Per MoE layer and microbatch the forward runs dispatch + return, the backward their transposes (the same sizes):
  4 all-to-alls; with ``remat`` other than none the backward reruns the forward's two first (the all-to-all outputs
  are not saved by any remat policy): 6. Each moves one buffer: dropless ``[ep, S, D]`` (every destination gets
  room for all S assignments: ep x ``ideal``), capacity ``[E, C, D]``, C = ceil(capacity_factor * S / E). Dropless
  also sends the expert ids, an int32 ``[ep, S]``, in the forward (and again in the rerun), without a transpose.
  Of every buffer the device keeps its own 1 / ep and sends the rest: ``sent`` = (ep - 1) / ep x ``buffer``.
  With ep = 1 there is no all-to-all (every figure 0 but ``ideal_bytes``). Keys: ``assignments`` (S),
  ``capacity`` (C, capacity mode), ``buffer_bytes`` (one all-to-all's operand), ``ideal_bytes`` (S x D x itemsize:
  each assignment once), ``per_layer`` (all-to-alls of the activations per layer and microbatch),
  ``id_bytes_per_step``, ``buffer_bytes_per_step`` (all operands, ids included: what the compiled program's
  all-to-alls take), ``sent_bytes_per_step`` (what leaves the device).
  """
  layers = cfg.num_layers - cfg.first_dense_layers if moe_layers is None else moe_layers
  s, d, num_experts = tokens_per_device * cfg.experts_per_token, cfg.d_model, cfg.num_experts
  rerun = cfg.remat != "none"
  per_layer = 6 if rerun else 4
  c = capacity(s, num_experts, cfg.capacity_factor) if cfg.moe_impl == "capacity" else None
  if ep == 1:
    buffer = ids = 0
  elif cfg.moe_impl == "dropless":
    buffer = ep * s * d * itemsize
    ids = ep * s * 4 * (2 if rerun else 1)
  else:
    buffer, ids = num_experts * c * d * itemsize, 0
  calls = layers * microbatches
  total = calls * (per_layer * buffer + ids)
  return {"ep": ep, "mode": cfg.moe_impl, "assignments": s, "capacity": c, "buffer_bytes": buffer,
          "ideal_bytes": s * d * itemsize, "per_layer": per_layer if ep > 1 else 0, "moe_layers": layers,
          "microbatches": microbatches, "id_bytes_per_step": calls * ids, "buffer_bytes_per_step": total,
          "sent_bytes_per_step": total * (ep - 1) // ep}

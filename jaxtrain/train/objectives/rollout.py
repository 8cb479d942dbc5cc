"""RL's rollout layout (``rl.rollout_tensor``): where the sampler keeps the policy's weights and its KV cache.

Training lays the weights out for the update: float32 and split over every device (fsdp), each layer's gathered
by the forward when it runs. A sampler decoding on that layout gathers every weight again for every token it
draws: Llama 3 8B's GRPO rollout on v5p-128 read 70 GB a chip per decode step (tools/bench_grpo.py), where the
bfloat16 weights of an 8B model split over a few chips are a few GB. So once per rollout (not per token)
:class:`Layout` puts the policy's weights where decoding wants them:

- merged (LoRA: ``W + alpha / rank A B`` in float32, as the training forward merges them) and cast to the compute
  dtype: the kernels and embedding tables, which the model computes with in that dtype anyway (a cast ahead of time
  is bitwise the cast the forward makes); norm scales, routers and biases stay as the model reads them;
- on a mesh of the same devices arranged as ``(data = N / T, tensor = T)``: split over tensor-parallel groups of T
  devices (consecutive in the training mesh's order, whose innermost axis has the fastest links) by the run's own
  sharding rules, and replicated across the groups. The rollout's rows are split across the groups, and the KV
  cache, created by the prefill, lives with them: rows over ``data``, KV heads over ``tensor``.

A decode step then reads its group's share of the weights (their compute-dtype bytes / T) and its own rows' cache:
tools/bench_grpo.py reports it against that memory bound. T = ``rl.rollout_tensor``: -1 (default) chooses the
model's KV heads, at most the devices of one slice (or one process, off TPU), the largest power of two that divides
the devices and the model's sharded dimensions, so that the KV cache is never replicated and the weights are split
as far as the cache allows; 0 keeps the training layout (the sampler then runs on the training mesh as before); N
asks for N. The weights' copy exists while the rollout runs (its bytes: the compute-dtype weights / T a device).

The sampler's arithmetic is the training forward's on either layout (jaxtrain.train.objectives.grpo's
``rl/logp_mismatch``); which of XLA's contraction orders each layout gets is the partitioner's, and
docs/post_training.md says where they differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxtrain import mesh as mesh_lib
from jaxtrain import sharding
from jaxtrain.errors import ConfigError

CAST = ("kernel", "embedding")  # the params the model computes with in its compute dtype (nnx.Linear, nnx.Embed)


def kv_heads(cfg) -> int:
  return int(cfg.get("num_kv_heads") or cfg.get("num_heads") or 1)


def _fits(run, t: int, rows: int) -> str | None:
  """Why the rollout layout with tensor size ``t`` does not fit the run (None: it does)."""
  n = run.mesh.size
  if n % t:
    return f"does not divide the {n} devices"
  if rows % (n // t):
    return f"leaves {n // t} groups of devices, which do not divide the {rows} rows of a rollout"
  sizes = {a: 1 for a in mesh_lib.MESH_AXES} | {"data": n // t, "tensor": t}
  try:
    sharding.check_shardable(run.model.abstract_params, run.model.logical_specs, _Sizes(sizes), run.rules)
  except ConfigError as e:
    return f"does not split the model ({e.problem})"
  return None


class _Sizes:  # what check_shardable reads of a mesh: its axis sizes
  def __init__(self, sizes):
    self.shape = sizes


def tensor_size(run, rows: int) -> int:
  """``rl.rollout_tensor`` resolved (module docstring): 0 for the training layout, else T. ConfigError (one line)
  for a T that does not fit the devices, the rows or the model."""
  asked = int(run.config.rl.rollout_tensor)
  if asked == 0:
    return 0
  if asked > 0:
    why = _fits(run, asked, rows)
    if why:
      raise ConfigError("rl.rollout_tensor", f"{asked} {why}", "choose a power of two that divides them, -1 to let "
                        "jaxtrain choose, or 0 for the training layout")
    return asked
  devices = list(run.mesh.devices.flat)
  if devices[0].platform == "tpu":  # a slice: the devices one ICI connects (a topology compiled for is one slice)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
  else:  # a process: off TPU the links between processes are the slow ones
    slices = len({d.process_index for d in devices})
  per_slice = run.mesh.size // slices
  t = 1
  while t * 2 <= min(kv_heads(run.model.cfg), per_slice) and _fits(run, t * 2, rows) is None:
    t *= 2
  return t


class Layout:
  """The rollout layout of a run for ``rows`` rows (module docstring): :attr:`mesh`, :attr:`rules`,
  :attr:`abstract` (the weights' shapes, dtypes and shardings: what a generator compiles for) and :meth:`put` (the
  policy's training-layout params -> the rollout's, one compiled program). ``tensor`` 0: the training layout, and
  :meth:`put` is the identity."""

  def __init__(self, run, rows: int):
    self.tensor = tensor_size(run, rows)
    self.rules = run.rules
    if not self.tensor:
      self.mesh = run.mesh
      self.abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   run.model.abstract_params, run.state_shardings.params)
      self._put = None
      return
    n = run.mesh.size
    shape = tuple({"data": n // self.tensor, "tensor": self.tensor}.get(a, 1) for a in mesh_lib.MESH_AXES)
    # The training mesh's device order, regrouped: jit sees one device assignment on both sides of put().
    self.mesh = Mesh(np.asarray(run.mesh.devices).reshape(-1).reshape(shape), mesh_lib.MESH_AXES,
                     axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_lib.MESH_AXES))
    model, dtype = run.model, jnp.dtype(run.model.cfg.dtype)
    quantized = run.model.cfg.get("quantization", "none") != "none"  # (qwix quantizes the float32 weights itself)

    def convert(params):
      plain = model.effective_params(params)  # LoRA merged (a no-op without it)
      if quantized or dtype == jnp.float32:
        return plain
      return jax.tree_util.tree_map_with_path(
          lambda path, x: x.astype(dtype) if _key(path[-1]) in CAST and jnp.issubdtype(x.dtype, jnp.floating) else x,
          plain)

    logical = model.logical_specs
    if model.lora and "lora" in model.abstract_params:
      logical = {k: v for k, v in logical.items() if k != "lora"}
    shardings = sharding.logical_to_sharding(logical, self.mesh, self.rules)
    shapes = jax.eval_shape(convert, model.abstract_params)
    self.abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)
    self._put = jax.jit(convert, in_shardings=(run.state_shardings.params,), out_shardings=shardings)

  def put(self, params):
    """The policy's params (laid out for training) in the rollout layout: dispatched, not waited for."""
    return params if self._put is None else self._put(params)

  def weight_bytes(self) -> int:
    """Bytes of the weights one device holds in this layout."""
    return sharding.shard_bytes(self.abstract, jax.tree.map(lambda a: a.sharding, self.abstract))

  def describe(self) -> str:
    if not self.tensor:
      return "the training layout"
    groups = self.mesh.shape["data"]
    return (f"{groups} group{'s' if groups > 1 else ''} of {self.tensor} device{'s' if self.tensor > 1 else ''} "
            f"(tensor-parallel within, replicated across)")


def _key(entry) -> str:
  return str(getattr(entry, "key", getattr(entry, "name", entry)))


class Rollout:
  """A sampler (jaxtrain.sampling's) compiled for a :class:`Layout`, called with the policy's training-layout params:
  ``rollout(params, batch, seed)`` puts them in the layout and samples. Everything else is the sampler's."""

  def __init__(self, layout: Layout, generator):
    self.layout, self.generator = layout, generator

  def __call__(self, params, batch, seed: int = 0):
    params = self.layout.put(params)
    with jax.set_mesh(self.layout.mesh):  # (what the sampler creates, its key, on the layout's mesh)
      return self.generator(params, batch, seed)

  def __getattr__(self, name):
    return getattr(self.generator, name)


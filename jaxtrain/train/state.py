"""TrainState and its layout on the mesh: abstract shapes, shardings, and a sharded init."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import sharding
from jaxtrain.errors import ConfigError
from jaxtrain.models import Model


# The memory kind of an offloaded optimizer state's arrays (optim.offload_state): the host's page-locked memory,
# which the accelerator reads and writes by DMA.
HOST = "pinned_host"


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  # What an objective carries from one step to the next besides the model, checkpointed with it (GRPO's rollouts
  # produced ahead, rl.max_staleness): the pytree its ``state_extra`` lays out; None for most objectives.
  extra: Any = None


def shardings(model: Model, tx: optax.GradientTransformation, mesh: Mesh | AbstractMesh, rules,
              extra: Any = None, offload: bool = False) -> TrainState:
  """NamedShardings for every leaf of the state: params from the sharding rules, optimizer state by
  :func:`opt_state_specs` (a plain ``jax.jit(tx.init)`` on an Auto mesh would leave it replicated), ``extra`` (the
  objective's, ShapeDtypeStructs with shardings) as it is laid out. ``mesh`` may be an AbstractMesh: the same layout
  by arithmetic, without devices (tools/estimate.py). With ``offload`` (``optim.offload_state``) every
  optimizer-state array of at least one dimension (the moments; not the scalar counters and loss scale, which stay
  on the device) is laid out the same way in host memory (:data:`HOST`); the step brings them over for the update
  and sends the new ones back (``step.apply_update``)."""
  replicated = NamedSharding(mesh, P())
  params = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  opt_shapes = jax.eval_shape(tx.init, model.abstract_params)
  specs = opt_state_specs(opt_shapes, model.abstract_params, jax.tree.map(lambda s: s.spec, params))
  opt = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)
  if offload:
    opt = jax.tree.map(lambda s, a: s.with_memory_kind(HOST) if a.ndim else s, opt, opt_shapes)
  return TrainState(step=replicated, params=params, opt_state=opt,
                    extra=None if extra is None else jax.tree.map(lambda a: a.sharding, extra))


def offloaded(opt_shardings: Any) -> bool:
  """Whether any of these optimizer-state shardings is in host memory (``optim.offload_state``)."""
  return any(s.memory_kind == HOST for s in jax.tree.leaves(opt_shardings))


def on_device(opt_shardings: Any) -> Any:
  """The same layouts in the device's memory: where the update computes on an offloaded state."""
  return jax.tree.map(lambda s: s.with_memory_kind("device") if s.memory_kind == HOST else s, opt_shardings)


def host_bytes(abstract_state: Any, state_shardings: Any) -> int:
  """Bytes per device of the state's arrays laid out in host memory (0 without ``optim.offload_state``)."""
  pairs = [(a, s) for a, s in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(state_shardings), strict=True)
           if s.memory_kind == HOST]
  return sharding.shard_bytes([a for a, _ in pairs], [s for _, s in pairs])


def check_offload(mesh: Mesh, opt_shapes: Any, optimizer: str) -> None:
  """ConfigError (``optim.offload_state``) when the optimizer state cannot be offloaded: the devices have no host
  memory (:data:`HOST`) to keep it in, or the optimizer keeps no per-parameter state to move."""
  device = mesh.devices.flat[0]
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # noqa: BLE001 - a TPU topology's devices (a dry run) may describe no memories; TPUs have it
    kinds = {HOST} if device.platform == "tpu" else set()
  if HOST not in kinds:
    raise ConfigError("optim.offload_state", f"the {device.platform} backend has no '{HOST}' memory to keep the "
                      f"optimizer state in (its memories: {', '.join(sorted(kinds)) or 'none'})",
                      "set optim.offload_state=false")
  if not any(a.ndim for a in jax.tree.leaves(opt_shapes)):
    raise ConfigError("optim.offload_state", f"optimizer '{optimizer}' keeps no per-parameter state to offload",
                      "set optim.offload_state=false")


def opt_state_specs(opt_state: Any, params: Any, param_specs: Any) -> Any:
  """The optimizer state's layout, one PartitionSpec (of mesh axes) per leaf of ``opt_state``, from the params'
  (``params``: arrays or ShapeDtypeStructs, ``param_specs``: their mesh PartitionSpecs). A leaf belongs to the
  param whose key path ends its own (optax keeps per-param state in trees shaped like the params, e.g.
  ``.mu['layers']['mlp']['up']['kernel']``). A leaf of a param
  - shaped like it gets the param's spec (AdamW's, Lion's, Muon's moments);
  - with the param's rank and some dims 1 gets the param's spec with None for those dims;
  - with some of the param's dims removed (Adafactor's factored ``v_row`` / ``v_col``) gets the param's spec
    with those dims' entries dropped (where equal sizes leave a choice, the leftmost dims are taken as kept:
    either layout is valid);
  everything else (step counters, Adafactor's ``(1,)`` placeholders, Muon's coefficients) is replicated."""
  by_path = {tuple(path): (p.shape, spec) for (path, p), spec in
             zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(param_specs, is_leaf=_is_spec),
                 strict=True)}

  def spec_of(path, leaf) -> P:
    for i in range(len(path)):  # the longest suffix of the leaf's path that is a param's path
      if tuple(path[i:]) in by_path:
        return _derived_spec(tuple(leaf.shape), *by_path[tuple(path[i:])])
    return P()

  return jax.tree_util.tree_map_with_path(spec_of, opt_state)


def _derived_spec(shape: tuple[int, ...], param_shape: tuple[int, ...], param_spec: P) -> P:
  """The spec of a state leaf of ``shape`` derived from a param of ``param_shape``; P() if it is not."""
  if shape == param_shape:
    return param_spec
  entries = tuple(param_spec) + (None,) * (len(param_shape) - len(param_spec))
  if len(shape) == len(param_shape):
    if all(d in (pd, 1) for d, pd in zip(shape, param_shape)):
      return P(*(e if d == pd else None for d, pd, e in zip(shape, param_shape, entries)))
    return P()
  kept = []
  for pd, e in zip(param_shape, entries):  # shape as a subsequence of param_shape, matched leftmost
    if len(kept) < len(shape) and shape[len(kept)] == pd:
      kept.append(e)
  return P(*kept) if len(kept) == len(shape) else P()


def _is_spec(x) -> bool:
  return isinstance(x, P)


def abstract(model: Model, tx: optax.GradientTransformation, shardings: TrainState | None = None,
             extra: Any = None) -> TrainState:
  """ShapeDtypeStructs of the state; with ``shardings``, they carry them (a restore target for that mesh). From
  the model's abstract params and the optimizer's init alone: the model's init is not traced (a run asks for this
  several times; tests/test_train.py checks it equals the shapes of the real init). ``extra``: the objective's
  (:attr:`TrainState.extra`; a run's is ``Run.state_extra``, and ``Run.abstract_state`` calls this)."""
  shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=model.abstract_params,
                      opt_state=jax.eval_shape(tx.init, model.abstract_params),
                      extra=None if extra is None else jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                                                    extra))
  if shardings is None:
    return shapes
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def _init(model: Model, tx, rng, extra=None) -> TrainState:
  params = model.init(rng)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    extra=None if extra is None else jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), extra))


def make_init(model: Model, tx, state_shardings: TrainState, extra: Any = None):
  """A jitted ``rng -> TrainState`` that creates every array directly in its sharded layout (``extra``: the
  objective's shapes, :attr:`TrainState.extra`, zeros at the start)."""
  return jax.jit(lambda rng: _init(model, tx, rng, extra), out_shardings=state_shardings)


"""TrainState and its layout on the mesh: abstract shapes, shardings, and a sharded init."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import sharding
from jaxtrain.models import Model


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any


def shardings(model: Model, tx: optax.GradientTransformation, mesh: Mesh, rules) -> TrainState:
  """NamedShardings for every leaf of the state. Optimizer moments are laid out like their params
  (a plain ``jax.jit(tx.init)`` on an Auto mesh would leave them replicated)."""
  replicated = NamedSharding(mesh, P())
  params = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  opt_abstract = jax.eval_shape(tx.init, model.abstract_params)
  opt = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, params,
                              transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=params, opt_state=opt)


def abstract(model: Model, tx: optax.GradientTransformation, shardings: TrainState | None = None) -> TrainState:
  """ShapeDtypeStructs of the state; with ``shardings``, they carry them (a restore target for that mesh)."""
  shapes = jax.eval_shape(lambda: _init(model, tx, jax.random.key(0)))
  if shardings is None:
    return shapes
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def _init(model: Model, tx, rng) -> TrainState:
  params = model.init(rng)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def make_init(model: Model, tx, state_shardings: TrainState):
  """A jitted ``rng -> TrainState`` that creates every array directly in its sharded layout."""
  return jax.jit(lambda rng: _init(model, tx, rng), out_shardings=state_shardings)

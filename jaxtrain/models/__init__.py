"""Model registry and the functional view of a Flax NNX model the trainer works with.

A model is an ``nnx.Module`` class registered under a name with :func:`register`. Its constructor takes
``(cfg, *, rngs)`` where ``cfg`` is the ``model`` config group, and calling it takes
``(tokens, positions, segment_ids)`` (int32, ``[batch, length]``) and returns float32 logits
``[batch, length, vocab]``. Parameters are ``nnx.Param`` annotated with logical axis names only.
A model can be split into pipeline stages (jaxtrain/parallel/pipeline.py) when it also has the parts of that
call as methods: ``embed_tokens(tokens) -> x``, a stacked layer module ``layers`` (leading ``layers`` axis),
``apply_layer(weights, x, (positions, segment_ids)) -> x`` for one layer's slice of ``params['layers']``,
and ``head(x) -> logits``.
Adding an architecture = a new module in this package that calls :func:`register`; nothing else changes.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax
from flax import nnx

_REGISTRY: dict[str, type[nnx.Module]] = {}
_BUILTIN = ("jaxtrain.models.llama",)
_STAGE_METHODS = ("embed_tokens", "apply_layer", "head")


def register(name: str) -> Callable[[type[nnx.Module]], type[nnx.Module]]:
  def wrap(cls):
    _REGISTRY[name] = cls
    return cls
  return wrap


def names() -> list[str]:
  for module in _BUILTIN:
    importlib.import_module(module)
  return sorted(_REGISTRY)


def get(name: str) -> type[nnx.Module]:
  if name not in names():
    raise KeyError(name)
  return _REGISTRY[name]


@dataclasses.dataclass(frozen=True)
class Model:
  """A registered model as pure functions over a nested dict of parameter arrays.

  ``abstract_params`` holds ShapeDtypeStructs and ``logical_specs`` the matching PartitionSpecs of
  logical axis names; the parallelism is decided elsewhere (jaxtrain/sharding.py) from these names.
  """

  cls: type[nnx.Module]
  cfg: Any
  graphdef: Any
  abstract_params: Any
  logical_specs: Any

  @classmethod
  def from_config(cls, model_cfg) -> "Model":
    module_cls = get(model_cfg.name)
    # Sharding comes from jit out_shardings computed by jaxtrain.sharding from the logical names, not from
    # NNX's eager sharding (which resolves rules differently); one resolver for params and activations.
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(lambda: module_cls(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    return cls(module_cls, model_cfg, graphdef, params, specs)

  def init(self, rng: jax.Array) -> dict:
    with nnx.use_eager_sharding(False):
      module = self.cls(self.cfg, rngs=nnx.Rngs(params=rng))
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))

  def apply(self, params: dict, tokens, positions, segment_ids) -> jax.Array:
    return self.bind(params)(tokens, positions, segment_ids)

  def bind(self, params: dict) -> nnx.Module:
    """The module with these parameter values (inside a traced function: tracers)."""
    with nnx.use_eager_sharding(False):
      return nnx.merge(self.graphdef, params)

  def why_not_stageable(self) -> str | None:
    """Why this model cannot be split into pipeline stages, or None if it can."""
    missing = [m for m in _STAGE_METHODS if not callable(getattr(self.cls, m, None))]
    if missing:
      return f"it has no {', '.join(missing)} method{'s' if len(missing) > 1 else ''}"
    if "layers" not in self.abstract_params:
      return "it has no stacked 'layers' parameters"
    return None

  def num_layers(self) -> int:
    return jax.tree.leaves(self.abstract_params["layers"])[0].shape[0]

  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.abstract_params))

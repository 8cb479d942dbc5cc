"""Logical-axis rules, and everything that turns logical names into shardings on a mesh (jaxtrain.mesh).

Models name logical axes only (``batch``, ``length``, ``embed``, ``heads``, ``kv_heads``, ``head_dim``,
``mlp``, ``vocab``, ``layers``; ``stage`` is the pipeline's; ``experts`` and ``expert_mlp`` are a Mixture-of-Experts
layer's expert weights). A rule table maps each logical name to mesh axes;
this module is the one place that resolves it, for parameters (:func:`logical_to_sharding`) and for activations
(:func:`constrain`), using Flax's rule resolution: for each logical name the first rule whose mesh axes are
still free in that array wins, so ``batch -> (data, fsdp)`` and ``embed -> fsdp`` coexist (an activation's
``embed`` stays unsharded, a weight's ``embed`` is sharded over fsdp).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtrain import mesh as mesh_lib
from jaxtrain.errors import ConfigError
from jaxtrain.mesh import MESH_AXES


def defaults() -> ml_collections.ConfigDict:
  """The ``sharding`` config group."""
  return ml_collections.ConfigDict(dict(
      # Named rule table (see jaxtrain/sharding.py): dp | fsdp | fsdp_tp.
      preset="fsdp_tp",
      # Extra rules, tried before the preset's: "logical=axis[+axis],logical=" (empty = unsharded).
      rules="",
      # At start, list every parameter at least this large that is fully replicated.
      report_replicated_mib=1.0,
  ))


def validate(config) -> None:
  """Mesh sizes are checked against the devices when the mesh is made (jaxtrain.mesh.make_mesh); here, the rule
  table."""
  rules_from_config(config.sharding)

Rules = tuple[tuple[str, Any], ...]

# Every preset: the batch over data, fsdp and expert; the sequence over context (a no-op when mesh.context is 1);
# the layer stack over pipeline stages (contiguous blocks of
# layers; a no-op when mesh.pipeline is 1), and ``stage``, the pipeline's own view of it, too; the experts of a MoE
# layer over expert (each device holds E / mesh.expert of them; tokens travel to them by all-to-all).
_BATCH = (("batch", ("data", "fsdp", "expert")), ("length", "context"), ("layers", "pipeline"), ("stage", "pipeline"),
          ("head_dim", None), ("experts", "expert"))
PRESETS: dict[str, Rules] = {
    # Pure data parallelism: every parameter replicated, the batch split over data and fsdp.
    "dp": _BATCH + (("embed", None), ("heads", None), ("kv_heads", None), ("mlp", None), ("vocab", None),
                    ("expert_mlp", None)),
    # FSDP / ZeRO-3: every parameter, gradient and optimizer moment sharded over fsdp along embed.
    "fsdp": _BATCH + (("embed", "fsdp"), ("heads", None), ("kv_heads", None), ("mlp", None), ("vocab", None),
                      ("expert_mlp", None)),
    # FSDP + tensor (Megatron) parallelism: heads, mlp and vocab split over tensor as well.
    "fsdp_tp": _BATCH + (("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"),
                         ("vocab", "tensor"), ("expert_mlp", "tensor")),
}


def parse_rules(text: str) -> Rules:
  """'embed=fsdp,mlp=tensor+fsdp,vocab=' -> (('embed', 'fsdp'), ('mlp', ('tensor', 'fsdp')), ('vocab', None))."""
  rules = []
  for item in filter(None, (s.strip() for s in text.split(","))):
    if "=" not in item:
      raise ConfigError("sharding.rules", f"'{item}' is not of the form logical=axis[+axis]",
                        "write e.g. 'mlp=tensor,embed=fsdp' ('vocab=' for unsharded)")
    name, axes = (s.strip() for s in item.split("=", 1))
    axes = tuple(a for a in axes.split("+") if a)
    for a in axes:
      if a not in MESH_AXES:
        raise ConfigError("sharding.rules", f"'{a}' in '{item}' is not a mesh axis",
                          f"use one of {', '.join(MESH_AXES)}")
    rules.append((name, axes[0] if len(axes) == 1 else (axes or None)))
  return tuple(rules)


def rules_from_config(sharding_cfg) -> Rules:
  if sharding_cfg.preset not in PRESETS:
    raise ConfigError("sharding.preset", f"'{sharding_cfg.preset}' is not a preset",
                      f"use one of {', '.join(PRESETS)}")
  return parse_rules(sharding_cfg.rules) + PRESETS[sharding_cfg.preset]


def logical_to_mesh_spec(logical: P, rules: Rules) -> P:
  return nn.logical_to_mesh_axes(tuple(logical), rules)


def logical_to_sharding(specs: Any, mesh: Mesh, rules: Rules) -> Any:
  """A pytree of logical PartitionSpecs -> NamedShardings on ``mesh``."""
  return nn.logical_to_mesh_sharding(specs, mesh, rules)


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
  """Sharding constraint on an activation by logical names; a no-op outside an ``axis_rules`` context."""
  return nn.with_logical_constraint(x, P(*logical_axes))


def axis_rules(rules: Rules):
  """Context manager that makes ``rules`` the ones :func:`constrain` uses while tracing."""
  return nn.logical_axis_rules(rules)


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
  """Sharding of a (batch, length, ...) input array."""
  return NamedSharding(mesh, logical_to_mesh_spec(P("batch", *(("length",) if ndim > 1 else ()),
                                                    *([None] * (ndim - 2))), rules))


def mesh_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names), as a tuple."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def batch_shards(mesh_sizes: dict[str, int], rules: Rules) -> tuple[tuple[str, ...], int]:
  """The mesh axes the batch is split over, and the product of their sizes."""
  axes = mesh_axes(logical_to_mesh_spec(P("batch"), rules)[0])
  return axes, math.prod(mesh_sizes[a] for a in axes)


def shard_shape(shape: tuple[int, ...], logical: P, rules: Rules, mesh_sizes: dict[str, int]) -> tuple[int, ...]:
  """One device's shape of an array with these logical axes, by arithmetic (no devices needed)."""
  spec = tuple(logical_to_mesh_spec(logical, rules)) + (None,) * len(shape)
  return tuple(d // math.prod(mesh_sizes[a] for a in mesh_axes(s)) for d, s in zip(shape, spec))


def check_shardable(abstract: Any, specs: Any, mesh: Mesh, rules: Rules,
                    axis_key: Callable[[str], str] = lambda axis: f"the '{axis}' dimension") -> None:
  """Raises ConfigError naming the config key (``axis_key(logical axis)``, from the model family) when a sharded
  parameter dimension does not divide."""
  for (path, leaf), (_, spec) in zip(jax.tree_util.tree_leaves_with_path(abstract),
                                     jax.tree_util.tree_leaves_with_path(specs, is_leaf=_is_spec)):
    mesh_spec = logical_to_mesh_spec(spec, rules)
    for size, logical, axes in zip(leaf.shape, spec, mesh_spec, strict=True):
      if axes is None:
        continue
      mesh_lib.check_divisible(axis_key(logical), size, mesh_axes(axes),
                                 dict(mesh.shape), f"'{logical}' of {jax.tree_util.keystr(path)}")


def _is_spec(x) -> bool:
  return isinstance(x, P)


def shard_bytes(abstract: Any, shardings: Any) -> int:
  """Bytes one device holds of a pytree of ShapeDtypeStructs laid out with ``shardings``."""
  return sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
             for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))


def total_bytes(abstract: Any) -> int:
  return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract))


def replicated_params(abstract: Any, shardings: Any, min_bytes: float) -> list[tuple[str, int]]:
  """(path, bytes) of every parameter of at least ``min_bytes`` that is fully replicated."""
  out = []
  for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(abstract), jax.tree.leaves(shardings)):
    nbytes = math.prod(a.shape) * np.dtype(a.dtype).itemsize
    if s.is_fully_replicated and nbytes >= min_bytes and s.mesh.size > 1:
      out.append((jax.tree_util.keystr(path), nbytes))
  return out

"""The device mesh's sizes: the ``mesh`` config group and the arithmetic that fills and checks it.

Axes, in this order: ``data``, ``pipeline``, ``fsdp``, ``expert``, ``context``, ``tensor``; each has an ICI size (within a
slice or host) and a DCN size (``dcn_<axis>``: across slices or hosts). One ``-1`` per kind fills the rest. The
devices are arranged into a ``jax.sharding.Mesh`` by :func:`make_mesh`, the one place a mesh is built.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jaxtrain.errors import ConfigError

# ``expert`` shards the experts of Mixture-of-Experts layers (jaxtrain/parallel/experts.py); for every other layer
# it is one more axis the batch is split over (as MaxText and torchtitan do), so a dense model is data-parallel on it.
# ``context`` shards the sequence of the activations (context parallelism, jaxtrain/parallel/context.py); next to
# ``tensor``, the fastest links: attention all-gathers keys and values over it in every layer.
MESH_AXES = ("data", "pipeline", "fsdp", "expert", "context", "tensor")


def defaults() -> ml_collections.ConfigDict:
  """The ``mesh`` config group: sizes per axis, ICI (within a slice / host) and DCN (across slices or hosts)."""
  return ml_collections.ConfigDict(dict(
      data=1, fsdp=-1, tensor=1, pipeline=1, expert=1, context=1,
      dcn_data=1, dcn_fsdp=1, dcn_tensor=1, dcn_pipeline=1, dcn_expert=1, dcn_context=1,
  ))


def validate(config) -> None:
  """Sizes are checked against the devices when the mesh is made (:func:`mesh_shape`); here, that they are
  positive or -1."""
  for key, size in config.mesh.items():
    if size != -1 and size < 1:
      raise ConfigError(f"mesh.{key}", f"size {size} is invalid", "use a positive size or -1 to fill")


def resolve_axis_sizes(sizes: dict[str, int], total: int, what: str, unit: str) -> dict[str, int]:
  """Fills at most one -1 so the product of ``sizes`` equals ``total``."""
  fill = [k for k, v in sizes.items() if v == -1]
  for k, v in sizes.items():
    if v != -1 and v < 1:
      raise ConfigError(f"mesh.{k}", f"size {v} is invalid", "use a positive size or -1 to fill")
  if len(fill) > 1:
    raise ConfigError(f"mesh.{fill[1]}", f"more than one {what} axis is -1 ({', '.join(fill)})",
                      "set all but one to explicit sizes")
  known = math.prod(v for v in sizes.values() if v != -1)
  if fill:
    if total % known:
      raise ConfigError(f"mesh.{fill[0]}", f"cannot fill: {total} {unit} are not divisible by "
                        f"the other {what} axes' product {known}", f"make the explicit {what} sizes divide {total}")
    sizes = {**sizes, fill[0]: total // known}
  elif known != total:
    desc = " x ".join(f"{k}={v}" for k, v in sizes.items())
    raise ConfigError("mesh", f"{what} mesh {desc} = {known} {unit}, but there are {total}",
                      f"make the product {total} or set one axis to -1")
  return sizes


def mesh_shape(mesh_cfg, num_devices: int, num_slices: int) -> tuple[dict[str, int], dict[str, int]]:
  """(ici, dcn) sizes per axis in MESH_AXES order, -1s filled. Raises ConfigError when impossible."""
  dcn = {f"dcn_{a}": mesh_cfg[f"dcn_{a}"] for a in MESH_AXES}
  dcn = resolve_axis_sizes(dcn, num_slices, "DCN", "slices (or processes)")
  if num_devices % num_slices:
    raise ConfigError("mesh", f"{num_devices} devices do not split evenly into {num_slices} slices",
                      "use the same number of devices on every host/slice")
  ici = resolve_axis_sizes({a: mesh_cfg[a] for a in MESH_AXES}, num_devices // num_slices, "ICI",
                           "devices per slice" if num_slices > 1 else "devices")
  return ({a: ici[a] for a in MESH_AXES}, {a: dcn[f"dcn_{a}"] for a in MESH_AXES})


def check_divisible(key: str, size: int, mesh_axes: tuple[str, ...], mesh_sizes: dict[str, int], what: str):
  shards = math.prod(mesh_sizes[a] for a in mesh_axes)
  if size % shards:
    axes = " x ".join(f"mesh.{a}={mesh_sizes[a]}" for a in mesh_axes)
    raise ConfigError(key, f"{size} is not divisible by {axes} ({what} is sharded over "
                      f"{', '.join(mesh_axes)})", f"make {key} a multiple of {shards} or shrink those axes")


def num_slices(devices: Sequence[jax.Device]) -> int:
  """Slices (TPU multi-slice) or, elsewhere, processes: the granules that DCN axes span."""
  if hasattr(devices[0], "slice_index"):
    return len({d.slice_index for d in devices})
  return len({d.process_index for d in devices})


def device_grid(mesh_cfg, devices: Sequence[jax.Device]) -> np.ndarray:
  """Devices arranged in MESH_AXES order: topology-aware within a slice (ICI sizes), and with the DCN sizes
  spanning slices (TPU multi-slice) or processes (GPU / CPU hosts) when any ``dcn_*`` size is > 1."""
  hybrid = any(mesh_cfg[f"dcn_{a}"] != 1 for a in MESH_AXES)
  ici, dcn = mesh_shape(mesh_cfg, len(devices), num_slices(devices) if hybrid else 1)
  ici_shape, dcn_shape = tuple(ici[a] for a in MESH_AXES), tuple(dcn[a] for a in MESH_AXES)
  if hybrid:
    return mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices,
                                                process_is_granule=not hasattr(devices[0], "slice_index"))
  return mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The device mesh with axes MESH_AXES, ICI x DCN sizes from the config, Auto axis types."""
  grid = device_grid(mesh_cfg, list(devices if devices is not None else jax.devices()))
  return Mesh(grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))

"""Dry runs for a TPU topology this host does not have (``--config.dry_run=true --config.dry_run_topology=v5p:4x4x4``).

With ``libtpu`` installed (``pip install -e '.[tpu]'``; no TPU needed), JAX describes a named TPU topology
(``jax.experimental.topologies.get_topology_desc``) and compiles ahead of time for its devices: the real train
step, on the configured mesh over those chips, with the TPU compiler's per-device memory (MaxText's
``train_compile.py`` sizes pod runs this way). :func:`devices` gives the devices; the trainer's dry run compiles
under :func:`jaxtrain.models.attention.compiling_for` so that kernels (splash) lower for TPU, not interpret mode.
"""

from __future__ import annotations

import re

from jaxtrain.errors import ConfigError

# HBM per chip, GiB (Cloud TPU documentation), by the topology name's generation.
HBM_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95, "v6e": 32}
# HBM bandwidth per chip, bytes per second (Google Cloud's TPU pages): what a memory-bound step (decoding) reads at.
HBM_BYTES_PER_S = {"v4": 1228e9, "v5e": 819e9, "v5litepod": 819e9, "v5p": 2765e9, "v6e": 1640e9}
# Host <-> chip bandwidth per chip and direction, bytes per second: what moving an offloaded optimizer state
# (optim.offload_state) in and out costs (tools/estimate.py). An assumption, not a published figure (Cloud TPU's
# pages give none): a PCIe Gen4 x8 link's ~16 GB/s a direction, reads and writes at once. Measure on the machine
# (a device_put of a few GiB to and from pinned_host) before trusting a step time built on it.
HOST_BYTES_PER_S = {"v4": 16e9, "v5e": 16e9, "v5litepod": 16e9, "v5p": 16e9, "v6e": 16e9}
_NAME = re.compile(r"^(v4|v5e|v5litepod|v5p|v6e):\d+(x\d+){1,2}$")


def validate(cfg) -> None:
  name = cfg.dry_run_topology
  if not cfg.dry_run:
    raise ConfigError("dry_run_topology", "is set but dry_run is false", "add --config.dry_run=true")
  if not _NAME.match(name):
    raise ConfigError("dry_run_topology", f"'{name}' is not a TPU topology name",
                      f"use GENERATION:AxB[xC] with a generation in {', '.join(HBM_GIB)}, e.g. v5p:4x4x4")
  try:
    import libtpu  # noqa: F401
  except ImportError:
    raise ConfigError("dry_run_topology", "compiling for a TPU topology needs libtpu",
                      "pip install -e '.[tpu]' (works on a CPU-only host)") from None


def slice_shape(name: str) -> dict:
  """How a real slice of topology ``name`` is built, as ``get_topology_desc`` takes it: v4 and v5p chips run their
  two TensorCores as one device (megacore); a slice's ICI links wrap around along a dimension the slice fills,
  every dimension of a v4/v5p slice made of whole 4x4x4 cubes, a v5e/v6e dimension of 16 chips (Cloud TPU's slice
  shapes; MaxText describes its compile targets the same way). The TPU compiler plans collectives for the links it
  is told of: described as an open mesh, v5p:4x4x4 had the train step's weights gathered as all-reduces of
  zero-padded buffers (benchmarks/NOTES.md)."""
  generation, dims = name.split(":")
  dims = [int(d) for d in dims.split("x")]
  if generation in ("v4", "v5p"):
    wrap = all(d % 4 == 0 for d in dims)
    return {"chip_config_name": "megacore", "wrap": (wrap,) * 3}
  return {"chip_config_name": "default", "wrap": tuple(d == 16 for d in dims) + (False,) * (3 - len(dims))}


def devices(name: str) -> list:
  """The devices of TPU topology ``name`` (e.g. ``v5e:2x2``), for ahead-of-time compilation."""
  from jax.experimental import topologies
  return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **slice_shape(name)).devices)


def hbm_bytes(name: str) -> int:
  return HBM_GIB[name.split(":")[0]] * 2**30


def hbm_bytes_per_s(name: str) -> float:
  return HBM_BYTES_PER_S[name.split(":")[0]]


def host_bytes_per_s(name: str) -> float:
  """:data:`HOST_BYTES_PER_S` of topology ``name``'s generation (a name, or a generation alone: ``v6e``)."""
  return HOST_BYTES_PER_S[name.split(":")[0]]

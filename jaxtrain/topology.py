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


def devices(name: str) -> list:
  """The devices of TPU topology ``name`` (e.g. ``v5e:2x2``), for ahead-of-time compilation."""
  from jax.experimental import topologies
  return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def hbm_bytes(name: str) -> int:
  return HBM_GIB[name.split(":")[0]] * 2**30

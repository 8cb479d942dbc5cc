"""What the benchmark scripts share: simulated CPU devices (unless XLA_FLAGS already sets a count), the repo on
sys.path, and writing results as JSON with the backend they were measured on.

Import and call :func:`setup` before jax is imported.
"""

from __future__ import annotations

import json
import os
import sys


def setup(devices: int = 8) -> None:
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}").strip()
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def write_json(path: str, results: dict) -> str:
  """Writes ``results`` plus backend, jax version, device kind and count to ``path`` (local, gs:// or s3://)."""
  import jax
  from etils import epath

  out = epath.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  header = {"backend": jax.default_backend(), "jax": jax.__version__, "device_kind": jax.devices()[0].device_kind,
            "devices": jax.device_count()}
  out.write_text(json.dumps({**header, **results}, indent=2))
  return os.fspath(out)

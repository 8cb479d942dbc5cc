"""For each attention backend argument (``backend`` or ``backend@remat``: with that remat policy): the real (scanned)
train step of a config compiled for a TPU topology on this (CPU) host, with the TPU compiler's memory figures, the
number of Mosaic (Pallas TPU) kernel calls in the compiled program, and tools/estimate.py's figures for the same
config. Prints one JSON object keyed by argument. Run by tests/test_tpu_compile.py with libtpu on PYTHONPATH: one
process for all of them, as libtpu's start is paid once."""

import importlib.util
import json
import os
import sys

from jaxtrain import topology
from jaxtrain.models import attention
from jaxtrain.train import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("estimate", os.path.join(ROOT, "tools", "estimate.py"))
estimate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(estimate)

name, config_file, overrides = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
out = {}
for argument in sys.argv[4:]:
  backend, _, remat = argument.partition("@")
  chosen = [f"model.attention={backend}"] + ([f"model.remat={remat}"] if remat else [])
  c = estimate.load_config(config_file, overrides + chosen + ["data.source=synthetic", "workdir=/tmp/unused"])
  c.dry_run, c.dry_run_topology = True, name
  run = trainer.build(c, topology.devices(name))
  with attention.compiling_for("tpu"):
    step = trainer.compile_step(run)
  mem = step.memory_analysis()
  estimated = estimate.estimate(c, run.mesh.size)
  out[argument] = {"device_kind": run.mesh.devices.flat[0].device_kind, "devices": int(run.mesh.size),
                   "compiled_peak": int(mem.peak_memory_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
                   "host_temp_bytes": int(mem.host_temp_size_in_bytes),
                   "mosaic_calls": step.as_text().count("tpu_custom_call"), **estimated["bytes_per_device"],
                   "host_activations": estimated.get("host_activation_bytes_per_device", 0)}
print(json.dumps(out))

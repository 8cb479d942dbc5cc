"""For each attention backend argument: the real (scanned) train step of a config compiled for a TPU topology on this
(CPU) host, with the TPU compiler's memory figures, the number of Mosaic (Pallas TPU) kernel calls in the compiled
program, and tools/estimate.py's figures for the same config. Prints one JSON object keyed by backend. Run by
tests/test_tpu_compile.py with libtpu on PYTHONPATH: one process for all backends, as libtpu's start is paid once."""

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
for backend in sys.argv[4:]:
  c = estimate.load_config(config_file, overrides + [f"model.attention={backend}", "data.source=synthetic",
                                                    "workdir=/tmp/unused"])
  c.dry_run, c.dry_run_topology = True, name
  run = trainer.build(c, topology.devices(name))
  with attention.compiling_for("tpu"):
    step = trainer.compile_step(run)
  mem = step.memory_analysis()
  out[backend] = {"device_kind": run.mesh.devices.flat[0].device_kind, "devices": int(run.mesh.size),
                  "compiled_peak": int(mem.peak_memory_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
                  "mosaic_calls": step.as_text().count("tpu_custom_call"),
                  **estimate.estimate(c, run.mesh.size)["bytes_per_device"]}
print(json.dumps(out))

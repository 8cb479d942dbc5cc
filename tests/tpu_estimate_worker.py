"""For each ``seq_len:backend`` argument: the train step of a config compiled for a TPU topology on this (CPU) host,
the TPU compiler's peak memory per device, and tools/estimate.py's figures for the same config. Prints one JSON
object. Run by tests/test_tpu_compile.py with libtpu on PYTHONPATH."""

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
for case in sys.argv[4:]:
  seq_len, backend = case.split(":")
  c = estimate.load_config(config_file, overrides + [f"data.seq_len={seq_len}", f"model.attention={backend}",
                                                    "data.source=synthetic", "workdir=/tmp/unused"])
  c.dry_run, c.dry_run_topology = True, name
  devices = topology.devices(name)
  run = trainer.build(c, devices)
  with attention.compiling_for("tpu"):
    step = trainer.compile_step(run)
  predicted = estimate.estimate(c, len(devices))["bytes_per_device"]
  out[case] = {"compiled_peak": int(step.memory_analysis().peak_memory_in_bytes), **predicted}
print(json.dumps(out))

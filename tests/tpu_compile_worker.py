"""Compiles configs/tiny.py-like train steps for a TPU topology on this (CPU) host, once per attention backend, and
prints per backend the dry run's per-device memory and the number of Mosaic (Pallas TPU) kernel calls in the
compiled program. Run by tests/test_tpu_compile.py with libtpu on PYTHONPATH."""

import json
import sys

from jaxtrain import topology
from jaxtrain.config import base_config
from jaxtrain.models import attention
from jaxtrain.train import trainer

name, seq_len = sys.argv[1], int(sys.argv[2])
out = {}
for backend in sys.argv[3:]:
  c = base_config()
  c.model.update(num_layers=2, d_model=128, num_heads=4, num_kv_heads=2, head_dim=128, mlp_dim=256, attention=backend)
  c.data.update(source="synthetic", seq_len=seq_len)
  c.train.global_batch_size = 4
  c.dry_run, c.dry_run_topology, c.workdir = True, name, "/tmp/unused"
  run = trainer.build(c, topology.devices(name))
  with attention.compiling_for("tpu"):
    step = trainer.compile_step(run)
  mem = step.memory_analysis()
  out[backend] = {"device_kind": run.mesh.devices.flat[0].device_kind, "devices": int(run.mesh.size),
                  "temp_bytes": mem.temp_size_in_bytes, "mosaic_calls": step.as_text().count("tpu_custom_call")}
print(json.dumps(out))

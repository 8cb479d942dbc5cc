"""Which configs fit which TPU chips: the train step compiled for named TPU topologies on this host (needs libtpu:
pip install -e '.[tpu]'), per attention backend; per-device peak memory from the TPU compiler, or its refusal, next
to tools/estimate.py's figure for the same config and chip count.

  python tools/bench_topology.py [--config=configs/llama3_8b.py] [--topologies=v5p:4x4x4,v6e:8x8]
      [--backends=xla,splash] [--per_chip_batch=1,8] [--remat=full,minimal,...] [--out=benchmarks/results/topology.json]
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags, logging  # noqa: E402

import _bench  # noqa: E402  (tools/ is on sys.path when a script runs)
from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/llama3_8b.py", "Config file.")
_TOPOS = flags.DEFINE_list("topologies", ["v5p:4x4x4", "v6e:8x8"], "TPU topologies.")
_BACKENDS = flags.DEFINE_list("backends", ["xla", "splash"], "model.attention values.")
_BATCH = flags.DEFINE_list("per_chip_batch", ["1", "8"], "Sequences per chip (global batch = this x chips).")
_REMAT = flags.DEFINE_list("remat", [], "model.remat policies to compare (default: the config's own).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/topology.json", "Where to write the JSON results.")


def _estimate(backend: str, batch: int, chips: int, remat: str) -> dict:
  """tools/estimate.py's per-device bytes for the same config (its own process: it defines the same flags), with
  the activations it puts in host memory as ``host``."""
  r = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "estimate.py"),
                      f"--config={_CONFIG.value}", f"--devices={chips}", "--json", f"--set=model.attention={backend}",
                      f"--set=train.global_batch_size={batch}", f"--set=model.remat={remat}"], capture_output=True,
                     text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  info = json.loads(r.stdout)
  return {**info["bytes_per_device"], "host": info["host_activation_bytes_per_device"]}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  spec = importlib.util.spec_from_file_location("cfg", _CONFIG.value)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  results = []
  print(f"{'topology':>10} {'chips':>5} {'batch/chip':>10} {'attention':>9} {'remat':>15} {'peak GiB':>9} "
        f"{'estimate':>8} {'host GiB':>8} {'HBM GiB':>8}  verdict")
  for topo in _TOPOS.value:
    chips = math.prod(int(n) for n in topo.split(":")[1].split("x"))
    for per_chip in map(int, _BATCH.value):
      for backend in _BACKENDS.value:
        for remat in _REMAT.value or [module.get_config().model.remat]:
          c = module.get_config()
          c.model.attention, c.model.remat = backend, remat
          c.train.global_batch_size = per_chip * chips
          c.dry_run, c.dry_run_topology, c.workdir = True, topo, "/tmp/bench_topology_unused"
          config_lib.validate_values(c)
          info = trainer.dry_run(c)
          peak = info.get("peak_bytes_per_device") or info.get("needs_bytes")
          predicted = _estimate(backend, per_chip * chips, chips, remat)
          results.append({"topology": topo, "chips": chips, "per_chip_batch": per_chip, "attention": backend,
                          "remat": remat, "seq_len": c.data.seq_len, **{k: info.get(k) for k in (
                              "fits", "peak_bytes_per_device", "needs", "needs_bytes", "device_capacity_bytes",
                              "memory_per_device", "compile_s", "flops_per_token", "host_bytes_per_device")},
                          "estimate_bytes_per_device": predicted})
          verdict = "fits" if info["fits"] else f"DOES NOT FIT ({info.get('needs', 'peak')})"
          print(f"{topo:>10} {chips:>5} {per_chip:>10} {backend:>9} {remat:>15} {peak / 2**30:>9.1f} "
                f"{predicted['total'] / 2**30:>8.1f} {(predicted['host'] or 0) / 2**30:>8.1f} "
                f"{info['device_capacity_bytes'] / 2**30:>8.1f}  {verdict}", flush=True)
  print(f"wrote {_bench.write_json(_OUT.value, {'config': _CONFIG.value, 'results': results})}")


if __name__ == "__main__":
  app.run(main)

"""The harness's log-likelihood program on a TPU slice, on the TPU compiler's own account (no TPU: libtpu compiles
for a named topology on this host; pip install -e '.[tpu]').

  python tools/bench_eval_tpu.py [--config=configs/llama3_8b.py] [--topologies=v5p:4x4x4] [--lengths=512,2048]
      [--rows_per_chip=1] [--out=benchmarks/results/eval_tpu.json]

For each row length, jaxtrain.evaluation.scoring.Scorer's program (the training forward, the cross-entropy of
every position, the per-row sums and greedy flags) for ``rows_per_chip`` x chips rows, laid out as the config
trains (its mesh and rules). The compiler counts a scanned layer stack's body once, so the figures are
extrapolated as tools/bench_tpu.py does (every scan unrolled at n and n + 1 layers; whole = rest + L x per layer):
flops, HBM bytes and the compiler's time estimate per chip. Requests per second = rows / seconds (a row holds one
request; a multiple-choice question of k choices is k requests), tokens per second = rows x length / seconds.
Peak memory comes from the real (rolled) program.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags, logging  # noqa: E402

import _bench  # noqa: E402  (tools/ is on sys.path when a script runs)
import _hlo  # noqa: E402
from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain import topology  # noqa: E402
from jaxtrain.evaluation.scoring import Scorer  # noqa: E402
from jaxtrain.models import attention, scans  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/llama3_8b.py", "Config file (configs/x.py[:variant]).")
_TOPOS = flags.DEFINE_list("topologies", ["v5p:4x4x4"], "TPU topologies (jaxtrain.topology names).")
_LENGTHS = flags.DEFINE_list("lengths", ["512", "2048"], "Row lengths (tokens).")
_ROWS = flags.DEFINE_integer("rows_per_chip", 1, "Rows per chip per program.")
_SET = flags.DEFINE_multi_string("set", [], "key=value overrides.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/eval_tpu.json", "Where to write the JSON results.")


def compile_figures(config, topo: str, layers: int, unrolled: bool, length: int):
  c = config.copy_and_resolve_references()
  c.model.num_layers = layers
  c.dry_run, c.dry_run_topology = True, topo
  config_lib.validate_values(c)
  run = trainer.build(c, topology.devices(topo))
  scorer = Scorer(run.model, run.mesh, run.rules, run.state_shardings.params, rows=_ROWS.value * run.mesh.size,
                  max_length=length)
  with attention.compiling_for("tpu"), scans.unrolled() if unrolled else contextlib.nullcontext():
    compiled = scorer.program(length)
  return _hlo.figures(compiled), compiled, run, scorer.rows


def estimate(config, topo: str, length: int) -> dict:
  layers, t = int(config.model.num_layers), time.perf_counter()
  small = compile_figures(config, topo, 1, True, length)[0]
  bigger = compile_figures(config, topo, 2, True, length)[0]
  per_layer, rest, whole = _hlo.extrapolate(small, bigger, 1, layers)
  _, real, run, rows = compile_figures(config, topo, layers, False, length)
  mem = real.memory_analysis()
  return {"topology": topo, "chips": run.mesh.size, "device_kind": run.mesh.devices.flat[0].device_kind,
          "layers": layers, "rows": rows, "length": length, "whole": whole, "per_layer": per_layer, "rest": rest,
          "requests_per_s": rows / whole["seconds"], "tokens_per_s": rows * length / whole["seconds"],
          "peak_bytes": int(mem.peak_memory_in_bytes), "compile_s": time.perf_counter() - t}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = config_lib.load_file(_CONFIG.value, [*_SET.value, "data.source=synthetic", "workdir=/tmp/bench_eval_tpu"])
  results = []
  print(f"{'topology':>10} {'chips':>5} {'rows':>5} {'length':>6} {'TFLOP/chip':>10} {'HBM GB':>7} {'batch ms':>8} "
        f"{'requests/s':>10} {'tokens/s':>10} {'peak GiB':>8}")
  for topo in _TOPOS.value:
    for length in map(int, _LENGTHS.value):
      r = estimate(config, topo, length)
      results.append(r)
      w = r["whole"]
      print(f"{topo:>10} {r['chips']:>5} {r['rows']:>5} {length:>6} {w['flops'] / 1e12:>10.2f} "
            f"{w['bytes'] / 1e9:>7.1f} {w['seconds'] * 1e3:>8.2f} {r['requests_per_s']:>10.0f} "
            f"{r['tokens_per_s']:>10.0f} {r['peak_bytes'] / 2**30:>8.2f}", flush=True)
  config_file, overrides = config_lib.as_overrides(_CONFIG.value, _SET.value)
  print(f"wrote {_bench.write_json(_OUT.value, {'config': config_file, 'overrides': overrides, 'results': results})}")


if __name__ == "__main__":
  app.run(main)

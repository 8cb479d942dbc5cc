"""Whole-step estimates from the TPU compiler's own cost model, on this host (no TPU: libtpu compiles for a named
topology; pip install -e '.[tpu]').

  python tools/bench_tpu.py [--config=configs/llama3_8b.py] [--topologies=v5p:4x4x4,v6e:8x8]
      [--set=model.remat=full ...] [--validate=4] [--out=benchmarks/results/tpu.json]

XLA's cost analysis counts a while loop's body once, so the real program (its layers one ``lax.scan``) reports one
layer's flops and bytes. Method: the train step compiled with every scan unrolled (jaxtrain.models.scans) at n and
n + 1 layers (n = the fewest the family allows: 1, or its dense first layers + 1); per layer = c(n + 1) - c(n), the
rest (embedding, head, loss, optimizer) = c(n) - n x per layer, the whole step = rest + L x per layer, for each of
the compiler's figures:
- ``flops`` and ``bytes accessed`` (HBM traffic) per chip;
- ``optimal_seconds``: the compiler's own step-time estimate per chip;
- the collectives' bytes per chip (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute: the
  largest array each one reads or writes, from the compiled HLO).
Estimated MFU = the model's FLOPs (the family's count, as training logs it) per chip / the estimated step / the
chip's peak bf16 FLOP/s. Peak memory and temporaries come from the real (rolled) program, compiled too.
With pipeline stages (S stages, R virtual stages for circular and interleaved_1f1b) the ticks unroll too and the
layers go S R at a time (one more on each stage and virtual stage): compiled at n - 1 + S R and n - 1 + 2 S R
layers, per layer = their difference / (S R); ``--validate`` then takes a multiple of S R.
Two things the cost model does not see: Pallas (Mosaic) kernels cost nothing in it (splash attention's own time
is missing from the estimate, ``mosaic_calls`` counts them), and a custom call it cannot price subtracts one second
each (tools/_hlo.py adds those back). MaxText's step, measured with the same code: tools/maxtext_step.py.
``--validate=V`` also compiles V layers fully unrolled and reports extrapolated / compiled for each figure (the
method holds when these are 1 within 2%: tests/test_tpu_compile.py).
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
from jaxtrain import metrics, topology  # noqa: E402
from jaxtrain.errors import ConfigError  # noqa: E402
from jaxtrain.models import attention, scans  # noqa: E402
from jaxtrain.parallel import pipeline as pipeline_lib  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/llama3_8b.py", "Config file (configs/x.py[:variant]).")
_TOPOS = flags.DEFINE_list("topologies", ["v5p:4x4x4"], "TPU topologies (jaxtrain.topology names).")
_SET = flags.DEFINE_multi_string("set", [], "key=value overrides, e.g. model.remat=save_qkv_proj.")
_VALIDATE = flags.DEFINE_integer("validate", 0, "Also compile this many layers unrolled and compare (0: no).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/tpu.json", "Where to write the JSON results.")

FIGURES = ("flops", "bytes", "seconds", "collective_bytes")


def compile_figures(config, topo: str, layers: int, unrolled: bool):
  """(figures, compiled, run) of the train step of ``config`` with ``layers`` layers compiled for ``topo``."""
  c = config.copy_and_resolve_references()
  c.model.num_layers = layers
  c.dry_run, c.dry_run_topology = True, topo
  config_lib.validate_values(c)
  run = trainer.build(c, topology.devices(topo))
  with attention.compiling_for("tpu"), scans.unrolled() if unrolled else contextlib.nullcontext():
    compiled = trainer.compile_step(run)
  figures = _hlo.figures(compiled)
  return figures, compiled, run


def estimate(config, topo: str, validate: int = 0) -> dict:
  layers = int(config.model.num_layers)
  first = int(config.model.get("first_dense_layers", 0)) + 1  # the fewest layers the family builds
  # A pipeline adds layers S x R at a time (one to each stage and virtual stage); its ticks unroll too, so the step
  # is linear in the layers per unit.
  stages = config.mesh.pipeline * config.mesh.dcn_pipeline
  step = stages * (config.pipeline.repeats if config.pipeline.schedule in pipeline_lib.REPEATING else 1)
  t = time.perf_counter()
  small, _, _ = compile_figures(config, topo, first - 1 + step, unrolled=True)
  bigger, _, _ = compile_figures(config, topo, first - 1 + 2 * step, unrolled=True)
  per_layer, rest, whole = _hlo.extrapolate(small, bigger, first - 1 + step, layers, step)
  _, real, run = compile_figures(config, topo, layers, unrolled=False)
  mem = real.memory_analysis()
  chips = run.mesh.size
  tokens = config.train.global_batch_size * config.data.seq_len
  model_flops = metrics.flops_per_token(run.model, config.data.seq_len) * tokens / chips
  peak = metrics.peak_flops_per_device(device=run.mesh.devices.flat[0])
  result = {
      "topology": topo, "chips": chips, "device_kind": run.mesh.devices.flat[0].device_kind, "layers": layers,
      "per_chip_batch": config.train.global_batch_size / chips, "seq_len": config.data.seq_len,
      "attention": config.model.attention, "remat": config.model.remat, "dtype": config.model.dtype,
      "whole": whole, "per_layer": per_layer, "rest": rest, "model_flops": model_flops,
      "estimated_mfu": model_flops / whole["seconds"] / peak if peak else None,
      "peak_bytes": int(mem.peak_memory_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
      "argument_bytes": int(mem.argument_size_in_bytes),
      "host_bytes": int(getattr(mem, "host_temp_size_in_bytes", 0) or 0)}
  if validate:
    compiled, _, _ = compile_figures(config, topo, validate, unrolled=True)
    extrapolated = {k: rest[k] + validate * per_layer[k] for k in rest}
    result["validation"] = {"layers": validate, "compiled": compiled, "extrapolated": extrapolated,
                            "ratio": {k: extrapolated[k] / compiled[k] if compiled[k] else None for k in FIGURES}}
  result["compile_s"] = time.perf_counter() - t
  return result


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = config_lib.load_file(_CONFIG.value, [*_SET.value, "data.source=synthetic", "workdir=/tmp/bench_tpu"])
  results = []
  print(f"{'topology':>10} {'chips':>5} {'TFLOP/chip':>10} {'model TF':>8} {'HBM GB':>7} {'coll GB':>7} "
        f"{'layer ms':>8} {'rest ms':>7} {'step s':>7} {'MFU':>6} {'peak GiB':>8} {'temp GiB':>8}  "
        "validation (extrapolated/compiled)")
  try:
    for topo in _TOPOS.value:
      r = estimate(config, topo, _VALIDATE.value)
      results.append(r)
      w = r["whole"]
      check = "" if "validation" not in r else "  " + " ".join(
          f"{k} {v:.4f}" for k, v in r["validation"]["ratio"].items() if v is not None)
      mfu = f"{r['estimated_mfu']:.1%}" if r["estimated_mfu"] else "-"
      print(f"{topo:>10} {r['chips']:>5} {w['flops'] / 1e12:>10.2f} {r['model_flops'] / 1e12:>8.2f} "
            f"{w['bytes'] / 1e9:>7.1f} {w['collective_bytes'] / 1e9:>7.2f} {r['per_layer']['seconds'] * 1e3:>8.2f} "
            f"{r['rest']['seconds'] * 1e3:>7.2f} {w['seconds']:>7.4f} {mfu:>6} "
            f"{r['peak_bytes'] / 2**30:>8.2f} {r['temp_bytes'] / 2**30:>8.2f}{check}", flush=True)
  except ConfigError as e:
    sys.exit(f"bench_tpu: error: {e}")
  config_file, overrides = config_lib.as_overrides(_CONFIG.value, _SET.value)  # a :variant as its overrides
  summary = {"config": config_file, "overrides": overrides, "results": results}
  print(f"wrote {_bench.write_json(_OUT.value, summary)}")


if __name__ == "__main__":
  app.run(main)

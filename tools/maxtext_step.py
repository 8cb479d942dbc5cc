"""MaxText's train step measured as tools/bench_tpu.py measures ours: its own ``train_compile`` compiles the step
for a TPU topology at n and n + 1 decoder layers with the layers unrolled (``scan_layers=false``: MaxText then
remats with ``prevent_cse``, as jaxtrain.models.scans does), the whole step is extrapolated from the TPU
compiler's figures (tools/_hlo.py, the same code), and the real scanned program gives peak memory and temporaries.

MaxText is a peer, never a dependency: run this with the Python of a virtualenv that has it, e.g.

  python3.12 -m venv /tmp/mtvenv && /tmp/mtvenv/bin/pip install 'maxtext[tpu]==0.2.5'
  /tmp/mtvenv/bin/python tools/maxtext_step.py --layers=32 --out=benchmarks/results/maxtext_llama3_8b_v5p.json -- \\
      model_name=llama3-8b compile_topology=v5p-128 compile_topology_num_slices=1 per_device_batch_size=1 \\
      max_target_length=8192 attention=flash remat_policy=full dtype=bfloat16 weight_dtype=float32

Everything after ``--`` is MaxText's own ``key=value`` config (its configs/base.yml plus these).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _hlo  # noqa: E402


def _compile(overrides: list[str]):
  """MaxText's compiled train step for ``overrides`` (train_compile.main, its compiled object kept)."""
  import maxtext
  from maxtext.trainers.pre_train import train_compile

  kept = {}
  jit_and_compile = train_compile.jit_and_compile

  def keep(*args, **kwargs):
    kept["compiled"] = jit_and_compile(*args, **kwargs)
    return kept["compiled"]

  train_compile.jit_and_compile = keep
  try:
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    train_compile.main(["train_compile", base, "run_name=jaxtrain_compare", "override_model_config=true", *overrides])
  finally:
    train_compile.jit_and_compile = jit_and_compile
  return kept["compiled"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, required=True, help="The model's decoder layers (the whole step's).")
  parser.add_argument("--first", type=int, default=1, help="The fewest layers to compile unrolled (n).")
  parser.add_argument("--out", default="")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  t = time.perf_counter()
  unrolled = [_hlo.figures(_compile([*args.overrides, f"base_num_decoder_layers={n}", "scan_layers=false"]))
              for n in (args.first, args.first + 1)]
  per_layer, rest, whole = _hlo.extrapolate(*unrolled, args.first, args.layers)
  real = _compile([*args.overrides, f"base_num_decoder_layers={args.layers}", "scan_layers=true"])
  mem = real.memory_analysis()
  result = {"maxtext_overrides": args.overrides, "layers": args.layers, "whole": whole, "per_layer": per_layer,
            "rest": rest, "peak_bytes": int(mem.peak_memory_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes), "compile_s": time.perf_counter() - t}
  import jax
  result["jax"] = jax.__version__
  print(f"MaxText: step {whole['seconds']:.4f} s (estimated), {whole['flops'] / 1e12:.2f} TFLOP, "
        f"{whole['bytes'] / 1e9:.1f} GB HBM, {whole['collective_bytes'] / 1e9:.2f} GB collectives per chip; per layer "
        f"{per_layer['bytes'] / 1e9:.2f} GB, rest {rest['bytes'] / 1e9:.2f} GB; "
        f"peak {result['peak_bytes'] / 2**30:.2f} "
        f"GiB, temporaries {result['temp_bytes'] / 2**30:.2f} GiB")
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()

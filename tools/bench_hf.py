"""Hugging Face import / export throughput and peak host memory (tools/convert_hf.py).

  python tools/bench_hf.py [--sizes=50m,1b] [--dir=/tmp/bench_hf] [--out=benchmarks/results/hf.json]

For each size a random bfloat16 ``LlamaForCausalLM`` folder is written (the shapes of the published model, written
tensor by tensor: no torch needed), then ``convert_hf.py import`` and ``convert_hf.py export`` run as separate
processes under ``/usr/bin/time``: wall time, MB/s of source (bfloat16) weights, peak resident memory. The export
is checked to be bitwise the source, tensor by tensor. Sizes:

  50m  the cpu_50m config's shape (8 x 768, GQA 12/4, mlp 2048, byte vocabulary): 50.7M params
  1b   Llama 3.2 1B's shape (16 x 2048, GQA 32/8, mlp 8192, vocab 128,256, tied): 1.24B params
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys

import _bench

_bench.setup(1)

SIZES = {
    "50m": dict(vocab_size=256, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                num_key_value_heads=4, head_dim=64, tie_word_embeddings=False),
    "1b": dict(vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
               rope_theta=500_000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_random_hf(folder: str, shape: dict, shard_bytes: int = 2 * 10**9) -> int:
  """A random bfloat16 HF Llama folder of ``shape``; returns its weight bytes."""
  import numpy as np
  from jaxtrain import hf
  config = {**dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                   max_position_embeddings=8192, rope_theta=10_000.0, attention_bias=False, mlp_bias=False,
                   torch_dtype="bfloat16"), **shape}
  os.makedirs(folder)
  with open(os.path.join(folder, "config.json"), "w") as fh:
    json.dump(config, fh, indent=2)
  tensors = [(name, shp) for name, _, _, shp, _ in hf.tensor_map(hf.model_config(config))]
  bf16 = np.dtype(hf._bf16())
  rng = np.random.default_rng(0)
  shards, size = [[]], 0
  for name, shp in tensors:
    nbytes = math.prod(shp) * 2
    if shards[-1] and size + nbytes > shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, shp, bf16))
    size += nbytes
  shape_of = dict(tensors)
  weight_map = {}
  for i, shard in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    hf._write_safetensors(os.path.join(folder, file), shard,
                          lambda n: (rng.standard_normal(shape_of[n], np.float32) * 0.02).astype(bf16))
    weight_map.update({n: file for n, _, _ in shard})
  total = sum(math.prod(s) * 2 for _, s in tensors)
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
  return total


def timed(cmd: list[str]) -> tuple[float, float]:
  """(wall seconds, peak RSS in GB) of ``cmd`` run under /usr/bin/time."""
  out = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M", *cmd], capture_output=True, text=True, cwd=ROOT)
  if out.returncode:
    sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
  wall, kb = re.findall(r"TIME ([\d.]+) (\d+)", out.stderr)[-1]
  return float(wall), int(kb) / 1e6


def same_tensors(a: str, b: str) -> bool:
  """Every tensor of HF folder ``a`` is bitwise the one of the same name in ``b`` (read one at a time)."""
  from jaxtrain import hf
  ea, eb = hf._find_weights(a), hf._find_weights(b)
  return set(ea) == set(eb) and all(ea[n].read().tobytes() == eb[n].read().tobytes() for n in ea)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sizes", default="50m,1b")
  p.add_argument("--dir", default="/tmp/bench_hf")
  p.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/hf.json"))
  args = p.parse_args()
  shutil.rmtree(args.dir, ignore_errors=True)
  python, tool = sys.executable, os.path.join(ROOT, "tools/convert_hf.py")
  baseline = timed([python, "-c", "import jax, jaxtrain.hf, jaxtrain.checkpoint; jax.numpy.zeros(1)"])[1]
  rows = []
  for size in args.sizes.split(","):
    src, out, back = (os.path.join(args.dir, f"{size}_{k}") for k in ("hf", "jaxtrain", "export"))
    nbytes = write_random_hf(src, SIZES[size])
    t_imp, m_imp = timed([python, tool, "import", f"--hf={src}", f"--output={out}"])
    t_exp, m_exp = timed([python, tool, "export", f"--checkpoint={out}", f"--output={back}", "--max_shard_mb=2000"])
    rows.append(dict(size=size, params=nbytes // 2, source_mb=nbytes / 1e6, fp32_mb=nbytes * 2 / 1e6,
                     import_s=t_imp, import_mb_s=nbytes / 1e6 / t_imp, import_peak_gb=m_imp,
                     export_s=t_exp, export_mb_s=nbytes / 1e6 / t_exp, export_peak_gb=m_exp,
                     bitwise=same_tensors(src, back)))
    shutil.rmtree(args.dir, ignore_errors=True)
  print(f"bare python + jax + jaxtrain: {baseline:.2f} GB peak RSS")
  print(f"{'size':>5} {'params':>14} {'bf16 MB':>8} {'import s':>9} {'MB/s':>7} {'peak GB':>8} "
        f"{'export s':>9} {'MB/s':>7} {'peak GB':>8} {'bitwise':>8}")
  for r in rows:
    print(f"{r['size']:>5} {r['params']:>14,} {r['source_mb']:>8.0f} {r['import_s']:>9.1f} {r['import_mb_s']:>7.0f} "
          f"{r['import_peak_gb']:>8.2f} {r['export_s']:>9.1f} {r['export_mb_s']:>7.0f} {r['export_peak_gb']:>8.2f} "
          f"{str(r['bitwise']):>8}")
  print("wrote", _bench.write_json(args.out, {"baseline_peak_gb": baseline, "rows": rows}))


if __name__ == "__main__":
  main()

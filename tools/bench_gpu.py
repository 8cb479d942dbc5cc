"""Training throughput and MFU on one GPU, per attention backend and sequence length (pip install -e '.[cuda]').

  python tools/bench_gpu.py [--config=configs/llama3_1b.py] [--runs=cudnn:8192:4:none,xla:4096:8:full]
      [--steps=5] [--attention] [--set=key=value ...] [--out=benchmarks/results/gpu_llama3_1b.json]

Each run is ``backend:seq_len:rows:remat``: the config's model (Llama 3.2 1B by default: 16 layers, d_model 2048,
bf16 compute, float32 params and AdamW state) with ``model.attention``, ``data.seq_len``,
``train.global_batch_size`` and ``model.remat`` set so, synthetic data, one device. The real train step (loss,
gradients, the finite guard, the optimizer update) is compiled, run twice to warm up, then ``--steps`` times, each
step waited for; the median is the step time. Reported: tokens/s, model TFLOP/s and MFU against the chip's peak
bf16 FLOP/s (jaxtrain.metrics: 989 TFLOP/s for H100 and H200), with the model's FLOPs as training logs them
(PaLM's count: 6 x the matmul parameters + 12 x layers x heads x head_dim x seq_len per token, the attention term
for the full square as PaLM and MaxText count it) and, beside it, ``MFU causal`` with the attention term halved
(the FLOPs a causal kernel does). Also the compiled step's peak memory (XLA's memory analysis) and the first
step's loss (the same batch for every run, so the backends' losses agree).

``--attention`` first times one layer's attention alone (forward + backward, 1 x seq_len tokens, the model's
heads): each backend, and cuDNN's packed call without the fallback's ``lax.cond``. ``--matmul`` first times the
MLP's up projection alone ([rows x seq_len, d_model] x [d_model, mlp_dim], forward + both backward matmuls) in
bf16 and through each ``model.quantization`` recipe: whether the quantized matmul itself pays, apart from the step.

XLA's GPU flags are process-wide: run the script once per flag set (``XLA_FLAGS=... python tools/bench_gpu.py
--out=...``); the JSON records them. A run that does not fit the GPU is reported as such and the others go on.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

import _bench  # noqa: E402  (tools/ is on sys.path when a script runs; no _bench.setup(): real devices only)
from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain import data as data_lib  # noqa: E402
from jaxtrain import metrics  # noqa: E402
from jaxtrain.data.synthetic import SyntheticSource  # noqa: E402
from jaxtrain.models import attention, quantization  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/llama3_1b.py", "Config file (configs/x.py[:variant]).")
_RUNS = flags.DEFINE_list("runs", ["cudnn:4096:8:none", "cudnn:8192:4:none", "blockwise:4096:8:none",
                                   "blockwise:8192:4:none", "xla:4096:8:full", "xla:8192:4:full"],
                          "backend:seq_len:rows:remat per run.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per run (after 2 warm-up steps).")
_ATTENTION = flags.DEFINE_bool("attention", False, "First time one layer's attention alone per backend.")
_MATMUL = flags.DEFINE_bool("matmul", False, "First time one MLP matmul per quantization recipe.")
_SET = flags.DEFINE_multi_string("set", [], "More key=value overrides for every run.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/gpu_llama3_1b.json", "Where to write the JSON results.")


def _time(fn, *args, steps: int = 10) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def time_attention(config, seq_len: int) -> list[dict]:
  """One layer's attention, forward + backward, 1 row of ``seq_len`` tokens, bf16: ms per backend."""
  m = config.model
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (1, seq_len, m.num_heads, m.head_dim), jnp.bfloat16)
  k, v = (jax.random.normal(x, (1, seq_len, m.num_kv_heads, m.head_dim), jnp.bfloat16) for x in keys[1:])
  seg = jnp.ones((1, seq_len), jnp.int32)
  pos = jnp.arange(seq_len, dtype=jnp.int32)[None]
  variants = {name: (lambda name: lambda q, k, v: attention.attend(name, q, k, v, seg, pos))(name)
              for name in ("cudnn", "blockwise", "xla")}
  variants["cudnn, no fallback cond"] = lambda q, k, v: attention._cudnn_packed(
      q, k, v, seg, attention.PLAIN, attention.CUDNN_MAX_SEGMENTS)
  flops = 4 * seq_len * seq_len * m.num_heads * m.head_dim * 3.5 / 2  # causal: fwd 2 matmuls, bwd 5
  rows = []
  for name, fn in variants.items():
    grad = jax.jit(jax.value_and_grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2)))
    try:
      ms = 1e3 * _time(grad, q, k, v)
      rows.append({"backend": name, "seq_len": seq_len, "ms": ms, "tflops": flops / ms / 1e9})
    except Exception as e:  # noqa: BLE001 - a backend that does not fit is reported, the others go on
      rows.append({"backend": name, "seq_len": seq_len, "error": str(e).splitlines()[0][:200]})
    print(rows[-1], flush=True)
  return rows


def time_matmul(config, tokens: int) -> list[dict]:
  """The MLP's up projection, forward + backward (3 matmuls), ``tokens`` rows, bf16 operands: ms per recipe."""
  m = config.model
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (tokens, m.d_model), jnp.bfloat16)
  w = jax.random.normal(kw, (m.d_model, m.mlp_dim), jnp.bfloat16) * m.d_model ** -0.5
  flops = 3 * 2 * tokens * m.d_model * m.mlp_dim
  rows = []
  for name in quantization.QUANTIZATION.names():
    dot = quantization.dot_general(name)
    loss = lambda x, w, dot=dot: jnp.sum(dot(x, w, (((1,), (0,)), ((), ()))).astype(jnp.float32) ** 2)
    fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    try:
      ms = _time(fn, x, w) * 1e3
    except Exception as e:  # noqa: BLE001 - a recipe the GPU cannot run: reported, the others go on
      rows.append({"quantization": name, "tokens": tokens, "error": str(e).splitlines()[0][:300]})
      print(f"matmul {name:<6} {tokens} tokens: {rows[-1]['error']}", flush=True)
      continue
    rows.append({"quantization": name, "tokens": tokens, "ms": ms, "tflops": flops / ms / 1e9})
    print(f"matmul {name:<6} {tokens} x {m.d_model} x {m.mlp_dim}: {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s",
          flush=True)
  return rows


def bench(config_file: str, spec: str, steps: int, overrides: list[str]) -> dict:
  backend, seq_len, rows, remat = spec.split(":")
  seq_len, rows = int(seq_len), int(rows)
  config = config_lib.load_file(config_file, [
      *overrides, f"model.attention={backend}", f"data.seq_len={seq_len}", f"train.global_batch_size={rows}",
      f"model.remat={remat}", "data.source=synthetic", "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1",
      "workdir=/tmp/bench_gpu"])
  result = {"run": spec, "backend": backend, "seq_len": seq_len, "rows": rows, "remat": remat,
            "tokens": rows * seq_len}
  try:
    config_lib.validate_values(config)
    run = trainer.build(config)
    t = time.perf_counter()
    step_fn = trainer.compile_step(run)
    result["compile_s"] = time.perf_counter() - t
    state = trainer.init_state(run)
    source = SyntheticSource(seq_len, config.model.vocab_size, rows, 0)
    batch = data_lib.to_global(next(source), run.batch_sharding)
    no_skip = np.bool_(False)
    times, losses = [], []
    for i in range(2 + steps):
      t = time.perf_counter()
      state, out = step_fn(state, batch, no_skip)
      losses.append(float(out["loss"]))
      if i >= 2:
        times.append(time.perf_counter() - t)
  except Exception as e:  # noqa: BLE001 - out of memory, a kernel refusing a shape: reported, the others go on
    result["error"] = str(e).splitlines()[0][:300]
    return result
  step = statistics.median(times)
  per_token = metrics.flops_per_token(run.model, seq_len)
  m = config.model
  causal = per_token - 6 * m.num_layers * m.num_heads * m.head_dim * seq_len  # the attention term halved
  peak = metrics.peak_flops_per_device()
  mem = step_fn.memory_analysis()
  result.update(
      step_s=step, step_s_min=min(times), step_s_max=max(times), tokens_per_s=result["tokens"] / step,
      tflops=per_token * result["tokens"] / step / 1e12,
      mfu=per_token * result["tokens"] / step / peak if peak else None,
      mfu_causal=causal * result["tokens"] / step / peak if peak else None, first_loss=losses[0], losses=losses,
      peak_gib=int(mem.peak_memory_in_bytes) / 2**30, temp_gib=int(mem.temp_size_in_bytes) / 2**30,
      chosen=attention.resolve(backend, jax.default_backend(), seq_len, dtype=m.dtype))
  return result


def _pct(x) -> str:
  return "-" if x is None else f"{x:.1%}"


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  header = {"config": _CONFIG.value, "overrides": _SET.value, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "steps": _STEPS.value}
  summary = {**header, "attention": [], "matmul": [], "results": []}
  config = config_lib.load_file(_CONFIG.value, _SET.value)
  if _MATMUL.value:
    for tokens in sorted({int(s.split(":")[1]) * int(s.split(":")[2]) for s in _RUNS.value}):
      summary["matmul"] += time_matmul(config, tokens)
      _bench.write_json(_OUT.value, summary)
  if _ATTENTION.value:
    for seq_len in sorted({int(s.split(":")[1]) for s in _RUNS.value}):
      summary["attention"] += time_attention(config, seq_len)
      _bench.write_json(_OUT.value, summary)
  print(f"{jax.devices()[0].device_kind}, XLA_FLAGS={header['xla_flags']!r}")
  print(f"{'run':<24}{'compile s':>10}{'step s':>8}{'tokens/s':>10}{'TFLOP/s':>9}{'MFU':>7}{'MFU causal':>11}"
        f"{'peak GiB':>9}{'loss 1':>8}")
  for spec in _RUNS.value:
    r = bench(_CONFIG.value, spec, _STEPS.value, _SET.value)
    summary["results"].append(r)
    if "error" in r:
      print(f"{spec:<24}  {r['error']}", flush=True)
    else:
      print(f"{spec:<24}{r['compile_s']:>10.1f}{r['step_s']:>8.3f}{r['tokens_per_s']:>10,.0f}{r['tflops']:>9.1f}"
            f"{_pct(r['mfu']):>7}{_pct(r['mfu_causal']):>11}{r['peak_gib']:>9.1f}{r['first_loss']:>8.4f}", flush=True)
    _bench.write_json(_OUT.value, summary)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)

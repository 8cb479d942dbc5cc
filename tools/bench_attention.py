"""Attention memory benchmark: the compiled train step's temporary bytes per device against sequence length, per
attention backend, and with a sliding window.

  python tools/bench_attention.py [--seq_lens=1024,2048,4096,8192,16384] [--backends=xla,blockwise]
      [--window=0] [--tokens_per_device=0] [--out=benchmarks/results/attention.json]

configs/tiny.py's model (4 layers, d_model 128, 4 heads of 32, 2 KV heads), one sequence per device (global
batch 8 on 8 simulated CPU devices, fsdp 8), synthetic data, float32; the step is compiled, never run (the dry
run's numbers: arguments, outputs and temporaries per device from XLA's memory analysis).

``--window=W``: each length longer than W is also compiled with a sliding window of W (every layer local), and each
run's temporaries are also given relative to the causal run at length W. ``--tokens_per_device=T``: T / seq_len
rows per device instead of one, so that every length holds the same tokens (the activations are then the same size
and the difference is attention's): a W-token window at length L should cost what a W-token context costs.

  python tools/bench_attention.py --seq_lens=4096,32768 --backends=blockwise --window=4096 \
      --tokens_per_device=32768 --out=benchmarks/results/attention_window.json
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

from absl import app, flags, logging  # noqa: E402

from jaxtrain.config import base_config  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_SEQ = flags.DEFINE_list("seq_lens", ["1024", "2048", "4096", "8192", "16384"], "Sequence lengths.")
_BACKENDS = flags.DEFINE_list("backends", ["xla", "blockwise"], "Attention backends (model.attention).")
_BLOCK = flags.DEFINE_integer("block_size", 512, "model.attention_block_size for blockwise.")
_WINDOW = flags.DEFINE_integer("window", 0, "Also compile each longer length with this sliding window (0: no).")
_TOKENS = flags.DEFINE_integer("tokens_per_device", 0, "Tokens per device (rows = this / seq_len); 0: one row.")
_TIME = flags.DEFINE_bool("time", False, "Also time attention's forward + backward alone on one device.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/attention.json", "Where to write the JSON results.")


def tiny(seq_len: int, backend: str, window: int = 0):
  c = base_config()
  c.model.update(num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384, vocab_size=256,
                 attention=backend, attention_block_size=_BLOCK.value, sliding_window=window)
  c.data.update(source="synthetic", seq_len=seq_len)
  c.train.global_batch_size = 8 * max(1, _TOKENS.value // seq_len)
  c.checkpoint.verify = False
  return c


def time_attention(rows: int, seq_len: int, backend: str, window: int) -> float:
  """Median seconds of attention's forward + backward alone (the tiny model's heads: 4 x 32, 2 KV heads) for
  ``rows`` rows of ``seq_len`` tokens on one device, after a compiling call."""
  import time

  import jax
  import jax.numpy as jnp

  from jaxtrain.models import attention
  q, k, v = (jax.random.normal(key, (rows, seq_len, heads, 32)) for key, heads in
             zip(jax.random.split(jax.random.key(0), 3), (4, 2, 2)))
  seg = jnp.ones((rows, seq_len), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (rows, seq_len))
  variant = attention.Variant(window=window)
  grad = jax.jit(jax.grad(lambda q, k, v: attention.attend(backend, q, k, v, seg, pos, _BLOCK.value,
                                                           variant).sum(), argnums=(0, 1, 2)))
  jax.block_until_ready(grad(q, k, v))
  times = []
  for _ in range(3):
    t = time.perf_counter()
    jax.block_until_ready(grad(q, k, v))
    times.append(time.perf_counter() - t)
  return sorted(times)[1]


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  results = []
  window = _WINDOW.value
  print(f"{'seq_len':>8} {'rows':>5} {'window':>7} {'backend':>10} {'temp MiB':>10} {'args MiB':>9} "
        f"{'x of first':>10}" + (f" {f'x of causal {window}':>16}" if window else ""))
  for backend in _BACKENDS.value:
    first, at_window = None, None
    for seq_len in map(int, _SEQ.value):
      for w in [0] + ([window] if window and window < seq_len else []):
        c = tiny(seq_len, backend, w)
        info = trainer.dry_run(c)
        mem = info["memory_per_device"]
        first = first or mem["temp"]
        if seq_len == window and not w:
          at_window = mem["temp"]
        rows = c.train.global_batch_size // 8
        seconds = time_attention(rows, seq_len, backend, w) if _TIME.value else None
        results.append({**({"attention_fwd_bwd_s": seconds} if seconds else {}),"seq_len": seq_len, "rows_per_device": rows, "window": w, "backend": backend,
                        "block_size": _BLOCK.value, "temp_bytes_per_device": mem["temp"],
                        "argument_bytes_per_device": mem["argument"], "compile_s": info["compile_s"],
                        **({"x_causal_at_window": mem["temp"] / at_window} if at_window else {})})
        print(f"{seq_len:>8} {rows:>5} {w or '-':>7} {backend:>10} {mem['temp'] / 2**20:>10,.1f} "
              f"{mem['argument'] / 2**20:>9,.1f} {mem['temp'] / first:>10.2f}"
              + (f" {mem['temp'] / at_window:>16.2f}" if at_window else "")
              + (f"  attention fwd+bwd {seconds:.3f}s" if seconds else ""), flush=True)
  print(f"wrote {_bench.write_json(_OUT.value, {'results': results})}")


if __name__ == "__main__":
  app.run(main)

"""Attention memory benchmark: the compiled train step's temporary bytes per device against sequence length, per
attention backend (and, with --context, per context-parallel size).

  python tools/bench_attention.py [--seq_lens=1024,2048,4096,8192,16384] [--backends=xla,blockwise]
      [--out=benchmarks/results/attention.json]

configs/tiny.py's model (4 layers, d_model 128, 4 heads of 32, 2 KV heads), one sequence per device (global
batch 8 on 8 simulated CPU devices, fsdp 8), synthetic data, float32; the step is compiled, never run (the dry
run's numbers: arguments, outputs and temporaries per device from XLA's memory analysis).
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
_OUT = flags.DEFINE_string("out", "benchmarks/results/attention.json", "Where to write the JSON results.")


def tiny(seq_len: int, backend: str):
  c = base_config()
  c.model.update(num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384, vocab_size=256,
                 attention=backend, attention_block_size=_BLOCK.value)
  c.data.update(source="synthetic", seq_len=seq_len)
  c.train.global_batch_size = 8
  c.checkpoint.verify = False
  return c


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  results = []
  print(f"{'seq_len':>8} {'backend':>10} {'temp MiB':>10} {'args MiB':>9} {'x of first':>10}")
  for backend in _BACKENDS.value:
    first = None
    for seq_len in map(int, _SEQ.value):
      info = trainer.dry_run(tiny(seq_len, backend))
      mem = info["memory_per_device"]
      first = first or mem["temp"]
      results.append({"seq_len": seq_len, "backend": backend, "block_size": _BLOCK.value,
                      "temp_bytes_per_device": mem["temp"], "argument_bytes_per_device": mem["argument"],
                      "compile_s": info["compile_s"]})
      print(f"{seq_len:>8} {backend:>10} {mem['temp'] / 2**20:>10,.1f} {mem['argument'] / 2**20:>9,.1f} "
            f"{mem['temp'] / first:>10.1f}", flush=True)
  print(f"wrote {_bench.write_json(_OUT.value, {'results': results})}")


if __name__ == "__main__":
  app.run(main)

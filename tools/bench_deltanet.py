"""Qwen3-Next's gated DeltaNet (jaxtrain/models/qwen3_next): the chunked form's compiled temporaries and time against
the sequence length, beside the recurrent form it equals.

  python tools/bench_deltanet.py [--lengths=1024,4096,16384] [--heads=4] [--dim=64] [--chunk=64] [--reps=3]
      [--out=benchmarks/results/deltanet.json]

For each length: the forward and backward of one DeltaNet mixer's delta rule (``chunked_delta_rule``: one row,
``--heads`` heads of ``--dim`` for k and v, float32, a packed row of documents), compiled on one CPU device; XLA's
temporary bytes (``memory_analysis``) and their ratio to the first length's, the median wall time of ``--reps``
runs; and the largest difference of the chunked output from the recurrent form's (``recurrent_delta_rule``, one
token at a time). Linear growth: the temporaries' ratio equals the lengths' ratio (a quadratic form's would be its
square). Prints a table and writes JSON.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup(devices=1)

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxtrain.models.qwen3_next import model as qwen3_next  # noqa: E402

_LENGTHS = flags.DEFINE_list("lengths", ["1024", "4096", "16384"], "Sequence lengths.")
_HEADS = flags.DEFINE_integer("heads", 4, "Heads (k and v alike).")
_DIM = flags.DEFINE_integer("dim", 64, "The k and v head dims.")
_CHUNK = flags.DEFINE_integer("chunk", 64, "The chunked form's chunk (model.deltanet_chunk).")
_REPS = flags.DEFINE_integer("reps", 3, "Timed runs per length (after one warm-up).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/deltanet.json", "Where to write the JSON results.")


def inputs(length: int, heads: int, dim: int, seed: int = 0):
  """q, k (L2-normalized, q scaled), v, g, beta and the document starts of one packed row (documents of 700
  tokens, as a pretraining row holds several)."""
  keys = jax.random.split(jax.random.key(seed), 5)
  q, k = (qwen3_next.l2_normalized(jax.random.normal(key, (1, length, heads, dim))) for key in keys[:2])
  v = jax.random.normal(keys[2], (1, length, heads, dim))
  g = -jax.nn.softplus(jax.random.normal(keys[3], (1, length, heads))) * 0.1
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, length, heads)))
  starts = (jnp.arange(length) % 700 == 0)[None]
  return q * dim ** -0.5, k, v, g, beta, starts


def main(argv):
  del argv
  chunk = _CHUNK.value

  def loss(q, k, v, g, beta, starts):
    out, state = qwen3_next.chunked_delta_rule(q, k, v, g, beta, starts, chunk=chunk)
    return jnp.sum(out ** 2) + jnp.sum(state ** 2)

  train = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  recurrent = jax.jit(qwen3_next.recurrent_delta_rule)
  chunked = jax.jit(lambda *a: qwen3_next.chunked_delta_rule(*a, chunk=chunk))
  rows = []
  for length in (int(n) for n in _LENGTHS.value):
    args = inputs(length, _HEADS.value, _DIM.value)
    compiled = train.lower(*args).compile()
    temps = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(_REPS.value):
      t = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - t)
    want, got = recurrent(*args), chunked(*args)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(want, got))
    rows.append(dict(length=length, temp_bytes=int(temps), seconds=statistics.median(times), max_abs_diff=err))
  first = rows[0]
  print(f"gated DeltaNet, chunked form, forward + backward: 1 row, {_HEADS.value} heads of {_DIM.value}, chunk "
        f"{chunk}, float32, {jax.devices()[0].device_kind}")
  print(f"{'tokens':>8} {'temporaries MiB':>16} {'x first':>8} {'x lengths':>10} {'step s':>8} {'x first':>8} "
        f"{'|chunked - recurrent|':>22}")
  for r in rows:
    r["temp_ratio"] = r["temp_bytes"] / first["temp_bytes"]
    r["length_ratio"] = r["length"] / first["length"]
    r["time_ratio"] = r["seconds"] / first["seconds"]
    print(f"{r['length']:>8} {r['temp_bytes'] / 2**20:>16.2f} {r['temp_ratio']:>8.2f} {r['length_ratio']:>10.0f} "
          f"{r['seconds']:>8.4f} {r['time_ratio']:>8.2f} {r['max_abs_diff']:>22.2e}")
  path = _bench.write_json(_OUT.value, dict(heads=_HEADS.value, dim=_DIM.value, chunk=chunk, rows=rows))
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)

"""Collective bandwidth over each mesh axis, on whatever backend is present.

  python tools/comm_benchmark.py [--mesh=data=2,fsdp=2,tensor=2] [--sizes_kib=4,64,1024,16384]
      [--iters=10] [--out=benchmarks/results/comm.json]

For every axis of size > 1 and every size (bytes per device), times all-reduce (psum), all-gather and
reduce-scatter (psum_scatter) inside jax.shard_map, and reports the median time, algorithm bandwidth
(bytes per device / time) and bus bandwidth (NCCL-tests convention: x 2(n-1)/n for all-reduce, x (n-1)/n for
the others), which is comparable across axis sizes. On CPU it simulates 8 devices.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxtrain import mesh as mesh_lib  # noqa: E402
from jaxtrain.config import base_config  # noqa: E402
from jaxtrain.mesh import MESH_AXES  # noqa: E402

_MESH = flags.DEFINE_string("mesh", "data=2,fsdp=2,tensor=2", "Mesh sizes (others 1; one may be -1).")
_SIZES = flags.DEFINE_list("sizes_kib", ["4", "64", "1024", "16384"], "Bytes per device, in KiB.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed iterations per point.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/comm.json", "Where to write the JSON results.")

OPS = {
    "all_reduce": (lambda x, axis: jax.lax.psum(x, axis), lambda n: 2 * (n - 1) / n),
    "all_gather": (lambda x, axis: jax.lax.all_gather(x, axis, tiled=True), lambda n: (n - 1) / n),
    "reduce_scatter": (lambda x, axis: jax.lax.psum_scatter(x, axis, tiled=True), lambda n: (n - 1) / n),
}


def bench(mesh, axis: str, op: str, nbytes: int) -> dict:
  n = mesh.shape[axis]
  fn, factor = OPS[op]
  per_device = max(nbytes // 4 // n * n, n)  # float32 elements, divisible by n for the scatter
  spec = P(axis)  # each device holds per_device elements; replicated over the other axes
  x = jax.device_put(jnp.ones((per_device * n,), jnp.float32), NamedSharding(mesh, spec))
  out_spec = P() if op == "all_gather" else spec
  f = jax.jit(jax.shard_map(functools.partial(fn, axis=axis), mesh=mesh, in_specs=spec, out_specs=out_spec,
                            check_vma=False))
  jax.block_until_ready(f(x))
  times = []
  for _ in range(_ITERS.value):
    t = time.perf_counter()
    jax.block_until_ready(f(x))
    times.append(time.perf_counter() - t)
  t = statistics.median(times)
  size = per_device * 4
  return {"axis": axis, "axis_size": n, "op": op, "bytes_per_device": size, "time_s": t,
          "algbw_gbps": size / t / 1e9, "busbw_gbps": size / t / 1e9 * factor(n)}


def main(argv):
  del argv
  cfg = base_config().mesh
  cfg.update({a: 1 for a in MESH_AXES})
  for item in _MESH.value.split(","):
    key, value = item.split("=")
    cfg[key] = int(value)
  mesh = mesh_lib.make_mesh(cfg)
  results = [bench(mesh, axis, op, int(kib) * 1024) for axis in MESH_AXES if mesh.shape[axis] > 1
             for op in OPS for kib in _SIZES.value]
  print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), mesh {dict(mesh.shape)}")
  print(f"{'axis':<9}{'n':>3} {'op':<15}{'bytes/device':>14}{'time ms':>10}{'algbw GB/s':>12}{'busbw GB/s':>12}")
  for r in results:
    print(f"{r['axis']:<9}{r['axis_size']:>3} {r['op']:<15}{r['bytes_per_device']:>14,}{1e3 * r['time_s']:>10.3f}"
          f"{r['algbw_gbps']:>12.2f}{r['busbw_gbps']:>12.2f}")
  print(f"wrote {_bench.write_json(_OUT.value, {'mesh': dict(mesh.shape), 'results': results})}")


if __name__ == "__main__":
  app.run(main)

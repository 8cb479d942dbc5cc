"""Mixture-of-Experts benchmark on the (simulated) device mesh: step time and all-to-all bytes per expert-parallel
degree and mode, and the load-balance loss's effect on expert loads.

  python tools/bench_moe.py [--experts=1,2,4,8] [--modes=dropless,capacity] [--steps=10] [--balance_steps=150]
                            [--config=configs/moe_tiny.py] [--out=benchmarks/results/moe.json] [--nobalance]

1. Sweep: ``--config`` (moe_tiny: 4 MoE layers, d_model 128, 8 experts top-2, 16 x 128 tokens per step) with
   mesh.expert = N (fsdp filling the rest of the 8 devices) x model.moe_impl dropless / capacity: the compiled
   train step's median time over ``--steps`` steps after 2 warm-up steps (synthetic batch, the same for all), and
   the all-to-all bytes per device per step counted from the compiled program: the sum of every all-to-all's
   operands (= its result: an all-to-all keeps shapes) in ``compiled.as_text()``, each times the trip counts of
   the while loops around it (the layer scan, forward and backward), next to tools/estimate.py's figure for the
   same config and mesh (``moe.all_to_all.buffer_bytes_per_step``; jaxtrain/parallel/experts.py all_to_all_bytes).
   Both count the whole buffers a device hands to its all-to-alls, the 1/ep it keeps for itself included.
2. Balance: trains ``--config`` on its data (the bundled corpus for moe_tiny) for ``--balance_steps`` steps with
   model.load_balance_weight = 0.01 and 0.0 (all else equal, fsdp over all devices) and reports the logged
   ``moe/load_max`` (the largest expert's share of the choices x E, mean over the MoE layers; 1.0 = even) at the
   first and last logged steps, and the loss.
Prints tables and writes JSON. On CPU it simulates 8 devices unless XLA_FLAGS already says otherwise.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

import estimate as estimate_lib  # noqa: E402  (tools/estimate.py)
from jaxtrain import data as data_lib  # noqa: E402
from jaxtrain import metrics as metrics_lib  # noqa: E402
from jaxtrain.data.synthetic import SyntheticSource  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_CFG = flags.DEFINE_string("moe_config", "configs/moe_tiny.py", "The MoE config to measure.")
_EXPERTS = flags.DEFINE_list("experts", ["1", "2", "4", "8"], "mesh.expert sizes (fsdp fills the rest).")
_MODES = flags.DEFINE_list("modes", ["dropless", "capacity"], "model.moe_impl values.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per setting (median).")
_BALANCE = flags.DEFINE_bool("balance", True, "Also run the load-balance on/off training comparison.")
_SWEEP = flags.DEFINE_bool("sweep", True, "Run the mesh.expert x moe_impl sweep.")
_BALANCE_STEPS = flags.DEFINE_integer("balance_steps", 150, "Training steps per balance run.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/moe.json", "Where to write the JSON results.")

_DTYPES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
           "s64": 8, "u64": 8, "f64": 8}
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_SHAPE = re.compile(r"\b(pred|[sufb]f?\d+)\[([\d,]*)\]")


def _config(expert: int, mode: str):
  config = estimate_lib.load_config(_CFG.value, [])
  config.mesh.update(data=1, fsdp=-1, tensor=1, pipeline=1, expert=expert)
  config.model.moe_impl = mode
  return config


def _shape_bytes(text: str) -> int:
  return sum(_DTYPES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _SHAPE.findall(text))


def hlo_all_to_all_bytes(hlo: str) -> dict:
  """Bytes of all the all-to-all operands one device runs in one execution of the compiled program ``hlo``
  (``compiled.as_text()``): each instruction's result shapes (an all-to-all's results are its operands' shapes),
  times the product of the known trip counts of the while loops that run its computation (a call or conditional
  branch counts once). Also split into forward / backward (``transpose(`` in the op name) and the int32 ids."""
  comps, current = {}, None
  for line in hlo.splitlines():
    m = _HEADER.match(line)
    if m:
      current = m.group(1)
      comps[current] = []
    elif current is not None:
      comps[current].append(line)
  entry = next(m.group(1) for m in re.finditer(r"^ENTRY\s+%([\w.\-]+)", hlo, re.M))
  callers: dict[str, list[tuple[str, int]]] = {}
  for name, lines in comps.items():
    for line in lines:
      trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
      body = re.search(r"\bbody=%([\w.\-]+)", line)
      if body:
        callers.setdefault(body.group(1), []).append((name, int(trip.group(1)) if trip else 1))
      for key in ("to_apply", "calls", "true_computation", "false_computation"):
        for callee in re.findall(rf"\b{key}=%([\w.\-]+)", line):
          callers.setdefault(callee, []).append((name, 1))
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      if branches:
        for callee in re.findall(r"%([\w.\-]+)", branches.group(1)):
          callers.setdefault(callee, []).append((name, 1))
  memo = {entry: 1}

  def runs(name: str, seen=()) -> int:
    if name not in memo:
      memo[name] = sum(runs(caller, seen + (name,)) * n for caller, n in callers.get(name, ()) if caller not in seen)
    return memo[name]

  out = {"total": 0, "forward": 0, "backward": 0, "ids": 0, "count": 0}
  for name, lines in comps.items():
    for line in lines:
      m = re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s+all-to-all(?:-start)?\(", line)
      if not m:
        continue
      n = runs(name)
      size = _shape_bytes(m.group(1)) * n
      out["total"] += size
      out["count"] += n
      out["backward" if "transpose(" in line else "forward"] += size
      if not re.search(r"\b(?:[bf]f?\d+)\[", m.group(1)):  # integer-only operands: the expert ids
        out["ids"] += size
  return out


def bench_setting(expert: int, mode: str) -> dict:
  config = _config(expert, mode)
  run = trainer.build(config)
  t = time.perf_counter()
  compiled = trainer.compile_step(run)
  compile_s = time.perf_counter() - t
  hlo = hlo_all_to_all_bytes(compiled.as_text())
  est = estimate_lib.estimate(config, jax.device_count(), platform=jax.default_backend())
  a2a = est["moe"]["all_to_all"]
  state = trainer.init_state(run)
  batch = data_lib.to_global(next(SyntheticSource(config.data.seq_len, config.model.vocab_size,
                                                  config.train.global_batch_size, seed=0)), run.batch_sharding)
  times = []
  for i in range(_STEPS.value + 2):
    t = time.perf_counter()
    state, m = compiled(state, batch, np.bool_(False))
    jax.block_until_ready(m)
    if i >= 2:
      times.append(time.perf_counter() - t)
  return {"expert": expert, "fsdp": est["mesh"]["fsdp"], "mode": mode, "step_s": statistics.median(times),
          "compile_s": compile_s, "experts_per_device": est["moe"]["experts_per_device"],
          "hlo_all_to_all_bytes": hlo["total"], "hlo_forward_bytes": hlo["forward"],
          "hlo_backward_bytes": hlo["backward"], "hlo_id_bytes": hlo["ids"], "hlo_all_to_alls": hlo["count"],
          "estimate_bytes": a2a["buffer_bytes_per_step"], "estimate_sent_bytes": a2a["sent_bytes_per_step"],
          "estimate_id_bytes": a2a["id_bytes_per_step"], "buffer_bytes": a2a["buffer_bytes"],
          "ideal_bytes": a2a["ideal_bytes"], "capacity": a2a["capacity"],
          "dropped": float(m.get("moe/dropped", 0.0)), "loss": float(m["loss"])}


def bench_balance(weight: float, workdir: str) -> dict:
  config = estimate_lib.load_config(_CFG.value, [])
  config.workdir = workdir
  config.mesh.update(data=1, fsdp=-1, tensor=1, pipeline=1, expert=1)
  config.model.load_balance_weight = weight
  config.train.update(steps=_BALANCE_STEPS.value, log_every=5)
  config.checkpoint.update(every_steps=0, verify=False)
  t = time.perf_counter()
  trainer.train(config)
  elapsed = time.perf_counter() - t
  records = [r for r in metrics_lib.read_records(workdir) if "moe/load_max" in r]
  first, last = records[0], records[-1]
  loads = [last[k] for k in sorted(last) if k.startswith("moe/load/e")]
  return {"load_balance_weight": weight, "steps": config.train.steps, "first_step": first["step"],
          "last_step": last["step"], "load_max_first": first["moe/load_max"], "load_max_last": last["moe/load_max"],
          "load_max_min": min(r["moe/load_max"] for r in records), "loss_first": first["loss"],
          "loss_last": last["loss"], "loads_last": loads, "seconds": elapsed,
          "load_max_curve": [(r["step"], r["moe/load_max"]) for r in records]}


def main(argv):
  del argv
  results = {"config": _CFG.value}
  if _SWEEP.value:
    sweep = [bench_setting(int(e), mode) for mode in _MODES.value for e in _EXPERTS.value]
    results["sweep"] = sweep
    kib = 2**10
    print(f"\n{_CFG.value}: step time and all-to-all bytes per device per step (whole step, fwd + bwd), "
          f"{jax.device_count()} devices")
    print(f"{'mode':>9} {'expert':>6} {'fsdp':>4} {'E/dev':>5} {'step ms':>8} {'compile s':>9} {'a2a ops':>7} "
          f"{'HLO KiB':>9} {'estim. KiB':>10} {'sent KiB':>9} {'ids KiB':>8} {'buf/ideal':>9}")
    for r in sweep:
      ratio = r["buffer_bytes"] / r["ideal_bytes"] if r["buffer_bytes"] else 0.0
      print(f"{r['mode']:>9} {r['expert']:>6} {r['fsdp']:>4} {r['experts_per_device']:>5} {1e3 * r['step_s']:>8.1f} "
            f"{r['compile_s']:>9.1f} {r['hlo_all_to_alls']:>7} {r['hlo_all_to_all_bytes'] / kib:>9.0f} "
            f"{r['estimate_bytes'] / kib:>10.0f} {r['estimate_sent_bytes'] / kib:>9.0f} "
            f"{r['hlo_id_bytes'] / kib:>8.0f} {ratio:>9.2f}")
  if _BALANCE.value:
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-moe-") as tmp:
      balance = [bench_balance(w, f"{tmp}/lb{w}") for w in (0.01, 0.0)]
    results["balance"] = balance
    print(f"\nload balance: {_CFG.value} on its data, {_BALANCE_STEPS.value} steps; moe/load_max (1.0 = even)")
    print(f"{'lb weight':>9} {'step':>5} {'load_max':>8} {'step':>5} {'load_max':>8} {'min':>6} {'loss first':>10} "
          f"{'loss last':>9}  final loads x E")
    for r in balance:
      loads = " ".join(f"{x * len(r['loads_last']):.2f}" for x in r["loads_last"])
      print(f"{r['load_balance_weight']:>9} {r['first_step']:>5} {r['load_max_first']:>8.3f} {r['last_step']:>5} "
            f"{r['load_max_last']:>8.3f} {r['load_max_min']:>6.3f} {r['loss_first']:>10.3f} {r['loss_last']:>9.3f}  "
            f"{loads}")
  print(f"\nwrote {_bench.write_json(_OUT.value, results)}")


if __name__ == "__main__":
  app.run(main)

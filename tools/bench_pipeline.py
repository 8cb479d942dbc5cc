"""Pipeline benchmark on the (simulated) device mesh: bubble fraction vs the formula, step time vs no pipeline.

  python tools/bench_pipeline.py [--stages=2,4] [--reps=5] [--out=benchmarks/results/pipeline.json]
  python tools/bench_pipeline.py --memory_only [--micro_rows=8] [--memory_out=benchmarks/results/pipeline_memory.json]
  python tools/bench_pipeline.py --schedules_only [--reps=5] [--schedules_out=benchmarks/results/pipeline_schedules.json]

1. Bubble: forward + backward of the pipelined layer stack alone (jaxtrain.parallel.pipeline.run), one
   microbatch size, M in {S, 2S, 4S} microbatches, GPipe (R = 1) and circular (R = 2). The loop runs
   R M + S - 1 iterations of which R M do useful work on every stage; a least-squares fit
   T(M) = a + t (R M + S - 1) over the three runs gives the time per iteration t, and
   measured bubble = 1 - R M t / T(M) (so it also counts the fixed cost a), against (S-1)/(R M+S-1).
   On simulated CPU devices bubble iterations compute on zeros instead of idling; same cost either way.
2. Step time: the whole compiled train step (embedding, pipeline, head, optimizer) with pipeline = S vs the
   same model, batch and devices without a pipeline (fsdp over all devices), median of alternated steps.
   Also the compiled step's per-device temporary memory.
3. Memory: per-device temporaries (``compiled.memory_analysis().temp_size_in_bytes``) of the whole compiled train
   step, compiled only (no step runs), for S = 4 stages (mesh pipeline=4, fsdp over the other 2 of the 8
   devices), the same small model, a fixed microbatch of ``--micro_rows`` rows (global batch M x micro_rows),
   every schedule (gpipe, 1f1b; circular and interleaved_1f1b with 2 repeats) at M in {8, 16, 32}: gpipe /
   circular keep every microbatch's stage inputs, so their temporaries grow with M, while the 1f1b schedules
   keep at most Schedule.in_flight = min(2 R S - 1, R M) and should stay flat. The table gives each row's ratio
   to the same schedule at M = 8, with in_flight and the bubble; written to ``--memory_out`` with the config
   shape. ``--memory_only`` runs this section alone (12 compiles, a few minutes on a 2-core CPU host).
4. Schedules: the whole train step's median time for every schedule at S = 4, M = 16 and without a pipeline (fsdp
   over every device), the same global batch, timed in alternation; ratios to gpipe and to no pipeline.
   ``--schedules_only`` runs this section alone.
Prints a table and writes JSON. On CPU it simulates 8 devices unless XLA_FLAGS already says otherwise.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxtrain import data as data_lib  # noqa: E402
from jaxtrain import sharding  # noqa: E402
from jaxtrain.config import base_config  # noqa: E402
from jaxtrain.data.synthetic import SyntheticSource  # noqa: E402
from jaxtrain.parallel import pipeline as pipeline_lib  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402

_STAGES = flags.DEFINE_list("stages", ["2", "4"], "Pipeline stage counts to measure.")
_REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions per measurement (median).")
_MICRO = flags.DEFINE_integer("micro_rows", 8, "Rows per microbatch.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/pipeline.json", "Where to write the JSON results.")
_MEMORY_ONLY = flags.DEFINE_bool("memory_only", False, "Run only the memory section (compiles, no steps).")
_SCHEDULES_ONLY = flags.DEFINE_bool("schedules_only", False, "Run only the schedules' step-time section.")
_SCHEDULES_OUT = flags.DEFINE_string("schedules_out", "benchmarks/results/pipeline_schedules.json",
                                     "Where the schedules' step-time section writes its JSON.")
_MEMORY_OUT = flags.DEFINE_string("memory_out", "benchmarks/results/pipeline_memory.json",
                                  "Where to write the memory section's JSON results.")

_MEMORY_STAGES = 4
_MEMORY_SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b")
_MEMORY_MICROBATCHES = (8, 16, 32)


def _config(stages: int, schedule: str, microbatches: int):
  c = base_config()
  c.workdir = "/tmp/jaxtrain-bench-pipeline"
  c.model.update(num_layers=8, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=512,
                 vocab_size=256)
  c.data.update(seq_len=128, source="synthetic")
  c.mesh.update(pipeline=stages, fsdp=-1)
  c.pipeline.update(schedule=schedule, repeats=2)
  c.train.update(microbatches=microbatches, global_batch_size=microbatches * _MICRO.value)
  return c


def _alternated_medians(calls: dict) -> dict:
  """Median seconds of each zero-argument call, timed in alternation (round-robin) after one warm-up each."""
  for fn in calls.values():
    jax.block_until_ready(fn())
  times = {k: [] for k in calls}
  for _ in range(_REPS.value):
    for k, fn in calls.items():
      t = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t)
  return {k: statistics.median(v) for k, v in times.items()}


def stack_call(stages: int, schedule: str, microbatches: int):
  """A call running forward + backward of the pipelined layer stack on [M, rows, T, D] activations."""
  run = trainer.build(_config(stages, schedule, microbatches))
  model, p = run.model, run.pipeline_schedule
  params = trainer.init_state(run).params
  rows, t, d = _MICRO.value, run.config.data.seq_len, run.config.model.d_model
  x = jax.random.normal(jax.random.key(0), (microbatches, rows, t, d), jnp.float32)
  side = (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (microbatches, rows, t)),
          jnp.ones((microbatches, rows, t), jnp.int32))

  def loss(layers, x):
    module = model.bind(params)
    y = pipeline_lib.run(module.apply_layer, layers, model.logical_specs["layers"], x, side, p,
                         ("batch", "length", "embed"))
    return jnp.mean(y * y)

  with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params["layers"], x).compile()
  return lambda: compiled(params["layers"], x)


def bench_bubble(stages: int, repeats: int) -> list[dict]:
  schedule = "circular" if repeats > 1 else "gpipe"
  times = _alternated_medians({m: stack_call(stages, schedule, m) for m in (stages, 2 * stages, 4 * stages)})
  iterations = {m: pipeline_lib.Schedule(stages, repeats, m).iterations for m in times}
  per_iteration, fixed = np.polyfit([iterations[m] for m in times], list(times.values()), 1)
  out = []
  for m, total in times.items():
    formula = pipeline_lib.Schedule(stages, repeats, m).bubble
    out.append({"stages": stages, "repeats": repeats, "microbatches": m, "iterations": iterations[m],
                "time_s": total, "time_per_iteration_s": total / iterations[m], "fit_per_iteration_s": per_iteration,
                "fit_fixed_s": fixed, "bubble_measured": 1 - repeats * m * per_iteration / total,
                "bubble_formula": formula})
  return out


def bench_step(stages: int, schedule: str, microbatches: int) -> dict:
  """Median step time with the pipeline and without (fsdp over every device), alternated."""
  steps = {}
  for name, c in (("pipeline", _config(stages, schedule, microbatches)),
                  ("none", _config(1, "gpipe", microbatches))):
    if name == "none":
      c.train.microbatches = 1  # the same global batch in one pass: the unpipelined baseline
    run = trainer.build(c)
    compiled = trainer.compile_step(run)
    state = trainer.init_state(run)
    batch = data_lib.to_global(next(SyntheticSource(c.data.seq_len, c.model.vocab_size,
                                                    c.train.global_batch_size, seed=0)), run.batch_sharding)
    steps[name] = [compiled, state, batch, [], compiled.memory_analysis().temp_size_in_bytes]
  for name in steps:  # warm up
    compiled, state, batch, _, _ = steps[name]
    steps[name][1], _ = jax.block_until_ready(compiled(state, batch, np.bool_(False)))
  for _ in range(_REPS.value):
    for name in steps:
      compiled, state, batch, times, _ = steps[name]
      t = time.perf_counter()
      steps[name][1], m = compiled(state, batch, np.bool_(False))
      jax.block_until_ready(m)
      times.append(time.perf_counter() - t)
  med = {name: statistics.median(v[3]) for name, v in steps.items()}
  return {"stages": stages, "schedule": schedule, "microbatches": microbatches,
          "step_s_pipeline": med["pipeline"], "step_s_none": med["none"],
          "ratio": med["pipeline"] / med["none"], "temp_mib_pipeline": steps["pipeline"][4] / 2**20,
          "temp_mib_none": steps["none"][4] / 2**20}


def bench_memory() -> list[dict]:
  """Per-device temporaries of the compiled train step (compile only) for every schedule and M, S = 4."""
  rows = []
  for schedule in _MEMORY_SCHEDULES:
    for m in _MEMORY_MICROBATCHES:
      run = trainer.build(_config(_MEMORY_STAGES, schedule, m))
      p = run.pipeline_schedule
      mem = trainer.compile_step(run).memory_analysis()
      rows.append({"stages": p.stages, "schedule": schedule, "repeats": p.repeats, "microbatches": m,
                   "global_batch_size": run.config.train.global_batch_size, "temp_bytes": mem.temp_size_in_bytes,
                   "temp_mib": mem.temp_size_in_bytes / 2**20, "argument_bytes": mem.argument_size_in_bytes,
                   "output_bytes": mem.output_size_in_bytes, "in_flight": p.in_flight, "bubble": p.bubble})
  for r in rows:
    base = next(b for b in rows if b["schedule"] == r["schedule"] and b["microbatches"] == _MEMORY_MICROBATCHES[0])
    r["ratio_to_m8"] = r["temp_bytes"] / base["temp_bytes"]
  return rows


def memory_main() -> None:
  rows = bench_memory()
  config = _config(_MEMORY_STAGES, "gpipe", _MEMORY_MICROBATCHES[0])
  c, seq_len, fsdp = config.model, config.data.seq_len, jax.device_count() // _MEMORY_STAGES
  print(f"\nmemory, whole train step compiled (per-device temporaries), S={_MEMORY_STAGES}, fsdp {fsdp}, "
        f"{_MICRO.value} rows x {seq_len} tokens per microbatch, {c.num_layers} layers d{c.d_model}")
  print(f"{'schedule':>16} {'M':>4} {'temp MiB':>9} {'x M=8':>6} {'in_flight':>9} {'bubble':>7}")
  for r in rows:
    print(f"{r['schedule']:>16} {r['microbatches']:>4} {r['temp_mib']:>9.2f} {r['ratio_to_m8']:>6.3f} "
          f"{r['in_flight']:>9} {r['bubble']:>7.3f}")
  shape = {"num_layers": c.num_layers, "d_model": c.d_model, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
           "head_dim": c.head_dim, "mlp_dim": c.mlp_dim, "vocab_size": c.vocab_size, "seq_len": seq_len,
           "micro_rows": _MICRO.value, "stages": _MEMORY_STAGES, "fsdp": fsdp, "repeats": config.pipeline.repeats}
  print(f"\nwrote {_bench.write_json(_MEMORY_OUT.value, {'config': shape, 'memory': rows})}")


def bench_schedules(stages: int = 4, microbatches: int = 16) -> list[dict]:
  """Median step time of the whole train step for every schedule and without a pipeline (fsdp over every device),
  the same global batch, timed in alternation."""
  calls, temps = {}, {}
  for name in _MEMORY_SCHEDULES + ("none",):
    c = _config(1, "gpipe", 1) if name == "none" else _config(stages, name, microbatches)
    c.train.global_batch_size = microbatches * _MICRO.value
    run = trainer.build(c)
    compiled = trainer.compile_step(run)
    temps[name] = compiled.memory_analysis().temp_size_in_bytes
    holder = {"state": trainer.init_state(run)}
    batch = data_lib.to_global(next(SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size,
                                                    seed=0)), run.batch_sharding)

    def step(compiled=compiled, holder=holder, batch=batch):
      holder["state"], metrics = compiled(holder["state"], batch, np.bool_(False))
      return metrics
    calls[name] = step
  times = _alternated_medians(calls)
  return [{"stages": stages, "microbatches": microbatches, "schedule": name, "step_s": t,
           "ratio_to_gpipe": t / times["gpipe"], "ratio_to_none": t / times["none"], "temp_mib": temps[name] / 2**20}
          for name, t in times.items()]


def schedules_main() -> None:
  rows = bench_schedules()
  print(f"\nstep time, whole train step, S=4, M=16, {_MICRO.value} rows per microbatch, alternated medians of "
        f"{_REPS.value} (simulated CPU devices: a bubble computes on zeros, so every schedule pays it)")
  print(f"{'schedule':>16} {'step s':>8} {'x gpipe':>8} {'x none':>7} {'temp MiB':>9}")
  for r in rows:
    print(f"{r['schedule']:>16} {r['step_s']:>8.3f} {r['ratio_to_gpipe']:>8.3f} {r['ratio_to_none']:>7.3f} "
          f"{r['temp_mib']:>9.1f}")
  print(f"\nwrote {_bench.write_json(_SCHEDULES_OUT.value, {'schedules': rows})}")


def main(argv):
  del argv
  if _MEMORY_ONLY.value:
    memory_main()
    return
  if _SCHEDULES_ONLY.value:
    schedules_main()
    return
  stages = [int(s) for s in _STAGES.value]
  bubble = [row for s in stages for r in (1, 2) for row in bench_bubble(s, r)]
  print(f"\nbubble ({_MICRO.value} rows x 128 tokens per microbatch, 8 layers d128; layer stack fwd+bwd only)")
  print(f"{'S':>3} {'R':>3} {'M':>4} {'iters':>5} {'time s':>8} {'s/iter':>7} {'fit s/iter':>10} {'fixed s':>8} "
        f"{'measured':>9} {'formula':>8}")
  for b in bubble:
    print(f"{b['stages']:>3} {b['repeats']:>3} {b['microbatches']:>4} {b['iterations']:>5} {b['time_s']:>8.3f} "
          f"{b['time_per_iteration_s']:>7.3f} {b['fit_per_iteration_s']:>10.3f} {b['fit_fixed_s']:>8.3f} "
          f"{b['bubble_measured']:>9.3f} {b['bubble_formula']:>8.3f}")
  step = [bench_step(s, sched, 4 * s) for s in stages for sched in ("gpipe", "circular")]
  print("\nstep time, whole train step, pipeline vs none (fsdp over all devices), same global batch")
  print(f"{'S':>3} {'schedule':>9} {'M':>4} {'pipe s':>8} {'none s':>8} {'ratio':>6} {'temp MiB pipe/none':>19}")
  for r in step:
    print(f"{r['stages']:>3} {r['schedule']:>9} {r['microbatches']:>4} {r['step_s_pipeline']:>8.3f} "
          f"{r['step_s_none']:>8.3f} {r['ratio']:>6.2f} {r['temp_mib_pipeline']:>9.1f}/{r['temp_mib_none']:<9.1f}")
  print(f"\nwrote {_bench.write_json(_OUT.value, {'bubble': bubble, 'step': step})}")
  memory_main()
  schedules_main()


if __name__ == "__main__":
  app.run(main)

"""From a config to a trained model: lay out (:func:`jaxtrain.train.run.build`), compile, restore, then loop
(:class:`jaxtrain.train.loop.Loop`); and the dry run, which stops after the compile.

``trainer`` is the training API: ``build``, ``train``, ``dry_run`` and the pieces tests and tools compose.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any, Iterator

import jax
import ml_collections
import numpy as np
from absl import logging
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import data as data_lib
from jaxtrain import goodput
from jaxtrain import integrity
from jaxtrain import metrics as metrics_lib
from jaxtrain import sampling
from jaxtrain import sharding
from jaxtrain import topology
from jaxtrain import workdir as workdir_lib
from jaxtrain.models import attention as attention_lib
from jaxtrain.train import hooks as hooks_lib
from jaxtrain.train import loop as loop_lib
from jaxtrain.train import objectives
from jaxtrain.train import start
from jaxtrain.train.start import init_state  # noqa: F401 - trainer.init_state: the API tests and tools use
from jaxtrain.train import state as state_lib
from jaxtrain.train.loop import TrainingStopped  # noqa: F401 - main catches trainer.TrainingStopped
from jaxtrain.train.run import Run, build, report  # noqa: F401 - trainer.build is the public name
from jaxtrain.train.state import TrainState


def compile_step(run: Run, train_step=None, extra: tuple = ()):
  """The jitted, donated, sharded train step compiled for this run's shapes (one compile): ``train_step``, by
  default the run's objective's (``train.objective``, :mod:`jaxtrain.train.objectives`), called as
  ``(state, batch, skip, *extra)``; ``extra``: shapes (with their shardings) of arguments an objective's step
  takes besides (a frozen reference model's params), never donated."""
  objective = objectives.of(run.config)
  train_step = train_step or objective.make_train_step(run)
  extra = extra or objective.abstract_extra(run)
  batch = objective.abstract_batch(run)
  replicated = NamedSharding(run.mesh, P())
  shardings_of = lambda tree: jax.tree.map(lambda a: a.sharding, tree)  # noqa: E731
  jitted = jax.jit(train_step, in_shardings=(run.state_shardings, shardings_of(batch), replicated,
                                             *map(shardings_of, extra)),
                   out_shardings=(run.state_shardings, replicated), donate_argnums=0)
  with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
    return jitted.lower(run.abstract_state(sharded=False), batch, jax.ShapeDtypeStruct((), np.bool_),
                        *extra).compile()


def write_config(config: ml_collections.ConfigDict) -> None:
  """``config.json`` (every start), and at the first start the run's lineage and its Hugging Face side files
  (jaxtrain.checkpoint.lineage), on process 0."""
  workdir = epath.Path(config.workdir)
  if jax.process_index() == 0:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
    checkpoint_lib.lineage.record(json.loads(config.to_json_best_effort()), data_lib.read_folders(config))


def make_checkpointer(config: ml_collections.ConfigDict) -> checkpoint_lib.Checkpointer:
  """The run's checkpointer over the tiers of ``checkpoint.tiers``."""
  return checkpoint_lib.Checkpointer.from_config(config)


def restore_or_init(run: Run, checkpointer: checkpoint_lib.Checkpointer, data) -> tuple[TrainState, dict]:
  """This run's newest good checkpoint in any tier (:meth:`jaxtrain.checkpoint.Checkpointer.restore`: onto the
  current mesh, with the data position), else the run's starting state (:func:`jaxtrain.train.start.starting_state`:
  a fresh init, optionally another run's checkpoint, ``checkpoint.restore_from``)."""
  abstract = run.abstract_state()
  restored = checkpointer.restore(abstract, data)
  if restored is not None:
    state, meta, where = restored
    logging.info("resumed from checkpoint step %d (%s)", int(state.step), where)
    changed = loop_lib.RunMeta.now(run, None).layout_changes(meta)
    if changed:
      logging.info("resumed on another layout: %s; the global batch stays %d rows", ", ".join(changed),
                   run.config.train.global_batch_size)
    return state, meta
  return start.starting_state(run), {}

def dry_run(config: ml_collections.ConfigDict, devices=None) -> dict[str, Any]:
  """Validates, lays out and compiles the step without allocating or training; reports per-device memory
  (from the compiled program) and FLOPs, and whether it fits where the device capacity is known. With
  ``dry_run_topology`` the step is compiled for that TPU topology's chips (jaxtrain.topology), on any host."""
  target = config.get("dry_run_topology", "")
  if target:
    topology.validate(config)  # before any TPU call: a bad name or a missing libtpu is one line
    devices = topology.devices(target)
  run = build(config, devices)
  config = run.config
  info = report(run)
  t = time.perf_counter()
  tokens = config.train.global_batch_size * config.data.seq_len
  info["flops_per_token"] = metrics_lib.flops_per_token(run.model, config.data.seq_len)
  info["flops_per_step_per_device"] = info["flops_per_token"] * tokens / run.mesh.size
  try:
    with attention_lib.compiling_for("tpu") if target else contextlib.nullcontext():
      step_fn = compile_step(run)
  except jax.errors.JaxRuntimeError as e:
    # The TPU compiler refuses a program larger than the chip's HBM: that is the dry run's answer, not a crash.
    found = re.search(r"Ran out of memory.*?required for (.+?) \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)",
                      str(e))
    if "RESOURCE_EXHAUSTED" not in str(e) or not found:
      raise
    info.update(compile_s=time.perf_counter() - t, fits=False, needs=found.group(1),
                needs_bytes=int(float(found.group(2)) * 2**30),
                device_capacity_bytes=int(float(found.group(3)) * 2**30), **({"topology": target} if target else {}))
    logging.info("dry run: DOES NOT FIT: the %s alone need %s GiB per device, the chip has %s GiB (the compiler's "
                 "verdict) | %.3g FLOPs/token", found.group(1), found.group(2), found.group(3), info["flops_per_token"])
    print(json.dumps({k: v for k, v in info.items() if k != "replicated"}))
    return info
  info["compile_s"] = time.perf_counter() - t
  mem = step_fn.memory_analysis()
  per_device = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp", "alias")}
  # The state's arrays in host memory (optim.offload_state): the TPU compiler counts them apart (host_argument_size);
  # the CPU backend counts them among the device's arguments, outputs and donated buffers: taken out here.
  host = {k: int(getattr(mem, f"host_{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp", "alias")}
  offloaded = state_lib.host_bytes(run.abstract_state(), run.state_shardings)
  if offloaded and not host["argument"]:
    for k in ("argument", "output", "alias"):
      per_device[k] -= offloaded
      host[k] += offloaded
  info["memory_per_device"] = per_device
  info["host_memory_per_device"] = host
  # Host memory the program uses besides (activations an offloading remat policy keeps there).
  info["host_bytes_per_device"] = host["temp"]
  if attention_lib.target_platform() == "tpu" or target:
    # The TPU compiler reports its heap's peak (temporaries reuse memory over the program; arguments included):
    # its own verdict. Its temp_size counts the temporaries without that reuse (llama3_8b at 8k: 1.4 x the peak).
    info["peak_bytes_per_device"] = int(mem.peak_memory_in_bytes)
  else:  # CPU and GPU: every argument, output and temporary buffer, less the donated (updated in place)
    info["peak_bytes_per_device"] = per_device["argument"] + per_device["output"] + per_device["temp"] - \
        per_device["alias"]
  try:
    capacity = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
  except Exception:  # noqa: BLE001 - backends without memory stats
    capacity = None
  if target:
    capacity = topology.hbm_bytes(target)
    info["topology"], info["device_kind"] = target, run.mesh.devices.flat[0].device_kind
  info["device_capacity_bytes"] = capacity
  info["fits"] = None if not capacity else info["peak_bytes_per_device"] <= capacity
  mib = 2**20
  verdict = ("fit unknown (this backend does not report device memory)" if not capacity else
             f"{'fits' if info['peak_bytes_per_device'] <= capacity else 'DOES NOT FIT'} in "
             f"{capacity / mib:,.0f} MiB per device")
  logging.info("dry run: compiled in %.1fs | per device: arguments %.1f MiB, outputs %.1f MiB, temporaries %.1f MiB, "
               "donated %.1f MiB -> peak %.1f MiB; %s | host: arguments %.1f MiB, temporaries %.1f MiB | %.3g FLOPs/token, "
               "%.3g FLOPs/step/device",
               info["compile_s"], per_device["argument"] / mib, per_device["output"] / mib, per_device["temp"] / mib,
               per_device["alias"] / mib, info["peak_bytes_per_device"] / mib, verdict, host["argument"] / mib,
               host["temp"] / mib, info["flops_per_token"], info["flops_per_step_per_device"])
  print(json.dumps({k: v for k, v in info.items() if k != "replicated"}))
  return info


def train(config: ml_collections.ConfigDict, devices=None, data: Iterator[dict] | None = None):
  """Runs (or resumes) training to ``config.train.steps``. Returns the final state and the logged metrics;
  ``(None, [])`` if the workdir's newest checkpoint is already at ``train.steps`` (nothing is compiled)."""
  run = build(config, devices)
  config = run.config
  data = data if data is not None else objectives.of(config).open_train(config)
  try:
    # Nothing in the workdir is touched before this.
    with workdir_lib.hold(config.workdir, lease_s=config.workdir_lease_s):
      checkpointer = make_checkpointer(config)
      try:
        if _already_done(run, checkpointer):
          return None, []
        return _train(run, data, checkpointer)
      finally:
        checkpointer.close()
  finally:
    data_lib.close(data)


def _already_done(run: Run, checkpointer: checkpoint_lib.Checkpointer) -> bool:
  """True (and says so) when the newest checkpoint is at or past ``train.steps``: a re-run of a finished run.
  A checkpoint of another model still fails clearly (metadata only, no tensor is read)."""
  steps = checkpointer.steps()
  target = run.config.train.steps
  if not steps or steps[-1] < target:
    return False
  checkpointer.persistent.check_compatible(steps[-1], run.abstract_state(sharded=False))
  logging.info("%s is already at step %d (train.steps=%d): nothing to train. To train longer, run the same "
               "command with --config.train.steps=N for some N > %d (the run resumes from step %d)",
               run.config.workdir, steps[-1], target, steps[-1], steps[-1])
  return True


def _train(run: Run, data: Iterator[dict], checkpointer: checkpoint_lib.Checkpointer):
  """Compiles, restores (or initializes) and runs the loop."""
  config = run.config
  recorder = goodput.Recorder(config.workdir)
  recorder.start()
  try:
    return _compile_restore_and_loop(run, data, checkpointer, recorder)
  except BaseException as e:
    # A start that stops before its loop ends (a restore the store did not answer) names why, as the loop's end does
    # (goodput's account of the interruptions; the loop's own end was recorded first, if it ran).
    recorder.end(None, cause=loop_lib.stop_cause(e), summarize=False)
    raise


def _compile_restore_and_loop(run: Run, data: Iterator[dict], checkpointer: checkpoint_lib.Checkpointer,
                              recorder: goodput.Recorder):
  config = run.config
  write_config(config)
  report(run)
  t0 = time.perf_counter()
  step_fn = objectives.of(config).step_fn(run, compile_step)
  try:
    # Fingerprints and finiteness of a state about to be saved (jaxtrain.integrity), compiled now so that the
    # first save does not wait for a compile.
    summarize = None
    if checkpointer.verify:
      summarize = jax.jit(integrity.summary).lower(run.abstract_state())
      summarize = summarize.compile()
    t = time.perf_counter()
    state, meta = restore_or_init(run, checkpointer, data)
    restore_s = time.perf_counter() - t if meta else 0.0  # a fresh state's init is start-up
    evaluate = make_evaluator(run) if config.eval.every_steps else None
    sample = sampling.Sampler(run) if config.train.sample_every else None  # compiled once, here
    hooks = hooks_lib.standard(run, evaluate, sample, recorder, restore_s)
    logging.info("compiled and initialized in %.1fs", time.perf_counter() - t0)
    return loop_lib.Loop(run, data, checkpointer, step_fn, summarize, state, meta, hooks, goodput=recorder).run()
  finally:
    # What the objective's step function holds beyond the run (GRPO's reward pool: its processes), released
    # whatever ended the run.
    close = getattr(step_fn, "close", None)
    if close is not None:
      close()


def make_evaluator(run: Run):
  """``params -> fetch``: the run's objective's evaluation (the language model's: eval loss and perplexity over
  every eval set, :meth:`jaxtrain.train.objectives.lm.LanguageModel.make_evaluator`), or None when it has none."""
  return objectives.of(run.config).make_evaluator(run)

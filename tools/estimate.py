"""Estimate per-device memory and per-step communication for a config and mesh, without any devices.

  python tools/estimate.py --config=configs/llama3_8b.py --devices=256 [--set=mesh.tensor=4 ...] [--json]
      [--platform=tpu|gpu|cpu]  (what model.attention=auto resolves to; default tpu)

Shapes and shardings come from the model and the sharding rules exactly as training lays them out; sizes are
then arithmetic over the mesh (no arrays are created, no program is compiled). Assumptions, printed too:
- params and gradients float32; the optimizer state is that of optim.name (jaxtrain.optim) for the params,
  laid out as training lays it out (jaxtrain/train/state.py: moments sharded like their params, factored
  moments like their params less the factored dim, counters replicated); AdamW: two float32 moments (2 x
  params) plus its int32 step counters; the train state adds one int32 step counter; with LoRA
  (model.lora.rank > 0) the optimizer state covers the adapters only, and the gradients are the adapters' plus
  the full gradient of every targeted kernel (the forward runs on merged weights: jaxtrain/models/lora.py);
- optim.offload_state: the optimizer state's arrays (not its scalars) in host memory, out of the device's total;
  each step moves them to the device and back after the backward pass, priced at the host link of --chip
  (jaxtrain/topology.py HOST_BYTES_PER_S, an assumed 16 GB/s a direction): an elementwise optimizer's (adamw, lion)
  streamed a layer at a time (jaxtrain/train/offload.py), twice to the device (the finiteness guard's pass and the
  update's) and once back, both directions at once, the layers' small updates hidden under the copies, the device
  holding one layer's state (or the other params') old and new; any other optimizer's whole, once each way, the
  device holding all of it twice during the update. The total is the larger of the backward pass's and that
  update's (params + grads + the state on the device);
- optimizer FLOPs per step (jaxtrain.optim.update_flops; adamw and muon): Muon's Newton-Schulz iterations per
  weight matrix (one per layer and expert; 5 steps of X <- c0 X + (c1 A + c2 A A) X, A = X X^T, for an m x n
  matrix with m <= n: 4 m^2 n + 2 m^3 matmul FLOPs a step, plus 3 m^2 + 2 m n elementwise) and the elementwise
  work of the moments, clipping and weight decay (AdamW 12 a param, Muon 13, clipping 5, decay 2); per device,
  each param's count over its shards (the update runs where the param's shards are, the partitioner splitting
  the matmuls as evenly); beside it the model's training FLOPs per step per device (the family's count);
- activations, the largest transient and the tensor- and context-parallel traffic are the model family's estimate
  (Family.activation_estimate; a family without one: not estimated). Llama's: activations per device, kept for
  the backward pass, per layer (b = local batch rows per microbatch, t = seq_len / mesh context (local tokens), T
  = seq_len, d = d_model, f = mlp_dim, h = heads x head_dim, kv = kv_heads x head_dim, in the compute dtype):
  remat=full: the layer input b*t*d; save_dots: + the matmul outputs the backward reads b*t*(h + 2 kv + d + 2 f);
  the policies that keep tagged projections by name (jaxtrain.models.ACTIVATION_NAMES) add theirs: save_qkv_proj
  b*t*(h + 2 kv), save_out_proj b*t*d, minimal all of save_dots' (down's output is read by no backward); the
  offload_* policies keep the same in host memory (reported apart) and only the layer input on the device
  (offload_full: the layer input in host memory, nothing on the device but one layer's transients);
  none: + the elementwise intermediates ~ b*t*(4 d + 3 f) and what the attention backend saves (xla: the
  probabilities heads*b*t*T). The transient on top is the larger of two phases': the head's (the logits and their
  gradient, b*t*vocab each in the compute dtype, and the full float32 gradient of the output projection, vocab*d,
  before its reduce-scatter; under FSDP the embedding's gradient stays in each device's slice of the table) and
  one layer's backward (the attention backend's transient, jaxtrain/models/attention.py
  MEMORY: xla heads*b*t*T*(4 + 2 x itemsize), blockwise 16*heads*b*t*block, splash ~0; plus two layers' weights
  gathered in the compute dtype).
  Activations shrink with tensor parallelism for h, kv, f, vocab, and with context parallelism for t.
  total = params + grads + optimizer + activations + transient: the peak the TPU compiler reports, within 15%
  (tests/test_tpu_compile.py; llama3_8b at 8k on v5p: docs/multihost.md).
- communication per step (bytes sent per device, ring algorithms): fsdp: all-gather of the params in forward
  and again in backward, reduce-scatter of the grads (each (n-1)/n x the fsdp-sharded bytes); data: all-reduce
  of the grads (2 (n-1)/n x their size on the device); tensor: 2 all-reduces per layer forward and 2 backward
  of b*t*d activations (2 (n-1)/n each); context: per layer an all-gather of the keys and values b*T*2 kv, again
  in the backward's recompute (remat) and a reduce-scatter of their gradients ((n-1)/n each); DCN axes multiply
  the same volumes over the slow links.
- Mixture-of-Experts (a model with ``experts``-sharded params, e.g. model.name=moe): the expert weights per
  device are the float32 shards of those leaves (E / ep experts a device, ep = the mesh axes ``experts`` maps to,
  their other dims sharded as the rules say; in compute they are gathered over fsdp one layer at a time);
  expert: the gradients of the params not sharded over ``expert`` are all-reduced over it (2 (n-1)/n, as data:
  for those layers it is a batch axis); all-to-all (jaxtrain/parallel/experts.py all_to_all_bytes): per MoE layer
  and microbatch dispatch + return forward and their transposes backward, 4 all-to-alls of one buffer each, 6
  when remat is not none (the backward reruns the forward's two); a buffer (S = local tokens x k assignments,
  in the compute dtype) is ep*S*d for dropless (room for all S per destination: ep x the S*d really needed, plus
  the int32 expert ids ep*S in each forward) and E*C*d for capacity (C = ceil(capacity_factor S / E)); (ep-1)/ep
  of each leaves the device. Times the MoE layers a device runs (their share of a pipeline) and the microbatches.
  The activations count the k routed experts' hidden width per token (f = k x expert_mlp_dim + shared); the
  routed experts' matmuls carry the expert dimension as a batch dimension, so save_dots keeps only the
  attention's, the shared experts' and the router's outputs (the router logits in float32).
- pipeline parallelism (S = mesh.pipeline x dcn_pipeline stages > 1; jaxtrain/parallel/pipeline.py): the schedule
  (pipeline.schedule, R = pipeline.repeats virtual stages, M = train.microbatches, 0: S) as training validates it;
  a unit is L / (S R) layers on one microbatch. The activations a device keeps are a stash of stage inputs, b*t*d
  each, plus one unit's activations (the family's estimate for those layers, remat policy as above) while its
  backward runs: gpipe / circular: R M + S - 1 stage inputs (autodiff of the stage loop keeps every iteration's)
  and the loop's [M, b, t, d] buffer and the embedded batch, M*b*t*d each: growing with M; 1f1b /
  interleaved_1f1b: the min(2 R S - 1, R M) units in flight and a spare slot, and no [M, ...] buffer: flat in M.
  Host-offloaded activations are one unit's too; tensor and context traffic that of the L / S layers a device
  runs, for each of the M microbatches.
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain import mesh as mesh_lib  # noqa: E402
from jaxtrain import models, optim, sharding, topology  # noqa: E402
from jaxtrain.errors import ConfigError  # noqa: E402
from jaxtrain.models import attention, lora  # noqa: E402
from jaxtrain.parallel import experts  # noqa: E402
from jaxtrain.parallel import pipeline as pipeline_lib  # noqa: E402
from jaxtrain.train import offload as offload_lib  # noqa: E402
from jaxtrain.train import state as state_lib  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/tiny.py", "Config file.")
_DEVICES = flags.DEFINE_integer("devices", 8, "Total devices of the target job.")
_SLICES = flags.DEFINE_integer("slices", 1, "Slices (or processes) the DCN axes span.")
_SET = flags.DEFINE_multi_string("set", [], "key=value overrides, e.g. mesh.tensor=4.")
_JSON = flags.DEFINE_bool("json", False, "Print JSON.")
_CHIP = flags.DEFINE_enum("chip", "v5p", sorted(topology.HOST_BYTES_PER_S), "The TPU generation whose host link "
                          "prices an offloaded optimizer state's transfers (optim.offload_state).")
_PLATFORM = flags.DEFINE_enum("platform", "tpu", ["tpu", "gpu", "cpu"], "Where it runs: what model.attention=auto "
                              "resolves to.")


load_config = config_lib.load_file  # (the name the tests and tools/bench_* call it by)


def _nbytes(tree) -> int:
  return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def estimate(config, devices: int, slices: int = 1, platform: str = "tpu", chip: str = "v5p") -> dict:
  ici, dcn = mesh_lib.mesh_shape(config.mesh, devices, slices)
  mesh = {a: ici[a] * dcn[a] for a in mesh_lib.MESH_AXES}
  rules = sharding.rules_from_config(config.sharding)
  model = models.Model.from_config(config.model)
  stages = mesh["pipeline"]  # (ICI x DCN)
  schedule = None
  if stages > 1:  # the schedule training runs (jaxtrain/train/run.py), validated as it validates it
    why = model.why_not_stageable()
    if why:
      raise ConfigError("mesh.pipeline", f"model '{config.model.name}' cannot be split into pipeline stages: {why}",
                        "set mesh.pipeline=1 and dcn_pipeline=1, or give the model those parts (see jaxtrain/models)")
    schedule = pipeline_lib.schedule_from_config(config, stages, model.num_layers())
  specs = jax.tree.leaves(model.logical_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  leaves = jax.tree.leaves(model.abstract_params)
  shards = [jax.ShapeDtypeStruct(sharding.shard_shape(a.shape, s, rules, mesh), a.dtype)
            for a, s in zip(leaves, specs, strict=True)]
  params = _nbytes(shards)
  # The optimizer's state for the full params (its shapes may depend on the full shapes: Adafactor factors dims
  # >= 128), laid out by the training run's own rule (train/state.py) on an abstract mesh of these sizes.
  # (LoRA: the adapters' state only; Muon: the logical axes tell an expert kernel's experts from its matrix)
  tx = optim.make(config.optim, config.train.steps, model.trainable_mask(), model.logical_specs, model.balance())
  # optim.offload_state: the moments laid out in host memory as training lays them out.
  offload = bool(config.optim.get("offload_state"))
  layout = state_lib.shardings(model, tx, jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh)), rules,
                               offload=offload)
  opt_shapes = jax.eval_shape(tx.init, model.abstract_params)
  optimizer = sharding.shard_bytes(opt_shapes, layout.opt_state)
  host_optimizer = state_lib.host_bytes(opt_shapes, layout.opt_state)
  grads = params
  if model.lora:  # gradients of the adapters, and the full gradient of each merged (targeted) kernel
    trained = model.split_trainable(model.abstract_params)[0]
    grads = sharding.shard_bytes(trained, model.split_trainable(layout.params)[0])
    targets = lora.targets(model.split_trainable(model.abstract_params)[1],
                           model.split_trainable(model.logical_specs)[1], model.lora)
    grads += _nbytes([jax.ShapeDtypeStruct(sharding.shard_shape(a.shape, jax.sharding.PartitionSpec(*s), rules,
                                                                 mesh), a.dtype) for a, s in targets.values()])
  flops = optim.update_flops(config.optim, model.abstract_params, model.trainable_mask(), model.logical_specs,
                             model.balance())
  opt_flops = None if flops is None else sum(
      f * math.prod(s.shape) / math.prod(a.shape) for f, a, s in zip(jax.tree.leaves(flops), leaves, shards,
                                                                      strict=True))
  state = params + optimizer - host_optimizer + 4  # + the train state's int32 step counter; the device's part
  m, t = config.model, config.train
  microbatches = schedule.microbatches if schedule else (t.microbatches or 1)
  b = t.global_batch_size // microbatches // sharding.batch_shards(mesh, rules)[1]
  # Activations and tensor-parallel traffic depend on the architecture: the family's own estimate, if it has one.
  family = model.family.activation_estimate
  if m.attention == "auto":  # what auto runs on the target platform
    m = m.copy_and_resolve_references()
    m.attention = attention.resolve("auto", platform, config.data.seq_len, mesh["context"], m.dtype,
                                    bool(m.get("attn_softcap")), bool(m.get("attention_sinks")))
  per_family = family(m, b, config.data.seq_len, mesh["tensor"], mesh["context"]) if family else None
  activations = per_family["activation_bytes"] if per_family else None
  transient = per_family["transient_bytes"] if per_family else None
  host = per_family.get("host_activation_bytes", 0) if per_family else None
  pipe = None
  if schedule:  # a device keeps its stash of stage inputs and one unit's (L / (S R) layers') activations
    layers = model.num_layers()
    unit_layers = layers // (schedule.stages * schedule.repeats)
    one = b * (config.data.seq_len // mesh["context"]) * m.d_model * jax.numpy.dtype(m.dtype).itemsize
    stash = (schedule.in_flight + 1) * one if schedule.scheduled_backward else \
        (schedule.iterations + 2 * schedule.microbatches) * one  # + the [M, b, t, d] loop buffer and embedded batch
    unit = activations * unit_layers // layers if per_family else None
    pipe = {"schedule": schedule.kind, "stages": schedule.stages, "repeats": schedule.repeats,
            "microbatches": schedule.microbatches, "bubble": schedule.bubble, "in_flight": schedule.in_flight,
            "layers_per_unit": unit_layers, "stash_bytes": stash, "unit_activation_bytes": unit}
    activations = stash + unit if per_family else None
    host = host * unit_layers // layers if per_family else None
  full_params = 4 * model.num_params()
  comm = {}
  for axis in mesh_lib.MESH_AXES:
    n = mesh[axis]
    if n == 1:
      continue
    if axis == "fsdp":
      comm[axis] = 3 * (n - 1) / n * params * n  # gather fwd + gather bwd + reduce-scatter, of the full shard
    elif axis == "data":
      comm[axis] = 2 * (n - 1) / n * params
    elif axis == "tensor" and per_family:
      comm[axis] = 2 * (n - 1) / n * per_family["tensor_allreduce_bytes"] * microbatches / stages
    elif axis == "context" and per_family:  # keys and values all-gathered (and their gradients reduce-scattered)
      comm[axis] = (n - 1) / n * per_family["context_allgather_bytes"] * microbatches / stages
    elif axis == "expert":  # a batch axis for the params not sharded over it: their grads are all-reduced
      comm[axis] = 2 * (n - 1) / n * sum(_nbytes([a]) for a, s in zip(shards, specs, strict=True)
                                         if "expert" not in _mesh_axes(s, rules))
  moe = _moe(config, mesh, rules, shards, specs, b, microbatches)
  if moe and moe["all_to_all"]["ep"] > 1:
    comm["expert_all_to_all"] = moe["all_to_all"]["sent_bytes_per_step"]
  offloaded, update_phase = None, None
  if host_optimizer:
    # Each step: every moment to the device and back, after the backward pass. Streamed (an elementwise optimizer,
    # jaxtrain/train/offload.py): a layer's moments at a time, twice towards the device (the guard's pass, then the
    # update's) and once back, the two directions at once; the device holds one layer's (or the other params')
    # state, old and new. Whole (any other optimizer): once each way, and the device holds the whole state twice.
    rate = topology.host_bytes_per_s(chip)
    streamed = offload_lib.plan(tx, model, model.abstract_params, opt_shapes, layout.opt_state)
    moved = [(a, s) for a, s in zip(jax.tree.leaves(opt_shapes), jax.tree.leaves(layout.opt_state), strict=True)
             if s.memory_kind == state_lib.HOST]
    if streamed is not None:
      groups = [g for g, s in zip(streamed.state, jax.tree.leaves(layout.opt_state)) if s.memory_kind == state_lib.HOST]
      per_layer = sum(sharding.shard_bytes([a], [s]) // g for (a, s), g in zip(moved, groups) if g is not None)
      rest = sum(sharding.shard_bytes([a], [s]) for (a, s), g in zip(moved, groups) if g is None)
      on_device, towards = 2 * max(per_layer, rest), 2 * host_optimizer
    else:
      on_device, towards = 2 * host_optimizer, host_optimizer
    update_phase = state + grads + on_device
    offloaded = {"host_bytes": host_optimizer, "streamed": streamed is not None,
                 "transfer_bytes_per_step": towards + host_optimizer, "update_device_bytes": on_device,
                 "chip": chip, "host_bytes_per_s": rate, "transfer_seconds_per_step": towards / rate}
  extra = {**({"moe": moe} if moe else {}), **({"pipeline": pipe} if pipe else {}),
           **({"offload": offloaded} if offloaded else {})}
  return {
      "mesh": mesh, "devices": devices, "params": model.num_params(), "local_batch_rows": b,
      "bytes_per_device": {"params": params, "grads": grads, "optimizer": optimizer - host_optimizer,
                           "activations": activations, "transient": transient,
                           # the larger of the backward's phase and (an offloaded state) the update's
                           "total": max(state + grads + (activations or 0) + (transient or 0), update_phase or 0)},
      # The whole train state (params, optimizer state, step counter): what the compiled step takes as
      # arguments besides the batch, to the byte.
      # Offloading remat policies (model.remat=offload_*) keep these activations in host memory instead.
      "host_activation_bytes_per_device": host,
      "params_plus_optimizer_per_device": state, "full_param_bytes": full_params,
      "comm_bytes_per_step_per_device": comm,
      "optimizer_flops_per_step_per_device": opt_flops,
      "model_flops_per_step_per_device": model.flops_per_token(config.data.seq_len) * t.global_batch_size
      * config.data.seq_len / devices, **extra,
  }


def _mesh_axes(logical, rules) -> set[str]:
  return {a for entry in sharding.logical_to_mesh_spec(logical, rules) if entry is not None
          for a in ((entry,) if isinstance(entry, str) else entry)}


def _moe(config, mesh: dict[str, int], rules, shards, specs, rows: int, microbatches: int) -> dict | None:
  """Expert weights per device and all-to-all traffic, for a model with ``experts``-sharded params (else None)."""
  is_expert = ["experts" in tuple(s) for s in specs]
  if not any(is_expert):
    return None
  m = config.model
  ep = math.prod(mesh[a] for a in _mesh_axes(jax.sharding.PartitionSpec("experts"), rules))
  stages = mesh["pipeline"]
  moe_layers = (m.num_layers - m.get("first_dense_layers", 0)) // stages  # (GPT-OSS has no dense layers)
  itemsize = jax.numpy.dtype(m.dtype).itemsize
  tp = math.prod(mesh[a] for a in _mesh_axes(jax.sharding.PartitionSpec("expert_mlp"), rules))
  a2a = experts.all_to_all_bytes(m, rows * config.data.seq_len, ep, itemsize, microbatches=microbatches,
                                 moe_layers=moe_layers)
  return {"num_experts": m.num_experts, "experts_per_device": m.num_experts // ep,
          "expert_weight_bytes_per_device": _nbytes([a for a, e in zip(shards, is_expert) if e]),
          # One MoE layer's experts as the shard_map computes with them: gathered over fsdp, in the compute dtype.
          "expert_weight_bytes_gathered_per_layer": m.num_experts // ep * 3 * m.d_model * m.expert_mlp_dim // tp
          * itemsize,
          "all_to_all": a2a}


def main(argv):
  del argv
  config = load_config(_CONFIG.value, _SET.value)
  try:
    info = estimate(config, _DEVICES.value, _SLICES.value, _PLATFORM.value, _CHIP.value)
  except config_lib.UserError as e:
    print(f"estimate: error: {e}", file=sys.stderr)
    sys.exit(2)
  if _JSON.value:
    print(json.dumps(info, indent=2))
    return
  gib = 2**30
  print(__doc__.split("Assumptions, printed too:")[1].strip())
  print(f"\n{_CONFIG.value}: {info['params']:,} params on mesh {info['mesh']} ({info['local_batch_rows']} rows "
        f"per device per microbatch)")
  for k, v in info["bytes_per_device"].items():
    print(f"  {k:<12} {v / gib:10.3f} GiB per device" if v is not None else
          f"  {k:<12} not estimated (model family '{config.model.name}' has no activation_estimate)")
  if "pipeline" in info:
    p = info["pipeline"]
    unit = (f"{p['unit_activation_bytes'] / gib:.3f} GiB" if p["unit_activation_bytes"] is not None else
            "not estimated")
    kept = (f"{p['in_flight']} units in flight + a spare slot" if p["schedule"] in pipeline_lib.SCHEDULED_BACKWARD
            else f"{p['in_flight']} iterations' + 2 x {p['microbatches']} microbatches' buffers")
    print(f"  {'pipeline':<12} {p['schedule']}: {p['stages']} stages x {p['repeats']} repeats, {p['microbatches']} "
          f"microbatches, bubble {p['bubble']:.1%}; activations: stage inputs ({kept}) "
          f"{p['stash_bytes'] / gib:.3f} GiB + one unit's ({p['layers_per_unit']} layers) {unit}")
  if "offload" in info:
    o = info["offload"]
    how = ("streamed a layer at a time: twice to the device, once back" if o["streamed"] else
           "the whole state at once (not an elementwise optimizer)")
    print(f"  {'host':<12} {o['host_bytes'] / gib:10.3f} GiB per device of optimizer state in host memory "
          f"(optim.offload_state; not in the device's total): {o['transfer_bytes_per_step'] / gib:.3f} GiB moved "
          f"per step ({how}), {o['transfer_seconds_per_step']:.3f} s at {o['host_bytes_per_s'] / 1e9:.0f} GB/s a "
          f"direction ({o['chip']}, assumed: jaxtrain/topology.py HOST_BYTES_PER_S), after the backward pass; "
          f"{o['update_device_bytes'] / gib:.3f} GiB of it on the device during the update")
  if info["host_activation_bytes_per_device"]:
    print(f"  {'host':<12} {info['host_activation_bytes_per_device'] / gib:10.3f} GiB per device of activations "
          f"offloaded to host memory (model.remat={config.model.remat})")
  model_flops, opt_flops = info["model_flops_per_step_per_device"], info["optimizer_flops_per_step_per_device"]
  print(f"  flops        {model_flops / 1e12:10.3f} TFLOP per step per device (the model's, training)")
  print(f"  {'optimizer':<12} {opt_flops / 1e12:10.3f} TFLOP per step per device ({opt_flops / model_flops:.2%} of "
        f"the model's)" if opt_flops is not None else
        f"  {'optimizer':<12} FLOPs not estimated (optim.name={config.optim.name}: adamw and muon are)")
  for axis, v in info["comm_bytes_per_step_per_device"].items():
    print(f"  comm {axis:<7} {v / gib:10.3f} GiB per step per device")
  if "moe" in info:
    moe, a2a = info["moe"], info["moe"]["all_to_all"]
    mib = 2**20
    print(f"  experts      {moe['experts_per_device']} of {moe['num_experts']} per device (ep={a2a['ep']}), "
          f"{moe['expert_weight_bytes_per_device'] / gib:.3f} GiB of expert weights (float32 shards); "
          f"{moe['expert_weight_bytes_gathered_per_layer'] / mib:.1f} MiB per layer gathered for compute")
    if a2a["ep"] > 1:
      cap = f", capacity {a2a['capacity']} slots per expert" if a2a["capacity"] else ""
      print(f"  all-to-all   {a2a['mode']}: S={a2a['assignments']:,} assignments per device{cap}; one buffer "
            f"{a2a['buffer_bytes'] / mib:.1f} MiB (each assignment once: {a2a['ideal_bytes'] / mib:.1f} MiB), "
            f"{a2a['per_layer']} per layer x {a2a['moe_layers']} MoE layers x {a2a['microbatches']} microbatches")
      print(f"               {a2a['buffer_bytes_per_step'] / gib:.3f} GiB of buffers per step per device, "
            f"{a2a['sent_bytes_per_step'] / gib:.3f} GiB of it sent off the device")
    else:
      print("  all-to-all   none (ep = 1: every device holds every expert)")


if __name__ == "__main__":
  app.run(main)

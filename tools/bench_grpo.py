"""GRPO's time split between rollout and update: measured on the CPU mesh, and on the TPU compiler's own account.

  python tools/bench_grpo.py [--steps=12] [--mesh=1,1,1] [--max_new_tokens=16]
      [--topologies=v5p:4x4x4] [--tpu_config=configs/llama3_8b.py] [--out=benchmarks/results/grpo.json]

CPU: configs/tiny.py's model (random params: the time does not depend on their values) trains ``--steps`` GRPO steps
on arithmetic prompts (tools/arithmetic_prompts.py; 64 completions a step, 8 per prompt, ``--max_new_tokens`` new
tokens each) on the ``--mesh=data,fsdp,tensor`` devices (8 simulated CPU devices exist); per step (the median over
the steps after the first two) the loop logs ``rl/rollout_s`` (prefill, the decode loop, the completions on the host)
and ``rl/update_s`` (the training rows built, the policy's and the reference's log-probabilities, the update), and the
rollout's share of the two.

TPU (``--topologies``, needs libtpu; empty: skipped): ``--tpu_config``'s model (Llama 3 8B) as a GRPO run of
``--tpu_rows`` completions of ``--tpu_seq_len`` tokens (``--tpu_new_tokens`` of them sampled), compiled for each
topology with no TPU attached (as tools/bench_tpu.py): the rollout's decode step (one new token for every row, KV
cache of the whole length: the decode loop's body, which the cost model counts once) and the update step (forward,
backward and optimizer over every row), each the compiler's estimated seconds per step (its layers extrapolated from
the programs compiled unrolled at 1 and 2 layers, as tools/bench_tpu.py) and the peak memory per chip of the real
(rolled) program. The estimated rollout = prefill + new tokens x decode step; the cost model does not see the host's
part (rewards) nor what waits on it.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

import _hlo  # noqa: E402
import arithmetic_prompts  # noqa: E402
from jaxtrain import config as config_lib  # noqa: E402
from jaxtrain import topology  # noqa: E402
from jaxtrain.models import attention, scans  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402
from jaxtrain.train.objectives import grpo  # noqa: E402
from jaxtrain.train.objectives import rewards as rewards_lib  # noqa: E402

_STEPS = flags.DEFINE_integer("steps", 12, "CPU: GRPO steps timed (the first two are left out of the medians; 0: "
                              "no CPU run).")
_MESH = flags.DEFINE_list("mesh", ["1", "1", "1"], "CPU: data,fsdp,tensor sizes.")
_NEW = flags.DEFINE_integer("max_new_tokens", 16, "CPU: new tokens per completion (no stop token: all of them).")
_TOPOS = flags.DEFINE_list("topologies", ["v5p:4x4x4"], "TPU topologies (jaxtrain.topology names); empty: none.")
_TPU_CONFIG = flags.DEFINE_string("tpu_config", "configs/llama3_8b.py", "TPU: the model's config file.")
_TPU_ROWS = flags.DEFINE_integer("tpu_rows", 512, "TPU: completions per step (64 prompts x 8).")
_TPU_SEQ = flags.DEFINE_integer("tpu_seq_len", 2048, "TPU: the training row (prompt and completion).")
_TPU_NEW = flags.DEFINE_integer("tpu_new_tokens", 1024, "TPU: new tokens per completion.")
_ROLLOUT_TENSOR = flags.DEFINE_integer("rollout_tensor", -1, "TPU: rl.rollout_tensor (-1: jaxtrain's choice; 0: "
                                       "the training layout).")
_STALENESS = flags.DEFINE_list("max_staleness", ["0"], "CPU: rl.max_staleness values, each a run (paired: the same "
                                "rollouts' shapes and rewards; their step times compared).")
_REWARD_S = flags.DEFINE_float("reward_s", 0.0, "CPU: seconds each reward call sleeps besides scoring (code run under "
                               "a timeout takes seconds: what asynchronous rollouts hide behind the update).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/grpo.json", "Where to write the JSON results.")


@rewards_lib.REWARDS.register("bench_delayed")
def _delayed(rl):
  """exact_match, after ``--reward_s`` seconds a call."""
  exact = rewards_lib.REWARDS.get("exact_match")(rl)

  def reward(completions, records):
    time.sleep(_REWARD_S.value)
    return exact(completions, records)
  return reward


def _prompts(folder: str) -> str:
  arithmetic_prompts.main([f"--output={folder}"])
  return f"{folder}/train.jsonl"


def cpu_split(folder: str, staleness: int = 0, index: int = 0) -> dict:
  data, fsdp, tensor = (int(x) for x in _MESH.value)
  c = config_lib.load_file("configs/tiny.py", [
      f"workdir={folder}/run{index}", "train.objective=grpo", f"train.steps={_STEPS.value}", "train.log_every=1",
      f"rl.max_staleness={staleness}", *(["rl.rewards=bench_delayed"] if _REWARD_S.value else []),
      "train.global_batch_size=64", "data.source=prompts", f"data.path={_prompts(folder)}",
      f"data.seq_len={_NEW.value + 8}", "rl.group_size=8", f"rl.max_new_tokens={_NEW.value}",
      f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", "checkpoint.async=false"])
  _, history = trainer.train(config_lib.resolve(c), devices=jax.devices()[:data * fsdp * tensor])
  timed = history[2:]
  med = {k: statistics.median(h[k] for h in timed) for k in
         ("rl/rollout_s", "rl/update_s", "rl/rollout_tokens_per_s", "rl/update_tokens_per_s", "rl/logp_mismatch",
          "rl/step_s")}
  return {"config": "configs/tiny.py", "mesh": {"data": data, "fsdp": fsdp, "tensor": tensor},
          "max_staleness": staleness, "reward_s": _REWARD_S.value, "step_s": med["rl/step_s"],
          "rows": 64, "group_size": 8, "seq_len": _NEW.value + 8, "new_tokens": _NEW.value, "steps": len(timed),
          "rollout_s": med["rl/rollout_s"], "update_s": med["rl/update_s"],
          "rollout_share": med["rl/rollout_s"] / (med["rl/rollout_s"] + med["rl/update_s"]),
          "rollout_tokens_per_s": med["rl/rollout_tokens_per_s"], "update_tokens_per_s": med["rl/update_tokens_per_s"],
          "logp_mismatch": med["rl/logp_mismatch"]}


def _tpu_run(prompts: str, topo: str, layers: int):
  c = config_lib.load_file(_TPU_CONFIG.value, [
      "workdir=/tmp/bench_grpo", "train.objective=grpo", f"train.global_batch_size={_TPU_ROWS.value}",
      "data.source=prompts", f"data.path={prompts}", f"data.seq_len={_TPU_SEQ.value}", "rl.group_size=8",
      f"rl.max_new_tokens={_TPU_NEW.value}", "eval.every_steps=0", "dry_run=true", f"dry_run_topology={topo}",
      "data.tokenizer=", f"model.num_layers={layers}", f"rl.rollout_tensor={_ROLLOUT_TENSOR.value}"])
  config_lib.validate_values(c)
  return trainer.build(c, topology.devices(topo))


def _programs(prompts: str, topo: str, layers: int, unrolled: bool) -> dict:
  """The update step's and the decode loop's compiled programs for ``layers`` layers."""
  run = _tpu_run(prompts, topo, layers)
  with attention.compiling_for("tpu"), scans.unrolled() if unrolled else contextlib.nullcontext():
    update = trainer.compile_step(run)
    generator = grpo.rollout_generator(run, _TPU_ROWS.value, ())
  return {"update": update, "decode": generator._decode_fn, "prefill": generator._prefill_fn, "run": run,
          "layout": generator.layout}


def tpu_estimate(prompts: str, topo: str) -> dict:
  t = time.perf_counter()
  layers = int(config_lib.load_file(_TPU_CONFIG.value).model.num_layers)
  small, bigger = (_programs(prompts, topo, n, unrolled=True) for n in (1, 2))
  real = _programs(prompts, topo, layers, unrolled=False)
  out = {"topology": topo, "chips": real["run"].mesh.size, "device_kind": real["run"].mesh.devices.flat[0].device_kind,
         "layers": layers, "rows": _TPU_ROWS.value, "seq_len": _TPU_SEQ.value, "new_tokens": _TPU_NEW.value}
  for name in ("update", "decode", "prefill"):
    _, _, whole = _hlo.extrapolate(_hlo.figures(small[name]), _hlo.figures(bigger[name]), 1, layers)
    mem = real[name].memory_analysis()
    out[name] = {"seconds": whole["seconds"], "flops": whole["flops"], "bytes": whole["bytes"],
                 "peak_bytes": int(mem.peak_memory_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes)}
  # A decode step reads every weight of its device and its rows' whole KV cache (the decode loop's arguments): its
  # memory bound is those bytes over the chip's HBM bandwidth.
  out["rollout_layout"] = {"tensor": real["layout"].tensor, "describe": real["layout"].describe(),
                           "weight_bytes": real["layout"].weight_bytes()}
  out["decode"]["memory_bound_s"] = out["decode"]["argument_bytes"] / topology.hbm_bytes_per_s(topo)
  out["decode"]["over_bound"] = out["decode"]["seconds"] / out["decode"]["memory_bound_s"]
  rollout = out["prefill"]["seconds"] + _TPU_NEW.value * out["decode"]["seconds"]
  out["rollout_seconds"] = rollout
  out["rollout_share"] = rollout / (rollout + out["update"]["seconds"])
  out["compile_s"] = time.perf_counter() - t
  return out


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  folder = tempfile.mkdtemp(prefix="bench_grpo-")
  runs = [cpu_split(folder, int(k), i) for i, k in enumerate(_STALENESS.value)] if _STEPS.value else []
  result = {"cpu": runs[0] if runs else None, "cpu_staleness": runs}
  for r in runs:
    print(f"CPU ({jax.devices()[0].device_kind}, mesh {r['mesh']}, rl.max_staleness={r['max_staleness']}, rewards "
          f"+{r['reward_s']:.2f} s): step {r['step_s'] * 1e3:.1f} ms ({r['step_s'] / runs[0]['step_s']:.2f}x the "
          f"first), rollout {r['rollout_s'] * 1e3:.1f} ms, update {r['update_s'] * 1e3:.1f} ms per step (rollout "
          f"{r['rollout_share']:.0%}); rollout {r['rollout_tokens_per_s']:,.0f} new tokens/s, update "
          f"{r['update_tokens_per_s']:,.0f} row tokens/s; logp mismatch {r['logp_mismatch']:.1e}", flush=True)
  result["tpu"] = []
  for topo in filter(None, _TOPOS.value):
    e = tpu_estimate(_prompts(folder + "/tpu"), topo)
    result["tpu"].append(e)
    print(f"{topo} ({e['chips']} chips), {_TPU_CONFIG.value}, {e['rows']} rows x {e['seq_len']} tokens, "
          f"{e['new_tokens']} new, rollout layout {e['rollout_layout']['describe']}: decode step "
          f"{e['decode']['seconds'] * 1e3:.2f} ms = {e['decode']['over_bound']:.2f}x its memory bound "
          f"({e['decode']['argument_bytes'] / 1e9:.2f} GB a chip: "
          f"{e['decode']['memory_bound_s'] * 1e3:.2f} ms; peak {e['decode']['peak_bytes'] / 2**30:.1f} GiB), prefill {e['prefill']['seconds']:.3f} s, update step "
          f"{e['update']['seconds']:.3f} s (peak {e['update']['peak_bytes'] / 2**30:.1f} GiB); rollout "
          f"{e['rollout_seconds']:.2f} s = {e['rollout_share']:.0%} of rollout + update", flush=True)
  print(f"wrote {_bench.write_json(_OUT.value, {'results': result})}")
  print(json.dumps(result))


if __name__ == "__main__":
  app.run(main)

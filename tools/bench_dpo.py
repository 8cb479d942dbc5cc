"""DPO step time against an SFT (``lm``) step of the same tokens (jaxtrain/train/objectives/preference.py).

  python tools/bench_dpo.py [--config=tiny] [--pairs=8] [--seq_len=128] [--mesh=1,8,1] [--reps=5]
      [--out=benchmarks/results/dpo.json]

A DPO step of B pairs runs the policy's forward and backward over 2B rows of ``seq_len`` tokens, plus, unless the
reference log-probs are precomputed, the reference's forward over the same rows (a third of a training step's
work: about 1.33x). Measured, each compiled once, warmed up, then timed ``--reps`` times in turn with the others
(median), on the local devices (8 simulated CPU devices unless XLA_FLAGS says otherwise):

- ``sft``: an ``lm`` step over 2B rows; ``dpo_frozen``: DPO with a frozen copy as the reference;
  ``dpo_precomputed``: DPO reading the reference log-probs with the batch (no reference forward);
- with LoRA (``--lora_rank``): ``sft_lora`` and ``dpo_adapters_off`` (the reference: the policy without adapters).

The ratios of seconds (DPO over its SFT step), and of the compiler's FLOPs count of each step (which no load on a
shared host disturbs), are checked against the targets: <= 1.4 with a frozen or adapters-off reference,
<= 1.05 precomputed. Prints a table and writes JSON.
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from jaxtrain.data import batch as batch_lib  # noqa: E402
from jaxtrain.data import prepare  # noqa: E402
from jaxtrain.train import objectives, trainer  # noqa: E402
from jaxtrain.train.objectives import preference  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "tiny", "A config module under configs/.")
_PAIRS = flags.DEFINE_integer("pairs", 8, "Pairs per step (the SFT step: twice as many rows).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per row.")
_MESH = flags.DEFINE_list("mesh", ["1", "8", "1"], "data,fsdp,tensor sizes.")
_LORA = flags.DEFINE_integer("lora_rank", 8, "LoRA rank for the adapters-off rows (0: skip them).")
_REPS = flags.DEFINE_integer("reps", 5, "Timed steps per measurement (median).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/dpo.json", "JSON output.")
TARGETS = {"dpo_frozen": 1.4, "dpo_adapters_off": 1.4, "dpo_precomputed": 1.05}


def _pairs_folder(root: str, seq_len: int) -> str:
  """A small prepared preference folder (the configs validate data.path; the timed batches are random tokens)."""
  src = os.path.join(root, "pairs.jsonl")
  with open(src, "w") as f:
    for i in range(64):
      f.write(json.dumps({"prompt": f"question {i}: ", "chosen": "yes " * 3, "rejected": f"no {i}"}) + "\n")
  out = os.path.join(root, "data")
  prepare.prepare(prepare.Options(inputs=[src], output=out, progress=False, eval_fraction=0.0, format="preference",
                                  seq_len=seq_len))
  return out


def _config(objective: str, data: str, lora: int, reference: str = "auto"):
  c = importlib.import_module(f"configs.{_CONFIG.value}").get_config()
  data_size, fsdp, tensor = (int(x) for x in _MESH.value)
  c.mesh.update(data=data_size, fsdp=fsdp, tensor=tensor)
  c.workdir = os.path.join(tempfile.gettempdir(), "bench_dpo")
  c.data.seq_len = _SEQ_LEN.value
  rows = _PAIRS.value * (2 if objective == "lm" else 1)
  c.train.update(objective=objective, global_batch_size=rows)
  if objective != "lm":
    c.data.update(source="arrayrecord", path=data)
    c.preference.reference = reference
  else:
    c.data.source = "synthetic"
  if lora:
    c.model.lora.update(rank=lora, alpha=2.0 * lora, targets="q,k,v,o,gate,up,down")
  return c


def _batch(run, rng) -> dict:
  """Random tokens in the objective's batch layout, every target trained (the same tokens for SFT and DPO)."""
  shapes = objectives.of(run.config).abstract_batch(run)
  local = {}
  for k, s in shapes.items():
    if k.endswith("loss_mask"):
      local[k] = np.ones(s.shape, np.float32)
    elif k.endswith(("positions",)):
      local[k] = np.broadcast_to(np.arange(s.shape[1], dtype=np.int32), s.shape).copy()
    elif k.endswith("segment_ids"):
      local[k] = np.ones(s.shape, np.int32)
    elif k.startswith("reference_"):
      local[k] = rng.normal(-100.0, 1.0, s.shape).astype(np.float32)
    else:
      local[k] = rng.integers(0, run.config.model.vocab_size, s.shape).astype(np.int32)
  assert set(batch_lib.KEYS) <= set(local) or "chosen_inputs" in local
  return {k: jax.make_array_from_process_local_data(s.sharding, local[k]) for k, s in shapes.items()}


def compiled(config):
  """A compiled step of ``config``, ready to run: (``() -> seconds`` of one step (after a warm-up step), the
  compiler's FLOPs count of the step)."""
  run = trainer.build(config)
  programs = []

  def compile_step(*args, **kwargs):
    programs.append(trainer.compile_step(*args, **kwargs))
    return programs[-1]

  step = objectives.of(run.config).step_fn(run, compile_step)
  flops = float((programs[0].cost_analysis() or {}).get("flops", 0.0))
  held = {"state": trainer.init_state(run)}
  batch = _batch(run, np.random.default_rng(0))
  skip = np.bool_(False)

  def timed() -> float:
    t = time.perf_counter()
    held["state"], metrics = step(held["state"], batch, skip)
    jax.block_until_ready((held["state"], metrics))
    return time.perf_counter() - t

  timed()
  return timed, flops


def measure(steps: dict) -> dict[str, float]:
  """Median seconds per step of each, the steps taken in turn (round-robin: a slow moment of a shared host falls on
  every kind alike)."""
  times = {k: [] for k in steps}
  for _ in range(_REPS.value):
    for k, (timed, _) in steps.items():
      times[k].append(timed())
  return {k: statistics.median(v) for k, v in times.items()}


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    data = _pairs_folder(tmp, _SEQ_LEN.value)
    steps = {"sft": compiled(_config("lm", data, 0)),
             "dpo_frozen": compiled(_config("dpo", data, 0, "frozen")),
             "dpo_precomputed": compiled(_config("dpo", data, 0, "precomputed"))}
    base = {"dpo_frozen": "sft", "dpo_precomputed": "sft"}
    if _LORA.value:
      steps["sft_lora"] = compiled(_config("lm", data, _LORA.value))
      steps["dpo_adapters_off"] = compiled(_config("dpo", data, _LORA.value, "adapters_off"))
      base["dpo_adapters_off"] = "sft_lora"
    rows = measure(steps)
  flops = {k: f for k, (_, f) in steps.items()}
  ratios = {k: rows[k] / rows[b] for k, b in base.items()}
  flop_ratios = {k: flops[k] / flops[b] for k, b in base.items() if flops[b]}
  tokens = 2 * _PAIRS.value * _SEQ_LEN.value
  print(f"{'step':<18}{'seconds':>10}{'tokens/s':>12}{'GFLOP':>10}{'ratio':>8}{'FLOPs':>8}{'target':>8}  "
        f"(config {_CONFIG.value}, "
        f"{_PAIRS.value} pairs = {2 * _PAIRS.value} rows x {_SEQ_LEN.value}, mesh {','.join(_MESH.value)})")
  for k, s in rows.items():
    ratio = f"{ratios[k]:.3f}" if k in ratios else ""
    flop_ratio = f"{flop_ratios[k]:.3f}" if k in flop_ratios else ""
    target = f"<={TARGETS[k]}" if k in TARGETS else ""
    print(f"{k:<18}{s:>10.4f}{tokens / s:>12,.0f}{flops[k] / 1e9:>10.2f}{ratio:>8}{flop_ratio:>8}{target:>8}")
  path = _bench.write_json(_OUT.value, {
      "config": _CONFIG.value, "pairs": _PAIRS.value, "seq_len": _SEQ_LEN.value, "mesh": _MESH.value,
      "lora_rank": _LORA.value, "reps": _REPS.value, "seconds": rows, "ratios": ratios,
      "flops": flops, "flop_ratios": flop_ratios,
      "targets": {k: v for k, v in TARGETS.items() if k in ratios},
      "within_targets": {k: ratios[k] <= TARGETS[k] for k in ratios}})
  print(f"-> {path}")


if __name__ == "__main__":
  app.run(main)

"""Reading the TPU compiler's compiled HLO text: the collectives' bytes and the custom calls its cost model cannot
price. Imports nothing from jaxtrain, so that tools/maxtext_step.py (run in MaxText's own virtualenv) measures
MaxText's programs with the same code as tools/bench_tpu.py measures ours."""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
# An HLO instruction: `%name = SHAPE opcode(operands...)`, SHAPE an array `bf16[8,128]{1,0}` or a tuple of them.
_INSTRUCTION = re.compile(r"=\s*(\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+([\w-]+)\((.*)$")
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")


def _array_bytes(text: str) -> list[float]:
  return [_DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
          for dtype, dims in _ARRAY.findall(text)]


def collective_bytes(hlo: str) -> dict[str, float]:
  """Per collective kind, the sum over the collectives in ``hlo`` (compiled HLO text) of the largest array each
  reads or writes (the gathered result of an all-gather, the reduced input of a reduce-scatter). The TPU compiler
  runs an async collective as a chain of fusions (its start, then continuations that overlap it with compute), each
  holding the op with the chain's ``chain_id``: a chain counts once. Any other collective instruction counts each
  time it appears (``-done`` halves not: their ``-start`` did)."""
  largest: dict[tuple, float] = {}
  for number, line in enumerate(hlo.splitlines()):
    found = _INSTRUCTION.search(line)
    if not found:
      continue
    shape, opcode, operands = found.groups()
    kind = opcode.removesuffix("-start")
    if kind not in COLLECTIVES or opcode.endswith("-done"):
      continue
    chain, channel = re.search(r'chain_id="(\d+)"', line), re.search(r"channel_id=(\d+)", line)
    key = (kind, channel and channel.group(1), chain.group(1)) if chain else (kind, number)
    size = max(_array_bytes(shape) + _array_bytes(operands.split(")")[0]), default=0)
    largest[key] = max(largest.get(key, 0.0), size)
  return {kind: sum(v for key, v in largest.items() if key[0] == kind) for kind in COLLECTIVES}


# Custom calls the TPU cost model cannot price add -1 to ``optimal_seconds`` each (seen with libtpu 0.0.42 and
# 0.0.50: a program with n of these reports its estimate minus n); these are the targets that do, the compiler's own
# (Mosaic kernels, target ``tpu_custom_call``, add 0: their time is missing from the estimate, not negative).
# PrepareAsyncCallStart/Done: a pair per MoE layer on libtpu 0.0.42 (Mixtral on v5p: -1.94 s at 1 layer with one
# pair, -3.89 s at 2 layers with two; AllocateBuffer, once in both, and AssumeGatherIndicesInBound, 12 then 22,
# add nothing). ZeroCrop: once in the harness's log-likelihood program (tools/bench_eval_tpu.py; Llama 3 8B on v5p,
# one layer: -0.997 s with it, AssumeGatherIndicesInBound alone priced at +2 us).
UNPRICED_TARGETS = ("ConcatBitcast", "PrepareAsyncCallStart", "PrepareAsyncCallDone", "ZeroCrop")


def unpriced_calls(hlo: str) -> int:
  return sum(len(re.findall(rf'custom_call_target="{t}"', hlo)) for t in UNPRICED_TARGETS)


def figures(compiled) -> dict[str, float]:
  """A compiled program's figures per chip: the cost model's ``flops``, ``bytes`` (HBM bytes accessed) and
  ``seconds`` (its step-time estimate, corrected for unpriced calls), ``collective_bytes`` (in all and per kind) and
  ``mosaic_calls`` (Pallas kernels, whose own time the estimate leaves out)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hlo = compiled.as_text()
  by_kind = collective_bytes(hlo)
  seconds = float(cost["optimal_seconds"]) + unpriced_calls(hlo)
  if seconds <= 0:
    raise RuntimeError(f"the TPU cost model's step estimate is {seconds:.3g} s after correcting for the custom calls "
                       f"it cannot price ({', '.join(UNPRICED_TARGETS)}): another target adds -1 now; find it in "
                       "compiled.as_text() and add it to UNPRICED_TARGETS")
  return {"flops": float(cost["flops"]), "bytes": float(cost["bytes accessed"]), "seconds": seconds,
          "collective_bytes": sum(by_kind.values()),
          "mosaic_calls": float(hlo.count('custom_call_target="tpu_custom_call"')),
          **{f"collective_bytes/{k}": v for k, v in by_kind.items()}}


def extrapolate(small: dict, bigger: dict, n: int, layers: int, step: int = 1) -> tuple[dict, dict, dict]:
  """(per layer, rest, whole step) from the figures of the step compiled unrolled at ``n`` and ``n + step`` layers
  (``step``: the layers a pipeline adds one to each stage and virtual stage with, else 1): per layer =
  (c(n + step) - c(n)) / step, rest = c(n) - n x per layer, whole = rest + ``layers`` x per layer."""
  per_layer = {k: (bigger[k] - small[k]) / step for k in small}
  rest = {k: small[k] - n * per_layer[k] for k in small}
  return per_layer, rest, {k: rest[k] + layers * per_layer[k] for k in rest}

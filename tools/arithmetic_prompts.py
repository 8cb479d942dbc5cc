"""A small math-style dataset for reinforcement learning with verifiable rewards: "a+b=" prompts with their answers.

  python tools/arithmetic_prompts.py --output=data/arithmetic [--max_operand=20] [--held_out=40] [--seed=0]

Writes ``train.jsonl`` and ``held_out.jsonl`` (``{"prompt": "12+7=", "answer": "19"}`` per line, the held-out sums
never in training) and ``sft.jsonl`` (``{"text": "12+7=19\\n"}``: the training prompts answered, to fine-tune a model
to the format first with ``data.source=raw``). The reward that checks an answer is ``exact_match`` with ``rl.stop``
``('\\n',)`` (docs/post_training.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random


def problems(max_operand: int, held_out: int, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
  """Every ``a+b`` with operands in [0, max_operand], shuffled: (training problems, held-out problems)."""
  pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
  random.Random(seed).shuffle(pairs)
  return pairs[held_out:], pairs[:held_out]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--output", required=True, help="folder to write train.jsonl, held_out.jsonl, sft.jsonl to")
  parser.add_argument("--max_operand", type=int, default=20)
  parser.add_argument("--held_out", type=int, default=40, help="problems kept out of training")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.max_operand < 1 or not 0 < args.held_out < (args.max_operand + 1) ** 2:
    parser.error(f"--held_out must be in (0, {(args.max_operand + 1) ** 2}) and --max_operand >= 1")
  train, held_out = problems(args.max_operand, args.held_out, args.seed)
  out = pathlib.Path(args.output)
  out.mkdir(parents=True, exist_ok=True)
  for name, pairs in (("train", train), ("held_out", held_out)):
    (out / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                               for a, b in pairs))
  (out / "sft.jsonl").write_text("".join(json.dumps({"text": f"{a}+{b}={a + b}\n"}) + "\n" for a, b in train))
  print(f"{len(train)} training and {len(held_out)} held-out problems -> {out}")


if __name__ == "__main__":
  main()

"""A task GRPO visibly learns on a CPU in minutes: reverse two letters ("ab>" -> "ba", then a newline).

  python tools/letter_prompts.py --output=data/letters [--letters=abcdefgh] [--held_out=16] [--seed=0]

Every ordered pair of ``--letters`` (64 of the default 8), shuffled: ``--held_out`` of them are kept out of training
(each letter still seen in both places by the training pairs). Writes ``train.jsonl`` and ``held_out.jsonl``
(``{"prompt": "ab>", "answer": "ba"}`` per line) and ``sft.jsonl`` (``{"text": "ab>ba\\n"}``: the training pairs
answered, 4 times each, to fine-tune a model to the format first with ``data.source=raw``). The reward is the
built-in ``exact_match`` with ``rl.stop`` ``('\\n',)``; configs/grpo_letters.py trains on these files
(docs/post_training.md has the commands and the held-out reward they reach).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np


def pairs(letters: str, held_out: int, seed: int) -> tuple[list[str], list[str]]:
  """Every two-letter string of ``letters``, shuffled: (training pairs, held-out pairs)."""
  every = [a + b for a in letters for b in letters]
  np.random.default_rng(seed).shuffle(every)
  return every[held_out:], every[:held_out]


def write(folder: pathlib.Path, letters: str = "abcdefgh", held_out: int = 16, seed: int = 0) -> tuple[int, int]:
  """The three files into ``folder``; returns (training prompts, held-out prompts)."""
  train, held = pairs(letters, held_out, seed)
  folder = pathlib.Path(folder)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "sft.jsonl").write_text("".join(json.dumps({"text": f"{p}>{p[::-1]}\n"}) + "\n" for p in train * 4))
  for name, chosen in (("train", train), ("held_out", held)):
    (folder / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": f"{p}>", "answer": p[::-1]}) + "\n"
                                                  for p in chosen))
  return len(train), len(held)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--output", required=True, help="folder to write train.jsonl, held_out.jsonl, sft.jsonl to")
  parser.add_argument("--letters", default="abcdefgh", help="the alphabet of the pairs (distinct letters)")
  parser.add_argument("--held_out", type=int, default=16, help="pairs kept out of training")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  n = len(args.letters) ** 2
  if len(set(args.letters)) != len(args.letters) or len(args.letters) < 2 or not args.letters.isalpha():
    parser.error(f"--letters={args.letters!r}: give at least 2 distinct letters")
  if not 0 < args.held_out < n:
    parser.error(f"--held_out must be in (0, {n}) for {len(args.letters)} letters")
  train, held = write(pathlib.Path(args.output), args.letters, args.held_out, args.seed)
  print(f"{train} training and {held} held-out prompts -> {args.output}")


if __name__ == "__main__":
  main()

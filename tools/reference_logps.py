"""Precompute the reference model's log-probabilities of every preference pair into its data folder.

  python tools/reference_logps.py --config=configs/X.py --config.train.objective=dpo \
      --config.data.path=DATA [--config.checkpoint.restore_from=BASE ...]

With the run's own config (the same model, ``checkpoint.restore_from``, seed, mesh and ``data.seq_len``), every
pair's summed response log-probabilities under the run's reference (its starting params, without adapters) are
computed with the training forward on the run's mesh, one pass per split, and written next to the shards
(``reference-train.npy``, ``reference-eval.npy``: float32 [pairs, 2], chosen then rejected; ``reference.json``:
what they were computed with). A run with ``preference.reference=precomputed`` then reads them with each batch and
runs no reference forward; it refuses them if they were computed for another reference model. Bad input: one line,
exit code 2, nothing written.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags  # noqa: E402

from jaxtrain import main as main_lib  # noqa: E402 - its --config flag and parser
from jaxtrain.errors import UserError  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402
from jaxtrain.train.objectives import preference  # noqa: E402


def main(argv):
  del argv
  config = flags.FLAGS.config
  try:
    if config.train.objective != "dpo":
      raise UserError("train.objective", f"is {config.train.objective}; only dpo has a reference model",
                      "pass --config.train.objective=dpo")
    out = preference.compute_reference(trainer.build(config))
  except UserError as e:
    print(f"reference_logps: error: {e}", file=sys.stderr)
    sys.exit(2)
  for split, values in out.items():
    print(f"{split}: {len(values):,} pairs, mean log-prob chosen {values[:, 0].mean():.4f}, rejected "
          f"{values[:, 1].mean():.4f} -> {os.path.join(config.data.path, f'reference-{split}.npy')}")


if __name__ == "__main__":
  app.run(main, flags_parser=main_lib.parse_flags)

"""Tokenize raw text into ArrayRecord shards + manifest for jaxtrain.

  python tools/prepare_data.py --input=PATH [--input=PATH ...] --output=DIR [--tokenizer=FILE]
      [--field=text] [--seed=N] [--eval_fraction=F] [--text_split=paragraph|file] [--workers=N]

Inputs: text files (documents separated by blank lines; --text_split=file for one per file), JSONL (field
--field), Parquet (column --field), folders (recursive) and globs. Exact duplicate documents are removed and
counted. The output folder appears complete or not at all. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags  # noqa: E402

from jaxtrain import paths  # noqa: E402
from jaxtrain.config import UserError  # noqa: E402
from jaxtrain.data import prepare  # noqa: E402

_INPUT = flags.DEFINE_multi_string("input", None, "Input file, folder or glob (repeatable).", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Output folder (must not exist or be empty).", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte", "'byte', a tokenizers JSON file or a SentencePiece model.")
_FIELD = flags.DEFINE_string("field", "text", "JSONL field / Parquet column holding the text.")
_SEED = flags.DEFINE_integer("seed", 0, "Shuffle seed.")
_EVAL = flags.DEFINE_float("eval_fraction", 0.01, "Fraction of documents held out for eval.")
_SPLIT = flags.DEFINE_enum("text_split", "paragraph", prepare.TEXT_SPLITS, "How text files split into documents.")
_SHARD_MIB = flags.DEFINE_float("shard_mib", 128.0, "Target shard size in MiB.")
_WORKERS = flags.DEFINE_integer("workers", 0, "Processes tokenizing input files in parallel (0: in-process).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty output folder (after success).")


def main(argv):
  del argv
  try:
    manifest = prepare.prepare(prepare.Options(
        inputs=[paths.resolve(i) for i in _INPUT.value], output=paths.resolve(_OUTPUT.value),
        tokenizer=_TOKENIZER.value if _TOKENIZER.value == "byte" else paths.resolve(_TOKENIZER.value),
        field=_FIELD.value,
        seed=_SEED.value, eval_fraction=_EVAL.value, text_split=_SPLIT.value, shard_mib=_SHARD_MIB.value,
        workers=_WORKERS.value, overwrite=_OVERWRITE.value, progress=sys.stderr.isatty()))
  except UserError as e:
    print(f"prepare_data: error: {e}", file=sys.stderr)
    sys.exit(2)
  splits = manifest["splits"]
  print(f"{manifest['documents']:,} documents ({splits['train']['documents']:,} train, "
        f"{splits['eval']['documents']:,} eval), {manifest['tokens']:,} tokens, "
        f"{manifest['duplicates_removed']:,} duplicates removed, tokenizer {manifest['tokenizer']} "
        f"(vocab {manifest['vocab_size']:,}), {len(manifest['shards'])} shards -> {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)

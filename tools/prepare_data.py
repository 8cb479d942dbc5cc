"""Tokenize raw text into ArrayRecord shards + manifest for jaxtrain.

  python tools/prepare_data.py --input=PATH [--input=PATH ...] --output=DIR [--tokenizer=FILE|FOLDER]
      [--format=auto|text|sft|preference] [--seq_len=N] [--field=text] [--seed=N] [--eval_fraction=F]
      [--text_split=paragraph|file]
      [--workers=N] [--prompt_field=prompt] [--response_field=response] [--messages_field=messages]
      [--chat_template=FILE] [--near_dup_threshold=0.8]
      [--runner=DirectRunner|DaskRunner|DataflowRunner|... [-- BEAM_OPTIONS]]

Pretraining text (--format=text): text files (documents separated by blank lines; --text_split=file for one
per file), JSONL (field --field), Parquet (column --field), folders (recursive) and globs.

Supervised fine-tuning (--format=sft; --format=auto, the default, picks it when the first JSONL line of the
inputs has a 'messages' field or both 'prompt' and 'response' fields): JSONL lines
{"prompt": ..., "response": ...} or {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}.
With a chat template (a Hugging Face tokenizer folder given as --tokenizer, whose tokenizer_config.json has
"chat_template" (or chat_template.jinja), or --chat_template=FILE) each record is rendered as transformers'
apply_chat_template renders it and only the assistant messages' tokens (and the end-of-turn token after each)
are trained; without one: BOS (if the tokenizer config names one), prompt tokens, response tokens + EOS (if
named), only the response and EOS trained. See jaxtrain/data/chat.py.

Preference pairs (--format=preference; --format=auto picks it when the first JSONL line has 'chosen' and
'rejected' fields), for train.objective=dpo|simpo|orpo: JSONL lines {"prompt": ..., "chosen": ..., "rejected": ...}
(strings) or {"chosen": [messages], "rejected": [messages]} (chats differing only in their last, assistant,
message), rendered as SFT records are, only the last assistant message of each side trained. --seq_len (required:
the data.seq_len you train with): a pair with a side longer than seq_len + 1 tokens loses tokens from the left of
its prompt, or is dropped when its response alone does not fit; both counted. See jaxtrain/data/pairs.py.

Exact duplicate documents / records are removed and counted; with --near_dup_threshold=J also near duplicates
(MinHash LSH over word 5-grams, Jaccard similarity J). Each document's split (eval with probability
--eval_fraction), place in the shuffle and shard come from a seeded hash of its content: the output is the same
bytes for any --workers and any --runner. Memory stays bounded (a 64 MiB buffer per worker and one shard of about
--shard_mib MiB of input) whatever the input size.

Without --runner the preparation runs in this process (--workers processes). With --runner it is an Apache Beam
pipeline (pip install -e '.[beam]'): --runner=DirectRunner --workers=N runs N local worker processes; on a Dask
cluster --runner=DaskRunner with the scheduler's address after `--` (one task per input file; the scheduler and
workers need jaxtrain installed, and the input and output on storage every worker reaches); at scale also
DataflowRunner, FlinkRunner or SparkRunner, their options after `--`, e.g.

  python tools/prepare_data.py --input=/shared/raw --output=/shared/data --runner=DaskRunner \
      -- --dask_client_address=tcp://scheduler:8786
  python tools/prepare_data.py --input=gs://b/raw/*.jsonl --output=gs://b/data --runner=DataflowRunner \
      -- --project=P --region=us-central1 --temp_location=gs://b/tmp

The output folder appears complete or not at all (the manifest is written last). Bad input: one line on stderr
(file and line for JSONL records), exit code 2, nothing written; so is a storage failure the user fixes (permissions,
a full disk, a missing bucket). A store that does not answer or throttles, or an I/O error: one line, exit 75 (run
the same command again).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from absl import app, flags, logging  # noqa: E402

from jaxtrain import exits  # noqa: E402
from jaxtrain import paths  # noqa: E402
from jaxtrain.errors import UserError  # noqa: E402
from jaxtrain.data import prepare  # noqa: E402

_INPUT = flags.DEFINE_multi_string("input", None, "Input file, folder or glob (repeatable).", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Output folder (must not exist or be empty).", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte", "'byte', a tokenizers JSON file, a Hugging Face tokenizer "
                                 "folder (tokenizer.json + tokenizer_config.json: special tokens, chat template) or "
                                 "a SentencePiece model.")
_FORMAT = flags.DEFINE_enum("format", "auto", prepare.FORMATS, "text: pretraining documents; sft: prompt/response "
                            "or chat JSONL, only responses trained; auto: sft when the first JSONL line has a "
                            "messages field or prompt and response fields, else text.")
_PROMPT = flags.DEFINE_string("prompt_field", "prompt", "SFT, preference: JSONL field holding the prompt.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 0, "Preference: the training data.seq_len; longer pairs are cut from the "
                                "prompt's left or dropped (counted).")
_RESPONSE = flags.DEFINE_string("response_field", "response", "SFT: JSONL field holding the response.")
_MESSAGES = flags.DEFINE_string("messages_field", "messages", "SFT: JSONL field holding the chat messages.")
_TEMPLATE = flags.DEFINE_string("chat_template", "", "SFT: a jinja chat template file (overrides the tokenizer's).")
_FIELD = flags.DEFINE_string("field", "text", "JSONL field / Parquet column holding the text.")
_SEED = flags.DEFINE_integer("seed", 0, "Shuffle seed.")
_EVAL = flags.DEFINE_float("eval_fraction", 0.01, "Fraction of documents held out for eval.")
_SPLIT = flags.DEFINE_enum("text_split", "paragraph", prepare.TEXT_SPLITS, "How text files split into documents.")
_SHARD_MIB = flags.DEFINE_float("shard_mib", 128.0, "About this many MiB of input text per shard.")
_WORKERS = flags.DEFINE_integer("workers", 0, "Worker processes (0: in-process; with --runner=DirectRunner: its "
                                "worker processes).")
_NEAR = flags.DEFINE_float("near_dup_threshold", 0.0, "Remove near duplicates at this Jaccard similarity of word "
                           "n-grams (MinHash LSH; e.g. 0.8); 0: exact de-duplication only.")
_NGRAM = flags.DEFINE_integer("near_dup_ngram", 5, "Words per n-gram for near-duplicate search.")
_PERM = flags.DEFINE_integer("near_dup_perm", 128, "MinHash permutations for near-duplicate search.")
_RUNNER = flags.DEFINE_string("runner", "", "An Apache Beam runner (DirectRunner, DaskRunner, DataflowRunner, "
                              "FlinkRunner, SparkRunner, ...); options for it go after `--`. Empty: prepare in this "
                              "process.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace a non-empty output folder (after success).")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Apache Beam logs every stage at INFO
  if len(argv) > 1 and not _RUNNER.value:
    print(f"prepare_data: error: {argv[1]}: an extra argument without --runner; pass Beam pipeline options "
          "after `--` together with --runner=NAME", file=sys.stderr)
    sys.exit(2)
  try:
    manifest = prepare.prepare(prepare.Options(
        inputs=[paths.resolve(i) for i in _INPUT.value], output=paths.resolve(_OUTPUT.value),
        tokenizer=_TOKENIZER.value if _TOKENIZER.value == "byte" else paths.resolve(_TOKENIZER.value),
        field=_FIELD.value,
        seed=_SEED.value, eval_fraction=_EVAL.value, text_split=_SPLIT.value, shard_mib=_SHARD_MIB.value,
        workers=_WORKERS.value, overwrite=_OVERWRITE.value, progress=sys.stderr.isatty(), format=_FORMAT.value,
        seq_len=_SEQ_LEN.value, prompt_field=_PROMPT.value, response_field=_RESPONSE.value,
        messages_field=_MESSAGES.value,
        chat_template=paths.resolve(_TEMPLATE.value) if _TEMPLATE.value else "",
        near_dup_threshold=_NEAR.value, near_dup_ngram=_NGRAM.value, near_dup_perm=_PERM.value,
        runner=_RUNNER.value, pipeline_options=tuple(argv[1:])))
  except UserError as e:
    print(f"prepare_data: error: {e}", file=sys.stderr)
    sys.exit(exits.USER_ERROR)
  except exits.Restart as e:  # a store that did not answer, an I/O error: running the same command again cures it
    print(f"prepare_data: stopped: {e.cause}: {e}; run the same command again (exit {exits.RESTART})", file=sys.stderr)
    sys.exit(exits.RESTART)
  splits = manifest["splits"]
  print(f"{manifest['documents']:,} documents ({splits['train']['documents']:,} train, "
        f"{splits['eval']['documents']:,} eval), {manifest['tokens']:,} tokens, "
        + (f"{manifest['trained_tokens']:,} trained (SFT, {manifest['sft']['template'].replace('_', ' ')}), "
           if manifest.get("sft") else "")
        + (f"{manifest['trained_tokens']:,} trained (preference pairs, "
           f"{manifest['preference']['template'].replace('_', ' ')}; {manifest['preference']['truncated']:,} "
           f"truncated, {manifest['preference']['dropped']:,} dropped at seq_len {manifest['preference']['seq_len']}), "
           if manifest.get("preference") else "")
        + f"{manifest['duplicates_removed']:,} duplicates removed, "
        + (f"{manifest['near_duplicates_removed']:,} near duplicates removed, " if manifest["near_dup"] else "")
        + f"tokenizer {manifest['tokenizer']} "
        f"(vocab {manifest['vocab_size']:,}), {len(manifest['shards'])} shards -> {_OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)

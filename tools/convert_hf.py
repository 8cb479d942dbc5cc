"""Hugging Face checkpoints (Llama, Mixtral, Qwen 2.5 / 3 / 3 MoE, Mistral, Gemma 2 / 3, OLMoE) in and out of jaxtrain.

  python tools/convert_hf.py import --hf=HF_DIR --output=OUT_DIR
  python tools/convert_hf.py export --checkpoint=CKPT_DIR [--step=N] --output=HF_DIR [--max_shard_mb=5000]
                                    [--dtype=auto|float32|bfloat16|float16] [--tokenizer=TOKENIZER_DIR]

import: OUT_DIR/checkpoints/0 (the params), OUT_DIR/config.py (train from them: python -m jaxtrain.main
--config=OUT_DIR/config.py) and OUT_DIR/hf/ (the source's config.json and tokenizer files). export: CKPT_DIR is a
run's workdir, its checkpoints folder or one step folder; HF_DIR gets the tokenizer, chat template and generation
config its lineage carries (a run's hf/ folder, copied from its parent's at its start), or --tokenizer's; without
either the export is refused. Each of HF_DIR, OUT_DIR, CKPT_DIR may be on an object
store (gs://bucket/..., s3://bucket/...). A mistake in the input, or a store that refuses access (credentials,
permissions), prints one line ``convert_hf: error: ...`` and exits 2, and nothing is written; a store that does not
answer prints one line and exits 75: run the same command again (it clears the unfinished output). The logic is
jaxtrain/hf.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a clone, uninstalled


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="convert_hf", description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  imp = sub.add_parser("import", help="a Hugging Face model folder -> a jaxtrain checkpoint and config")
  imp.add_argument("--hf", required=True, help="Hugging Face model folder (config.json, *.safetensors); local, gs:// "
                   "or s3://")
  imp.add_argument("--output", required=True, help="new folder for the checkpoint, config.py and hf/; local, gs:// or "
                   "s3://")
  exp = sub.add_parser("export", help="a jaxtrain checkpoint -> a Hugging Face folder")
  exp.add_argument("--checkpoint", required=True, help="a run's workdir, its checkpoints folder or a step folder")
  exp.add_argument("--step", type=int, default=None, help="the step to export (default: the newest)")
  exp.add_argument("--output", required=True, help="new folder for config.json and *.safetensors; local, gs:// or "
                   "s3://")
  exp.add_argument("--tokenizer", default="", help="a Hugging Face tokenizer folder or file to write with the weights "
                   "(default: the one the checkpoint's lineage carries; without either the export is refused)")
  exp.add_argument("--max_shard_mb", type=float, default=5000, help="largest safetensors file, in MB")
  exp.add_argument("--dtype", default="auto", help="auto (the imported source's dtype, else float32), float32, "
                   "bfloat16 or float16")
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion is host work: never grab an accelerator
  from jaxtrain import exits, hf, paths
  from jaxtrain.errors import UserError
  t = time.perf_counter()
  try:
    for name in ("hf", "output", "checkpoint"):  # ~ and relative paths, as everywhere; a URL's store client checked
      if getattr(args, name, None):
        setattr(args, name, paths.resolve(getattr(args, name), f"--{name}"))
    if args.command == "import":
      info = hf.import_model(args.hf, args.output)
      what = f"{info['params']:,} params ({info['source_dtype']} source)"
      nbytes = info["bytes"]
    else:
      info = hf.export_model(args.checkpoint, args.output, step=args.step, max_shard_mb=args.max_shard_mb,
                             dtype=args.dtype, tokenizer=args.tokenizer)
      what = f"{info['step_dir']} as {info['dtype']} in {info['shards']} file{'s' * (info['shards'] > 1)}"
      nbytes = info["bytes"]
  except UserError as e:
    print(f"convert_hf: error: {e}", file=sys.stderr)
    return exits.USER_ERROR
  except exits.Restart as e:  # an object store did not answer
    print(f"convert_hf: stopped: {e} (exit {exits.RESTART})", file=sys.stderr)
    return exits.RESTART
  seconds = time.perf_counter() - t
  print(f"convert_hf: {args.command}ed {what} -> {args.output} ({nbytes / 1e6:,.1f} MB in {seconds:.1f}s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

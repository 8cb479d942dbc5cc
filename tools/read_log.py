"""Print a workdir's log as one file: ``train.log`` (the default), ``metrics.jsonl`` or any other log a run writes.

  python tools/read_log.py WORKDIR [--log=train.log] [--tail=N]

A local workdir's log is a file; on an object store (``gs://``, ``s3://``) it is the segments every run wrote
(``<log>.d/``, jaxtrain.logs), printed in order, run after run, after the whole object an earlier version wrote.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxtrain import logs, paths  # noqa: E402
from jaxtrain.errors import UserError  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("--log", default="train.log", help="the log's name in the workdir")
  parser.add_argument("--tail", type=int, default=0, help="print only the last N lines")
  args = parser.parse_args()
  try:
    text = logs.read(paths.join(paths.resolve(args.workdir, "WORKDIR"), args.log))
  except UserError as e:  # a store whose client library is not installed
    print(f"read_log: error: {e}", file=sys.stderr)
    sys.exit(2)
  if not text:
    print(f"read_log: error: {args.workdir}: no {args.log} there; pass the workdir of a run (and --log)",
          file=sys.stderr)
    sys.exit(2)
  lines = text.splitlines(keepends=True)
  sys.stdout.write("".join(lines[-args.tail:] if args.tail else lines))


if __name__ == "__main__":
  main()

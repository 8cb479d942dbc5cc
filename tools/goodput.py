"""The goodput of a workdir over all its runs and restarts: a table of where the wall time went, and a plot.

  python tools/goodput.py WORKDIR [--out=goodput.png] [--json=FILE]

Reads the events under ``WORKDIR/goodput/`` (WORKDIR local or a URL such as ``gs://``; an older workdir's
``goodput.jsonl`` too; jaxtrain.goodput explains the parts); the plot shows each run as a bar on the wall-clock axis,
the gaps between runs as down time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jaxtrain import goodput  # noqa: E402

COLORS = {"productive": "tab:green", "startup": "tab:blue", "restore": "tab:cyan", "checkpoint": "tab:purple",
          "eval": "tab:olive", "data_wait": "tab:orange", "lost": "tab:red", "down": "tab:gray", "other": "tab:brown"}


def table(summary: dict) -> str:
  rows = [f"{'part':<12} {'seconds':>10} {'share':>8}"]
  for part in goodput.PARTS:
    rows.append(f"{part:<12} {summary['seconds'][part]:>10.1f} {100 * summary['shares'][part]:>7.1f}%")
  rows.append(f"{'wall':<12} {summary['wall_s']:>10.1f} {100.0:>7.1f}%")
  return "\n".join(rows)


def plot(events: list[dict], summary: dict, out: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (timeline, bars) = plt.subplots(2, 1, figsize=(10, 5), height_ratios=(1, 2))
  t0 = events[0]["t"]
  starts = [e["t"] - t0 for e in events if e["event"] == "start"]
  ends = []
  for i, start in enumerate(starts):
    later = [e["t"] - t0 for e in events if e["event"] != "start" and e["t"] - t0 >= start
             and (i + 1 == len(starts) or e["t"] - t0 < starts[i + 1])]
    ends.append(max(later, default=start))
  for i, (start, end) in enumerate(zip(starts, ends)):
    timeline.barh(0, end - start, left=start, color=COLORS["productive"], label="running" if i == 0 else None)
    if i + 1 < len(starts):
      timeline.barh(0, starts[i + 1] - end, left=end, color=COLORS["down"], label="down" if i == 0 else None)
  timeline.set_yticks([])
  timeline.set_xlabel("seconds since the first start")
  timeline.legend(loc="upper right", fontsize=8)
  parts = [p for p in goodput.PARTS if summary["seconds"][p] > 0]
  bars.barh(parts, [100 * summary["shares"][p] for p in parts], color=[COLORS[p] for p in parts])
  bars.invert_yaxis()
  bars.set_xlabel("% of the wall time")
  fig.suptitle(goodput.describe(summary), fontsize=9)
  fig.tight_layout()
  fig.savefig(out, dpi=100)


def _fail(message: str) -> None:
  print(f"goodput: error: {message}", file=sys.stderr)
  sys.exit(2)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("--out", default="", help="write the plot here (PNG)")
  parser.add_argument("--json", default="", help="write the account here")
  args = parser.parse_args()
  events = goodput.read_events(args.workdir)
  if not any(e["event"] == "start" for e in events):
    _fail(f"{args.workdir}: no run recorded there (no events in {goodput.FOLDER}/); pass the workdir of a run")
  if args.out:
    try:
      import matplotlib  # noqa: F401 - the plot's only dependency, an extra
    except ImportError:
      _fail("--out needs matplotlib: pip install -e '.[plot]' (or leave --out out to print the table)")
  summary = goodput.account(events)
  print(goodput.describe(summary))
  print(table(summary))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
  if args.out:
    plot(events, summary, pathlib.Path(args.out))
    print(f"plot: {args.out}")


if __name__ == "__main__":
  main()

"""Plot loss, throughput, grad norm and learning rate from the metrics.jsonl of one or several runs.

  python tools/plot_metrics.py RUN_OR_JSONL [RUN_OR_JSONL ...] --out=plot.png

Each argument is a workdir (its metrics.jsonl is read; on ``gs://`` or ``s3://`` the segments every run wrote, as one
file: jaxtrain.logs) or a JSONL file; runs are labelled by folder name.
Eval records (eval_loss) are drawn on the loss panel as dots. A data mixture's runs get a third row: each
component's token share (``mix/<name>``) and its training loss (``loss/<name>``, with ``eval_loss/<name>`` as dots,
also for ``eval.sets``).
"""

from __future__ import annotations

import io
import json
import sys

from absl import app, flags
from etils import epath

from jaxtrain import metrics, paths
from jaxtrain.errors import UserError

_OUT = flags.DEFINE_string("out", "metrics.png", "PNG file to write.")
PANELS = (("loss", "loss"), ("tokens_per_sec", "tokens / s"), ("grad_norm", "grad norm"), ("lr", "learning rate"))


def read(path: str) -> tuple[str, list[dict]]:
  p = epath.Path(paths.resolve(path))
  # Complete lines only (a live run may be appending one); on an object store, every run's segments as one file.
  records = metrics.read_records(p)
  if not records:
    raise FileNotFoundError(f"{path}: no metrics.jsonl records")
  return (p.parent.name if p.name.endswith(".jsonl") else p.name), records


def _components(runs, prefix: str) -> list[str]:
  return sorted({k[len(prefix):] for _, records in runs for r in records for k in r if k.startswith(prefix)})


def figure(runs: list[tuple[str, list[dict]]]):
  """The 2 x 2 panels of PANELS (a matplotlib Figure): one line per run, eval losses as dots; a third row for
  data mixtures (shares; per-component losses)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  mixed = _components(runs, "mix/")
  named_evals = _components(runs, "eval_loss/")
  rows = 3 if mixed or named_evals else 2
  fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), squeeze=False)
  for ax, (key, title) in zip(axes.flat, PANELS):
    for i, (label, records) in enumerate(runs):
      color = f"C{i}"  # one colour per run in every panel
      points = sorted({r["step"]: r[key] for r in records if key in r}.items())  # a re-run step: last value
      if points:
        ax.plot(*zip(*points), color=color, label=label)
      if key == "loss":
        evals = sorted({r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}.items())
        if evals:
          ax.plot(*zip(*evals), "o", color=color, label=f"{label} (eval)")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if key in ("loss", "grad_norm"):
      ax.set_yscale("log")
  if rows == 3:  # one colour per component, one line style per run
    share_ax, loss_ax = axes[2]
    names = sorted(set(mixed) | set(named_evals))
    for i, (label, records) in enumerate(runs):
      style = ("-", "--", ":", "-.")[i % 4]
      for j, name in enumerate(names):
        color = f"C{j}"
        for ax, key, marker in ((share_ax, f"mix/{name}", style), (loss_ax, f"loss/{name}", style),
                                (loss_ax, f"eval_loss/{name}", "o")):
          points = sorted({r["step"]: r[key] for r in records if key in r}.items())
          if points:
            ax.plot(*zip(*points), marker, color=color, label=f"{label}: {key}" if len(runs) > 1 else key)
    share_ax.set_title("mixture: token share per component")
    loss_ax.set_title("loss per component (eval: dots)")
    loss_ax.set_yscale("log")
    for ax in (share_ax, loss_ax):
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
      if ax.lines:
        ax.legend(fontsize="small")
  axes.flat[0].legend()
  fig.tight_layout()
  return fig


def plot(runs: list[tuple[str, list[dict]]], out: str) -> None:
  import matplotlib.pyplot as plt
  fig = figure(runs)
  if paths.is_url(out):  # matplotlib writes local files: the PNG is made in memory and written as the object
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    epath.Path(out).write_bytes(png.getvalue())
  else:
    fig.savefig(out, dpi=100)
  plt.close(fig)


def main(argv):
  if len(argv) < 2:
    print("usage: plot_metrics.py RUN_OR_JSONL [...] --out=plot.png", file=sys.stderr)
    sys.exit(2)
  try:
    runs = [read(a) for a in argv[1:]]
    out = paths.resolve(_OUT.value, "--out")
  except (FileNotFoundError, json.JSONDecodeError, UserError) as e:  # UserError: a store client not installed
    print(f"plot_metrics: error: {e}", file=sys.stderr)
    sys.exit(2)
  plot(runs, out)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)

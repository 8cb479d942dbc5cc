"""List a run's checkpoints: steps, metadata, and every tensor with shape, dtype and bytes.

  python tools/inspect_checkpoint.py PATH [--step=N] [--json]

PATH is a run's workdir (or an import's folder), its checkpoint folder (``<workdir>/checkpoints``), or one step
folder. Reads only metadata (no tensor data), so it is fast on any size of checkpoint. Shows the run's lineage (what
it started from, back to an import or a fresh init: jaxtrain.checkpoint.lineage) and the side files it carries.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
from absl import app, flags, logging
from etils import epath

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain.checkpoint import lineage
from jaxtrain import paths
from jaxtrain.errors import UserError

_STEP = flags.DEFINE_integer("step", None, "Step to detail (default: the newest).")
_JSON = flags.DEFINE_bool("json", False, "Print JSON instead of a table.")


def _root(path: epath.Path) -> epath.Path:
  return epath.Path(checkpoint_lib.checkpoints_folder(str(path)))


def describe(path: str, step: int | None = None) -> dict:
  path = epath.Path(paths.resolve(path))
  if (path / "state").exists():  # one step folder
    root, steps, step = path.parent, [int(path.name)], int(path.name)
  else:
    root = _root(path)
    if not root.exists():
      raise FileNotFoundError(f"{path}: no such folder")
    steps = [s for s in checkpoint_lib.committed_steps(root) if (root / str(s) / "state").exists()]
    if not steps:
      raise FileNotFoundError(f"{root}: no committed checkpoints")
    step = steps[-1] if step is None else step
  step_dir = root / str(step)
  meta_file = step_dir / "meta" / "metadata"
  meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
  tensors = []
  for path_, leaf in sorted(checkpoint_lib.saved_tensors(step_dir / "state").items()):
    shape = tuple(leaf.shape)
    dtype = np.dtype(leaf.dtype)
    tensors.append({"name": path_, "shape": list(shape), "dtype": dtype.name,
                    "bytes": math.prod(shape) * dtype.itemsize})
  committed = {str(s) for s in checkpoint_lib.committed_steps(root)}
  others = sorted(p.name for p in root.iterdir() if p.name not in committed)
  try:
    workdir = lineage.workdir_of(str(step_dir), checkpoint_lib.saved_config(str(step_dir)))
  except UserError:  # no config: a checkpoint not written by a run
    workdir = str(root.parent)
  side = lineage.side_dir(workdir)
  return {"directory": str(root), "steps": steps, "step": step, "meta": meta, "tensors": tensors,
          "total_bytes": sum(t["bytes"] for t in tensors), "not_committed_or_set_aside": others,
          "lineage": lineage.chain(lineage.read(workdir)),
          "side_files": sorted(p.name for p in epath.Path(side).iterdir()) if side else []}


def main(argv):
  logging.set_verbosity(logging.WARNING)  # Orbax narrates every read at INFO
  if len(argv) != 2:
    print("usage: inspect_checkpoint.py PATH [--step=N] [--json]", file=sys.stderr)
    sys.exit(2)
  try:
    info = describe(argv[1], _STEP.value)
  except (FileNotFoundError, ValueError, UserError) as e:  # UserError: a store URL whose client is not installed
    print(f"inspect_checkpoint: error: {e}", file=sys.stderr)
    sys.exit(2)
  if _JSON.value:
    print(json.dumps(info, indent=2))
    return
  print(f"{info['directory']}: steps {', '.join(map(str, info['steps']))}")
  if info["not_committed_or_set_aside"]:
    print(f"  also present (ignored on restore): {', '.join(info['not_committed_or_set_aside'])}")
  meta = {k: v for k, v in info["meta"].items() if k != "fingerprints"}
  if "fingerprints" in info["meta"]:
    meta["fingerprints"] = f"{len(info['meta']['fingerprints'])} arrays"
  print(f"step {info['step']}: " + ", ".join(f"{k}={v}" for k, v in meta.items()))
  for i, link in enumerate(info["lineage"]):
    origin = (f"imported from {link['import']}" if link["import"] else f"started from {link['parent']}" if
              link["parent"] else "a fresh init")
    version = (link.get("jaxtrain") or {})
    print(f"{'lineage: ' if i == 0 else '      <- '}{origin} ({link['created']}, jaxtrain {version.get('version')}"
          f"{' ' + version['commit'][:10] if version.get('commit') else ''})")
  if not info["lineage"]:
    print("lineage: not recorded")
  print(f"side files (hf/): {', '.join(info['side_files']) or 'none'}")
  width = max(len(t["name"]) for t in info["tensors"])
  for t in info["tensors"]:
    print(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<22} {t['dtype']:<9} {t['bytes']:>14,}")
  print(f"  {'total':<{width}}  {'':<22} {'':<9} {info['total_bytes']:>14,}")


if __name__ == "__main__":
  app.run(main)

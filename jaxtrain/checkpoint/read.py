"""Checkpoints read outside a run's own tiers: another run's, to start from (``checkpoint.restore_from``:
:func:`restore_from`), and the step folder a user names to a tool (:func:`step_dir`, :func:`saved_config`:
tools/convert_hf.py export, jaxtrain.generate). All of them are persistent-tier
checkpoints (Orbax step folders), local or on an object store; only committed steps are found."""

from __future__ import annotations

import json
import os
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from jaxtrain import integrity
from jaxtrain import paths
from jaxtrain.checkpoint.errors import CheckpointError, CorruptCheckpoint, describe, read_failure
from jaxtrain.checkpoint.persistent import (committed_steps, quiet_libraries, reach, saved_tensors, shape_mismatch,
                                            verify)


def restore_from(path: str, abstract_state: Any, params_only: bool,
                 optional: tuple[str, ...] = (), subset: bool = False) -> tuple[Any, int]:
  """Reads another run's checkpoint: ``path`` is a run's workdir or import folder, its checkpoints folder (the newest
  step of either) or one step folder.
  Returns the restored state pytree (only its ``params`` are meaningful when ``params_only``) and the step.
  ``optional`` (with ``params_only``): top-level params keys that the checkpoint may lack (LoRA adapters, when
  starting from a base model); those it lacks are not read and are absent from the returned params. Any other
  difference between its params and ``abstract_state``'s (a missing or extra tensor, another shape) is a
  CheckpointError naming it (metadata only, before any tensor is read). ``subset`` (with ``params_only``):
  ``abstract_state``'s params name only some of the checkpoint's (read one at a time: tools/convert_hf.py export);
  the others are not compared, nor read."""
  quiet_libraries()
  root = epath.Path(paths.resolve(path, "checkpoint.restore_from"))
  reach(os.fspath(root))
  step_dir = root if (root / "state").exists() else None
  if step_dir is None:
    folder = epath.Path(checkpoints_folder(os.fspath(root)))
    steps = committed_steps(folder)
    if not steps:
      raise CheckpointError(path, "no committed checkpoint found", "point checkpoint.restore_from at a run's "
                            "workdir, its checkpoints folder or one of its step folders")
    step_dir = folder / str(steps[-1])
  item = step_dir / "state"
  target = {"params": abstract_state.params} if params_only else abstract_state
  try:
    if params_only:  # read just the params subtree, whatever else (optimizer state) the other run saved
      saved = {k: v for k, v in saved_tensors(item).items() if k.startswith("params/")}
      if subset:
        saved = {k: v for k, v in saved.items() if k in integrity.named({"params": abstract_state.params})}
      absent = [k for k in optional if k in abstract_state.params and not any(
          n.startswith(f"params/{k}/") for n in saved)]
      target = {"params": {k: v for k, v in abstract_state.params.items() if k not in absent}}
      mismatch = shape_mismatch(saved, target)
      if mismatch:
        raise CheckpointError(os.fspath(step_dir), f"holds params of another model ({mismatch})",
                              "check that the checkpoint matches this model config (model.lora included)")
      with ocp.PyTreeCheckpointer() as ckptr:
        restored = ckptr.restore(item, args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    else:
      with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(item, target)
    meta_file = step_dir / "meta" / "metadata"
    verify(restored, json.loads(meta_file.read_text()) if meta_file.exists() else {})
  except CorruptCheckpoint as e:
    raise CheckpointError(os.fspath(step_dir), f"is corrupt ({e})", "restore from another step or run") from None
  except CheckpointError:
    raise
  except Exception as e:
    # The storage's or the memory's failure by its cause (exit 2 or 75: a store that does not answer is no mismatch);
    # bytes that do not decode are a corrupt checkpoint; anything else most likely another model's layout.
    stop = read_failure(e, os.fspath(step_dir), int(step_dir.name) if step_dir.name.isdigit() else -1)
    if isinstance(stop, CorruptCheckpoint):
      raise CheckpointError(os.fspath(step_dir), f"is corrupt ({stop})", "restore from another step or run") from None
    if stop is not e:
      raise stop from e
    raise CheckpointError(os.fspath(step_dir), f"cannot restore ({describe(e)})",
                          "check that the checkpoint matches this model config") from None
  return restored, int(step_dir.name) if step_dir.name.isdigit() else -1


def step_dir(path: str, step: int | None = None) -> str:
  """The step folder that ``path`` names: a run's workdir, its checkpoints folder, or a step folder itself (local or
  on an object store); the newest committed step unless ``step``. Raises CheckpointError (one line) when there is
  none."""
  path = paths.resolve(path)
  root = epath.Path(path)
  if (root / "state").exists():
    if step is not None and root.name != str(step):
      raise CheckpointError(path, f"is step {root.name}, not --step={step}", "drop --step or pass its folder")
    return path
  folder = epath.Path(checkpoints_folder(path))
  steps = committed_steps(folder)
  if not steps:
    raise CheckpointError(path, "holds no committed checkpoint",
                          "pass a run's workdir, its checkpoints folder or a step folder")
  if step is not None and step not in steps:
    raise CheckpointError(os.fspath(folder), f"has no step {step} (it has {', '.join(map(str, steps))})",
                          "pick one of them")
  return os.fspath(folder / str(step if step is not None else steps[-1]))


def saved_config(step_dir: str) -> dict:
  """The resolved config a checkpoint was written with: its ``config`` item, else its workdir's config.json."""
  for f in (epath.Path(step_dir) / "config" / "metadata", epath.Path(step_dir).parent.parent / "config.json"):
    if f.exists():
      return json.loads(f.read_text())
  raise CheckpointError(step_dir, "has no config item and its workdir no config.json",
                        "pass a checkpoint written by jaxtrain")


def checkpoints_folder(path: str) -> str:
  """The folder of step folders that ``path`` names: a workdir's (``checkpoints/``, or the ``checkpoint.dir`` its
  config.json names), an import's, or ``path`` itself."""
  root = epath.Path(path)
  if (root / "checkpoints").exists():
    return os.fspath(root / "checkpoints")
  config_file = root / "config.json"
  if config_file.exists():  # a workdir whose checkpoints are kept apart
    try:
      folder = (json.loads(config_file.read_text()).get("checkpoint") or {}).get("dir")
    except ValueError:
      folder = None
    if folder:
      return folder
  return path

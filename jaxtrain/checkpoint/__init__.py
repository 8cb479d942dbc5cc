"""Checkpoints: a run's :class:`Checkpointer` over its tiers (:class:`Tier`; the persistent Orbax tier,
:class:`PersistentTier`, and the node-local one, :class:`LocalTier`; a user's, registered in :data:`TIERS`), the
data position they save (:class:`DataPosition`), what goes wrong (:mod:`.errors`), and reading another run's
checkpoint or a step folder a tool is given (:mod:`.read`), and where a run comes from (:mod:`.lineage`).

  tier.py          the Tier and DataPosition protocols, the TIERS registry
  checkpointer.py  Checkpointer: which tier saves a step, the restore agreed across tiers, rollback, fallback
  persistent.py    the persistent tier (Orbax), fingerprints checked on restore; committed_steps of a folder
  local.py         the node-local tier (each process's shards on its own disk)
  read.py          restore_from (checkpoint.restore_from), step_dir, saved_config, checkpoints_folder
  lineage.py       a run's lineage.json and its hf/ side files (tokenizer, chat template), copied at its start;
                   side_files_dir
  errors.py        CheckpointError, SaveFailed, StoreUnreachable, StorageFailed, CorruptCheckpoint,
                   NonFiniteState, TierUnavailable; a failed read told apart: the environment's, the bytes', a bug

This module holds the ``checkpoint`` config group.
"""

from __future__ import annotations

import ml_collections

from jaxtrain import paths
from jaxtrain.checkpoint.checkpointer import Checkpointer, checkpoint_due
from jaxtrain.checkpoint.errors import (CheckpointError, CorruptCheckpoint, NonFiniteState, SaveFailed,
                                        StorageFailed, StoreUnreachable, TierUnavailable, describe, environment_error,
                                        proven_corrupt, read_failure)
from jaxtrain.checkpoint.local import LocalTier
from jaxtrain.checkpoint.persistent import (LIBRARY_LOG_FILTER, PersistentTier, committed_steps, quiet_libraries,
                                            saved_tensors, verify)
from jaxtrain.checkpoint import lineage
from jaxtrain.checkpoint.lineage import side_files_dir
from jaxtrain.checkpoint.read import checkpoints_folder, restore_from, saved_config, step_dir
from jaxtrain.checkpoint.tier import TIERS, DataPosition, Tier
from jaxtrain.errors import ConfigError, check_choice, check_positive

__all__ = ["Checkpointer", "checkpoint_due", "CheckpointError", "CorruptCheckpoint", "NonFiniteState", "SaveFailed",
           "StorageFailed", "StoreUnreachable", "TierUnavailable", "describe", "environment_error", "proven_corrupt",
           "read_failure", "LocalTier", "LIBRARY_LOG_FILTER",
           "PersistentTier", "committed_steps", "quiet_libraries", "saved_tensors", "verify", "restore_from", "saved_config",
           "side_files_dir", "step_dir", "lineage", "checkpoints_folder", "TIERS", "DataPosition", "Tier", "defaults", "validate"]


def defaults() -> ml_collections.ConfigDict:
  """The ``checkpoint`` config group."""
  return ml_collections.ConfigDict({
      # The tiers a run saves to and resumes from (jaxtrain.checkpoint.TIERS), the persistent one first. The local
      # tier is on only with local_dir; a registered tier of yours is added by its name.
      "tiers": ("persistent", "local"),
      "dir": "",  # default: <workdir>/checkpoints; a local folder, gs:// or s3://
      "every_steps": 0,  # save every N steps (0: off); the last step and preemptions always save
      "every_minutes": 0.0,  # and/or at least every T minutes (0: off)
      "keep_last": 3,  # retention: the newest K checkpoints ...
      "keep_every": 0,  # ... plus every M-th step kept permanently (0: none)
      "async": True,  # save in the background; the loop blocks only for the device-to-host copy
      "verify": True,  # fingerprint every array at save, check them (and finiteness) at restore
      "restore_from": "",  # start from another run's checkpoint (folder of steps, or one step folder)
      "restore_mode": "params",  # params | state: what restore_from takes from that checkpoint
      # A node-local tier (jaxtrain.checkpoint.local): each process saves its own shards to this folder on its
      # own disk (a local NVMe, /dev/shm; empty: off) every local_every_steps, keeping local_keep_last of them.
      # A failed local save is counted and the run goes on; after local_max_failures in a row the tier is off.
      "local_dir": "",
      "local_every_steps": 0,
      "local_keep_last": 2,
      "local_max_failures": 3,
  })


def validate(config) -> None:
  check_positive(config, ["checkpoint.every_steps", "checkpoint.every_minutes", "checkpoint.keep_every"],
                 allow_zero=True)
  check_positive(config, ["checkpoint.keep_last", "checkpoint.local_keep_last", "checkpoint.local_max_failures"])
  check_positive(config, ["checkpoint.local_every_steps"], allow_zero=True)
  c = config.checkpoint
  tiers = c.tiers
  if isinstance(tiers, str) or not tiers or tiers[0] != "persistent" or len(set(tiers)) != len(tiers):
    raise ConfigError("checkpoint.tiers", f"{tiers!r} is not a tuple of distinct tier names, 'persistent' first",
                      "e.g. --config.checkpoint.tiers=\"('persistent', 'local')\"")
  for name in tiers:
    TIERS.get(name)
  if c.local_dir and "local" not in tiers:
    raise ConfigError("checkpoint.local_dir", f"is set but checkpoint.tiers {tiers!r} has no 'local'",
                      "add 'local' to checkpoint.tiers, or unset checkpoint.local_dir")
  if c.local_dir and not c.local_every_steps:
    raise ConfigError("checkpoint.local_every_steps", "must be > 0 when checkpoint.local_dir is set",
                      "set how often the local tier saves, e.g. --config.checkpoint.local_every_steps=100")
  if c.local_dir and paths.is_url(c.local_dir):
    raise ConfigError("checkpoint.local_dir", f"'{c.local_dir}' is not on a local disk",
                      "give a node-local folder (a local NVMe, /dev/shm); checkpoint.dir is the persistent tier")
  check_choice(config, "checkpoint.restore_mode", ("params", "state"))

"""Entry point: ``python -m jaxtrain.main --config=configs/NAME.py[:variant] --config.key=value``."""

from __future__ import annotations

import gc
import logging as std_logging
import os
import secrets
import sys
import time
import traceback

import jax
import numpy as np
from absl import app, flags, logging
from jax.experimental import multihost_utils
from ml_collections import config_flags
from ml_collections.config_flags import config_flags as config_flags_impl  # its file parser, to subclass

from jaxtrain import _compat
from jaxtrain import config as config_lib
from jaxtrain import distributed
from jaxtrain import errors
from jaxtrain import exits
from jaxtrain import models
from jaxtrain import paths
from jaxtrain import restarts
from jaxtrain.checkpoint import CheckpointError, SaveFailed, describe
from jaxtrain.train import trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).",
                                          lock_config=True)
flags.mark_flag_as_required("config")
_CONFIG_VALUE = flags.DEFINE_string("config_value", None, "Print the value of this config key (the config file's, "
                                    "with the --config.* overrides) and exit, starting nothing: for launchers.")
_ARGV: list[str] = []  # the command line being parsed


class _FamilyAwareConfigFile(config_flags_impl.ConfigFileFlagParser):
  """Loads the config file like ml_collections does, then, if the command line picks another model family
  (``--config.model.name=F``), swaps in family F's ``model`` group (its own keys and defaults) before the
  ``--config.*`` overrides are applied, so that ``--config.model.<a key of F>=...`` works. ml_collections applies
  overrides to the keys the file returned and has no hook for a key that changes the schema: we replace the
  flag's parser (its public ``parser`` attribute) with this subclass."""

  def parse(self, path):
    config = super().parse(path)  # constructed with lock_config=False: we lock after the swap
    name = _model_name_override(_ARGV)
    if name is not None and hasattr(config, "model") and name != config.model.get("name"):
      config.model = models.defaults(name)  # ConfigError naming model.name if F is not registered
    config.lock()
    return config


flags.FLAGS["config"].parser = _FamilyAwareConfigFile("config", lock_config=False)


def _model_name_override(argv: list[str]) -> str | None:
  """The last ``--config.model.name=F`` (or ``--config.model.name F``) on the command line, if any."""
  name = None
  for i, arg in enumerate(argv):
    if arg.startswith("--config.model.name="):
      name = arg.split("=", 1)[1]
    elif arg == "--config.model.name" and i + 1 < len(argv):
      name = argv[i + 1]
  return name


def _fail(message: str, code: int = exits.USER_ERROR, at_once: bool = False) -> None:
  print(f"jaxtrain: error: {message}", file=sys.stderr)
  # On a multi-process job the others stop too, by this cause and with this code (not as a lost peer).
  if distributed.stop_job(code, message) or at_once:
    _leave(code)
  sys.exit(code)


def _leave(code: int) -> None:
  """Exits now, after a failed checkpoint save has been reported. Orbax's signalling threads of the failed async
  save are not daemons and wait (for minutes) for signals that never come; a normal exit joins them and hangs
  after the one-line error (seen on Python 3.12 in about one run of six). The run's files are closed by now."""
  std_logging.shutdown()  # flushes train.log
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with every user mistake turned into one line and exit code 2."""
  _ARGV[:] = argv
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.keys()  # config files load lazily: force it so that load errors surface here
    return rest
  except flags.Error as e:  # wrong type, missing --config, unparsable value, unknown flag
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    _fail(lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}")  # drop a config file's traceback
  except config_lib.UserError as e:  # model.name names no registered family
    _fail(str(e))
  except (AttributeError, KeyError) as e:  # ml_collections: override of a key that does not exist
    _fail(str(_unknown_key(argv) or e))
  except Exception as e:  # the config file is missing, or its get_config() raised
    cause = [line.strip() for line in str(e).splitlines() if line.strip()]
    _fail(f"--config: cannot load the config file: {cause[-1] if cause else type(e).__name__}; "
          "pass an existing configs/*.py file (and a variant it knows)")


def _unknown_key(argv: list[str]) -> config_lib.ConfigError | None:
  loaded = flags.FLAGS["config"].value  # the file's config (with the family swapped in), when it loaded
  base = loaded if loaded is not None else config_lib.base_config(_model_name_override(argv) or "llama")
  known = set(config_lib.flat_keys(base))
  for arg in argv[1:]:
    key = arg.split("=")[0].removeprefix("--config.")
    if arg.startswith("--config.") and key not in known and not any(k.startswith(key + ".") for k in known):
      return config_lib.unknown_key_error(key, base)
  return None


def use_compilation_cache(config) -> None:
  """Points JAX's persistent compilation cache at ``config.compilation_cache_dir`` unless JAX already has one
  (JAX_COMPILATION_CACHE_DIR, or set by the caller) or the key is ''. Programs that compile in under a second are
  not kept (JAX's own threshold)."""
  if not jax.config.jax_compilation_cache_dir and config.compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", paths.resolve(config.compilation_cache_dir))


def check_restart_budget(config) -> None:
  """Raises :class:`jaxtrain.exits.RestartsExhausted` when the workdir's restarts of the last hour exceed
  ``distributed.max_restarts_per_hour`` (:mod:`jaxtrain.restarts`), else arms the recording of this start's
  restartable exits. Process 0 reads the records and every process gets its verdict, so that all stop or none."""
  distributed.validate(config)
  workdir, budget = paths.resolve(config.workdir), config.distributed.max_restarts_per_hour
  verdict = None
  if jax.process_index() == 0:
    try:
      restarts.prune(workdir)
      verdict = restarts.check(workdir, budget)
    except Exception as e:  # noqa: BLE001 - an unreadable workdir: the run's own start reports it
      logging.warning("could not read the restarts of %s: %s", workdir, e)
  # Whether to stop, and this start's name (its time and a random number, from process 0).
  header = np.array([verdict is not None, int(time.time()), secrets.randbits(31)], np.int32)
  if jax.process_count() > 1:
    header = np.asarray(multihost_utils.broadcast_one_to_all(header))
  if header[0]:
    raise exits.RestartsExhausted(verdict or "the restarts of the last hour exceed distributed.max_restarts_per_hour "
                                  "(process 0 names them)")
  restarts.arm(workdir, f"{int(header[1]):010d}-{int(header[2]):08x}", jax.process_index())


def known_stop(e: BaseException) -> tuple[int, str] | None:
  """``(exit code, the one line printed)`` of a stop whose cause is known (no traceback): a user's mistake (2), a
  cause a restart cures (75, its cause named), the restart budget spent (3), training stopped on purpose (1); None
  for anything else (a bug: 1 with its traceback in train.log)."""
  if isinstance(e, config_lib.UserError):
    return exits.USER_ERROR, f"jaxtrain: error: {e}"
  if isinstance(e, exits.RestartsExhausted):
    return exits.RESTARTS_EXHAUSTED, f"jaxtrain: stopped: {e} (exit {exits.RESTARTS_EXHAUSTED})"
  if isinstance(e, exits.Restart):
    named = "" if str(e).startswith(e.cause) else f"{e.cause}: "  # the cause first, once
    return exits.RESTART, f"jaxtrain: stopped: {named}{e}; restart the same command to resume (exit {exits.RESTART})"
  if isinstance(e, trainer.TrainingStopped):
    return exits.BUG, f"jaxtrain: stopped: {e}"
  return None


def main(argv: list[str]) -> None:
  del argv
  # The objects of the imports above live as long as the process: out of the collector's sight, the full collections
  # that tracing the model triggers do not walk them again each time (0.35 s of a tiny run's 3 s went to those).
  gc.freeze()
  config = _CONFIG.value
  if _CONFIG_VALUE.value is not None:  # a launcher asks for one value: nothing starts
    key = _CONFIG_VALUE.value
    if key not in config_lib.flat_keys(config):
      _fail(str(config_lib.unknown_key_error(key, config)))
    print(errors.value(config, key))
    return
  _compat.warn_if_untested()
  use_compilation_cache(config)  # before the first compile
  try:
    distributed.initialize(config.distributed)  # before anything starts JAX's backends
  except config_lib.UserError as e:
    _fail(str(e))
  if jax.process_index() > 0:  # one voice: other processes report only warnings and errors
    logging.set_verbosity(logging.WARNING)
  logging.info("jax %s on %d %s devices (%d processes)", jax.__version__, jax.device_count(),
               jax.default_backend(), jax.process_count())
  try:
    if config.dry_run:
      trainer.dry_run(config)
      return
    check_restart_budget(config)
    trainer.train(config)
  except config_lib.UserError as e:
    _fail(str(e), at_once=isinstance(e, CheckpointError))
  except (exits.RestartsExhausted, exits.Restart, trainer.TrainingStopped) as e:
    code, line = known_stop(e)
    if isinstance(e, exits.Restart):
      restarts.record(e.cause, str(e))
    print(line, file=sys.stderr)
    if isinstance(e, exits.Restart) and e.cause != exits.PREEMPTED:
      # A cause one process met (its lease lost, its store's answer): every process stops by it, with this code, not
      # as a lost peer. (A preemption stops every process at the same step already.)
      distributed.stop_job(code, line.removeprefix("jaxtrain: stopped: "))
      _leave(code)  # a failed async save's threads would hold up a normal exit (see _leave)
    sys.exit(code)
  except Exception as e:  # not the user's mistake: a lost peer, or a bug here or in a library
    cause = distributed.lost_peer(e)
    if cause:  # another process went away (by the error's type and status code): restart the job
      distributed.exit_lost_peer(f"{cause}: {describe(e)}")
    log_file = getattr(e, "log_file", None)
    if log_file is None and jax.process_count() == 1:  # before the run had a log file: the traceback to the console
      raise
    if log_file is None:  # a process that writes no log file (all but process 0): the traceback to its stderr, and
      traceback.print_exc()  # the job still stops by this cause on every process (not as a lost peer, exit -6)
    what = str(e) if isinstance(e, SaveFailed) else f"unexpected {describe(e)}; this is a bug"
    where = f"the traceback is in {log_file}" if log_file else "the traceback is above"
    _fail(f"{what}; {where}", code=exits.BUG, at_once=isinstance(e, SaveFailed))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)

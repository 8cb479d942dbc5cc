"""Entry point: ``python -m jaxtrain.main --config=configs/NAME.py[:variant] --config.key=value``."""

from __future__ import annotations

import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxtrain import config as config_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).",
                                          lock_config=True)
flags.mark_flag_as_required("config")


def _fail(message: str) -> None:
  print(f"jaxtrain: error: {message}", file=sys.stderr)
  sys.exit(2)


def parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with every user mistake turned into one line and exit code 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # wrong type, missing --config, unparsable value, unknown flag
    _fail(str(e).splitlines()[0])
  except (AttributeError, KeyError) as e:  # ml_collections: override of a key that does not exist
    match = re.search(r"--config\.([\w.]+)", " ".join(a for a in argv if a.startswith("--config.")))
    bad = next((a.split("=")[0][len("--config."):] for a in argv[1:] if a.startswith("--config.")
                and _missing(a.split("=")[0][len("--config."):])), match.group(1) if match else str(e))
    _fail(str(config_lib.unknown_key_error(bad, flags.FLAGS["config"].value or config_lib.base_config())))
  except (OSError, SyntaxError, ImportError) as e:  # config file missing or broken
    _fail(f"--config: cannot load the config file: {e}; pass an existing configs/*.py file")


def _missing(key: str) -> bool:
  cfg = flags.FLAGS["config"].value or config_lib.base_config()
  for part in key.split("."):
    if not hasattr(cfg, "keys") or part not in cfg:
      return True
    cfg = cfg[part]
  return False


def main(argv: list[str]) -> None:
  del argv
  import jax  # after flag parsing, so a bad command line never pays for (or is hidden by) jax start-up

  from jaxtrain.train import trainer

  config = _CONFIG.value
  logging.info("jax %s on %d %s devices (%d processes)", jax.__version__, jax.device_count(),
               jax.default_backend(), jax.process_count())
  try:
    trainer.train(config)
  except config_lib.ConfigError as e:
    _fail(str(e))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)

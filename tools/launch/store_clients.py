"""The object-store clients a run's config needs, as pip requirements: for every ``gs://`` and ``s3://`` URL among the
config's values (the workdir, checkpoint.dir, checkpoint.restore_from, data paths, a mixture's or an eval set's
paths: any string value, and a URL inside a longer one), the requirements of the setup.cfg extra that installs its
client (jaxtrain.stores.CLIENTS: gs -> the ``gcs`` extra, gcsfs; s3 -> ``s3``, s3fs), as the installed jaxtrain
declares them. For launchers that install jaxtrain on fresh machines (tools/launch/tpu_worker.sh): a worker without
gcsfs stops at start on a gs:// workdir.

  python tools/launch/store_clients.py --config=configs/NAME.py[:variant] [--config.key=value ...]

prints one requirement a line (``gcsfs>=2024.2``; nothing when the config names no store), for ``pip install``. The
flags are jaxtrain.main's (the config file, its variant, the ``--config.*`` overrides, another model family's
keys); a mistake in them is one line and exit 2, as it is for jaxtrain.main. It reads the config and the extras
with the installed jaxtrain: install jaxtrain first, then ask, then install what it prints. (The requirements, not
``pip install -e ".[gcs]"``: that builds jaxtrain's editable install again, 4-5 s of a worker's start for nothing.)
"""

from __future__ import annotations

import importlib.metadata
import re

import ml_collections
from absl import app, flags
from packaging.requirements import Requirement

from jaxtrain import stores

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def schemes(value) -> set[str]:
  """The URL schemes (lower case) of every URL in ``value``: a config, a dict or a sequence (each value in it), or
  a string (each URL in it, also one inside a longer string: ``web=gs://bucket/web:0.7``)."""
  if isinstance(value, str):
    return {s.lower() for s in _SCHEME.findall(value)}
  if isinstance(value, (ml_collections.ConfigDict, dict)):
    value = list(value.values())
  if isinstance(value, (list, tuple)):
    return set().union(*(schemes(v) for v in value))
  return set()


def extras(config) -> list[str]:
  """The extras of setup.cfg that ``config`` needs for its stores, sorted."""
  return sorted({stores.CLIENTS[s][1] for s in schemes(config) if s in stores.CLIENTS})


def requirements(names: list[str]) -> list[str]:
  """What the installed jaxtrain requires for the extras ``names`` (its metadata: setup.cfg's extras, the one place
  they are written), without their markers."""
  found = []
  for line in importlib.metadata.requires("jaxtrain") or ():
    requirement = Requirement(line)
    marker = requirement.marker
    # An extra's requirement holds only under its extra; one that holds without any is not an extra's.
    if marker and not marker.evaluate({"extra": ""}) and any(marker.evaluate({"extra": n}) for n in names):
      requirement.marker = None
      found.append(str(requirement))
  return found


def main(argv: list[str]) -> None:
  del argv
  for requirement in requirements(extras(flags.FLAGS["config"].value)):  # parsed by entry.parse_flags
    print(requirement)


if __name__ == "__main__":
  # jaxtrain.main's flags and their parsing: the same command line as the run's. Imported here, not at the top: it
  # defines absl flags, which a process that loads this module for its functions (a test) may have defined already.
  from jaxtrain import main as entry
  app.run(main, flags_parser=entry.parse_flags)

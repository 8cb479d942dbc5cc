"""The TPU pod launcher's worker command (tools/launch/tpu_worker.sh) on a fresh machine: it installs jaxtrain and
the object-store clients its config's URLs need (tools/launch/store_clients.py), then trains on the store. The
launcher around it (gcloud, exit codes, restarts) is tests/test_distributed.py's."""

import importlib.util
import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import sysconfig

import fsspec
import pytest

from jaxtrain.config import base_config
from tests import object_store
from tests.test_checkpoint import BASE, run_env

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _store_clients():
  spec = importlib.util.spec_from_file_location("store_clients", ROOT / "tools" / "launch" / "store_clients.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_clients_a_config_needs_are_those_of_every_store_url_in_it():
  module = _store_clients()
  extras = module.extras
  c = base_config()
  assert extras(c) == []  # local paths only
  c.checkpoint.restore_from = "s3://bucket/imported/checkpoints"
  assert extras(c) == ["s3"]
  c.data.mixture = "web=data/web:0.7,code=GS://bucket/code:0.3"  # a URL inside a longer value, any case
  assert extras(c) == ["gcs", "s3"]
  c.data.mixture, c.eval.sets = "", "wiki@arrayrecord=gs://bucket/wiki"
  assert extras(c) == ["gcs", "s3"]
  c.checkpoint.restore_from, c.eval.sets, c.workdir = "", "", "https://example.com/x"  # not a store's
  assert extras(c) == []
  # As pip requirements: the installed jaxtrain's extras (setup.cfg), not the test extra's gcsfs and s3fs[boto3].
  assert module.requirements(["gcs", "s3"]) == ["gcsfs>=2024.2", "s3fs>=2024.2"]
  assert module.requirements([]) == []


def _fresh_venv(base: pathlib.Path) -> pathlib.Path:
  """A new virtualenv that sees the packages installed for the tests except jaxtrain and the object stores'
  clients (gcsfs, s3fs), through a folder of links to the rest (a .pth file names it): pip finds jaxtrain's
  dependencies there, and what the launcher installs (jaxtrain, a store's client) goes into the new venv, as on a
  fresh worker whose image has jax. Installing jax, flax, orbax and grain from scratch instead costs minutes."""
  venv, farm = base / "venv", base / "site"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # pip: the farm's
  farm.mkdir()
  hidden = ("gcsfs", "s3fs", "jaxtrain", "__editable__")
  for folder in dict.fromkeys(p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]
                              if os.path.isdir(p)):
    for name in os.listdir(folder):
      if not name.startswith(hidden) and not name.endswith(".pth") and not (farm / name).exists():
        (farm / name).symlink_to(os.path.join(folder, name))
  purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                            "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
  pathlib.Path(purelib, "_test_environment.pth").write_text(f"{farm}\n")
  return venv


def _found(venv: pathlib.Path, *modules: str) -> dict[str, str | None]:
  """Where each of ``modules`` would import from in ``venv`` (not from the current folder; found, not imported),
  None where it would not."""
  r = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util, json, sys; print(json.dumps("
                      "{m: getattr(importlib.util.find_spec(m), 'origin', None) for m in sys.argv[1:]}))", *modules],
                     capture_output=True, text=True, cwd=venv, check=True)
  return json.loads(r.stdout)


@pytest.mark.slow
def test_a_fresh_worker_installs_the_client_of_its_gs_workdir_then_trains_and_checkpoints_there(tmp_path):
  """tools/launch/tpu_worker.sh, as tpu_vm.sh runs it on each worker, in a checkout on a machine with no jaxtrain
  and no gcsfs, with its workdir on a GCS server (localhost; no accelerator's extra: a CPU host): it installs
  jaxtrain, learns from the config that it needs the gcs extra and installs gcsfs, then trains and checkpoints on
  the store, and reports its restart budget and exit code as the launcher reads them."""
  repo = tmp_path / "jaxtrain"
  files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split("\0")
  for name in filter(None, files):
    if (ROOT / name).is_file():
      (repo / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(ROOT / name, repo / name)
  venv = _fresh_venv(tmp_path)
  found = _found(venv, "jax", "gcsfs", "s3fs", "jaxtrain")
  assert found["jax"] and not found["gcsfs"] and not found["s3fs"] and not found["jaxtrain"], found
  with object_store.serve("gs") as store:
    workdir = store.url("runs/pod")
    env = {**{k: v for k, v in run_env().items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}, **store.env,
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "ACCELERATOR": ""}
    r = subprocess.run(["bash", "tools/launch/tpu_worker.sh", *BASE, "--config.train.steps=2",
                        f"--config.workdir={workdir}"], cwd=repo, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.splitlines() == ["jaxtrain-restart-budget=6", "jaxtrain-exit-code=0"], r.stdout
    assert "done: step 2/2" in r.stderr and f"checkpoint {workdir}/checkpoints/2" in r.stderr, r.stderr[-3000:]
    fs, path = fsspec.core.url_to_fs(workdir)
    assert fs.exists(f"{path}/checkpoints/2/commit_success.txt")  # step 2, committed on the store
  found = _found(venv, "gcsfs", "s3fs", "jaxtrain")
  assert found["gcsfs"].startswith(str(venv)), found  # installed by the launcher, into the fresh venv
  assert found["jaxtrain"] == str(repo / "jaxtrain" / "__init__.py")  # the checkout, editable
  assert not found["s3fs"]  # the config names no s3:// URL

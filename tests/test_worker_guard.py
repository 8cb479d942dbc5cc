"""tests/worker_guard.py: a test worker that dies in native code while a process it forked lives on ends the run
with the crash reported, instead of the run waiting for that process (here it would wait ten minutes)."""

import pathlib
import subprocess
import sys
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

DIES = """
import multiprocessing, os, time

def _linger():
  time.sleep(600)

def test_dies_while_a_forked_child_lives():
  multiprocessing.get_context("fork").Process(target=_linger).start()
  os.abort()

def test_after_the_crash_in_the_same_file():
  pass
"""


def test_a_dead_worker_with_a_live_child_ends_the_run(tmp_path):
  (tmp_path / "test_dies.py").write_text(textwrap.dedent(DIES))
  (tmp_path / "test_fine.py").write_text("def test_fine():\n  pass\n")
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  start = time.monotonic()
  r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.worker_guard", "-p", "no:cacheprovider", "-q",
                      "-n", "2", "--dist", "loadfile", "--max-worker-restart=0", "-c", str(tmp_path / "pytest.ini"),
                      "--rootdir", str(tmp_path), str(tmp_path)],
                     cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
  assert "crashed while running 'test_dies.py::test_dies_while_a_forked_child_lives'" in r.stdout, r.stdout[-3000:]
  assert "tests/worker_guard.py: worker gw" in r.stderr and "killing them so that the run ends" in r.stderr
  assert time.monotonic() - start < 60

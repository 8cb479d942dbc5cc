"""Command-line runs forked from a Python process that has the libraries imported: ``run_many`` for the suite's
error cases, ``run_entry`` for the processes of multi-process jobs (tests/multiprocess.py ``Forked``, which forks
them from multiprocessing's forkserver and gives each its own environment).

A command that ends at a user mistake (exit 2, one line) runs for a fraction of a second, but its process pays
~2 CPU-seconds to start and stop Python with jax, flax, orbax and grain loaded, and the suite has about 80 of them.
``run_many`` starts one process that imports those libraries (never an entry module itself: those define their
flags when run) and forks it once per command. The fork runs the command's entry as ``python -m module`` or
``python script.py`` would, as ``__main__`` with the command's argv, its stdout and stderr in their own files, and
ends with the status the interpreter would give (``SystemExit``'s code, 1 and the traceback for an uncaught
exception) after the ``atexit`` functions. Only the environment is shared: JAX reads its variables at import, so
every command runs in this test process's environment.

  python tests/forked.py < job.json   ({"argvs": [argv, ...], "preload": [module, ...], "timeout": seconds},
                                        each argv ``["-m", module, ...]`` or ``[script, ...]``)
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRELOAD = ("jax", "flax.nnx", "optax", "orbax.checkpoint", "grain", "jaxtrain.config", "jaxtrain.train.trainer",
           "jaxtrain.data.prepare", "jaxtrain.sampling")
COMMAND_TIMEOUT = 120  # seconds, each command (an error case takes one or two)


def run_many(argvs: list[list[str]], preload: tuple[str, ...] = (), timeout: float = 300
             ) -> list[subprocess.CompletedProcess]:
  """``python *argv`` for each argv, in the repository root; returns their exit codes, stdouts and stderrs.
  ``preload``: more modules to import once (PRELOAD's are), e.g. a library that every command imports."""
  r = subprocess.run([sys.executable, str(pathlib.Path(__file__))], cwd=ROOT,
                     input=json.dumps({"argvs": argvs, "preload": [*PRELOAD, *preload], "timeout": COMMAND_TIMEOUT}),
                     capture_output=True, text=True, timeout=timeout,
                     env={**os.environ, "PYTHONPATH": str(ROOT)})
  assert r.returncode == 0, r.stderr[-3000:]
  return [subprocess.CompletedProcess([sys.executable, *argv], code, out, err)
          for argv, (code, out, err) in zip(argvs, json.loads(r.stdout))]


def _exit_code(e: SystemExit) -> int:
  """What the interpreter exits with for ``raise SystemExit(e.code)``: None 0, an int itself, else the value
  printed to stderr and 1."""
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code
  print(e.code, file=sys.stderr)
  return 1


def _run_as_main(argv: list[str]) -> int:
  """Runs ``python *argv``'s entry in this process, as ``__main__``; returns the exit status the interpreter would
  give. Then the ``atexit`` functions run, as at an interpreter's exit."""
  code = 0
  try:
    if argv[0] == "-m":
      sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's file first, as python -m does
      sys.path[0] = str(ROOT)
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
      sys.argv = list(argv)
      sys.path[0] = str((ROOT / argv[0]).parent)
      runpy.run_path(argv[0], run_name="__main__")
  except SystemExit as e:
    code = _exit_code(e)
  except BaseException:  # noqa: BLE001 - the interpreter's own handling of an uncaught exception
    traceback.print_exc()
    code = 1
  atexit._run_exitfuncs()
  return code


def _redirect(out: str, err: str) -> None:
  for fd, path in ((1, out), (2, err)):
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)


def _leave(code: int) -> None:
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def _child(argv: list[str], out: str, err: str, timeout: int) -> None:
  signal.alarm(timeout)  # a command that hangs ends (SIGALRM: status -14) instead of holding up the rest
  _redirect(out, err)
  code = 1
  try:
    code = _run_as_main(argv)
  finally:
    _leave(code)


def run_entry(argv: list[str], env: dict[str, str], err: str) -> None:
  """The target of a process forked by multiprocessing's forkserver (tests/multiprocess.py): ``python *argv`` in
  ``env``, in the repository root, stdout discarded and stderr to ``err``."""
  os.environ.clear()
  os.environ.update(env)
  os.chdir(ROOT)
  _redirect(os.devnull, err)
  code = 1
  try:
    code = _run_as_main(argv)
  finally:
    _leave(code)


def main() -> None:
  job = json.load(sys.stdin)
  for name in job["preload"]:
    __import__(name)
  argvs = job["argvs"]
  results = []
  tmp = tempfile.mkdtemp()  # not a TemporaryDirectory: its finalizer is an atexit function, which a fork runs
  try:
    for i, argv in enumerate(argvs):
      out, err = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        _child(argv, out, err, job["timeout"])
      _, status = os.waitpid(pid, 0)
      results.append((os.waitstatus_to_exitcode(status), pathlib.Path(out).read_text(),
                      pathlib.Path(err).read_text()))
  finally:
    shutil.rmtree(tmp)
  json.dump(results, sys.stdout)


if __name__ == "__main__":
  main()

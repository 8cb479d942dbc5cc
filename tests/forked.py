"""Command-line runs forked from a Python process that has the libraries imported: ``run_many`` for the suite's
error cases; ``Forked`` (and ``popen`` / ``run``, its ``subprocess``-like faces) for the training runs that tests
start, kill and restart, and for the processes of multi-process jobs (tests/multiprocess.py): each forked from
multiprocessing's forkserver, in its own environment.

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
import multiprocessing
import os
import pathlib
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback

from tests.xla_flags import RUN_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRELOAD = ("jax", "flax.nnx", "optax", "orbax.checkpoint", "grain", "jaxtrain.config", "jaxtrain.train.trainer",
           "jaxtrain.data.prepare", "jaxtrain.sampling", "tests.preload")
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



def assert_one_line_exit_2(result: subprocess.CompletedProcess, message: str) -> None:
  """``result`` (of :func:`run_many`) is a user mistake refused: exit 2, one ``: error:`` line that holds
  ``message``, no traceback."""
  errors = [line for line in result.stderr.splitlines() if ": error:" in line]
  assert result.returncode == 2, result.stderr
  assert len(errors) == 1 and message in errors[0], result.stderr
  assert "Traceback" not in result.stderr

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
    elif argv[0] == "-c":
      sys.argv = ["-c", *argv[2:]]
      sys.path[0] = ""  # python -c looks in the current folder first
      exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
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


def _run_and_leave(argv: list[str], out: str, err: str) -> None:
  """In a forked process: ``python *argv`` with stdout to the file ``out`` and stderr to ``err``, then the exit."""
  _redirect(out, err)
  code = 1
  try:
    code = _run_as_main(argv)
  finally:
    _leave(code)


def _child(argv: list[str], out: str, err: str, timeout: int) -> None:
  signal.alarm(timeout)  # a command that hangs ends (SIGALRM: status -14) instead of holding up the rest
  _run_and_leave(argv, out, err)


def run_entry(argv: list[str], env: dict[str, str], out: str, err: str, new_session: bool = False,
              cwd: str | None = None) -> None:
  """The target of a process forked by multiprocessing's forkserver (``Forked``): ``python *argv`` in ``env``, in
  ``cwd`` (default: the repository root), stdout to the file ``out`` and stderr to ``err``; in a session (and
  process group) of its own if ``new_session``."""
  if new_session:
    os.setsid()
  os.environ.clear()
  os.environ.update(env)
  os.chdir(cwd or ROOT)
  _run_and_leave(argv, out, err)


class Forked:
  """``python *argv`` as a process forked by multiprocessing's forkserver, which has jax, flax, orbax, grain and
  jaxtrain imported (PRELOAD): each run saves the ~2 CPU-seconds of starting and stopping Python with them. It runs
  the command as the interpreter would (``run_entry``: its own environment, the entry as ``__main__``, the
  ``atexit`` functions, the interpreter's exit status) and has the part of ``subprocess.Popen``'s interface the
  tests use: ``pid``, ``poll``, ``wait``, ``communicate``, ``returncode`` (minus the signal's number for a killed
  process), ``send_signal``, ``kill``. Its stdout and stderr are the files ``out_path`` and ``err_path``, there
  from the start as a Popen's redirected streams are; ``new_session`` is Popen's ``start_new_session``.

  Only what a process reads after it starts is its own: JAX reads its ``JAX_*`` variables at import, in the
  forkserver, which has the environment of the test process that started it. So the command's ``env`` may differ
  from the test process's in ``XLA_FLAGS`` (read when the backend starts), paths and the like, not in ``JAX_*``."""

  _context = None

  def __init__(self, argv: list[str], env: dict[str, str], err_path: pathlib.Path,
               out_path: pathlib.Path | None = None, new_session: bool = False, cwd: str | None = None):
    if Forked._context is None:
      Forked._context = multiprocessing.get_context("forkserver")
      Forked._context.set_forkserver_preload(list(PRELOAD))
    self.args, self.err_path, self.out_path = argv, pathlib.Path(err_path), out_path and pathlib.Path(out_path)
    self.err_path.write_text("")
    if self.out_path:
      self.out_path.write_text("")
    self._process = Forked._context.Process(
        target=run_entry,
        args=(argv, env, os.fspath(self.out_path or os.devnull), os.fspath(self.err_path), new_session,
              cwd and os.fspath(cwd)))
    self._process.start()
    self.pid = self._process.pid

  @property
  def returncode(self) -> int | None:
    return self._process.exitcode

  def poll(self) -> int | None:
    return self._process.exitcode

  def wait(self, timeout: float | None = None) -> int:
    self._process.join(timeout)
    if self._process.exitcode is None:
      raise subprocess.TimeoutExpired(self.args, timeout)
    return self._process.exitcode

  def communicate(self, timeout: float | None = None) -> tuple[str, str]:
    """Waits (``subprocess.TimeoutExpired`` after ``timeout`` seconds, the process left running) and returns
    stdout and stderr."""
    self.wait(timeout)
    return self.out_path.read_text() if self.out_path else "", self.err_path.read_text()

  def send_signal(self, sig: int) -> None:
    if self._process.exitcode is None:
      os.kill(self.pid, sig)

  def kill(self) -> None:
    self._process.kill()


def run_env(env: dict[str, str] | None = None, optimized: bool = True) -> dict[str, str]:
  """``env`` (default: this process's environment) for a training run started as a process: the repository
  importable and, if ``optimized``, tests/xla_flags.py's RUN_FLAGS added to its ``XLA_FLAGS`` (the later flag wins).
  A run of a few steps is started with ``optimized=False``: the tests' fast compile costs less than the steps it
  slows (tests/xla_flags.py)."""
  env = dict(os.environ if env is None else env)
  flags = f"{env.get('XLA_FLAGS', '')} {RUN_FLAGS if optimized else ''}".strip()
  return {**env, "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}


def popen(argv: list[str], env: dict[str, str] | None = None, optimized: bool = True, cwd=None) -> Forked:
  """``subprocess.Popen([sys.executable, *argv], cwd=cwd or ROOT, stdout=PIPE, stderr=PIPE, env=run_env(env,
  optimized))``, forked."""
  folder = tempfile.mkdtemp(prefix="jaxtrain-forked-")  # in TMPDIR, a throwaway folder under CI
  return Forked(argv, run_env(env, optimized), pathlib.Path(folder, "err"), pathlib.Path(folder, "out"), cwd=cwd)


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 300, optimized: bool = True,
        cwd=None) -> subprocess.CompletedProcess:
  """``subprocess.run([sys.executable, *argv], cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout,
  env=run_env(env, optimized))``, forked (``popen``): a run still going after ``timeout`` seconds is killed and
  raises TimeoutExpired."""
  p = popen(argv, env, optimized, cwd)
  try:
    out, err = p.communicate(timeout)
  except subprocess.TimeoutExpired:
    p.kill()
    p.wait(30)
    raise
  finally:
    if p.poll() is not None:
      shutil.rmtree(p.err_path.parent)  # popen's folder: the output is read
  return subprocess.CompletedProcess([sys.executable, *argv], p.returncode, out, err)


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

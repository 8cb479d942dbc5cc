"""``python tests/local_tier_main.py FAULTS_DIR [--full_from=S [--full_process=P]] [--nan_at=S] [--crash_at=S]
[jaxtrain.main flags]``:
jaxtrain.main with faults of the node-local checkpoint tier's surroundings (tests/test_local_checkpoint.py), each
recorded in FAULTS_DIR so that it happens once per job, however often the job is started:

  --full_from=S  the local disk is full from step S on: the writer thread's write of the shards of step S or later
                 fails with OSError(ENOSPC) after a few bytes (what a full disk or /dev/shm does);
                 FAULTS_DIR/attempts-<process index> lists every step the writer tried (mounting a size-limited
                 filesystem needs root: not here). With --full_process=P, only process P's disk is full.
  --nan_at=S     a transient fault: step S's loss mask holds a NaN (the step is non-finite), the first time only.
  --crash_at=S   after --nan_at's step, when the run reaches the local save of step S again (the replay after the
                 rollback), the process waits for the local write before it (committed), then SIGKILLs itself.
"""

import errno
import os
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

from jaxtrain.checkpoint import local as local_checkpoint
from jaxtrain import main
from jaxtrain.train import trainer

faults = sys.argv.pop(1)
options = {}
while len(sys.argv) > 1 and sys.argv[1].split("=")[0] in ("--full_from", "--full_process", "--nan_at", "--crash_at"):
  key, value = sys.argv.pop(1)[2:].split("=")
  options[key] = int(value)
os.makedirs(faults, exist_ok=True)


def once(name: str) -> bool:
  """True the first time in this job (FAULTS_DIR/name records it)."""
  try:
    os.close(os.open(os.path.join(faults, name), os.O_CREAT | os.O_EXCL))
    return True
  except FileExistsError:
    return False


if "full_from" in options:
  savez = np.savez

  def full_disk(file, *args, **kwargs):
    writer = threading.current_thread().name
    if writer.startswith("jaxtrain-local-save-"):  # the local tier's writer thread, named after its step
      step = int(writer.rsplit("-", 1)[1])
      with open(os.path.join(faults, f"attempts-{jax.process_index()}"), "a") as f:
        f.write(f"{step}\n")
      if step >= options["full_from"] and options.get("full_process", jax.process_index()) == jax.process_index():
        file.write(b"\0" * 4096)  # what fitted
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file.name)
    return savez(file, *args, **kwargs)

  np.savez = full_disk

if "nan_at" in options:
  compile_step = trainer.compile_step

  def compile_with_fault(run, train_step=None):
    step_fn = compile_step(run, train_step)

    def faulty(state, batch, control):
      if int(state.step) == options["nan_at"] - 1 and once("nan"):
        mask = batch["loss_mask"]
        batch = {**batch, "loss_mask": jax.device_put(mask.at[0, 0].set(jnp.nan), mask.sharding)}
      return step_fn(state, batch, control)
    return faulty

  trainer.compile_step = compile_with_fault

if "crash_at" in options:
  save = local_checkpoint.LocalTier.save

  def save_or_crash(self, step, *args, **kwargs):
    if step == options["crash_at"] and os.path.exists(os.path.join(faults, "nan")) and once("crash"):
      self.wait()  # the local step before it is committed (and settled)
      os.kill(os.getpid(), signal.SIGKILL)
    return save(self, step, *args, **kwargs)

  local_checkpoint.LocalTier.save = save_or_crash

app.run(main.main, flags_parser=main.parse_flags)

"""One of 2 JAX processes on localhost (the flags tests/multiprocess.py passes) in which a peer goes away; the survivor
prints what jaxtrain.distributed makes of the error it gets, one line per error:

  LOST <what the error was> | <jaxtrain.distributed.lost_peer(error)> | <type> <status code> | says Broken pipe: <bool>

  python tests/dist_lost_peer_worker.py --coordinator=HOST:PORT --num_processes=2 --process_id=I MODE

MODE ``collective``: first an error that is no lost peer (a host callback inside a jitted function raises a
RuntimeError about a broken pipe, and the same RuntimeError raised plainly); then process 1 is SIGKILLed while both
run collectives. ``barrier``: process 1 is killed; process 0 then waits at a barrier of the coordination service.
``coordinator``: process 0 (the coordination service's host) is killed while both run collectives.
"""

import argparse
import os
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator")
parser.add_argument("--num_processes", type=int)
parser.add_argument("--process_id", type=int)
parser.add_argument("mode", choices=["collective", "barrier", "coordinator"])
args = parser.parse_args()

from tests.multiprocess import init_distributed  # noqa: E402

init_distributed(args.coordinator, args.num_processes, args.process_id)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jaxtrain import _compat, distributed  # noqa: E402

me = jax.process_index()
client = _compat.coordination_client()
mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
total = jax.jit(lambda x: jnp.sum(x * 2.0), out_shardings=NamedSharding(mesh, PartitionSpec()))


def report(what: str, error: BaseException) -> None:
  print(f"LOST {what} | {distributed.lost_peer(error)} | {type(error).__name__} {distributed.status_code(error)} | "
        f"says Broken pipe: {'Broken pipe' in str(error)}", flush=True)


def collectives(victim: int) -> None:
  """Sums a global array, both processes, until one fails; ``victim`` kills itself at the 10th."""
  for i in range(10**6):
    x = jax.make_array_from_callback((jax.device_count(),), NamedSharding(mesh, PartitionSpec("d")),
                                     lambda index: np.ones((1,), np.float32))
    float(total(x))  # waits for the collective
    if i == 10 and me == victim:
      os.kill(os.getpid(), signal.SIGKILL)


def broken_pipe(x):
  raise RuntimeError("writing the report: [Errno 32] Broken pipe")


if args.mode == "collective":
  if me == 0:
    callback = jax.jit(lambda x: jax.pure_callback(broken_pipe, jax.ShapeDtypeStruct((3,), jnp.float32), x))
    try:
      callback(jnp.ones(3)).block_until_ready()
    except Exception as e:  # noqa: BLE001
      report("a host callback's error", e)
    try:
      broken_pipe(None)
    except RuntimeError as e:
      report("a RuntimeError", e)
  client.wait_at_barrier("checked", 60_000)
  try:
    collectives(victim=1)
  except Exception as e:  # noqa: BLE001
    report("a collective whose peer was killed", e)
elif args.mode == "barrier":
  client.wait_at_barrier("started", 60_000)
  if me == 1:
    os.kill(os.getpid(), signal.SIGKILL)
  try:
    client.wait_at_barrier("never", 3_000)
  except Exception as e:  # noqa: BLE001
    report("a barrier whose peer was killed", e)
else:
  try:
    collectives(victim=0)
  except Exception as e:  # noqa: BLE001 - JAX's agent aborts this process about now (SIGABRT)
    report("a collective whose coordinator was killed", e)
  signal.pause()  # the abort comes; the test's bound ends a process it does not reach
sys.stdout.flush()
os._exit(0)  # not JAX's shutdown: the peer is gone, its barrier would wait for it

"""One of 2 JAX processes on localhost (the flags tests/multiprocess.py passes) stepping in lockstep (a collective per
step); at step 3 process 1 posts the preemption notice the way a first SIGTERM does (jaxtrain.train.preemption,
through jaxtrain._compat), and each process prints the step at which JAX's preemption sync point says to stop:

  SYNC <step>
"""

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator")
parser.add_argument("--num_processes", type=int)
parser.add_argument("--process_id", type=int)
args = parser.parse_args()

from tests.multiprocess import init_distributed  # noqa: E402

init_distributed(args.coordinator, args.num_processes, args.process_id)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxtrain.train import preemption  # noqa: E402

for step in range(1, 200):
  multihost_utils.process_allgather(np.float32(step))  # a collective: the processes stay within a step
  if step == 3 and jax.process_index() == 1:
    preemption._notify_peers()
  if multihost_utils.reached_preemption_sync_point(step):
    print(f"SYNC {step}", flush=True)
    break
multihost_utils.sync_global_devices("done")
os._exit(0)

"""A Dask worker preload (``dask worker --preload tests.dask_hold``) for tests/test_prepare_cluster.py: each
scatter of an input file on the worker first writes ``started-INDEX-PID`` into the folder named by
``JAXTRAIN_TEST_HOLD`` and then waits (60 s at most) until the test writes ``release`` there. The test thereby
sees which worker process runs which file, and kills a worker while it is inside a pipeline task. Without the
variable, or while the folder lacks ``armed``, the scatter runs as it is."""

import os
import time

from jaxtrain.data.prepare import algorithm

_scatter = algorithm.scatter


def _held_scatter(plan, index):
  folder = os.environ.get("JAXTRAIN_TEST_HOLD", "")
  if folder and os.path.exists(os.path.join(folder, "armed")):
    open(os.path.join(folder, f"started-{index}-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, "release")) and time.monotonic() < deadline:
      time.sleep(0.02)
  yield from _scatter(plan, index)


algorithm.scatter = _held_scatter

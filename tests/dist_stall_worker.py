"""A run whose data stalls for good after 2 batches (a stuck input pipeline): the one way to keep a run from
finishing its step, for signals that must end it anyway. One process, or one of several with the flags
tests/multiprocess.py passes. Prints STALLED to stderr once stuck.

  python tests/dist_stall_worker.py [--coordinator=HOST:PORT --num_processes=N --process_id=I] WORKDIR
"""

import argparse
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator", default="")
parser.add_argument("--num_processes", type=int, default=1)
parser.add_argument("--process_id", type=int, default=0)
parser.add_argument("workdir")
args = parser.parse_args()
if args.coordinator:
  from tests.multiprocess import init_distributed
  init_distributed(args.coordinator, args.num_processes, args.process_id)

import jax  # noqa: E402

from jaxtrain.config import base_config  # noqa: E402
from jaxtrain.data.synthetic import SyntheticSource  # noqa: E402
from jaxtrain.train import trainer  # noqa: E402


class Stalling(SyntheticSource):
  def __next__(self):
    if self.step == 2:
      print("STALLED", file=sys.stderr, flush=True)
      while True:
        time.sleep(3600)
    return super().__next__()


config = base_config()
config.workdir = args.workdir
config.data.update(source="synthetic", seq_len=32)
config.train.update(steps=1000, global_batch_size=16, log_every=1)
config.checkpoint.every_steps = 0
trainer.train(config, data=Stalling(32, config.model.vocab_size, 16, 0, jax.process_index(), jax.process_count()))

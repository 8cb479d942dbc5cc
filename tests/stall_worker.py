"""Trains with a data source that hangs forever after 6 batches; the watchdog must end the process."""

import sys
import time

from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.train import trainer
from tests.conftest import small_config


class Stalling(SyntheticSource):
  def __next__(self):
    if self.step == 6:
      print("STALLING", file=sys.stderr, flush=True)
      time.sleep(3600)
    return super().__next__()


config = small_config(sys.argv[1], fsdp=8)
config.train.steps = 100
config.monitor.watchdog_timeout_s = float(sys.argv[2])
trainer.train(config, data=Stalling(32, 256, 16, 0))

"""``python tests/straggler_main.py DELAY_S [jaxtrain.main flags]``: jaxtrain.main, where process 1 (the one given
``--config.distributed.process_id=1``) gets each step's batch DELAY_S late: a slow host."""

import sys
import time

from absl import app

from jaxtrain import data as data_lib
from jaxtrain import main

delay = float(sys.argv.pop(1))
if "--config.distributed.process_id=1" in sys.argv:
  to_global = data_lib.to_global

  def late(*args, **kwargs):
    time.sleep(delay)
    return to_global(*args, **kwargs)

  data_lib.to_global = late
app.run(main.main, flags_parser=main.parse_flags)

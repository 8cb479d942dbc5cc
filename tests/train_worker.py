"""One process of a multi-process training run on localhost (see test_checkpoint.py): joins the job, then
trains with the config file and overrides given after --, exactly as ``jaxtrain.main`` would."""

import argparse
import json

from tests.multiprocess import init_distributed

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator")
parser.add_argument("--num_processes", type=int)
parser.add_argument("--process_id", type=int)
parser.add_argument("--config")
parser.add_argument("--out")
parser.add_argument("overrides", nargs="*")  # key=value, applied to the config
args = parser.parse_args()
init_distributed(args.coordinator, args.num_processes, args.process_id)

import importlib.util  # noqa: E402

import jax  # noqa: E402

from jaxtrain.train import trainer  # noqa: E402

spec = importlib.util.spec_from_file_location("cfg", args.config)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = module.get_config()
for item in args.overrides:
  key, value = item.split("=", 1)
  try:
    value = json.loads(value)  # numbers and booleans
  except json.JSONDecodeError:
    pass  # strings (paths)
  config.update_from_flattened_dict({key: value})
state, history = trainer.train(config)
if jax.process_index() == 0:
  with open(args.out, "w") as f:
    json.dump({"history": [{k: float(v) for k, v in h.items() if v is not None} for h in history]}, f)

"""One process of the 2-process raw-data test (see test_stream.py): opens data.source=raw as training does (its
process index and count from jax.distributed), reads --batches batches, and writes to --out its rows' document
ids and the first global batch assembled across processes."""

import argparse
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain import data as data_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain import sharding
from jaxtrain.config import base_config
from tests.multiprocess import init_distributed

parser = argparse.ArgumentParser()
for name in ("coordinator", "data", "out"):
  parser.add_argument(f"--{name}")
for name in ("num_processes", "process_id", "global_batch", "seq_len", "batches", "num_workers"):
  parser.add_argument(f"--{name}", type=int)
args = parser.parse_args()
init_distributed(args.coordinator, args.num_processes, args.process_id)

config = base_config()
config.data.update(source="raw", path=args.data, seq_len=args.seq_len, num_workers=args.num_workers)
config.train.global_batch_size = args.global_batch
it = data_lib.open_train(config)
batches = [next(it) for _ in range(args.batches)]
data_lib.close(it)

mesh = mesh_lib.make_mesh(base_config().mesh)
batch_sharding = sharding.batch_sharding(mesh, sharding.PRESETS["fsdp_tp"])
first = data_lib.to_global(batches[0], batch_sharding)
gathered = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)).tolist() for k, v in first.items()}
with open(args.out.format(jax.process_index()), "w") as f:
  json.dump({"doc_ids": sorted({int(d) for b in batches for d in np.unique(b["doc_ids"]) if d >= 0}),
             "rows": batches[0]["inputs"].shape[0], "batch": gathered}, f)

"""One process of the 2-process data tests (see test_data.py): reads its lanes for one epoch and the
first global batch, and writes what it saw to --out; writes its share of the eval batches (what training
evaluates on) to --eval_out."""

import argparse
import hashlib
import json

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxtrain import data as data_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain import sharding
from jaxtrain.config import base_config
from jaxtrain.data import loader
from tests.multiprocess import init_distributed

parser = argparse.ArgumentParser()
for name in ("coordinator", "data", "out", "eval_out"):
  parser.add_argument(f"--{name}")
for name in ("num_processes", "process_id", "global_batch", "seq_len", "seed"):
  parser.add_argument(f"--{name}", type=int)
args = parser.parse_args()
init_distributed(args.coordinator, args.num_processes, args.process_id)
assert jax.device_count() == 4 * args.num_processes and jax.process_count() == args.num_processes

manifest = loader.load_manifest(args.data)
kw = dict(seq_len=args.seq_len, global_batch=args.global_batch, seed=args.seed,
          process_index=jax.process_index(), process_count=jax.process_count())
it = iter(loader.train_dataset(args.data, manifest, **kw))

# The first global batch, assembled across processes with the batch sharding of an 8-device fsdp mesh.
mesh_cfg = base_config().mesh
mesh = mesh_lib.make_mesh(mesh_cfg)
batch_sharding = sharding.batch_sharding(mesh, sharding.PRESETS["fsdp_tp"])
first = data_lib.to_global(next(it), batch_sharding)
gathered = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in first.items()}

# Reconstruct the documents each of this process's lanes read during the first epoch (a document starts
# at position 0 of a segment; a continuation at the start of a row has position > 0).
num_docs = manifest["splits"]["train"]["documents"]
lanes = list(range(kw["process_index"] * args.global_batch // args.num_processes,
                   (kw["process_index"] + 1) * args.global_batch // args.num_processes))
wanted = {lane: len(range(lane, num_docs, args.global_batch)) for lane in lanes}
docs = {lane: [] for lane in lanes}
it = iter(loader.train_dataset(args.data, manifest, **kw))
while any(len(docs[lane]) <= wanted[lane] for lane in lanes):
  b = next(it)
  # inputs + the last target give the row's seq_len + 1 tokens.
  tokens = np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
  # The last token continues the last input's document iff its target is unmasked; else it opens a new one.
  continues = b["loss_mask"][:, -1:] > 0
  segs = np.concatenate([b["segment_ids"], b["segment_ids"][:, -1:] + ~continues], axis=1)
  pos = np.concatenate([b["positions"], np.where(continues, b["positions"][:, -1:] + 1, 0)], axis=1)
  for row, lane in enumerate(lanes):
    for seg in np.unique(segs[row][segs[row] > 0]):
      piece = segs[row] == seg
      if pos[row][piece][0] == 0:
        docs[lane].append([])
      docs[lane][-1].extend(tokens[row][piece].tolist())
epoch = [d for lane in lanes for d in docs[lane][:wanted[lane]]]
data_lib.close(it)
with open(args.out.format(jax.process_index()), "w") as f:
  json.dump({"docs": [hashlib.sha256(np.asarray(d, np.int32).tobytes()).hexdigest() for d in epoch],
             "batch": {k: v.tolist() for k, v in gathered.items()}}, f)

# This process's eval batches, as training gets them (its process index and count from jax.distributed).
config = base_config()
config.data.path, config.data.seq_len = args.data, args.seq_len
config.train.global_batch_size, config.eval.max_batches = args.global_batch, 0
evals = data_lib.open_eval(config)
np.savez(args.eval_out.format(jax.process_index()), **{k: np.stack([b[k] for b in evals]) for k in evals[0]})

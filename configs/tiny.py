"""A tiny Llama for CPU: trains in seconds on 8 simulated devices.

Variants pick a parallelism layout: ``configs/tiny.py:dp`` (data parallel), ``:fsdp`` (default, ZeRO-3 over
all devices), ``:tp`` (FSDP x 2-way tensor parallel). Each variant has its own workdir: ``runs/tiny`` for the
default, ``runs/tiny_<variant>`` for the others.
"""

from jaxtrain.config import base_config


def get_config(variant: str = "fsdp"):
  c = base_config()
  c.workdir = "runs/tiny" if variant == "fsdp" else f"runs/tiny_{variant}"
  c.model.update(num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384,
                 vocab_size=256)
  c.data.seq_len = 128
  c.train.update(steps=200, global_batch_size=16, log_every=10)
  c.optim.update(lr=3e-3, warmup_steps=20, weight_decay=0.0)
  if variant == "dp":
    c.sharding.preset, c.mesh.fsdp, c.mesh.data = "dp", 1, -1
  elif variant == "tp":
    c.mesh.tensor = 2
  elif variant != "fsdp":
    raise ValueError(f"unknown variant '{variant}' of tiny.py: use dp, fsdp or tp")
  return c

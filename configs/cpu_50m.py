"""A ~50M-parameter Llama (byte vocabulary) that still trains on a CPU mesh: the mid-size CPU benchmark."""

from jaxtrain.config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/cpu_50m"
  c.model.update(num_layers=8, d_model=768, num_heads=12, num_kv_heads=4, head_dim=64, mlp_dim=2048,
                 vocab_size=256)
  c.data.seq_len = 256
  c.train.update(steps=1000, global_batch_size=16, log_every=10)
  c.optim.update(lr=1e-3, warmup_steps=100)
  return c

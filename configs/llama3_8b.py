"""Llama 3 8B (8.03B parameters). Pod-scale defaults: bf16 compute, FSDP over all chips, remat of dots."""

from jaxtrain.config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/llama3_8b"
  c.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                 vocab_size=128256, rope_theta=500_000.0, dtype="bfloat16", remat="save_dots")
  c.data.seq_len = 8192
  c.train.update(steps=100_000, global_batch_size=512, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return c

"""Llama 3 70B (70.6B parameters). Pod-scale defaults: bf16, FSDP x 8-way tensor parallel, full remat."""

from jaxtrain.config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/llama3_70b"
  c.model.update(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672,
                 vocab_size=128256, rope_theta=500_000.0, dtype="bfloat16", remat="full")
  c.mesh.tensor = 8
  c.data.seq_len = 8192
  c.train.update(steps=100_000, global_batch_size=1024, log_every=50)
  c.optim.update(lr=1.5e-4, warmup_steps=2000)
  return c

"""Llama 3.2 1B (1.24B parameters, tied embeddings). Pod-scale defaults: bf16 compute, FSDP over all chips."""

from jaxtrain.config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/llama3_1b"
  c.model.update(num_layers=16, d_model=2048, num_heads=32, num_kv_heads=8, head_dim=64, mlp_dim=8192,
                 vocab_size=128256, tie_embeddings=True, rope_theta=500_000.0, dtype="bfloat16",
                 remat="save_dots")
  c.data.seq_len = 8192
  c.train.update(steps=100_000, global_batch_size=256, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return c

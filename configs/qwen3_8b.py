"""Qwen3-8B (8.19B parameters; ``models.Model.num_params`` 8,190,735,360, transformers' count of the same shapes).
Pod-scale defaults: bf16 compute, FSDP over all chips, remat of dots.

Architecture from the released checkpoint (Qwen Team 2025, arXiv:2505.09388): 36 layers, d_model 4096, 32 heads x 128,
8 KV heads, SwiGLU 12288, QK-norm (RMSNorm of each query and key head), no biases, RoPE theta 1e6, norm_eps 1e-6,
vocab 151936, untied head.
"""

from jaxtrain.config import base_config


def get_config():
  c = base_config(model="qwen3")
  c.workdir = "runs/qwen3_8b"
  c.model.update(num_layers=36, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=12288,
                 vocab_size=151936, dtype="bfloat16", remat="save_dots")
  c.data.seq_len = 4096
  c.train.update(steps=100_000, global_batch_size=512, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return c

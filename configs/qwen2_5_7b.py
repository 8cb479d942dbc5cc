"""Qwen2.5-7B (7.62B parameters; ``models.Model.num_params`` 7,615,616,512, transformers' count of the same shapes).
Pod-scale defaults: bf16 compute, FSDP over all chips, remat of dots.

Architecture from the released checkpoint (Qwen Team 2024, arXiv:2412.15115): 28 layers, d_model 3584, 28 heads x 128,
4 KV heads, SwiGLU 18944, biases on the q, k, v projections, RoPE theta 1e6, norm_eps 1e-6, vocab 152064, untied
head; full attention on every layer (the released config's sliding window is off).
"""

from jaxtrain.config import base_config


def get_config():
  c = base_config(model="qwen2")
  c.workdir = "runs/qwen2_5_7b"
  c.model.update(num_layers=28, d_model=3584, num_heads=28, num_kv_heads=4, head_dim=128, mlp_dim=18944,
                 vocab_size=152064, dtype="bfloat16", remat="save_dots")
  c.data.seq_len = 4096
  c.train.update(steps=100_000, global_batch_size=512, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return c

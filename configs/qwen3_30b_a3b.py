"""Qwen3-30B-A3B (30.5B parameters, 3.3B active per token: 128 experts, top-8). Pod-scale defaults: bf16 compute,
full remat, dropless experts, FSDP over all chips.

Architecture from the released checkpoint (Qwen Team 2025, arXiv:2505.09388): 48 layers, d_model 2048, 32 heads x
128, 4 KV heads, QK-norm, every feed-forward 128 SwiGLU experts of hidden size 768 with a softmax router and the
top-8 weights renormalized, no shared experts; RoPE theta 1e6, norm_eps 1e-6, vocab 151936, untied head.
``jaxtrain.models.moe.param_counts``: 30,532,122,624 total (transformers' count of the same shapes),
3,353,032,704 active (the published 30.5B / 3.3B).
"""

from jaxtrain.config import base_config


def get_config():
  c = base_config(model="qwen3_moe")
  c.workdir = "runs/qwen3_30b_a3b"
  c.model.update(num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4, head_dim=128, vocab_size=151936,
                 num_experts=128, experts_per_token=8, expert_mlp_dim=768, mlp_dim=6144, moe_impl="dropless",
                 load_balance_weight=0.01, dtype="bfloat16", remat="full")
  c.data.seq_len = 4096
  c.train.update(steps=100_000, global_batch_size=512, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return c

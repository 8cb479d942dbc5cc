"""Gemma-2-9B (9.24B parameters; ``models.Model.num_params`` 9,241,705,984, transformers' count of the same shapes).
Pod-scale defaults: bf16 compute, FSDP over all chips, full remat (the 256k-token vocabulary's logits are large).

Architecture from the released checkpoint (Gemma Team 2024, arXiv:2408.00118): 42 layers alternating local
(sliding window 4096) and global attention, d_model 3584, 16 heads x 256, 8 KV heads, GeGLU 14336 (tanh GELU),
RMSNorm scaled by 1 + w on the inputs and outputs of attention and MLP, embeddings scaled by sqrt(d_model),
attention logits soft-capped at 50 and final logits at 30, queries scaled by 256^-0.5, RoPE theta 10000,
norm_eps 1e-6, vocab 256000, tied head.
"""

from jaxtrain.config import base_config


def get_config():
  c = base_config(model="gemma2")
  c.workdir = "runs/gemma2_9b"
  c.model.update(num_layers=42, d_model=3584, num_heads=16, num_kv_heads=8, head_dim=256, mlp_dim=14336,
                 vocab_size=256000, dtype="bfloat16", remat="full")
  c.data.seq_len = 8192
  c.train.update(steps=100_000, global_batch_size=512, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return c

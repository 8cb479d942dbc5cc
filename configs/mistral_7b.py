"""Mistral-7B-v0.1 (7.24B parameters; ``models.Model.num_params`` 7,241,732,096, transformers' count of the same
shapes). Pod-scale defaults: bf16 compute, FSDP over all chips, remat of dots.

Architecture from the released checkpoint (Jiang et al. 2023, arXiv:2310.06825): 32 layers, d_model 4096, 32 heads x
128, 8 KV heads, SwiGLU 14336, sliding-window attention of 4096 tokens on every layer, RoPE theta 10000,
norm_eps 1e-5, vocab 32000, untied head. At 8192 tokens a layer attends over 4096 keys per query, not 8192:
``blockwise`` and ``splash`` skip the rest (docs/models.md).
"""

from jaxtrain.config import base_config


def get_config():
  c = base_config(model="mistral")
  c.workdir = "runs/mistral_7b"
  c.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                 vocab_size=32000, sliding_window=4096, norm_eps=1e-5, dtype="bfloat16", remat="save_dots")
  c.data.seq_len = 8192
  c.train.update(steps=100_000, global_batch_size=512, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return c

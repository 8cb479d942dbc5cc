"""Gemma-3-1B (1.00B parameters; ``models.Model.num_params`` 999,885,952, transformers' count of the same shapes), the
text-only Gemma 3. Defaults for a small pod slice: bf16 compute, FSDP over all chips, remat of dots.

Architecture from the released checkpoint (Gemma Team 2025, arXiv:2503.19786): 26 layers, five local (sliding
window 512, RoPE theta 10000) to one global (RoPE theta 1e6), d_model 1152, 4 heads x 256, 1 KV head, GeGLU 6912,
QK-norm, RMSNorm scaled by 1 + w on the inputs and outputs of attention and MLP, embeddings scaled by sqrt(d_model),
queries scaled by 256^-0.5, no soft-capping, norm_eps 1e-6, vocab 262144, tied head.
"""

from jaxtrain.config import base_config


def get_config():
  c = base_config(model="gemma3")
  c.workdir = "runs/gemma3_1b"
  c.model.update(num_layers=26, d_model=1152, num_heads=4, num_kv_heads=1, head_dim=256, mlp_dim=6912,
                 vocab_size=262144, sliding_window=512, dtype="bfloat16", remat="save_dots")
  c.data.seq_len = 8192
  c.train.update(steps=100_000, global_batch_size=256, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return c

"""configs/tiny.py's shapes for any registered family, its attention variants on: ``configs/tiny_family.py:NAME``
(default qwen3), e.g. ``:gemma2``, ``:mistral``, ``:qwen3_moe``, ``:gpt_oss``. Trains in seconds on 8 simulated CPU
devices.

Windows are 32 tokens (of 128): Gemma 2 and GPT-OSS alternate local and global layers, Gemma 3 has three local to one
global (of 4 layers), Mistral's are all local, Qwen's families have none (as released). MoE families (GPT-OSS too) get
4 experts, top 2.
"""

from jaxtrain import models
from jaxtrain.config import base_config


def get_config(variant: str = "qwen3"):
  c = base_config(model=variant)
  c.workdir = f"runs/tiny_{variant}"
  c.model.update(num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384, vocab_size=256)
  if c.model.sliding_window:
    c.model.update(sliding_window=32, global_every=min(c.model.global_every, 4))
  if "num_experts" in c.model:
    c.model.update(num_experts=4, experts_per_token=2, expert_mlp_dim=128)
  if c.model.query_scale:  # Gemma: 1 / sqrt(head_dim), as released
    c.model.query_scale = 32 ** -0.5
  c.data.seq_len = 128
  c.train.update(steps=200, global_batch_size=16, log_every=10)
  c.optim.update(lr=3e-3, warmup_steps=20, weight_decay=0.0)
  models.get(variant)  # an unknown family: one ConfigError line naming model.name
  return c

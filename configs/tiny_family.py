"""configs/tiny.py's shapes for any registered family, its attention variants on: ``configs/tiny_family.py:NAME``
(default qwen3), e.g. ``:gemma2``, ``:mistral``, ``:qwen3_moe``, ``:gpt_oss``, ``:deepseek_v3``. Trains in seconds
on 8 simulated CPU devices.

Windows are 32 tokens (of 128): Gemma 2 and GPT-OSS alternate local and global layers, Gemma 3 has three local to one
global (of 4 layers), Mistral's are all local, Qwen's families have none (as released). MoE families (GPT-OSS too) get
4 experts, top 2; DeepSeek-V3 gets multi-head latent attention (query rank 64, key/value rank 32) and 8 experts in 4
groups of which 2 compete, top 2, beside its shared expert and a dense first layer.
"""

from jaxtrain import models
from jaxtrain.config import base_config


def get_config(variant: str = "qwen3"):
  c = base_config(model=variant)
  c.workdir = f"runs/tiny_{variant}"
  if "kv_lora_rank" in c.model:  # DeepSeek-V3's multi-head latent attention; 8 experts in 4 groups, 2 of them chosen
    c.model.update(num_layers=4, d_model=128, num_heads=4, mlp_dim=384, vocab_size=256, q_lora_rank=64,
                   kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=8,
                   experts_per_token=2, expert_mlp_dim=64, num_groups=4, topk_groups=2)
    return _rest(c, variant)
  c.model.update(num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384, vocab_size=256)
  if c.model.sliding_window:
    c.model.update(sliding_window=32, global_every=min(c.model.global_every, 4))
  if "num_experts" in c.model:
    c.model.update(num_experts=4, experts_per_token=2, expert_mlp_dim=128)
  if c.model.get("attention_chunk_size"):  # Llama 4: chunks of 32 tokens, the temperature over them
    c.model.update(attention_chunk_size=32, floor_scale=32)
  if c.model.query_scale:  # Gemma: 1 / sqrt(head_dim), as released
    c.model.query_scale = 32 ** -0.5
  return _rest(c, variant)


def _rest(c, variant: str):
  c.data.seq_len = 128
  c.train.update(steps=200, global_batch_size=16, log_every=10)
  c.optim.update(lr=3e-3, warmup_steps=20, weight_decay=0.0)
  models.get(variant)  # an unknown family: one ConfigError line naming model.name
  return c

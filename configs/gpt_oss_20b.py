"""gpt-oss-20b (20.9B parameters, 3.6B active per token: 32 experts, top-4). Pod-scale defaults: bf16 compute, full
remat, dropless experts, FSDP. d_model 2880 is 2^6 x 45: ``mesh.fsdp`` must divide it (at most 64 of a power of two),
so a pod adds ``mesh.expert`` or ``mesh.data`` (256 chips: expert 8 x fsdp 32, 18.5 GiB per chip by the estimate).

Architecture from the released checkpoint's config.json (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card",
arXiv:2508.10925): 24 layers, d_model 2880, 64 query heads x 64, 8 KV heads, biases on q, k, v and o, a learned
attention sink per head, layers alternating a 128-token sliding window and full attention, RoPE theta 150000 with
YaRN (factor 32 over 4096 original positions, beta_fast 32, beta_slow 1, not truncated: 131072 positions), every
feed-forward 32 experts of hidden size 2880 with biases and the clamped SwiGLU (alpha 1.702, limit 7), top-4 of a
biased router softmaxed among themselves; vocab 201088 (o200k_harmony), untied head, norm_eps 1e-5 (the ``gpt_oss``
family: jaxtrain/models/gpt_oss). ``jaxtrain.models.gpt_oss.param_counts`` on the abstract shapes:
20,914,757,184 total (transformers' count of the same shapes), 3,608,307,264 active (the published 20.9B / 3.6B; the
model card's 3.61B, which counts the head and not the input embedding table).

The released weights are MXFP4 (the experts): tools/convert_hf.py dequantizes them on import (docs/huggingface.md). No
training recipe is published: AdamW 3e-4 as at this scale, 4M-token batches (1024 x 4096).

  python tools/estimate.py --config=configs/gpt_oss_20b.py --devices=256 --set=mesh.expert=8 --set=mesh.fsdp=32
"""

from jaxtrain.config import base_config

SHAPES = dict(d_model=2880, num_heads=64, num_kv_heads=8, head_dim=64, vocab_size=201088, expert_mlp_dim=2880,
              experts_per_token=4, sliding_window=128, global_every=2, rope_theta=150_000.0, rope_scaling="yarn",
              rope_scaling_factor=32.0, rope_original_max_positions=4096, rope_yarn_beta_fast=32.0,
              rope_yarn_beta_slow=1.0, rope_yarn_truncate=False, swiglu_alpha=1.702, swiglu_limit=7.0, norm_eps=1e-5,
              tie_embeddings=False)


def get_config(num_layers: int = 24, num_experts: int = 32, name: str = "gpt_oss_20b"):
  c = base_config(model="gpt_oss")
  c.workdir = f"runs/{name}"
  c.model.update(num_layers=num_layers, num_experts=num_experts, moe_impl="dropless", load_balance_weight=0.01,
                 dtype="bfloat16", remat="full", **SHAPES)
  c.data.seq_len = 4096
  c.train.update(steps=100_000, global_batch_size=1024, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return c

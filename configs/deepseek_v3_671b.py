"""DeepSeek-V3 (671B parameters, 37B active per token: 256 routed experts of which 8, and a shared one). Pod-scale
defaults: bf16 compute, full remat, experts with a capacity (factor 1.25), FSDP with expert parallelism, 15
microbatches (one row a device each on 1024 chips). The estimator sizes it for a slice: 1024 chips (a v5p-2048),
expert 64 x fsdp 16, 34.2 GiB per chip by the estimate, 41.6 GiB by the TPU compiler for v5p:8x8x16 (the dry run
below; docs/benchmarks.md). It is not trained here.

Architecture from the released checkpoint's config.json (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
arXiv:2412.19437): 61 layers, d_model 7168, 128 heads of multi-head latent attention (queries through a rank-1536
latent, keys and values through a rank-512 latent, 128 dims per head without position and 64 RoPE dims shared, values
of 128), RoPE theta 10000 with YaRN (factor 40 over 4096 original positions, betas 32 / 1, mscale 1 and
mscale_all_dim 1: 163840 positions), the first 3 layers dense (hidden 18432), the other 58 with 256 routed experts of
hidden 2048 in 8 groups of which 4 compete, top-8, sigmoid scores with the balancing bias, routed weights scaled by
2.5, one shared expert; vocab 129280, untied head, norm_eps 1e-6 (the ``deepseek_v3`` family:
jaxtrain/models/deepseek_v3). ``jaxtrain.models.deepseek_v3.param_counts`` on the abstract shapes: 671,026,419,200
total (transformers' count of the same config.json, plus the 58 x 256 choice biases it holds as buffers),
37,552,297,472 active (the published 671B / 37B; the MTP module's 14B the released checkpoint adds is not part of
it). Training as published: AdamW (0.9, 0.95, weight decay 0.1), lr 2.2e-4 after 2000 warmup steps, 4096-token
sequences, batches of 15360, the choice biases moved by 0.001 a step.

  python tools/estimate.py --config=configs/deepseek_v3_671b.py --devices=1024 --set=mesh.expert=64 \
      --set=mesh.fsdp=16
  python -m jaxtrain.main --config=configs/deepseek_v3_671b.py --config.mesh.expert=64 --config.mesh.fsdp=16 \
      --config.dry_run=true --config.dry_run_topology=v5p:8x8x16
"""

from jaxtrain.config import base_config

SHAPES = dict(num_layers=61, d_model=7168, num_heads=128, mlp_dim=18432, vocab_size=129280, q_lora_rank=1536,
              kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10_000.0,
              rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_positions=4096,
              rope_yarn_beta_fast=32.0, rope_yarn_beta_slow=1.0, rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=1.0,
              num_experts=256, experts_per_token=8, expert_mlp_dim=2048, num_shared_experts=1, first_dense_layers=3,
              num_groups=8, topk_groups=4, routed_scaling_factor=2.5, normalize_topk=True, norm_eps=1e-6,
              tie_embeddings=False)


def get_config():
  c = base_config(model="deepseek_v3")
  c.workdir = "runs/deepseek_v3_671b"
  c.model.update(moe_impl="capacity", capacity_factor=1.25, bias_update_speed=0.001, dtype="bfloat16", remat="full",
                 **SHAPES)
  c.data.seq_len = 4096
  c.train.update(steps=100_000, global_batch_size=15360, microbatches=15, log_every=50)
  c.optim.update(lr=2.2e-4, warmup_steps=2000, b2=0.95, weight_decay=0.1)
  return c

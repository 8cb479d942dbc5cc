"""Kimi K2 (1.04T parameters, 32.6B active per token: 384 routed experts of which 8, and a shared one), trained with
MuonClip: Muon with QK-clip. DeepSeek-V3's architecture at other sizes (the ``deepseek_v3`` family; Hugging Face
``model_type`` ``kimi_k2`` imports as it: jaxtrain/models/deepseek_v3/hf.py). Pod-scale defaults as
configs/deepseek_v3_671b.py's: bf16 compute, full remat, experts with a capacity (factor 1.25), FSDP with expert
parallelism, 16 microbatches (one row a device each on 1024 chips): expert 64 x fsdp 16 on a v5p-2048 (6 routed experts
a chip), the dry run below (docs/benchmarks.md). It is not trained here.

Architecture from the released checkpoint's config.json (Kimi Team 2025, "Kimi K2: Open Agentic Intelligence",
arXiv:2507.20534): 61 layers, d_model 7168, 64 heads of multi-head latent attention (queries through a rank-1536
latent, keys and values through a rank-512 latent, 128 dims per head without position and 64 RoPE dims shared, values
of 128), RoPE theta 50000 with YaRN (factor 32 over 4096 original positions, betas 1 / 1, mscale 1 and mscale_all_dim
1: 131072 positions), the first layer dense (hidden 18432), the other 60 with 384 routed experts of hidden 2048 in one
group, top-8, sigmoid scores with the balancing bias, routed weights scaled by 2.827, one shared expert; vocab 163840,
untied head, norm_eps 1e-6. ``jaxtrain.models.deepseek_v3.param_counts`` on the abstract shapes: 1,026,408,232,448
total (transformers' count of the config.json jaxtrain exports, plus the 60 x 384 choice biases it holds as buffers),
32,861,500,928 active (published as "1T total, 32B activated").
Training as published: MuonClip (Muon whose updates match AdamW's RMS, weight decay 0.1; QK-clip at a threshold of 100
on every head's largest logit, ``model.qk_clip``), lr 2e-4 after 500 warmup steps, constant for 10T tokens and decayed
(there by a cosine to 2e-5; here linearly, ``wsd``) over the last 5.5T of 15.5T, 4096-token sequences, batches of
67M tokens (16384 sequences).

  python tools/estimate.py --config=configs/kimi_k2_1t.py --devices=1024 --set=mesh.expert=64 --set=mesh.fsdp=16
  python -m jaxtrain.main --config=configs/kimi_k2_1t.py --config.mesh.expert=64 --config.mesh.fsdp=16 \
      --config.dry_run=true --config.dry_run_topology=v5p:8x8x16
"""

from configs import deepseek_v3_671b

# DeepSeek-V3's shapes where Kimi K2's are the same (configs/deepseek_v3_671b.py), these where they differ.
SHAPES = dict(deepseek_v3_671b.SHAPES, num_heads=64, vocab_size=163840, rope_theta=50_000.0, rope_scaling_factor=32.0,
              rope_yarn_beta_fast=1.0, num_experts=384, first_dense_layers=1, num_groups=1, topk_groups=1,
              routed_scaling_factor=2.827)


def get_config():
  c = deepseek_v3_671b.get_config()  # (its pod-scale defaults: bf16, full remat, capacity 1.25, AdamW's betas)
  c.workdir = "runs/kimi_k2_1t"
  c.model.update(qk_clip=100.0, **SHAPES)
  c.train.update(steps=231_000, global_batch_size=16384, microbatches=16)
  c.optim.update(name="muon", lr=2e-4, warmup_steps=500, schedule="wsd", wsd_decay_fraction=0.355, end_lr_ratio=0.1)
  return c

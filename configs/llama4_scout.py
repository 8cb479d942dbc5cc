"""Llama 4 Scout (17B active, 16 experts; its text model: 107.8B of the published 109B, the rest its vision encoder).
Pod-scale defaults: bf16 compute, full remat, experts with a capacity (factor 1.25), FSDP with expert parallelism,
8192-token sequences (one chunk of the local layers). It is not trained here. The estimator and the TPU compiler size
it for a v5p-128 (64 chips, expert 16 x fsdp 4): 77.7 GiB per chip by the estimate, a peak of 92.1 GiB of 95 by
the TPU compiler (the dry run below, compiled on this host with libtpu):

  python tools/estimate.py --config=configs/llama4_scout.py --devices=64 --set=mesh.expert=16 --set=mesh.fsdp=4
  python -m jaxtrain.main --config=configs/llama4_scout.py --config.mesh.expert=16 --config.mesh.fsdp=4 \\
      --config.dry_run=true --config.dry_run_topology=v5p:4x4x4

Architecture from the released checkpoint's config.json (meta-llama/Llama-4-Scout-17B-16E, its text_config; the
defaults of transformers' Llama4TextConfig agree where they say): 48 layers, d_model 5120, 40 heads of 128, 8
key/value heads, every layer a MoE (interleave_moe_layer_step 1) of 16 routed experts of hidden 8192, top-1 by
sigmoid, and a shared expert of 8192 (intermediate_size_mlp 16384: the dense layers', of which Scout has none);
local layers attend within chunks of 8192, every 4th layer a global NoPE layer with attention temperature tuning
(floor_scale 8192, attn_scale 0.1); the local layers' q and k L2-normalized; RoPE theta 500000 with Llama 3's
scaling (factor 16, low and high frequency factors 1, 8192 original positions); vocab 202048, untied head, norm_eps
1e-5 (the ``llama4`` family: jaxtrain/models/llama4). ``jaxtrain.models.llama4.param_counts`` on the abstract
shapes: 107,769,861,120 total (transformers' count of the same config.json), 17,172,894,720 active.
"""

from jaxtrain.config import base_config

SHAPES = dict(num_layers=48, d_model=5120, num_heads=40, num_kv_heads=8, head_dim=128, mlp_dim=16384,
              vocab_size=202048, num_experts=16, experts_per_token=1, expert_mlp_dim=8192, moe_every=1,
              attention_chunk_size=8192, global_every=4, qk_l2_norm=True, attn_temperature_tuning=True,
              floor_scale=8192, attn_scale=0.1, rope_theta=500_000.0, rope_scaling="llama3", rope_scaling_factor=16.0,
              rope_low_freq_factor=1.0, rope_high_freq_factor=1.0, rope_original_max_positions=8192, norm_eps=1e-5,
              tie_embeddings=False)


def get_config():
  c = base_config(model="llama4")
  c.workdir = "runs/llama4_scout"
  c.model.update(moe_impl="capacity", capacity_factor=1.25, dtype="bfloat16", remat="full", **SHAPES)
  c.data.seq_len = 8192
  c.train.update(steps=100_000, global_batch_size=256, microbatches=4, log_every=50)
  c.optim.update(lr=1e-4, warmup_steps=2000, b2=0.95, weight_decay=0.1)
  return c

"""Qwen3-Next-80B-A3B (80B parameters, 3B active per token: 512 routed experts, top-10, and a gated shared one; three
gated DeltaNet layers to each gated full-attention one). Pod-scale defaults: bf16 compute, full remat, experts with a
capacity (factor 1.25), FSDP with expert parallelism, 16 microbatches (one row a device each on 64 devices). It is
not trained here. On a v5p-128 (64 chips, expert 8 x fsdp 8) the TPU compiler puts the step's peak at 50.0 GiB of a
chip's 95 (arguments 16.8 GiB, temporaries 53.8 GiB: the dry run below, compiled on this host with libtpu); the
estimator says 26.6 GiB, without the DeltaNet's chunk matrices, which it does not count.

Architecture from the released checkpoint's config.json (Qwen/Qwen3-Next-80B-A3B-Instruct): 48 layers, d_model
2048; every 4th layer gated full attention (16 query heads x 256, 2 KV heads, QK-norm, RoPE theta 1e7 on the first
quarter of each head, ``partial_rotary_factor`` 0.25), the others gated DeltaNet (16 q / k heads x 128, 32 v heads x
128, a conv of 4 taps); every layer 512 routed experts of hidden 512, top-10 of a softmax renormalized, and a shared
expert of hidden 512 gated by a sigmoid; zero-centred RMSNorm (eps 1e-6), vocab 151936, untied head (the
``qwen3_next`` family: jaxtrain/models/qwen3_next). ``jaxtrain.models.qwen3_next.param_counts`` on the abstract
shapes: 79,674,391,296 total (transformers' count of the same config.json), 3,874,929,408 active, 3,252,599,552
without the embedding table and the head (the published 80B / 3B; the multi-token-prediction weights the released
checkpoint adds are not part of it and are skipped on import).

  python tools/estimate.py --config=configs/qwen3_next_80b_a3b.py --devices=64 --set=mesh.expert=8 --set=mesh.fsdp=8
  python -m jaxtrain.main --config=configs/qwen3_next_80b_a3b.py --config.mesh.expert=8 --config.mesh.fsdp=8 \\
      --config.dry_run=true --config.dry_run_topology=v5p:4x4x4
"""

from jaxtrain.config import base_config

SHAPES = dict(num_layers=48, d_model=2048, num_heads=16, num_kv_heads=2, head_dim=256, mlp_dim=5120,
              vocab_size=151936, full_attention_every=4, partial_rotary_factor=0.25, rope_theta=10_000_000.0,
              linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128, linear_conv_kernel=4,
              num_experts=512, experts_per_token=10, expert_mlp_dim=512, shared_mlp_dim=512, normalize_topk=True,
              norm_eps=1e-6, tie_embeddings=False)


def get_config():
  c = base_config(model="qwen3_next")
  c.workdir = "runs/qwen3_next_80b_a3b"
  c.model.update(moe_impl="capacity", capacity_factor=1.25, load_balance_weight=0.01, dtype="bfloat16", remat="full",
                 **SHAPES)
  c.data.seq_len = 4096
  c.train.update(steps=100_000, global_batch_size=1024, microbatches=16, log_every=50)
  c.optim.update(lr=2e-4, warmup_steps=2000, b2=0.95, weight_decay=0.1)
  return c

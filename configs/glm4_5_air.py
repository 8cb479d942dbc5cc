"""GLM-4.5-Air (106B parameters, 12B active per token: 128 routed experts, top-8, and a shared one). Pod-scale
defaults: bf16 compute, full remat, experts with a capacity (factor 1.25), FSDP with expert parallelism, 64
microbatches (one row a device each on 64 chips). The estimator sizes it for a v5p-128 (64 chips): expert 8 x fsdp
8, 42.7 GiB per chip by the estimate, 53.5 GiB by the TPU compiler for v5p:4x4x4 (the dry run below, jax 0.10.2,
libtpu 0.0.42: arguments 27.5 GiB, temporaries 39.0 GiB). It is not trained here.

Architecture from the released checkpoint's config.json (zai-org/GLM-4.5-Air; GLM-4.5 Team 2025, "GLM-4.5: Agentic,
Reasoning, and Coding (ARC) Foundation Models", arXiv:2508.06471): 46 layers, d_model 4096, 96 query heads x 128 and
8 KV heads with biases on q, k and v (no QK-norm: GLM-4.5's 355B model has it), RoPE theta 1e6 on the first half of
each head (``partial_rotary_factor`` 0.5), the first layer dense (hidden 10944), the other 45 with 128 routed experts
of hidden 1408 and one shared expert, top-8 of sigmoid scores with the balancing bias (one group, weights normalized,
scaled by 1.0); vocab 151552, untied head, norm_eps 1e-5 (the ``glm4_moe`` family: jaxtrain/models/glm4_moe).
``jaxtrain.models.moe.param_counts`` on the abstract shapes: 106,852,251,264 total (transformers' count of the same
config.json plus the 45 x 128 choice biases it holds as buffers), 13,424,129,664 active, 12,182,615,680 without the
embedding table and the head (the published 106B / 12B; the MTP layer the released checkpoint adds is not part of
it and is skipped on import). GLM-4.5 trained with Muon; AdamW here (lr 2.5e-4, weight decay 0.1), the choice biases
moved by 0.001 a step, 4096-token sequences, 16M-token batches (4096 x 4096).

  python tools/estimate.py --config=configs/glm4_5_air.py --devices=64 --set=mesh.expert=8 --set=mesh.fsdp=8
  python -m jaxtrain.main --config=configs/glm4_5_air.py --config.mesh.expert=8 --config.mesh.fsdp=8 \
      --config.dry_run=true --config.dry_run_topology=v5p:4x4x4
"""

from jaxtrain.config import base_config

SHAPES = dict(num_layers=46, d_model=4096, num_heads=96, num_kv_heads=8, head_dim=128, mlp_dim=10944,
              vocab_size=151552, qkv_bias=True, qk_norm="", partial_rotary_factor=0.5, rope_theta=1_000_000.0,
              num_experts=128, experts_per_token=8, expert_mlp_dim=1408, num_shared_experts=1, first_dense_layers=1,
              num_groups=1, topk_groups=1, routed_scaling_factor=1.0, normalize_topk=True, norm_eps=1e-5,
              tie_embeddings=False)


def get_config():
  c = base_config(model="glm4_moe")
  c.workdir = "runs/glm4_5_air"
  c.model.update(moe_impl="capacity", capacity_factor=1.25, bias_update_speed=0.001, dtype="bfloat16", remat="full", **SHAPES)
  c.data.seq_len = 4096
  c.train.update(steps=100_000, global_batch_size=4096, microbatches=64, log_every=50)
  c.optim.update(lr=2.5e-4, warmup_steps=2000, b2=0.95, weight_decay=0.1)
  return c

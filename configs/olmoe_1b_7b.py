"""OLMoE-1B-7B-0924 (6.9B parameters, 1.3B active per token: 64 experts, top-8). Pod-scale defaults: bf16 compute,
remat of dots, dropless experts as in the paper, FSDP over all chips (``mesh.expert`` = 1: no all-to-all).

Architecture from the released checkpoint (Muennighoff et al. 2024, arXiv:2409.02060): 16 layers, d_model 2048,
16 heads x 128 (no GQA), QK-norm over the whole 2048-wide q and k projections, each feed-forward 64 SwiGLU experts of
hidden size 1024, softmax router, top-8 weights kept as they are (not renormalized); vocab 50304, untied head,
rope_theta 10000, norm_eps 1e-5 (the ``olmoe`` family: jaxtrain/models/moe/presets.py).
``jaxtrain.models.moe.param_counts`` on the abstract shapes: 6,919,161,856 total (transformers' count of the same
shapes), 1,282,017,280 active (the published 6.9B / 1.3B to the rounding).

Training as the paper's: 4M-token batches (1024 x 4096), AdamW lr 4e-4, 10k warmup steps, cosine, weight decay
0.1, load-balance loss 0.01, router z-loss 0.001, dropless (5T tokens would be ~1.2M steps). Expert parallelism
(tools/estimate.py, 256 chips): ``mesh.expert=8`` cuts the fsdp traffic from ~77 to ~14 GiB per step and device
but adds all-to-alls: ~52 GiB with ``model.moe_impl=capacity``, ~336 GiB dropless (its padded buffers are
ep x the tokens; jaxtrain/parallel/experts.py).

  python tools/estimate.py --config=configs/olmoe_1b_7b.py --devices=256 [--set=mesh.expert=8]
"""

from jaxtrain.config import base_config


def get_config():
  c = base_config(model="olmoe")
  c.workdir = "runs/olmoe_1b_7b"
  c.model.update(num_layers=16, d_model=2048, num_heads=16, num_kv_heads=16, head_dim=128, vocab_size=50304,
                 num_experts=64, experts_per_token=8, expert_mlp_dim=1024, router_scores="softmax",
                 normalize_topk=False, rope_theta=10_000.0, norm_eps=1e-5, moe_impl="dropless",
                 load_balance_weight=0.01, router_z_weight=0.001, dtype="bfloat16", remat="save_dots")
  c.data.seq_len = 4096
  c.train.update(steps=100_000, global_batch_size=1024, log_every=50)
  c.optim.update(lr=4e-4, warmup_steps=10_000)
  return c

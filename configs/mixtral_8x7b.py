"""Mixtral-8x7B-v0.1 (46.7B parameters, 12.9B active per token: 8 experts, top-2). Pod-scale defaults: bf16
compute, full remat, one expert per device group over ``mesh.expert`` = 8 with capacity routing, FSDP over the rest.

Architecture from the released checkpoint (Jiang et al. 2024, arXiv:2401.04088): Mistral-7B's attention (32 layers,
d_model 4096, 32 heads x 128, 8 KV heads, rope_theta 1e6, norm_eps 1e-5) with each feed-forward replaced by 8
SwiGLU experts of hidden size 14336, softmax router, top-2 weights renormalized to sum 1; vocab 32000, untied head.
``jaxtrain.models.moe.param_counts`` on the abstract shapes: 46,702,792,704 total, 12,879,925,248 active (the
published 46.7B / 12.9B to the rounding; +0.006% / -0.16%).

The paper gives no training recipe: 4M-token batches (1024 x 4096) and AdamW 3e-4 as at Llama scale;
load_balance_weight 0.01 is Switch's (transformers' Mixtral ``router_aux_loss_coef`` 0.02 is on a loss k = 2
times this one's). Why capacity and not dropless, and full remat (tools/estimate.py, 256 chips, 4 rows each):
dropless with ep = 8 ships a padded [ep, S, D] buffer per all-to-all, 2 GiB here, ~336 GiB sent per step and
device against 52.5 GiB for capacity_factor 1.25 (and ep = 1 would all-gather every expert: ~520 GiB of fsdp
traffic); save_dots would keep ~100 GiB of activations per device. ``--config.model.moe_impl=dropless`` for
no dropped tokens.

  python tools/estimate.py --config=configs/mixtral_8x7b.py --devices=256

Variant for a TPU slice, the fastest of the settings compared on the TPU compiler's own estimate that fits the chip
(``tools/bench_tpu.py``; docs/benchmarks.md "TPU: defaults per target"): ``configs/mixtral_8x7b.py:v5p`` for v5p-128 (64
chips: expert 8 x fsdp 8, 2 sequences of 4,096 tokens each, splash attention, remat ``save_dots``). On another
slice size, scale ``train.global_batch_size`` with the chips. Its workdir is ``runs/mixtral_8x7b_v5p``.
"""

from jaxtrain.config import base_config, for_target

# Per target: the overrides for its 64 chips, from bench_tpu's estimates
# (benchmarks/results/tpu_mixtral_8x7b_<target>*.json; their figures: docs/benchmarks.md "TPU: defaults per target";
# the settings compared: benchmarks/NOTES.md).
TARGETS = {"v5p": {"train.global_batch_size": 128, "model.remat": "save_dots", "model.attention": "splash"}}


def get_config(variant: str = ""):
  c = base_config(model="moe")
  c.workdir = "runs/mixtral_8x7b"
  c.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=32000,
                 num_experts=8, experts_per_token=2, expert_mlp_dim=14336, router_scores="softmax",
                 normalize_topk=True, rope_theta=1_000_000.0, norm_eps=1e-5, moe_impl="capacity",
                 capacity_factor=1.25, load_balance_weight=0.01, router_z_weight=0.001, dtype="bfloat16",
                 remat="full")
  c.mesh.expert = 8
  c.data.seq_len = 4096
  c.train.update(steps=100_000, global_batch_size=1024, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return for_target(c, "mixtral_8x7b", TARGETS, variant)

"""Llama 3 70B (70.6B parameters). Pod-scale defaults: bf16, FSDP x 8-way tensor parallel, full remat.

Variant for a TPU slice, the fastest of the settings compared on the TPU compiler's own estimate that fits the chip
(``tools/bench_tpu.py``; docs/benchmarks.md "TPU: defaults per target"): ``configs/llama3_70b.py:v5p`` for v5p-128 (64
chips, pure FSDP, 2 sequences of 8,192 tokens each, splash attention, remat ``save_qkv_proj``) and
``configs/llama3_70b.py:v6e`` for v6e-64 (64 chips of 32 GiB, pure FSDP, 1 sequence, splash, remat ``offload_full``:
the layer inputs in host memory). On another slice size, scale ``train.global_batch_size`` with the chips. Their
workdirs are ``runs/llama3_70b_<target>``.
"""

from jaxtrain.config import base_config, for_target

# Per target: the overrides for its 64 chips, from bench_tpu's estimates
# (benchmarks/results/tpu_llama3_70b_<target>.json; their figures: docs/benchmarks.md "TPU: defaults per target";
# the settings compared: benchmarks/NOTES.md).
# On v6e full remat would need 34.3 of 32 GiB (tools/estimate.py); on v5p save_dots would need 127 GiB.
TARGETS = {"v5p": {"train.global_batch_size": 128, "model.remat": "save_qkv_proj", "model.attention": "splash",
                   "mesh.tensor": 1},
           "v6e": {"train.global_batch_size": 64, "model.remat": "offload_full", "model.attention": "splash",
                   "mesh.tensor": 1}}


def get_config(variant: str = ""):
  c = base_config()
  c.workdir = "runs/llama3_70b"
  c.model.update(num_layers=80, d_model=8192, num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672,
                 vocab_size=128256, rope_theta=500_000.0, dtype="bfloat16", remat="full")
  c.mesh.tensor = 8
  c.data.seq_len = 8192
  c.train.update(steps=100_000, global_batch_size=1024, log_every=50)
  c.optim.update(lr=1.5e-4, warmup_steps=2000)
  return for_target(c, "llama3_70b", TARGETS, variant)

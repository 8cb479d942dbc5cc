"""Llama 3 8B (8.03B parameters). Pod-scale defaults: bf16 compute, FSDP over all chips, remat of dots.

Variants for a TPU slice, each the fastest of the settings compared on the TPU compiler's own estimate that fits
the chip (``tools/bench_tpu.py``; remat full or save_dots, 1 or 2 sequences per chip: docs/benchmarks.md
"TPU: defaults per target"): ``configs/llama3_8b.py:v5p`` for v5p-128 (64 chips, 2 sequences of 8,192 tokens each)
and ``:v6e`` for v6e-64 (64 chips, 1 sequence each), both splash attention and remat ``save_dots``. On another
slice size, scale ``train.global_batch_size`` with the chips. Each variant has its own workdir,
``runs/llama3_8b_<variant>``.
"""

from jaxtrain.config import base_config, for_target

# Per target: the overrides for its 64 chips, from bench_tpu's estimates
# (benchmarks/results/tpu_llama3_8b_<target>.json; their figures: docs/benchmarks.md "TPU: defaults per target";
# the settings compared: benchmarks/NOTES.md).
TARGETS = {
    "v5p": {"train.global_batch_size": 128, "model.remat": "save_dots", "model.attention": "splash"},
    "v6e": {"train.global_batch_size": 64, "model.remat": "save_dots", "model.attention": "splash"},
}


def get_config(variant: str = ""):
  c = base_config()
  c.workdir = "runs/llama3_8b"
  c.model.update(num_layers=32, d_model=4096, num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                 vocab_size=128256, rope_theta=500_000.0, dtype="bfloat16", remat="save_dots")
  c.data.seq_len = 8192
  c.train.update(steps=100_000, global_batch_size=512, log_every=50)
  c.optim.update(lr=3e-4, warmup_steps=2000)
  return for_target(c, "llama3_8b", TARGETS, variant)

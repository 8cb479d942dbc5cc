"""A tiny Mixture-of-Experts model for CPU (seconds per step on 8 simulated devices): 8 experts, top-2, on the
bundled corpus. ``--config.mesh.expert=N`` shards the experts over N devices (tokens travel by all-to-all).

  python -m jaxtrain.main --config=configs/moe_tiny.py --config.mesh.expert=4
"""

from jaxtrain.config import base_config


def get_config():
  c = base_config(model="moe")
  c.workdir = "runs/moe_tiny"
  c.model.update(num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=256,
                 num_experts=8, experts_per_token=2, expert_mlp_dim=192, load_balance_weight=0.01,
                 router_z_weight=0.001)
  c.data.seq_len = 128
  c.train.update(steps=200, global_batch_size=16, log_every=10)
  c.optim.update(lr=3e-3, warmup_steps=20, weight_decay=0.0)
  return c

"""GRPO on arithmetic (tools/arithmetic_prompts.py's "a+b=" prompts, reward: the exact answer): configs/tiny.py's
model, fine-tuned first to the format (runs/arithmetic_sft, docs/post_training.md), learns to add by reward."""

from jaxtrain.config import base_config


def get_config():
  c = base_config()
  c.workdir = "runs/grpo_math"
  c.model.update(num_layers=4, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=384, vocab_size=256)
  c.train.update(objective="grpo", steps=200, global_batch_size=64, log_every=10)
  c.data.update(source="prompts", path="data/arithmetic/train.jsonl", eval_path="data/arithmetic/held_out.jsonl",
                seq_len=16)
  # 8 prompts a step, 8 completions each, at most 4 new tokens, a newline ends one; the answer checked exactly.
  c.rl.update(group_size=8, max_new_tokens=4, stop=("\n",), rewards="exact_match", kl_weight=0.04)
  c.eval.every_steps = 20  # eval_reward_mean: the held-out problems, one completion each
  c.optim.update(lr=2e-4, warmup_steps=0, schedule="constant", weight_decay=0.0)  # 1e-3 undoes the fine-tuning
  c.checkpoint.restore_from = "runs/arithmetic_sft/checkpoints"
  return c

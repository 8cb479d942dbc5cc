"""GRPO whose held-out reward rises within minutes on a CPU: reverse two letters (tools/letter_prompts.py's "ab>"
prompts, reward: the exact answer "ba"). A 2-layer byte-level model, one device.

Variants, run in this order (docs/post_training.md has the commands and the held-out reward they reach):
``configs/grpo_letters.py:sft`` fine-tunes the random model to the format for 60 steps (the language-model objective
on the answered training pairs, runs/letters_sft); ``configs/grpo_letters.py:grpo`` (the default) trains it by
reward for 100 steps (runs/grpo_letters), the held-out pairs' reward logged as ``eval_reward_mean`` every 20 steps.
"""

from jaxtrain.config import base_config


def get_config(variant: str = "grpo"):
  c = base_config()
  c.model.update(num_layers=2, d_model=64, num_heads=8, num_kv_heads=4, head_dim=16, mlp_dim=128, vocab_size=256)
  if variant == "sft":
    c.workdir = "runs/letters_sft"
    c.data.update(source="raw", path="data/letters/sft.jsonl", seq_len=32, tokenizer="byte")
    c.train.update(steps=60, global_batch_size=16, log_every=10)
    c.optim.update(lr=3e-3, warmup_steps=5)
  elif variant == "grpo":
    c.workdir = "runs/grpo_letters"
    c.train.update(objective="grpo", steps=100, global_batch_size=64, log_every=10)
    c.data.update(source="prompts", path="data/letters/train.jsonl", eval_path="data/letters/held_out.jsonl",
                  seq_len=8)
    # 8 prompts a step, 8 completions each, at most 4 new tokens, a newline ends one; the answer checked exactly.
    c.rl.update(group_size=8, max_new_tokens=4, stop=("\n",), rewards="exact_match", kl_weight=0.0)
    c.eval.every_steps = 20  # eval_reward_mean: the 16 held-out pairs, one completion each
    c.optim.update(lr=1e-3, warmup_steps=0, schedule="constant")
    c.checkpoint.restore_from = "runs/letters_sft/checkpoints"
  else:
    raise ValueError(f"unknown variant '{variant}' of grpo_letters.py: use sft or grpo")
  return c

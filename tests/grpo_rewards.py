"""Reward functions for tests/test_grpo.py's bad-input cases, named as ``tests.grpo_rewards:<function>``."""


def wrong_shape(completions, records):
  return [0.0] * (len(completions) + 1)  # one number too many


def first_letter(completions, records):
  return [float(c[:1] == r["answer"][:1]) for c, r in zip(completions, records)]

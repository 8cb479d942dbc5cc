"""Reward functions for tests/test_grpo.py, named as ``tests.grpo_rewards:<function>``."""


def wrong_shape(completions, records):
  return [0.0] * (len(completions) + 1)  # one number too many


def letters(completions, records):
  """The share of a completion's characters that are lowercase letters: varies between samples of any model."""
  return [sum(ch.islower() for ch in c) / max(len(c), 1) for c in completions]

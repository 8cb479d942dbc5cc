"""Metric output: one console line and one JSON object in ``workdir/metrics.jsonl`` per logged step."""

from __future__ import annotations

import json

import jax
from absl import logging
from etils import epath


class MetricWriter:
  """Writes on process 0 only; other processes keep quiet."""

  def __init__(self, workdir: str, total_steps: int):
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.total_steps = total_steps
    self.enabled = jax.process_index() == 0

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")
    logging.info("step %d/%d | loss %.4f | grad_norm %.3f | lr %.2e | %s tok/s | %.3fs/step", step,
                 self.total_steps, record["loss"], record["grad_norm"], record["lr"],
                 f"{record['tokens_per_sec']:,.0f}", record["step_time"])

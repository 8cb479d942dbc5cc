"""A loop hook added from outside ``jaxtrain/`` (docs/extending.md walks through it), named in a config by its
import path: ``c.train.hooks = ("tests.hook_example:loss_log",)``. Every 3 steps and at the last it appends the
step, its loss and whether the step was logged to ``<workdir>/loss_log.jsonl``; it also adds to every log record
how many lines it has written (``loss_log/lines``)."""

import json
import os

import jax

from jaxtrain.train import hooks


class LossLog(hooks.Hook):
  every = 3

  def __init__(self, path: str):
    self.path, self.lines = path, 0

  def logged(self, loop, step, record):
    if jax.process_index() == 0:  # every process calls its hooks; one writes
      with open(self.path, "a") as f:
        f.write(json.dumps({"step": step, "loss": loop.last["loss"], "logged": record is not None}) + "\n")
    self.lines += 1

  def metrics(self, loop, step, record):
    return {"loss_log/lines": self.lines}


def loss_log(run) -> LossLog:
  """The factory ``train.hooks`` names: called once per run with its :class:`jaxtrain.train.run.Run`."""
  return LossLog(os.path.join(run.config.workdir, "loss_log.jsonl"))

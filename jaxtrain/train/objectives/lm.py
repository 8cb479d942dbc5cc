"""``lm``: the language model's objective, next-token cross-entropy over the real target tokens (the default).

Its step is :func:`jaxtrain.train.step.make_train_step` (microbatches, pipeline stages, context parallelism, a
data mixture's per-component metrics, the z-loss, the model's auxiliary losses); its evaluation is eval loss and
perplexity over the held-out split and the named eval sets.
"""

from __future__ import annotations

import math

import jax

from jaxtrain import data as data_lib
from jaxtrain import sharding
from jaxtrain.parallel import context as context_lib
from jaxtrain.train import step as step_lib
from jaxtrain.train.objectives.base import OBJECTIVES, Objective


@OBJECTIVES.register("lm")
class LanguageModel(Objective):
  """Next-token cross-entropy (plus the z-loss and the model's weighted auxiliary losses)."""
  loss_scaling = True

  def make_train_step(self, run):
    return step_lib.make_train_step(run.model, run.tx, run.lr_schedule, run.microbatches, run.state_shardings,
                                    run.pipeline_schedule, run.aux_weights, context_lib.shards(run.mesh), run.sources,
                                    run.config.train.z_loss_weight)

  def make_evaluator(self, run):
    """``params -> fetch``: dispatches the eval of ``params`` over every eval set (:func:`jaxtrain.data.eval_sets`;
    one compiled step, not waited for, so the params may be donated next); ``fetch()`` waits and returns
    ``{eval_loss, eval_perplexity, eval_tokens}`` over the training data's eval split (each loss the mean over all
    real target tokens: a mixture's components' splits pooled, so token-weighted) and ``eval_loss/<name>`` for each
    named set (a mixture's components, ``eval.sets``)."""
    sets = [(s.name, s.in_total, [data_lib.to_global(b, run.batch_sharding) for b in s.batches])
            for s in data_lib.eval_sets(run.config)]
    eval_step = jax.jit(step_lib.make_eval_step(run.model, run.pipeline_schedule, context_lib.shards(run.mesh)),
                        in_shardings=(run.state_shardings.params, run.batch_sharding))

    def evaluate(params):
      with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
        sums = [(name, in_total, [eval_step(params, b) for b in batches]) for name, in_total, batches in sets]

      def fetch() -> dict[str, float]:
        out, total = {}, [0.0, 0.0]
        for name, in_total, parts in sums:
          loss_sum, tokens = (sum(float(x[i]) for x in parts) for i in (0, 1))
          if name is not None:
            out[f"eval_loss/{name}"] = loss_sum / max(tokens, 1.0)
          if in_total:
            total = [total[0] + loss_sum, total[1] + tokens]
        if any(in_total for _, in_total, _ in sums):
          loss = total[0] / max(total[1], 1.0)
          out = {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": total[1], **out}
        return out

      return fetch

    return evaluate

"""Benchmark scores: EleutherAI's lm-evaluation-harness on jaxtrain's models (``harness``: the harness model and its
evaluator; ``scoring``: log-likelihoods on the mesh in a few compiled shapes). The command line is
jaxtrain.evaluate; in a run, ``eval.harness_tasks`` (jaxtrain.train.hooks.Harness)."""

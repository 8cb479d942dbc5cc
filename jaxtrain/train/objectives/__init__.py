"""Training objectives by name (``train.objective``): :data:`OBJECTIVES`, the :class:`Objective` protocol
(:mod:`.base`), what preference and RL objectives share (:mod:`.logprobs`: per-token log-probabilities, the
reference model), and the built-in objectives, each in its own module: ``lm`` (next-token cross-entropy, :mod:`.lm`),
``dpo``, ``simpo`` and ``orpo`` (preference pairs, :mod:`.preference`), ``grpo`` (reinforcement learning with
verifiable rewards, :mod:`.grpo`; its rewards: :mod:`.rewards`).
"""

from jaxtrain.train.objectives import grpo, lm, preference  # noqa: F401 - built-in objectives register on import
from jaxtrain.train.objectives.base import OBJECTIVES, Objective, check_loss_scaling, of, validate  # noqa: F401 - API

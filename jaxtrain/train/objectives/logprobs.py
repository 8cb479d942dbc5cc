"""What preference and RL objectives share: per-token log-probabilities of a batch's targets under the model, and
the reference model they are measured against.

:func:`token_logps` is the training forward's own arithmetic (:func:`jaxtrain.train.losses.cross_entropy`, float32
from logits in the compute dtype), so a log-probability computed here for the loss, for a reference or for a
sampled token's check is the same number wherever it is computed.

:class:`Reference` gives the reference model's params for a step: with LoRA (``reference="adapters_off"``) the
policy's own base weights with the adapters switched off (no second copy of the base in memory); otherwise
(``"frozen"``) a copy of the run's starting params (:func:`jaxtrain.train.start.starting_state`: the seeded init or
``checkpoint.restore_from``), laid out like the params and never updated. Both are rebuilt the same on every
restart, so a resumed run's reference is the one it started with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.models import Model, Output, lora
from jaxtrain.train import losses as losses_lib
from jaxtrain.train import start

REFERENCES = ("frozen", "adapters_off")


def token_logps(model: Model, params, batch: dict, prefix: str = "", temperature: float = 1.0) -> jax.Array:
  """``log p(target | inputs)`` per token, float32 ``[rows, seq_len]``, 0 where ``loss_mask`` is 0 (selected, not
  multiplied: a masked token's logits never reach the value or the gradient). ``prefix``: the batch's keys are
  ``prefix + "inputs"`` etc. (``"chosen_"`` for one side of a preference pair). ``temperature``: the
  log-probabilities of the distribution a sampler at that temperature draws from (:func:`tempered_logps`)."""
  return token_logps_and_aux(model, params, batch, prefix, temperature)[0]


def token_logps_and_aux(model: Model, params, batch: dict, prefix: str = "",
                        temperature: float = 1.0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """:func:`token_logps` and the forward's auxiliary losses (a MoE router's), which an objective that trains the
  model adds to its loss as the language model's step does (:func:`weighted_aux`)."""
  out = Output.of(model.forward(params, batch[prefix + "inputs"], batch[prefix + "positions"],
                                batch[prefix + "segment_ids"]))
  logps = tempered_logps(out.logits, batch[prefix + "targets"], temperature)
  return jnp.where(batch[prefix + "loss_mask"] > 0, logps, 0.0), out.aux_losses


def weighted_aux(aux: dict[str, jax.Array], weights: dict[str, float]) -> jax.Array:
  """``sum(weights[n] * aux[n])``: the auxiliary losses' term of an objective (``Run.aux_weights``: the model's
  ``model.<name>_weight`` keys); 0 for a model without them."""
  return sum((w * aux[n] for n, w in weights.items()), jnp.zeros((), jnp.float32))


def tempered_logps(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
  """``log softmax(logits / temperature)[token]``, float32, by the training loss's arithmetic
  (:func:`jaxtrain.train.losses.cross_entropy`): the one function the training forward (:func:`token_logps`) and an
  RL sampler (for each token it draws, jaxtrain.train.objectives.grpo) compute a token's log-probability with, so
  that the two agree bitwise when the logits do. At temperature 1 the logits go in as the head computed them (in the
  compute dtype); otherwise they are divided in float32, as jaxtrain.sampling divides them before it draws (TRL's
  convention: the ratio and the KL are those of the tempered policy). A nucleus (top-p) cut is not renormalized in
  (as TRL and Tunix)."""
  if temperature != 1.0:
    logits = logits.astype(jnp.float32) / temperature
  return -losses_lib.cross_entropy(logits, tokens)


def without_adapters(params: dict) -> dict:
  """The base model's params of LoRA-adapted ``params`` (the adapters dropped: the model then computes with the
  base weights as they are, bitwise what a frozen copy of the base computes)."""
  return {k: v for k, v in params.items() if k != lora.KEY}


class Reference:
  """The reference model's params for a run: ``mode`` ``"adapters_off"`` (LoRA only) or ``"frozen"``."""

  def __init__(self, run, mode: str):
    self.mode = mode
    self._frozen = None
    if mode == "frozen":
      self._frozen = without_adapters(start.starting_state(run, role="the frozen reference model:").params)

  @staticmethod
  def default_mode(config) -> str:
    """``adapters_off`` with LoRA, else ``frozen``."""
    return "adapters_off" if lora.active(config.model) else "frozen"

  @property
  def extra(self) -> tuple:
    """What a compiled step takes besides ``(state, batch, skip)``: the frozen params, or nothing."""
    return (self._frozen,) if self._frozen is not None else ()

  def abstract_extra(self, run) -> tuple:
    """:attr:`extra` as shapes laid out like the params (for compiling)."""
    if self._frozen is None:
      return ()
    shardings = without_adapters(run.state_shardings.params)
    return (jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self._frozen, shardings),)

  def params(self, policy_params: dict, *extra) -> dict:
    """Inside a step: the reference's params (``extra``: the step's arguments after ``skip``), never
    differentiated."""
    params = extra[0] if self.mode == "frozen" else without_adapters(policy_params)
    return jax.tree.map(jax.lax.stop_gradient, params)

"""Context parallelism: the sequence of every activation split over the ``context`` mesh axis.

The rules map the logical axis ``length`` to ``context``, so the batch's tokens, the embeddings, the residual
stream, the MLPs and the logits are each held as ``seq_len / context`` tokens per device, and nothing else changes
in the model. Attention needs every key of the sequence: :func:`jaxtrain.models.attention.attend` constrains keys
and values to an unsplit ``length``, so XLA all-gathers them over ``context`` (the strategy MaxText and torchtitan
default to; a ring is a later refinement) while each device keeps its own queries. The attention mask is built
from segment ids and positions (causal by position within a document), never from the token order.

Load balance. Causal attention gives the end of a sequence more work than its start, so the sequence is cut into
``2 C`` chunks and device i holds chunks i and ``2C - 1 - i`` (:func:`balance_order`): every device gets the same
causal work. The reorder is a fixed permutation of the batch's ``[batch, length]`` fields at the top of the step
(:func:`balance`); the loss is a mean over tokens, so it is unchanged, and positions travel with their tokens
(RoPE, the mask and packed documents stay correct across shard boundaries).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxtrain.errors import ConfigError
from jaxtrain.sharding import constrain


def balance_order(seq_len: int, shards: int) -> np.ndarray:
  """The token order giving shard i of ``shards`` the chunks i and ``2 shards - 1 - i`` of ``2 shards``."""
  if shards == 1:
    return np.arange(seq_len)
  chunks = np.arange(seq_len).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def balance(batch: dict, shards: int) -> dict:
  """``batch`` with its ``[batch, length]`` fields in :func:`balance_order` (a no-op for one shard)."""
  if shards == 1:
    return batch
  seq_len = batch["inputs"].shape[1]
  order = balance_order(seq_len, shards)
  return {k: constrain(v[:, order], ("batch", "length")) if v.ndim == 2 and v.shape[1] == seq_len else v
          for k, v in batch.items()}


def shards(mesh: jax.sharding.Mesh) -> int:
  return mesh.shape.get("context", 1)


def validate(config) -> None:
  """The sequence splits into 2 x context equal chunks (one line otherwise). Whether the model family can run on a
  split sequence is its own declaration, checked with the model (``Family.context_parallel``, jaxtrain/models/core.py):
  every built-in family can, the MoE ones too (the experts' dispatch runs on each device's own tokens)."""
  context = config.mesh.context * config.mesh.dcn_context
  if context == 1:
    return
  if context < 1:
    return  # -1: checked against the devices when the mesh is made
  if config.data.seq_len % (2 * context):
    raise ConfigError("mesh.context", f"data.seq_len={config.data.seq_len} does not split into 2 x {context} equal "
                      "chunks (each device holds two, for a balanced causal load)",
                      f"make data.seq_len a multiple of {2 * context}")

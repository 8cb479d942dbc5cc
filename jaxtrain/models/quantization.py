"""Quantized training of the layers' matmuls: ``model.quantization`` = none | int8 | fp8.

The projections inside every layer (attention's q, k, v and output; the MLP's gate, up and down; a MoE layer's
experts) multiply quantized operands in the forward pass *and* in both matmuls of the backward pass, through
Google's qwix (what MaxText's ``quantization=int8|fp8`` runs on):

* ``int8``: operands and incoming gradients in int8 (TPU v5e / v5p: twice the bf16 rate on the MXU).
* ``fp8``: operands in float8_e4m3fn, incoming gradients in float8_e5m2, whose wider range suits gradients (the
  "hybrid" format of NVIDIA's Transformer Engine; H100 and newer, TPU v7).

Scales are computed on the fly each step from the absolute maximum (dynamic, symmetric): per row of the
activations and of the gradients (per token), per output channel of the weights. The parameters stay float32
and the optimizer, the checkpoints and Hugging Face export never see a quantized value, so a checkpoint moves
freely between quantized and unquantized runs. The embedding lookup, the output head, the MoE router and
attention's own score and value matmuls keep the compute dtype (MaxText quantizes only its decoder layers'
``dot_general``\\s too): those are where quantization error hurts most for the least time saved.

A model takes its matmuls from here: ``dot_general(name)`` for ``nnx.Linear(dot_general=...)``, ``einsum(name)``
for ``nnx.Einsum(einsum_op=...)`` and ``ragged_dot(name)`` for grouped expert matmuls; with ``none`` they are
JAX's own functions, so an unquantized model is the program it always was.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxtrain import _compat
from jaxtrain.registry import Registry


@dataclasses.dataclass(frozen=True)
class Recipe:
  """The operands' type in the forward matmul and the incoming gradient's type in the two backward matmuls."""
  forward: Any
  backward: Any


QUANTIZATION: Registry[Recipe | None] = Registry("model.quantization", "quantization",
                                                 how="jaxtrain.models.quantization.QUANTIZATION.register")
QUANTIZATION.register("none", None)
QUANTIZATION.register("int8", Recipe(jnp.int8, jnp.int8))
QUANTIZATION.register("fp8", Recipe(jnp.float8_e4m3fn, jnp.float8_e5m2))


# qwix's public entry point, ``qwix.quantize_model``, subclasses a module and intercepts ``jax.lax.dot_general``
# while it runs, telling weights from activations by walking the caller's stack frames for the module. jaxtrain's
# layers run as pure functions of split weights inside scans and remat, which that interception does not follow,
# so the model asks for its quantized matmuls explicitly and these call qwix's own quantized-training ops (a
# private module path, through jaxtrain._compat, which names the qwix releases it was checked on).
def _qt():
  return _compat.qwix_quantized_training()  # loaded by a quantized model only


@functools.cache
def _dot_general(recipe: Recipe) -> Callable:
  dot_general_qt, _ = _qt()
  config = dot_general_qt.DotGeneralQtConfig(lhs_qtype=recipe.forward, rhs_qtype=recipe.forward,
                                             dlhs_grad_qtype=recipe.backward, drhs_grad_qtype=recipe.backward)

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    del precision, preferred_element_type, out_sharding  # the quantized matmul sets its own
    return dot_general_qt.dot_general_qt(lhs, rhs, dimension_numbers, config)
  return dot_general


def dot_general(name: str) -> Callable:
  """``jax.lax.dot_general``, quantized by recipe ``name``."""
  recipe = QUANTIZATION.get(name)
  return jax.lax.dot_general if recipe is None else _dot_general(recipe)


@functools.cache
def _einsum(recipe: Recipe) -> Callable:
  return functools.partial(jnp.einsum, _dot_general=_dot_general(recipe))


def einsum(name: str) -> Callable:
  """``jnp.einsum`` of two operands whose contraction runs :func:`dot_general` of recipe ``name``."""
  recipe = QUANTIZATION.get(name)
  return jnp.einsum if recipe is None else _einsum(recipe)


@functools.cache
def _ragged_dot(recipe: Recipe) -> Callable:
  _, ragged_dot_qt = _qt()
  config = ragged_dot_qt.RaggedDotQtConfig(lhs_qtype=recipe.forward, rhs_qtype=recipe.forward,
                                           dlhs_grad_qtype=recipe.backward, drhs_grad_qtype=recipe.backward)
  return lambda lhs, rhs, group_sizes: ragged_dot_qt.ragged_dot_qt(lhs, rhs, group_sizes, config)


def ragged_dot(name: str) -> Callable:
  """``jax.lax.ragged_dot(lhs [rows, in], rhs [groups, in, out], group_sizes)``, quantized by recipe ``name``."""
  recipe = QUANTIZATION.get(name)
  return jax.lax.ragged_dot if recipe is None else _ragged_dot(recipe)

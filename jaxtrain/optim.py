"""The optax optimizer from the ``optim`` config group: a registered optimizer and lr schedule, weight-decay mask,
global-norm clipping.

:func:`make` builds ``clip_by_global_norm(optim.clip_norm)`` (skipped when 0) followed by the optimizer
``OPTIMIZERS[optim.name]``, whose learning rate is :func:`schedule`: linear warmup over ``optim.warmup_steps``,
then ``SCHEDULES[optim.schedule]`` up to the horizon (``optim.decay_steps``, default ``train.steps``).

Optimizers (``optim.name``), all from optax, all weight-decayed (``optim.weight_decay``, multiplied by the lr as
in AdamW) except on norm scales and biases (:func:`decay_mask`):
  adamw      optax.adamw (b1, b2, eps)
  lion       optax.lion (b1, b2); wants a 3-10x smaller lr (and a correspondingly larger weight decay)
  adafactor  optax.adafactor: factored second moments (a row and a column vector instead of a full moment for
             params with two dims >= 128), no first moment; lr is the step size as for AdamW (not relative to
             the param scale); b1, b2, eps unused
  muon       optax.contrib.muon on the stacked layers' weight matrices (see :func:`muon_dimension_numbers`),
             AdamW (as adamw) on everything else; updates scaled to AdamW's RMS, so lr and weight_decay carry over
Schedules (``optim.schedule``, after the warmup): ``cosine`` and ``linear`` decay to ``lr * end_lr_ratio`` at the
horizon, ``constant``, ``wsd`` (warmup-stable-decay: lr until the last ``optim.wsd_decay_fraction`` of the
horizon, then linear decay to ``lr * end_lr_ratio``).

Adding one is one ``register`` call, from inside the package or outside it (import the module before training),
then ``--config.optim.name=sgdm`` / ``--config.optim.schedule=...``:

  @optim.OPTIMIZERS.register("sgdm")
  def sgdm(cfg, learning_rate):  # the optim config group, the lr schedule -> optax.GradientTransformation
    return optax.chain(optax.add_decayed_weights(cfg.weight_decay, optim.decay_mask),  # L2, masked
                       optax.sgd(learning_rate, momentum=cfg.b1))

  @optim.SCHEDULES.register("step")
  def step(cfg, steps):  # the lr from the end of warmup on; ``steps`` from there to the horizon
    return optax.piecewise_constant_schedule(cfg.lr, {steps // 2: 0.1})

The optimizer state is laid out on the mesh like the params, whatever its shape (jaxtrain/train/state.py); with
``optim.offload_state`` its arrays are kept in host memory between steps (any optimizer: the update is the same),
and an :data:`ELEMENTWISE` optimizer's update streams over the stacked layers (jaxtrain/train/offload.py). Its
global-norm clipping is :func:`clip_by_global_norm` (optax's arithmetic and state; the streamed update gives it
the norm of the whole gradients).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from ml_collections import config_dict

from jaxtrain import loss_scale
from jaxtrain.errors import ConfigError, check_positive
from jaxtrain.registry import Registry

NO_DECAY = ("scale", "bias", "score_bias")  # norm scales, biases and routers' choice biases: not weight-decayed
# optim.name -> (cfg, learning_rate: optax.Schedule) -> optax.GradientTransformation (weight decay included)
OPTIMIZERS: Registry[Callable[..., optax.GradientTransformation]] = Registry(
    "optim.name", "optimizer", how="jaxtrain.optim.OPTIMIZERS.register")
# optim.schedule -> (cfg, steps) -> optax.Schedule of the lr from the end of warmup (count 0) on, where ``steps``
# is the number of steps from there to the horizon
SCHEDULES: Registry[Callable[..., optax.Schedule]] = Registry(
    "optim.schedule", "schedule", how="jaxtrain.optim.SCHEDULES.register")


def defaults() -> ml_collections.ConfigDict:
  """The ``optim`` config group."""
  return ml_collections.ConfigDict(dict(
      name="adamw",  # adamw | lion (lr 3-10x smaller than AdamW's) | adafactor | muon, or a registered one
      lr=3e-4,
      schedule="cosine",  # cosine | linear | constant | wsd (after warmup), or a registered one
      warmup_steps=100,
      decay_steps=config_dict.placeholder(int),  # the horizon, counted from step 0; default: train.steps
      end_lr_ratio=0.1,  # final lr = lr * end_lr_ratio (cosine / linear / wsd)
      wsd_decay_fraction=0.2,  # wsd: the lr decays over this last fraction of the horizon
      b1=0.9,  # adamw, lion; muon's AdamW part
      b2=0.95,  # adamw, lion; muon's AdamW part
      eps=1e-8,  # adamw; muon
      weight_decay=0.1,  # not applied to norm scales and biases; multiplied by the lr (decoupled, as AdamW)
      clip_norm=1.0,  # global-norm clipping; 0 disables
      # Loss scaling for model.dtype=float16 (jaxtrain/loss_scale.py): none | dynamic (doubles after
      # loss_scale_period finite steps, halves and skips the step on an overflow) | a constant, e.g. "1024".
      loss_scale="none",
      loss_scale_init=2.0 ** 15,  # dynamic: the first scale
      loss_scale_period=2000,  # dynamic: finite steps in a row before the scale doubles
      # Keep the optimizer's per-parameter state (AdamW's moments) in the host's pinned memory between steps,
      # brought to the device for the update only (jaxtrain/train/step.py apply_update; docs/parallelism.md).
      offload_state=False,
  ))


def validate(config) -> None:
  """Checks of the ``optim`` group (ConfigError naming the key)."""
  check_positive(config, ["optim.lr"])
  check_positive(config, ["optim.warmup_steps", "optim.weight_decay", "optim.clip_norm", "optim.end_lr_ratio",
                          "optim.wsd_decay_fraction"], allow_zero=True)
  if config.optim.wsd_decay_fraction > 1:
    raise ConfigError("optim.wsd_decay_fraction", f"must be <= 1, got {config.optim.wsd_decay_fraction}",
                      "give the fraction of the horizon the lr decays over, e.g. 0.2")
  OPTIMIZERS.check(config)
  SCHEDULES.check(config)
  loss_scale.parse(config.optim.loss_scale)
  check_positive(config, ["optim.loss_scale_init", "optim.loss_scale_period"])


def schedule(optim_cfg, train_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to ``lr`` over ``warmup_steps``, then ``SCHEDULES[optim_cfg.schedule]`` over the
  ``horizon - warmup_steps`` steps to the horizon (``decay_steps``, default ``train_steps``), and after it."""
  lr, warmup = optim_cfg.lr, optim_cfg.warmup_steps
  steps = max((optim_cfg.decay_steps or train_steps) - warmup, 1)
  after = SCHEDULES.get(optim_cfg.schedule)(optim_cfg, steps)
  if not warmup:  # (optax logs about a linear schedule of no steps)
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def decay_mask(params):
  """True for parameters that get weight decay (everything but norm scales and biases)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[-1], "key", None) not in NO_DECAY,
                                          params)


def balance_update(speed: float) -> optax.GradientTransformation:
  """The auxiliary-loss-free balancing of DeepSeek-V3's routers (arXiv:2412.19437, section 2.1.2): each choice bias
  moves by ``speed x sign(mean load - load)`` per step, whatever the lr schedule. Its "gradient" is the load's
  deviation (``load - mean load``; jaxtrain/models/deepseek_v3's ``bias_feedback``), so the update is ``-speed x
  sign(gradient)``."""
  return optax.chain(optax.scale_by_sign(), optax.scale(-speed))


def optimizer(optim_cfg, train_steps: int, trainable: Callable[[Any], Any] | None = None,
              logical_specs: Any = None, balance: tuple[Callable[[Any], Any], float] | None = None
              ) -> optax.GradientTransformation:
  """Global-norm clipping (unless ``clip_norm`` is 0), then ``OPTIMIZERS[optim_cfg.name]`` with the lr
  :func:`schedule`. ConfigError naming ``optim.name`` if it is not registered.

  ``trainable``: ``params -> tree of bools`` when only part of the params is trained (LoRA: the model's
  ``trainable_mask()``); the clipping and the optimizer then see only the trained params (the global norm is
  theirs), and the frozen ones get zero updates and have no optimizer state at all (``optax.multi_transform``
  with ``set_to_zero``). ``logical_specs``: the model's logical axis names per param, given to an optimizer
  whose factory takes a ``logical_specs`` argument (Muon: which axes are batch axes). ``balance``: ``(params ->
  tree of bools, speed)``, the routers' choice biases (the model's ``balance()``), updated by
  :func:`balance_update` instead, outside the clipping's norm and without optimizer state (a frozen one stays
  frozen)."""
  chain = []
  if optim_cfg.clip_norm > 0:
    chain.append(clip_by_global_norm(optim_cfg.clip_norm))
  factory = OPTIMIZERS.get(optim_cfg.name)
  takes_specs = "logical_specs" in inspect.signature(factory).parameters
  chain.append(factory(optim_cfg, schedule(optim_cfg, train_steps),
                       **({"logical_specs": logical_specs} if takes_specs else {})))
  tx = optax.chain(*chain)
  elementwise = optim_cfg.name in ELEMENTWISE
  if trainable is None and balance is None:
    return _marked(tx, elementwise)

  def labels(params):
    trained = trainable(params) if trainable is not None else jax.tree.map(lambda _: True, params)
    balanced = balance[0](params) if balance is not None else jax.tree.map(lambda _: False, params)
    return jax.tree.map(lambda t, b: "frozen" if not t else "balance" if b else "train", trained, balanced)

  transforms = {"train": tx, "frozen": optax.set_to_zero()}
  if balance is not None:
    transforms["balance"] = balance_update(balance[1])
  return _marked(optax.multi_transform(transforms, labels), elementwise)


# The optimizers whose update is elementwise given the clipping's global norm: every state leaf of one param is
# shaped like it and each element's new value depends on that element's gradient, param and state alone (and the
# shared counters). Their update over a slice of the params (one of the stacked layers) is the update of that slice,
# bit for bit: what the streamed update of an offloaded state runs (jaxtrain/train/offload.py). Not Adafactor (its
# factored moments average over a matrix's rows and columns) nor Muon (orthogonalizes whole matrices).
ELEMENTWISE = ("adamw", "lion")


def elementwise(tx) -> bool:
  """Whether ``tx`` (from :func:`make`) is of an :data:`ELEMENTWISE` optimizer."""
  return bool(getattr(tx.update, "elementwise", False))


def _marked(tx: optax.GradientTransformation, elementwise: bool) -> optax.GradientTransformation:
  """``tx`` whose update says whether it is elementwise (:func:`elementwise`; loss_scale.wrap passes it on)."""
  def update(updates, state, params=None):
    return tx.update(updates, state, params)

  update.elementwise = elementwise
  return optax.GradientTransformation(tx.init, update)


# The global norm :func:`clip_by_global_norm` clips by, when the caller computed it (a streamed update clips a
# slice of the gradients at a time by the norm of all of them), or _RECORD: stop at the clipping with its norm.
_CLIP_NORM: contextvars.ContextVar = contextvars.ContextVar("jaxtrain_clip_norm", default=None)
_RECORD = object()


class _Norm(Exception):  # noqa: N818 - the clipping's norm, carried out of a recording update (same trace)
  def __init__(self, norm):
    super().__init__("clip norm")
    self.norm = norm


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm, the same arithmetic and state, whose norm the caller may give
  (:func:`clipping_by`) or ask for (:func:`clip_norm_of`)."""
  def update(updates, state, params=None):
    del params
    given = _CLIP_NORM.get()
    g_norm = optax.tree.norm(updates) if given is None or given is _RECORD else given
    if given is _RECORD:
      raise _Norm(g_norm)
    trigger = jnp.squeeze(g_norm < max_norm)
    return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm),
                        updates), state

  return optax.GradientTransformation(optax.init_empty_state, update)


@contextlib.contextmanager
def clipping_by(norm):
  """Within it, :func:`clip_by_global_norm` clips by ``norm`` (traced: the global norm of the whole gradients)
  instead of the norm of the updates it is given."""
  token = _CLIP_NORM.set(norm)
  try:
    yield
  finally:
    _CLIP_NORM.reset(token)


def clip_norm_of(tx, grads, opt_state, params):
  """The global norm ``tx``'s clipping computes for ``grads`` (the very expression: over the leaves it sees), or
  None without clipping. Traced only up to the clipping (``opt_state`` is not read before it); anything ``tx``
  computes before it is left unused. Whether there is one is found on shapes first: without one, nothing is
  traced."""
  def recorded(grads, opt_state, params):
    token = _CLIP_NORM.set(_RECORD)
    try:
      tx.update(grads, opt_state, params)
    except _Norm as e:
      return e.norm
    finally:
      _CLIP_NORM.reset(token)
    return None

  if jax.eval_shape(recorded, grads, opt_state, params) is None:
    return None
  return recorded(grads, opt_state, params)


def make(optim_cfg, train_steps: int, trainable: Callable[[Any], Any] | None = None,
         logical_specs: Any = None, balance: tuple[Callable[[Any], Any], float] | None = None
         ) -> optax.GradientTransformation:
  """The run's optimizer (:func:`optimizer`), loss-scaled as ``optim.loss_scale`` says (the outermost layer: its
  state holds the scale, :mod:`jaxtrain.loss_scale`)."""
  return loss_scale.wrap(optimizer(optim_cfg, train_steps, trainable, logical_specs, balance), optim_cfg.loss_scale,
                         optim_cfg.loss_scale_init, optim_cfg.loss_scale_period)


# Schedules after the warmup ----------------------------------------------------------------------------------


@SCHEDULES.register("cosine")
def _cosine(cfg, steps: int) -> optax.Schedule:
  return optax.cosine_decay_schedule(cfg.lr, steps, alpha=cfg.end_lr_ratio)


@SCHEDULES.register("linear")
def _linear(cfg, steps: int) -> optax.Schedule:
  return optax.linear_schedule(cfg.lr, cfg.lr * cfg.end_lr_ratio, steps)


@SCHEDULES.register("constant")
def _constant(cfg, steps: int) -> optax.Schedule:
  del steps
  return optax.constant_schedule(cfg.lr)


@SCHEDULES.register("wsd")
def _wsd(cfg, steps: int) -> optax.Schedule:
  """Warmup-stable-decay: ``lr`` until the last ``round(wsd_decay_fraction * horizon)`` steps of the horizon
  (``horizon = warmup_steps + steps``; at most ``steps``), then linearly down to ``lr * end_lr_ratio``."""
  decay = min(round(cfg.wsd_decay_fraction * (cfg.warmup_steps + steps)), steps)
  if not decay:  # (optax logs about a linear schedule of no steps)
    return optax.constant_schedule(cfg.lr)
  return optax.join_schedules([optax.constant_schedule(cfg.lr),
                               optax.linear_schedule(cfg.lr, cfg.lr * cfg.end_lr_ratio, decay)], [steps - decay])


# Optimizers --------------------------------------------------------------------------------------------------


@OPTIMIZERS.register("adamw")
def _adamw(cfg, learning_rate: optax.Schedule) -> optax.GradientTransformation:
  return optax.adamw(learning_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                     mask=decay_mask)


@OPTIMIZERS.register("lion")
def _lion(cfg, learning_rate: optax.Schedule) -> optax.GradientTransformation:
  return optax.lion(learning_rate, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)


@OPTIMIZERS.register("adafactor")
def _adafactor(cfg, learning_rate: optax.Schedule) -> optax.GradientTransformation:
  # optax.adafactor adds weight_decay_rate * param after the lr scaling: decay by lr(step) * weight_decay to
  # decay as AdamW does.
  def decay_rate(step):
    return learning_rate(step) * cfg.weight_decay

  return optax.adafactor(learning_rate, multiply_by_parameter_scale=False,
                         weight_decay_rate=decay_rate if cfg.weight_decay else None, weight_decay_mask=decay_mask)


# Newton-Schulz iterations per Muon update (optax.contrib.muon's quintic iteration; its default).
MUON_NS_STEPS = 5
# The logical axes Muon treats as batch axes (one matrix per index): the stacked layers and an expert kernel's
# experts (each expert's matrix is orthogonalized on its own); Qwen3-Next's DeltaNet layers, a stack inside each step
# of the layer scan (``linear_layers``).
MUON_BATCH_AXES = ("layers", "experts", "linear_layers")
# The top-level params that are stacks of layers (leading axis the layer): the MoE families' dense first layers
# (``dense_layers``) and DeepSeek-V3's multi-token-prediction modules (``mtp``) besides ``layers``.
MUON_STACKS = ("layers", "dense_layers", "mtp")


def muon_dimension_numbers(path, shape, logical=None) -> optax.contrib.MuonDimensionNumbers | None:
  """How Muon sees a param, or None for a param AdamW updates instead. Muon orthogonalizes the weight matrices
  of the stacked layers (params under a top-level key of :data:`MUON_STACKS`: ``layers``, and ``dense_layers`` /
  ``mtp`` where a model has them; leading axis the layer: one matrix per layer); embeddings, the output head and
  norm scales (and anything with fewer than two axes per layer) are left to AdamW, as Muon's authors do. With the
  param's logical axis names (``logical``: the model's spec of it), every axis named in :data:`MUON_BATCH_AXES` is a
  batch axis: an expert kernel ``[layers, experts, in, out]`` is one ``in x out`` matrix per layer and expert. The
  axes left are the matrix between the leading and the trailing ones, split where the two sizes are closest:
  attention's ``[embed, heads, head_dim]`` is ``embed x (heads * head_dim)``, ``[heads, head_dim, embed]`` is
  ``(heads * head_dim) x embed`` (the heads flattened, as Moonlight and the anchors do)."""
  if not path or getattr(path[0], "key", None) not in MUON_STACKS:
    return None
  batch = {0} | {i for i, name in enumerate(logical or ()) if name in MUON_BATCH_AXES}
  axes = tuple(a for a in range(len(shape)) if a not in batch)
  if len(axes) < 2:
    return None

  def imbalance(i):
    fan_in, fan_out = math.prod(shape[a] for a in axes[:i]), math.prod(shape[a] for a in axes[i:])
    return max(fan_in, fan_out) / min(fan_in, fan_out)

  split = min(range(1, len(axes)), key=imbalance)
  return optax.contrib.MuonDimensionNumbers(reduction_axis=axes[:split], output_axis=axes[split:])


def check_muon(abstract_params, logical_specs, model_name: str) -> None:
  """ConfigError (``optim.name``) when Muon would orthogonalize nothing: no param of the model is a matrix of the
  stacked layers."""
  dims = jax.tree.leaves(_muon_dimensions(abstract_params, logical_specs),
                         is_leaf=lambda x: isinstance(x, optax.contrib.MuonDimensionNumbers))
  if not any(isinstance(d, optax.contrib.MuonDimensionNumbers) for d in dims):
    raise ConfigError("optim.name", f"muon orthogonalizes the weight matrices of the stacked layers, and model "
                      f"'{model_name}' has none (no param under 'layers' with two axes besides the layer's)",
                      "use optim.name=adamw")


def _spec_dict(logical_specs) -> dict[tuple, tuple]:
  """``{param path: its logical axis names}`` of a tree of PartitionSpecs of logical names ({} for None)."""
  if logical_specs is None:
    return {}
  return {tuple(path): tuple(spec) for path, spec in jax.tree_util.tree_leaves_with_path(
      logical_specs, is_leaf=lambda x: isinstance(x, P))}


def _muon_dimensions(params, logical_specs=None, specs: dict | None = None):
  """:func:`muon_dimension_numbers` of every param (a tree like ``params``: None for AdamW's); the logical names
  from ``logical_specs``, or by path from ``specs`` (:func:`_spec_dict`)."""
  specs = _spec_dict(logical_specs) if specs is None else specs
  return jax.tree_util.tree_map_with_path(
      lambda path, p: muon_dimension_numbers(path, p.shape, specs.get(tuple(path))), params)


def _experts_first(logical) -> tuple[int, ...] | None:
  """The axis order in which Muon sees a param with these logical axis names: an expert kernel's ``experts`` axis
  first (:func:`_experts_major`); None: as it is."""
  if not logical or "experts" not in logical or logical.index("experts") == 0:
    return None
  i = logical.index("experts")
  return (i, *(a for a in range(len(logical)) if a != i))


def _experts_major(tx: optax.GradientTransformation, orders: dict) -> optax.GradientTransformation:
  """``tx`` (optax's Muon) seeing every expert kernel with its ``experts`` axis first (``orders``: param path -> the
  axis order :func:`_experts_first` gives it, None for a param left as it is): its
  params, updates and momentum (``MuonState.mu``) transposed on the way in and back on the way out, so the state
  keeps the params' layout. Why: optax.contrib.muon flattens a param's batch axes (the layers, the experts) into one,
  in axis order, before its Newton-Schulz iterations. With the experts split over the ``expert`` mesh axis and the
  layers not, that flattened axis has no layout XLA can split, and it replicates the iterates: the TPU compiler asked
  1.11 TB of temporaries a chip for Kimi K2 (configs/kimi_k2_1t.py) on a v5p-2048. Experts first, the flattened axis
  is split as the experts are (tests/test_optimizers.py measures the temporaries). Each matrix's arithmetic is the
  same."""
  def moved(tree, inverse: bool = False):
    def one(path, x):
      order = orders.get(tuple(path))
      if order is None:
        return x
      return jnp.transpose(x, tuple(int(a) for a in np.argsort(order)) if inverse else order)
    return jax.tree_util.tree_map_with_path(one, tree)

  def states(state, inverse: bool):
    return jax.tree.map(lambda s: s._replace(mu=moved(s.mu, inverse)) if isinstance(s, optax.contrib.MuonState)
                        else s, state, is_leaf=lambda s: isinstance(s, optax.contrib.MuonState))

  def init(params):
    return states(tx.init(moved(params)), True)

  def update(updates, state, params=None):
    updates, state = tx.update(moved(updates), states(state, False), None if params is None else moved(params))
    return moved(updates, True), states(state, True)
  return optax.GradientTransformation(init, update)


@OPTIMIZERS.register("muon")
def _muon(cfg, learning_rate: optax.Schedule, logical_specs=None) -> optax.GradientTransformation:
  # consistent_rms=0.2 scales Muon's updates to AdamW's RMS (Liu et al., "Muon is Scalable for LLM Training"),
  # so one lr and weight decay serve both parts. The AdamW part is ours (with decay_mask): optax.contrib.muon's
  # own AdamW takes no weight-decay mask, so it only ever sees the Muon params here.
  specs = _spec_dict(logical_specs)
  orders = {path: _experts_first(spec) for path, spec in specs.items()}
  moved = {path: tuple(spec[a] for a in orders[path]) if orders[path] else spec
           for path, spec in specs.items()}  # (the names of the axes as _experts_major hands them to optax)
  dimensions = functools.partial(_muon_dimensions, specs=moved)
  muon = _experts_major(optax.contrib.muon(
      learning_rate, ns_steps=MUON_NS_STEPS, eps=cfg.eps, weight_decay=cfg.weight_decay, weight_decay_mask=decay_mask,
      consistent_rms=0.2, muon_weight_dimension_numbers=dimensions), orders)

  def labels(params):
    return jax.tree.map(lambda d: "adamw" if d is None else "muon", _muon_dimensions(params, specs=specs),
                        is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))

  return optax.partition({"muon": muon, "adamw": _adamw(cfg, learning_rate)}, labels)

# FLOPs of one update -----------------------------------------------------------------------------------------

# Elementwise FLOPs per trained element, counted from the optax transforms the update runs (as XLA counts them: a
# multiply, add or divide is one, a square root is a transcendental, not a FLOP; scalar work is left out).
CLIP_FLOPS = 5  # clip_by_global_norm: square and sum for the norm; divide, multiply and select
ADAMW_FLOPS = 12  # moments 3 + 4, bias corrections 2, + eps and the division 2, lr 1
MUON_FLOPS = 13  # momentum 3, Nesterov's mix 3 + bias corrections 2, Frobenius normalization 3, RMS scale 1, lr 1
DECAY_FLOPS = 2  # + weight_decay x param, on the decayed params (decay_mask)
BALANCE_FLOPS = 2  # balance_update: sign, scale


def newton_schulz_flops(rows: int, cols: int, steps: int = MUON_NS_STEPS) -> int:
  """FLOPs of orthogonalizing one ``rows x cols`` matrix (optax.contrib's ``orthogonalize_via_newton_schulz``): the
  matrix X is m x n with m <= n (transposed if taller), and each step is X <- c0 X + (c1 A + c2 A A) X with A = X
  X^T: the matmuls 2 m m n (A), 2 m m m (A A) and 2 m m n ((...) X), the elementwise 3 m m + 2 m n."""
  m, n = min(rows, cols), max(rows, cols)
  return steps * (4 * m * m * n + 2 * m ** 3 + 3 * m * m + 2 * m * n)


def update_flops(optim_cfg, abstract_params, trainable: Callable[[Any], Any] | None = None,
                 logical_specs: Any = None, balance: tuple[Callable[[Any], Any], float] | None = None) -> Any:
  """FLOPs of one update of the optimizer :func:`make` builds with these arguments, per param: a tree like
  ``abstract_params`` of ints, or None for an optimizer not counted here (adamw and muon are). Muon: per matrix
  (one per layer and expert: :func:`muon_dimension_numbers`) :func:`newton_schulz_flops` plus its elementwise
  work; AdamW (and Muon's AdamW part): the elementwise work; clipping and weight decay where configured; frozen
  params (LoRA) nothing. The estimator (tools/estimate.py) divides each param's count by its shards."""
  if optim_cfg.name not in ("adamw", "muon"):
    return None
  trained = trainable(abstract_params) if trainable else jax.tree.map(lambda _: True, abstract_params)
  balanced = balance[0](abstract_params) if balance else jax.tree.map(lambda _: False, abstract_params)
  decayed = decay_mask(abstract_params) if optim_cfg.weight_decay else jax.tree.map(lambda _: False,
                                                                                   abstract_params)
  if optim_cfg.name == "muon":
    dims = _muon_dimensions(abstract_params, logical_specs)
  else:
    dims = jax.tree.map(lambda _: None, abstract_params)
  clip = CLIP_FLOPS if optim_cfg.clip_norm > 0 else 0

  def leaf(p, d, t, b, w):
    size = math.prod(p.shape)
    if not t:
      return 0
    if b:
      return BALANCE_FLOPS * size
    flops = (clip + (DECAY_FLOPS if w else 0)) * size
    if d is None:
      return flops + ADAMW_FLOPS * size
    rows, cols = (math.prod(p.shape[a] for a in axes) for axes in (d.reduction_axis, d.output_axis))
    return flops + MUON_FLOPS * size + size // (rows * cols) * newton_schulz_flops(rows, cols)

  return jax.tree.map(leaf, abstract_params, dims, trained, balanced, decayed,
                      is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))

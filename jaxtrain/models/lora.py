"""LoRA (low-rank adaptation, Hu et al. 2021) for any model family: frozen base weights, trained adapters.

Config: ``model.lora`` (shared by every family): ``rank`` (0 = off), ``alpha`` (the update is scaled by
``alpha / rank``), ``targets`` (comma-separated names matched against the components of the kernels' parameter
paths: ``q`` adapts ``['layers']['attn']['q']['kernel']``, ``attn`` every kernel under ``attn``, ``lm_head`` the
output head; default ``q,v`` as PEFT's ``q_proj,v_proj``).

Where the adapters live: in the params tree under a top-level ``lora`` key that mirrors the targets' paths, e.g.
``params['lora']['layers']['attn']['q'] = {'a': A, 'b': B}`` for ``params['layers']['attn']['q']['kernel']``.
So they are checkpointed, restored onto any mesh, fingerprinted and sharded like any parameter.

Shapes and layout. A kernel is split into input dims and output dims, after a leading stack axis (``layers``, or
``dense_layers``: a scanned stack keeps it, so each layer has its own adapter and the pipeline splits adapters with
their layers):
- if the first dim's logical name is ``embed``, the input is that dim and the output the rest
  (``q``: ``[embed | heads, head_dim]``, ``gate``: ``[embed | mlp]``, ``lm_head``: ``[embed | vocab]``);
- else if the last dim's name is ``embed``, the output is that dim and the input the rest
  (``o``: ``[heads, head_dim | embed]``, ``down``: ``[mlp | embed]``);
- else the first dim is the input and the rest the output.
Then ``A = in_dims + (rank,)`` and ``B = (rank,) + out_dims`` with the kernel's logical names on those dims
(``None`` on the rank dim), so an adapter is sharded like its kernel. ``A`` starts uniform in
``+-1/sqrt(fan_in)`` (PEFT's kaiming-uniform with a = sqrt(5)), ``B`` at zeros: an adapted model starts
exactly equal to its base.

The forward: :func:`merge` (``W + alpha / rank * A @ B`` per target, the ``lora`` key removed, every base
weight under ``jax.lax.stop_gradient``) is the one function that turns adapted params into plain ones; the model
calls it before binding its module (``Model.effective_params``, used by ``Model.bind`` and by the pipelined
forward), and the Hugging Face export calls it to write plain weights.

Trade-off of merging: the forward and backward run on the merged weight, so the full gradient of every targeted
matrix is formed (FLOPs and a temporary gradient like full fine-tuning for those matrices; untargeted frozen
weights get no weight gradient at all) and a merged copy of the targeted weights exists during the step. In
exchange the model code knows nothing of LoRA, every compute path (scan, remat, pipeline, any family) works
unchanged, and the optimizer state and updates cover the adapters only (jaxtrain.optim.make with the model's
:func:`trainable_mask`; the step differentiates the adapters alone and leaves the base bitwise unchanged).
An unmerged forward (``x W + (x A) B``) would save the targeted matrices' weight-gradient FLOPs at the cost of
touching every model's layers.
"""

from __future__ import annotations

import math
import string
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.errors import ConfigError

KEY = "lora"  # the top-level params key holding the adapters
KERNEL = "kernel"  # the leaf name of the matrices that can be adapted


def defaults() -> dict:
  """The ``model.lora`` sub-group (shared by every model family)."""
  return dict(
      rank=0,  # adapter rank; 0 = LoRA off (full fine-tuning / pre-training)
      alpha=16.0,  # the adapters' update is scaled by alpha / rank
      targets="q,v",  # comma-separated names of path components of the kernels to adapt, e.g. q,k,v,o,gate,up,down
  )


def active(model_cfg) -> Any:
  """The ``model.lora`` group when LoRA is on (rank > 0), else None (also for a model group without it)."""
  cfg = model_cfg.get(KEY) if hasattr(model_cfg, "get") else None
  return cfg if cfg is not None and cfg.get("rank", 0) > 0 else None


def target_names(lora_cfg) -> list[str]:
  return [t.strip() for t in str(lora_cfg.targets).split(",") if t.strip()]


def validate(model_cfg) -> None:
  """rank >= 0 (an integer), alpha > 0, targets not empty when LoRA is on. That each target names a kernel of the
  model is checked when the model is laid out (:func:`add_adapters`)."""
  cfg = model_cfg.get(KEY)
  if cfg is None:
    return
  if isinstance(cfg.rank, bool) or not isinstance(cfg.rank, int) or cfg.rank < 0:
    raise ConfigError("model.lora.rank", f"must be an integer >= 0, got {cfg.rank!r}",
                      "set the adapter rank, e.g. 8 (0 turns LoRA off)")
  if not isinstance(cfg.alpha, (int, float)) or isinstance(cfg.alpha, bool) or not cfg.alpha > 0:
    raise ConfigError("model.lora.alpha", f"must be > 0, got {cfg.alpha!r}",
                      "set the scale's numerator, e.g. 16.0 (the update is scaled by alpha / rank)")
  if cfg.rank > 0 and not target_names(cfg):
    raise ConfigError("model.lora.targets", "is empty", "name the kernels to adapt, e.g. 'q,v' or "
                      "'q,k,v,o,gate,up,down'")


def scale(lora_cfg) -> float:
  return float(lora_cfg.alpha) / float(lora_cfg.rank)


def _keys(path) -> tuple[str, ...]:
  return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _kernels(abstract_params) -> dict[tuple[str, ...], Any]:
  """path (without the leaf name) -> abstract kernel, for every leaf named ``kernel`` (outside the adapters) with
  at least two dims besides a leading layers axis (checked in :func:`split_dims`)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
    keys = _keys(path)
    if keys[-1] == KERNEL and keys[0] != KEY:
      out[keys[:-1]] = leaf
  return out


# The logical names of a scanned stack's leading axis: the layers, and the dense first layers of the MoE families
# (``dense_layers``, a stack of its own); ``linear_layers``: Qwen3-Next's DeltaNet layers, a stack inside each step of
# the layer scan (its kernels lead with both axes).
LAYER_AXES = ("layers", "dense_layers", "linear_layers")


def split_dims(spec: tuple) -> tuple[int, int, int]:
  """(lead, n_in, n_out): a kernel with logical names ``spec`` is a leading stack axis (lead = 1) or none,
  then n_in input dims and n_out output dims (the rule in the module docstring)."""
  names = tuple(spec)
  lead = next((i for i, n in enumerate(names) if n not in LAYER_AXES), len(names))
  rest = names[lead:]
  if rest and rest[0] == "embed":
    n_in = 1
  elif rest and rest[-1] == "embed":
    n_in = len(rest) - 1
  else:
    n_in = 1
  return lead, n_in, len(rest) - n_in


def targets(abstract_params, logical_specs, lora_cfg) -> dict[tuple[str, ...], tuple]:
  """path -> (abstract kernel, its logical names padded to its rank) of every kernel a target names. ConfigError
  naming ``model.lora.targets`` for a target that names none."""
  kernels = _kernels(abstract_params)
  specs = {_keys(p)[:-1]: s for p, s in jax.tree_util.tree_leaves_with_path(
      logical_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) if _keys(p)[-1] == KERNEL}
  usable = {}
  for path, leaf in kernels.items():
    spec = tuple(specs.get(path, ())) + (None,) * leaf.ndim
    spec = spec[:leaf.ndim]
    lead, n_in, n_out = split_dims(spec)
    if n_in >= 1 and n_out >= 1:
      usable[path] = (leaf, spec)
  out = {}
  for name in target_names(lora_cfg):
    hits = [p for p in usable if name in p]
    if not hits:
      names = sorted({c for p in usable for c in p})
      raise ConfigError("model.lora.targets", f"'{name}' names no kernel of this model",
                        f"use names from the kernels' paths: {', '.join(names)}")
    out.update({p: usable[p] for p in hits})
  return dict(sorted(out.items()))


def _adapter_shapes(leaf, spec, rank: int):
  lead, n_in, _ = split_dims(spec)
  shape = tuple(leaf.shape)
  cut = lead + n_in
  a = (shape[:cut] + (rank,), spec[:cut] + (None,))
  b = (shape[:lead] + (rank,) + shape[cut:], spec[:lead] + (None,) + spec[cut:])
  return a, b


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def add_adapters(abstract_params, logical_specs, lora_cfg) -> tuple[dict, dict]:
  """The model's abstract params and logical specs with the adapters added under ``lora`` (ShapeDtypeStructs and
  PartitionSpecs of logical names)."""
  adapters, specs = {}, {}
  for path, (leaf, spec) in targets(abstract_params, logical_specs, lora_cfg).items():
    (a_shape, a_spec), (b_shape, b_spec) = _adapter_shapes(leaf, spec, lora_cfg.rank)
    _set(adapters, path, {"a": jax.ShapeDtypeStruct(a_shape, leaf.dtype), "b": jax.ShapeDtypeStruct(b_shape,
                                                                                                  leaf.dtype)})
    _set(specs, path, {"a": jax.sharding.PartitionSpec(*a_spec), "b": jax.sharding.PartitionSpec(*b_spec)})
  return {**abstract_params, KEY: adapters}, {**logical_specs, KEY: specs}


def init(rng: jax.Array, abstract_adapters: dict, adapter_specs: dict) -> dict:
  """Fresh adapters: A uniform in +-1/sqrt(fan_in) (fan_in: the product of the input dims), B zeros."""
  out = {}
  paths = sorted(_adapter_paths(abstract_adapters))
  for i, path in enumerate(paths):
    ab, sp = _get(abstract_adapters, path), _get(adapter_specs, path)
    lead = 1 if tuple(sp["a"]) and tuple(sp["a"])[0] in LAYER_AXES else 0
    fan_in = math.prod(ab["a"].shape[lead:-1])
    bound = 1.0 / math.sqrt(fan_in)
    a = jax.random.uniform(jax.random.fold_in(rng, i), ab["a"].shape, ab["a"].dtype, -bound, bound)
    _set(out, path, {"a": a, "b": jnp.zeros(ab["b"].shape, ab["b"].dtype)})
  return out


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _has(tree, path) -> bool:
  for k in path:
    if not isinstance(tree, dict) or k not in tree:
      return False
    tree = tree[k]
  return True


def _adapter_paths(tree, prefix=()) -> list[tuple[str, ...]]:
  """Paths of the ``{'a', 'b'}`` dicts in an adapters tree."""
  if isinstance(tree, dict) and set(tree) == {"a", "b"} and not isinstance(tree["a"], dict):
    return [prefix]
  if isinstance(tree, dict):
    return [p for k, v in tree.items() for p in _adapter_paths(v, prefix + (k,))]
  return []


def delta(a: jax.Array, b: jax.Array, kernel_ndim: int) -> jax.Array:
  """A @ B contracted over the rank: ``[lead.., in.., r] x [lead.., r, out..] -> [lead.., in.., out..]``."""
  lead = a.ndim + b.ndim - 2 - kernel_ndim  # 1 for a stacked kernel (the layers axis is in both), else 0
  letters = iter(string.ascii_letters.replace("r", ""))
  ls = "".join(next(letters) for _ in range(lead))
  ins = "".join(next(letters) for _ in range(a.ndim - lead - 1))
  outs = "".join(next(letters) for _ in range(b.ndim - lead - 1))
  return jnp.einsum(f"{ls}{ins}r,{ls}r{outs}->{ls}{ins}{outs}", a, b, precision=jax.lax.Precision.HIGHEST)


def merge(params: dict, lora_cfg) -> dict:
  """Plain params of the adapted model: ``W + alpha / rank * A @ B`` for every adapted kernel, the ``lora`` key
  removed. With adapters present every base weight is under ``jax.lax.stop_gradient`` (frozen: the gradient
  reaches only the adapters). Params without a ``lora`` key are returned as they are."""
  if KEY not in params:
    return params
  base = jax.tree.map(jax.lax.stop_gradient, {k: v for k, v in params.items() if k != KEY})
  s = scale(lora_cfg)
  merged = jax.tree.map(lambda x: x, base)  # a new nested dict (the caller's is not modified)
  for path in _adapter_paths(params[KEY]):
    ab = _get(params[KEY], path)
    holder = _get(merged, path)
    w = holder[KERNEL]
    holder[KERNEL] = w + jnp.asarray(s, w.dtype) * delta(ab["a"], ab["b"], w.ndim).astype(w.dtype)
  return merged


def trainable_mask(params: dict) -> dict:
  """True for the adapters, False for the (frozen) base params."""
  return {k: jax.tree.map(lambda _: k == KEY, v) for k, v in params.items()}


def split(params: dict) -> tuple[dict, dict]:
  """(adapters, base) of adapted params."""
  return params[KEY], {k: v for k, v in params.items() if k != KEY}


def join(adapters: dict, base: dict) -> dict:
  return {**base, KEY: adapters}

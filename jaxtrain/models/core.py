"""What every model family shares: the :class:`Family` contract and its registry, the remat policies, and the
functional view of a Flax NNX model the trainer works with (:class:`Model`). ``jaxtrain.models`` re-exports these
names and imports the built-in families; a family's folder imports this module, not the package.

A family is one :func:`register` call with a :class:`Family`: its Flax module, its own config keys with their
defaults, its checks, its training FLOPs per token and which config key sizes each logical axis. The core keeps
only the keys every model shares (:data:`SHARED`); choosing ``model.name`` picks the rest (also on the command
line: ``--config.model.name=F`` gives family F's keys and defaults). A family may live outside the package:
registering it before ``trainer.build`` (or importing its module from a config file) is all it takes.

The module contract: ``Module(cfg, *, rngs)`` where ``cfg`` is the ``model`` config group; calling it with
``(tokens, positions, segment_ids)`` (int32, ``[batch, length]``) returns logits ``[batch, length, vocab]`` (in
its compute dtype: the loss reads them as float32 in one pass, jaxtrain.train.losses; :meth:`Model.apply` returns
them as float32) or an :class:`Output` (logits plus auxiliary losses, added to the objective weighted by the config
key ``model.<name>_weight``, and metrics, logged). Parameters are ``nnx.Param`` annotated with logical axis names only.
A module can be split into pipeline stages (jaxtrain/parallel/pipeline.py) when it also has the parts of that call
as methods: ``embed_tokens(tokens, positions, segment_ids) -> x``, a stacked layer module ``layers`` (leading
``layers`` axis), ``apply_layer(weights, x, (positions, segment_ids)) -> x`` for one layer's slice of
``params['layers']``, and ``head(x) -> logits or Output``. A layer with auxiliary losses or metrics (a MoE router's)
returns ``(x, {"aux_losses": {...}, "metrics": {...}})`` instead, each scalar that layer's share (the sum over the
stack is what the forward reports); the pipeline sums them over layers and microbatches like the head's.

Decoding (jaxtrain/generate.py) works with a module that also has a classmethod ``init_cache(cfg, batch, max_len)
-> KVCache`` (jaxtrain.models.attention) and takes the cache as a fourth argument: ``(tokens, positions,
segment_ids, cache) -> (logits, cache)``. The cache holds every layer's keys and values ``[layers, batch, max_len,
kv_heads, head_dim]`` (logical axes ``(batch, None, kv_heads, head_dim)`` per layer), the segment id and position of
the token in each slot ``[batch, max_len]`` and the next slot to write, ``index`` (one for all rows). The call
writes the ``length`` new tokens' keys and values at ``index`` through the model's own attention layers, lets the
new queries attend over the cache with ``attention.cached_mask`` (key j is visible to query i iff they have the
same nonzero segment id and ``kv_position[j] <= q_position[i]``) and returns the cache with ``index + length``.
Prompts of different lengths are left-padded: pads have segment id 0, each row's positions start at 0 at its first
real token, so a prefill (whole prompts at once) and then one token per call compute the logits of the training
forward on the same rows. Without a cache the call is the training forward, unchanged.

A family's layers reach the cache through the slots API (``attention.KVCache``'s docstring: ``slots =
cache.write_slots(...)``, ``slots.scan_layers``, ``slots.write``, ``slots.view``, ``slots.kv_segment_ids`` and
``kv_positions``, ``slots.advanced``); one whose module class sets ``paged_cache = True`` also decodes with an
``attention.PagedKVCache`` (a page pool and a page table, each row its own write index): continuous batching,
``jaxtrain.sampling.ContinuousGenerator``. A family that writes with ``attention.write_kv`` at ``cache.index``
decodes static batches only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
import ml_collections
from flax import nnx

from jaxtrain.errors import ConfigError, check_choice, check_positive
from jaxtrain.models import attention, lora, quantization, scans
from jaxtrain.registry import Registry

_STAGE_METHODS = ("embed_tokens", "apply_layer", "head")
DTYPES = ("float32", "bfloat16", "float16")  # float16: with optim.loss_scale (jaxtrain/loss_scale.py)


def _shared_defaults() -> dict:
  return dict(
      name="llama",
      vocab_size=256,
      dtype="float32",  # compute dtype; params are always float32
      remat="none",  # what the backward pass recomputes per layer: a name in models.REMAT (none | full | save_dots |
      # save_qkv_proj | save_out_proj | minimal | offload_minimal | offload_dots | offload_full; docs/parallelism.md)
      attention="auto",  # the attention backend, a name in models.attention.BACKENDS: auto | xla | blockwise | splash
      attention_block_size=512,  # keys per block of the blockwise backend (memory O(seq_len x this) per layer)
      quantization="none",  # the layers' matmuls quantized in training: a name in models.quantization.QUANTIZATION
      # (none | int8 | fp8; docs/parallelism.md#quantized-training-int8-and-fp8)
      lora=lora.defaults(),  # LoRA fine-tuning (rank 0 = off): jaxtrain/models/lora.py
  )


SHARED = tuple(_shared_defaults())


@dataclasses.dataclass(frozen=True)
class Output:
  """What a forward returns: logits, auxiliary losses (scalars; each is added to the objective times the config
  key ``model.<name>_weight``, and logged as ``aux_loss/<name>``), metrics (scalars, logged as they are) and
  maxima: per-head statistics that combine by their maximum over microbatches, by the path of the module that
  measured them in the params (``"layers/attn"``: ``[layers, heads]`` for a stack), read by the family's
  ``qk_clip`` (:func:`capturing_maxima`)."""
  logits: jax.Array
  aux_losses: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
  metrics: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
  maxima: dict[str, jax.Array] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, out) -> "Output":
    return out if isinstance(out, Output) else cls(out)


jax.tree_util.register_dataclass(Output, data_fields=["logits", "aux_losses", "metrics", "maxima"], meta_fields=[])
MAX_LOGIT = "max_logit"  # what an attention module sows (nnx.Intermediate) for QK-clip: attention.max_logits


def sow_max_logit(module: nnx.Module, value: jax.Array) -> None:
  """Keeps ``value`` (``[heads]``: attention.max_logits) for :func:`capturing_maxima` (the maximum, if the module
  runs twice in one forward)."""
  module.sow(nnx.Intermediate, MAX_LOGIT, value, reduce_fn=jnp.maximum, init_fn=lambda: -jnp.inf)


def clipped_heads(cfg, params, maxima: dict, keep):
  """QK-clip's shared part (a family's ``qk_clip`` rule scales what this returns): a copy of ``params`` (the same
  leaves) and, for each measured attention module, ``(its params dict in that copy, the gain [stack, heads])``: ``g =
  model.qk_clip / S`` for a head whose largest logit ``S`` passed the threshold where ``keep``, else exactly 1."""
  threshold = float(cfg.qk_clip)
  params = jax.tree.map(lambda a: a, params)  # (new containers: the rule replaces leaves, the caller's tree is kept)
  found = []
  for path, largest in maxima.items():
    gain = jnp.where(keep & jnp.isfinite(largest) & (largest > threshold), threshold / largest, 1.0)
    module = params
    for key in path.split("/"):
      module = module[key]
    found.append((module, gain))
  return params, found


def capturing_maxima(module: nnx.Module, prefix: str, *args, **kwargs) -> tuple[Any, dict[str, jax.Array]]:
  """``module(*args, **kwargs)`` and the :data:`MAX_LOGIT` statistics its modules sowed (``nnx.capture``):
  ``(output, {prefix + the sowing module's path: value})``, empty when nothing was sown (QK-clip off)."""
  out, sown = nnx.capture(module, nnx.Intermediate)(*args, **kwargs)
  found = {}

  def walk(node, path):
    for key, value in node.items():
      if key == MAX_LOGIT:
        found[prefix + "/".join(path)] = value
      elif isinstance(value, dict):
        walk(value, (*path, str(key)))
  walk(nnx.to_pure_dict(sown), ())
  return out, found


def _no_checks(cfg) -> None:
  del cfg


def matmul_flops_per_token(cfg, seq_len: int, abstract_params) -> float:
  """6 x the parameters outside the embedding tables: a family's FLOPs when it declares none (attention's
  score and value matmuls, which grow with seq_len, are not counted: MFU then reads low)."""
  del cfg, seq_len
  return dense_flops_per_token(abstract_params, 0, num_layers=0, attention_width=0, tied_embeddings=False)


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family.

  module: the ``nnx.Module`` class (see the module contract above).
  defaults: ``() -> dict``: the family's own ``model`` keys and their defaults (not the shared ones).
  flops_per_token: ``(cfg, seq_len, abstract_params) -> float``: training FLOPs (forward + backward) per token,
    for MFU, the dry run and the estimator. :func:`dense_flops_per_token` is the usual formula; the default,
    :func:`matmul_flops_per_token`, leaves attention out.
  validate: ``(cfg) -> None``: checks of the family's keys (``cfg`` is the model group); raise ConfigError naming
    ``model.<key>``.
  axis_keys: logical axis -> the model key that sets its size, for errors such as "not divisible by the mesh".
  activation_estimate: ``(cfg, rows, seq_len, tensor, context) -> {activation_bytes, transient_bytes,
    tensor_allreduce_bytes, context_allgather_bytes}`` per device for ``rows`` local rows of one microbatch
    (tools/estimate.py); None: the estimator says it cannot.
  quantizable: whether its layers honour ``model.quantization`` (validation refuses it otherwise).
  context_parallel: whether its forward may run with the sequence split over ``mesh.context``
    (jaxtrain/parallel/context.py): every layer but attention computes each token on its own (its MoE dispatch
    too) and attention masks by ``positions`` and ``segment_ids``, never by a token's index in the row (the
    tokens are reordered). Validation refuses ``mesh.context`` > 1 otherwise.
  """
  module: type[nnx.Module]
  defaults: Callable[[], dict] = dict
  flops_per_token: Callable[[Any, int, Any], float] = matmul_flops_per_token
  validate: Callable[[Any], None] = _no_checks
  axis_keys: dict[str, str] = dataclasses.field(default_factory=dict)
  activation_estimate: Callable[[Any, int, int, int, int], dict[str, int]] | None = None
  quantizable: bool = False  # its layers take their matmuls from jaxtrain.models.quantization (model.quantization)
  context_parallel: bool = True  # its forward is correct with the sequence split and reordered (mesh.context > 1)
  # QK-clip (``model.qk_clip``): ``(cfg, params, maxima, keep) -> params``, each attention head's query and key weights
  # scaled so that its largest logit (``Output.maxima``) would be the threshold, where ``keep`` (the update applied)
  qk_clip: Callable[[Any, Any, dict, Any], Any] | None = None


# The built-in families register when jaxtrain.models imports their folders (jaxtrain/models/__init__.py).
FAMILIES: Registry[Family] = Registry("model.name", "model", how="jaxtrain.models.register")
# The activations a layer tags with jax.ad_checkpoint.checkpoint_name, which remat policies can keep by name
# (the names MaxText's policies use for the same tensors): the q, k, v projections (before RoPE), the attention
# output projection, the MLP's gate, up and down projections.
ACTIVATION_NAMES = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_down")
LAYER_INPUT = "layer_input"  # the name remat_layer gives a layer's input


@dataclasses.dataclass(frozen=True)
class Remat:
  """A jax.checkpoint policy (called as one) and what it keeps for the backward pass, for tools/estimate.py:
  ``saved`` in device memory, ``offloaded`` to host memory (``pinned_host``) between the forward and the backward;
  names from :data:`ACTIVATION_NAMES`, or ``dots``: every matmul output without batch dimensions."""
  policy: Callable
  saved: tuple[str, ...] = ()
  offloaded: tuple[str, ...] = ()

  def __call__(self, *args, **kwargs):
    return self.policy(*args, **kwargs)


def _names(*names: str) -> Remat:
  return Remat(jax.checkpoint_policies.save_only_these_names(*names), saved=names)


def _offloaded(*names: str) -> Remat:
  return Remat(jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(names), offload_src="device",
      offload_dst="pinned_host"), offloaded=names)


# What the backward pass recomputes inside each layer (jax.checkpoint policies; a plain policy registers too);
# None: keep everything.
REMAT: Registry[Any] = Registry("model.remat", "remat policy", how="jaxtrain.models.REMAT.register")
REMAT.register("none", None)
REMAT.register("full", Remat(jax.checkpoint_policies.nothing_saveable))
REMAT.register("save_dots", Remat(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, saved=("dots",)))
REMAT.register("save_qkv_proj", _names("query_proj", "key_proj", "value_proj"))
REMAT.register("save_out_proj", _names("out_proj"))
REMAT.register("minimal", _names(*ACTIVATION_NAMES))  # every projection's output: MaxText's "minimal"
REMAT.register("offload_minimal", _offloaded(*ACTIVATION_NAMES))  # the same, kept in host memory
REMAT.register("offload_dots", Remat(jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
                                     offloaded=("dots",)))
# Full remat with each layer's input (the residual stream the layer scan keeps for the backward pass) in host memory:
# the device keeps one layer's worth at a time (MaxText's ``decoder_layer_input: offload``).
REMAT.register("offload_full", _offloaded(LAYER_INPUT))


def stacked(cfg, dtype, rngs: nnx.Rngs, block, count: int, axis_name: str = "layers"):
  """``count`` instances of ``block(cfg, dtype, rngs)`` stacked on a leading axis named ``axis_name`` (the layer
  scan's; each from its own split of ``rngs``)."""
  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis_name})
  def make(rngs):
    return block(cfg, dtype, rngs)
  return make(rngs)


def decode_stacks(stacks, slots, x, k, v, positions, segment_ids):
  """Decoding through layer stacks that share one cache stack, in order (``stacks``: nnx layer stacks, None skipped;
  e.g. the dense first layers, then the MoE ones): each stack's layers over their cache layers, from where the last
  stack's ended (``slots``: the cache's slots API, jaxtrain.models.attention.KVCache). ``(x, (k, v))``."""
  start = 0
  for stack in stacks:
    if stack is None:
      continue
    graphdef = nnx.graphdef(stack)

    def layer(h, weights, k_layer, v_layer, kind, graphdef=graphdef):
      del kind
      return nnx.merge(graphdef, weights)(h, positions, segment_ids, (k_layer, v_layer, slots))

    x, (k, v) = slots.scan_layers(layer, x, nnx.state(stack), k, v, first=start)
    start += jax.tree.leaves(nnx.state(stack))[0].shape[0]
  return x, (k, v)


def remat_layer(fn: Callable, remat: str) -> Callable:
  """``fn(weights, x, *rest)``, one layer of a stack, rematerialized per the policy named ``remat``
  (:data:`REMAT`), with its input ``x`` tagged :data:`LAYER_INPUT` (what ``offload_full`` moves to host memory;
  every other policy keeps it on the device, as the scan's saved input)."""
  if remat == "none":
    return fn

  def tagged(weights, x, *rest):
    return fn(weights, checkpoint_name(x, LAYER_INPUT), *rest)
  return jax.checkpoint(tagged, policy=REMAT.get(remat), prevent_cse=scans.prevent_cse())


def register(name: str, family: Family) -> Family:
  """Registers a model family under ``name`` (then ``model.name=<name>`` selects it)."""
  overlap = set(family.defaults()) & set(SHARED)
  if overlap:
    raise ValueError(f"model family {name}: {sorted(overlap)} are shared model keys; leave them out of defaults()")
  return FAMILIES.register(name, family)


def preset(base: str, **keys) -> Family:
  """The registered family ``base`` with other defaults for its own keys (a family that differs by flags)."""
  family = get(base)
  unknown = set(keys) - set(family.defaults())
  if unknown:
    raise ValueError(f"{sorted(unknown)} are not keys of the '{base}' family")
  return dataclasses.replace(family, defaults=lambda: {**family.defaults(), **keys})


def names() -> list[str]:
  return FAMILIES.names()


def get(name: str) -> Family:
  return FAMILIES.get(name)


def defaults(name: str = "llama") -> ml_collections.ConfigDict:
  """The ``model`` config group of family ``name``: the shared keys, then the family's own."""
  return ml_collections.ConfigDict({**_shared_defaults(), "name": name, **get(name).defaults()})


def _check_qk_clip(config, family: Family) -> None:
  """QK-clip rescales the attention weights the step's own forward measured: the step of the ``lm`` objective over
  the whole model (not adapters, not pipeline stages)."""
  def refuse(what, fix):
    raise ConfigError("model.qk_clip", f"QK-clip {what}", fix + " (or set model.qk_clip=0)")
  if family.qk_clip is None:
    refuse(f"has no rule for the '{config.model.name}' family's attention weights", "register the family with qk_clip")
  if lora.active(config.model):
    refuse("rescales the base weights, which LoRA freezes", "train without model.lora")
  if config.model.get("qk_norm"):
    refuse(f"cannot scale a head's logits back through model.qk_norm={config.model.qk_norm} (the norm undoes a "
           "scaled query; it bounds the logits itself)", "train with QK-norm alone")
  objective = config.get("train", {}).get("objective", "lm")
  if objective != "lm":
    refuse(f"reads the maxima of the lm objective's forward, not train.objective={objective}'s",
           "use train.objective=lm")
  mesh = config.get("mesh")
  if mesh is not None and mesh.pipeline * mesh.dcn_pipeline > 1:
    refuse("is not measured through pipeline stages", "set mesh.pipeline=1 and mesh.dcn_pipeline=1")


def validate(config) -> None:
  """The shared keys, then the family's checks. A config whose model group belongs to another family (its keys
  differ) is named as such."""
  m = config.model
  family = FAMILIES.get(m.name)
  mine = set(SHARED) | set(family.defaults())
  if set(m.keys()) != mine:
    extra, missing = sorted(set(m.keys()) - mine), sorted(mine - set(m.keys()))
    raise ConfigError("model.name", f"the model group has the keys of another family than '{m.name}' ("
                      f"{'extra: ' + ', '.join(extra) if extra else ''}{'; ' if extra and missing else ''}"
                      f"{'missing: ' + ', '.join(missing) if missing else ''})",
                      f"start the config from base_config(model='{m.name}'), or set model.name on the command "
                      "line (which swaps in that family's keys)")
  check_positive(config, ["model.vocab_size"])
  check_choice(config, "model.dtype", DTYPES)
  if m.dtype == "float16" and config.get("dry_run_topology"):
    raise ConfigError("model.dtype", "float16 is not a TPU compute type (TPUs compute in bfloat16, which needs no "
                      "loss scaling)", "set model.dtype=bfloat16 and optim.loss_scale=none")
  REMAT.check(config)
  check_positive(config, ["model.attention_block_size"])
  attention.BACKENDS.check(config)
  attention.check_available(config)
  quantization.QUANTIZATION.check(config)
  if m.quantization != "none" and not family.quantizable:
    raise ConfigError("model.quantization", f"the '{m.name}' model family does not take its matmuls from "
                      "jaxtrain.models.quantization", "set model.quantization=none, or build the family's layers "
                      "with quantization.dot_general / einsum and register it with quantizable=True")
  mesh = config.get("mesh")
  if "qk_clip" in m:
    check_positive(config, ["model.qk_clip"], allow_zero=True)
  if m.get("qk_clip"):
    _check_qk_clip(config, family)
  if mesh is not None and mesh.context * mesh.dcn_context != 1 and not family.context_parallel:
    raise ConfigError("mesh.context", f"the '{m.name}' model family cannot split the sequence over devices (it "
                      "registers context_parallel=False)", "set mesh.context=1 and mesh.dcn_context=1")
  family.validate(m)
  lora.validate(m)
  if lora.active(m):
    Model.from_config(m)  # ConfigError naming model.lora.targets if a target names no kernel


def axis_key(name: str, axis: str) -> str:
  """The config key that sets the size of logical axis ``axis`` in family ``name``."""
  key = get(name).axis_keys.get(axis) if name in FAMILIES else None
  return f"model.{key}" if key else f"the '{axis}' dimension"


def dense_flops_per_token(abstract_params, seq_len: int, *, num_layers: int, attention_width: int,
                          tied_embeddings: bool) -> float:
  """Training FLOPs per token of a dense decoder, the formula of PaLM (Chowdhery et al., appendix B):
  ``6 N + 12 layers * attention_width * seq_len``, ``attention_width`` = heads x head_dim. N counts every
  parameter except the input embedding table (the unembedding matmul counts; a tied table counts once, as the
  unembedding); position-embedding tables are not matmuls either (name them ``pos_embed``). The attention term is
  not halved for causal masking."""
  n = sum(math.prod(a.shape) for a in jax.tree.leaves(abstract_params))
  for table in ("embed", "pos_embed"):
    if table in abstract_params and not (table == "embed" and tied_embeddings):
      n -= sum(math.prod(a.shape) for a in jax.tree.leaves(abstract_params[table]))
  return 6 * n + 12 * num_layers * attention_width * seq_len


@dataclasses.dataclass(frozen=True)
class Model:
  """A registered model as pure functions over a nested dict of parameter arrays.

  ``abstract_params`` holds ShapeDtypeStructs and ``logical_specs`` the matching PartitionSpecs of
  logical axis names; the parallelism is decided elsewhere (jaxtrain/sharding.py) from these names.
  """

  family: Family
  cfg: Any
  graphdef: Any
  abstract_params: Any
  logical_specs: Any

  @property
  def cls(self) -> type[nnx.Module]:
    return self.family.module

  @classmethod
  def from_config(cls, model_cfg) -> "Model":
    family = get(model_cfg.name)
    # Sharding comes from jit out_shardings computed by jaxtrain.sharding from the logical names, not from
    # NNX's eager sharding (which resolves rules differently); one resolver for params and activations.
    with nnx.use_eager_sharding(False):
      abstract = nnx.eval_shape(lambda: family.module(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract, nnx.Param)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    if lora.active(model_cfg):  # the adapters, under params['lora'] (jaxtrain/models/lora.py)
      params, specs = lora.add_adapters(params, specs, model_cfg.lora)
    return cls(family, model_cfg, graphdef, params, specs)

  def init(self, rng: jax.Array) -> dict:
    with nnx.use_eager_sharding(False):
      module = self.cls(self.cfg, rngs=nnx.Rngs(params=rng))
    params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    if self.lora:  # the base is initialized as without LoRA; B = 0: the adapted model equals it
      params[lora.KEY] = lora.init(jax.random.fold_in(rng, 0x10EA), self.abstract_params[lora.KEY],
                                   self.logical_specs[lora.KEY])
    return params

  @property
  def lora(self):
    """The ``model.lora`` config group when LoRA is on (rank > 0), else None."""
    return lora.active(self.cfg)

  def effective_params(self, params: dict) -> dict:
    """The plain params the module computes with: with LoRA adapters the merged weights (lora.merge, the base
    frozen by stop_gradient), else ``params`` themselves. Every forward goes through here (bind, the pipeline)."""
    return lora.merge(params, self.lora) if self.lora and lora.KEY in params else params

  def trainable_mask(self):
    """``params -> tree of bools`` (True: trained) when only part of the params is trained (LoRA: the
    adapters), else None (everything is trained)."""
    return lora.trainable_mask if self.lora else None

  def balance(self) -> tuple[Callable[[Any], Any], float] | None:
    """``(params -> tree of bools, speed)``: the routers' choice biases (params named ``score_bias``) that the
    optimizer moves by the load (jaxtrain.optim.balance_update) at ``model.bias_update_speed``; None where the model
    has no such key or it is 0."""
    speed = float(self.cfg.get("bias_update_speed", 0.0))
    if not speed:
      return None
    return (lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) == "score_bias", params)), speed

  def qk_clip(self, params: dict, maxima: dict, keep) -> dict:
    """``params`` with QK-clip applied (the family's ``qk_clip``) where the forward measured ``maxima`` and ``keep``
    is true; ``params`` themselves without maxima (QK-clip off)."""
    return self.family.qk_clip(self.cfg, params, maxima, keep) if maxima else params

  def split_trainable(self, params: dict) -> tuple[Any, Any]:
    """(trained params, frozen params): with LoRA (adapters, base), else (params, {})."""
    return lora.split(params) if self.lora else (params, {})

  def join_trainable(self, trained: Any, frozen: Any) -> dict:
    """The inverse of :meth:`split_trainable`."""
    return lora.join(trained, frozen) if self.lora else trained

  def forward(self, params: dict, tokens, positions, segment_ids) -> Output:
    return Output.of(self.bind(params)(tokens, positions, segment_ids))

  def apply(self, params: dict, tokens, positions, segment_ids) -> jax.Array:
    """The logits alone, in float32 (the model computes them in its compute dtype: ``forward(...).logits``)."""
    return self.forward(params, tokens, positions, segment_ids).logits.astype(jnp.float32)

  def bind(self, params: dict) -> nnx.Module:
    """The module with these parameter values (inside a traced function: tracers)."""
    with nnx.use_eager_sharding(False):
      return nnx.merge(self.graphdef, self.effective_params(params))

  def aux_loss_weights(self, names) -> dict[str, float]:
    """``{name: model.<name>_weight}`` for the auxiliary losses ``names``; ConfigError if a weight is missing."""
    missing = [n for n in names if f"{n}_weight" not in self.cfg]
    if missing:
      raise ConfigError(f"model.{missing[0]}_weight", f"model '{self.cfg.name}' returns the auxiliary loss "
                        f"'{missing[0]}' but has no weight for it", f"add {missing[0]}_weight to the family's defaults")
    return {n: float(self.cfg[f"{n}_weight"]) for n in names}

  def flops_per_token(self, seq_len: int) -> float:
    base = {k: v for k, v in self.abstract_params.items() if k != lora.KEY}  # the computed weights (merged)
    return float(self.family.flops_per_token(self.cfg, seq_len, base))

  def why_not_stageable(self) -> str | None:
    """Why this model cannot be split into pipeline stages, or None if it can."""
    missing = [m for m in _STAGE_METHODS if not callable(getattr(self.cls, m, None))]
    if missing:
      return f"it has no {', '.join(missing)} method{'s' if len(missing) > 1 else ''}"
    if "layers" not in self.abstract_params:
      return "it has no stacked 'layers' parameters"
    if attention.mixed_layers(self.cfg):
      return "its layers interleave local and global attention (model.global_every)"
    if self.cfg.get("mtp_depth"):
      return "its multi-token prediction modules run after the stack (model.mtp_depth)"
    return None

  def num_layers(self) -> int:
    return jax.tree.leaves(self.abstract_params["layers"])[0].shape[0]

  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.abstract_params))

  def can_decode(self) -> bool:
    """Whether the module supports decoding with a KV cache (see the module docstring)."""
    return callable(getattr(self.cls, "init_cache", None))

  def init_cache(self, batch: int, max_len: int):
    """An empty KV cache (jaxtrain.models.attention.KVCache) of ``max_len`` slots for ``batch`` rows."""
    return self.cls.init_cache(self.cfg, batch, max_len)

  def can_decode_paged(self) -> bool:
    """Whether the module also decodes with a paged cache (``paged_cache = True``: the module docstring)."""
    return self.can_decode() and bool(getattr(self.cls, "paged_cache", False))

  def init_paged_cache(self, pages: int, page_size: int, rows: int, pages_per_row: int, shards: int = 1):
    """An empty paged cache (jaxtrain.models.attention.PagedKVCache): a pool of ``pages`` pages of ``page_size``
    tokens, each token's entry shaped as in the family's own cache (its ``init_cache``: e.g. MLA's latent), and a
    page table of ``rows`` rows of ``pages_per_row`` pages, split over ``shards`` batch shards."""
    per_token = jax.eval_shape(lambda: self.cls.init_cache(self.cfg, 1, page_size))
    return attention.PagedKVCache.zeros(per_token, pages, rows, pages_per_row, shards)

  def decode(self, params: dict, tokens, positions, segment_ids, cache):
    """``(logits, cache)``: the tokens' logits (float32) with the cache's keys and values in view, and the updated
    cache."""
    logits, cache = self.bind(params)(tokens, positions, segment_ids, cache)
    return Output.of(logits).logits.astype(jnp.float32), cache

"""Generation on the mesh: KV-cache decoding through the model's own attention, and the tokenizer of a run.

:class:`Generator` compiles a prefill (the whole prompts at once, filling the KV cache ``[layers, batch, max_len,
kv_heads, head_dim]``, logical axes ``(batch, None, kv_heads, head_dim)`` per layer) and one ``lax.while_loop``
that decodes a token per step until every row has produced an EOS token or ``max_new_tokens``; prompts are
left-padded into one batch (a multiple of the batch shards: :func:`padded_rows`). :class:`Sampling`: greedy at
``temperature=0``, else softmax at that temperature within ``top_k`` and the nucleus ``top_p``; row r of step i
draws with ``fold_in(fold_in(key(seed), i), r)``, so a completion does not depend on the other prompts.
:class:`ContinuousGenerator` is continuous batching over a paged KV cache: a queue of prompts for a few slots,
each slot refilled as soon as its completion ends, the same tokens as the static batch's for every prompt.
:func:`tokenizer_for` finds a run's tokenizer (see :mod:`jaxtrain.generate` for the order). :class:`Sampler` is
what the training loop uses for ``train.sample_every``, compiled once. The command line is jaxtrain.generate.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import data as data_lib
from jaxtrain import models
from jaxtrain import paths
from jaxtrain import sharding
from jaxtrain.data import chat
from jaxtrain.data import tokenizers
from jaxtrain.errors import UserError


class GenerateError(UserError):
  """A mistake in what was asked of generation (printed as one line, exit code 2)."""


# ---------------------------------------------------------------------------------------------------------------
# Sampling.

@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen: greedy (``temperature`` 0), else a draw at ``temperature`` from the ``top_k``
  most likely tokens (0: all) within the smallest set whose probability reaches ``top_p`` (1: all)."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def check(self) -> "Sampling":
    if not self.temperature >= 0:
      raise GenerateError("--temperature", f"must be >= 0, got {self.temperature}", "use 0 for greedy decoding")
    if self.top_k < 0:
      raise GenerateError("--top_k", f"must be >= 0, got {self.top_k}", "use 0 for no top-k cut")
    if not 0 < self.top_p <= 1:
      raise GenerateError("--top_p", f"must be in (0, 1], got {self.top_p}", "use 1 for no nucleus cut")
    return self


def next_tokens(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """``[batch]`` int32 token ids from float32 logits ``[batch, vocab]``; row r draws with ``fold_in(key, r)``."""
  return draw(logits, jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(logits.shape[0])), sampling)


def request_keys(key: jax.Array, requests: jax.Array, steps: jax.Array) -> jax.Array:
  """The keys of token ``steps[b]`` of request ``requests[b]``: ``fold_in(fold_in(key, step), request)``, what row
  ``request`` of step ``step`` of a static batch draws with (:func:`next_tokens`), wherever the request runs."""
  return jax.vmap(lambda q, t: jax.random.fold_in(jax.random.fold_in(key, t), q))(requests, steps)


def draw(logits: jax.Array, keys: jax.Array, sampling: Sampling) -> jax.Array:
  """``[batch]`` int32 token ids from float32 logits ``[batch, vocab]``, row b drawing with ``keys[b]``."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / sampling.temperature
  if 0 < sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each one
    kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)  # the first token is always kept
    logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, logits)
  return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------------------
# The compiled generator.

@dataclasses.dataclass
class Batch:
  """Prompts as one left-padded batch: ``tokens``, ``positions``, ``segment_ids`` ``[rows, prompt_len]`` (pads:
  segment 0, position 0), each row's prompt length ``lengths`` (the position of its first new token) and
  ``rows`` (1 for a prompt, 0 for a row that only pads the batch to a multiple of the batch shards); ``budgets``:
  each row's most new tokens (None: the generator's ``max_new_tokens`` for every row)."""
  tokens: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  lengths: np.ndarray
  rows: np.ndarray
  count: int  # real prompts (the first ``count`` rows)
  budgets: np.ndarray | None = None

  def budgets_or(self, max_new_tokens: int) -> np.ndarray:
    """``[rows]`` int32: each row's budget (``max_new_tokens`` where none is given), 1 to ``max_new_tokens``."""
    if self.budgets is None:
      return np.full(self.rows.shape, max_new_tokens, np.int32)
    budgets = np.asarray(self.budgets, np.int32)
    if budgets.shape != self.rows.shape or budgets[:self.count].min(initial=1) < 1 or budgets.max(initial=0) > \
        max_new_tokens:
      raise GenerateError("budgets", f"must be {self.rows.shape[0]} values from 1 to max_new_tokens="
                          f"{max_new_tokens}", "give each prompt at most max_new_tokens new tokens")
    return np.maximum(budgets, 1)


def left_pad(prompts: Sequence[Sequence[int]], rows: int, prompt_len: int,
             budgets: Sequence[int] | None = None) -> Batch:
  """``prompts`` (token id lists, each 1 to ``prompt_len`` long) as a left-padded batch of ``rows`` rows;
  ``budgets``: each prompt's most new tokens (None: the generator's ``max_new_tokens``)."""
  if len(prompts) > rows:
    raise ValueError(f"{len(prompts)} prompts for a batch of {rows} rows")
  tokens, positions, segments = (np.zeros((rows, prompt_len), np.int32) for _ in range(3))
  lengths, real = np.zeros((rows,), np.int32), np.zeros((rows,), np.int32)
  for r, ids in enumerate(prompts):
    n = len(ids)
    if not 0 < n <= prompt_len:
      raise ValueError(f"prompt {r} has {n} tokens, not 1 to {prompt_len}")
    tokens[r, prompt_len - n:] = np.asarray(ids, np.int32)
    positions[r, prompt_len - n:] = np.arange(n, dtype=np.int32)
    segments[r, prompt_len - n:] = 1
    lengths[r], real[r] = n, 1
  if budgets is not None:
    if len(budgets) != len(prompts):
      raise ValueError(f"{len(budgets)} budgets for {len(prompts)} prompts")
    budgets = np.pad(np.asarray(budgets, np.int32), (0, rows - len(prompts)), constant_values=1)
  return Batch(tokens, positions, segments, lengths, real, len(prompts), budgets)


def abstract_params(model: models.Model, param_shardings) -> Any:
  """The params a generator is compiled for: ``param_shardings`` is a tree of shardings (the model's abstract params
  laid out on them) or of ``jax.ShapeDtypeStruct`` with their own shapes, dtypes and shardings (RL's rollout layout:
  its weights in the compute dtype, jaxtrain.train.objectives.rollout)."""
  if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(param_shardings)):
    return param_shardings
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), model.abstract_params,
                      param_shardings)


class Generator:
  """Generation compiled for fixed shapes: ``rows`` prompt rows (a multiple of the mesh's batch shards), prompts of
  up to ``prompt_len`` tokens, ``max_new_tokens`` new ones, one :class:`Sampling`. ``param_shardings``: where the
  params live (e.g. the train state's). Compiled once, at construction; :meth:`__call__` dispatches without
  waiting. ``use_cache=False`` recomputes the whole forward for every new token; ``return_logits`` also returns
  every step's logits ``[rows, max_new_tokens, vocab]`` (tests); ``token_logp`` (``(logits [rows, vocab], tokens
  [rows]) -> float32 [rows]``), when given, is applied to each new token and its untempered logits, whatever the
  sampling, and the values ``[rows, max_new_tokens]`` (0 after a row's end) are returned too: RL passes the
  training loss's arithmetic, so that a sampled token's log-probability is the training forward's number."""

  def __init__(self, model: models.Model, mesh, rules, param_shardings, *, rows: int, prompt_len: int,
               max_new_tokens: int, sampling: Sampling = Sampling(), eos_ids: Sequence[int] = (),
               use_cache: bool = True, return_logits: bool = False, token_logp: Callable | None = None):
    _, shards = sharding.batch_shards(dict(mesh.shape), rules)
    if rows % shards:
      raise ValueError(f"rows={rows} is not a multiple of the {shards} batch shards")
    if use_cache and not model.can_decode():
      raise GenerateError(f"model.name={model.cfg.name}", "the model family has no KV-cache decoding (init_cache)",
                          "add it (see jaxtrain/models), or pass --no_cache")
    self.model, self.mesh, self.rules = model, mesh, rules
    self.rows, self.prompt_len, self.max_new_tokens = rows, prompt_len, max_new_tokens
    self.sampling, self.eos_ids = sampling, tuple(int(e) for e in eos_ids)
    self.use_cache, self.return_logits, self.token_logp = use_cache, return_logits, token_logp
    self.batch_sharding = sharding.batch_sharding(mesh, rules)
    row_sharding = sharding.batch_sharding(mesh, rules, ndim=1)
    replicated = NamedSharding(mesh, P())
    abstract = abstract_params(model, param_shardings)
    prompt = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, sharding=self.batch_sharding)
    per_row = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=row_sharding)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=replicated)
    t = time.perf_counter()
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
      prefill = jax.jit(self._prefill)
      self._prefill_fn = prefill.lower(abstract, prompt, prompt, prompt).compile()
      # The decode loop takes the prefill's outputs where the prefill leaves them.
      logits, state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                   jax.eval_shape(self._prefill, abstract, prompt, prompt, prompt),
                                   self._prefill_fn.output_shardings)
      decode = jax.jit(self._decode, donate_argnums=(1,))
      self._decode_fn = decode.lower(abstract, state, logits, per_row, per_row, per_row, key).compile()
    self.compile_s = time.perf_counter() - t

  # The two compiled halves ---------------------------------------------------------------------------------------

  def _forward_last(self, params, state):
    """No-cache mode: the full forward over the token buffer; the logits at slot ``index - 1``."""
    logits = self.model.apply(params, state["tokens"], state["positions"], state["segment_ids"])
    return jax.lax.dynamic_index_in_dim(logits, state["index"] - 1, axis=1, keepdims=False)

  def _prefill(self, params, tokens, positions, segment_ids):
    """The prompts' last logits ``[rows, vocab]`` and the decoding state (the KV cache, or the token buffer)."""
    # The last new token is never fed back, so the cache holds prompt_len + max_new_tokens - 1 slots: for RL that is
    # the training row's length (data.seq_len), so that a decode step's attention reduces over the same keys, in the
    # same slots and order, as the training forward's (jaxtrain.train.objectives.grpo: the log-probabilities agree
    # bitwise).
    max_len = self.prompt_len + max(self.max_new_tokens - 1, 0)
    if self.use_cache:
      cache = self.model.init_cache(self.rows, max_len)
      logits, cache = self.model.decode(params, tokens, positions, segment_ids, cache)
      return logits[:, -1], cache
    pad = ((0, 0), (0, self.max_new_tokens))
    state = {"tokens": jnp.pad(tokens, pad), "positions": jnp.pad(positions, pad),
             "segment_ids": jnp.pad(segment_ids, pad), "index": jnp.int32(self.prompt_len)}
    state = {k: v if k == "index" else sharding.constrain(v, ("batch", None)) for k, v in state.items()}
    return self._forward_last(params, state), state

  def _step(self, params, state, token, position, segment):
    """One new token per row: its logits ``[rows, vocab]`` and the next state."""
    if self.use_cache:
      logits, state = self.model.decode(params, token[:, None], position[:, None], segment[:, None], state)
      return logits[:, 0], state
    at = (jnp.zeros((), jnp.int32), state["index"])
    state = {"tokens": jax.lax.dynamic_update_slice(state["tokens"], token[:, None], at),
             "positions": jax.lax.dynamic_update_slice(state["positions"], position[:, None], at),
             "segment_ids": jax.lax.dynamic_update_slice(state["segment_ids"], segment[:, None], at),
             "index": state["index"] + 1}
    return self._forward_last(params, state), state

  def _decode(self, params, state, first_logits, lengths, rows, budgets, key):
    """The whole decode loop: token 0 from the prefill's logits, then one step per token while any row is not
    done (a row is done at an EOS token or at its budget, ``budgets``: ``max_new_tokens`` unless the batch gives
    less; the batch runs until its longest row is done). Returns the new tokens ``[rows, max_new_tokens]`` (0
    after a row's end), how many each row produced (an EOS included), with ``return_logits`` every step's logits,
    with ``token_logp`` its values for each new token, and the final state."""
    n, eos = self.max_new_tokens, jnp.asarray(self.eos_ids or (-1,), jnp.int32)
    params = self.model.effective_params(params)  # LoRA: merged once, not in every step (a no-op after this)

    def pick(logits, i):
      return next_tokens(logits, jax.random.fold_in(key, i), self.sampling)

    first = pick(first_logits, 0)
    live = rows > 0
    out = jnp.zeros((self.rows, n), jnp.int32).at[:, 0].set(jnp.where(live, first, 0))
    done = ~live | jnp.isin(first, eos) | (budgets <= 1)
    produced = live.astype(jnp.int32)
    all_logits = logps = None
    if self.return_logits:
      all_logits = jnp.zeros((self.rows, n, first_logits.shape[-1]), jnp.float32).at[:, 0].set(first_logits)
    if self.token_logp is not None:
      logps = jnp.zeros((self.rows, n), jnp.float32).at[:, 0].set(
          jnp.where(live, self.token_logp(first_logits, first), 0.0))

    def cond(carry):
      i, _, _, done, _, _, _ = carry
      return (i < n) & ~jnp.all(done)

    def body(carry):
      i, state, out, done, produced, all_logits, logps = carry
      logits, state = self._step(params, state, out[:, i - 1], lengths + i - 1, rows)
      token = jnp.where(done, 0, pick(logits, i))
      out = jax.lax.dynamic_update_index_in_dim(out, token, i, axis=1)
      if logps is not None:
        logps = jax.lax.dynamic_update_index_in_dim(logps, jnp.where(done, 0.0, self.token_logp(logits, token)),
                                                    i, axis=1)
      produced = produced + (~done).astype(jnp.int32)
      done = done | jnp.isin(token, eos) | (produced >= budgets)
      if all_logits is not None:
        all_logits = jax.lax.dynamic_update_index_in_dim(all_logits, logits, i, axis=1)
      return i + 1, state, out, done, produced, all_logits, logps

    carry = (jnp.int32(1), state, out, done, produced, all_logits, logps)
    _, state, out, _, produced, all_logits, logps = jax.lax.while_loop(cond, body, carry)
    # The state is returned (and dropped by the caller) so that its donated buffer is updated in place.
    extras = ((all_logits,) if self.return_logits else ()) + ((logps,) if logps is not None else ())
    return (out, produced, *extras, state)

  # Use ---------------------------------------------------------------------------------------------------------

  def batch(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int] | None = None) -> Batch:
    return left_pad(prompts, self.rows, self.prompt_len, budgets)

  def __call__(self, params, batch: Batch, seed: int = 0):
    """Dispatches prefill and decode (not waited for); returns the device arrays of ``_decode``."""
    return self.decode(params, self.prefill(params, batch), batch, seed)

  def prefill(self, params, batch: Batch):
    """The compiled prefill (dispatched): the prompts' last logits and the decoding state."""
    put = [jax.device_put(getattr(batch, k), self.batch_sharding) for k in ("tokens", "positions", "segment_ids")]
    return self._prefill_fn(params, *put)

  def decode(self, params, prefilled, batch: Batch, seed: int = 0):
    """The compiled decode loop (dispatched) from ``prefill``'s output (its state is donated)."""
    rows_sharding = sharding.batch_sharding(self.mesh, self.rules, ndim=1)
    lengths, rows, budgets = (jax.device_put(x, rows_sharding)
                              for x in (batch.lengths, batch.rows, batch.budgets_or(self.max_new_tokens)))
    key = jax.device_put(jax.random.key(seed), NamedSharding(self.mesh, P()))
    logits, state = prefilled
    return self._decode_fn(params, state, logits, lengths, rows, budgets, key)

  def completions(self, result, batch: Batch) -> list[list[int]]:
    """The new token ids of each real prompt, up to (not including) its EOS."""
    out, produced = (np.asarray(jax.device_get(x)) for x in result[:2])
    ids = []
    for r in range(batch.count):
      row = out[r, :produced[r]].tolist()
      if row and row[-1] in self.eos_ids:
        row = row[:-1]
      ids.append(row)
    return ids

  def generate(self, params, prompts: Sequence[Sequence[int]], seed: int = 0) -> list[list[int]]:
    batch = self.batch(prompts)
    return self.completions(self(params, batch, seed), batch)


class ContinuousGenerator:
  """Continuous batching: a queue of ``requests`` prompts decoded by ``slots`` rows in one compiled program, each
  slot taking the next queued request as soon as its own ends (an EOS token or the request's budget), over a paged
  KV cache (:class:`jaxtrain.models.attention.PagedKVCache`). Returns what :class:`Generator` returns for the same
  batch (``tokens [requests, max_new_tokens]``, ``produced [requests]``, with ``token_logp`` its values), so GRPO's
  rollouts (``rl.rollout_slots``) and jaxtrain.generate (``--slots``) switch with one setting; greedy and sampled
  tokens are the static generator's for every request (sampling keys depend on the request and the token index
  alone: :func:`request_keys`), whatever slot runs it and whatever else is queued.

  The loop (one ``lax.while_loop``, no host round trip per token), each step:

  1. Refill: while a slot is free, a request is queued and its pages fit, admit one request per batch shard (the
     first free slot of each shard, the queue in order; a request whose pages do not fit waits, and so do those
     behind it): allocate its pages, prefill its whole prompt (one ``[shards, prompt_len]`` forward writing its
     keys and values to its pages) and draw its token 0 from the prompt's last logits, as the static prefill does.
     A prompt is one forward rather than a token per step or chunks riding along the decode rows: on CPU a
     ``[1, 16]`` forward costs 0.4 of a ``[16, 1]`` decode step, while feeding prompts through the decode rows
     would make every slot's step as wide as a prompt chunk, or hold a slot for a step per prompt token.
  2. Decode: one token for every busy slot (``[slots, 1]``), each at its own position and write index; a free slot's
     row is padding (written nowhere, its output dropped).
  3. A slot whose request ended (EOS or its budget) returns its pages to its shard's free list and is free for 1.

  The cache: a pool of ``pages`` pages of ``page_size`` tokens per layer (``[layers, pages, page_size, kv_heads,
  head_dim]``, MLA: its latent), split over the batch shards like a static cache's rows (a slot only holds pages of
  its shard, so no page crosses devices); a slot's page table holds its request's pages, allocated at admission
  for what the request can write (``ceil((prompt + budget - 1) / page_size)`` pages: the last token is never fed
  back) and freed when it ends, on device (a free mask per shard; allocation takes the lowest free pages). So the
  pool may be smaller than ``slots x ceil((prompt_len + max_new_tokens - 1) / page_size)`` pages (``pages``;
  default: that much, every slot at its longest): requests then wait for pages instead of slots. It never
  deadlocks (each shard's pool holds the longest request: checked at construction, and a shard with no busy slot
  has all its pages free) and never preempts. Reserving a request's budget at admission keeps the loop simple;
  growing requests page by page (vLLM) packs more of them into a small pool when completions end early, at the
  price of preempting one when the pool runs dry: the next step if pools are the limit.

  A slot's request is compact in its pages (not left-padded: the token at position p at index p), so a refilled
  slot restarts at length 0 and its previous request's keys, never cleared, are past its length and invisible.
  Attention over the pages, the exact fallback on every backend: each layer gathers a slot's pages into one
  contiguous view and runs :func:`jaxtrain.models.attention.attend_cached` on it; the pools are carried through the
  layer scan and written in place (:class:`jaxtrain.models.attention.PoolLayer`).

  On TPU a Pallas kernel would read the pages in place instead of gathering them. For this loop's decode step the
  one is ``jax.experimental.pallas.ops.tpu.paged_attention``: one query per sequence, a page table and per-sequence
  lengths, keys from index 0 to the length, which is this cache's decode step exactly (its pool is this one's with
  the KV heads first, ``[kv_heads, pages, page_size, head_dim]``; queries pre-scaled; soft-capping but no sliding
  window). ``ragged_paged_attention`` (queries of many sequences packed ragged, prefill chunks and decode tokens in
  one call, k and v interleaved in one pool, windows and soft-capping) is the kernel of a loop that packs prompt
  chunks with decode tokens, which this one does not; the prefill of a new request sees only its own prompt, so it
  needs no paged kernel. Neither kernel has attention sinks (GPT-OSS would stay on the fallback). Not wired: there is
  no TPU here, and neither kernel takes ``interpret=`` to run on CPU, so the TPU compiler could only show that it
  compiles, not that its tokens are the static generator's (Pallas's TPU interpret mode, patched into the kernel's
  ``pallas_call``, is the way to test it here). The fallback compiles for a TPU topology (v5e:2x2, data 2 x tensor
  2: no collective moves a pool or a view).

  The numbers are the static generator's up to rounding: the same arithmetic on a request's keys at other indices
  of a view of another length, and matmuls of other shapes, so a reduction may round differently (tokens equal in
  the tests, greedy and sampled; log-probabilities within 1e-6). ``return_logits`` and ``use_cache=False`` are the
  static generator's only.
  """

  def __init__(self, model: models.Model, mesh, rules, param_shardings, *, requests: int, slots: int,
               prompt_len: int, max_new_tokens: int, sampling: Sampling = Sampling(), eos_ids: Sequence[int] = (),
               token_logp: Callable | None = None, page_size: int = 16, pages: int = 0):
    _, shards = sharding.batch_shards(dict(mesh.shape), rules)
    if not model.can_decode_paged():
      raise GenerateError(f"model.name={model.cfg.name}", "the model family has no paged KV-cache decoding "
                          "(continuous batching: jaxtrain/models/core.py's paged_cache)",
                          "use the static batch (no slots), or give its decoding the slots API")
    if slots < 1 or slots % shards:
      raise GenerateError("slots", f"{slots} is not a positive multiple of the {shards} batch shards",
                          f"use a multiple of {shards}")
    if page_size < 1:
      raise GenerateError("page_size", f"must be >= 1, got {page_size}", "use e.g. 16")
    if requests < 1 or prompt_len < 1 or max_new_tokens < 1:
      raise ValueError(f"requests={requests}, prompt_len={prompt_len}, max_new_tokens={max_new_tokens}: each >= 1")
    self.max_len = prompt_len + max_new_tokens - 1  # the last new token is never fed back
    self.pages_per_slot = -(-self.max_len // page_size)
    pages = pages or slots * self.pages_per_slot
    if pages % shards or pages // shards < self.pages_per_slot:
      raise GenerateError("pages", f"{pages} pages: each of the {shards} batch shards needs at least "
                          f"{self.pages_per_slot} (one request of prompt_len + max_new_tokens - 1 = {self.max_len} "
                          f"tokens, {page_size} a page) and the pool splits evenly over them",
                          f"give a multiple of {shards}, at least {shards * self.pages_per_slot}")
    self.model, self.mesh, self.rules, self.shards = model, mesh, rules, shards
    self.requests, self.slots, self.prompt_len, self.max_new_tokens = requests, slots, prompt_len, max_new_tokens
    self.sampling, self.eos_ids, self.token_logp = sampling, tuple(int(e) for e in eos_ids), token_logp
    self.page_size, self.pages = page_size, pages
    self.replicated = NamedSharding(mesh, P())
    abstract = abstract_params(model, param_shardings)

    def arg(shape, dtype=jnp.int32):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=self.replicated)

    t = time.perf_counter()
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
      key = arg((), jax.eval_shape(jax.random.key, 0).dtype)  # (no array made: compiles for a TPU topology too)
      self._run_fn = jax.jit(self._run).lower(abstract, arg((requests, prompt_len)), arg((requests,)),
                                              arg((requests,)), arg(()), key).compile()
    self.compile_s = time.perf_counter() - t

  def _run(self, params, tokens, lengths, budgets, count, key):
    """The whole program: tokens ``[requests, prompt_len]`` left-padded, ``lengths`` and ``budgets`` ``[requests]``,
    the first ``count`` requests real. Returns ``(tokens [requests, max_new_tokens], produced [requests], [token_logp
    values,] {"steps", "prefills"})``."""
    model, sampling_ = self.model, self.sampling
    params = model.effective_params(params)  # LoRA: merged once, not in every step
    n, N, P_len, S = self.max_new_tokens, self.requests, self.prompt_len, self.slots
    B, per_shard, page_size, per_slot = self.shards, self.slots // self.shards, self.page_size, self.pages_per_slot
    local_pages = self.pages // B
    eos = jnp.asarray(self.eos_ids or (-1,), jnp.int32)
    # A request's pages: its prompt and its budget's tokens but the last (which is never fed back).
    need = -(-(lengths + budgets - 1) // page_size)
    cols = jnp.arange(per_slot, dtype=jnp.int32)[None, :]
    state = {
        "next": jnp.int32(0),  # the next queued request
        "slot_q": jnp.full((S,), N, jnp.int32),  # each slot's request (N: free)
        "slot_t": jnp.zeros((S,), jnp.int32),  # how many tokens it has drawn
        "slot_last": jnp.zeros((S,), jnp.int32),  # its last token (the next step's input)
        "slot_pages": jnp.zeros((S,), jnp.int32),  # how many pages it holds
        "free": jnp.ones((B, local_pages), bool),  # each shard's free pages
        "cache": model.init_paged_cache(self.pages, page_size, S, per_slot, B),
        "out": jnp.zeros((N, n), jnp.int32), "produced": jnp.zeros((N,), jnp.int32),
        "logps": jnp.zeros((N, n), jnp.float32) if self.token_logp is not None else None,
        "steps": jnp.int32(0), "prefills": jnp.int32(0),
    }

    def emit(st, rows, q, t, logits, live):
      """Draws token ``t`` of request ``q`` for each of ``rows`` (slot ids) where ``live``; records it; frees the
      slots whose request it ends. Returns the new state and the tokens."""
      qc = jnp.minimum(q, N - 1)
      token = draw(logits, request_keys(key, qc, t), sampling_)
      at = jnp.where(live, q, N)  # out of bounds: dropped
      st = {**st, "out": st["out"].at[at, t].set(token, mode="drop"),
            "produced": st["produced"].at[at].set(t + 1, mode="drop")}
      if self.token_logp is not None:
        st["logps"] = st["logps"].at[at, t].set(self.token_logp(logits, token), mode="drop")
      ended = live & (jnp.isin(token, eos) | (t + 1 >= budgets[qc]))
      # The ended requests' pages back to their shards' free lists, their slots free.
      held = ended[:, None] & (cols < st["slot_pages"][rows][:, None])
      shard = jnp.where(held, (rows // per_shard)[:, None], B)
      st["free"] = st["free"].at[shard, st["cache"].page_table[rows]].set(True, mode="drop")
      st["slot_q"] = st["slot_q"].at[jnp.where(ended, rows, S)].set(N, mode="drop")
      return st, token

    def plan(st):
      """Who is admitted now: per shard its first free slot, the queued requests in order, while their pages fit."""
      vacant = (st["slot_q"] == N).reshape(B, per_shard)
      has = jnp.any(vacant, axis=1)
      slot = jnp.argmax(vacant, axis=1).astype(jnp.int32) + jnp.arange(B, dtype=jnp.int32) * per_shard
      q = st["next"] + jnp.cumsum(has, dtype=jnp.int32) - 1
      queued = has & (q < count)
      pages = need[jnp.minimum(q, N - 1)]
      stuck = queued & (pages > jnp.sum(st["free"], axis=1))
      admit = queued & (jnp.cumsum(stuck) == 0)  # first come, first served: none passes one that waits
      return admit, slot, q, pages

    def refill(st):
      admit, slot, q, pages = plan(st)
      qc = jnp.minimum(q, N - 1)
      lowest = jax.vmap(lambda f: jnp.nonzero(f, size=local_pages, fill_value=0)[0])(st["free"])[:, :per_slot]
      take = admit[:, None] & (cols < pages[:, None])
      table = jnp.where(take, lowest, 0).astype(jnp.int32)
      shards = jnp.arange(B, dtype=jnp.int32)[:, None]
      free = st["free"].at[jnp.where(take, shards, B), lowest].set(False, mode="drop")
      to = jnp.where(admit, slot, S)
      cache = st["cache"]
      # The prompts' prefill: one row per shard (its admitted request, or padding), written to the request's pages.
      plen = lengths[qc]
      col = jnp.arange(P_len, dtype=jnp.int32)[None, :]
      real = admit[:, None] & (col >= P_len - plen[:, None])
      start = dataclasses.replace(cache, page_table=table, lengths=jnp.zeros((B,), jnp.int32))
      logits, prefilled = model.decode(params, tokens[qc], jnp.where(real, col - (P_len - plen[:, None]), 0),
                                       real.astype(jnp.int32), start)
      cache = dataclasses.replace(cache, k=prefilled.k, v=prefilled.v,
                                  page_table=cache.page_table.at[to].set(table, mode="drop"),
                                  lengths=cache.lengths.at[to].set(plen, mode="drop"))
      st = {**st, "free": free, "cache": cache, "next": st["next"] + jnp.sum(admit, dtype=jnp.int32),
            "slot_q": st["slot_q"].at[to].set(q, mode="drop"), "slot_t": st["slot_t"].at[to].set(1, mode="drop"),
            "slot_pages": st["slot_pages"].at[to].set(pages, mode="drop"), "prefills": st["prefills"] + 1}
      st, token = emit(st, slot, q, jnp.zeros((B,), jnp.int32), logits[:, -1], admit)
      return {**st, "slot_last": st["slot_last"].at[to].set(token, mode="drop")}

    def step(st):
      st = jax.lax.while_loop(lambda st: jnp.any(plan(st)[0]), refill, st)
      busy = st["slot_q"] < N
      cache = st["cache"]
      logits, cache = model.decode(params, st["slot_last"][:, None], cache.lengths[:, None],
                                   busy[:, None].astype(jnp.int32), cache)
      rows = jnp.arange(S, dtype=jnp.int32)
      st, token = emit({**st, "cache": cache}, rows, st["slot_q"], st["slot_t"], logits[:, 0], busy)
      return {**st, "slot_last": token, "slot_t": st["slot_t"] + busy.astype(jnp.int32), "steps": st["steps"] + 1}

    def more(st):  # (bounded: every step with a busy slot draws a token)
      waiting = (st["next"] < count) | jnp.any(st["slot_q"] < N)
      return waiting & (st["steps"] <= count * n)

    st = jax.lax.while_loop(more, step, state)
    extras = (st["logps"],) if self.token_logp is not None else ()
    return (st["out"], st["produced"], *extras, {"steps": st["steps"], "prefills": st["prefills"]})

  # Use ---------------------------------------------------------------------------------------------------------

  def batch(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int] | None = None) -> Batch:
    return left_pad(prompts, self.requests, self.prompt_len, budgets)

  def __call__(self, params, batch: Batch, seed: int = 0):
    """Dispatches the program (not waited for) on ``batch`` (left-padded, as :class:`Generator`'s: the first
    ``batch.count`` rows are the queue, in order); returns the device arrays of ``_run``."""
    if batch.tokens.shape != (self.requests, self.prompt_len):
      raise ValueError(f"a batch of {batch.tokens.shape} for {self.requests} requests of {self.prompt_len} tokens")
    put = [jax.device_put(np.asarray(x, np.int32), self.replicated)
           for x in (batch.tokens, batch.lengths, batch.budgets_or(self.max_new_tokens), batch.count)]
    return self._run_fn(params, *put, jax.device_put(jax.random.key(seed), self.replicated))

  completions = Generator.completions
  generate = Generator.generate


def padded_rows(count: int, mesh, rules) -> int:
  """``count`` rounded up to a multiple of the mesh's batch shards."""
  _, shards = sharding.batch_shards(dict(mesh.shape), rules)
  return -(-count // shards) * shards


# ---------------------------------------------------------------------------------------------------------------
# A run's tokenizer.

@dataclasses.dataclass
class Tokenizer:
  """Text <-> ids for generation: the tokenizer, the id prepended to every plain prompt (None: none), the ids that
  end a row (the generation config's EOS ids and the tokenizer's own EOS token), and the chat template (with the
  special tokens it names) that renders a conversation (:meth:`encode_chat`)."""
  tokenizer: Any
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  where: str = ""
  chat_template: str | None = None
  special_tokens: dict = dataclasses.field(default_factory=dict)

  def encode(self, text: str) -> list[int]:
    ids = [int(i) for i in self.tokenizer.encode(text)]
    return ([self.bos_id] if self.bos_id is not None else []) + ids

  def encode_chat(self, messages: list[dict]) -> list[int]:
    """The ids of ``messages`` rendered by the chat template with the generation prompt (the template writes any
    BOS itself, as transformers' ``apply_chat_template`` does)."""
    if not self.chat_template:
      raise GenerateError("--chat", f"the tokenizer ({self.where}) has no chat template", "drop --chat, or pass "
                          "--tokenizer=a folder whose tokenizer_config.json or chat_template.jinja has one")
    try:
      text = chat.ChatTemplate(self.chat_template, self.special_tokens).render(messages, add_generation_prompt=True)[0]
    except chat.RecordError as e:
      raise GenerateError("--chat", str(e), "give messages of {\"role\", \"content\"}") from None
    return [int(i) for i in self.tokenizer.encode(text)]

  def decode(self, ids) -> str:
    return self.tokenizer.decode(ids)


def _ids(value) -> tuple[int, ...]:
  if value is None:
    return ()
  return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


def _generation_ids(side: str | None) -> dict:
  """``bos_token_id`` / ``eos_token_id`` of a side folder's config.json, its generation_config.json winning."""
  found = {}
  for name in ("config.json", "generation_config.json"):
    file = epath.Path(side) / name if side else None
    try:
      if file and file.exists():
        found.update({k: v for k, v in json.loads(file.read_text()).items()
                      if k in ("bos_token_id", "eos_token_id") and v is not None})
    except (OSError, ValueError):
      pass
  return found


def tokenizer_for(config: ml_collections.ConfigDict, saved: dict | None = None, step_dir: str | None = None,
                  override: str = "") -> Tokenizer:
  """The tokenizer of a checkpoint (``step_dir``) or of the running run (``config``): ``override`` (a tokenizer
  file or folder), else the Hugging Face side files its lineage carries (jaxtrain.checkpoint.lineage: a folder, with
  its special tokens and chat template), else ``data.tokenizer``, else the data source's. A row ends at the side
  files' generation-config EOS ids and at the tokenizer's own EOS token, whichever tokenizer it is."""
  saved = saved if saved is not None else config.to_dict()
  side = (checkpoint_lib.side_files_dir(step_dir, saved) if step_dir
          else checkpoint_lib.lineage.run_side_dir(saved))
  ids = _generation_ids(side)
  bos = None
  if override:
    tok, where = tokenizers.load(override), override
  elif checkpoint_lib.lineage.has_tokenizer(side):
    json_file = paths.join(side, "tokenizer.json")
    where = json_file if epath.Path(json_file).exists() else paths.join(side, "tokenizer.model")
    tok = tokenizers.load(side if where == json_file else where)
    bos = None if ids.get("bos_token_id") is None else _ids(ids["bos_token_id"])[0]
  elif config.data.tokenizer and config.data.tokenizer != "byte":
    tok, where = tokenizers.load(config.data.tokenizer), f"data.tokenizer={config.data.tokenizer}"
  else:
    try:
      spec = data_lib.tokenizer_of(config)  # the source's (jaxtrain.data.Source.tokenizer)
    except UserError as e:
      raise GenerateError(e.subject, e.problem, e.fix) from None
    if spec is None:
      raise GenerateError(f"data.source={config.data.source}", "generation does not know this source's tokenizer",
                          "pass --tokenizer=FILE")
    tok, where = ((tokenizers.load(spec), f"data.source={config.data.source}'s tokenizer {spec}") if spec != "byte"
                  else (tokenizers.ByteTokenizer(), "byte-level"))
  special = dict(getattr(tok, "special_tokens", {}) or {})
  own_eos = special.get("eos_token")
  own_eos = tok.token_to_id(own_eos) if own_eos is not None and hasattr(tok, "token_to_id") else None
  eos = tuple(dict.fromkeys(_ids(ids.get("eos_token_id")) + ((int(own_eos),) if own_eos is not None else ())))
  return Tokenizer(tok, bos, eos, where, getattr(tok, "chat_template", None), special)


def encode_prompts(tok: Tokenizer, prompts: Sequence[str], vocab_size: int) -> list[list[int]]:
  if not prompts:
    raise GenerateError("--prompt", "no prompt given", "pass --prompt=TEXT or --prompts_file=FILE")
  out = []
  for i, text in enumerate(prompts):
    ids = tok.encode(text) if text else []
    if not ids or (tok.bos_id is not None and len(ids) == 1):
      raise GenerateError(f"prompt {i + 1}", "is empty", "give every prompt some text")
    if max(ids) >= vocab_size:
      raise GenerateError(f"prompt {i + 1}", f"has token id {max(ids)}, outside the model's vocab_size "
                          f"{vocab_size}", f"use the tokenizer the model was trained with (this is {tok.where})")
    out.append(ids)
  return out


# ---------------------------------------------------------------------------------------------------------------
# Samples during training.

class Sampler:
  """Greedy continuations of ``train.sample_prompts`` (``train.sample_tokens`` new tokens each) from a train
  state's params, for the loop (``train.sample_every``). Compiled once, at construction."""

  def __init__(self, run):
    c = run.config
    self.tokenizer = tokenizer_for(c)
    self.prompts = list(c.train.sample_prompts)
    ids = encode_prompts(self.tokenizer, self.prompts, c.model.vocab_size)
    self.generator = Generator(run.model, run.mesh, run.rules, run.state_shardings.params,
                               rows=padded_rows(len(ids), run.mesh, run.rules), prompt_len=max(map(len, ids)),
                               max_new_tokens=c.train.sample_tokens, eos_ids=self.tokenizer.eos_ids)
    self.batch = self.generator.batch(ids)

  def __call__(self, params):
    """Dispatches the generation (the params may be donated next); ``fetch()`` waits and returns
    ``[{"prompt", "completion"}]``."""
    with jax.set_mesh(self.generator.mesh):
      result = self.generator(params, self.batch)

    def fetch() -> list[dict[str, str]]:
      ids = self.generator.completions(result, self.batch)
      return [{"prompt": p, "completion": self.tokenizer.decode(i)} for p, i in zip(self.prompts, ids)]

    return fetch

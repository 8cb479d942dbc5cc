"""Prompts for reinforcement learning (``data.source=prompts``, read by ``train.objective=grpo``): a JSONL file of
records, each with a prompt and whatever its reward needs (an ``answer``, test cases, ...).

A record's prompt (``data.prompts.field``, default ``prompt``) is a string, encoded as it is, or a list of chat
messages (``{"role", "content"}``), rendered with the tokenizer's chat template and its generation prompt (the
assistant's turn opened), as SFT data is. The tokenizer is ``data.tokenizer`` (a tokenizer file or folder; empty:
the tokenizer the run's lineage carries, else byte-level). A prompt may have at most
``data.seq_len + 1 - rl.max_new_tokens`` tokens (the prompt and its completion make one training row); a longer one, a record without the field or a line that is not a JSON object
is a DataError naming the file and line, before anything compiles.

The train stream (:class:`PromptStream`) visits the records in a new seeded order each epoch; step s takes the next
``train.global_batch_size / rl.group_size`` prompts and repeats each ``rl.group_size`` times, consecutively, so a
group's completions are rows next to each other. Each process yields its share of the rows. A row is the prompt
left-padded to the prompt width (``inputs``, ``positions``, ``segment_ids``: padding is segment 0), ``loss_mask`` 0
everywhere and the record's index in column 0 of ``targets`` (under the mask, so no token id): how the objective,
holding the same records, finds what the reward needs. Its position (the global step) is a
:class:`jaxtrain.checkpoint.DataPosition`: a resumed run reads the prompts it would have read. Held-out prompts
(``data.eval_path``) are read by the objective's evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np
from etils import epath

from jaxtrain import paths
from jaxtrain.checkpoint import lineage
from jaxtrain.data import chat as chat_lib
from jaxtrain.data import tokenizers
from jaxtrain.data.source import SOURCES, Source, StepPosition
from jaxtrain.errors import ConfigError, DataError


@dataclasses.dataclass
class PromptSet:
  """Records of one JSONL file and their prompts' token ids (``ids[i]``: record i's)."""
  path: str
  records: list[dict]
  ids: list[np.ndarray]
  texts: list[str]
  lines: list[int] | None = None  # the line of each record in the file (1-based; blank lines are skipped)

  def where(self, i: int) -> str:
    return f"{self.path}:{self.lines[i] if self.lines else i + 1}"


def prompt_width(config) -> int:
  """The most tokens a prompt may have: the prompt and ``rl.max_new_tokens`` new tokens make one training row of
  ``data.seq_len + 1`` tokens (inputs and targets)."""
  return config.data.seq_len + 1 - config.rl.max_new_tokens


def tokenizer_spec(config) -> str:
  """``data.tokenizer``; left empty, the tokenizer the run's lineage carries (a run started from an import or its
  descendants: jaxtrain.checkpoint.lineage), which its model was trained with; else byte-level."""
  return config.data.tokenizer or lineage.tokenizer_of(config.to_dict()) or "byte"


@functools.lru_cache(maxsize=8)
def _tokenizer(spec: str):
  return tokenizers.ByteTokenizer() if spec == "byte" else tokenizers.load(spec)


def load(path: str, config, key: str = "data.path") -> PromptSet:
  """The records of ``path`` with their prompts tokenized; DataError naming the line for a bad record, ConfigError
  naming ``key`` for a missing file."""
  path = paths.resolve(path)
  file = epath.Path(path)
  if not path or not file.exists():
    raise ConfigError(key, f"no prompts file at '{path}'", "give a JSONL file of {\"prompt\": ...} records")
  tok = _tokenizer(tokenizer_spec(config))
  field, width = config.data.prompts.field, prompt_width(config)
  template = None
  records, ids, texts, lines = [], [], [], []
  for n, line in enumerate(file.read_text().splitlines()):
    if not line.strip():
      continue
    where = f"{path}:{n + 1}"
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(where, f"is not JSON ({e.msg})", "write one JSON object per line") from None
    if not isinstance(record, dict):
      raise DataError(where, "is not a JSON object", f"write one {{\"{field}\": ...}} object per line")
    if field not in record:
      raise DataError(where, f"has no '{field}' field (its fields: {', '.join(map(str, record)) or 'none'})",
                      f"give every record a '{field}', or set data.prompts.field to the field that holds the prompt")
    prompt = record[field]
    if isinstance(prompt, list):
      if template is None:
        if not getattr(tok, "chat_template", None):
          raise DataError(where, "has chat messages but the tokenizer has no chat template",
                          "set data.tokenizer to a tokenizer folder with a chat template, or give the prompt as text")
        template = chat_lib.ChatTemplate(tok.chat_template, tok.special_tokens)
      if not prompt or not all(isinstance(m, dict) and m.get("role") in chat_lib.ROLES
                               and isinstance(m.get("content"), str) for m in prompt):
        raise DataError(where, f"its '{field}' is not a list of {{role, content}} messages",
                        f"give roles among {', '.join(chat_lib.ROLES)} and string contents")
      try:
        text = template.render(prompt, add_generation_prompt=True)[0]
      except chat_lib.RecordError as e:
        raise DataError(where, str(e), "fix the record's messages") from None
    elif isinstance(prompt, str) and prompt:
      text = prompt
    else:
      raise DataError(where, f"its '{field}' is {prompt!r}, not a non-empty string or a list of messages",
                      "fix the record")
    tokens = np.asarray(tok.encode(text), np.int32)
    if not 0 < tokens.size <= width:
      raise DataError(where, f"its prompt has {tokens.size} tokens, more than the {width} that data.seq_len="
                      f"{config.data.seq_len} leaves after rl.max_new_tokens={config.rl.max_new_tokens}",
                      "raise data.seq_len or shorten the prompt")
    if int(tokens.max()) >= config.model.vocab_size:
      raise DataError(where, f"has token id {int(tokens.max())}, outside model.vocab_size={config.model.vocab_size}",
                      "set data.tokenizer to the model's tokenizer")
    records.append(record)
    ids.append(tokens)
    texts.append(text)
    lines.append(n + 1)
  if not records:
    raise DataError(path, "holds no records", "give a JSONL file of {\"prompt\": ...} records")
  return PromptSet(path, records, ids, texts, lines)


def rows(prompts: list[np.ndarray], indices, width: int) -> dict[str, np.ndarray]:
  """The prompt batch of :func:`jaxtrain.data.batch`'s keys for records ``indices`` (see the module docstring)."""
  n = len(indices)
  batch = {k: np.zeros((n, width), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
  batch["loss_mask"] = np.zeros((n, width), np.float32)
  for r, i in enumerate(indices):
    ids = prompts[i]
    batch["inputs"][r, width - ids.size:] = ids
    batch["positions"][r, width - ids.size:] = np.arange(ids.size)
    batch["segment_ids"][r, width - ids.size:] = 1
    batch["targets"][r, 0] = i
  batch["doc_ids"] = np.repeat(np.asarray(indices, np.int64)[:, None], width, axis=1)
  return batch


def record_indices(batch) -> np.ndarray:
  """The record index of each row of a prompt batch (see :func:`rows`)."""
  return np.asarray(batch["targets"])[:, 0]


class PromptStream(StepPosition):
  """This process's rows of the prompt stream (see the module docstring); its position is the global step."""

  def __init__(self, prompts: PromptSet, width: int, global_rows: int, group_size: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    if global_rows % group_size or global_rows % process_count:
      raise ValueError(f"{global_rows} rows do not split into groups of {group_size} over {process_count} processes")
    self.prompts, self.width, self.group, self.seed = prompts, width, group_size, seed
    self.per_step = global_rows // group_size
    local = global_rows // process_count
    self.rows = slice(process_index * local, (process_index + 1) * local)
    self.step = 0

  def __iter__(self) -> "PromptStream":
    return self

  def order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng((self.seed, epoch)).permutation(len(self.prompts.records))

  def indices(self, step: int) -> np.ndarray:
    """The records of global step ``step`` (0-based), one per prompt (not repeated)."""
    n = len(self.prompts.records)
    out = []
    for j in range(step * self.per_step, (step + 1) * self.per_step):
      out.append(self.order(j // n)[j % n])
    return np.asarray(out, np.int64)

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global step ``step`` (0-based), wherever the stream is (GRPO's rollouts produced
    ahead read the steps to come)."""
    return rows(self.prompts.ids, np.repeat(self.indices(step), self.group)[self.rows], self.width)

  def __next__(self) -> dict[str, np.ndarray]:
    self.step += 1
    return self.batch(self.step - 1)


def open_train(config) -> PromptStream:
  return PromptStream(load(config.data.path, config), prompt_width(config), config.train.global_batch_size,
                      config.rl.group_size, config.train.seed, jax.process_index(), jax.process_count())


def _validate(config) -> None:
  if config.train.objective != "grpo":
    raise ConfigError("data.source", "'prompts' holds prompts without targets, for train.objective=grpo",
                      "set train.objective=grpo, or use a source of documents")
  if not config.data.path:
    raise ConfigError("data.path", "is empty: train.objective=grpo needs prompts",
                      "set data.path to a JSONL file of {\"prompt\": ..., \"answer\": ...} records")


def _provenance(config, step: int, doc_ids) -> dict:
  records = sorted({int(i) for i in np.unique(doc_ids)}) if doc_ids is not None else []
  return {"source": f"prompts {config.data.path} (batch {step - 1})", "records": [r + 1 for r in records]}


SOURCES.register("prompts", Source(open_train, lambda config: [], _provenance, defaults=lambda: {"field": "prompt"},
                                   validate=_validate, reads=("eval_path",),
                                   tokenizer=lambda config: tokenizer_spec(config)))

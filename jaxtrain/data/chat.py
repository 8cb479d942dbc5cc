"""Supervised fine-tuning (SFT) records -> token ids plus a per-token *trained* flag.

A record is a prompt/response pair or a chat (``messages``: ``{"role": "system"|"user"|"assistant",
"content": str}`` in order, at least one assistant message). Only what the assistant says is trained on.

**With a chat template** (a Hugging Face tokenizer folder whose ``tokenizer_config.json`` has ``chat_template``,
or its ``chat_template.jinja``, or a template file given explicitly): the conversation (a pair is
``[user: prompt, assistant: response]``) is rendered with jinja2 as transformers' ``apply_chat_template(messages,
tokenize=False)`` renders it: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, the globals ``raise_exception``, ``strftime_now`` and the special tokens of the
tokenizer's config (``bos_token``, ``eos_token``, ...), ``add_generation_prompt=False`` and transformers'
``tojson`` filter. The whole text is tokenized once (as transformers does, no special tokens added) and a token
is trained when its character span (the tokenizer's offsets) overlaps a trained character span:

- templates with ``{% generation %}`` blocks: exactly those blocks (transformers' assistant-token mask);
- otherwise each assistant message's content, found in the rendered text in message order (verbatim, or
  stripped for templates that ``trim`` it), plus the template's end-of-turn token after it: the first special
  token that follows the content with nothing but whitespace between (``<|eot_id|>``, ``<|im_end|>``, ``</s>``,
  ...; it and that whitespace are trained, so the model learns to stop).

**Without a template** (byte tokenizer, a bare ``tokenizer.json``, a folder without one) the plain format is
the concatenation of separately tokenized pieces: the config's ``bos_token`` if it names one, then for a pair
the prompt's tokens then the response's tokens, for a chat every message's content's tokens in order; each
response / assistant content is followed by the config's ``eos_token`` if it names one. Trained: the
response / assistant tokens and their EOS. No separators are added: put them in the text (e.g. a prompt that
ends with ``"\\n"``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from contextlib import contextmanager

import numpy as np

ROLES = ("system", "user", "assistant")


class RecordError(ValueError):
  """A record that cannot be turned into a training example; the message says why (no location)."""


@dataclasses.dataclass(frozen=True)
class Fields:
  prompt: str = "prompt"
  response: str = "response"
  messages: str = "messages"


def is_sft_object(obj, fields: Fields) -> bool:
  """Whether a JSON object looks like an SFT record (has ``messages``, or both ``prompt`` and ``response``)."""
  return isinstance(obj, dict) and (fields.messages in obj or (fields.prompt in obj and fields.response in obj))


def messages_field(obj) -> str | None:
  """The first field of a JSON object whose value looks like chat messages (a non-empty list of objects), or None:
  what a misnamed ``messages`` field is called (for the hint of a record that has none of the expected fields)."""
  if isinstance(obj, dict):
    for k, v in obj.items():
      if isinstance(v, list) and v and all(isinstance(m, dict) for m in v):
        return str(k)
  return None


def fields_of(obj) -> str:
  """``its fields: a, b`` of a JSON object (``a JSON list``, ... of anything else): what a record has."""
  if isinstance(obj, dict):
    return f"its fields: {', '.join(map(str, obj)) or 'none'}"
  return f"a JSON {type(obj).__name__}"


def parse(obj, fields: Fields) -> list[dict]:
  """One JSONL object -> its messages (a pair becomes ``[user, assistant]``). RecordError on bad records."""
  if not isinstance(obj, dict):
    raise RecordError("not a JSON object")
  if fields.messages in obj:
    messages = obj[fields.messages]
    if not isinstance(messages, list) or not messages:
      raise RecordError(f"field '{fields.messages}' is not a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise RecordError(f"message {i} is not an object with 'role' and 'content'")
      if m["role"] not in ROLES:
        raise RecordError(f"message {i} has unknown role {m['role']!r} (roles: {', '.join(ROLES)})")
      if not isinstance(m["content"], str):
        raise RecordError(f"message {i}'s content is not a string")
      out.append({k: v for k, v in m.items() if v is not None})  # as transformers: None-valued keys dropped
    if not any(m["role"] == "assistant" for m in out):
      raise RecordError("the messages have no assistant turn (nothing to train on)")
  else:
    for name in (fields.prompt, fields.response):
      if name not in obj:
        raise RecordError(f"no field '{name}' (nor '{fields.messages}')")
      if not isinstance(obj[name], str):
        raise RecordError(f"field '{name}' is not a string")
    out = [{"role": "user", "content": obj[fields.prompt]}, {"role": "assistant", "content": obj[fields.response]}]
  for i, m in enumerate(out):
    if m["role"] == "assistant" and not m["content"].strip():
      raise RecordError(f"{'the response' if fields.messages not in obj else f'message {i}'} is empty")
  return out


def digest(messages: list[dict]) -> bytes:
  """SHA-256 of a record's messages (for de-duplication)."""
  return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode("utf-8")).digest()


# ------------------------------------------------------------------------------------------- chat templates


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  """transformers' tojson filter (jinja's own escapes HTML characters)."""
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(source: str):
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class GenerationTracker(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: records the character span of what the block renders
    (transformers' AssistantTracker)."""
    tags = {"generation"}

    def __init__(self, environment):
      super().__init__(environment)
      environment.extend(track_generation=self.track)
      self._blocks, self._spans = None, None

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body).set_lineno(lineno)

    def _support(self, caller):
      rendered = caller()
      if self._blocks is not None:
        start = len("".join(self._blocks))
        self._spans.append((start, start + len(rendered)))
      return rendered

    @contextmanager
    def track(self, blocks: list, spans: list):
      self._blocks, self._spans = blocks, spans
      try:
        yield
      finally:
        self._blocks, self._spans = None, None

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def strftime_now(fmt):
    from datetime import datetime
    return datetime.now().strftime(fmt)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[GenerationTracker, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env.from_string(source)


class ChatTemplate:
  """A compiled chat template with the tokenizer's special tokens (``bos_token``, ``eos_token``, ...)."""

  def __init__(self, source: str, special_tokens: dict[str, str]):
    self.source, self.special_tokens = source, dict(special_tokens)
    self.sha256 = hashlib.sha256(source.encode("utf-8")).hexdigest()
    self.tracks_generation = bool(re.search(r"\{%-?\s*generation\s*-?%\}", source))
    self._template = _compile(source)

  def render(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, the character spans of its ``{% generation %}`` blocks)."""
    import jinja2
    blocks, spans = [], []
    kwargs = dict(self.special_tokens, messages=messages, tools=None, documents=None,
                  add_generation_prompt=add_generation_prompt)
    try:
      with self._template.environment.track_generation(blocks, spans):
        for block in self._template.generate(**kwargs):
          blocks.append(block)
    except jinja2.exceptions.TemplateError as e:
      raise RecordError(f"the chat template refused the record: {str(e)[:200]}") from None
    return "".join(blocks), spans


def _content_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
  """The character spans of the assistant messages' contents in ``text``, found in message order."""
  spans, cursor = [], 0
  for i, m in enumerate(messages):
    for piece in (m["content"], m["content"].strip()):
      at = text.find(piece, cursor) if piece else -1
      if at >= 0:
        cursor = at + len(piece)
        if m["role"] == "assistant":
          spans.append((at, cursor))
        break
    else:
      if m["role"] == "assistant":
        raise RecordError(f"the chat template does not render message {i}'s content as given, so its tokens "
                          "cannot be found; give the template {% generation %} blocks")
  return spans


def _overlapping(offsets: np.ndarray, spans) -> np.ndarray:
  """Per token: whether its character span [start, end) overlaps one of ``spans``."""
  trained = np.zeros(len(offsets), bool)
  for start, end in spans:
    trained |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
  return trained


class Encoder:
  """Records -> (int32 token ids, uint8 trained flags), with ``template`` (a :class:`ChatTemplate`) or the
  plain format (``template=None``)."""

  def __init__(self, tokenizer, template: ChatTemplate | None):
    self.tokenizer, self.template = tokenizer, template
    if template is not None and not hasattr(tokenizer, "encode_with_offsets"):
      raise RecordError("chat templates need the byte tokenizer or a Hugging Face tokenizer (character offsets)")

  def encode(self, messages: list[dict], last_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``last_only``: only the last assistant message (and its end-of-turn token) is trained (a preference
    pair's response: the turns before it are its prompt)."""
    if self.template is None:
      return self._plain(messages, last_only)
    text, generation = self.template.render(messages)
    ids, offsets = self.tokenizer.encode_with_offsets(text)
    if self.template.tracks_generation:
      return ids, _overlapping(offsets, generation[-1:] if last_only else generation).astype(np.uint8)
    spans = _content_spans(text, messages)
    if last_only:
      spans = spans[-1:]
    trained = _overlapping(offsets, spans)
    special = self.tokenizer.special_ids
    for _, end in spans:  # the end-of-turn token after each assistant content
      first = j = int(np.searchsorted(offsets[:, 0], end))  # the first token starting at or after the content
      while j < len(ids) and int(ids[j]) not in special and not text[offsets[j, 0]:offsets[j, 1]].strip():
        j += 1  # whitespace between the content and the end-of-turn token
      if j < len(ids) and int(ids[j]) in special:
        trained[first:j + 1] = True
    return ids, trained.astype(np.uint8)

  def _plain(self, messages: list[dict], last_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    tok, special = self.tokenizer, self.tokenizer.special_tokens
    bos = self._special_id(special.get("bos_token"))
    eos = self._special_id(special.get("eos_token"))
    ids, trained = [np.asarray(bos, np.int32)], [np.zeros(len(bos), np.uint8)]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for i, m in enumerate(messages):
      piece = tok.encode(m["content"])
      if m["role"] == "assistant":
        piece = np.concatenate([piece, np.asarray(eos, np.int32)])
      ids.append(piece.astype(np.int32))
      trained.append(np.full(piece.size, m["role"] == "assistant" and (i == last or not last_only), np.uint8))
    return np.concatenate(ids), np.concatenate(trained)

  def _special_id(self, text: str | None) -> list[int]:
    """The id of a special token's text (as a list: empty when the config names none)."""
    if not text:
      return []
    ids = self.tokenizer.encode(text)
    if ids.size != 1:
      raise RecordError(f"special token {text!r} is not one token of the tokenizer")
    return [int(ids[0])]

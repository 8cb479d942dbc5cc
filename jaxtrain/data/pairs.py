"""Preference pairs: JSONL records -> the token ids and trained flags of both responses, one record per pair
(``tools/prepare_data.py --format=preference``; read back by :mod:`jaxtrain.data.preference`).

A record is ``{"prompt": str, "chosen": str, "rejected": str}`` (each response a single assistant turn after the
prompt as a user turn), or ``{"chosen": [messages], "rejected": [messages]}`` (two chats that differ only in their
last message, an assistant turn; optionally with ``"prompt"``: messages, or a string as one user turn, put before
both). Each side is rendered and tokenized as SFT data is (:mod:`jaxtrain.data.chat`: the chat template, or the
plain format), and only its last assistant message (and the end-of-turn token after it) is trained: the prompt is
masked from the loss.

**Length** (``seq_len``, the training ``data.seq_len``): a side fits when it has at most ``seq_len + 1`` tokens
(one row of inputs and targets). An over-long pair loses the same number of tokens from the left of both sides'
prompts, the fewest that make both fit (so the tokens nearest the responses stay); when that would leave a side no
prompt token before its response (or cut into a response) the pair is dropped. Both are counted in the manifest
(``preference``: ``truncated``, ``dropped``).

**Record layout**: the chosen side's token ids then the rejected side's, then one uint8 flag per token (bit 0:
trained, bit 1: the token is the rejected side's, bit 2 on the first flag: the pair was truncated, bit 3 on the
first flag: the pair is dropped, a record that never reaches a shard). The layout is the SFT one (n ids then n
flags), so the preparation's shuffle, de-duplication and checksums are shared unchanged.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from jaxtrain.data import chat

TRAINED, REJECTED, TRUNCATED, DROPPED = 1, 2, 4, 8
SIDES = ("chosen", "rejected")


def is_pair_object(obj) -> bool:
  """Whether a JSON object looks like a preference record (``chosen`` and ``rejected`` fields)."""
  return isinstance(obj, dict) and all(k in obj for k in SIDES)


def parse(obj, fields: chat.Fields) -> tuple[list[dict], list[dict]]:
  """One JSONL object -> (the chosen side's messages, the rejected side's). RecordError on bad records."""
  if not isinstance(obj, dict):
    raise chat.RecordError("not a JSON object")
  for name in SIDES:
    if name not in obj:
      raise chat.RecordError(f"no field '{name}' (a preference record has 'chosen' and 'rejected')")
  chosen, rejected = obj["chosen"], obj["rejected"]
  prompt = obj.get(fields.prompt)
  if isinstance(chosen, str) and isinstance(rejected, str):
    if prompt is None:
      raise chat.RecordError(f"no field '{fields.prompt}' (the prompt that 'chosen' and 'rejected' answer)")
    sides = [chat.parse({fields.prompt: prompt, fields.response: r}, fields) for r in (chosen, rejected)]
  elif isinstance(chosen, list) and isinstance(rejected, list):
    if isinstance(prompt, str):
      prompt = [{"role": "user", "content": prompt}]
    if prompt is not None and not isinstance(prompt, list):
      raise chat.RecordError(f"field '{fields.prompt}' is neither a string nor a list of messages")
    sides = [chat.parse({fields.messages: (prompt or []) + r}, fields) for r in (chosen, rejected)]
    for name, messages in zip(SIDES, sides):
      if messages[-1]["role"] != "assistant":
        raise chat.RecordError(f"the last message of '{name}' is not an assistant turn (the response compared)")
    if sides[0][:-1] != sides[1][:-1]:
      raise chat.RecordError("'chosen' and 'rejected' differ before their last message (they must share the prompt)")
  else:
    raise chat.RecordError("'chosen' and 'rejected' must both be strings (with a 'prompt') or both lists of messages")
  if sides[0][-1]["content"] == sides[1][-1]["content"]:
    raise chat.RecordError("'chosen' and 'rejected' are the same response (nothing to prefer)")
  return sides[0], sides[1]


def digest(chosen: list[dict], rejected: list[dict]) -> bytes:
  """SHA-256 of a pair (for de-duplication)."""
  text = json.dumps({"chosen": chosen, "rejected": rejected}, sort_keys=True, ensure_ascii=False)
  return hashlib.sha256(text.encode("utf-8")).digest()


def encode(encoder: chat.Encoder, chosen: list[dict], rejected: list[dict],
           seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """A pair's record: (int32 ids of both sides, uint8 flags), truncated or marked dropped by the rule above."""
  sides = [encoder.encode(m, last_only=True) for m in (chosen, rejected)]
  if np.array_equal(sides[0][0], sides[1][0]):
    raise chat.RecordError("'chosen' and 'rejected' tokenize the same (nothing to prefer)")
  limit = seq_len + 1
  cut = max(0, *(len(ids) - limit for ids, _ in sides))
  flags_first = 0
  if cut:
    prompt_tokens = min(int(np.argmax(trained > 0)) for _, trained in sides)  # tokens before each response
    if cut > prompt_tokens - 1:  # at least one prompt token stays: the first response token's input
      flags_first = DROPPED
    else:
      sides = [(ids[cut:], trained[cut:]) for ids, trained in sides]
      flags_first = TRUNCATED
  ids = np.concatenate([sides[0][0], sides[1][0]]).astype(np.int32)
  flags = np.concatenate([sides[0][1].astype(np.uint8) & TRAINED,
                          (sides[1][1].astype(np.uint8) & TRAINED) | REJECTED])
  flags[0] |= flags_first
  return ids, flags


def decode(ids: np.ndarray, flags: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """A record's ids and flags -> ((chosen ids, chosen trained), (rejected ids, rejected trained))."""
  rejected = (flags & REJECTED) > 0
  trained = (flags & TRAINED).astype(np.int32)
  return (ids[~rejected], trained[~rejected]), (ids[rejected], trained[rejected])


def text(chosen: list[dict], rejected: list[dict]) -> str:
  """A pair's text, for near-duplicate search."""
  return "\n".join(str(m.get("content") or "") for m in chosen + rejected[-1:])

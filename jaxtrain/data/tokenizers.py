"""Tokenizers by file: byte-level built in, a Hugging Face ``tokenizers`` JSON file or folder, or a SentencePiece
model.

``load("")`` / ``load("byte")`` gives the byte tokenizer (UTF-8 bytes, vocab 256). Any other value is a path:
a folder is a Hugging Face tokenizer folder (``tokenizer.json``, and optionally ``tokenizer_config.json`` with
its special tokens (``bos_token``, ``eos_token``, ...) and ``chat_template``, or a ``chat_template.jinja`` file,
which wins, as in transformers); ``*.json`` is read with ``tokenizers``, anything else with ``sentencepiece``.
``name`` identifies the tokenizer by kind and content hash of its vocabulary file (a folder and its
``tokenizer.json`` give the same tokens and the same name), so a manifest can prove which tokenizer made its
tokens. ``special_tokens`` (name -> text) and ``chat_template`` (or None) come from a folder's config only.
"""

from __future__ import annotations

import functools
import hashlib
import json

import numpy as np
from etils import epath

from jaxtrain.errors import DataError


# What a tokenizer spec may name (for the fix of one that names none).
WHAT = ("a Hugging Face tokenizer folder (tokenizer.json, with tokenizer_config.json for the special tokens and the "
        "chat template), a tokenizer.json or a SentencePiece .model file")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ByteTokenizer:
  name, vocab_size = "byte", 256
  special_tokens: dict[str, str] = {}
  special_ids: frozenset[int] = frozenset()
  chat_template = None

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, [n, 2] character offsets): every byte of a character gets that character's span."""
    ids = self.encode(text)
    char = np.cumsum((ids & 0xC0) != 0x80) - 1  # UTF-8 continuation bytes belong to the character before
    return ids, np.stack([char, char + 1], axis=1)

  def decode(self, ids) -> str:
    return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
  def __init__(self, path: epath.Path, content: bytes, config: dict | None = None, chat_template: str | None = None):
    import tokenizers  # optional dependency: pip install tokenizers
    self._tok = tokenizers.Tokenizer.from_str(content.decode("utf-8"))
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.name = f"hf:{path.name}:{hashlib.sha256(content).hexdigest()[:16]}"
    config = config or {}
    self.special_tokens = {k: _token_text(config[k]) for k in SPECIAL_TOKEN_NAMES if config.get(k) is not None}
    self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
    self.chat_template = chat_template
    self._offsets_tok = None

  def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
    """The ids of ``text``; ``add_special_tokens``: with those the tokenizer's post-processor adds (a BOS)."""
    return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, np.int32)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, [n, 2] character offsets into ``text``). The offsets come from a copy without the
    post-processor, whose ``trim_offsets`` (ByteLevel) would shrink whitespace tokens to empty spans; without
    special tokens added, a post-processor does not change the ids."""
    if self._offsets_tok is None:
      import tokenizers
      self._offsets_tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
      self._offsets_tok.post_processor = None
    enc = self._offsets_tok.encode(text, add_special_tokens=False)
    return np.asarray(enc.ids, np.int32), np.asarray(enc.offsets, np.int64).reshape(-1, 2)

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)


class SentencePieceTokenizer:
  special_tokens: dict[str, str] = {}
  special_ids: frozenset[int] = frozenset()
  chat_template = None

  def __init__(self, path: epath.Path, content: bytes):
    import sentencepiece  # optional dependency: pip install sentencepiece
    self._sp = sentencepiece.SentencePieceProcessor(model_proto=content)
    self.vocab_size = self._sp.get_piece_size()
    self.name = f"sentencepiece:{path.name}:{hashlib.sha256(content).hexdigest()[:16]}"

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.encode(text), np.int32)

  def decode(self, ids) -> str:
    return self._sp.decode(list(map(int, ids)))


@functools.cache  # one load (read + hash) per process, however many input files use it
def load(spec: str):
  if spec in ("", "byte"):
    return ByteTokenizer()
  path = epath.Path(spec)
  if not path.exists():
    raise DataError(spec, "no such tokenizer file or folder", f"pass {WHAT}")
  if path.is_dir():
    return _load_folder(spec, path)
  content = path.read_bytes()
  try:
    return HFTokenizer(path, content) if path.suffix == ".json" else SentencePieceTokenizer(path, content)
  except ImportError as e:
    raise DataError(spec, f"needs the '{e.name}' package", f"pip install {e.name}") from None
  except Exception as e:  # the library rejected the file
    raise DataError(spec, f"not a valid tokenizer file ({type(e).__name__}: {str(e)[:120]})",
                    "pass a Hugging Face tokenizer.json or a SentencePiece .model file") from None


def _token_text(value) -> str:
  """A special token in tokenizer_config.json: a string or an AddedToken dict ({"content": ...})."""
  return str(value["content"] if isinstance(value, dict) else value)


def _load_folder(spec: str, path: epath.Path) -> HFTokenizer:
  """A Hugging Face tokenizer folder: tokenizer.json, its tokenizer_config.json (special tokens, chat template)
  and chat_template.jinja (preferred over the config's template, as transformers does)."""
  if not (path / "tokenizer.json").exists():
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    has = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "") if names else "nothing"
    inside = [n for n in names if n.endswith("/") and (path / n / "tokenizer.json").exists()]
    if (path / "tokenizer.model").exists():
      fix = f"pass the SentencePiece model {path / 'tokenizer.model'} itself, or a folder with tokenizer.json"
    elif inside:
      fix = f"pass {path / inside[0].rstrip('/')}, the folder that holds tokenizer.json"
    else:
      fix = f"pass {WHAT}"
    raise DataError(spec, f"is not a tokenizer folder: a folder needs tokenizer.json (tokenizer_config.json for the "
                    f"special tokens and the chat template), and this one holds {has}", fix)
  config = {}
  for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config's entries win
    if (path / name).exists():
      try:
        config.update(json.loads((path / name).read_text()))
      except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{spec}/{name}", f"not valid JSON ({str(e)[:100]})", "fix the file") from None
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
    template = {t.get("name"): t.get("template") for t in template}.get("default")
  if (path / "chat_template.jinja").exists():
    template = (path / "chat_template.jinja").read_text()
  try:
    return HFTokenizer(path / "tokenizer.json", (path / "tokenizer.json").read_bytes(), config, template or None)
  except ImportError as e:
    raise DataError(spec, f"needs the '{e.name}' package", f"pip install {e.name}") from None
  except Exception as e:  # the library rejected the file
    raise DataError(f"{spec}/tokenizer.json", f"not a valid tokenizer file ({type(e).__name__}: {str(e)[:120]})",
                    "pass a Hugging Face tokenizer folder") from None

"""Tokenizers by file: byte-level built in, a Hugging Face ``tokenizers`` JSON file, or a SentencePiece model.

``load("")`` / ``load("byte")`` gives the byte tokenizer (UTF-8 bytes, vocab 256). Any other value is a file
path: ``*.json`` is read with ``tokenizers``, anything else with ``sentencepiece``. ``name`` identifies the
tokenizer by kind and content hash, so a manifest can prove which tokenizer made its tokens.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
from etils import epath

from jaxtrain.config import DataError


class ByteTokenizer:
  name, vocab_size = "byte", 256

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
  def __init__(self, path: epath.Path, content: bytes):
    import tokenizers  # optional dependency: pip install tokenizers
    self._tok = tokenizers.Tokenizer.from_str(content.decode("utf-8"))
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.name = f"hf:{path.name}:{hashlib.sha256(content).hexdigest()[:16]}"

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tok.decode(list(map(int, ids)))


class SentencePieceTokenizer:
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
    raise DataError(spec, "tokenizer file not found", "pass an existing tokenizer.json or SentencePiece .model")
  content = path.read_bytes()
  try:
    return HFTokenizer(path, content) if path.suffix == ".json" else SentencePieceTokenizer(path, content)
  except ImportError as e:
    raise DataError(spec, f"needs the '{e.name}' package", f"pip install {e.name}") from None
  except Exception as e:  # the library rejected the file
    raise DataError(spec, f"not a valid tokenizer file ({type(e).__name__}: {str(e)[:120]})",
                    "pass a Hugging Face tokenizer.json or a SentencePiece .model file") from None

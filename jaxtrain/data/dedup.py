"""Where a document goes, and which documents are (near-)duplicates: pure functions of its content and the seed.

Every decision of the preparation (:mod:`jaxtrain.data.prepare`) about a document is a function of its digest
(SHA-256 of its text, or of its messages for SFT records) and the seed, never of the order in which documents
were read or of which worker read them; that is what makes the output the same bytes for any worker count and
any runner:

- :func:`route`: a seeded hash of the digest gives the document's split (eval when a uniform draw from it is
  below ``eval_fraction``), its order key (the global shuffle is the order of the keys) and its bucket (the
  key's range; a bucket is one output shard). Exact duplicates share the digest, hence the bucket, and are
  found there (hash-partitioned: no worker holds every hash).
- :func:`band_keys` / :func:`near_duplicates`: MinHash (``datasketch``) of the document's word n-grams, cut into
  LSH bands (``datasketch.MinHashLSH``'s choice of bands x rows for the threshold); documents that share a band
  are candidates, and in each candidate group every document but the one with the smallest key is removed.
"""

from __future__ import annotations

import functools
import hashlib
import re

import numpy as np

Route = tuple[str, int, int]  # (split, bucket, order key)


def route(digest: bytes, seed: int, eval_fraction: float, buckets: dict[str, int]) -> Route:
  """The split, bucket (of ``buckets[split]``, by the key's range) and order key of a document."""
  h = hashlib.sha256(b"jaxtrain.prepare\0" + seed.to_bytes(8, "little", signed=True) + digest).digest()
  key, draw = int.from_bytes(h[:8], "big"), int.from_bytes(h[8:16], "big") / 2.0**64
  split = "eval" if draw < eval_fraction else "train"
  return split, (key * buckets[split]) >> 64, key


@functools.cache
def _lsh(threshold: float, num_perm: int) -> tuple[int, int, object]:
  """(bands, rows per band, a MinHash whose permutations every signature reuses)."""
  from datasketch import MinHash, MinHashLSH
  lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
  return lsh.b, lsh.r, MinHash(num_perm=num_perm, seed=1)


_WORD = re.compile(r"\w+")


def band_keys(text: str, threshold: float, num_perm: int = 128, ngram: int = 5) -> list[bytes]:
  """The LSH band keys of ``text``'s MinHash signature over its lower-cased word ``ngram``-grams (the whole text
  as one gram when it is shorter): band index + a hash of the band's rows."""
  from datasketch import MinHash
  bands, rows, template = _lsh(threshold, num_perm)
  words = _WORD.findall(text.lower())
  grams = {" ".join(words[i:i + ngram]).encode() for i in range(max(1, len(words) - ngram + 1))}
  signature = MinHash(num_perm=num_perm, permutations=template.permutations, scheme=template.scheme)
  signature.update_batch(list(grams))
  values = np.asarray(signature.hashvalues, np.uint64)
  return [b.to_bytes(2, "little") + hashlib.blake2b(values[b * rows:(b + 1) * rows].tobytes(), digest_size=12)
          .digest() for b in range(bands)]


def near_duplicates(members) -> list[tuple[tuple[str, int], bytes]]:
  """Of one candidate group (documents sharing a band: ``(key, digest, split, bucket)``, exact duplicates
  possibly repeated), the documents to remove: all but the smallest key, as ``((split, bucket), digest)``."""
  distinct = sorted(set(members))  # copies of one document are one tuple: same digest, same route
  return [((split, bucket), digest) for _, digest, split, bucket in distinct[1:]]

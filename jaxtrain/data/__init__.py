"""Input pipelines. Every source yields per-process numpy batches of the form described in
:func:`jaxtrain.data.batch.from_tokens`; :func:`to_global` assembles them into global jax.Arrays."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding


def to_global(local_batch: dict, sharding: NamedSharding) -> dict:
  """This process's rows -> global arrays laid out with ``sharding`` (works on one host and on many)."""
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}

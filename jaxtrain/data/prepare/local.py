"""The in-process runner of the data preparation (:mod:`.algorithm`): this process, or a pool of ``workers``
spawned processes, over the input files (scatter), then over the buckets (gather)."""

from __future__ import annotations

import collections
import functools
import multiprocessing

from tqdm import tqdm

from jaxtrain.data import dedup
from jaxtrain.data.prepare.algorithm import Plan, gather, scatter


def _scatter_file(plan: Plan, index: int) -> list[tuple]:
  return list(scatter(plan, index))


def _gather_bucket(args) -> dict:
  return gather(*args)


def run(plan: Plan) -> list[dict]:
  """Every shard's manifest entry (``opts.workers`` > 1: a process pool over files, then over buckets)."""
  parts, bands = collections.defaultdict(list), collections.defaultdict(list)
  pool = multiprocessing.get_context("spawn").Pool(plan.opts.workers) if plan.opts.workers > 1 else None
  imap = pool.imap if pool else map  # ordered either way
  try:
    with _progress(len(plan.files), plan.opts.progress, "tokenizing", "file") as bar:
      for items in imap(functools.partial(_scatter_file, plan), range(len(plan.files))):
        for kind, key, value in items:
          (parts if kind == "part" else bands)[key].append(value)
        bar.update(1)
    dropped = collections.defaultdict(list)
    for members in bands.values():
      for where, digest in dedup.near_duplicates(members):
        dropped[where].append(digest)
    del bands
    jobs = [(plan, split, bucket, parts[(split, bucket)], dropped[(split, bucket)]) for split, bucket in sorted(parts)]
    with _progress(len(jobs), plan.opts.progress, "writing", "shard") as bar:
      entries = []
      for entry in imap(_gather_bucket, jobs):
        entries.append(entry)
        bar.update(1)
    return entries
  finally:
    if pool:
      pool.terminate()


def _progress(total: int, enabled: bool, desc: str, unit: str):
  return tqdm(total=total, unit=unit, desc=desc, disable=not enabled)

"""The cells of the fault matrix (tests/faults.py ``MATRIX``), run in one process started with tests/faults.py's disk
faults preloaded, against the localhost stores behind fault proxies; each cell's outcome as JSON, for
tests/test_faults.py to check against the table:

    python -m tests.fault_matrix OUT.json [ROW_ID ...]     (with tests.faults.FaultyDisk.environ() in its environment)

A cell builds what a run has at that boundary with the real parts (the Checkpointer and its tiers, ...) over a small
state laid over 8 simulated devices, commits steps 2 and 4, raises the row's fault at the row's moment and catches
what comes out, as ``python -m jaxtrain.main`` would (``jaxtrain.main.known_stop``: the exit code and the one line).
Then the fault is healed and the run restarted: it must resume from the newest step committed, bitwise, with nothing
set aside but a step proven bad. The store clients' back-off between retries is compressed (their retry counts and
what they raise at the end are theirs): a cell takes a fraction of a second, not the ~30 s a client waits.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
# A silent store: TensorStore gives up on a request that moves nothing for this long, gcsfs and s3fs likewise.
os.environ["TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"] = "1"
os.environ["FSSPEC_GCS"] = '{"requests_timeout": 1}'
os.environ["FSSPEC_S3"] = '{"config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}'

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import faulthandler  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import uuid  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from absl import logging  # noqa: E402

from jaxtrain import checkpoint as checkpoint_lib  # noqa: E402
from jaxtrain import exits  # noqa: E402
from jaxtrain import goodput as goodput_lib  # noqa: E402
from jaxtrain import lease as lease_lib  # noqa: E402
from jaxtrain import logs  # noqa: E402
from jaxtrain import metrics as metrics_lib  # noqa: E402
from jaxtrain import paths  # noqa: E402
from jaxtrain import workdir as workdir_lib  # noqa: E402
from jaxtrain import main as main_lib  # noqa: E402
from jaxtrain import restarts  # noqa: E402
from jaxtrain import stores  # noqa: E402
from tests import faults, object_store  # noqa: E402

CELL_TIMEOUT_S = 90


def compress_backoff(factor: float = 0.02) -> None:
  """The clients' sleeps between retries (gcsfs's, s3fs's, aiobotocore's: asyncio.sleep; TensorStore's:
  jaxtrain.stores.RETRIES) last ``factor`` of their length."""
  real = asyncio.sleep

  async def sleep(delay, *args, **kwargs):
    return await real(delay * factor if delay and delay > 0.01 else delay, *args, **kwargs)

  asyncio.sleep = sleep
  stores.RETRIES.update(max_retries=2, initial_delay="0.01s", max_delay="0.04s")
  logs.RETRY_S = (0.05, 0.2)  # the log streams' back-off between failed writes


# -- a run's state in miniature ---------------------------------------------------------------------------------------


def mesh():
  return jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))


def state_at(step: int) -> dict:
  """The state a run has at ``step`` (different at every step; sharded and replicated leaves, as a train state)."""
  m = mesh()
  w = jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32) * 1e-3 + step, NamedSharding(m, P("fsdp")))
  b = jax.device_put(np.full((32,), step, np.float32), NamedSharding(m, P()))
  return {"params": {"w": w, "b": b}, "opt_state": {"mu": w * 0.5}, "step": jax.device_put(np.int32(step),
                                                                                        NamedSharding(m, P()))}


@functools.cache
def abstract() -> dict:
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state_at(0))


def bitwise(a, b) -> bool:
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class Position:
  """A data position (jaxtrain.checkpoint.DataPosition): the number of batches read."""

  def __init__(self, at: int = 0):
    self.at = at

  def get_state(self) -> dict:
    return {"at": self.at}

  def set_state(self, state: dict) -> None:
    self.at = state["at"]

  def resplit(self, saved: list[dict]) -> dict:
    return saved[0]


# -- the cells ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Seen:
  outcome: str  # an OUTCOMES key, "bug" (an unexpected exception), "lost" or "wrong" (see detail)
  line: str = ""  # the one line a run would print
  detail: str = ""


class Context:
  def __init__(self, root: str, servers: dict, proxies: dict):
    self.root, self.servers, self.proxies = root, servers, proxies
    self.seeded: dict = {}  # (where, steps) -> a folder the rows that only read share

  def location(self, row: faults.Row) -> str:
    name = f"{row.boundary.replace(' ', '-')}-{uuid.uuid4().hex[:8]}"
    if row.where == "disk":
      path = os.path.join(self.root, name)
      os.makedirs(path)
      return os.path.join(path, "checkpoints")
    return self.servers[row.where].url(name, "checkpoints")


def _line(e: BaseException) -> tuple[str, str]:
  """``(outcome, line)`` of an exception as ``jaxtrain.main`` ends on it."""
  stop = main_lib.known_stop(e)
  if stop is None:
    return "bug", "".join(traceback.format_exception(e))[-3000:]
  return {2: "exit 2", 3: "exit 3", 75: "exit 75"}.get(stop[0], f"exit {stop[0]}"), stop[1]


def _store_match(row: faults.Row) -> str:
  """The requests of the row's boundary, as the proxy sees them (method, decoded target, the body's head)."""
  write, read = r"^(PUT|POST) ", r"^GET "
  return {
      "save": write + (r"[\s\S]*/6/state/(d/|ocdbt)" if row.fault == "silent" else r"[\s\S]*/6/state/"),
      "commit": write + r"[\s\S]*/6/commit_success\.txt",
      "restore": read + r".*/4/state/",
      "list": r"^GET [^\n]*(/o\?|list-type=2|\?prefix=|&prefix=)",
      "delete": r"^DELETE .*/2/",
  }[row.boundary]


def _disk_rule(row: faults.Row, root: str) -> faults.DiskRule:
  ops = {"eacces": ("open",), "enospc": ("write",)}.get(row.fault)
  return {
      "save": faults.DiskRule(row.fault, f"{root}/6.orbax-checkpoint-tmp", ops or ("write", "sync")),
      "commit": faults.DiskRule(row.fault, f"{root}/6.orbax-checkpoint-tmp", ("rename",)),
      "restore": faults.DiskRule(row.fault, f"{root}/4/state", ops or ("read",)),
      "list": faults.DiskRule(row.fault, root, ("list",)),
      "delete": faults.DiskRule(row.fault, f"{root}/2", ("unlink",)),
  }[row.boundary]


@contextlib.contextmanager
def _fault(row: faults.Row, ctx: Context, root: str):
  fault = faults.FAULTS[row.fault]
  if fault.kind == "http":
    rule = ctx.proxies[row.where].fail(row.fault, _store_match(row), times=row.times, delay_s=0.1)
    try:
      yield rule
    finally:
      ctx.proxies[row.where].heal()
  elif fault.kind == "disk":
    with faults.FaultyDisk.faults([_disk_rule(row, root)]):
      yield None
  elif fault.kind == "device":
    with faults.device_memory(always=True):
      yield None
  else:
    raise ValueError(row)


def _persistent(root: str, keep_last: int = 3) -> checkpoint_lib.PersistentTier:
  return checkpoint_lib.PersistentTier(root, every_steps=2, keep_last=keep_last, async_save=True)


def _save(checkpointer, step: int) -> None:
  checkpointer.save(checkpointer.persistent, step, state_at(step), Position(step), {"step": step}, {}, forced=False)


def _aside(root: str) -> list[str]:
  if "://" in root:
    fs = stores_fs(root)
    return sorted(p.rstrip("/").rsplit("/", 1)[1] for p in fs.ls(root) if "corrupt-" in p)
  return sorted(p for p in os.listdir(root) if p.startswith("corrupt-")) if os.path.isdir(root) else []


def stores_fs(url: str):
  import fsspec
  fs, _ = fsspec.core.url_to_fs(url)
  fs.invalidate_cache()
  return fs


def _seeded(row: faults.Row, ctx: Context) -> str:
  """A checkpoints folder with steps committed: 2 and 4 where the row needs the one before 4 (a fallback from a step
  set aside, retention deleting the oldest), else 4. A row that only reads (a restore or a listing that does not set
  anything aside) shares its folder with the other such rows of its store."""
  steps = (2, 4) if row.expect == "set aside" or row.boundary == "delete" else (4,)
  shared = row.boundary in ("restore", "list") and row.expect != "set aside" and row.moment != "rollback"
  key = (row.where, steps)
  if shared and key in ctx.seeded:
    return ctx.seeded[key]
  root = ctx.location(row)
  first = checkpoint_lib.Checkpointer([_persistent(root)])
  for step in steps:
    _save(first, step)
  first.wait()
  first.close()
  if shared:
    ctx.seeded[key] = root
  return root


def checkpoint_cell(row: faults.Row, ctx: Context) -> Seen:
  """Step 4 committed (and 2, see :func:`_seeded`); then the row's fault while saving step 6 (``save``, ``commit``,
  ``delete``: retention deletes step 2 once 6 is committed) or restoring at start (``restore``, ``list``) or in a
  rollback; then healed, a restart must resume from the newest committed step, bitwise."""
  root = _seeded(row, ctx)
  outcome, line, newest = "resumed", "", 4
  try:
    with _fault(row, ctx, root) if row.moment != "rollback" else contextlib.nullcontext():
      if row.boundary in ("save", "commit", "delete"):
        newest = 6 if row.boundary == "delete" else 4  # a delete fails after step 6 is committed
        run = checkpoint_lib.Checkpointer([_persistent(root, keep_last=2 if row.boundary == "delete" else 3)])
        _save(run, 6)
        run.wait()
        newest = 6
      elif row.moment == "rollback":
        run = checkpoint_lib.Checkpointer([_persistent(root)])
        live = state_at(5)
        with faults.device_memory(headroom_bytes=4096) as failed:  # a chip full with the live state
          state, meta = run.rollback(abstract(), Position(), live=live)
        if meta is None or not bitwise(state, state_at(4)) or failed:
          return Seen("wrong", detail=f"rollback gave step {meta and meta.get('step')}, failed transfers {failed}")
      else:
        run = checkpoint_lib.Checkpointer([_persistent(root)])
        if row.boundary == "list":
          run.steps()
        restored = run.restore(abstract(), Position())
        if restored is None or int(restored[0]["step"]) != 4:
          outcome = "set aside"
  except Exception as e:  # noqa: BLE001 - what the run ends on
    outcome, line = _line(e)
    if outcome == "bug":
      return Seen("bug", detail=line)
  # Healed: a restart resumes from the newest committed step, bitwise; only a step proven bad is set aside.
  restart = checkpoint_lib.Checkpointer([_persistent(root)])
  position = Position()
  restored = restart.restore(abstract(), position)
  restart.close()
  aside = _aside(root)
  expected = newest if outcome == "resumed" or row.boundary == "delete" else 4
  if outcome == "set aside" or aside:
    outcome = "set aside" if aside and all(a.startswith("corrupt-4-") for a in aside) else "wrong"
    expected = 2
  if restored is None or int(restored[0]["step"]) != expected or not bitwise(restored[0], state_at(expected)) \
      or position.at != expected:
    got = None if restored is None else int(restored[0]["step"])
    return Seen("lost", line, f"the restart resumed from step {got}, expected {expected}; set aside: {aside}")
  return Seen(outcome, line, f"resumed from step {expected}; set aside: {aside}")


def local_cell(row: faults.Row, ctx: Context) -> Seen:
  """The persistent tier with steps 2 and 4, the local tier with step 5; the fault while the local tier saves step 6
  or restores at start. The local tier never ends a run: a failed save is counted, an unreadable disk passed over."""
  root = ctx.location(row)
  local_dir = os.path.join(os.path.dirname(root), "local")

  def tiers():
    return [_persistent(root), checkpoint_lib.LocalTier(local_dir, every_steps=1, keep_last=2, owner=root)]

  first = checkpoint_lib.Checkpointer(tiers())
  for step in (2, 4):
    _save(first, step)
  first.wait()
  local = first.tiers[1]
  local.save(5, state_at(5), Position(5), {"step": 5}, {})
  local.wait()
  first.close()
  outcome, line, expected = "resumed", "", 5
  try:
    if row.moment == "async save":
      rule = faults.DiskRule(row.fault, os.path.join(local_dir, ""), ("write", "sync"))
      run = checkpoint_lib.Checkpointer(tiers())
      with faults.FaultyDisk.faults([rule]):
        run.tiers[1].save(6, state_at(6), Position(6), {"step": 6}, {})
        run.tiers[1].wait()
      if run.tiers[1].failures != 1:
        return Seen("wrong", detail=f"local failures counted: {run.tiers[1].failures}")
      run.close()
    else:
      with _fault(row, ctx, root) if row.fault == "device_oom" else faults.FaultyDisk.faults([faults.DiskRule(
          row.fault, os.path.join(local_dir, ""), ("open",) if row.fault == "eacces" else ("read",))]):
        run = checkpoint_lib.Checkpointer(tiers())
        restored = run.restore(abstract(), Position())
      expected = int(restored[0]["step"])
      if expected != 4 or restored[2] != run.persistent.where:
        return Seen("wrong", detail=f"restored step {expected} from {restored[2]}, not the persistent step 4")
      run.close()
  except Exception as e:  # noqa: BLE001
    outcome, line = _line(e)
    if outcome == "bug":
      return Seen("bug", detail=line)
  restart = checkpoint_lib.Checkpointer(tiers())
  position = Position()
  restored = restart.restore(abstract(), position)
  restart.close()
  aside = sorted(p for p in os.listdir(local.directory) if p.startswith("corrupt-"))
  # After a save's fault the local step 5 is there to resume from; after a read's, the run went on from the persistent
  # step 4 (the local step 5, of the timeline it left, deleted), and so does its restart.
  expected = 5 if row.moment == "async save" or outcome != "resumed" else 4
  if restored is None or int(restored[0]["step"]) != expected or not bitwise(restored[0], state_at(expected)) or \
      position.at != expected or aside:
    return Seen("lost", line, f"the restart restored {restored and int(restored[0]['step'])}, expected {expected}; "
                f"set aside: {aside}")
  return Seen(outcome, line, f"the restart resumed from step {expected}")


def budget_cell(row: faults.Row, ctx: Context) -> Seen:
  """The row's fault at every start: each start records its restartable exit as ``jaxtrain.main`` does
  (jaxtrain.restarts), and the start after ``distributed.max_restarts_per_hour`` of them is refused, exit 3."""
  workdir, budget = os.path.join(ctx.root, f"budget-{uuid.uuid4().hex[:8]}"), 2
  root = _seeded(dataclasses.replace(row, every_start=False, expect="exit 75"), ctx)
  lines = []
  for start in range(budget + 2):
    verdict = restarts.check(workdir, budget)
    if verdict is not None:
      outcome, line = _line(exits.RestartsExhausted(verdict))
      break
    restarts.arm(workdir, f"{start:010d}-faults", 0)
    try:
      with _fault(row, ctx, root):
        checkpoint_lib.Checkpointer([_persistent(root)]).restore(abstract(), Position())
      return Seen("wrong", detail=f"start {start} restored despite the fault")
    except exits.Restart as e:
      restarts.record(e.cause, str(e))
      lines.append(_line(e)[1])
  else:
    return Seen("wrong", detail=f"{budget + 2} starts, none refused: {lines}")
  if start != budget + 1 or f"{exits.STORE_UNREACHABLE} x{budget + 1}" not in line:
    return Seen("wrong", line, f"refused at start {start}; restartable exits before: {lines}")
  return Seen(outcome, line, f"refused at start {start}")


def prepare_cell(row: faults.Row, ctx: Context) -> Seen:
  """tools/prepare_data.py's preparation into a store folder, the row's fault on its uploads; healed, it is run again
  and the folder is complete (its manifest names every shard, each there)."""
  from jaxtrain.data import prepare
  text = os.path.join(ctx.root, "prepare-input.txt")
  if not os.path.exists(text):
    with open(text, "w") as f:
      f.write("\n\n".join(f"document {i}: " + "word " * (20 + i % 7) for i in range(200)))
  output = ctx.servers[row.where].url(f"prepared-{uuid.uuid4().hex[:8]}")
  options = prepare.Options(inputs=[text], output=output, progress=False, eval_fraction=0.1)
  outcome, line = "resumed", ""
  proxy = ctx.proxies[row.where]
  proxy.fail(row.fault, r"^(PUT|POST) [\s\S]*prepared-", times=row.times)
  try:
    prepare.prepare(options)
  except Exception as e:  # noqa: BLE001
    outcome, line = _line(e)
    if outcome == "bug":
      return Seen("bug", detail=line)
  finally:
    proxy.heal()
  fs = stores_fs(output)
  if outcome != "resumed":
    if fs.exists(output + "/manifest.json"):
      return Seen("wrong", line, "a failed preparation left a manifest")
    prepare.prepare(dataclasses.replace(options, overwrite=True))
  manifest = json.loads(stores_fs(output).cat_file(output + "/manifest.json"))
  missing = [s["file"] for s in manifest["shards"] if not fs.exists(f"{output}/{s['file']}")]
  if missing:
    return Seen("lost", line, f"the manifest names shards that are not there: {missing}")
  return Seen(outcome, line, f"{len(manifest['shards'])} shards")


def _wait(what: str, done: Callable[[], bool], timeout_s: float = 20.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not done():
    if time.monotonic() > deadline:
      raise TimeoutError(f"waited {timeout_s} s for {what}")
    time.sleep(0.02)


def logs_cell(row: faults.Row, ctx: Context) -> Seen:
  """A run's metrics, train.log or goodput events written through the row's fault: on a store the loop never waits
  (each write returns at once) and, once the store answers again, every line is there, once; on a local disk a
  failed write stops the run by its cause, the lines before it intact."""
  if row.where == "disk":
    workdir = os.path.join(ctx.root, f"logs-{uuid.uuid4().hex[:8]}")
    os.makedirs(workdir)
  else:
    workdir = ctx.servers[row.where].url(f"logs-{uuid.uuid4().hex[:8]}")
  names = {"metrics": "metrics.jsonl", "log": "train.log", "goodput": "goodput"}
  lines, slowest, outcome, line = [], 0.0, "resumed", ""

  def timed(write, *args):
    nonlocal slowest
    t = time.perf_counter()
    write(*args)
    slowest = max(slowest, time.perf_counter() - t)

  @contextlib.contextmanager
  def fault():
    if row.where == "disk":
      with faults.FaultyDisk.faults([faults.DiskRule(row.fault, os.path.join(workdir, names[row.boundary]),
                                                     ("write", "open"))]):
        yield None
      return
    try:
      yield ctx.proxies[row.where].fail(row.fault, names[row.boundary], times=row.times)
    finally:
      ctx.proxies[row.where].heal()

  try:
    if row.boundary == "metrics":
      cfg = metrics_lib.defaults()
      cfg.update(tensorboard=False, progress="log")
      writer = metrics_lib.MetricWriter(workdir, 12, 0, cfg, {})
      record = lambda step: {"loss": 1.0 / step, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1.0,  # noqa: E731
                             "tflops_per_device": 0.1, "step_time": 0.1}
      for step in (1, 2, 3):
        timed(writer.write, step, record(step))
      with fault() as rule:
        for step in (4, 5, 6):
          timed(writer.write, step, record(step))
        if rule is not None:
          _wait("the store's fault", lambda: rule.fired > 0)
      writer.close()
      lines = [r["step"] for r in metrics_lib.read_records(workdir)]
      want = [1, 2, 3, 4, 5, 6]
    elif row.boundary == "goodput":
      recorder = goodput_lib.Recorder(workdir)
      recorder.start()
      timed(recorder.ready, 0, 0.0)
      with fault() as rule:
        for step in (1, 2, 3):
          timed(recorder.progress, step, {"productive": step, "checkpoint": 0.0, "eval": 0.0, "data_wait": 0.0})
        if rule is not None:
          _wait("the store's fault", lambda: rule.fired > 0)
      recorder.end(3)
      lines = [e["event"] for e in goodput_lib.read_events(workdir)]
      want = ["start", "ready", "progress", "progress", "progress", "end"]
    else:  # train.log
      with workdir_lib.LogFile(workdir):
        for i in range(3):
          timed(logging.warning, "line %d before", i)
        with fault() as rule:
          for i in range(3):
            timed(logging.warning, "line %d during", i)
          if rule is not None:
            _wait("the store's fault", lambda: rule.fired > 0)
      text = logs.read(paths.join(workdir, workdir_lib.LOG_FILE))
      lines = re.findall(r"line \d \w+", text)
      want = [f"line {i} {w}" for w in ("before", "during") for i in range(3)]
  except Exception as e:  # noqa: BLE001
    outcome, line = _line(e)
    if outcome == "bug":
      return Seen("bug", detail=line)
    lines = [r["step"] for r in metrics_lib.read_records(workdir)]  # (a local metrics file: the lines before)
    want = [1, 2, 3]
  if lines != want:
    return Seen("lost", line, f"read back {lines}, expected {want}")
  if slowest > 0.5:
    return Seen("wrong", line, f"a write held the loop for {slowest:.2f} s")
  return Seen(outcome, line, f"{len(lines)} lines; the slowest write {slowest * 1e3:.0f} ms")


def _prepared(ctx: Context, where: str) -> str:
  """A prepared dataset on the ``where`` store (made once)."""
  from jaxtrain.data import prepare
  key = ("prepared", where)
  if key not in ctx.seeded:
    text = os.path.join(ctx.root, "shards-input.txt")
    with open(text, "w") as f:
      f.write("\n\n".join(f"document {i}: " + "word " * (30 + i % 11) for i in range(300)))
    ctx.seeded[key] = ctx.servers[where].url(f"data-{uuid.uuid4().hex[:8]}")
    prepare.prepare(prepare.Options(inputs=[text], output=ctx.seeded[key], progress=False, eval_fraction=0.1))
  return ctx.seeded[key]


def shards_cell(row: faults.Row, ctx: Context) -> Seen:
  """A run's data on a store: its shards copied to this host (``shard cache``: the copy's local disk) through the
  row's fault, at the run's start; then healed, the run reads the batches a run without the fault reads."""
  from jaxtrain import data as data_lib
  from jaxtrain.config import base_config
  from jaxtrain.data import shard_cache
  url = _prepared(ctx, "gs" if row.where == "disk" else row.where)
  config = base_config()
  config.data.update(path=url, seq_len=64)
  config.train.global_batch_size = 8

  def batches(n=3):
    os.environ[shard_cache.ENV] = os.path.join(ctx.root, f"cache-{uuid.uuid4().hex[:8]}")
    it = data_lib.open_train(config)
    try:
      return [next(it)["inputs"] for _ in range(n)]
    finally:
      data_lib.close(it)

  outcome, line, got = "resumed", "", None
  try:
    if row.where == "disk":
      with faults.FaultyDisk.faults([faults.DiskRule(row.fault, os.path.join(ctx.root, "cache-"), ("write",))]):
        got = batches()
    else:
      ctx.proxies[row.where].fail(row.fault, r"^GET .*\.array_record", times=row.times)
      try:
        got = batches()
      finally:
        ctx.proxies[row.where].heal()
  except Exception as e:  # noqa: BLE001
    outcome, line = _line(e)
    if outcome == "bug":
      return Seen("bug", detail=line)
  reference = batches()
  if got is not None and not all(np.array_equal(a, b) for a, b in zip(got, reference)):
    return Seen("wrong", line, "the batches read through the fault differ from those read without it")
  return Seen(outcome, line, f"{len(reference)} batches read after the fault")


def _hf_folder(folder: str) -> str:
  """A one-layer Llama as a Hugging Face folder (config.json, a tokenizer.json and safetensors, made with numpy)."""
  from safetensors.numpy import save_file
  os.makedirs(folder, exist_ok=True)
  d, f, v, heads, kv, hd = 16, 32, 64, 2, 1, 8
  with open(os.path.join(folder, "config.json"), "w") as out:
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d, "intermediate_size": f,
               "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 1, "vocab_size": v,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
               "tie_word_embeddings": False, "head_dim": hd, "torch_dtype": "float32"}, out)
  with open(os.path.join(folder, "tokenizer.json"), "w") as out:  # (an export carries its tokenizer, or refuses)
    out.write('{"model": {"type": "BPE"}}')
  r = np.random.default_rng(0)
  normal = lambda *shape: r.normal(size=shape).astype(np.float32)  # noqa: E731
  p = "model.layers.0."
  save_file({"model.embed_tokens.weight": normal(v, d), p + "self_attn.q_proj.weight": normal(heads * hd, d),
             p + "self_attn.k_proj.weight": normal(kv * hd, d), p + "self_attn.v_proj.weight": normal(kv * hd, d),
             p + "self_attn.o_proj.weight": normal(d, heads * hd), p + "mlp.gate_proj.weight": normal(f, d),
             p + "mlp.up_proj.weight": normal(f, d), p + "mlp.down_proj.weight": normal(d, f),
             p + "input_layernorm.weight": np.ones(d, np.float32),
             p + "post_attention_layernorm.weight": np.ones(d, np.float32), "model.norm.weight": np.ones(d, np.float32),
             "lm_head.weight": normal(v, d)}, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  return folder


def hf_cell(row: faults.Row, ctx: Context) -> Seen:
  """A Hugging Face import from a store folder, or an export to one, through the row's fault; healed, the same
  command gives the whole output (an export's folder has its config.json and no unfinished marker)."""
  from jaxtrain import hf
  if "hf" not in ctx.seeded:
    local = _hf_folder(os.path.join(ctx.root, "hf-local"))
    imported = os.path.join(ctx.root, "hf-imported")
    hf.import_model(local, imported)
    remote = ctx.servers["gs"].url("hf-src")
    stores_fs(remote).put(local + "/", remote.removeprefix("gs://"), recursive=True)
    ctx.seeded["hf"] = (imported, remote)
  imported, remote = ctx.seeded["hf"]
  if row.boundary == "hf import":
    command = lambda: hf.import_model(remote, os.path.join(ctx.root, f"hf-{uuid.uuid4().hex[:8]}"))  # noqa: E731
    match, output = r"^GET .*hf-src", None
  else:
    output = ctx.servers[row.where].url(f"hf-export-{uuid.uuid4().hex[:8]}")
    command = lambda: hf.export_model(imported, output)  # noqa: E731
    match = r"^(PUT|POST) [\s\S]*hf-export"
  outcome, line = "resumed", ""
  ctx.proxies[row.where].fail(row.fault, match, times=row.times)
  try:
    command()
  except Exception as e:  # noqa: BLE001
    outcome, line = _line(e)
    if outcome == "bug":
      return Seen("bug", detail=line)
  finally:
    ctx.proxies[row.where].heal()
  if outcome != "resumed":
    command()  # the same command, the store healed
  if output is not None:
    names = sorted(p.rsplit("/", 1)[-1] for p in stores_fs(output).ls(output))
    if "config.json" not in names or hf.UNFINISHED in names:
      return Seen("lost", line, f"the export's folder holds {names}")
  return Seen(outcome, line, "the command done once the store answered")


def harness_cell(row: faults.Row, ctx: Context) -> Seen:
  """The in-run harness (a run's eval.harness_tasks: jaxtrain.evaluation.harness on the live params) scoring a local
  multiple-choice task through the row's fault: its data's disk failing a read, the device out of memory; then, the
  fault gone, the same evaluation scores."""
  from jaxtrain.config import base_config
  from jaxtrain.evaluation import harness
  from jaxtrain.train import trainer
  from tests import harness_data
  if "harness" not in ctx.seeded:
    c = base_config()
    c.workdir = os.path.join(ctx.root, "harness-run")
    c.model.update(num_layers=1, d_model=32, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64, vocab_size=256)
    c.data.update(seq_len=64, source="synthetic")
    c.train.global_batch_size = 8
    run = trainer.build(c)
    state = trainer.init_state(run)
    lm = harness.JaxtrainLM(run.model, run.mesh, run.rules, run.state_shardings.params, harness.text_of(run.config),
                            params=state.params, batch_size=8, max_length=64)
    ctx.seeded["harness"] = lm
  lm = ctx.seeded["harness"]
  tasks = harness_data.write_tasks(pathlib.Path(ctx.root) / f"tasks-{uuid.uuid4().hex[:8]}")
  manager = harness.task_manager(str(tasks), ["jt_mc"])
  evaluate = lambda: harness.evaluate(lm, ["jt_mc"], manager=manager, bootstrap_iters=0,  # noqa: E731
                                      log_samples=False)
  outcome, line = "resumed", ""
  try:
    if row.fault == "device_oom":
      with faults.device_memory(always=True):
        evaluate()
    else:
      with faults.FaultyDisk.faults([faults.DiskRule(row.fault, str(tasks / "mc.jsonl"), ("read",))]):
        evaluate()
  except Exception as e:  # noqa: BLE001
    outcome, line = _line(e)
    if outcome == "bug":
      return Seen("bug", detail=line)
  scores = harness.metrics(evaluate())
  if "harness/jt_mc/acc" not in scores:
    return Seen("wrong", line, f"scores after the fault: {scores}")
  return Seen(outcome, line, f"scored after the fault: acc {scores['harness/jt_mc/acc']:.3f}")


LEASE_S = 2.0  # the cells' leases (renewed every half second): a restart after a loss waits about this long


def lease_cell(row: faults.Row, ctx: Context) -> Seen:
  """The workdir's lease on a store. ``lease take``: a run starting through the row's fault. ``lease renew``: a
  holder renewing through it (a store's fault), or a contender whose clock is off trying to take a live holder's
  lease (a clock fault); the holder trains on (its fence passes) unless it cannot renew before its lease ends: then
  it stops (lease lost) and its restart, the store answering again, takes the workdir over."""
  workdir = ctx.servers[row.where].url(f"lease-{uuid.uuid4().hex[:8]}")
  lock = lambda: workdir_lib.WorkdirLock(workdir, renew_s=LEASE_S / 4, lease_s=LEASE_S)  # noqa: E731
  proxy, outcome, line, holder = ctx.proxies[row.where], "resumed", "", None
  try:
    if row.boundary == "lease take":
      proxy.fail(row.fault, r"run\.lock", times=row.times)
      try:
        holder = lock().acquire()
      finally:
        proxy.heal()
    elif faults.FAULTS[row.fault].kind == "clock":
      holder = lock().acquire()
      with faults.clock_offset(faults.FAULTS[row.fault].offset_s, lease_lib):
        try:
          lock().acquire().release()
          return Seen("wrong", detail="a contender with its clock off took a live holder's lease")
        except workdir_lib.WorkdirBusy:
          pass
      holder.fence()
    else:
      holder = lock().acquire()
      rule = proxy.fail(row.fault, r"run\.lock", times=row.times)
      try:
        deadline = time.monotonic() + 1.5 * LEASE_S
        while time.monotonic() < deadline:  # the loop's fence at every step, longer than a lease
          holder.fence()
          time.sleep(0.05)
        if rule.fired == 0:
          return Seen("wrong", detail="no renewal met the fault")
      except exits.Restart:
        # As the process's exit: nothing renews after it. (Its renewal in flight may land once the store answers: the
        # restart then watches a whole lease go unrenewed before it takes over, as after a holder that died.)
        renewing = holder._thread  # pylint: disable=protected-access
        holder.release()
        proxy.heal()
        if renewing is not None:
          renewing.join(10)
        holder = None
        raise
      finally:
        proxy.heal()
  except Exception as e:  # noqa: BLE001
    outcome, line = _line(e)
    if outcome == "bug":
      return Seen("bug", detail=line)
  if outcome == "resumed":
    holder.release()
  restart = lock().acquire()  # (after a loss: the lease taken over once unrenewed for a whole lease)
  restart.fence()
  restart.release()
  return Seen(outcome, line, "the restart holds the workdir")


def run_cell(row: faults.Row, ctx: Context) -> Seen:
  if row.boundary in ("lease take", "lease renew"):
    return lease_cell(row, ctx)
  if row.boundary == "harness":
    return harness_cell(row, ctx)
  if row.boundary in ("hf import", "hf export"):
    return hf_cell(row, ctx)
  if row.boundary in ("shard read", "shard cache"):
    return shards_cell(row, ctx)
  if row.boundary in ("metrics", "log", "goodput"):
    return logs_cell(row, ctx)
  if row.every_start:
    return budget_cell(row, ctx)
  if row.boundary == "local tier":
    return local_cell(row, ctx)
  if row.boundary == "prepare upload":
    return prepare_cell(row, ctx)
  return checkpoint_cell(row, ctx)


# -- the process -------------------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
  out, wanted = argv[0], set(argv[1:])
  rows = [r for r in faults.MATRIX if not wanted or r.id in wanted]
  if not faults.FaultyDisk.loaded() and any(faults.FAULTS[r.fault].kind == "disk" for r in rows):
    raise SystemExit("start this with tests.faults.FaultyDisk.environ() in its environment")
  compress_backoff()
  checkpoint_lib.quiet_libraries()
  abstract()  # (made once, before any device is out of memory)
  results: dict[str, dict] = {}

  def write():
    with open(out + ".tmp", "w") as f:
      json.dump(results, f, indent=1)
    os.replace(out + ".tmp", out)

  current = {}

  def watch():  # a cell that outlasts its bound ends the process with what it was doing
    while True:
      time.sleep(1)
      if current and time.monotonic() - current["since"] > CELL_TIMEOUT_S:
        results[current["id"]] = dataclasses.asdict(Seen("timeout", detail=f"over {CELL_TIMEOUT_S} s"))
        write()
        print(f"fault_matrix: {current['id']} ran over {CELL_TIMEOUT_S} s; its threads:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

  threading.Thread(target=watch, daemon=True).start()
  with tempfile.TemporaryDirectory(prefix="fault-matrix-") as root, \
       object_store.serve("gs", set_environ=False) as gs, object_store.serve("s3", set_environ=False) as s3, \
       faults.FaultyStore(gs) as gs_proxy, faults.FaultyStore(s3) as s3_proxy, gs_proxy.use(), s3_proxy.use():
    ctx = Context(root, {"gs": gs, "s3": s3}, {"gs": gs_proxy, "s3": s3_proxy})
    for row in rows:
      current.update(id=row.id, since=time.monotonic())
      t = time.perf_counter()
      try:
        seen = run_cell(row, ctx)
      except Exception:  # noqa: BLE001 - the matrix's own failure, reported as the cell's
        seen = Seen("bug", detail=traceback.format_exc()[-3000:])
      results[row.id] = {**dataclasses.asdict(seen), "seconds": round(time.perf_counter() - t, 2)}
      write()
      current.clear()
  write()
  return 0


if __name__ == "__main__":
  code = main(sys.argv[1:])
  sys.stdout.flush()
  sys.stderr.flush()
  # As jaxtrain.main after a failed save: Orbax's signalling threads of the saves the faults failed are no daemons
  # and would hold up a normal exit.
  os._exit(code)

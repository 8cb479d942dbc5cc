"""A fault drill: one training run on an object-store workdir that meets faults drawn from the fault matrix
(tests/faults.py ``MATRIX``, seeded), restarted after every exit as a scheduler would, checked against the same run
without faults: the final loss and every saved tensor bitwise, and the goodput account naming each interruption's
cause.

  python tools/fault_drill.py [--steps=300] [--faults=10] [--seed=0] [--out=benchmarks/results/fault_drill.json]

The run is ``python -m jaxtrain.main`` (configs/tiny.py, 2 layers, 8 rows of 64 tokens, 2 simulated devices) with its
workdir, checkpoints and prepared data on a GCS server on localhost (tests/object_store.py, the test extra), reached
through tests/faults.py's ``FaultyStore``: the faults are the store's real answers (403, 429, 503, resets, silence),
with the clients' own retries and timeouts. Each drawn row is raised where it belongs:

- a checkpoint's save, commit or retention delete: on that step's requests, from the start (the run reaches it);
- a start's listing, restore, lease or data: the run is stopped (SIGTERM, a preemption) once a step is committed,
  and its restart meets the fault;
- metrics, train.log, goodput and the lease's renewals: for a few seconds while the run trains.

After an exit the fault is gone (the store answers again, the user fixed the permission) and the same command runs
again, up to a bound. Prints a table of the drill and writes JSON.
"""

from __future__ import annotations

import os

import _bench  # tools/ is on sys.path when a script runs

_bench.setup(devices=2)

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import fsspec  # noqa: E402
from absl import app, flags  # noqa: E402

from tests import faults, object_store  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps.")
_FAULTS = flags.DEFINE_integer("faults", 10, "Faults drawn from the matrix.")
_SEED = flags.DEFINE_integer("seed", 0, "Which faults, and when.")
_EVERY = flags.DEFINE_integer("every", 25, "checkpoint.every_steps.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/fault_drill.json", "Where the JSON goes.")
_MAX_STARTS = flags.DEFINE_integer("max_starts", 40, "Give up after this many starts.")

BASE = ["--config=configs/tiny.py", "--config.model.num_layers=2", "--config.train.global_batch_size=8",
        "--config.data.seq_len=64", "--config.train.log_every=5", "--config.metrics.tensorboard=False",
        "--config.distributed.max_restarts_per_hour=0", "--config.workdir_lease_s=8"]
SAVED = ("save", "commit")  # raised on a step's requests
AT_START = ("restore", "list", "lease take", "shard read")  # raised at a restart
WHILE_TRAINING = ("metrics", "log", "goodput", "lease renew")  # raised for a while as the run trains


@dataclasses.dataclass
class Drawn:
  row: faults.Row
  step: int  # the checkpoint step it concerns, or after which it is raised
  rule: faults.Rule | None = None
  restores: int = 0  # a restore's fault: the step the start restores (its reads alone fail)
  done: bool = False
  met: list = dataclasses.field(default_factory=list)  # (start, its exit code) of the starts that met it


LEASE_S = 8  # the drill's workdir_lease_s: a store silent for longer than this costs the run its lease


def _pattern(d: Drawn) -> str:
  """The requests ``d`` fails (the proxy matches ``METHOD target`` and the body's head)."""
  write = r"^(PUT|POST) [\s\S]*"
  return {
      "save": write + rf"/checkpoints/{d.step}/state/",
      "commit": write + rf"/checkpoints/{d.step}/commit_success\.txt",
      "restore": rf"^GET .*/checkpoints/{d.restores}/state/",
      "list": r"^GET [^\n]*(/o\?|list-type=2)[^\n]*checkpoints",
      "lease take": r"run\.lock", "lease renew": r"run\.lock",
      "shard read": r"^GET .*\.array_record",
      "metrics": r"metrics\.jsonl", "log": r"train\.log", "goodput": r"goodput/",
  }[d.row.boundary]


def _lasts(d: Drawn) -> float:
  """How long a fault raised while the run trains lasts (one with a count lasts its count)."""
  return 1.5 * LEASE_S if d.row.boundary == "lease renew" and d.row.fault == "silent" else 3.0


def draw(n: int, seed: int, steps: int, every: int) -> list[Drawn]:
  """``n`` of the matrix's rows on gs:// that a training run meets (the store's answers: the drill's disks are the
  store's), each at a checkpoint step of its own, in order."""
  rows = [r for r in faults.MATRIX if r.where == "gs" and not r.every_start and faults.FAULTS[r.fault].kind == "http"
          and r.fault != "slow" and r.boundary in SAVED + AT_START + WHILE_TRAINING]
  rng = random.Random(seed)
  picked = rng.sample(rows, n)
  at = sorted(rng.sample(range(every, steps, every), n))
  return [Drawn(row, step) for row, step in zip(picked, at)]


def committed(fs, checkpoints: str) -> list[int]:
  fs.invalidate_cache()
  try:
    found = fs.glob(checkpoints.removeprefix("gs://") + "/*/commit_success.txt")
  except FileNotFoundError:
    return []
  return sorted(int(p.split("/")[-2]) for p in found if p.split("/")[-2].isdigit())


def start(workdir: str, data: str, env: dict, log: pathlib.Path) -> subprocess.Popen:
  """The run, its data prepared on the store (``data``: the bundled corpus's cache) and copied to a host cache of its
  own (each start reads the shards from the store)."""
  env = {**env, "JAXTRAIN_SHARD_CACHE": str(log.with_suffix(".shards"))}
  return subprocess.Popen([sys.executable, "-m", "jaxtrain.main", *BASE, f"--config.workdir={workdir}",
                           f"--config.train.steps={_STEPS.value}", f"--config.checkpoint.every_steps={_EVERY.value}",
                           f"--config.data.cache_dir={data}"],
                          cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def last_line(log: pathlib.Path) -> str:
  lines = [line for line in log.read_text().splitlines() if line.startswith("jaxtrain:")]
  return lines[-1] if lines else ""


def final(workdir: str) -> tuple[float, dict]:
  """The loss logged at the last step, and the fingerprints of the last checkpoint."""
  from jaxtrain import metrics
  records = metrics.read_records(workdir)
  loss = [r["loss"] for r in records if r["step"] == _STEPS.value and "loss" in r][-1]
  fs, _ = fsspec.core.url_to_fs(workdir)
  fs.invalidate_cache()
  meta = json.loads(fs.cat_file(f"{workdir}/checkpoints/{_STEPS.value}/meta/metadata"))
  return loss, meta["fingerprints"]


def main(argv):
  del argv
  every, steps = _EVERY.value, _STEPS.value
  slots = len(range(every, steps, every)) if every > 0 else 0
  if not 0 < _FAULTS.value <= slots:
    print(f"fault_drill: error: --faults={_FAULTS.value} needs a checkpoint step of its own for each fault, and "
          f"--steps={steps} with --every={every} has {slots}: ask for 1 to {slots} faults, or more steps",
          file=sys.stderr)
    sys.exit(2)
  drawn = draw(_FAULTS.value, _SEED.value, steps, every)
  with tempfile.TemporaryDirectory(prefix="fault-drill-") as tmp, object_store.serve("gs") as gs, \
       faults.FaultyStore(gs) as proxy:
    tmp = pathlib.Path(tmp)
    env = {**os.environ, **proxy.env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": str(tmp / "xla-cache")}
    fs = fsspec.filesystem("gs", endpoint_url=gs.endpoint)

    # The run without faults.
    t = time.time()
    reference = gs.url("reference/run")
    data = gs.url("data-cache")
    p = start(reference, data, env, tmp / "reference.log")
    assert p.wait() == 0, (tmp / "reference.log").read_text()[-3000:]
    reference_s = time.time() - t
    want_loss, want_fingerprints = final(reference)

    # The run with them, restarted after every exit until it ends.
    workdir = gs.url("drill/run")
    checkpoints = workdir + "/checkpoints"
    for d in drawn:
      if d.row.boundary in SAVED:
        d.rule = proxy.fail(d.row.fault, _pattern(d), times=d.row.times)
    exits, t, at_start = [], time.time(), None  # at_start: the fault the next start meets
    for n in range(_MAX_STARTS.value):
      if at_start is not None:
        at_start.restores = (committed(fs, checkpoints) or [0])[-1]
        at_start.rule = proxy.fail(at_start.row.fault, _pattern(at_start), times=at_start.row.times)
      log = tmp / f"run-{n}.log"
      fired = {id(d): d.rule.fired for d in drawn if d.rule is not None}
      p = start(workdir, data, env, log)
      stopping = None
      while p.poll() is None:
        time.sleep(0.25)
        newest = (committed(fs, checkpoints) or [0])[-1]
        for d in drawn:  # the next fault due, one at a time; none after this start was told to stop
          if stopping is not None:
            break
          if d.done or d.rule is not None or d.step > newest or d is at_start:
            continue
          if d.row.boundary in AT_START:
            stopping = d
            p.send_signal(signal.SIGTERM)  # a preemption: the next start meets the fault
          elif d.row.boundary in WHILE_TRAINING:
            d.rule = proxy.fail(d.row.fault, _pattern(d), times=d.row.times)
            fired[id(d)] = 0
            if d.row.times is None:
              end = time.monotonic() + _lasts(d)
              while p.poll() is None and time.monotonic() < end:
                time.sleep(0.1)
              proxy.drop(d.rule)
            break
      code = p.returncode
      exits.append({"start": n, "code": code, "line": last_line(log)[:400]})
      # The faults this start met; once met, a fault is gone for the next start (the store answers again, the
      # permission is fixed), but one with a count that it has not spent stays.
      for d in drawn:
        if d.rule is not None and d.rule.fired > fired.get(id(d), 0):
          d.met.append((n, code))
        if d.rule is not None and (d.rule.fired and (d.row.times is None or d.rule.fired >= d.row.times)
                                   or d.row.boundary in WHILE_TRAINING or d is at_start):
          proxy.drop(d.rule)
          d.done = True
      at_start = stopping
      if code == 0 and at_start is None:
        break
    else:
      raise SystemExit(f"the run did not end within {_MAX_STARTS.value} starts: {exits}")
    drill_s = time.time() - t

    got_loss, got_fingerprints = final(workdir)
    fs.invalidate_cache()
    aside = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(checkpoints.removeprefix("gs://"))
                   if "/corrupt-" in p)  # the steps proven bad (a file of theirs missing), kept for inspection
    account = json.loads(fs.cat_file(workdir.removeprefix("gs://") + "/goodput.json"))

  # Each exit's cause, as the run named it (goodput's words), in order: the account must name the same.
  def cause(e):
    if e["code"] == 0:
      return None
    found = re.match(r"jaxtrain: stopped: (preempted|store unreachable|storage I/O|lease lost|lost peer|hang)", e["line"])
    return found.group(1) if found else "user error" if e["code"] == 2 else f"exit {e['code']}"
  # A start that could not take the workdir's lease wrote nothing into it (not holding it, it must not): the account
  # names the interruptions of the runs that held it.
  said = [c for e in exits if (c := cause(e)) is not None and "taking the workdir's lease" not in e["line"]]
  named = [i["cause"] for i in account["interruptions"]]
  results = {
      "steps": steps, "faults": [{"row": d.row.id, "expect": d.row.expect, "step": d.step, "met": d.met}
                                 for d in drawn],
      "starts": len(exits), "exits": exits, "reference_s": round(reference_s, 1), "drill_s": round(drill_s, 1),
      "causes_said": said, "causes_in_goodput": named, "goodput_names_each_cause": said == named,
      "set_aside": aside, "final_loss": got_loss, "reference_final_loss": want_loss, "bitwise_loss": got_loss == want_loss,
      "bitwise_state": got_fingerprints == want_fingerprints,
      "goodput": {k: account[k] for k in ("goodput", "runs", "steps_trained_again", "interruptions",
                                          "interrupted_by")},
  }
  print(f"{'row':52} {'step':>5} {'expected':>9}  met at (start, its exit)")
  for d in drawn:
    print(f"{d.row.id:52} {d.step:5d} {d.row.expect:>9}  {d.met}")
  print(f"\n{len(exits)} starts, exit codes {[e['code'] for e in exits]}; causes said {said}, named by goodput "
        f"{named}")
  print(f"steps set aside: {aside}")
  print(f"final loss {got_loss!r} (uninterrupted: {want_loss!r}): bitwise {got_loss == want_loss}; every saved "
        f"tensor of step {steps} bitwise: {got_fingerprints == want_fingerprints}")
  print(f"goodput: {account['goodput']:.3f} over {account['runs']} runs; interrupted by {account['interrupted_by']}")
  print("wrote", _bench.write_json(_OUT.value, results))
  if not (results["bitwise_loss"] and results["bitwise_state"] and results["goodput_names_each_cause"]):
    raise SystemExit("the drill's run does not end as the uninterrupted one, or goodput does not name its causes")


if __name__ == "__main__":
  app.run(main)

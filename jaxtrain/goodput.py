"""Goodput: how much of a workdir's wall time, over all its runs and restarts, went into training that was kept.

Process 0 records a few events per run (:class:`Recorder`): the process's start, the loop's start (after compile
and restore), its progress at every logged step and checkpoint, each NaN rollback, and its end. Each run's events go
to ``<workdir>/goodput/``: appended to ``<run>-00000.jsonl`` on a local disk (a kill loses at most the event being
written); on an object store, which cannot append, as the segments of a :class:`jaxtrain.logs.Stream`
(``<run>.<first>-<last>.jsonl``), written by a thread at most once a second, so that an event costs the same bytes
at every step and the loop never waits for the store (a kill loses the events of the last second). Earlier versions
wrote a run's events whole, up to 1,000 per object (``<run>-<part>.jsonl``), and before that to
``<workdir>/goodput.jsonl``: both still read. :func:`account` turns every run's events into one account:

- ``productive``: the loop's time of steps whose update was kept (the loop's time less the parts below);
- ``startup``: from the process's start to the loop's (imports, joining the job, compile, init), less restore;
- ``restore``: reading the checkpoint a run resumed from;
- ``checkpoint``: the loop blocked by saves;
- ``eval``: evaluations and samples;
- ``data_wait``: the loop waiting for batches;
- ``lost``: the productive time of steps thrown away and trained again: those after the checkpoint a later run
  resumed from, and those after the checkpoint a NaN rollback went back to (its restore included);
- ``down``: from a run's last event to the next run's start (a crash's last seconds, the scheduler's delay);
- ``other``: the rest of the loop's time (logging, the end of a run).

The parts add up to the wall time from the first start to the last event. ``goodput.json`` holds the account
(rewritten at the end of every run), ``tools/goodput.py WORKDIR`` prints and plots it.

Google's ml-goodput-measurement (MaxText's) keeps the same kind of events, but records them in Google Cloud
Logging and computes from there: it needs a Cloud project with billing, so it cannot run here or on a Slurm
cluster. Its categories map onto these: program startup and training prep -> ``startup``, data loading ->
``data_wait``, unproductive checkpoint save / restore -> ``checkpoint`` / ``restore``, wasted progress from
disruption -> ``lost``, and the time between a failure and the restart -> ``down``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import time
from typing import Callable

import jax
from absl import logging
from etils import epath

from jaxtrain import logs, paths, restarts

FOLDER = "goodput"  # <workdir>/goodput/: each run's events (<run>-<part>.jsonl, or a store's segments)
LEGACY_EVENTS = "goodput.jsonl"  # the events of runs recorded by earlier versions (appended to one file)
SUMMARY = "goodput.json"
PARTS = ("productive", "startup", "restore", "checkpoint", "eval", "data_wait", "lost", "down", "other")
LOOP_PARTS = ("productive", "checkpoint", "eval", "data_wait")  # what progress events count (cumulative seconds)
KILLED = "killed"  # the cause of a run that ended without a word (SIGKILL, an OOM kill, a lost host)
_IMPORTED = time.time()
_runs_in_this_process = [0]
_recorders = itertools.count()


def process_start_time() -> float:
  """When this process started (Unix time, to the kernel's clock tick), else when this module was imported."""
  try:
    stat = epath.Path("/proc/self/stat").read_text()
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: start time, in clock ticks since boot
    since = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since
  except (OSError, ValueError, IndexError, AttributeError):  # not Linux
    return _IMPORTED


class Recorder:
  """Records this run's events under ``<workdir>/goodput/`` (process 0; a no-op on the others).

  ``clock``: the time of every event, the start included (Unix seconds; tests pass a fake one). By default the
  wall clock, and a process's first run starts at the process's start."""

  def __init__(self, workdir: str, clock: Callable[[], float] | None = None):
    self.workdir, self.clock = workdir, clock
    self.folder = epath.Path(workdir) / FOLDER if jax.process_index() == 0 else None
    # Names this run's objects: its time (ms), process and recorder, as a sort key and to be unique.
    self.run = f"{int(1000 * (clock or time.time)()):013d}-{os.getpid()}-{next(_recorders)}"
    self.stream = None  # an object store's events (a jaxtrain.logs.Stream)
    if self.folder is not None and paths.is_url(os.fspath(workdir)):
      self.stream = logs.Stream(os.fspath(self.folder), "goodput events", ".jsonl", run=self.run)
    self.made = False  # the local folder
    self.unwritten = ""  # local events whose write failed: written with the next
    self.failed = False  # a local write failed (warned once)
    self.ended = False

  def _write(self, event: str, t: float | None = None, **fields) -> None:
    """Adds the event to this run's: appended to its local file, or handed to the store's stream (which writes it in
    the background, warns of an outage once and never raises)."""
    if self.folder is None:
      return
    line = json.dumps({"event": event, "t": (self.clock or time.time)() if t is None else t, **fields}) + "\n"
    if self.stream is not None:
      self.stream.write(line)
    else:
      self._stored(lambda: self._append(line), "write events to")

  def _append(self, line: str) -> None:
    self.unwritten += line
    if not self.made:
      self.folder.mkdir(parents=True, exist_ok=True)
      self.made = True
    with (self.folder / f"{self.run}-00000.jsonl").open("a") as f:
      f.write(self.unwritten)
    self.unwritten = ""

  def start(self) -> None:
    """The run starts: at the process's start for its first run, now for a later one in the same process. From now
    on a restartable exit of this process that does not end the loop (a hang, a lost peer: they exit at once) is
    recorded as this run's interruption, with its cause (:func:`jaxtrain.restarts.listen`)."""
    first = _runs_in_this_process[0] == 0
    _runs_in_this_process[0] += 1
    restarts.listen(self.stopped)
    if self.clock is not None:
      self._write("start", t=self.clock())
    else:
      self._write("start", t=process_start_time() if first else time.time())

  def ready(self, step: int, restore_s: float) -> None:
    """The loop starts at ``step`` (a resumed one, or 0), after ``restore_s`` seconds of reading its checkpoint."""
    self._write("ready", step=step, restore_s=restore_s)

  def progress(self, step: int, spent: dict[str, float]) -> None:
    """Up to ``step``, the loop spent ``spent`` (cumulative seconds: productive, checkpoint, eval, data_wait)."""
    self._write("progress", step=step, **spent)

  def rollback(self, reached: int, step: int, spent: dict[str, float]) -> None:
    """A NaN rollback: the loop, at step ``reached`` having spent ``spent`` (as :meth:`progress`), went back to
    the checkpoint of ``step`` (restored): the steps after it are trained again."""
    self._write("rollback", step=step, reached=reached, **spent)

  def stopped(self, cause: str, detail: str = "") -> None:
    """The process exits restartably (``cause``, one of :data:`jaxtrain.exits.CAUSES`) without ending the loop."""
    self._write("stop", cause=cause, detail=detail[:300])

  def end(self, step: int | None, cause: str | None = None, summarize: bool = True) -> dict | None:
    """The loop ended at ``step`` (None: before it started; ``cause``: why it stopped before ``train.steps``, e.g. one of
    :data:`jaxtrain.exits.CAUSES`; None: it reached them); rewrites ``goodput.json`` (unless not ``summarize``) and
    returns the account (None: not recorded)."""
    if self.ended:  # (a start's end after its loop's: the loop's stands)
      return None
    self.ended = True
    restarts.unlisten(self.stopped)
    self._write("end", **({"step": step} if step is not None else {}), **({"cause": cause} if cause else {}))
    if self.folder is None:
      return None
    if not summarize:
      if self.stream is not None:
        self.stream.close()
      return None
    if self.stream is not None:
      self.stream.close()  # every event in the store (or warned about), before the account reads them back
    events = self._stored(lambda: read_events(self.workdir), "read the events of")
    if events is None:
      return None
    summary = account(events)
    self._stored(lambda: (epath.Path(self.workdir) / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n"),
                 f"write {SUMMARY} in")
    return summary

  def _stored(self, action, what: str):
    """``action()``'s result, or None if the storage failed: warned about once (accounting never ends a run)."""
    try:
      return action()
    except Exception as e:  # noqa: BLE001 - each storage backend raises its own
      if not self.failed:
        logging.warning("goodput: could not %s %s (%s); the next event tries again", what, self.workdir, e)
      self.failed = True
      return None


def _parse(text: str) -> list[dict]:
  """The events of one file (a line cut short, as a kill leaves one in an appended legacy file, is skipped)."""
  events = []
  for line in text.splitlines():
    try:
      events.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return events


def read_events(workdir: str) -> list[dict]:
  """Every run's events in a workdir (``goodput/``, and an older workdir's ``goodput.jsonl``), run after run in
  the order they started."""
  root = epath.Path(workdir)
  runs: list[list[dict]] = []
  legacy = root / LEGACY_EVENTS
  for e in _parse(legacy.read_text()) if legacy.exists() else []:
    if e["event"] == "start":
      runs.append([])
    if runs:
      runs[-1].append(e)
  folder, parts = root / FOLDER, {}
  for path in folder.glob("*.jsonl") if folder.exists() else []:
    run, _, part = path.stem.rpartition("-")
    if run and "." not in path.stem and part.isdigit():  # a local run's, or an earlier version's (a store's too)
      parts.setdefault(run, []).append((int(part), path))
  texts = ["".join(path.read_text() for _, path in sorted(objects)) for objects in parts.values()]
  if paths.is_url(os.fspath(workdir)):
    texts += [text for _, text in logs.read_runs(os.fspath(folder))]  # a store's segments
  for text in texts:
    events = _parse(text)
    if events and events[0]["event"] == "start":  # a recorder never started (a Loop built by hand) is no run
      runs.append(events)
  runs.sort(key=lambda events: events[0]["t"])
  return [e for events in runs for e in events]


@dataclasses.dataclass
class _Run:
  start: float
  events: list[dict]

  @property
  def last(self) -> float:
    return self.events[-1]["t"] if self.events else self.start

  def first(self, kind: str) -> dict | None:
    return next((e for e in self.events if e["event"] == kind), None)

  def step(self) -> int | None:
    """The newest step the run recorded."""
    return next((e["step"] for e in reversed(self.events) if "step" in e), None)

  def cause(self) -> str | None:
    """Why the run stopped before its end, as it said (:data:`jaxtrain.exits.CAUSES`), ``"killed"`` when it said
    nothing (SIGKILL, an OOM kill, a lost host), None for a run that ended (reached train.steps)."""
    said = next((e for e in reversed(self.events) if e["event"] in ("stop", "end")), None)
    if said is None:
      return KILLED
    return said.get("cause")


def account(events: list[dict]) -> dict:
  """The goodput account of a workdir's events: seconds per part (:data:`PARTS`), their shares of the wall time,
  ``goodput`` (the productive share), the wall time, the number of runs and the steps trained again.

  The training's timeline is followed across runs as the productive seconds of each stretch between two records,
  labelled with the step it reached; a run resuming from a checkpoint, or a rollback to one, cuts the timeline
  back to that checkpoint's step: the stretches past it are lost, and what remains at the end is productive."""
  runs: list[_Run] = []
  for e in events:
    if e["event"] == "start":
      runs.append(_Run(e["t"], []))
    elif runs:
      runs[-1].events.append(e)
  seconds = dict.fromkeys(PARTS, 0.0)
  timeline: list[tuple[int, float]] = []  # (step reached, productive seconds of the stretch), kept so far
  trained_again = 0

  def back_to(step: int) -> None:
    nonlocal trained_again
    if timeline and timeline[-1][0] > step:
      trained_again += timeline[-1][0] - step
    while timeline and timeline[-1][0] > step:
      seconds["lost"] += timeline.pop()[1]

  for k, run in enumerate(runs):
    if k:
      seconds["down"] += run.start - runs[k - 1].last
    ready = run.first("ready")
    if ready is None:  # never got to train: all of it was start-up
      seconds["startup"] += run.last - run.start
      continue
    seconds["restore"] += ready["restore_s"]
    seconds["startup"] += ready["t"] - run.start - ready["restore_s"]
    back_to(ready["step"])  # a run resumed from a checkpoint older than the timeline's end
    spent = dict.fromkeys(LOOP_PARTS, 0.0)  # the run's cumulative seconds at its newest record
    for e in run.events:
      if e["event"] in ("progress", "rollback"):
        reached = e["reached"] if e["event"] == "rollback" else e["step"]
        timeline.append((reached, e["productive"] - spent["productive"]))
        spent = {p: e.get(p, 0.0) for p in LOOP_PARTS}
        if e["event"] == "rollback":
          back_to(e["step"])
    for part in ("checkpoint", "eval", "data_wait"):
      seconds[part] += spent[part]
    seconds["other"] += run.last - ready["t"] - sum(spent.values())
  seconds["productive"] = sum(s for _, s in timeline)
  wall = (runs[-1].last - runs[0].start) if runs else 0.0
  shares = {p: (v / wall if wall > 0 else 0.0) for p, v in seconds.items()}
  interruptions = [{"run": k, "step": run.step(), "cause": run.cause()} for k, run in enumerate(runs[:-1])
                   if run.cause() is not None]
  return {"goodput": shares["productive"], "wall_s": wall, "runs": len(runs), "steps_trained_again": trained_again,
          "seconds": seconds, "shares": shares, "interruptions": interruptions,
          "interrupted_by": dict(collections.Counter(i["cause"] for i in interruptions))}


def describe(summary: dict) -> str:
  """One line: the goodput, the largest parts of the badput and the interruptions by cause."""
  bad = sorted(((v, p) for p, v in summary["shares"].items() if p != "productive" and v >= 0.005), reverse=True)
  rest = ", ".join(f"{p} {100 * v:.1f}%" for v, p in bad[:4])
  causes = ", ".join(f"{c} x{n}" for c, n in sorted(summary.get("interrupted_by", {}).items()))
  return (f"goodput {100 * summary['goodput']:.1f}% of {summary['wall_s']:.0f}s over {summary['runs']} run(s)"
          + (f" (badput: {rest})" if rest else "") + (f"; interrupted by {causes}" if causes else ""))

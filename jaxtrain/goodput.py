"""Goodput: how much of a workdir's wall time, over all its runs and restarts, went into training that was kept.

Process 0 appends a few events per run to ``<workdir>/goodput.jsonl`` (:class:`Recorder`; local workdirs only,
like ``train.log``: object stores cannot append): the process's start, the loop's start (after compile and restore),
its progress at every logged step and checkpoint, and its end. :func:`account` turns them into one account:

- ``productive``: the loop's time of steps whose update was kept (the loop's time less the parts below);
- ``startup``: from the process's start to the loop's (imports, joining the job, compile, init), less restore;
- ``restore``: reading the checkpoint a run resumed from;
- ``checkpoint``: the loop blocked by saves;
- ``eval``: evaluations and samples;
- ``data_wait``: the loop waiting for batches;
- ``lost``: the productive time of steps a later run trained again (those after the checkpoint it resumed from);
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

import dataclasses
import json
import os
import time

import jax
from etils import epath

from jaxtrain import paths

EVENTS = "goodput.jsonl"
SUMMARY = "goodput.json"
PARTS = ("productive", "startup", "restore", "checkpoint", "eval", "data_wait", "lost", "down", "other")
_IMPORTED = time.time()
_runs_in_this_process = [0]


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
  """Appends this run's events to ``<workdir>/goodput.jsonl`` (process 0, local workdirs; otherwise a no-op)."""

  def __init__(self, workdir: str):
    local = jax.process_index() == 0 and not paths.is_url(workdir)
    self.path = epath.Path(workdir) / EVENTS if local else None
    self.workdir = workdir

  def _write(self, event: str, **fields) -> None:
    if self.path is not None:
      with self.path.open("a") as f:
        f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")

  def start(self) -> None:
    """The run starts: at the process's start for its first run, now for a later one in the same process."""
    first = _runs_in_this_process[0] == 0
    _runs_in_this_process[0] += 1
    if self.path is not None:
      with self.path.open("a") as f:
        f.write(json.dumps({"event": "start", "t": process_start_time() if first else time.time()}) + "\n")

  def ready(self, step: int, restore_s: float) -> None:
    """The loop starts at ``step`` (a resumed one, or 0), after ``restore_s`` seconds of reading its checkpoint."""
    self._write("ready", step=step, restore_s=restore_s)

  def progress(self, step: int, spent: dict[str, float]) -> None:
    """Up to ``step``, the loop spent ``spent`` (cumulative seconds: productive, checkpoint, eval, data_wait)."""
    self._write("progress", step=step, **spent)

  def end(self, step: int) -> dict | None:
    """The loop ended at ``step``; rewrites ``goodput.json`` and returns the account (None: not recorded)."""
    self._write("end", step=step)
    if self.path is None:
      return None
    summary = account(read_events(self.workdir))
    (epath.Path(self.workdir) / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def read_events(workdir: str) -> list[dict]:
  """The events of ``<workdir>/goodput.jsonl`` (a line cut short by a kill is skipped)."""
  path = epath.Path(workdir) / EVENTS
  events = []
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      events.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return events


@dataclasses.dataclass
class _Run:
  start: float
  events: list[dict]

  @property
  def last(self) -> float:
    return self.events[-1]["t"] if self.events else self.start

  def first(self, kind: str) -> dict | None:
    return next((e for e in self.events if e["event"] == kind), None)

  def progress(self) -> list[dict]:
    return [e for e in self.events if e["event"] == "progress"]


def account(events: list[dict]) -> dict:
  """The goodput account of a workdir's events: seconds per part (:data:`PARTS`), their shares of the wall time,
  ``goodput`` (the productive share), the wall time, the number of runs and the steps trained again."""
  runs: list[_Run] = []
  for e in events:
    if e["event"] == "start":
      runs.append(_Run(e["t"], []))
    elif runs:
      runs[-1].events.append(e)
  seconds = dict.fromkeys(PARTS, 0.0)
  lost_steps = 0
  for k, run in enumerate(runs):
    ready = run.first("ready")
    if ready is None:  # never got to train: all of it was start-up
      seconds["startup"] += run.last - run.start
      continue
    seconds["restore"] += ready["restore_s"]
    seconds["startup"] += ready["t"] - run.start - ready["restore_s"]
    records = run.progress()
    final = records[-1] if records else {"step": ready["step"], "t": ready["t"]}
    spent = {p: final.get(p, 0.0) for p in ("productive", "checkpoint", "eval", "data_wait")}
    resumed_at = runs[k + 1].first("ready") if k + 1 < len(runs) else None
    if resumed_at is not None and resumed_at["step"] < final["step"]:
      # Steps after the checkpoint the next run resumed from were trained again there: lost.
      kept = [r for r in records if r["step"] <= resumed_at["step"]]
      kept_productive = kept[-1]["productive"] if kept else 0.0
      seconds["lost"] += spent["productive"] - kept_productive
      lost_steps += final["step"] - resumed_at["step"]
      spent["productive"] = kept_productive
    for part, value in spent.items():
      seconds[part] += value
    seconds["other"] += run.last - ready["t"] - sum(final.get(p, 0.0) for p in spent)
    if k + 1 < len(runs):
      seconds["down"] += runs[k + 1].start - run.last
  wall = (runs[-1].last - runs[0].start) if runs else 0.0
  shares = {p: (v / wall if wall > 0 else 0.0) for p, v in seconds.items()}
  return {"goodput": shares["productive"], "wall_s": wall, "runs": len(runs), "steps_trained_again": lost_steps,
          "seconds": seconds, "shares": shares}


def describe(summary: dict) -> str:
  """One line: the goodput and the largest parts of the badput."""
  bad = sorted(((v, p) for p, v in summary["shares"].items() if p != "productive" and v >= 0.005), reverse=True)
  rest = ", ".join(f"{p} {100 * v:.1f}%" for v, p in bad[:4])
  return (f"goodput {100 * summary['goodput']:.1f}% of {summary['wall_s']:.0f}s over {summary['runs']} run(s)"
          + (f" (badput: {rest})" if rest else ""))

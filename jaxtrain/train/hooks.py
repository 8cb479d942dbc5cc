"""Loop hooks: what the training loop does besides training a step, each on its cadence. A :class:`Hook` is told
the moments of a run it cares about (the loop's start, a step dispatched, a step's log record, a step logged, a
checkpoint saved, a rollback, the loop's end); every moment is a no-op unless the hook defines it. The built-in
ones: the eval (:class:`Eval`), greedy samples (:class:`Samples`), the profiler trace (:class:`Profiler`), the
straggler verdict (:class:`Stragglers`) and the goodput events (:class:`Goodput`). A user's hook is a factory
named by import path in ``train.hooks`` (``"my_module:factory"``, called with the run's :class:`Run`), loaded by
:func:`from_config`:

  class LossPrinter(hooks.Hook):
    every = 100                       # at steps 100, 200, ... and the last
    def logged(self, loop, step, record):
      print(step, loop.last["loss"])  # the step's fetched metrics; ``record``: its log record if one was written

What a hook may read of the loop: ``state`` (the train state: in ``dispatched``, the step's own, whose params the
next step donates), ``last`` (the newest fetched step's metrics), ``counts`` (:class:`jaxtrain.train.loop.LoopState`),
``config``, ``plan`` (the Run), ``writer`` (``writer.write(step, {...})`` logs more metrics), ``watchdog``
(``beat()`` after long host work) and ``spent`` (the loop's seconds by kind, for goodput).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time
from typing import Any, Callable

import jax
import numpy as np
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from jaxtrain import goodput as goodput_lib
from jaxtrain import monitor
from jaxtrain import registry
from jaxtrain import workdir as workdir_lib
from jaxtrain.errors import ConfigError, UserError


def due(step: int, every: int, last: int) -> bool:
  """A hook's cadence: multiples of ``every`` (0: never) and the last step."""
  return bool(every) and (step % every == 0 or step == last)


class Hook:
  """One thing the loop does on a cadence. ``every``: :meth:`dispatched` and :meth:`logged` are called at the steps
  :func:`due` says (1: every step); the other moments at every occurrence. Every process calls the same hooks at the
  same steps (a hook may gather across processes)."""

  every: int = 1

  def start(self, loop) -> None:
    """Before the first step (after the restore: ``loop.counts.step`` is where the run starts)."""

  def dispatched(self, loop, step: int) -> None:
    """``step`` has just been dispatched (not waited for): ``loop.state`` is its result, alive until the next step
    is dispatched (which donates it)."""

  def metrics(self, loop, step: int, record: dict) -> dict[str, float]:
    """At a log step, before ``record`` is written: metrics to add to it."""
    return {}

  def logged(self, loop, step: int, record: dict | None) -> None:
    """``step``'s metrics have been fetched, judged and, at a log step, written: ``record`` (else None)."""

  def saved(self, loop, step: int) -> None:
    """A checkpoint of ``step`` was saved (to any tier)."""

  def rolled_back(self, loop, reached: int) -> None:
    """The run went back from step ``reached`` to a checkpoint (``loop.counts.step``, ``loop.state``)."""

  def close(self, loop) -> None:
    """The loop is over, whatever ended it (an error too): release what outlives it."""


# The built-in hooks -----------------------------------------------------------------------------------------------


class _Deferred(Hook):
  """Work dispatched with a step's params (before the next step donates them) and fetched and written once that
  step is logged, after its record."""

  def __init__(self, every: int):
    self.every, self.pending = every, {}  # step -> fetch

  def logged(self, loop, step: int, record: dict | None) -> None:
    if step in self.pending:
      t = time.perf_counter()
      self.write(loop, step, self.pending.pop(step)())
      loop.watchdog.beat()
      loop.spent["eval"] += time.perf_counter() - t

  def rolled_back(self, loop, reached: int) -> None:
    self.pending = {s: fetch for s, fetch in self.pending.items() if s <= loop.counts.step}

  def write(self, loop, step: int, fetched) -> None:
    raise NotImplementedError


class Eval(_Deferred):
  """The eval every ``eval.every_steps`` and at the last step (``evaluate``: :func:`jaxtrain.train.trainer.
  make_evaluator`'s), logged under its step; its first call compiles it (the watchdog knows)."""

  def __init__(self, evaluate: Callable, every: int):
    super().__init__(every)
    self.evaluate, self.compiled = evaluate, False

  def dispatched(self, loop, step: int) -> None:
    if self.compiled:
      self.pending[step] = self.evaluate(loop.state.params)
      return
    self.compiled = True
    with loop.watchdog.compiling("the eval step's first call (its compile)"):
      self.pending[step] = self.evaluate(loop.state.params)

  def write(self, loop, step: int, fetched) -> None:
    loop.last_eval.update(fetched)
    loop.writer.write(step, loop.last_eval)


class Samples(_Deferred):
  """Greedy continuations of ``train.sample_prompts`` every ``train.sample_every`` steps and at the last
  (``sample``: a compiled :class:`jaxtrain.sampling.Sampler`)."""

  def __init__(self, sample: Callable, every: int):
    super().__init__(every)
    self.sample = sample

  def dispatched(self, loop, step: int) -> None:
    self.pending[step] = self.sample(loop.state.params)

  def write(self, loop, step: int, fetched) -> None:
    write_samples(loop.config.workdir, step, fetched, loop.writer)


def write_samples(workdir: str, step: int, samples: list[dict[str, str]], writer=None) -> None:
  """Logs ``step``'s samples and appends them to ``<workdir>/samples.jsonl`` (one JSON object per sample: step,
  prompt, completion) and, where the run writes TensorBoard, as text (process 0)."""
  if jax.process_index() != 0:
    return
  for s in samples:
    logging.info("step %d sample: %r -> %r", step, s["prompt"], s["completion"])
  workdir_lib.append(epath.Path(workdir) / "samples.jsonl",
                     "".join(json.dumps({"step": step, **s}, ensure_ascii=False) + "\n" for s in samples))
  tb = getattr(writer, "tb", None)
  if tb is not None:
    tb.add_text("samples", "\n\n".join(f"**{s['prompt']}**{s['completion']}" for s in samples), step)
    tb.flush()


class Harness(Hook):
  """Benchmark scores on the live params (no save, no reload): the lm-evaluation-harness tasks of
  ``eval.harness_tasks`` every ``eval.harness_every`` steps and at the last (jaxtrain.evaluation.harness, the run's
  model, mesh, layout and tokenizer), logged after the step's record as ``harness/<task>/<metric>``. Every process
  runs the same requests (the programs span the mesh); the writer writes on process 0. Its time is eval time
  (goodput); the watchdog leaves it out of the step's (as a compile, bounded by ``monitor.watchdog_compile_s``).
  An unknown task is a ConfigError of the config check (:func:`validate_harness`), before anything is written."""

  def __init__(self, run):
    from jaxtrain.evaluation import harness  # the eval extra (lm-evaluation-harness), only when it is asked for
    e = run.config.eval
    self.harness, self.every = harness, e.harness_every
    self.manager = harness.task_manager(e.harness_include_path or None, e.harness_tasks)
    self.tasks = harness.check_tasks(e.harness_tasks, self.manager)
    self.limit, self.fewshot = e.harness_limit or None, None if e.harness_num_fewshot < 0 else e.harness_num_fewshot
    self.chat, self.multiturn = e.harness_apply_chat_template, e.harness_fewshot_as_multiturn
    c = run.config  # rows of one training microbatch: the logits of a program are at most a training step's
    self.lm = harness.JaxtrainLM(run.model, run.mesh, run.rules, run.state_shardings.params, harness.text_of(c),
                                 batch_size=c.train.global_batch_size // max(1, c.train.microbatches),
                                 max_length=c.data.seq_len)
    self.pending: dict[int, dict[str, float]] = {}

  def dispatched(self, loop, step: int) -> None:
    t = time.perf_counter()
    with loop.watchdog.compiling(f"the harness's tasks at step {step}"):
      self.lm.params = loop.state.params
      try:
        results = self.harness.evaluate(self.lm, self.tasks, manager=self.manager, limit=self.limit,
                                        num_fewshot=self.fewshot, bootstrap_iters=0, log_samples=False,
                                        apply_chat_template=self.chat, fewshot_as_multiturn=self.multiturn)
      finally:
        self.lm.params = None  # the next step donates them
    self.pending[step] = self.harness.metrics(results)
    loop.spent["eval"] += time.perf_counter() - t

  def logged(self, loop, step: int, record: dict | None) -> None:
    if step in self.pending:
      scores = self.pending.pop(step)
      if jax.process_index() == 0:
        logging.info("step %d harness: %s", step, ", ".join(f"{k[8:]} {v:.4g}" for k, v in scores.items()))
      loop.writer.write(step, scores)

  def rolled_back(self, loop, reached: int) -> None:
    self.pending = {s: v for s, v in self.pending.items() if s <= loop.counts.step}


class Profiler(Hook):
  """One jax.profiler trace of steps [profile_start, profile_start + profile_steps) into <workdir>/profile
  (process 0; a run resumed inside that window traces the rest of it). Told before each step (after the one before
  it is dispatched); the trace ends wherever the loop ends (the window reaching train.steps, a preemption, an
  error): a trace that is never stopped is never written."""

  def __init__(self, config):
    m = config.metrics
    self.start_step, self.end = m.profile_start, m.profile_start + m.profile_steps
    self.enabled = self.start_step >= 0 and jax.process_index() == 0
    self.directory = os.fspath(epath.Path(config.workdir) / "profile")
    self.tracing = False

  def start(self, loop) -> None:
    self._before(loop.counts.step, loop.state)

  def dispatched(self, loop, step: int) -> None:
    self._before(step, loop.state)

  def rolled_back(self, loop, reached: int) -> None:
    self._before(loop.counts.step, loop.state)

  def _before(self, step: int, state) -> None:
    """Before the step from ``step`` (``state``: the state that step starts from)."""
    if not self.enabled:
      return
    inside = self.start_step <= step < self.end
    if inside and not self.tracing:
      jax.profiler.start_trace(self.directory)
      self.tracing = True
    elif not inside and self.tracing:
      jax.block_until_ready(state)  # the window's last step may still be running: let the trace see it end
      self.close(None)

  def close(self, loop) -> None:
    if not self.tracing:
      return
    self.tracing = self.enabled = False  # one trace per run (a rollback may step back into the window)
    try:
      jax.profiler.stop_trace()
      logging.info("profiler trace written to %s", self.directory)
    except Exception as e:  # noqa: BLE001 - a lost trace must not end the run
      logging.warning("the profiler trace could not be written: %s", e)


class Stragglers(Hook):
  """Every process's data wait and step time of each log interval (a gather of two floats on a multi-process job),
  judged by :class:`jaxtrain.monitor.Stragglers`; its verdict goes into the record."""

  def __init__(self, config):
    self.config, self.judge, self.judged_once = config.monitor, None, False

  def start(self, loop) -> None:
    m = self.config
    self.judge = monitor.Stragglers(
        process_hosts(), m.straggler_threshold, m.straggler_logs, m.slowdown_threshold,
        warn=logging.warning if jax.process_index() == 0 else lambda *_: None)  # the same verdict everywhere

  def metrics(self, loop, step: int, record: dict) -> dict[str, float]:
    if not (self.judge.threshold or self.judge.slowdown):
      return {}  # both off: no gather
    if not self.judged_once:  # the same on every process: they all log the same steps
      # The run's first interval holds its one-time costs (the first dispatch of the compiled step, buffers
      # allocated, the input pipeline warming up): seconds on a loaded host that later intervals do not have and
      # that would dilute a real straggler's share of the time. Judging starts with the second.
      self.judged_once = True
      return {}
    own = np.array([record["data_wait_s"], record["step_time"]], np.float32)
    every = np.asarray(multihost_utils.process_allgather(own)) if jax.process_count() > 1 else own[None]
    return self.judge(step, [float(t) for t in every[:, 0]], float(every[:, 1].max()))


def process_hosts() -> list[str]:
  """Every process's host name, by process index (one gather of 64 bytes each, on a multi-process job)."""
  name = socket.gethostname()
  if jax.process_count() == 1:
    return [name]
  own = np.frombuffer(name.encode()[:64].ljust(64, b"\0"), np.uint8)
  every = np.asarray(multihost_utils.process_allgather(own))
  return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]


class Goodput(Hook):
  """The run's goodput events (:class:`jaxtrain.goodput.Recorder`, whose ``end`` the loop records itself, once the
  last save is committed): ready at the start, progress at every logged step and checkpoint, each rollback. List it
  after the hooks whose time it counts (``loop.spent``)."""

  def __init__(self, recorder: goodput_lib.Recorder, restore_s: float):
    self.recorder, self.restore_s = recorder, restore_s

  def start(self, loop) -> None:
    self.recorder.ready(loop.counts.step, self.restore_s)

  def logged(self, loop, step: int, record: dict | None) -> None:
    if record is not None:
      self.recorder.progress(step, loop.spent_now())

  def saved(self, loop, step: int) -> None:
    self.recorder.progress(step, loop.spent_now())

  def rolled_back(self, loop, reached: int) -> None:
    self.recorder.rollback(reached, loop.counts.step, loop.spent_now())  # the steps since: lost


def standard(run, evaluate: Callable | None, sample: Callable | None, recorder: goodput_lib.Recorder,
             restore_s: float) -> list[Hook]:
  """The built-in hooks of a run, in the order the loop tells them: the profiler, stragglers, the eval
  (``evaluate``, None: off) and samples (``sample``, None: off), then the user's (``train.hooks``), then goodput
  (which counts the others' time). ``restore_s``: the seconds the restore this run resumed from took."""
  c = run.config
  hooks = [Profiler(c), Stragglers(c)]
  if evaluate is not None:
    hooks.append(Eval(evaluate, c.eval.every_steps))
  if sample is not None:
    hooks.append(Samples(sample, c.train.sample_every))
  if c.eval.harness_tasks:
    hooks.append(Harness(run))
  return hooks + from_config(run) + [Goodput(recorder, restore_s)]


# A user's hooks, by import path -------------------------------------------------------------------------------------


def load(path: str) -> Callable[[Any], Hook]:
  """The factory that ``path`` (``"package.module:name"``) names; ConfigError (one line, naming ``train.hooks`` and
  the path) if it cannot be imported or is not there."""
  return registry.by_import_path(path, "train.hooks", "factory", "my_hooks:loss_printer",
                                 "a function or class of that module that returns a hook")


def validate(config) -> None:
  hooks = config.train.hooks
  if isinstance(hooks, str) or not all(isinstance(p, str) for p in hooks):
    raise ConfigError("train.hooks", f"{hooks!r} is not a tuple of 'module.path:factory' strings",
                      "e.g. --config.train.hooks=\"('my_hooks:loss_printer',)\"")
  for path in hooks:
    load(path)


def validate_harness(config) -> None:
  """The ``eval.harness_*`` keys, the task names included (the harness's TaskManager knows them: with tasks that
  are all in ``eval.harness_include_path`` it indexes only that folder, else all of the harness's, some seconds)."""
  e = config.eval
  tasks = e.harness_tasks
  if isinstance(tasks, str) or not all(isinstance(t, str) and t for t in tasks):
    raise ConfigError("eval.harness_tasks", f"{tasks!r} is not a tuple of task names",
                      "e.g. --config.eval.harness_tasks=\"('hellaswag', 'arc_easy')\"")
  if e.harness_every < 0 or e.harness_limit < 0 or e.harness_num_fewshot < -1:
    raise ConfigError("eval.harness_every/harness_limit/harness_num_fewshot", f"{e.harness_every}/{e.harness_limit}/"
                      f"{e.harness_num_fewshot} are not all >= 0 (num_fewshot: -1 is the task's own)", "fix the value")
  if tasks and not e.harness_every:
    raise ConfigError("eval.harness_every", "is 0 while eval.harness_tasks is set",
                      "set --config.eval.harness_every=N (the steps between evaluations)")
  if e.harness_fewshot_as_multiturn and not e.harness_apply_chat_template:
    raise ConfigError("eval.harness_fewshot_as_multiturn", "needs eval.harness_apply_chat_template=True",
                      "set both, as jaxtrain.evaluate's --fewshot_as_multiturn needs --apply_chat_template")
  if tasks and importlib.util.find_spec("lm_eval") is None:
    raise ConfigError("eval.harness_tasks", "needs lm-evaluation-harness, which is not installed",
                      "pip install 'jaxtrain[eval]'")
  if e.harness_include_path and not os.path.isdir(e.harness_include_path):
    raise ConfigError("eval.harness_include_path", f"{e.harness_include_path} is not a folder",
                      "pass a folder of task YAMLs")
  if tasks:
    from jaxtrain.evaluation import harness  # the eval extra (lm-evaluation-harness), only when it is asked for
    if e.harness_apply_chat_template:
      try:
        text = harness.text_of(config)
      except UserError as err:
        raise ConfigError("eval.harness_apply_chat_template", f"{err.subject}: {err.problem}", err.fix) from None
      if not text.chat_template:
        raise ConfigError("eval.harness_apply_chat_template", f"the run's tokenizer ({text.where}) has no chat "
                          "template", "evaluate without it, or train from a checkpoint or data.tokenizer folder that "
                          "has one")
    try:
      harness.build_tasks(tasks, harness.task_manager(e.harness_include_path or None, tasks))  # YAMLs fit data
    except harness.HarnessError as err:
      raise ConfigError("eval.harness_tasks", f"{err.subject}: {err.problem}", err.fix) from None


def from_config(run) -> list[Hook]:
  """The hooks of ``train.hooks``, each factory called with ``run``."""
  return [load(path)(run) for path in run.config.train.hooks]

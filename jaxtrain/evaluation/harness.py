"""EleutherAI's lm-evaluation-harness on jaxtrain: a harness model (``lm_eval.api.model.TemplateLM``) whose
requests run on the mesh, and :func:`evaluate`, the harness's own evaluator over it.

:class:`JaxtrainLM` holds a model, its params (a checkpoint's, or a training run's live ones: ``lm.params`` may be
replaced between evaluations) and the checkpoint's tokenizer (:class:`Text`). The harness's three request kinds:

- ``loglikelihood`` (context, continuation): the pair is tokenized as the harness's ``hf`` model does (trailing
  spaces of the context moved to the continuation, the whole text encoded and split at the context's length; an
  empty context is the prefix token: BOS, else EOS), then scored by :class:`jaxtrain.evaluation.scoring.Scorer`:
  the training forward and cross-entropy in float32 over the continuation's tokens, with the greedy flag;
- ``loglikelihood_rolling`` (perplexity): the harness's rolling windows of ``max_length`` tokens, each scored the
  same way, summed per document;
- ``generate_until``: :class:`jaxtrain.sampling.Generator` (the KV-cache decoder), greedy unless the task asks to
  sample, prompts left-truncated to ``max_length - max_gen_toks`` and left-padded into rows of a few fixed lengths,
  one compiled generator per (prompt length, ``max_gen_toks``); the text is cut at the first stop sequence.

Every process of a multi-process job runs the same requests in the same order (the programs span the whole mesh;
the harness sees one rank); only process 0 shows progress. ``apply_chat_template`` renders the tokenizer's chat
template (``tokenizer_config.json``'s or ``chat_template.jinja``) with jaxtrain.data.chat when the harness asks
(``--apply_chat_template``).

The harness's ``--model jaxtrain`` (a checkpoint by path) is jaxtrain.evaluate's, which registers it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import glob
import json
import logging as std_logging
import os
from typing import Any, Sequence

import jax
import yaml
from absl import logging
# The harness: this module is its adapter (jaxtrain's eval extra, pip install 'jaxtrain[eval]'); nothing imports
# this module unless the harness is asked for (jaxtrain.evaluate, eval.harness_tasks).
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from jaxtrain import _compat
from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import failures
from jaxtrain import sampling
from jaxtrain.data import chat
from jaxtrain.data import tokenizers
from jaxtrain.errors import UserError, find_cause
from jaxtrain.evaluation.scoring import Scorer, buckets


class HarnessError(UserError):
  """A mistake in what the harness was asked (a task, a checkpoint, a flag): one line, exit code 2."""


# ---------------------------------------------------------------------------------------------------------------
# The checkpoint's tokenizer.

@dataclasses.dataclass
class Text:
  """A checkpoint's tokenizer as the harness uses it: ``bos_id`` / ``eos_id`` as the tokenizer names them (its
  ``tokenizer_config.json``, else the model's config), ``stop_ids`` the ids that end a generation, the chat
  template (or None)."""
  tokenizer: Any  # a jaxtrain.data.tokenizers tokenizer
  bos_id: int | None
  eos_id: int | None
  stop_ids: tuple[int, ...]
  chat_template: str | None
  special_tokens: dict
  where: str

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """The ids of ``text``, with the special tokens the tokenizer itself adds (a Hugging Face tokenizer's
    post-processor: Llama 3's BOS; Qwen's none) when ``add_special_tokens``."""
    if isinstance(self.tokenizer, tokenizers.HFTokenizer):
      return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]
    return [int(i) for i in self.tokenizer.encode(text)]

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    if isinstance(self.tokenizer, tokenizers.HFTokenizer):
      return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return self.tokenizer.decode(ids)

  @property
  def prefix_id(self) -> int:
    """What an empty context is: BOS, else EOS, else 0 (the byte tokenizer has neither)."""
    return next((i for i in (self.bos_id, self.eos_id) if i is not None), 0)


def text_of(config, saved: dict | None = None, step_dir: str | None = None, override: str = "") -> Text:
  """The tokenizer of a checkpoint, or of the running run without ``step_dir`` (jaxtrain.sampling.tokenizer_for:
  its lineage's ``hf/`` folder, else the run's; ``override``: a tokenizer file or folder instead), with the ids that
  end a generation the same as jaxtrain.generate's and the GRPO sampler's."""
  saved = saved if saved is not None else config.to_dict()
  side = (checkpoint_lib.side_files_dir(step_dir, saved) if step_dir
          else checkpoint_lib.lineage.run_side_dir(saved))
  if side and not override and not checkpoint_lib.lineage.has_tokenizer(side):
    raise HarnessError(side, "the checkpoint's lineage carries no tokenizer (no tokenizer.json or tokenizer.model)",
                       "pass --tokenizer=FILE, or import a Hugging Face folder that has its tokenizer")
  found = sampling.tokenizer_for(config, saved, step_dir, override)
  tok = found.tokenizer

  def named(name):
    text = found.special_tokens.get(name)
    return tok.token_to_id(text) if text is not None and hasattr(tok, "token_to_id") else None

  bos = named("bos_token")
  bos = found.bos_id if bos is None else bos
  eos = named("eos_token")
  eos = (found.eos_ids[0] if found.eos_ids else None) if eos is None else eos
  return Text(tok, bos, eos, found.eos_ids, found.chat_template, found.special_tokens, found.where)


# ---------------------------------------------------------------------------------------------------------------
# The harness model.

class JaxtrainLM(TemplateLM):
  """A harness model on the mesh: ``model`` with ``params`` laid out by ``param_shardings`` (``mesh``, ``rules``),
  tokenized by ``text``. ``batch_size`` rows per program (rounded up to a multiple of the batch shards),
  ``max_length`` tokens per row at most, ``max_gen_toks`` new tokens by default."""

  def __init__(self, model, mesh, rules, param_shardings, text: Text, params=None, *, batch_size: int = 8,
               max_length: int = 2048, max_gen_toks: int = 256):
    super().__init__()
    self.model, self.mesh, self.rules, self.param_shardings = model, mesh, rules, param_shardings
    self.text, self.params = text, params
    self._max_length, self._max_gen_toks = int(max_length), int(max_gen_toks)
    self.rows = sampling.padded_rows(max(1, int(batch_size)), mesh, rules)
    self.scorer = Scorer(model, mesh, rules, param_shardings, rows=self.rows, max_length=self._max_length)
    self._generators: dict[tuple, sampling.Generator] = {}
    self.generate_compiles = 0
    self.show_progress = jax.process_index() == 0

  # What the harness reads -----------------------------------------------------------------------------------

  @property
  def eot_token_id(self) -> int:
    return self.text.eos_id if self.text.eos_id is not None else self.text.prefix_id

  @property
  def prefix_token_id(self) -> int:
    return self.text.prefix_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def tokenizer_name(self) -> str:
    return f"jaxtrain:{getattr(self.text.tokenizer, 'name', self.text.where)}"

  @property
  def compiles(self) -> int:
    """Programs compiled so far (scoring and generation)."""
    return self.scorer.compiles + self.generate_compiles

  def get_model_info(self) -> dict:
    return {"model_num_parameters": sum(int(x.size) for x in jax.tree.leaves(self.model.abstract_params)),
            "model_dtype": str(self.model.cfg.dtype), "mesh": dict(self.mesh.shape)}

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    if add_special_tokens is None:  # as the hf model: no second BOS on a text that starts with one
      bos = self.text.decode([self.prefix_token_id], skip_special_tokens=False)
      add_special_tokens = not (bos and string.startswith(bos))
    return self.text.encode(string, add_special_tokens)

  def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
    return self.text.decode(tokens, skip_special_tokens=skip_special_tokens)

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    if chat_template is False or chat_template is None:
      return None
    return self.text.chat_template

  def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    if not self.text.chat_template:
      raise HarnessError("--apply_chat_template", f"the tokenizer ({self.text.where}) has no chat template",
                         "evaluate without it, or use a tokenizer folder whose tokenizer_config.json has one")
    template = chat.ChatTemplate(self.text.chat_template, self.text.special_tokens)
    if add_generation_prompt:
      return template.render(chat_history, add_generation_prompt=True)[0]
    # Continue the final message (transformers' continue_final_message): the text up to its content's end.
    rendered = template.render(chat_history)[0]
    final = chat_history[-1]["content"].strip()
    at = rendered.rfind(final)
    return rendered[:at + len(final)] if at >= 0 else rendered

  # Scoring --------------------------------------------------------------------------------------------------

  def _progress(self, total: int, what: str, disable: bool):
    return tqdm(total=total, desc=what, disable=disable or not self.show_progress)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    scored = []
    for _, context, continuation in requests:
      tokens = (list(context) + list(continuation))[-(self.max_length + 1):]
      scored.append((tokens, len(continuation)))
    with self._progress(len(requests), "loglikelihood requests (jaxtrain)", disable_tqdm) as bar:
      out = self.scorer.score(self.params, scored, progress=bar.update)
    for (pair, _, _), answer in zip(requests, out):
      if pair is not None:
        self.cache_hook.add_partial("loglikelihood", pair, answer)
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    windows, owners = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
          context_len=1)):
        windows.append((None, context, continuation))
        owners.append(i)
    scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
    totals = [0.0] * len(requests)
    for i, (logp, _) in zip(owners, scores):
      totals[i] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  # Generation -----------------------------------------------------------------------------------------------

  def generator(self, prompt_len: int, max_new: int, how: sampling.Sampling) -> sampling.Generator:
    key = (prompt_len, max_new, how)
    if key not in self._generators:
      self._generators[key] = sampling.Generator(
          self.model, self.mesh, self.rules, self.param_shardings, rows=self.rows, prompt_len=prompt_len,
          max_new_tokens=max_new, sampling=how, eos_ids=self.text.stop_ids)
      self.generate_compiles += 2  # its prefill and its decode loop
    return self._generators[key]

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    out: list[str | None] = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
      groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
    eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
    with self._progress(len(requests), "generate_until requests (jaxtrain)", disable_tqdm) as bar:
      for indices in groups.values():
        kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_new = int(kwargs.pop("max_gen_toks"))
        if max_new >= self.max_length:
          raise HarnessError("max_gen_toks", f"{max_new} new tokens do not fit max_length {self.max_length}",
                             "raise max_length or lower the task's max_gen_toks")
        how = sampling.Sampling(float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0,
                                int(kwargs.get("top_k") or 0), float(kwargs.get("top_p") or 1.0)).check()
        limit = self.max_length - max_new
        prompts = {i: (self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-limit:] for i in indices}
        lengths = buckets(limit, 16)
        by_len: dict[int, list[int]] = {}
        for i in indices:
          by_len.setdefault(next(n for n in lengths if len(prompts[i]) <= n), []).append(i)
        for prompt_len, members in sorted(by_len.items()):
          gen = self.generator(prompt_len, max_new, how)
          for start in range(0, len(members), self.rows):
            chunk = members[start:start + self.rows]
            with jax.set_mesh(self.mesh):
              ids = gen.generate(self.params, [prompts[i] for i in chunk], seed=int(kwargs.get("seed") or 0))
            for i, new in zip(chunk, ids):
              text = postprocess_generated_text(self.tok_decode(new), until, None)
              out[i] = text
              self.cache_hook.add_partial("generate_until", requests[i].args, text)
            bar.update(len(chunk))
    return out


# ---------------------------------------------------------------------------------------------------------------
# The harness's evaluator.

def task_manager(include_path: str | Sequence[str] | None = None, tasks: Sequence[str] = ()):
  """The harness's TaskManager with the tasks of ``include_path`` (folders of task YAMLs): those alone when they
  hold every one of ``tasks`` (indexing the harness's own thousands of tasks takes seconds), else the harness's
  too. One per process for the same arguments (a run's config check and its hook share it)."""
  paths = [include_path] if isinstance(include_path, str) else list(include_path or ())
  for p in paths:
    if not os.path.isdir(p):
      raise HarnessError(p, "is not a folder of task YAMLs", "pass --include_path=a folder that holds them")
  return _task_manager(tuple(paths), tuple(task_names(tasks)))


def _task_manager(paths: tuple[str, ...], names: tuple[str, ...]):
  if paths and names:
    local = _indexed(paths, False)
    if set(names) <= set(local.all_tasks) or unreadable_yamls(paths):  # (check_tasks names the unreadable YAML)
      return local
  return _indexed(paths, True)


@functools.cache
def _indexed(paths: tuple[str, ...], defaults: bool):
  """The harness's index of ``paths`` (and of its own tasks with ``defaults``): one per process, whatever tasks are
  asked of it."""
  from lm_eval.tasks import TaskManager
  return TaskManager(include_path=list(paths) or None, include_defaults=defaults)


@functools.cache
def unreadable_yamls(paths: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
  """(file, why) of each task YAML under ``paths`` that the harness cannot read: its index skips such a file
  without a word, so that its task is merely unknown."""
  load_yaml = _compat.lm_eval_yaml_loader()  # the harness index's own reader (its includes, !function)
  if load_yaml is None:  # another harness version: YAML's syntax alone
    def load_yaml(path, **_):
      loader = type("Loader", (yaml.SafeLoader,), {})
      loader.add_multi_constructor("!", lambda *_: None)
      with open(path, "rb") as f:
        return yaml.load(f, Loader=loader)  # noqa: S506 - a SafeLoader that ignores tags
  out = []
  for root in paths:
    for path in sorted(glob.glob(os.path.join(root, "**", "*.yaml"), recursive=True)):
      try:
        load_yaml(path, resolve_func=False, recursive=True)
      except Exception as e:  # noqa: BLE001 - whatever the reader refused, as the index does
        if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
          why = (f"{e.context}: " if e.context else "") + (f"{e.problem} at line {e.problem_mark.line + 1}, "
                                                            f"column {e.problem_mark.column + 1}")
        else:
          why = f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        out.append((path, why))
  return tuple(out)


def task_names(tasks: Sequence[str]) -> list[str]:
  """Task names from names or comma-separated lists of them."""
  return [t.strip() for item in tasks for t in item.split(",") if t.strip()]


def check_tasks(tasks: Sequence[str], manager) -> list[str]:
  """``tasks`` (names, or comma-separated names) that the harness knows; HarnessError naming the first it does not."""
  names = task_names(tasks)
  if not names:
    raise HarnessError("--tasks", "no task given", "pass e.g. --tasks=hellaswag,arc_easy")
  known = set(manager.all_tasks)
  for name in names:
    if name not in known:
      include = getattr(manager, "include_path", None) or ()
      unreadable = unreadable_yamls((include,) if isinstance(include, str) else tuple(include))
      if unreadable:
        path, why = unreadable[0]
        raise HarnessError(name, f"is not a task the harness knows, and the include path's {path} cannot be read "
                           f"({why})", "fix that task YAML (the harness skips one it cannot read)")
      close = difflib.get_close_matches(name, sorted(known), n=3)
      raise HarnessError(name, "is not a task the harness knows", "see `lm_eval ls tasks`" + (
          f" (did you mean {', '.join(close)}?)" if close else "") + ", or put its YAML in the include path "
                         "(--include_path, eval.harness_include_path)")
  return names


def _task_error(e: BaseException, names: Sequence[str], building: bool) -> HarnessError | None:
  """A task YAML's mistake behind ``e`` as one line: a template that names a field its data lacks (the task, the
  template, the field and the fields the data has), or (``building``: raised while the harness built the tasks,
  their data loaded and their templates tried on a document) whatever the harness refused of a task's config;
  None for anything else."""
  import jinja2
  task, template, fields, tb = None, None, None, e.__traceback__
  while tb is not None:  # the task being built, the template being rendered and its document: the frames' own
    frame = tb.tb_frame
    owner = frame.f_locals.get("self")
    if isinstance(getattr(getattr(owner, "config", None), "task", None), str) and hasattr(owner, "doc_to_text"):
      task = owner.config.task
      if frame.f_code.co_name.startswith(("doc_to_", "fewshot_")):
        template = frame.f_code.co_name
    doc = frame.f_locals.get("doc")
    if isinstance(doc, dict):
      fields = ", ".join(map(str, doc))
    tb = tb.tb_next
  name = task or ",".join(names)
  undefined = find_cause(e, lambda x: isinstance(x, jinja2.exceptions.UndefinedError))
  if undefined is not None:
    return HarnessError(name, f"its {template or 'template'} names a field the data lacks ({undefined.message})",
                        (f"the data's fields are {fields}: " if fields else "") + "fix the task YAML")
  if building and task is not None:  # the harness refused the task's config
    return HarnessError(name, f"the harness cannot build the task ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:160]})", "fix the task YAML")
  return None


def build_tasks(tasks: Sequence[str], manager) -> dict:
  """The harness's tasks of ``tasks`` built as its evaluator builds them (their data loaded, their templates tried
  on a document), so that a task YAML's mistake is one line (:func:`_task_error`) before any params are loaded."""
  from lm_eval.tasks import get_task_dict
  names = check_tasks(tasks, manager)
  try:
    return get_task_dict(names, manager)
  except Exception as e:  # noqa: BLE001 - told apart by cause below; a bug is raised as it is
    _raise_known(e, names, building=True)
    raise


def _raise_known(e: Exception, names: Sequence[str], building: bool = False) -> None:
  """Raises the one-line error of a failure of the harness whose cause is known (a task's data or YAML, memory, the
  disk); returns for anything else."""
  failure = failures.classify(e)
  if failure is not None and failure.kind in (failures.DEVICE_OOM, failures.HOST_OOM):
    raise HarnessError(",".join(names), f"scoring ran out of memory ({failures.describe(failure.error)})",
                       "the harness's batch is a training microbatch's rows: raise train.microbatches (or lower "
                       "eval.harness_limit)") from None
  if failure is not None and failure.kind == failures.IO:  # the disk under the task's files: a restart cures it
    raise failures.error_for(failure, ",".join(names), "reading the harness's task data") from e
  if isinstance(e, (ConnectionError, OSError)):
    raise HarnessError(",".join(names), f"its data cannot be loaded ({type(e).__name__}: {str(e)[:160]})",
                       "a task from the hub needs the network (HF_DATASETS_OFFLINE unset); a local task needs its "
                       "data files where its YAML says") from None
  task = _task_error(e, names, building)
  if task is not None:
    raise task from None


def evaluate(lm: JaxtrainLM, tasks: Sequence[str], *, include_path=None, num_fewshot: int | None = None,
             limit: int | float | None = None, manager=None, **kwargs) -> dict:
  """The harness's ``simple_evaluate`` of ``tasks`` on ``lm``: its results dict (the JSON it writes). A task whose
  data cannot be had (the hub offline, a missing file) is a HarnessError."""
  from lm_eval import evaluator
  manager = manager or task_manager(include_path, tasks)
  names = check_tasks(tasks, manager)
  std_logging.getLogger("lm_eval").setLevel(std_logging.WARNING if jax.process_index() else std_logging.INFO)
  try:
    results = evaluator.simple_evaluate(model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit,
                                        task_manager=manager, **kwargs)
  except Exception as e:  # noqa: BLE001 - told apart by cause below; a bug is raised as it is
    _raise_known(e, names)
    raise
  if results is None:
    raise HarnessError(",".join(names), "the harness returned no results", "see its log above")
  logging.info("harness: %s scored (%d programs compiled)", ",".join(names), lm.compiles)
  return results


def metrics(results: dict) -> dict[str, float]:
  """``harness/<task>/<metric>`` -> value of the numbers in a results dict (a metric's filter, other than
  ``none``, after a slash: ``exact_match/strict-match``)."""
  out = {}
  for task, values in sorted(results.get("results", {}).items()):
    for key, value in values.items():
      if not isinstance(value, (int, float)) or isinstance(value, bool) or key in ("alias",):
        continue
      metric, _, filt = key.partition(",")
      out[f"harness/{task}/{metric}" + (f"/{filt}" if filt and filt != "none" else "")] = float(value)
  return out

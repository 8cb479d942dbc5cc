"""Benchmark scores with EleutherAI's lm-evaluation-harness (jaxtrain/evaluation, jaxtrain/evaluate.py): on models
imported from random transformers Llama and Qwen3 folders, local tasks (multiple choice, generation, perplexity;
tests/harness_data.py, no network) give through jaxtrain the same per-request log-likelihoods as the harness's own
``hf`` model on the same folder (float32, within 1e-4), the same accuracy and the same greedy generations (Qwen3
with its chat template); rolling log-likelihoods equal jaxtrain's eval loss; a whole evaluation compiles a few
programs and a second one none; the command writes the harness's results JSON; bad input is one line, exit 2."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest

from tests import forked
from tests import harness_data

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval (the eval extra, in setup.cfg's test extra) is not "
                              "installed: pip install -e '.[test]'")
os.environ["HF_DATASETS_OFFLINE"] = "1"  # the tasks are local: nothing may come from the hub
os.environ["HF_HUB_OFFLINE"] = "1"

from jaxtrain import hf  # noqa: E402
from jaxtrain.evaluation import harness  # noqa: E402
from jaxtrain.evaluation.scoring import Scorer  # noqa: E402

TASKS = ["jt_mc", "jt_gen", "jt_ppl"]
TOL = 1e-4
SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
  return harness_data.write_tasks(tmp_path_factory.mktemp("tasks"))


def _import(folder: pathlib.Path, qwen: bool) -> pathlib.Path:
  pytest.importorskip("transformers", reason="transformers (test-only) is not installed: the random Hugging Face "
                      "models are built with it")
  harness_data.hf_model(folder / "src", qwen=qwen)
  hf.import_model(str(folder / "src"), str(folder / "out"))
  return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """A random Llama folder (``src``, with its BPE tokenizer) and its import (``out``)."""
  return _import(tmp_path_factory.mktemp("llama"), qwen=False)


@pytest.fixture(scope="module")
def llama_lm(llama):
  import jaxtrain.evaluate as evaluate_lib
  return evaluate_lib.CheckpointLM(str(llama / "out"), batch_size=4)


def _by_request(results: dict, task: str) -> list:
  return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


# (a) The harness's hf model and jaxtrain's, request by request ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scores_equal_the_harness_hf_model(family, tasks, tmp_path):
  """Every log-likelihood within 1e-4 (float32), the same greedy flags, accuracies and generations; Qwen3 through
  its chat template (``apply_chat_template``)."""
  from lm_eval import evaluator
  from lm_eval.models.huggingface import HFLM
  import jaxtrain.evaluate as evaluate_lib
  qwen = family == "qwen3"
  folder = _import(tmp_path, qwen=qwen)
  kwargs = dict(log_samples=True, bootstrap_iters=0, apply_chat_template=qwen)
  ours = harness.evaluate(evaluate_lib.CheckpointLM(str(folder / "out"), batch_size=4), TASKS,
                          include_path=str(tasks), **kwargs)
  ref = HFLM(pretrained=str(folder / "src"), dtype="float32", batch_size=4, device="cpu")
  theirs = evaluator.simple_evaluate(model=ref, tasks=TASKS, task_manager=harness.task_manager(str(tasks)), **kwargs)
  worst = 0.0
  for task in ("jt_mc", "jt_ppl"):
    for a, b in zip(_by_request(ours, task), _by_request(theirs, task), strict=True):
      for x, y in zip(a, b, strict=True):
        x, y = (x[0], y[0]) if isinstance(x[0], (list, tuple)) else (x, y)
        worst = max(worst, abs(x[0] - y[0]))
        if task == "jt_mc":
          assert x[1] == y[1]  # the greedy flag
  generated = _by_request(ours, "jt_gen")
  assert generated == _by_request(theirs, "jt_gen")
  assert any(g[0][0] for g in generated)  # something was generated
  mine, ref_metrics = harness.metrics(ours), harness.metrics(theirs)
  print(f"{family}: max |log-likelihood difference| {worst:.2e} over {sum(len(_by_request(ours, t)) for t in TASKS)} "
        f"docs; acc {mine['harness/jt_mc/acc']:.3f} (hf {ref_metrics['harness/jt_mc/acc']:.3f}); generations: "
        f"{[g[0][0] for g in generated][:3]}")
  assert worst < TOL
  for key in ("harness/jt_mc/acc", "harness/jt_mc/acc_norm", "harness/jt_gen/exact_match"):
    assert mine[key] == ref_metrics[key], key
  assert mine["harness/jt_ppl/word_perplexity"] == pytest.approx(ref_metrics["harness/jt_ppl/word_perplexity"],
                                                                  rel=1e-4)


# (b) Rolling log-likelihoods are the eval loss ---------------------------------------------------------------------


def test_rolling_loglikelihood_equals_the_eval_loss(llama_lm):
  """A document's rolling log-likelihood (the harness's perplexity tasks) is jaxtrain's eval loss on the same tokens
  (the prefix token, then the text's), per token within 1e-5."""
  from jaxtrain.train import step as step_lib
  lm = llama_lm
  text = " ".join(harness_data.SENTENCES[:4])
  from lm_eval.api.instance import Instance
  request = Instance("loglikelihood_rolling", {}, (text,), 0)
  rolling = lm.loglikelihood_rolling([request], disable_tqdm=True)[0]
  tokens = lm.tok_encode(text)
  assert 20 < len(tokens) < lm.max_length  # one window
  inputs = np.array([[lm.prefix_token_id] + tokens[:-1]], np.int32)
  batch = {"inputs": inputs, "targets": np.array([tokens], np.int32),
           "positions": np.arange(len(tokens), dtype=np.int32)[None], "segment_ids": np.ones_like(inputs),
           "loss_mask": np.ones_like(inputs)}
  loss_sum, count = jax.jit(step_lib.make_eval_step(lm.model))(lm.params, batch)
  eval_loss = float(loss_sum) / float(count)
  print(f"rolling {-rolling / len(tokens):.7f} per token, eval loss {eval_loss:.7f}")
  assert abs(-rolling / len(tokens) - eval_loss) < 1e-5


# (c) A few fixed shapes --------------------------------------------------------------------------------------------


def test_requests_of_any_length_compile_a_few_programs_once(llama_lm):
  """Requests of 3 to 120 tokens compile one program per row length they use (64 and 128 here); later requests
  of other lengths compile nothing (no jax compile event at all), and a request scores the same in any batch."""
  lm = llama_lm
  scorer = Scorer(lm.model, lm.mesh, lm.rules, lm.param_shardings, rows=lm.rows, max_length=lm.max_length)
  rng = np.random.default_rng(0)

  def requests(lengths):
    return [(rng.integers(2, 300, n).tolist(), max(1, n // 3)) for n in lengths]

  first = requests([3, 17, 40, 64, 65, 90, 120, 8, 33])
  out = scorer.score(lm.params, first)
  assert scorer.compiles == 2 and scorer.lengths == (64, 128)
  events = []
  listener = lambda event, duration, **kw: events.append(event)  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    again = scorer.score(lm.params, requests([5, 70, 110, 12, 50, 100, 2, 127]) + first[::-1])
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert scorer.compiles == 2
  assert not [e for e in events if "compil" in e], events
  assert [round(x, 4) for x, _ in again[-len(first):]] == [round(x, 4) for x, _ in out[::-1]]


# (d) The command line ----------------------------------------------------------------------------------------------


def _cli(*args, env=None, timeout=300):
  return forked.run(["-m", "jaxtrain.evaluate", *args], env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                                                              **(env or {})}, timeout=timeout)


def test_command_writes_the_harness_results(llama, llama_lm, tasks, tmp_path):
  """``python -m jaxtrain.evaluate`` prints the harness's table and writes its results JSON: the scores of the
  harness model in this process."""
  out = tmp_path / "results.json"
  result = _cli(f"--checkpoint={llama / 'out'}", "--tasks=jt_mc", f"--include_path={tasks}", f"--output={out}",
                "--batch_size=4")
  assert result.returncode == 0, result.stderr[-3000:]
  written = json.loads(out.read_text())
  assert "|jt_mc|" in result.stdout.replace(" ", "") and written["config"]["model"] == "CheckpointLM"
  direct = harness.evaluate(llama_lm, ["jt_mc"], include_path=str(tasks), bootstrap_iters=0)
  assert written["results"]["jt_mc"]["acc,none"] == direct["results"]["jt_mc"]["acc,none"]
  assert written["n-samples"]["jt_mc"]["effective"] == len(harness_data.MC)


@pytest.fixture(scope="module")
def no_tokenizer(llama, tmp_path_factory):
  """The Llama import with its tokenizer files removed."""
  import shutil
  folder = tmp_path_factory.mktemp("no_tokenizer") / "out"
  shutil.copytree(llama / "out", folder)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (folder / "hf" / name).unlink()
  return folder


@pytest.mark.parametrize("case", ["no_tokenizer", "not_a_checkpoint", pytest.param("unknown_task", marks=SLOW),
                                  pytest.param("hub_task_offline", marks=SLOW)])
def test_bad_input_gives_one_line_and_exit_2(case, llama, no_tokenizer, tasks, tmp_path):
  """The checkpoint is checked before the tasks, the tasks before any params are loaded; a name the include path
  does not hold makes the harness index all of its own tasks (~14 s: slow-marked)."""
  checkpoint = {"no_tokenizer": no_tokenizer, "not_a_checkpoint": tmp_path / "nothing"}.get(case, llama / "out")
  task = {"unknown_task": "jt_mcq", "hub_task_offline": "arc_easy"}.get(case, "jt_mc")
  out = tmp_path / "results.json"
  result = _cli(f"--checkpoint={checkpoint}", f"--tasks={task}", f"--include_path={tasks}", f"--output={out}")
  lines = [line for line in result.stderr.splitlines() if line.startswith("evaluate: error:")]
  assert result.returncode == 2, result.stderr[-3000:]
  assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  print(case, "->", lines[0])
  assert {"unknown_task": "jt_mcq: is not a task", "no_tokenizer": "carries no tokenizer",
          "hub_task_offline": "arc_easy: its data cannot be loaded", "not_a_checkpoint": "does not exist"}[case] in lines[0]
  assert not out.exists()

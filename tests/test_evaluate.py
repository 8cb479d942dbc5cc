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
def test_scores_equal_the_harness_hf_model(family, tasks, tmp_path, request):
  """Every log-likelihood within 1e-4 (float32), the same greedy flags, accuracies and generations; Qwen3 through
  its chat template (``apply_chat_template``). (Llama: the module's import and its model, which the other tests
  use, not a second copy of each.)"""
  from lm_eval import evaluator
  from lm_eval.models.huggingface import HFLM
  import jaxtrain.evaluate as evaluate_lib
  qwen = family == "qwen3"
  if qwen:
    folder = _import(tmp_path, qwen=True)
    lm = evaluate_lib.CheckpointLM(str(folder / "out"), batch_size=4)
  else:
    folder, lm = request.getfixturevalue("llama"), request.getfixturevalue("llama_lm")
  kwargs = dict(log_samples=True, bootstrap_iters=0, apply_chat_template=qwen)
  ours = harness.evaluate(lm, TASKS, include_path=str(tasks), **kwargs)
  ref = HFLM(pretrained=str(folder / "src"), dtype="float32", batch_size=4, device="cpu")
  # The task manager jaxtrain's evaluation built (the include path's tasks alone: indexing the harness's own
  # thousands as well costs ~15 s and changes none of these tasks).
  theirs = evaluator.simple_evaluate(model=ref, tasks=TASKS, task_manager=harness.task_manager(str(tasks), TASKS),
                                     **kwargs)
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


def test_the_harness_finds_the_jaxtrain_model():
  """``import jaxtrain.evaluate`` registers the harness model ``jaxtrain`` (what ``simple_evaluate(model="jaxtrain",
  model_args="checkpoint=...")`` builds)."""
  import jaxtrain.evaluate as evaluate_lib
  from lm_eval.api.registry import get_model
  assert get_model("jaxtrain") is evaluate_lib.CheckpointLM


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
  """Requests of 3 to 120 tokens compile one program per row length they use (64, 96, 128); later requests
  of other lengths compile nothing (no jax compile event at all), and a request scores the same in any batch."""
  lm = llama_lm
  scorer = Scorer(lm.model, lm.mesh, lm.rules, lm.param_shardings, rows=lm.rows, max_length=lm.max_length)
  rng = np.random.default_rng(0)

  def requests(lengths):
    return [(rng.integers(2, 300, n).tolist(), max(1, n // 3)) for n in lengths]

  first = requests([3, 17, 40, 64, 65, 90, 120, 8, 33])
  out = scorer.score(lm.params, first)
  assert scorer.compiles == 3 and scorer.lengths == (64, 96, 128)
  events = []
  listener = lambda event, duration, **kw: events.append(event)  # noqa: E731
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    again = scorer.score(lm.params, requests([5, 70, 110, 12, 50, 100, 2, 127]) + first[::-1])
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert scorer.compiles == 3
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


def _field_task(folder: pathlib.Path, tasks: pathlib.Path) -> pathlib.Path:
  """jt_mc as jt_field, whose doc_to_target names a field ('label') that its data lacks."""
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "field.yaml").write_text((tasks / "jt_mc.yaml").read_text().replace("task: jt_mc", "task: jt_field")
                                     .replace("{{answer}}", "{{label}}"))
  return folder


@pytest.mark.parametrize("case", ["no_tokenizer", "not_a_checkpoint", "field_the_data_lacks",
                                  pytest.param("unknown_task", marks=SLOW),
                                  pytest.param("hub_task_offline", marks=SLOW)])
def test_bad_input_gives_one_line_and_exit_2(case, llama, no_tokenizer, tasks, tmp_path):
  """The checkpoint is checked before the tasks, the tasks (built: their data loaded, their templates tried on a
  document) before any params are loaded; a name the include path does not hold makes the harness index all of its
  own tasks (~14 s: slow-marked)."""
  checkpoint = {"no_tokenizer": no_tokenizer, "not_a_checkpoint": tmp_path / "nothing"}.get(case, llama / "out")
  task = {"unknown_task": "jt_mcq", "hub_task_offline": "arc_easy", "field_the_data_lacks": "jt_field"}.get(case,
                                                                                                         "jt_mc")
  include = _field_task(tmp_path / "field", tasks) if case == "field_the_data_lacks" else tasks
  out = tmp_path / "results.json"
  result = _cli(f"--checkpoint={checkpoint}", f"--tasks={task}", f"--include_path={include}", f"--output={out}")
  lines = [line for line in result.stderr.splitlines() if line.startswith("evaluate: error:")]
  assert result.returncode == 2, result.stderr[-3000:]
  assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  print(case, "->", lines[0])
  expected = {"unknown_task": "jt_mcq: is not a task", "no_tokenizer": "carries no tokenizer",
              "hub_task_offline": "arc_easy: its data cannot be loaded", "not_a_checkpoint": "does not exist",
              "field_the_data_lacks": "jt_field: its doc_to_target names a field the data lacks ('label' is "
                                      "undefined); the data's fields are question, choices, answer: fix the task YAML"}
  assert expected[case] in lines[0]
  assert not out.exists()


def test_task_yaml_mistakes_are_one_line(tasks, tmp_path):
  """A task YAML that is not YAML (the harness's index skips it without a word), an output type the harness does not
  have, a template naming a field the data lacks: each a HarnessError naming the file or the task, when the tasks
  are built (what jaxtrain.evaluate and the run's config check do before anything is loaded)."""
  broken = tmp_path / "broken"
  broken.mkdir()
  (broken / "jt_broken.yaml").write_text('task: jt_broken\ndoc_to_text: "{{question}}\n')
  typo = tmp_path / "typo"
  typo.mkdir()
  (typo / "typo.yaml").write_text((tasks / "jt_mc.yaml").read_text().replace("task: jt_mc", "task: jt_typo")
                                  .replace("output_type: multiple_choice", "output_type: multiple_choise"))
  for folder, name, line in [
      (broken, "jt_broken", f"jt_broken: is not a task the harness knows, and the include path's {broken}/"
                            "jt_broken.yaml cannot be read (while scanning a quoted scalar: found unexpected end of "
                            "stream at line 3"),
      (typo, "jt_typo", "jt_typo: the harness cannot build the task (ValueError: Got invalid output_type "
                        "'multiple_choise'"),
      (_field_task(tmp_path / "field", tasks), "jt_field", "jt_field: its doc_to_target names a field the data lacks")]:
    with pytest.raises(harness.HarnessError) as e:
      harness.build_tasks([name], harness.task_manager([str(folder)], [name]))
    assert line in str(e.value), str(e.value)


# (e) Inside a run: eval.harness_tasks ------------------------------------------------------------------------------


def _run_args(tasks, workdir, steps=6):
  return ["--config=configs/tiny.py", f"--config.workdir={workdir}", "--config.data.seq_len=64",
          "--config.model.num_layers=2", "--config.model.d_model=64", "--config.model.num_heads=4",
          "--config.model.num_kv_heads=2", "--config.model.head_dim=16", "--config.model.mlp_dim=128",
          f"--config.train.steps={steps}", "--config.train.global_batch_size=8", "--config.train.log_every=1",
          "--config.optim.warmup_steps=1", "--config.checkpoint.every_steps=2",
          "--config.eval.harness_tasks=('jt_mc','jt_ppl')", "--config.eval.harness_every=2",
          "--config.eval.harness_limit=4", f"--config.eval.harness_include_path={tasks}"]


def _scores(workdir: pathlib.Path) -> dict[int, dict[str, float]]:
  """step -> its harness/... metrics (the last written, after a resume)."""
  out = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    scores = {k: v for k, v in r.items() if k.startswith("harness/")}
    if scores:
      out[r["step"]] = scores
  return out


@pytest.fixture(scope="module")
def harness_run(tasks, tmp_path_factory):
  """The tiny config (2 layers, byte-level, 6 steps) with the multiple-choice and perplexity tasks every 2 steps
  (4 documents each), uninterrupted, one process of 8 devices."""
  workdir = tmp_path_factory.mktemp("harness_run") / "run"
  result = forked.run(["-m", "jaxtrain.main", *_run_args(tasks, workdir)], timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


@pytest.mark.slow
def test_a_run_logs_harness_scores_at_its_steps(harness_run):
  """harness/<task>/<metric> at steps 2, 4 and 6 (metrics.jsonl, TensorBoard), counted as eval in goodput; the
  scores at step 6 are those of jaxtrain.evaluate on the step-6 checkpoint (the live params are the saved ones)."""
  import jaxtrain.evaluate as evaluate_lib
  scores = _scores(harness_run)
  assert sorted(scores) == [2, 4, 6]
  assert {"harness/jt_mc/acc", "harness/jt_mc/acc_norm", "harness/jt_ppl/word_perplexity",
          "harness/jt_ppl/bits_per_byte"} <= set(scores[6])
  assert scores[2] != scores[6]  # the model trained in between
  from tensorboard.backend.event_processing import event_accumulator  # the same scores in TensorBoard
  events = event_accumulator.EventAccumulator(os.fspath(harness_run / "tensorboard"))
  events.Reload()
  logged = events.Scalars("harness/jt_mc/acc")
  assert [e.step for e in logged] == [2, 4, 6]
  assert [e.value for e in logged] == pytest.approx([scores[s]["harness/jt_mc/acc"] for s in (2, 4, 6)])
  goodput = json.loads((harness_run / "goodput.json").read_text())
  assert goodput["seconds"]["eval"] > 1.0
  lm = evaluate_lib.CheckpointLM(str(harness_run), step=6, batch_size=8, max_length=64)
  tasks_dir = pathlib.Path(json.loads((harness_run / "config.json").read_text())["eval"]["harness_include_path"])
  offline = harness.metrics(harness.evaluate(lm, ["jt_mc", "jt_ppl"], include_path=str(tasks_dir), limit=4,
                                             bootstrap_iters=0))
  for key, value in scores[6].items():
    assert offline[key] == pytest.approx(value, rel=1e-4), key


@pytest.mark.slow
def test_harness_scores_resume_exactly_after_a_sigkill(harness_run, tasks, tmp_path):
  """SIGKILLed as it saves step 4 and resumed from step 2: the harness's scores at steps 2, 4 and 6 are those of
  the uninterrupted run, bitwise."""
  from tests import multiprocess
  import signal
  args = _run_args(tasks, tmp_path / "run")
  code = multiprocess.main_killed_at_save(4, args, tmp_path / "killed.log", timeout=600)
  assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
  result = forked.run(["-m", "jaxtrain.main", *args], timeout=600)
  assert result.returncode == 0 and "resumed from checkpoint step 2" in result.stderr, result.stderr[-3000:]
  assert _scores(tmp_path / "run") == _scores(harness_run)


@pytest.mark.slow
def test_two_processes_give_the_scores_of_one(harness_run, tasks, tmp_path):
  """The same run as 2 processes of 4 devices (every process runs the harness, process 0 writes): the same
  accuracies, the perplexities within 1e-4."""
  from tests import multiprocess
  procs = multiprocess.start_main(_run_args(tasks, tmp_path / "run"), num_processes=2, local_devices=4)
  codes = multiprocess.wait_all(procs, timeout=600)
  assert codes == [0, 0], [p.err_path.read_text()[-2000:] for p in procs]
  two, one = _scores(tmp_path / "run"), _scores(harness_run)
  assert sorted(two) == sorted(one) == [2, 4, 6]
  for step in one:
    for key, value in one[step].items():
      assert two[step][key] == pytest.approx(value, rel=1e-4), (step, key)
    assert {k: v for k, v in two[step].items() if "/acc" in k} == {k: v for k, v in one[step].items() if "/acc" in k}


@pytest.mark.parametrize("override, problem", [
    (dict(harness_tasks=("jt_mc", "")), "eval.harness_tasks: ('jt_mc', '') is not a tuple of task names"),
    (dict(harness_tasks=("jt_mc",)), "eval.harness_every: is 0 while eval.harness_tasks is set"),
    (dict(harness_tasks=("jt_mc",), harness_every=2, harness_limit=-1), "are not all >= 0"),
    (dict(harness_tasks=("jt_mc",), harness_every=2, harness_include_path="/nonexistent"), "is not a folder"),
    pytest.param(dict(harness_tasks=("shakespeare_mcq",), harness_every=2, harness_include_path=str(
        pathlib.Path(__file__).parents[1] / "docs/examples/tasks")), "eval.harness_tasks: shakespeare_mcq: is not a "
        "task the harness knows; see `lm_eval ls tasks` (did you mean shakespeare_mc", marks=SLOW),
    (dict(harness_tasks=("jt_mc",), harness_every=2, harness_fewshot_as_multiturn=True),
     "eval.harness_fewshot_as_multiturn: needs eval.harness_apply_chat_template=True"),
    (dict(harness_tasks=("jt_mc",), harness_every=2, harness_apply_chat_template=True),
     "eval.harness_apply_chat_template: the run's tokenizer (byte-level) has no chat template"),
])
def test_bad_harness_keys_are_one_line(override, problem):
  """The eval.harness_* keys are checked with the config, before anything is written, the task names too (a name
  the include path does not hold makes the harness index all of its own tasks: slow-marked)."""
  from jaxtrain import config as config_lib
  c = config_lib.base_config()
  c.eval.update(**override)
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate_values(c)
  assert problem in str(e.value)

"""Data mixtures (jaxtrain/data/mixture.py): token shares follow the weights and their stages, the same rows for
any process or worker count, each component's own position kept through weight and component changes and
process-count changes, per-component metrics and eval losses equal to an independent computation, eval sets,
bad input in one line, and exact resume after SIGKILLs."""

import json
import os
import pathlib
import random
import signal
import sys

import jax
import numpy as np
import optax
import pytest

from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain import models
from jaxtrain.data import folders, loader, mixture, packing, prepare
from jaxtrain.train import trainer
from configs import tiny
from tests import forked, multiprocess
from tests.conftest import small_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = ("books", "code", "web")  # name order: the components' ids in batches' "sources"


def _paragraphs() -> list[str]:
  text = prepare.BUNDLED.read_text()
  return [p.strip("\n") for p in text.split("\n\n") if p.strip()]


@pytest.fixture(scope="module")
def components(tmp_path_factory):
  """Three prepared folders of different Shakespeare paragraphs and sizes (books small: it repeats), and a raw
  JSONL folder (a component needs no preparation)."""
  tmp = tmp_path_factory.mktemp("mixture")
  paragraphs = _paragraphs()
  sizes = {"web": paragraphs[0::3][:1500], "code": paragraphs[1::3][:800], "books": paragraphs[2::3][:200]}
  out = {}
  for name, docs in sizes.items():
    (tmp / f"{name}_in").mkdir()
    (tmp / f"{name}_in" / "a.txt").write_text("\n\n".join(docs) + "\n")
    out[name] = os.fspath(tmp / name)
    prepare.prepare(prepare.Options(inputs=[os.fspath(tmp / f"{name}_in")], output=out[name], progress=False,
                                    eval_fraction=0.05, seed=len(name)))
  (tmp / "raw").mkdir()
  (tmp / "raw" / "part.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in paragraphs[-300:]))
  out["raw"] = os.fspath(tmp / "raw")
  return out


def _config(workdir, mixture_spec, **data):
  c = small_config(workdir)
  c.data.update(source="arrayrecord", seq_len=64, **data)
  c.data.mixture = mixture_spec
  c.train.global_batch_size = 8
  c.metrics.tensorboard = False
  return config_lib.resolve(c)


def _spec(paths, weights) -> str:
  return ",".join(f"{n}={paths[n]}:{w}" for n, w in weights.items())


def _take(it, n):
  return [next(it) for _ in range(n)]


def _stream(c, n, process_index=0, process_count=1, workers=0, state=None):
  """``n`` batches of process ``process_index`` of ``process_count`` (from ``state`` if given), and its state."""
  c = c.copy_and_resolve_references()
  c.data.num_workers = workers
  it = loader.TrainIterator(mixture.train_dataset(c, process_index, process_count), c.train.global_batch_size,
                            process_index, process_count)
  try:
    if state is not None:
      it.set_state(state)
    return _take(it, n), json.loads(json.dumps(it.get_state()))
  finally:
    data_lib.close(it)


def _shares(batches, count=3):
  tokens = np.zeros(count)
  for b in batches:
    for k in range(count):
      tokens[k] += b["loss_mask"][b["sources"] == k].sum()
  return tokens / tokens.sum()


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_token_shares_follow_the_weights_the_same_for_any_process_or_worker_count(components, tmp_path):
  weights = {"web": 0.6, "code": 0.3, "books": 0.1}
  c = _config(tmp_path, _spec(components, weights))
  batches, _ = _stream(c, 250)  # 2,000 rows
  shares = _shares(batches)
  np.testing.assert_allclose(shares, [weights[n] for n in NAMES], atol=0.02)
  assert set(np.unique(np.concatenate([b["sources"] for b in batches]))) == {0, 1, 2}
  assert all((b["sources"] == b["sources"][:, :1]).all() for b in batches)  # each row from one component
  # Two processes' rows are the single process's global batch; so are 2 Grain workers'.
  halves = [_stream(c, 12, i, 2)[0] for i in range(2)]
  _assert_same([{k: np.concatenate([h[s][k] for h in halves]) for k in halves[0][s]} for s in range(12)],
               batches[:12])
  _assert_same(_stream(c, 12, workers=2)[0], batches[:12])
  two_by_two = [_stream(c, 12, i, 2, workers=2)[0] for i in range(2)]
  _assert_same([{k: np.concatenate([h[s][k] for h in two_by_two]) for k in two_by_two[0][s]} for s in range(12)],
               batches[:12])
  # Weights of another scale, and the components listed in another order, change nothing.
  same = _config(tmp_path, _spec(components, {"books": 1, "web": 6, "code": 3}))
  assert same.data.mixture == c.data.mixture.replace(":0.1", ":1.0").replace(":0.3", ":3.0").replace(":0.6", ":6.0")
  _assert_same(_stream(same, 12)[0], batches[:12])


def test_shares_follow_the_stages_at_once_or_ramped(components, tmp_path):
  c = _config(tmp_path, _spec(components, {"web": 0.5, "code": 0.5}),
              mixture_stages="10:web=0.9,code=0.1")
  batches, _ = _stream(c, 60)
  web = 1  # components in name order: code, web
  assert _shares(batches[:10], 2)[web] == pytest.approx(0.5, abs=0.05)  # 80 rows at 0.5 / 0.5
  assert _shares(batches[10:], 2)[web] == pytest.approx(0.9, abs=0.02)  # 400 rows at 0.9 / 0.1
  sched = mixture.schedule(c)
  np.testing.assert_allclose(sched.weights(9), [0.5, 0.5])
  np.testing.assert_allclose(sched.weights(10), [0.1, 0.9])
  ramp = mixture.schedule(_config(tmp_path, c.data.mixture, mixture_stages="10:web=0.9,code=0.1;30:web=0,code=1",
                                  mixture_ramp=True))
  np.testing.assert_allclose([ramp.weights(k)[1] for k in (0, 5, 10, 20, 30, 99)], [0.5, 0.7, 0.9, 0.45, 0, 0])
  assert {ramp(k, lane) for k in range(30, 40) for lane in range(8)} == {0}  # a weight of 0 is never drawn


def _lane_rows(batches, lanes=8):
  """(component, lane) -> the rows that lane read from that component, in order (documents and positions)."""
  out = {}
  for b in batches:
    for lane in range(lanes):
      c = int(b["sources"][lane, 0])
      row = (b["doc_ids"][lane] & ((1 << packing.SOURCE_SHIFT) - 1), b["positions"][lane])
      out.setdefault((NAMES[c], lane), []).append(row)
  return out


def _alone(c, path, name, lane, n):
  """The first ``n`` rows lane ``lane`` of component ``name`` (at ``path``) packs on its own: documents and
  positions."""
  folder = folders.open_folder(name, path, c, name)
  it = iter(packing.PackedLanes(mixture._order(c, folder, 8), folder.train, [lane], 8, c.data.seq_len + 1))
  return [(r["doc_ids"][:-1], r["positions"][:-1]) for r in _take(it, n)]


def test_changes_of_weights_and_components_on_resume_keep_each_components_position(components, tmp_path):
  """Weights changed, a component removed, then added back: every lane of every component reads on exactly
  where it was (compared with the component packed alone), nothing read twice, nothing skipped."""
  first = _config(tmp_path, _spec(components, {"web": 0.2, "code": 0.3, "books": 0.5}))
  second = _config(tmp_path, _spec(components, {"web": 0.7, "code": 0.3}))  # books removed
  third = _config(tmp_path, _spec(components, {"web": 0.1, "code": 0.1, "books": 0.8}))  # and back
  a, state = _stream(first, 15)
  assert "books" in state["parts"]
  b, state = _stream(second, 15, state=state)
  assert state["parts"]["books"] == json.loads(json.dumps(_stream(first, 15)[1]))["parts"]["books"]  # kept
  assert all(int(x["sources"].max()) < 2 for x in b)
  # The second config's component ids differ (code 0, web 1): map them back to names before comparing.
  b = [{**x, "sources": np.where(x["sources"] == 0, 1, 2)} for x in b]
  c, _ = _stream(third, 15, state=state)
  rows = _lane_rows(a + b + c)
  assert {name for name, _ in rows} == set(NAMES)
  for (name, lane), got in rows.items():
    want = _alone(first, components[name], name, lane, len(got))
    for (docs, positions), (want_docs, want_positions) in zip(got, want):
      np.testing.assert_array_equal(docs[docs >= 0], want_docs[want_docs >= 0])
      np.testing.assert_array_equal(positions, want_positions)


@pytest.mark.parametrize("before,after,workers", [(2, 1, (0, 0)), (1, 2, (0, 2)), (2, 1, (2, 0))])
def test_mixture_position_moves_to_another_process_count(components, tmp_path, before, after, workers):
  c = _config(tmp_path, _spec(components, {"web": 0.5, "code": 0.3, "raw": 0.2}),
              mixture_stages="4:web=0.1,code=0.1,raw=0.8")
  expected = _stream(c, 6)[0][3:]
  saved = [_stream(c, 3, i, before, workers[0])[1] for i in range(before)]
  parts = []
  for i in range(after):
    it = loader.TrainIterator(mixture.train_dataset(c, i, after), 8, i, after)
    it.set_state(it.resplit(saved))
    parts.append(_take(it, 3))
    data_lib.close(it)
  for s in range(3):
    for k in expected[s]:
      np.testing.assert_array_equal(np.concatenate([p[s][k] for p in parts]), expected[s][k])


def _direct(config, params, batches, sources=None):
  """Sums of token cross entropies and real targets (float64), per component id when ``sources``."""
  model = models.Model.from_config(config.model)
  losses_of = jax.jit(lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
      model.apply(p, b["inputs"], b["positions"], b["segment_ids"]), b["targets"]))
  sums, tokens = np.zeros(sources or 1), np.zeros(sources or 1)
  for b in batches:
    losses = np.asarray(losses_of(params, {k: b[k] for k in ("inputs", "positions", "segment_ids", "targets")}))
    ids = b["sources"] if sources else np.zeros_like(b["targets"])
    for k in range(sources or 1):
      mask = b["loss_mask"] * (ids == k)
      sums[k] += float(np.sum(losses.astype(np.float64) * mask))
      tokens[k] += float(mask.sum())
  return sums, tokens


@pytest.mark.parametrize("mesh,microbatches", [(dict(data=2, fsdp=2, tensor=2), 2), (dict(pipeline=2, fsdp=4), 4)])
def test_step_reports_each_components_token_share_and_loss(components, tmp_path, mesh, microbatches):
  c = small_config(tmp_path, **mesh)
  c.data.update(source="arrayrecord", seq_len=64, mixture=_spec(components, {"web": 0.5, "code": 0.3, "books": 0.2}))
  c.train.update(global_batch_size=16, microbatches=microbatches)
  run = trainer.build(c)
  assert run.sources == NAMES
  step_fn, state = trainer.compile_step(run), trainer.init_state(run)
  data = data_lib.open_train(run.config)
  try:
    batch = next(data)
  finally:
    data_lib.close(data)
  params = jax.device_get(state.params)
  _, metrics = step_fn(state, data_lib.to_global(batch, run.batch_sharding), np.bool_(False))
  metrics = jax.device_get(metrics)
  sums, tokens = _direct(run.config, params, [batch], sources=3)
  for k, name in enumerate(NAMES):
    np.testing.assert_allclose(metrics[f"mix/{name}"], tokens[k] / tokens.sum(), rtol=1e-6)
    np.testing.assert_allclose(metrics[f"loss/{name}"], sums[k] / tokens[k], rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], sums.sum() / tokens.sum(), rtol=1e-5)
  assert metrics["tokens"] == tokens.sum()


def test_eval_per_component_and_eval_sets_equal_an_independent_computation(components, tmp_path):
  c = small_config(tmp_path, data=2, fsdp=4)
  c.data.update(source="arrayrecord", seq_len=64, mixture=_spec(components, {"web": 0.7, "code": 0.3}))
  c.train.update(steps=3, global_batch_size=8)
  c.eval.update(every_steps=3, max_batches=3, sets=f"books={components['books']},raw={components['raw']}")
  c.metrics.tensorboard = False
  c.checkpoint.verify = False
  state, _ = trainer.train(c)
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in records if "eval_loss" in r]
  train = [r for r in records if "loss" in r]
  assert [r["step"] for r in evals] == [3] and all({"mix/code", "mix/web", "loss/web"} <= r.keys() for r in train)
  ev = evals[0]
  assert sorted(k for k in ev if k.startswith("eval_loss/")) == ["eval_loss/books", "eval_loss/code",
                                                                 "eval_loss/raw", "eval_loss/web"]
  params = jax.device_get(state.params)
  resolved = config_lib.resolve(c)
  total = [0.0, 0.0]
  for name in ("code", "web"):
    folder = folders.open_folder(name, components[name], resolved, name)
    sums, tokens = _direct(resolved, params, mixture.eval_batches(folder, resolved, 0, 1))
    np.testing.assert_allclose(ev[f"eval_loss/{name}"], sums[0] / tokens[0], rtol=1e-5)
    total = [total[0] + sums[0], total[1] + tokens[0]]
  np.testing.assert_allclose(ev["eval_loss"], total[0] / total[1], rtol=1e-5)  # token-weighted over components
  assert ev["eval_tokens"] == total[1]
  for name in ("books", "raw"):  # eval sets: every document of the folder, not in eval_loss
    folder = folders.open_folder(name, components[name], resolved, name, whole=True)
    documents = json.loads(pathlib.Path(components[name], "manifest.json").read_text())["documents"] \
        if name == "books" else 300
    assert folder.held_out_docs == documents
    sums, tokens = _direct(resolved, params, mixture.eval_batches(folder, resolved, 0, 1))
    np.testing.assert_allclose(ev[f"eval_loss/{name}"], sums[0] / tokens[0], rtol=1e-5)


MIX = "--config.data.mixture=web={web}:0.6,code={code}:0.4"
# (arguments, text the one error line must contain); the first three also through the command line (exit 2,
# one line, nothing written), the others where main gets them from (the config's validation).
BAD = [
    (["--config.data.mixture=web={web}:0.6,code={tmp}/nowhere:0.4"],
     "data.mixture (code): {tmp}/nowhere: no such file or folder"),
    (["--config.data.mixture=web={web}:0.6,code={code}:lots"], "data.mixture: the weight 'lots' of 'code' is not a "
                                                                "number"),
    (["--config.data.mixture=web={web}:0.6,sp={sp}:0.4"], "data.mixture (web): {web} was made with tokenizer byte, "
                                                           "but 'sp' with sentencepiece:sp.model:"),
    (["--config.data.mixture=web={web}"], "data.mixture: 'web={web}' is not name=path:weight"),
    (["--config.data.mixture=web={web}:0.6,code={code}:-0.4"], "data.mixture: the weight -0.4 of 'code' is negative"),
    (["--config.data.mixture=web={web}:0,code={code}:0"], "data.mixture: every weight is 0"),
    (["--config.data.mixture=web={web}:1,web={code}:1"], "data.mixture: 'web' is named twice"),
    ([MIX, "--config.data.mixture_stages=5:web=0.5"], "data.mixture_stages: the stage at step 5 gives no weight to "
                                                      "'code'"),
    ([MIX, "--config.data.mixture_stages=5:web=0.5,code=0.5,books=1"], "the stage at step 5 names 'books'"),
    ([MIX, "--config.data.path={web}"], "data.path: is set together with data.mixture"),
    ([MIX, "--config.eval.sets=web={code}", "--config.eval.every_steps=5"], "eval.sets: 'web' is also a component"),
    ([MIX, "--config.eval.sets=x={code}"], "eval.sets: is set but eval.every_steps=0"),
    (["--config.data.mixture=raw={raw}:1", "--config.eval.every_steps=5"], "eval.every_steps: is set but no "
                                                                           "component of data.mixture holds eval"),
]
COMMAND_LINE = 3


@pytest.fixture(scope="module")
def other_tokenizer(components, tmp_path_factory):
  """A component prepared with a SentencePiece tokenizer (the others: bytes)."""
  spm = pytest.importorskip("sentencepiece", reason="the [data] extra (sentencepiece) is not installed")
  tmp = tmp_path_factory.mktemp("sp")
  corpus = tmp / "c.txt"
  corpus.write_text(prepare.BUNDLED.read_text()[:50_000])
  spm.SentencePieceTrainer.train(input=os.fspath(corpus), model_prefix=os.fspath(tmp / "sp"), vocab_size=100,
                                 minloglevel=2)
  prepare.prepare(prepare.Options(inputs=[os.fspath(corpus)], output=os.fspath(tmp / "data"),
                                  tokenizer=os.fspath(tmp / "sp.model"), progress=False))
  return os.fspath(tmp / "data")


@pytest.fixture(scope="module")
def command_line_mistakes(components, other_tokenizer, tmp_path_factory):
  """Per command-line case of BAD: (its values, its workdir, the result), the commands run as forks of one process
  (tests/forked.py)."""
  cases = []
  for args, _ in BAD[:COMMAND_LINE]:
    tmp = tmp_path_factory.mktemp("mistake")
    cases.append(({**components, "tmp": os.fspath(tmp), "sp": other_tokenizer}, tmp / "run", args))
  results = forked.run_many([["-m", "jaxtrain.main", "--config=configs/tiny.py", f"--config.workdir={workdir}",
                              *(a.format(**values) for a in args)] for values, workdir, args in cases])
  return [(values, workdir, r) for (values, workdir, _), r in zip(cases, results)]


@pytest.mark.parametrize("case", range(COMMAND_LINE), ids=[a[-1].split("=", 1)[1][:40] for a, _ in BAD[:COMMAND_LINE]])
def test_bad_mixture_input_is_one_line_exit_2_nothing_written(case, command_line_mistakes):
  message, (values, workdir, r) = BAD[case][1], command_line_mistakes[case]
  errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
  assert message.format(**values) in errors[0], errors[0]
  assert "Traceback" not in r.stderr
  assert not workdir.exists()  # refused before anything is written


@pytest.mark.parametrize("args,message", BAD[COMMAND_LINE:], ids=[a[-1].split("=", 1)[1][:40] for a, _ in
                                                                  BAD[COMMAND_LINE:]])
def test_bad_mixture_config_is_refused_by_validation(components, tmp_path, args, message):
  values = {**components, "tmp": os.fspath(tmp_path)}
  c = tiny.get_config()  # what the command line would run
  c.workdir = os.fspath(tmp_path / "run")
  for arg in args:
    key, value = arg.format(**values)[len("--config."):].split("=", 1)
    group, name = key.split(".")
    c[group][name] = int(value) if value.isdigit() else value
  with pytest.raises(config_lib.UserError) as e:
    config_lib.resolve(c)
  assert message.format(**values) in str(e.value)
  assert not (tmp_path / "run").exists()


def _records(workdir) -> dict:
  """step -> the last training record logged for it: its loss, token count and per-component metrics."""
  out = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    if "loss" in r:
      out[r["step"]] = {k: v for k, v in r.items() if k in ("loss", "tokens") or k.startswith(("mix/", "loss/"))}
  return out


@pytest.mark.slow
def test_sigkills_at_random_steps_resume_to_the_uninterrupted_batches_and_losses(components, tmp_path, monkeypatch):
  steps, boundary = 20, 10  # 0.5 / 0.5 for 10 steps, then 0.9 / 0.1
  # Its runs (forked: the flag is read when their backend starts) on 2 simulated devices, not 8: the kills and
  # resumes are the point, and a step takes a fraction of the time.
  monkeypatch.setenv("XLA_FLAGS", f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=2")
  args = ["--config=configs/tiny.py", f"--config.data.mixture=web={components['web']}:0.5,"
          f"code={components['code']}:0.5", f"--config.data.mixture_stages={boundary}:web=0.9,code=0.1",
          "--config.data.seq_len=64", f"--config.train.steps={steps}", "--config.train.log_every=1",
          "--config.checkpoint.every_steps=1", "--config.metrics.tensorboard=False"]
  r = forked.run(["-m", "jaxtrain.main", *args, f"--config.workdir={tmp_path / 'a'}"])
  assert r.returncode == 0, r.stderr[-3000:]
  # Three kills at steps drawn at random (seeded, so a failure reproduces: 5, 9, 11); each run resumes from the
  # step before its kill and is killed again further on; one run is killed after crossing the stage boundary.
  kills = sorted(random.Random(4).sample(range(2, steps), 3))
  resumes = [0] + [k - 1 for k in kills]  # run i starts after step resumes[i] and is killed at step kills[i]
  assert any(start <= boundary < kill for start, kill in zip(resumes, kills)), kills
  for kill in kills:
    code = multiprocess.main_killed_at_save(kill, [*args, f"--config.workdir={tmp_path / 'b'}"],
                                            tmp_path / "killed.log")
    assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
  r = forked.run(["-m", "jaxtrain.main", *args, f"--config.workdir={tmp_path / 'b'}"])
  assert r.returncode == 0 and f"resumed from checkpoint step {kills[-1] - 1}" in r.stderr, r.stderr[-3000:]
  want, got = _records(tmp_path / "a"), _records(tmp_path / "b")
  assert sorted(want) == list(range(1, steps + 1))
  assert got == want  # the same batches: token counts, shares and every loss bitwise equal
  assert np.mean([want[s]["mix/web"] for s in range(boundary + 1, steps + 1)]) > 0.85
  assert np.mean([want[s]["mix/web"] for s in range(1, boundary + 1)]) == pytest.approx(0.5, abs=0.1)


def test_plot_tool_draws_each_components_share_and_losses(tmp_path):
  sys.path.insert(0, str(ROOT))
  from tools import plot_metrics
  records = [{"step": s, "loss": 3.0 / s, "tokens_per_sec": 1.0, "grad_norm": 1.0, "lr": 1e-3,
              "mix/code": 0.25 * s, "mix/web": 1 - 0.25 * s, "loss/web": 2.0 / s} for s in (1, 2)]
  records.append({"step": 2, "eval_loss": 1.5, "eval_loss/web": 1.4, "eval_loss/letters": 1.9})
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  fig = plot_metrics.figure([plot_metrics.read(str(tmp_path))])
  share, losses = fig.axes[4:]
  assert share.get_title() == "mixture: token share per component"
  lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
           for ax in (share, losses) for line in ax.get_lines()}
  assert lines == {"mix/code": ([1, 2], [0.25, 0.5]), "mix/web": ([1, 2], [0.75, 0.5]),
                   "loss/web": ([1, 2], [2.0, 1.0]), "eval_loss/web": ([2], [1.4]), "eval_loss/letters": ([2], [1.9])}

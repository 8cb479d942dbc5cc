"""Observability: FLOPs and MFU, writers, NaN policies, anomaly warnings, watchdog, plots, profiler."""

import functools
import json
import os
import pathlib
import re
import threading

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import llama3_8b
from jaxtrain import data as data_lib
from jaxtrain import _compat, exits, integrity, metrics, models, monitor
from jaxtrain.data import loader, prepare
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.metrics import read_records
from jaxtrain.train import loop, trainer
from jaxtrain.train import step as step_lib
from tests import forked
from tests.conftest import count_dispatched_steps

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_llama3_8b_flops_per_token_is_6n_plus_attention():
  config = llama3_8b.get_config()
  model = models.Model.from_config(config.model)
  n_without_input_embedding = 8_030_261_248 - 128_256 * 4096
  attention = 12 * 32 * 32 * 128 * 8192
  expected = 6 * n_without_input_embedding + attention
  assert abs(metrics.flops_per_token(model, 8192) - expected) / expected < 0.01


def test_peak_table():
  assert metrics.peak_flops_per_device(2.5) == 2.5e12
  class Kind:
    def __init__(self, kind):
      self.device_kind = kind
  assert metrics.peak_flops_per_device(0, Kind("TPU v5 lite")) == 197e12
  assert metrics.peak_flops_per_device(0, Kind("NVIDIA H100 80GB HBM3")) == 989e12
  assert metrics.peak_flops_per_device(0, Kind("cpu")) is None


# FLOPs per token of small_config (tests/conftest.py) at seq_len 32. Its parameters: 2 layers of q (64 x 128),
# k and v (64 x 64 each), o (128 x 64), gate, up and down (64 x 128 each) and two norms (64 each): 49,280 per
# layer; a final norm (64); a token table (256 x 64) and, untied, an output projection (64 x 256).
SMALL_LAYERS, SMALL_TABLE = 2 * 49_280 + 64, 256 * 64
SMALL_ATTENTION = 12 * 2 * 8 * 16 * 32  # 12 x layers x heads x head_dim x seq_len
SMALL_FLOPS_PER_TOKEN = 6 * (SMALL_LAYERS + SMALL_TABLE) + SMALL_ATTENTION


def test_flops_per_token_counts_the_output_projection_once_tied_or_not(make_config):
  untied = models.Model.from_config(make_config().model)
  tied_config = make_config()
  tied_config.model.tie_embeddings = True
  tied = models.Model.from_config(tied_config.model)
  assert untied.num_params() == SMALL_LAYERS + 2 * SMALL_TABLE and tied.num_params() == SMALL_LAYERS + SMALL_TABLE
  # The input lookup is no matmul; the output projection is, with its own matrix or with the shared table.
  assert metrics.flops_per_token(untied, 32) == metrics.flops_per_token(tied, 32) == SMALL_FLOPS_PER_TOKEN == 788_352


@pytest.mark.slow
def test_mfu_on_console_jsonl_and_tensorboard(make_config, caplog):
  from tensorboard.backend.event_processing import event_accumulator
  config = make_config(fsdp=8)
  peak = 0.01e12
  config.metrics.peak_tflops = 0.01  # a made-up CPU peak per device (FLOP/s = 1e12 x this), so that MFU is reported
  with caplog.at_level("INFO"):
    _, history = trainer.train(config)
  records = read_records(config.workdir)
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
  assert metrics.flops_per_token(trainer.build(config).model, 32) == SMALL_FLOPS_PER_TOKEN
  for r in records:  # one step per log; every synthetic position is a target: 16 x 32 tokens per step
    np.testing.assert_allclose(r["tokens_per_sec"], 16 * 32 / r["step_time"], rtol=1e-12)
    np.testing.assert_allclose(r["tflops_per_device"], SMALL_FLOPS_PER_TOKEN * r["tokens_per_sec"] / 8 / 1e12,
                               rtol=1e-12)
    np.testing.assert_allclose(r["mfu"], SMALL_FLOPS_PER_TOKEN * r["tokens_per_sec"] / (8 * peak), rtol=1e-12)
  # The console shows the very figures of metrics.jsonl.
  lines = [rec.getMessage() for rec in caplog.records if re.match(r"step \d+/5 \| ", rec.getMessage())]
  assert lines == [f"step {r['step']}/5 | loss {r['loss']:.4f} | grad_norm {r['grad_norm']:.3f} | lr {r['lr']:.2e} | "
                   f"{r['tokens_per_sec']:,.0f} tok/s | {r['tflops_per_device']:.3g} TFLOP/s/device | "
                   f"MFU {100 * r['mfu']:.1f}% | {r['step_time']:.3f}s/step" for r in records]
  events = event_accumulator.EventAccumulator(os.fspath(pathlib.Path(config.workdir) / "tensorboard"))
  events.Reload()
  tags = events.Tags()["scalars"]
  assert {"loss", "mfu", "tokens_per_sec", "grad_norm", "lr", "data_wait_s"} <= set(tags)
  for tag in ("loss", "mfu", "tokens_per_sec"):
    assert [e.step for e in events.Scalars(tag)] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([e.value for e in events.Scalars(tag)], [r[tag] for r in records], rtol=1e-6)
  np.testing.assert_allclose(records[-1]["loss"], history[-1]["loss"], rtol=1e-12)


class Poisoned(SyntheticSource):
  """Batch `bad` (0-based) carries a NaN in its loss mask, so that step's loss and gradients are NaN."""

  def __init__(self, bad, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.bad = bad

  def __next__(self):
    bad = self.step == self.bad
    batch = super().__next__()
    if bad:
      batch["loss_mask"][0, 0] = np.nan
    return batch


class Without(SyntheticSource):
  """The same stream with batch `drop` left out."""

  def __init__(self, drop, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.drop = drop

  def __next__(self):
    if self.step == self.drop:
      self.step += 1
    return super().__next__()


def _nan_config(make_config, workdir, policy, steps):
  config = make_config(fsdp=8)
  config.workdir = str(workdir)
  config.train.steps = steps
  config.optim.update(schedule="constant", warmup_steps=0)  # so a skipped step does not shift the schedule
  config.monitor.nan_policy = policy
  config.checkpoint.every_steps = 3
  return config


def _assert_checkpoints_finite(workdir):
  root = pathlib.Path(workdir) / "checkpoints"
  steps = [p for p in root.iterdir() if p.name.isdigit()]
  assert steps
  for step in steps:
    with ocp.StandardCheckpointer() as ckptr:
      state = ckptr.restore(step / "state")
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_nan_step_is_skipped_and_never_checkpointed(make_config, tmp_path, policy, caplog):
  args = (32, 256, 16, 0)
  reference = _nan_config(make_config, tmp_path / "ref", "skip", 7)
  ref_state, _ = trainer.train(reference, data=Without(4, *args))
  config = _nan_config(make_config, tmp_path / policy, policy, 8)
  with caplog.at_level("WARNING"):
    state, history = trainer.train(config, data=Poisoned(4, *args))
  assert "step 5: non-finite loss, gradients or updated state; update not applied" in caplog.text
  if policy == "rollback":
    assert "back to checkpoint step 3" in caplog.text
  report = json.loads(pathlib.Path(config.workdir, "bad_batches.jsonl").read_text().splitlines()[0])
  assert report["step"] == 5 and report["source"] == "synthetic (seed 0, batch 4)"
  # Skip drops the update once; rollback drops it when seen and again when the replay reaches that batch.
  assert int(state.step) == 8 and history[-1]["skipped_steps"] == (1 if policy == "skip" else 2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7),
               state.params, ref_state.params)
  _assert_checkpoints_finite(config.workdir)


def test_nan_policy_stop(make_config, tmp_path):
  config = _nan_config(make_config, tmp_path, "stop", 8)
  with pytest.raises(trainer.TrainingStopped, match="step 5: non-finite"):
    trainer.train(config, data=Poisoned(4, 32, 256, 16, 0))
  _assert_checkpoints_finite(config.workdir)
  import threading  # the watchdog must not outlive the run (it would kill this process later)
  assert not any(t.name == "jaxtrain-watchdog" for t in threading.enumerate())


# A learning rate of 1e30 turns the params huge (but finite) at step 1; every later step's loss is non-finite:
# a problem that persists whatever the batch, as a diverged model or a bad optimizer state would.
DIVERGING = ["--config=configs/tiny.py", "--config.train.global_batch_size=8", "--config.data.seq_len=64",
             "--config.train.log_every=1", "--config.optim.lr=1e30", "--config.optim.warmup_steps=0",
             "--config.optim.schedule=constant"]


def _main(*args):
  return forked.run(["-m", "jaxtrain.main", *DIVERGING, *args])  # forked from a process with jax imported


@pytest.mark.slow
def test_persistent_non_finite_steps_under_skip_roll_back_then_stop(tmp_path):
  r = _main(f"--config.workdir={tmp_path}", "--config.train.steps=20", "--config.checkpoint.every_steps=1",
            "--config.monitor.max_consecutive_nonfinite=3")
  assert r.returncode == 1, r.stderr[-3000:]
  # Steps 2-4 fail: back to checkpoint 1; the replay skips their batches, 5-7 fail again: stop.
  assert "rollback at step 4 (3 non-finite step(s) in a row): back to checkpoint step 1" in r.stderr
  assert r.stderr.strip().splitlines()[-1] == (
      "jaxtrain: stopped: step 7: 3 non-finite step(s) in a row again after 1 rollback(s) to checkpoint step 1; "
      f"the checkpoints are intact (steps: [1]): look at {tmp_path / 'bad_batches.jsonl'}, lower optim.lr or fix "
      "the data")
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]  # never carried past the problem
  _assert_checkpoints_finite(tmp_path)


@pytest.mark.slow
def test_rollback_policy_stops_after_too_many_rollbacks_to_one_checkpoint(tmp_path):
  r = _main(f"--config.workdir={tmp_path}", "--config.train.steps=20", "--config.checkpoint.every_steps=1",
            "--config.monitor.max_consecutive_nonfinite=3", "--config.monitor.nan_policy=rollback")
  assert r.returncode == 1, r.stderr[-3000:]
  # Each new step fails and rolls back to 1 (the replays skip the known ones): 2, 3, 4, then 5 is one too many.
  assert [line.split("rollback at step ")[1][:2] for line in r.stderr.splitlines() if "rollback at step" in line] \
      == ["2 ", "3 ", "4 "]
  assert r.stderr.strip().splitlines()[-1] == (
      "jaxtrain: stopped: step 5: a non-finite step again after 3 rollback(s) to checkpoint step 1; the checkpoints "
      f"are intact (steps: [1]): look at {tmp_path / 'bad_batches.jsonl'}, lower optim.lr or fix the data")


def test_a_run_never_exits_0_when_its_last_steps_were_non_finite(tmp_path):
  r = _main(f"--config.workdir={tmp_path}", "--config.train.steps=3")  # steps 2 and 3 fail, fewer than the limit
  assert r.returncode == 1, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == (
      "jaxtrain: stopped: step 3: 2 non-finite step(s) in a row and no checkpoint to roll back to; nothing was "
      "saved: lower optim.lr or fix the data, or save earlier with checkpoint.every_steps")
  assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.slow
def test_nan_policy_stop_on_the_command_line(tmp_path):
  r = _main(f"--config.workdir={tmp_path}", "--config.train.steps=20", "--config.checkpoint.every_steps=1",
            "--config.monitor.nan_policy=stop")
  assert r.returncode == 1, r.stderr[-3000:]
  # Step 1 is finite and saved; step 2 is the first non-finite one: the run stops there, in one line.
  message = ("jaxtrain: stopped: step 2: non-finite loss, gradients or updated state and monitor.nan_policy=stop; "
             "the last checkpoint is intact (steps: [1])")
  assert [line for line in r.stderr.splitlines() if line.startswith("jaxtrain:")] == [message], r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == message and "Traceback" not in r.stderr
  assert [json.loads(line)["step"] for line in (tmp_path / "bad_batches.jsonl").read_text().splitlines()] == [2]
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
  _assert_checkpoints_finite(tmp_path)


def test_non_finite_values_injected_into_a_live_state_never_reach_a_checkpoint(make_config, tmp_path, caplog,
                                                                               monkeypatch):
  """A fault in device memory (here: NaN written into AdamW's second moment before step 7): the step's guard
  reports it non-finite and keeps it out of the params, no checkpoint is written from it, and the run rolls back
  to the last good checkpoint and finishes."""
  compile_step, poisoned = trainer.compile_step, []

  def compile_with_fault(run, train_step=None):
    step_fn = compile_step(run, train_step)

    def faulty(state, batch, control):
      if int(state.step) == 6 and not poisoned:
        def poison(path, x):
          if integrity.name(path) != "1/0/nu/layers/attn/o/kernel":
            return x
          return jax.device_put(x.at[(0,) * x.ndim].set(np.nan), x.sharding)
        state = state.replace(opt_state=jax.tree_util.tree_map_with_path(poison, state.opt_state))
        poisoned.append(True)
      return step_fn(state, batch, control)
    return faulty

  monkeypatch.setattr(trainer, "compile_step", compile_with_fault)
  config = _nan_config(make_config, tmp_path, "skip", 12)
  config.monitor.max_consecutive_nonfinite = 3
  with caplog.at_level("WARNING"):
    state, history = trainer.train(config)
  assert poisoned and int(state.step) == 12
  assert "step 7: non-finite loss, gradients or updated state; update not applied" in caplog.text
  assert "rollback at step 9 (3 non-finite step(s) in a row): back to checkpoint step 6" in caplog.text
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
  # Not 9: on the replay, step 9 skipped its (known bad) batch, and a save waits for an applied update.
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [3, 6, 12]
  _assert_checkpoints_finite(tmp_path)


def test_anomaly_detector_flags_spikes_and_drops():
  detect = monitor.AnomalyDetector(sigma=4.0, window=20)
  rng = np.random.default_rng(0)
  for step in range(15):  # steady: nothing to flag
    assert detect(step, {"loss": 2.0 + 0.01 * rng.standard_normal(), "grad_norm": 1.0 + 0.01 * step,
                         "tokens_per_sec": 1000.0}) == []
  found = detect(15, {"loss": 5.0, "grad_norm": 50.0, "tokens_per_sec": 100.0})
  assert found == ["loss_spike", "grad_norm_spike", "throughput_drop"]


def test_loss_stagnation_is_flagged_exactly_at_the_configured_log():
  losses = [3.0, 2.0, 2.5, 2.0, 2.1, 2.2, 2.3, 1.0, 1.0, 1.5, 1.1, 0.9, 1.0, 1.0]
  # Best 2.0 at log 1; logs 2-4 do not improve on it (an equal loss is no improvement): flagged at the third of
  # them (log 4) and not again while it lasts; log 7 improves, 8-10 do not: flagged at 10; 11 improves.
  for logs, expected in ((3, [4, 10]), (1, [2, 8, 12]), (0, [])):
    detect = monitor.AnomalyDetector(sigma=0.0, stagnation_logs=logs)
    found = [detect(i, {"loss": loss, "grad_norm": 1.0, "tokens_per_sec": 1000.0}) for i, loss in enumerate(losses)]
    assert [i for i, f in enumerate(found) if f] == expected and all(f == ["loss_stagnation"] for f in found if f)


class Unlearnable(SyntheticSource):
  """Every target masked out: the loss is exactly 0 at every step, so it never improves."""

  def __next__(self):
    batch = super().__next__()
    batch["loss_mask"][:] = 0.0
    return batch


def test_a_run_flags_stagnation_at_the_configured_log_and_beats_the_watchdog_each_step(make_config, caplog,
                                                                                         monkeypatch):
  dogs = []

  class Recorded(monitor.Watchdog):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.args, self.beats = args, 0
      dogs.append(self)

    def beat(self):
      super().beat()
      self.beats += 1

  monkeypatch.setattr(monitor, "Watchdog", Recorded)
  config = make_config(fsdp=8)
  config.train.update(steps=8, log_every=2)
  config.monitor.update(stagnation_logs=3, watchdog_multiple=7.0, watchdog_min_s=30.0)
  with caplog.at_level("WARNING"):
    trainer.train(config, data=Unlearnable(32, 256, 16, 0))
  records = read_records(config.workdir)
  assert [(r["step"], r["loss"], r["anomalies"]) for r in records] == [(2, 0, 0), (4, 0, 0), (6, 0, 0), (8, 0, 1)]
  bad = [json.loads(line) for line in pathlib.Path(config.workdir, "bad_batches.jsonl").read_text().splitlines()]
  assert bad == [{"step": 8, "why": "loss_stagnation", "process": 0, "source": "synthetic (seed 0, batch 7)"}]
  assert caplog.text.count("loss has not improved") == 1
  assert "step 8: loss has not improved on 0.0000 for 3 log intervals" in caplog.text
  (dog,) = dogs
  assert dog.args == (7.0, 30.0, 0.0) and dog.beats == 8
  assert dog.log_path == str(pathlib.Path(config.workdir, "train.log"))  # where its report would go


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """200 distinct short documents, byte tokens, in several train shard files."""
  root = tmp_path_factory.mktemp("prepared")
  words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
  docs = [f"Document {i}: " + " ".join(words[(i * k + k * k) % len(words)] for k in range(12)) for i in range(200)]
  (root / "corpus.txt").write_text("\n\n".join(docs) + "\n")
  manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(root / "corpus.txt")], output=os.fspath(root / "data"),
                                             progress=False, eval_fraction=0.05, shard_mib=4096 / 2**20))
  assert len([s for s in manifest["shards"] if s["split"] == "train"]) > 1
  return os.fspath(root / "data")


def test_an_anomaly_on_prepared_data_names_its_shard_files_and_documents(make_config, prepared, monkeypatch):
  class SpikeAtStep3(monitor.AnomalyDetector):
    def __call__(self, step, record):
      return super().__call__(step, record) + (["loss_spike"] if step == 3 else [])

  monkeypatch.setattr(monitor, "AnomalyDetector", SpikeAtStep3)
  config = make_config(fsdp=8)
  config.data.update(source="arrayrecord", path=prepared)
  trainer.train(config)
  (entry,) = [json.loads(line) for line in pathlib.Path(config.workdir, "bad_batches.jsonl").read_text().splitlines()]
  assert (entry["step"], entry["why"], entry["process"], entry["data"]) == (3, "loss_spike", 0, prepared)
  # Step 3 trained on the stream's third batch: its documents, each one read back from the shard file and index
  # the entry names, are the batch's tokens.
  stream = data_lib.open_train(config)
  batch = [next(stream) for _ in range(3)][-1]
  data_lib.close(stream)
  doc_ids = batch["doc_ids"]
  assert entry["documents"] == sorted({int(d) for d in np.unique(doc_ids) if d >= 0})
  assert len(entry["shards"]) == len(entry["documents"])
  dtype = loader.load_manifest(prepared)["dtype"]
  for doc_id, (shard, index) in zip(entry["documents"], entry["shards"]):
    assert shard.startswith("train-") and shard.endswith(".array_record")
    document = np.frombuffer(grain.sources.ArrayRecordDataSource([os.path.join(prepared, shard)])[index], dtype)
    for row in range(16):
      piece = doc_ids[row] == doc_id
      if piece.any():
        offset = batch["positions"][row][piece][0]
        np.testing.assert_array_equal(batch["inputs"][row][piece], document[offset:offset + piece.sum()])


class FakeClock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


def test_watchdog_limit_is_a_multiple_of_the_median_step_time():
  clock = FakeClock()
  dog = monitor.Watchdog(multiple=10.0, min_s=5.0, clock=clock)  # never started: no thread
  assert dog.limit() == 50.0  # before the first step: 10 x min_s
  assert dog.overdue() is None
  for gap in (2.0, 1.0, 3.0, 2.5, 40.0):  # a slow step (a checkpoint save, say) leaves the median alone
    clock.now += gap
    dog.beat()
  assert dog.limit() == 25.0  # 10 x median 2.5
  clock.now += 25.0
  assert dog.overdue() is None
  clock.now += 0.5
  assert dog.overdue() == 25.5
  fast = monitor.Watchdog(multiple=10.0, min_s=5.0, clock=clock)
  for _ in range(3):
    clock.now += 0.125
    fast.beat()
  assert fast.limit() == 5.0  # never below min_s
  assert monitor.Watchdog(multiple=10.0, min_s=5.0, timeout_s=7.0, clock=clock).limit() == 7.0


def test_watchdog_thread_fires_once_a_step_overruns_the_default_limit():
  clock, expired = FakeClock(), threading.Event()

  class Recorded(monitor.Watchdog):
    def _expire(self, waited):  # instead of dumping the stacks and exiting
      self.waited = waited
      expired.set()

  dog = Recorded(multiple=10.0, min_s=0.5, clock=clock).start()
  try:
    for _ in range(4):
      clock.now += 0.25
      dog.beat()
    assert dog.limit() == 2.5  # 10 x 0.25 s; the thread checks every 0.25 s (a tenth of it, in real time)
    clock.now += 2.5
    assert not expired.wait(1.0)  # at the limit, not past it
    clock.now += 0.25
    assert expired.wait(120)
    assert dog.waited == 2.75
  finally:
    dog.stop()


@pytest.mark.compat  # JAX's compile events (jaxtrain._compat)
def test_watchdog_leaves_the_loop_threads_compiles_out_and_bounds_one_on_its_own():
  """A jit compile on the watched thread, however long (the fake clock jumps 500 s as JAX reports its backend
  compile's end), is not counted in the step, nor in the median; a compile on another thread is; a compile in
  progress is bounded by compile_s, not by the step's limit."""
  clock = FakeClock()
  dog = monitor.Watchdog(multiple=10.0, min_s=5.0, timeout_s=60.0, clock=clock, compile_s=900.0)

  def slow_backend(event, duration, **kwargs):  # registered first: runs before the watchdog hears the event
    if event == _compat.BACKEND_COMPILE_EVENT:
      clock.now += 500.0

  jax.monitoring.register_event_duration_secs_listener(slow_backend)
  dog.start()
  try:
    clock.now += 10.0
    jax.jit(lambda x: x * 3.0 + 1.0)(np.arange(7.0)).block_until_ready()  # a cache miss: trace, lower, compile
    clock.now += 10.0
    assert dog.overdue() is None  # 520 s since the start, 20 s of them outside the compile
    dog.beat()
    assert list(dog._gaps) == [pytest.approx(20.0, abs=0.1)]
    # On another thread (orbax's, the data pipeline's) a compile does not hold up the loop: it is counted.
    other = threading.Thread(target=lambda: jax.jit(lambda x: x - 2.0)(np.arange(5.0)).block_until_ready())
    other.start()
    other.join(60)
    assert dog.overdue() == pytest.approx(500.0)
    dog.beat()
    # A compile the loop announces: its time is not counted until compile_s, then it is overdue on its own.
    with dog.compiling("the eval step's first call (its compile)"):
      clock.now += 800.0
      assert dog.overdue() is None  # past the step's 60 s, within compile_s
      clock.now += 200.0
      assert dog.overdue() == pytest.approx(1000.0)
    clock.now += 5.0
    assert dog.overdue() is None
  finally:
    dog.stop()
    jax.monitoring.unregister_event_duration_listener(slow_backend)
  excluded = dog._excluded
  jax.jit(lambda x: x / 4.0)(np.arange(3.0)).block_until_ready()
  assert dog._excluded == excluded  # stopped: it no longer hears JAX's compiles


def test_a_first_eval_compile_longer_than_the_limit_does_not_fire_but_a_stalled_step_does(make_config, monkeypatch):
  """The whole loop with the watchdog's clock faked and its verdict taken at every heartbeat (whenever its thread
  would have looked): tracing the eval step (its first call) takes 1,000 s of that clock and the limit is 100 s: not
  overdue; the batch of step 5 then takes 1,000 s: overdue, as a step."""
  clock, late = FakeClock(), []

  class Recorded(monitor.Watchdog):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, clock=clock, **kwargs)

    def _run(self):  # no thread: the verdict is taken at each heartbeat instead
      pass

    def beat(self):
      waited = self.overdue()
      if waited is not None:
        late.append((waited, self.describe()))
      super().beat()

  make_eval_step = step_lib.make_eval_step

  def slow_to_trace(*args, **kwargs):
    step = make_eval_step(*args, **kwargs)

    def traced(params, batch):
      clock.now += 1000.0  # runs while jax traces it: at its first call
      return step(params, batch)
    return traced

  class StallsAtFive(SyntheticSource):
    def __next__(self):
      if self.step == 4:  # the batch of step 5
        clock.now += 1000.0
      return super().__next__()

  monkeypatch.setattr(monitor, "Watchdog", Recorded)
  monkeypatch.setattr(step_lib, "make_eval_step", slow_to_trace)
  config = make_config(fsdp=8)
  config.train.update(steps=6, log_every=1)
  config.eval.update(every_steps=2, max_batches=1)
  config.monitor.update(watchdog_timeout_s=100.0)
  trainer.train(config, data=StallsAtFive(32, 256, 16, 0))
  assert [r["step"] for r in read_records(config.workdir) if "eval_loss" in r] == [2, 4, 6]
  [(waited, where)] = late
  assert waited == pytest.approx(1000.0) and where.startswith("step 5 dispatched"), late


@pytest.mark.slow
def test_watchdog_dumps_stacks_and_exits_nonzero(tmp_path):
  # The worker's data hangs before step 7 with monitor.watchdog_timeout_s=6 (its steps take well under that).
  r = forked.run(["tests/stall_worker.py", str(tmp_path), "6"])
  err = r.stderr
  assert r.returncode == monitor.Watchdog.EXIT_CODE, err[-3000:]
  stalled, fired = err.find("STALLING"), err.find("jaxtrain: watchdog: no step finished for ")
  assert 0 <= stalled < fired, err[-3000:]  # it fired on the hang, not before
  waited, limit = map(float, re.search(r"no step finished for ([\d.]+)s \(limit ([\d.]+)s\)", err).groups())
  assert limit == 6.0 and waited >= limit
  # train.log keeps the report: where the loop was (step 7 dispatched, waiting for its data) and every stack.
  log = (tmp_path / "train.log").read_text()
  assert re.search(r"watchdog: no step finished for [\d.]+s \(limit 6.0s\): step 6 dispatched; newest step "
                   r"logged: [56], loss [\d.]+; [\d.]+s waiting for data", log), log[-3000:]
  assert "Thread 0x" in log and "in __next__" in log and "stall_worker.py" in log, log[-3000:]
  stacks = err[fired:]
  assert "Thread" in stacks and re.search(r'stall_worker\.py", line \d+ in __next__', stacks), stacks[-3000:]


def _plotted(ax) -> dict[str, tuple[list, list]]:
  return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_plot_metrics_draws_the_logged_values(make_config, tmp_path):
  from tools import plot_metrics
  config = make_config(fsdp=8)
  config.workdir = str(tmp_path / "run")
  trainer.train(config)
  records = read_records(config.workdir)
  # A second run, resumed from step 1 (steps 2 and 3 logged again), with eval records: the last value counts.
  resumed = tmp_path / "resumed"
  resumed.mkdir()
  def logged(step, v):
    return {"step": step, "loss": v, "tokens_per_sec": 100 * v, "grad_norm": v / 10, "lr": v / 1000}
  lines = [logged(1, 4.0), logged(2, 3.0), logged(3, 2.0), logged(2, 3.5), logged(3, 2.5)]
  lines[2:2] = [{"step": 2, "eval_loss": 3.25}]
  lines += [{"step": 3, "eval_loss": 2.75}]
  # ... and still running: its next record is half written.
  (resumed / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 4, "lo')
  fig = plot_metrics.figure([plot_metrics.read(config.workdir), plot_metrics.read(str(resumed))])
  for ax, (key, title) in zip(fig.axes, plot_metrics.PANELS, strict=True):
    assert ax.get_title() == title
    expected = {"run": ([r["step"] for r in records], [r[key] for r in records])}
    expected["resumed"] = ([1, 2, 3], [logged(step, v)[key] for step, v in ((1, 4.0), (2, 3.5), (3, 2.5))])
    if key == "loss":
      expected["resumed (eval)"] = ([2, 3], [3.25, 2.75])
    assert _plotted(ax) == expected
  r = forked.run(["tools/plot_metrics.py", config.workdir, str(resumed), f"--out={tmp_path / 'plot.png'}"],
                 timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  import matplotlib.image
  assert matplotlib.image.imread(tmp_path / "plot.png").shape == (800, 1200, 4)  # the figure, 12 x 8 in at 100 dpi


def _trace_calls(monkeypatch, real: bool) -> list[tuple[str, int]]:
  """(start_trace | stop_trace, train steps dispatched before it) as a run calls them; the real profiler runs
  only if ``real``."""
  calls, dispatched = [], count_dispatched_steps(monkeypatch)
  start_trace, stop_trace = jax.profiler.start_trace, jax.profiler.stop_trace

  def start(directory, *args, **kwargs):
    calls.append(("start_trace", dispatched[0]))
    if real:
      start_trace(directory, *args, **kwargs)

  def stop():
    calls.append(("stop_trace", dispatched[0]))
    if real:
      stop_trace()

  monkeypatch.setattr(jax.profiler, "start_trace", start)
  monkeypatch.setattr(jax.profiler, "stop_trace", stop)
  return calls


class PreemptedAfter:
  """A PreemptionGuard whose signal arrives during step ``step``."""

  def __init__(self, step):
    self.step = step

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    pass

  def requested(self, step):
    return step >= self.step


# Profiler window (profile_start, profile_steps) -> train steps dispatched (in this run) when the trace starts
# and when it stops.
PROFILE_CASES = {
    "inside": ((1, 2), (1, 3)),
    "to_the_end": ((3, 5), (3, 5)),  # the window reaches train.steps: stopped when the loop ends
    "preempted": ((1, 3), (1, 2)),  # preempted after step 2
    "stopped": ((1, 9), (1, 5)),  # nan_policy=stop: step 4's NaN is noticed once step 5 is dispatched
    "resumed": ((1, 3), (0, 2)),  # resumed from step 2, inside the window: its rest, steps 3 and 4, is traced
}


@pytest.mark.parametrize("case", list(PROFILE_CASES))
def test_profiler_traces_exactly_its_window(make_config, monkeypatch, case):
  (start, steps), (started, stopped) = PROFILE_CASES[case]
  config = make_config(fsdp=8)
  if case == "resumed":  # a first run, preempted after step 2 (its checkpoint)
    with monkeypatch.context() as m, pytest.raises(exits.Restart, match="preempted after step 2 of 5; newest "
                                                                           "checkpoint: step 2"):
      m.setattr(loop, "PreemptionGuard", functools.partial(PreemptedAfter, 2))
      trainer.train(config)
  config.metrics.update(profile_start=start, profile_steps=steps)  # steps [start, start + steps), 0-based
  calls = _trace_calls(monkeypatch, real=case == "to_the_end")
  if case == "preempted":
    monkeypatch.setattr(loop, "PreemptionGuard", functools.partial(PreemptedAfter, 2))
  if case == "stopped":
    config.train.steps, config.monitor.nan_policy = 8, "stop"
    with pytest.raises(trainer.TrainingStopped, match="step 4: non-finite"):
      trainer.train(config, data=Poisoned(3, 32, 256, 16, 0))
  elif case == "preempted":
    with pytest.raises(exits.Restart):
      trainer.train(config)
  else:
    trainer.train(config)
  # Stopped after the window's last step, or wherever the run ended (train.steps, a preemption, an error): a
  # trace never stopped is never written.
  assert calls == [("start_trace", started), ("stop_trace", stopped)]
  if case == "to_the_end":
    assert list(pathlib.Path(config.workdir, "profile").rglob("*.xplane.pb"))


def _wandb_records(path: pathlib.Path):
  """The records of a W&B transaction log (``run-*.wandb``): a 7-byte header, then LevelDB-log chunks (a 7-byte
  header each: CRC, length, type 1 full / 2 first / 3 middle / 4 last) in 32 KiB blocks. Read here because wandb
  no longer ships a Python reader of its own (its DataStore went with the move of the internals to Go)."""
  from wandb.proto import wandb_internal_pb2
  data = path.read_bytes()
  assert data[:4] == b":W&B"
  pos, parts = 7, []
  while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
      pos += 32768 - pos % 32768
      continue
    length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
    parts.append(data[pos + 7:pos + 7 + length])
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(b"".join(parts))
      parts = []
      yield record


def test_wandb_history_equals_metrics_jsonl(make_config, monkeypatch):
  try:
    import wandb
  except ImportError as e:
    pytest.skip(f"wandb cannot be imported ({e}): pip install wandb (it is in the 'test' extra)")
  monkeypatch.setenv("WANDB_MODE", "offline")  # written to <workdir>/wandb, nothing sent
  monkeypatch.setenv("WANDB_CONSOLE", "off")
  monkeypatch.setenv("WANDB_SILENT", "true")
  config = make_config(fsdp=8)
  config.metrics.wandb = True
  try:
    trainer.train(config)
  finally:
    wandb.teardown()
  (log,) = pathlib.Path(config.workdir).glob("wandb/offline-run-*/run-*.wandb")
  history, run_config = [], None
  for record in _wandb_records(log):
    if record.HasField("history"):
      row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
      history.append({k: v for k, v in row.items() if not k.startswith("_")})  # W&B's own _step, _runtime, ...
    elif record.HasField("run"):
      run_config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.run.config.update}
  assert history == read_records(config.workdir)
  assert run_config["train"]["steps"] == 5 and run_config["model"]["d_model"] == 64


def test_progress_bar_shows_step_loss_throughput_and_mfu(make_config, capsys):
  config = make_config(fsdp=8)
  config.metrics.update(progress="bar", peak_tflops=0.01)
  trainer.train(config)
  err = capsys.readouterr().err
  assert "5/5" in err and "loss" in err and "tok/s" in err and "MFU" in err


def test_stragglers_name_a_process_whose_data_wait_costs_the_job_over_the_threshold_across_the_window():
  warnings = []
  judge = monitor.Stragglers(["a", "b", "c"], threshold=0.15, logs=3, slowdown=0.0,
                             warn=lambda *args: warnings.append(args[0] % args[1:]))
  # (data waits of processes 0, 1, 2; the job's step time) per logged interval. Process 2 waits 0.2 s more than
  # the median per 1 s step from the second log on; the third interval is a short one (a log right after a save).
  logs = [([0.0, 0.0, 0.0], 1.0), ([0.0, 0.0, 0.2], 1.0), ([0.0, 0.0, 0.0], 0.01), ([0.0, 0.0, 0.2], 1.0),
          ([0.0, 0.0, 0.2], 1.0), ([0.0, 0.0, 0.0], 1.0), ([0.0, 0.0, 0.0], 1.0), ([0.0, 0.0, 0.0], 1.0)]
  found = [judge(step, waits, t) for step, (waits, t) in enumerate(logs, start=1)]
  # Windows of 3: steps 1-3 wait 0.2 of 2.01 s (10%: no), 2-4 0.4 of 2.01 (20%), 3-5 0.4 of 2.01, 4-6 0.4 of 3
  # (13%: recovered), then nothing.
  assert [f.get("straggler/process") for f in found] == [None, None, None, 2.0, 2.0, None, None, None]
  assert found[3]["straggler/excess"] == pytest.approx(0.4 / 2.01)
  assert warnings == ["step 4: process 2 on host c is a straggler: over the last 3 logged steps it waited 0.133s "
                      "per step for its data, the median process 0.000s: 20% of the job's 0.670s per step"]
  # Milliseconds of steps (a test's tiny model): 4 ms more than the median is 50% of a step, but under the 10 ms
  # floor: the OS scheduler's noise, not a slow host. 12 ms more is named.
  judge, warnings[:] = monitor.Stragglers(["a", "b", "c"], logs=1, slowdown=0.0,
                                          warn=lambda *a: warnings.append(a)), []
  assert judge(1, [0.0, 0.0, 0.004], 0.008) == {} and not warnings
  assert judge(2, [0.0, 0.0, 0.012], 0.02)["straggler/process"] == 2.0 and len(warnings) == 1
  # A slowdown of the whole job: step time 1 s for a while, then 1.3 s (30% > 15%): warned once, when the window's
  # mean passes 1.15 s; each record while it lasts.
  judge, warnings[:] = monitor.Stragglers(["a"], logs=3, warn=lambda *args: warnings.append(args[0] % args[1:])), []
  found = [judge(step, [0.0], 1.0 if step <= 8 else 1.3) for step in range(1, 14)]
  assert [round(f.get("slowdown", 0), 3) for f in found] == [0] * 9 + [0.2, 0.3, 0.3, 0.3]
  assert warnings == ["step 10: the whole job slowed down: 1.200s per step over the last 3 logged steps, 20% over "
                      "its recent median 1.000s"]

"""float16 with loss scaling (``optim.loss_scale``, jaxtrain/loss_scale.py): the dynamic scale's rule, a float16
run that trains as a bfloat16 one does, overflowing steps skipped one by one with the scale halved (a static scale's
overflows handed to the NaN policy), the scale carried through a SIGKILL and a resume bitwise, and why there is a
scaler (float16 gradients underflow without it).
"""

import json
import pathlib
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import config as config_lib
from jaxtrain import loss_scale, models
from jaxtrain.config import ConfigError
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.train import losses, trainer
from tests import forked, multiprocess

STEPS = 100
# A small run: two layers, 8 rows of 64 tokens; the lr schedule's horizon fixed, so that a shorter run of the same
# settings is the first steps of the long one. The dynamic scale doubles every 8 finite steps: it overflows and
# halves several times in 100 steps (measured: 7 times, from step 27; float16's last-10-step loss 0.9% above
# bfloat16's, as at 200 steps with a period of 20; at 60 steps it was 2.0%, no margin).
ARGS = ["--config=configs/tiny.py", "--config.model.num_layers=2", "--config.data.seq_len=64",
        "--config.train.global_batch_size=8", "--config.train.log_every=1", "--config.metrics.tensorboard=False",
        f"--config.optim.decay_steps={STEPS}"]
FP16 = ["--config.model.dtype=float16", "--config.optim.loss_scale=dynamic", "--config.optim.loss_scale_period=8"]


def _records(workdir) -> dict[int, dict]:
  out = {}
  for line in open(workdir / "metrics.jsonl"):
    r = json.loads(line)
    if "loss" in r:
      out[r["step"]] = {k: r[k] for k in ("loss", "grad_norm", "loss_scale", "overflow", "skipped", "nonfinite")
                        if k in r}
  return out


def _train(workdir, *args, steps=STEPS):
  r = forked.run(["-m", "jaxtrain.main", *ARGS, *args, f"--config.train.steps={steps}",
                  f"--config.checkpoint.every_steps={steps}", f"--config.workdir={workdir}"])
  assert r.returncode == 0, r.stderr[-3000:]
  return _records(workdir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("fp16")
  return {"bf16": _train(root / "bf16", "--config.model.dtype=bfloat16"), "fp16": _train(root / "fp16", *FP16)}


def test_the_dynamic_scale_doubles_after_its_period_and_halves_to_at_least_1_on_an_overflow():
  tx = loss_scale.wrap(optax.sgd(1.0), "dynamic", 8.0, 3)
  state, scales = tx.init({"w": jnp.zeros(2)}), []
  for finite in (True, True, True, True, False, False, True, True, True):
    state = tx.adjust(state, jnp.bool_(finite))
    scales.append(float(state.scale))
  assert scales == [8, 8, 16, 16, 8, 4, 4, 4, 8]
  low = tx.init({"w": jnp.zeros(2)})._replace(scale=jnp.float32(1.0))
  assert float(tx.adjust(low, jnp.bool_(False)).scale) == 1.0
  static = loss_scale.wrap(optax.sgd(1.0), "1024", 8.0, 3)
  state = static.init({"w": jnp.zeros(2)})
  assert float(static.adjust(state, jnp.bool_(False)).scale) == 1024.0
  sgd = optax.sgd(1.0)
  assert loss_scale.wrap(sgd, "none", 8.0, 3) is sgd
  with pytest.raises(ConfigError, match="optim.loss_scale: 'fast' is not none, dynamic or a positive number"):
    loss_scale.parse("fast")


@pytest.mark.slow
def test_float16_with_a_dynamic_scale_trains_to_the_bfloat16_loss(runs):
  """At the last step (the mean of its last 10 steps: one step's loss is noisier than the 2% asked) within 2%."""
  last = lambda r: np.mean([r[s]["loss"] for s in range(STEPS - 9, STEPS + 1)])  # noqa: E731
  assert sorted(runs["fp16"]) == list(range(1, STEPS + 1))
  assert last(runs["fp16"]) == pytest.approx(last(runs["bf16"]), rel=0.02)
  assert last(runs["fp16"]) < 0.6 * runs["fp16"][1]["loss"]


@pytest.mark.slow
def test_an_overflow_skips_exactly_its_step_and_halves_the_scale(runs):
  fp16 = runs["fp16"]
  overflows = [s for s, r in fp16.items() if r["overflow"]]
  assert len(overflows) >= 2, overflows  # the scale grew into float16's range and back, more than once
  for s, r in fp16.items():
    assert r["nonfinite"] == 0 and r["skipped"] == r["overflow"], (s, r)  # the scaler's, not the NaN policy's
    if s + 1 in fp16:
      want = r["loss_scale"] / 2 if r["overflow"] else (r["loss_scale"], 2 * r["loss_scale"])
      assert fp16[s + 1]["loss_scale"] in (want if isinstance(want, tuple) else (want,)), (s, r, fp16[s + 1])
  assert max(r["loss_scale"] for r in fp16.values()) > 2.0 ** 15  # it grew


@pytest.mark.slow
def test_a_sigkill_resumes_with_the_scale_it_had_bitwise(tmp_path):
  """A scale started too high (2^20: the first steps overflow and halve it) that doubles every 4 finite steps;
  killed at step 6's save and resumed: every step's loss, gradient norm, scale and overflow equal the uninterrupted
  run's."""
  steps, scaled = 12, ["--config.model.dtype=float16", "--config.optim.loss_scale=dynamic",
                       "--config.optim.loss_scale_period=4", f"--config.optim.loss_scale_init={2 ** 20}"]
  want = _train(tmp_path / "whole", *scaled, steps=steps)
  assert any(r["overflow"] for s, r in want.items() if s <= 6) and len({r["loss_scale"] for r in want.values()}) > 2
  args = [*ARGS, *scaled, f"--config.train.steps={steps}", "--config.checkpoint.every_steps=1",
          f"--config.workdir={tmp_path / 'run'}"]
  code = multiprocess.main_killed_at_save(6, args, tmp_path / "killed.log")
  assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
  r = forked.run(["-m", "jaxtrain.main", *args])
  assert r.returncode == 0 and "resumed from checkpoint step 5" in r.stderr, r.stderr[-3000:]
  assert _records(tmp_path / "run") == want


def test_a_static_scale_that_overflows_is_a_non_finite_step_for_the_nan_policy(make_config):
  """A static scale never moves, so a step whose gradients overflow at it is followed by another: each is a
  non-finite step, the NaN policy's to act on (here ``stop``: the run ends at the first, with its line), where before
  every step was skipped silently and the run ended as if it had trained."""
  config = make_config()
  config.model.dtype = "float16"
  config.optim.loss_scale = "1e10"  # (float16's largest number is 65504: every backward pass overflows)
  config.monitor.nan_policy = "stop"
  with pytest.raises(trainer.TrainingStopped) as stopped:
    trainer.train(config, devices=jax.devices()[:1])
  assert str(stopped.value) == ("step 1: non-finite loss, gradients or updated state and monitor.nan_policy=stop; "
                                "the last checkpoint is intact (steps: none)")
  bad = (pathlib.Path(config.workdir) / "bad_batches.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in bad] == [1]


def test_float16_gradients_underflow_without_a_scale():
  """One batch's gradients of a float16 model against the float32 model's: unscaled, float16's range loses the
  small ones (zeros where float32 has none, and a relative error several times the scaled one's)."""
  config = config_lib.load_file("configs/tiny.py", ["model.num_layers=2"])
  exact = models.Model.from_config(config.model)
  config.model.dtype = "float16"
  half = models.Model.from_config(config.model)
  params = exact.init(jax.random.key(0))
  batch = next(SyntheticSource(16, 256, 128, 0, 0, 1))

  def grads(model, scale):
    def loss(p):
      out = model.forward(p, batch["inputs"], batch["positions"], batch["segment_ids"])
      return jnp.mean(losses.cross_entropy(out.logits, batch["targets"])) * scale
    return np.concatenate([np.ravel(g) / scale for g in jax.tree.leaves(jax.jit(jax.grad(loss))(params))])

  want = grads(exact, 1.0)
  error = {s: np.linalg.norm(grads(half, s) - want) / np.linalg.norm(want) for s in (1.0, 2.0 ** 15)}
  lost = {s: np.mean((grads(half, s) == 0) & (want != 0)) for s in (1.0, 2.0 ** 15)}
  assert lost[1.0] > 1e-5 and lost[1.0] > 10 * lost[2.0 ** 15], lost
  assert error[1.0] > 3 * error[2.0 ** 15], error


def test_float16_on_a_tpu_a_bad_loss_scale_and_scaling_another_objective_are_one_line_exit_2(tmp_path):
  config = config_lib.load_file("configs/tiny.py", ["model.dtype=float16", "dry_run_topology=v5e:2x2"])
  with pytest.raises(ConfigError, match="model.dtype: float16 is not a TPU compute type .* set model.dtype=bfloat16"):
    config_lib.validate_values(config)  # (before the topology's own checks: on this host, libtpu may be missing)
  config = config_lib.load_file("configs/tiny.py", ["train.objective=dpo", "optim.loss_scale=dynamic"])
  with pytest.raises(ConfigError, match="optim.loss_scale: train.objective=dpo does not scale its loss"):
    config_lib.validate_values(config)
  r = forked.run(["-m", "jaxtrain.main", "--config=configs/tiny.py", "--config.model.dtype=float16",
                  "--config.optim.loss_scale=often", f"--config.workdir={tmp_path / 'run'}"])
  errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  assert "optim.loss_scale: 'often' is not none, dynamic or a positive number" in errors[0]
  assert not (tmp_path / "run").exists()

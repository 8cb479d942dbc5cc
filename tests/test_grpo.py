"""GRPO (train.objective=grpo): the sampler's log-probabilities against the training forward's, the loss against a
float64 implementation, sharded equal to one device, the prompt stream's position, bad input, and (slow) a 2-process
job equal to one process with a reward drawn at random, docs/post_training.md's letter-reversal commands as written
(a tiny model whose held-out reward rises), resumed bitwise after a SIGKILL."""

import json
import os
import pathlib
import runpy
import shlex
import signal
import time

import jax
import numpy as np
import pytest

from jaxtrain import config as config_lib
from jaxtrain import sampling
from jaxtrain.data import prompts as prompts_lib
from jaxtrain.metrics import read_records
from jaxtrain.train import objectives, start, trainer
from jaxtrain.train.objectives import grpo
from jaxtrain.train.objectives.logprobs import token_logps
from tests import forked, multiprocess, readme
from tests.conftest import small_config

# The task (tools/letter_prompts.py, docs/post_training.md's GRPO example): "xy>" -> "yx" then a newline; 48 pairs
# train, 16 held out (each letter seen in both places). MODEL: configs/grpo_letters.py's.
MODEL = {"num_layers": 2, "d_model": 64, "num_heads": 8, "num_kv_heads": 4, "head_dim": 16, "mlp_dim": 128,
         "vocab_size": 256}
# The page's commands (a unique part of each): the prompts written, the format fine-tuned, GRPO from it.
LETTERS_DATA, LETTERS_SFT, LETTERS_GRPO = ("tools/letter_prompts.py", "configs/grpo_letters.py:sft",
                                           "configs/grpo_letters.py:grpo")


def write_task(folder: pathlib.Path) -> pathlib.Path:
  runpy.run_path(str(readme.ROOT / "tools" / "letter_prompts.py"))["write"](folder)
  return folder


def grpo_config(workdir, task_dir: pathlib.Path, **mesh):
  c = small_config(workdir, **mesh)
  c.train.update(objective="grpo", steps=4, global_batch_size=64, log_every=1)
  c.data.update(source="prompts", path=str(task_dir / "train.jsonl"), seq_len=8)
  c.rl.update(group_size=8, max_new_tokens=4, stop=("\n",), kl_weight=0.04)
  c.optim.update(lr=1e-3, warmup_steps=0, schedule="constant")
  return c


def grpo_flags(data: pathlib.Path) -> list[str]:
  """The same run as :func:`grpo_config`, as jaxtrain.main's flags (for configs/tiny.py)."""
  return ["--config=configs/tiny.py", *[f"--config.model.{k}={v}" for k, v in MODEL.items()],
          "--config.train.objective=grpo", "--config.train.global_batch_size=64", "--config.train.log_every=1",
          "--config.data.source=prompts", f"--config.data.path={data / 'train.jsonl'}", "--config.data.seq_len=8",
          "--config.rl.group_size=8", "--config.rl.max_new_tokens=4", "--config.rl.stop=('\\n',)",
          "--config.optim.warmup_steps=0", "--config.optim.schedule=constant", "--config.optim.lr=0.001",
          "--config.mesh.fsdp=1", "--config.mesh.data=-1"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  return write_task(tmp_path_factory.mktemp("grpo_task"))


# Pieces ---------------------------------------------------------------------------------------------------------


def test_group_advantages_and_loss_equal_a_float64_implementation():
  """Advantages: (r - group mean) / (sample std + 1e-4); the loss: the clipped surrogate plus the k3 KL, per
  completion the mean over its tokens, then the mean over completions; computed again here in float64."""
  rng = np.random.default_rng(0)
  rewards = rng.integers(0, 2, 16).astype(np.float64)
  adv = grpo.group_advantages(rewards, 4)
  for g in range(4):
    r = rewards[4 * g:4 * g + 4]
    np.testing.assert_allclose(adv[4 * g:4 * g + 4], (r - r.mean()) / (np.std(r, ddof=1) + 1e-4), rtol=1e-6)
  rows, t = 16, 6
  mask = (np.arange(t)[None] >= rng.integers(1, 5, (rows, 1))).astype(np.float32)
  logps, old, ref = (rng.normal(-2, 0.3, (rows, t)).astype(np.float32) * mask for _ in range(3))
  batch = {"loss_mask": mask, "old_logps": old, "ref_logps": ref, "advantages": adv}
  loss, aux = jax.jit(lambda lp, b: grpo.grpo_loss(lp, b, 0.2, 0.04))(logps, batch)
  lp, o, rf, a = (np.asarray(x, np.float64) for x in (logps, old, ref, adv))
  ratio = np.exp(lp - o)
  surrogate = -np.minimum(ratio * a[:, None], np.clip(ratio, 0.8, 1.2) * a[:, None])
  kl = np.exp(rf - lp) - (rf - lp) - 1
  per_seq = ((surrogate + 0.04 * kl) * mask).sum(1) / mask.sum(1)
  np.testing.assert_allclose(float(loss), per_seq.mean(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(aux["rl/kl"]), (kl * mask).sum() / mask.sum(), rtol=1e-5, atol=1e-7)
  clipped = (np.clip(ratio, 0.8, 1.2) * a[:, None] < ratio * a[:, None]) & (mask > 0)
  np.testing.assert_allclose(float(aux["rl/clip_fraction"]), clipped.sum() / mask.sum(), rtol=1e-6)


def test_prompt_stream_repeats_each_prompt_per_group_and_resumes_where_it_was(task, tmp_path):
  c = config_lib.resolve(grpo_config(tmp_path, task))
  stream = prompts_lib.open_train(c)
  first = [prompts_lib.record_indices(next(stream)) for _ in range(3)]
  assert all((b.reshape(8, 8) == b.reshape(8, 8)[:, :1]).all() for b in first)  # groups of 8 rows, one prompt
  assert len({int(i) for b in first for i in b}) == 24  # 3 steps x 8 prompts, none repeated within an epoch
  saved = stream.get_state()
  later = [prompts_lib.record_indices(next(stream)) for _ in range(4)]  # crosses into the second epoch
  resumed = prompts_lib.open_train(c)
  resumed.set_state(resumed.resplit([saved, saved]))
  assert all((a == prompts_lib.record_indices(next(resumed))).all() for a in later)
  # Two processes: each takes its half of the same global rows.
  halves = [prompts_lib.PromptStream(stream.prompts, 5, 64, 8, c.train.seed, p, 2) for p in range(2)]
  glued = np.concatenate([prompts_lib.record_indices(next(h)) for h in halves])
  assert (glued == first[0]).all()


@pytest.fixture(scope="module")
def sharded_losses(task, tmp_path_factory):
  """The first GRPO step's loss (and the scoring's log-probs) of one fixed batch on several meshes."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(97, 105, (64, 9)).astype(np.int32)
  advantages = grpo.group_advantages(rng.integers(0, 2, 64).astype(np.float64), 8)
  out = {}
  for name, mesh, rank in (("one", dict(data=1, fsdp=1), 0), ("fsdp_tensor", dict(fsdp=2, tensor=2), 0),
                           ("one_lora", dict(data=1, fsdp=1), 4), ("fsdp_tensor_lora", dict(fsdp=2, tensor=2), 4)):
    c = grpo_config(tmp_path_factory.mktemp(name), task, **mesh)
    c.model.update(**MODEL)
    if rank:
      c.model.lora.update(rank=rank, alpha=8.0)
    c = config_lib.resolve(c)
    devices = jax.devices()[:4 if mesh.get("fsdp") == 2 else 1]
    run = trainer.build(c, devices)
    state = start.starting_state(run)
    if rank:  # adapters not at their zero start, so that they count
      state = state.replace(params=jax.tree_util.tree_map_with_path(
          lambda p, x: x + 0.01 if "lora" in jax.tree_util.keystr(p) else x, state.params))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": np.tile(np.arange(8), (64, 1)),
             "segment_ids": np.ones((64, 8), np.int32),
             "loss_mask": (np.arange(8)[None] >= 4).repeat(64, 0).astype(np.float32),
             "advantages": advantages}
    abstract = objectives.of(c).abstract_batch(run)
    on = {k: jax.device_put(np.asarray(v, abstract[k].dtype), abstract[k].sharding) for k, v in batch.items()}
    logps = jax.jit(lambda p, b: token_logps(run.model, p, b))(state.params, on)
    on.update(old_logps=logps - 0.3 * on["loss_mask"], ref_logps=logps + 0.1 * on["loss_mask"])
    step = trainer.compile_step(run)
    with jax.set_mesh(run.mesh):
      _, metrics = step(state, on, np.bool_(False))
    out[name] = {k: float(v) for k, v in jax.device_get(metrics).items()}
  return out


def test_sharded_grpo_loss_equals_one_device(sharded_losses):
  for sharded, one in (("fsdp_tensor", "one"), ("fsdp_tensor_lora", "one_lora")):
    for key in ("loss", "rl/kl", "grad_norm"):
      assert abs(sharded_losses[sharded][key] - sharded_losses[one][key]) < 1e-5, (sharded, key, sharded_losses)
  assert sharded_losses["one"]["rl/kl"] > 0 and sharded_losses["one"]["rl/clip_fraction"] > 0  # terms present


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_sampler_logps_equal_the_training_forward(task, tmp_path, lora_rank):
  """The KV-cache sampler's log-probability of each token it samples (temperature 1.3, top-p 0.9: the draw is
  tempered, the log-probability is the model's) equals the training forward's for the same row within 1e-5, with
  LoRA too (the sampler merges the adapters, the training forward applies them); a generator that does not ask for
  them returns what it always did."""
  c = grpo_config(tmp_path, task, fsdp=2, tensor=2)
  c.model.update(**MODEL)
  c.model.lora.update(rank=lora_rank, alpha=8.0)
  c.rl.update(temperature=1.3, top_p=0.9)
  run = trainer.build(config_lib.resolve(c), jax.devices()[:4])
  params = start.starting_state(run).params
  if lora_rank:  # adapters not at their zero start, so that they count
    params = jax.tree_util.tree_map_with_path(lambda p, x: x + 0.05 if "lora" in jax.tree_util.keystr(p) else x,
                                              params)
  gen = grpo.rollout_generator(run, 64, (10,))
  plain = sampling.Generator(run.model, run.mesh, run.rules, run.state_shardings.params, rows=64, prompt_len=5,
                             max_new_tokens=4, sampling=sampling.Sampling(1.3, 0, 0.9), eos_ids=(10,))
  table = prompts_lib.load(c.data.path, run.config)
  batch = gen.batch([table.ids[i % len(table.ids)] for i in range(64)])
  with jax.set_mesh(run.mesh):
    done = grpo.Completions(gen(params, batch, seed=3), (10,), prompts_lib._tokenizer("byte"))
    again = plain(params, batch, seed=3)
  assert len(again) == 3 and (np.asarray(again[0]) == done.tokens).all()  # (tokens, produced, state) as before
  host = {"inputs": batch.tokens, "positions": batch.positions, "segment_ids": batch.segment_ids}
  rows = grpo.update_batch(host, done, np.zeros(64, np.float32))
  with jax.set_mesh(run.mesh):
    trained = np.asarray(jax.jit(lambda p, b: token_logps(run.model, p, b))(params, rows))
  mismatch = grpo.Trainer._mismatch(trained, done, 5)
  assert mismatch < 1e-5, mismatch
  assert np.abs(done.logps).sum() > 1  # (real log-probabilities were compared)


def test_a_lora_run_on_fsdp_x_tensor_measures_kl_against_the_adapters_off_reference(task, tmp_path):
  """GRPO with LoRA on fsdp x tensor: the reference is the base with the adapters off (no copy), so at step 1 (the
  adapters' B at 0) the policy is the reference and the KL is exactly 0; after updates it is not. Every step's
  sampler log-probabilities equal the training forward's within 1e-5."""
  c = grpo_config(tmp_path, task, fsdp=2, tensor=2)
  c.model.update(**MODEL)
  c.model.lora.update(rank=4, alpha=8.0)
  c.train.update(steps=3)
  c.rl.rewards = "tests.grpo_rewards:letters"  # (rewards that differ within a group: the policy moves)
  c.optim.update(lr=1e-2)
  _, history = trainer.train(config_lib.resolve(c), devices=jax.devices()[:4])
  assert grpo.reference_mode(c) == "adapters_off"
  kl = [h["rl/kl"] for h in history]
  assert kl[0] == 0.0 and kl[-1] > 0, kl
  assert max(h["rl/logp_mismatch"] for h in history) < 1e-5
  assert all(np.isfinite(h["loss"]) and h["rl/completion_length"] >= 1 for h in history)


def test_updates_per_batch_update_the_optimizer_twice_and_count_one_step(task, tmp_path, caplog):
  """rl.updates_per_batch=2: two optimizer updates per rollout (the optimizer's own count is 4 after 2 steps, the
  second update of a batch sees a ratio away from 1), one loop and TrainState step each. The console line and the
  run's last line show GRPO's own figure, the mean reward (the objective's console_metrics)."""
  c = grpo_config(tmp_path, task, data=1, fsdp=1)
  c.model.update(**MODEL)
  c.train.update(steps=2)
  c.rl.update(updates_per_batch=2, rewards="tests.grpo_rewards:letters", clip_epsilon=0.01)
  c.optim.update(lr=1e-2)
  with caplog.at_level("INFO"):
    state, history = trainer.train(config_lib.resolve(c), devices=jax.devices()[:1])
  assert int(state.step) == 2 and [h["step"] for h in history] == [1, 2]
  said = [r.getMessage() for r in caplog.records]
  reward = f"rl/reward_mean {history[-1]['rl/reward_mean']:.4f}"
  assert [m for m in said if m.startswith("step 2/2 | loss ") and f"| {reward} |" in m], said[-5:]
  assert [m for m in said if m.startswith("done: step 2/2, loss ") and f", {reward}" in m], said[-5:]
  leaves = jax.tree_util.tree_leaves_with_path(state.opt_state)
  counts = [int(x) for p, x in leaves if "count" in jax.tree_util.keystr(p)]
  assert counts and set(counts) == {4}, counts
  assert all(h["rl/clip_fraction"] > 0 for h in history)  # (the mean over the two updates: the second one clips)




# Logged every step; what two runs of the same job must agree on (timings aside).
COMPARED = ("loss", "grad_norm", "lr", "rl/reward_mean", "rl/reward_std", "rl/reward/flaky_coin", "rl/kl",
            "rl/clip_fraction", "rl/completion_length", "rl/logp_mismatch")


@pytest.mark.slow  # a 2-process job and a 1-process run
def test_two_processes_train_as_one_on_a_reward_drawn_at_random_and_stop_as_one_when_it_fails(task, tmp_path):
  """A 2-process job (1 device each) logs, bitwise, what one process on 2 devices (the same mesh) logs at every
  step, with a reward drawn at random at every call (tests.grpo_rewards:flaky_coin, seeded by the process index:
  process 0 draws what the lone process draws, process 1 other values). The rewards are drawn on process 0 alone and
  broadcast; drawn on each process, process 1's rows would train on advantages of other draws than process 0's and
  the logged ones (jax's device_put stops such a job at step 1 as a bug). At step 4 the reward fails (NaN) on process
  0: it ends with the reward's one line and exit 2, and process 1, waiting for the rewards, with the same code and
  line; the 1-process run ends with that line too."""
  flags = [*grpo_flags(task), "--config.rl.rewards=tests.grpo_rewards:flaky_coin", "--config.train.steps=5",
           "--config.checkpoint.every_steps=5", "--config.distributed.heartbeat_timeout_s=5"]
  two = multiprocess.start_main([*flags, f"--config.workdir={tmp_path / 'two'}"], local_devices=1)
  one = multiprocess.start_main([*flags, f"--config.workdir={tmp_path / 'one'}"], num_processes=1, local_devices=2)
  codes = multiprocess.wait_all([*two, *one], 300)
  errs = [p.err_path.read_text() for p in (*two, *one)]
  assert codes == [2, 2, 2], [e[-2000:] for e in errs]
  line = "reward flaky_coin: returned a non-finite value; return finite floats"
  said = [[x for x in e.splitlines() if x.startswith("jaxtrain: error:")] for e in errs]
  assert said == [[f"jaxtrain: error: {line}"], [f"jaxtrain: error: process 0 stopped the job: {line}"],
                  [f"jaxtrain: error: {line}"]], said
  assert not any("Traceback" in e or "a process of the job is gone" in e for e in errs), errs
  # Steps 1 and 2 were logged before step 4 failed (metrics are fetched one step late).
  logged = {name: {r["step"]: tuple(r[k] for k in COMPARED) for r in read_records(tmp_path / name) if "loss" in r}
            for name in ("one", "two")}
  assert sorted(logged["one"])[:2] == [1, 2] and logged["two"] == logged["one"], logged
  assert all(values[COMPARED.index("rl/reward_std")] > 0 for values in logged["one"].values())  # (coins differed)


def test_bad_input_is_one_line_exit_2_nothing_written(task, tmp_path):
  """Every record of the prompts files is checked for the fields its rewards read (not the first alone): a record
  without its answer, or an rl.answer_field that names no field, is one line naming the file, line and field."""
  base = grpo_flags(task)
  lines = (task / "train.jsonl").read_text().splitlines()
  (tmp_path / "unanswered.jsonl").write_text("\n".join([*lines[:5], "", json.dumps({"prompt": "ab>"}), *lines[5:]]))
  held_out = (task / "held_out.jsonl").read_text().splitlines()
  (tmp_path / "held_out.jsonl").write_text("\n".join([*held_out[:3], json.dumps({"prompt": "ab>", "ans": "ba"})]))
  cases = [  # (flags, what the line names)
      (["--config=configs/tiny.py", "--config.train.objective=grpo"], "data.source"),
      ([*base, "--config.rl.rewards=no_such_module:reward"], "rl.rewards: 'no_such_module:reward': module"),
      ([*base, "--config.rl.rewards=tests.grpo_rewards:wrong_shape"], "reward wrong_shape: returned shape (3,)"),
      ([*base, "--config.rl.rewards=exact_match,nope=2"], "rl.rewards: 'nope' is not a registered reward"),
      ([*base, f"--config.data.path={tmp_path / 'unanswered.jsonl'}"],
       "unanswered.jsonl:7: has no 'answer' field, which reward exact_match reads (its fields: prompt); add 'answer' "
       "to every record, or set rl.answer_field to the field that holds it"),
      ([*base, "--config.rl.answer_field=answr"], "train.jsonl:1: has no 'answr' field, which reward exact_match "
       "reads (its fields: prompt, answer)"),
      ([*base, f"--config.data.eval_path={tmp_path / 'held_out.jsonl'}", "--config.eval.every_steps=2"],
       "held_out.jsonl:4: has no 'answer' field, which reward exact_match reads (its fields: prompt, ans)"),
  ]
  workdirs = [tmp_path / f"run{i}" for i in range(len(cases))]
  results = forked.run_many([["-m", "jaxtrain.main", *flags, f"--config.workdir={w}"]
                             for (flags, _), w in zip(cases, workdirs)])
  for (flags, message), result, workdir in zip(cases, results, workdirs):
    errors = [line for line in result.stderr.splitlines() if line.startswith("jaxtrain: error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and message in errors[0], (message, result.stderr[-2000:])
    assert not workdir.exists()


# End to end (slow) ----------------------------------------------------------------------------------------------


def _page_command(part: str, folder: pathlib.Path, *extra: str) -> str:
  """docs/post_training.md's command containing ``part``, run as written (plus ``extra`` flags) in ``folder`` on one
  device, as a CPU has: forked (tests/forked.py) from a process with the libraries imported; returns its output."""
  command = readme.command(part)
  argv = shlex.split(command)
  assert argv[0] == "python", command
  env = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=1"}
  r = forked.run([*argv[1:], *extra], env, timeout=600, cwd=folder)
  assert r.returncode == 0, f"{command}\n{r.stdout[-1000:]}\n{r.stderr[-3000:]}"
  return r.stdout + r.stderr


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
  """A fresh folder (the repository's configs/ and tools/ linked in) where the page's first two commands have run:
  the prompts written, the format fine-tuned (runs/letters_sft)."""
  folder = tmp_path_factory.mktemp("letters")
  for name in ("configs", "tools"):
    (folder / name).symlink_to(readme.ROOT / name)
  assert "48 training and 16 held-out prompts -> data/letters" in _page_command(LETTERS_DATA, folder)
  assert "done: step 60/60" in _page_command(LETTERS_SFT, folder)
  return folder


@pytest.fixture(scope="module")
def sft(letters):
  return letters / "runs" / "letters_sft" / "checkpoints"


@pytest.mark.slow
def test_grpo_raises_the_held_out_reward(letters, task):
  """docs/post_training.md's GRPO example as written (one device; every step logged): from the model fine-tuned
  briefly to the format (held-out reward < 0.5 at the first eval), GRPO raises the mean reward on held-out prompts
  by >= 0.3 within 100 steps, with the sampler's log-probabilities equal to the training forward's within 1e-5 at
  every step. The page's data are the suite's task."""
  for name in ("train", "held_out", "sft"):
    assert (letters / "data" / "letters" / f"{name}.jsonl").read_text() == (task / f"{name}.jsonl").read_text()
  assert "done: step 100/100" in _page_command(LETTERS_GRPO, letters, "--config.train.log_every=1")
  records = read_records(letters / "runs" / "grpo_letters")
  evals = {r["step"]: r["eval_reward_mean"] for r in records if "eval_reward_mean" in r}
  history = [r for r in records if "loss" in r]
  mismatch = max(h["rl/logp_mismatch"] for h in history)
  print("held-out reward: " + ", ".join(f"step {s} {v:.3f}" for s, v in evals.items())
        + f"; rl/logp_mismatch max {mismatch:.2e}")
  assert sorted(evals) == [20, 40, 60, 80, 100] and [h["step"] for h in history] == list(range(1, 101))
  first = evals[20]
  assert first < 0.5
  assert max(evals.values()) - first >= 0.3, evals
  assert mismatch < 1e-5
  assert all(h["rl/completion_length"] >= 1 for h in history)


@pytest.mark.slow
def test_sigkill_mid_run_resumes_to_bitwise_the_same_rewards_and_losses(task, sft, tmp_path):
  flags = [*grpo_flags(task), f"--config.checkpoint.restore_from={sft}", "--config.train.steps=8",
           "--config.checkpoint.every_steps=3"]
  full, killed = tmp_path / "full", tmp_path / "killed"
  r = forked.run(["-m", "jaxtrain.main", *flags, f"--config.workdir={full}"])
  assert r.returncode == 0, r.stderr[-3000:]
  p = forked.popen(["-m", "jaxtrain.main", *flags, f"--config.workdir={killed}"])
  deadline = time.time() + 300
  while p.poll() is None and time.time() < deadline and len(read_records(killed)) < 5:
    time.sleep(0.01)
  assert p.poll() is None, "the run finished before it could be killed"
  p.send_signal(signal.SIGKILL)
  p.communicate(timeout=60)
  r = forked.run(["-m", "jaxtrain.main", *flags, f"--config.workdir={killed}"])
  assert r.returncode == 0 and "resumed from checkpoint step" in r.stderr, r.stderr[-3000:]
  keys = ("loss", "grad_norm", "rl/reward_mean", "rl/reward_std", "rl/kl", "rl/completion_length")
  last = lambda w: {rec["step"]: tuple(rec[k] for k in keys) for rec in read_records(w) if "loss" in rec}  # noqa
  assert last(killed) == last(full) and sorted(last(full)) == list(range(1, 9))

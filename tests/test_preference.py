"""Preference optimization (train.objective=dpo|simpo|orpo, jaxtrain/train/objectives/preference.py) and its data
(tools/prepare_data.py --format=preference: jaxtrain/data/pairs.py, jaxtrain/data/preference.py)."""

import json
import math
import os
import pathlib
import random
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxtrain.data import preference as pref_data
from jaxtrain.data import prepare
from jaxtrain.errors import DataError
from jaxtrain.train import trainer
from jaxtrain.train.objectives import logprobs
from jaxtrain.train.objectives import preference
from tests import forked
from tests.conftest import small_config
from tests.test_moe import moe_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEQ_LEN = 48


def _write_jsonl(path: pathlib.Path, records) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
  return path


def shakespeare_pairs(n: int, seed: int = 0) -> list[dict]:
  """Prompt: 24 characters of the corpus; chosen: its true continuation (16 characters); rejected: the same
  characters shuffled (the same letters, so only their order tells the two apart)."""
  text = (ROOT / "jaxtrain/data/corpus/tinyshakespeare.txt").read_text()
  rng, out = random.Random(seed), []
  while len(out) < n:
    at = rng.randrange(len(text) - 64)
    prompt, chosen = text[at:at + 24], text[at + 24:at + 40]
    rejected = "".join(rng.sample(chosen, len(chosen)))
    if rejected != chosen:
      out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
  return out


@pytest.fixture(scope="module")
def pairs_data(tmp_path_factory) -> str:
  """A prepared preference folder: 400 pairs, about 10% held out."""
  tmp = tmp_path_factory.mktemp("pairs")
  src = _write_jsonl(tmp / "in" / "pairs.jsonl", shakespeare_pairs(400))
  prepare.prepare(prepare.Options(inputs=[os.fspath(src)], output=os.fspath(tmp / "data"), progress=False,
                                  eval_fraction=0.1, format="preference", seq_len=SEQ_LEN))
  return os.fspath(tmp / "data")


def dpo_config(workdir, path, objective="dpo", **mesh) -> ml_collections.ConfigDict:
  c = small_config(workdir, **(mesh or {"data": 8}))
  c.data.update(source="arrayrecord", path=path, seq_len=SEQ_LEN)
  c.train.update(objective=objective, steps=3, global_batch_size=16, log_every=1)
  c.optim.update(lr=3e-3, warmup_steps=2, decay_steps=100)  # (a schedule that does not depend on train.steps)
  # Its checkpoints are not fingerprinted (no fingerprint program compiled, ~0.7 CPU-s a run): only the resume test
  # restores one, and turns it back on (tests/test_checkpoint.py checks the fingerprints).
  c.checkpoint.verify = False
  return c


def _losses(history, key="loss"):
  return [h[key] for h in history if key in h]


# ------------------------------------------------------------------------------------------------------- data


def test_pairs_mask_prompts_truncate_from_the_left_and_count(tmp_path):
  long_prompt = "x" * 30 + "PROMPT:"
  records = [
      {"prompt": "Q: ", "chosen": "yes", "rejected": "no"},
      {"chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a1"},
                  {"role": "user", "content": "again"}, {"role": "assistant", "content": "good"}],
       "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a1"},
                    {"role": "user", "content": "again"}, {"role": "assistant", "content": "bad!"}]},
      {"prompt": long_prompt, "chosen": "abcd", "rejected": "efgh"},  # 41 tokens > 20 + 1: cut 20 from the left
      {"prompt": "p", "chosen": "c" * 30, "rejected": "r"},  # its response alone does not fit: dropped
  ]
  src = _write_jsonl(tmp_path / "in.jsonl", records)
  manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(src)], output=os.fspath(tmp_path / "out"),
                                             progress=False, eval_fraction=0.0, seq_len=20))  # format: auto
  assert manifest["format"] == prepare.FORMAT_PREFERENCE
  assert (manifest["documents"], manifest["preference"]["truncated"], manifest["preference"]["dropped"]) == (3, 1, 1)
  source = pref_data.Pairs(os.fspath(tmp_path / "out"), manifest, "train")
  got = {}
  for i in range(len(source)):
    (c_ids, c_trained), (r_ids, r_trained) = source[i]
    text = lambda ids, trained, want: bytes(int(t) for t, m in zip(ids, trained) if m == want).decode()  # noqa: E731
    got[text(c_ids, c_trained, 1)] = (text(c_ids, c_trained, 0), text(r_ids, r_trained, 0),
                                      text(r_ids, r_trained, 1), len(c_ids))
  assert got["yes"] == ("Q: ", "Q: ", "no", 6)
  # A chat: only the last assistant turn is trained, the earlier one is prompt; both sides share the prompt.
  assert got["good"][:3] == ("hia1again", "hia1again", "bad!")
  # Truncated from the prompt's left, to exactly seq_len + 1 tokens; the response whole.
  assert got["abcd"] == (long_prompt[-17:], long_prompt[-17:], "efgh", 21)
  batch = pref_data.make_batch(source, np.arange(len(source)), 20)
  assert batch["chosen_inputs"].shape == batch["rejected_loss_mask"].shape == (3, 20)
  # The loss counts exactly the response tokens' predictions (the first token is never a target).
  assert sorted(batch["chosen_loss_mask"].sum(1).tolist()) == [3, 4, 4]


def test_bad_preference_input_gives_one_line_and_exit_2(tmp_path, pairs_data):
  good = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})
  cases = {
      "missing.jsonl": ([good, json.dumps({"prompt": "p", "chosen": "a"})], "missing.jsonl:2: no field 'rejected' "
                        "(a preference record has 'chosen' and 'rejected'), its fields: prompt, chosen; fix or remove "
                        "the line"),
      "no_prompt.jsonl": ([good, json.dumps({"chosen": "a", "rejected": "b"})], "no_prompt.jsonl:2: no field 'prompt'"),
      "same.jsonl": ([good, json.dumps({"prompt": "p", "chosen": "same", "rejected": "same"})],
                     "same.jsonl:2: 'chosen' and 'rejected' are the same response"),
      "prompts.jsonl": ([good, json.dumps({"chosen": [{"role": "user", "content": "u"},
                                                      {"role": "assistant", "content": "a"}],
                                           "rejected": [{"role": "user", "content": "v"},
                                                        {"role": "assistant", "content": "b"}]})],
                        "prompts.jsonl:2: 'chosen' and 'rejected' differ before their last message"),
  }
  # Each command forked from one process with the libraries imported (tests/forked.py: the commands end at a mistake,
  # so a Python start with jax would cost more than the command): the same exit status, stdout and stderr.
  for name, (lines, _) in cases.items():
    _write_jsonl(tmp_path / name, lines)
  # dpo on a folder without pairs (pretraining text): one line naming the folder, exit 2, no workdir.
  text = tmp_path / "text"
  prepare.prepare(prepare.Options(inputs=[os.fspath(_write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}] * 1))],
                                  output=os.fspath(text), progress=False, eval_fraction=0.0))
  workdir = tmp_path / "run"
  results = forked.run_many([["tools/prepare_data.py", f"--input={tmp_path / name}",
                              f"--output={tmp_path / f'out-{name}'}", "--format=preference", "--seq_len=32"]
                             for name in cases]
                            + [["-m", "jaxtrain.main", "--config=configs/tiny.py", f"--config.workdir={workdir}",
                                "--config.train.objective=dpo", f"--config.data.path={text}"]])
  for (name, (_, message)), r in zip(cases.items(), results):
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / f"out-{name}").exists()
  r = results[-1]
  assert r.returncode == 2, r.stderr[-2000:]
  line = r.stderr.strip().splitlines()[-1]
  assert f"{text}: holds no preference pairs" in line and "--format=preference" in line
  assert not workdir.exists()
  # ... and lm on a preference folder.
  c = small_config(tmp_path / "lm", data=8)
  c.data.update(source="arrayrecord", path=pairs_data, seq_len=SEQ_LEN)
  with pytest.raises(DataError, match="holds preference pairs"):
    trainer.train(c)
  assert not (tmp_path / "lm").exists()


# ------------------------------------------------------------------------------------------- the loss itself


def _logits_case(seed=0, b=4, t=12, v=11):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(2, b, 2, t, v))  # (policy, reference) x pairs x (chosen, rejected) x tokens x vocab
  targets = rng.integers(0, v, size=(b, 2, t))
  mask = (rng.random((b, 2, t)) < 0.6).astype(np.float64)
  mask[..., 0] = 1.0
  return logits, targets, mask


def _np_logps(logits, targets, mask):
  """float64: summed log-probs of the targets, (the per-token derivative of that sum w.r.t. the logits)."""
  z = logits - logits.max(-1, keepdims=True)
  log_softmax = z - np.log(np.exp(z).sum(-1, keepdims=True))
  onehot = np.eye(logits.shape[-1])[targets]
  per_token = (log_softmax * onehot).sum(-1)
  return (per_token * mask).sum(-1), (onehot - np.exp(log_softmax)) * mask[..., None]


def _np_log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


def _np_sigmoid(x):
  return 1 / (1 + np.exp(-x))


def _reference_loss_and_grad(kind, p, logits, targets, mask):
  """The papers' formulas in float64 and their gradient w.r.t. the policy logits, by the chain rule."""
  logp, dlogp = _np_logps(logits[0], targets, mask)
  ref, _ = _np_logps(logits[1], targets, mask)
  n = mask.sum(-1)
  b = logp.shape[0]
  e = p.label_smoothing
  if kind == "dpo" and p.loss == "sigmoid":
    h = (logp[:, 0] - ref[:, 0]) - (logp[:, 1] - ref[:, 1])
    loss = -(1 - e) * _np_log_sigmoid(p.beta * h) - e * _np_log_sigmoid(-p.beta * h)
    dh = -(1 - e) * p.beta * _np_sigmoid(-p.beta * h) + e * p.beta * _np_sigmoid(p.beta * h)
    dl = np.stack([dh, -dh], 1)
  elif kind == "dpo":  # ipo
    h = (logp[:, 0] - ref[:, 0]) / n[:, 0] - (logp[:, 1] - ref[:, 1]) / n[:, 1]
    loss = (h - 1 / (2 * p.beta)) ** 2
    dh = 2 * (h - 1 / (2 * p.beta))
    dl = np.stack([dh / n[:, 0], -dh / n[:, 1]], 1)
  elif kind == "simpo":
    x = p.beta * (logp[:, 0] / n[:, 0] - logp[:, 1] / n[:, 1]) - p.simpo_gamma
    loss = -(1 - e) * _np_log_sigmoid(x) - e * _np_log_sigmoid(-x)
    dx = -(1 - e) * _np_sigmoid(-x) + e * _np_sigmoid(x)
    dl = np.stack([dx * p.beta / n[:, 0], -dx * p.beta / n[:, 1]], 1)
  else:  # orpo: NLL of the chosen tokens (token mean) - lambda * mean log sigmoid(log odds ratio)
    m = logp / n
    log_odds = m - np.log1p(-np.exp(m))
    x = log_odds[:, 0] - log_odds[:, 1]
    tokens = n[:, 0].sum()
    loss = -p.orpo_lambda * _np_log_sigmoid(x) - b * logp[:, 0] / tokens  # per pair, so that mean = the loss
    dodds = (1 / (1 - np.exp(m))) / n  # d log odds / d logp
    dx = -p.orpo_lambda * _np_sigmoid(-x)
    dl = np.stack([dx * dodds[:, 0] - b / tokens, -dx * dodds[:, 1]], 1)
  return loss.mean(), dl[..., None, None] * dlogp / b


def _jax_loss(kind, p, logits, targets, mask):
  """jaxtrain's loss from the same logits (float32): per-token log-probs as the training forward computes them
  (jaxtrain.train.losses.cross_entropy), then pair_statistics / objective_value."""
  from jaxtrain.train import losses as losses_lib

  def sums(lg):
    per_token = -losses_lib.cross_entropy(lg, targets)
    return jnp.sum(jnp.where(mask > 0, per_token, 0.0), -1)

  def loss(policy_logits):
    logp = sums(policy_logits)
    ref = jax.lax.stop_gradient(sums(jnp.asarray(logits[1], jnp.float32))) if kind == "dpo" else None
    stats = preference.pair_statistics(kind, p, logp, jnp.asarray(mask.sum(-1), jnp.float32), ref)
    return preference.objective_value(kind, p, stats, logp.shape[0], mask[:, 0].sum())

  return jax.value_and_grad(loss)(jnp.asarray(logits[0], jnp.float32))


@pytest.mark.parametrize("kind,overrides", [("dpo", {}), ("dpo", {"label_smoothing": 0.2}),
                                            ("dpo", {"loss": "ipo", "beta": 0.5}),
                                            ("simpo", {"beta": 2.0, "label_smoothing": 0.1}), ("orpo", {})])
def test_loss_and_gradient_equal_the_papers_formulas_in_float64(kind, overrides):
  p = preference.defaults()
  p.update(**overrides)
  logits, targets, mask = _logits_case()
  want_loss, want_grad = _reference_loss_and_grad(kind, p, logits, targets, mask)
  loss, grad = _jax_loss(kind, p, logits, targets, mask)
  assert abs(float(loss) - want_loss) < 1e-6, (float(loss), want_loss)
  np.testing.assert_allclose(np.asarray(grad, np.float64), want_grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_and_gradient_equal_trl(loss_type):
  """TRL's DPOTrainer._compute_loss, run on a stand-in model whose per-token log-probs come from the same logits
  (precomputed reference log-probs, as TRL's precompute_ref_log_probs passes them)."""
  torch = pytest.importorskip("torch")
  trl = pytest.importorskip("trl")
  import collections

  p = preference.defaults()
  p.update(loss=loss_type, beta=0.3)
  logits, targets, mask = _logits_case(seed=1)
  b, _, t, v = logits.shape[1:]
  policy = torch.tensor(logits[0].reshape(b * 2, t, v), dtype=torch.float64, requires_grad=True)
  # TRL's batch is [chosen rows; rejected rows], each a sequence whose token j + 1 is predicted at j.
  order = lambda x: np.concatenate([x[:, 0], x[:, 1]])  # noqa: E731
  tgt, msk = torch.tensor(order(targets)), torch.tensor(order(mask))
  ref_sums, _ = _np_logps(logits[1], targets, mask)

  class Model(torch.nn.Module):
    training = True

    def forward(self, input_ids, attention_mask, labels, **kw):
      lg = torch.cat([policy.view(b, 2, t, v)[:, 0], policy.view(b, 2, t, v)[:, 1]])
      lp = torch.log_softmax(lg, -1).gather(-1, tgt[..., None])[..., 0] * msk
      zeros = torch.zeros_like(lp)
      return types.SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

  accelerator = types.SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x)
  fake = types.SimpleNamespace(
      model=Model(), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
      f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0], beta=p.beta,
      label_smoothing=0.0, use_weighting=False, _metrics={"train": collections.defaultdict(list)},
      _total_train_tokens=0, _tp_size=1, args=types.SimpleNamespace())
  # completion_mask marks token j + 1 when target j is a response token: TRL shifts it by one.
  completion = torch.cat([torch.zeros(2 * b, 1), msk], 1)
  inputs = {"input_ids": torch.zeros(2 * b, t + 1, dtype=torch.long), "attention_mask": torch.ones(2 * b, t + 1),
            "completion_mask": completion, "ref_chosen_logps": torch.tensor(ref_sums[:, 0]),
            "ref_rejected_logps": torch.tensor(ref_sums[:, 1])}
  trl_loss = trl.DPOTrainer._compute_loss(fake, fake.model, inputs, False)  # noqa: SLF001 - its loss, as it is
  trl_loss.backward()
  trl_grad = policy.grad.numpy().reshape(b, 2, t, v)
  loss, grad = _jax_loss("dpo", p, logits, targets, mask)
  trl_loss = float(trl_loss.detach())
  assert abs(float(loss) - trl_loss) < 1e-6, (float(loss), trl_loss)
  np.testing.assert_allclose(np.asarray(grad, np.float64), trl_grad, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------- training on the mesh


def test_lora_reference_equals_a_frozen_copy_bitwise(tmp_path, pairs_data):
  """preference.reference=adapters_off (the policy's base weights, adapters dropped) gives bitwise the
  log-probabilities of a frozen copy of the starting params, here after the adapters have trained away from 0."""
  c = dpo_config(tmp_path, pairs_data)
  c.model.lora.update(rank=4, alpha=8.0, targets="q,v,down")
  run = trainer.build(c)
  state = trainer.init_state(run)
  adapted = jax.tree.map(lambda x: x + 0.05, state.params["lora"])  # as if trained
  params = {**state.params, "lora": adapted}
  frozen = logprobs.Reference(run, "frozen")
  adapters_off = logprobs.Reference(run, "adapters_off")
  batch = preference.Preference().to_global(run, next(pref_data.stream(run.config, False)))
  sums = jax.jit(lambda p, b: preference.pair_sums(run.model, p, b)[0])
  with jax.set_mesh(run.mesh):
    off = np.asarray(sums(adapters_off.params(params), batch))
    copy = np.asarray(sums(frozen.params(params, *frozen.extra), batch))
    policy = np.asarray(sums(params, batch))
  np.testing.assert_array_equal(off, copy)
  assert not np.array_equal(policy, off)  # (the adapters do change the policy)


@pytest.fixture(scope="module")
def one_device_dpo(tmp_path_factory, pairs_data):
  """Three DPO steps on one device: the history the sharded runs must equal."""
  c = dpo_config(tmp_path_factory.mktemp("one"), pairs_data, data=1)
  _, history = trainer.train(c, devices=jax.devices()[:1])
  return history


def test_first_step_loss_is_ln2_and_metrics_are_logged(one_device_dpo):
  first = one_device_dpo[0]
  assert abs(first["loss"] - math.log(2)) < 1e-6, first["loss"]
  for key in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
    assert abs(first[key]) < 1e-6, first
  for key in preference.METRICS:
    assert all(key in h for h in one_device_dpo if "loss" in h)
  assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0


def test_a_moe_models_router_losses_are_in_the_preference_objective(tmp_path, pairs_data):
  """DPO on a MoE model, in two microbatches: its first step's loss is ln 2 (the policy is the reference) plus the
  router's auxiliary losses weighted by their keys (model.load_balance_weight, model.router_z_weight), as the
  language model's step adds them, and they are logged (aux_loss/<name>): without them a preference run's routers
  would drift from balance unchecked."""
  c = moe_config(tmp_path, steps=1)
  c.data.update(source="arrayrecord", path=pairs_data, seq_len=SEQ_LEN)
  c.train.update(objective="dpo")
  c.checkpoint.verify = False  # (nothing restores its checkpoint: no fingerprint program compiled)
  _, history = trainer.train(c, devices=jax.devices()[:1])
  first = history[0]
  aux = {n: first[f"aux_loss/{n}"] for n in ("load_balance", "router_z")}
  assert all(v > 0 for v in aux.values()), first
  want = math.log(2) + c.model.load_balance_weight * aux["load_balance"] + c.model.router_z_weight * aux["router_z"]
  assert abs(first["loss"] - want) < 1e-6, (first["loss"], want)


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_sharded_fsdp_by_tensor_equals_one_device(tmp_path, pairs_data, one_device_dpo, lora, caplog):
  """... and its console line shows DPO's own figures, the reward accuracy and margin (the objective's
  console_metrics)."""
  c = dpo_config(tmp_path, pairs_data, data=1, fsdp=4, tensor=2)
  if lora:  # with LoRA the reference is the adapters-off base; compare against one device with LoRA too
    c.model.lora.update(rank=4, alpha=8.0, targets="q,v,down")
    one = dpo_config(tmp_path / "one", pairs_data, data=1)
    one.model.lora.update(rank=4, alpha=8.0, targets="q,v,down")
    _, want = trainer.train(one, devices=jax.devices()[:1])
  else:
    want = one_device_dpo
  with caplog.at_level("INFO"):
    _, got = trainer.train(c)
  np.testing.assert_allclose(_losses(got), _losses(want), rtol=0, atol=1e-5)
  step3 = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 3/3 | loss ")]
  assert len(step3) == 1 and f"| rewards/accuracy {got[-1]['rewards/accuracy']:.4f} | rewards/margin " in step3[0], \
      step3
  np.testing.assert_allclose(_losses(got, "rewards/margin"), _losses(want, "rewards/margin"), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_reference_logps_command_writes_what_the_step_would_compute(tmp_path, pairs_data):
  """tools/reference_logps.py with the run's flags: the reference log-probs of every pair of both splits, equal to
  the reference forward's on the same mesh; a run that is not dpo is one line, exit 2, nothing written."""
  import shutil
  data = tmp_path / "data"
  shutil.copytree(pairs_data, data)
  flags = ["--config=configs/tiny.py", "--config.train.objective=dpo", f"--config.data.path={data}",
           f"--config.data.seq_len={SEQ_LEN}", "--config.mesh.fsdp=8", f"--config.workdir={tmp_path / 'run'}"]
  # Forked (tests/forked.py) in the tests' environment (their XLA flags, not a training run's RUN_FLAGS), as a
  # `python tools/reference_logps.py` started from here would be.
  bad = forked.run(["tools/reference_logps.py", *flags, "--config.train.objective=simpo"], optimized=False)
  assert bad.returncode == 2 and "train.objective: is simpo; only dpo has a reference model" in bad.stderr
  assert not (data / "reference-train.npy").exists()
  r = forked.run(["tools/reference_logps.py", *flags], optimized=False)
  assert r.returncode == 0, r.stderr[-3000:]
  manifest = pref_data.open_manifest(os.fspath(data))
  train = np.load(data / "reference-train.npy")
  assert train.shape == (len(pref_data.Pairs(os.fspath(data), manifest, "train")), 2) and (train < 0).all()
  assert np.load(data / "reference-eval.npy").shape[1] == 2
  # The same numbers as the step's own reference forward over one batch of those pairs.
  from configs import tiny
  c = tiny.get_config()
  c.train.objective, c.data.path, c.data.seq_len, c.mesh.fsdp = "dpo", os.fspath(data), SEQ_LEN, 8
  run = trainer.build(c)
  source = pref_data.Pairs(os.fspath(data), manifest, "train")
  batch = preference.Preference().to_global(run, pref_data.make_batch(source, np.arange(16), SEQ_LEN))
  with jax.set_mesh(run.mesh):
    params = logprobs.Reference(run, "frozen").extra[0]
    sums = np.asarray(jax.jit(lambda p, b: preference.pair_sums(run.model, p, b)[0])(params, batch))
  np.testing.assert_allclose(sums, train[:16], rtol=1e-6, atol=0)  # (float32 sums of ~90: a few ulps)


@pytest.mark.slow
def test_context_parallel_equals_one_device(tmp_path, pairs_data, one_device_dpo):
  """mesh.context=2: each pair's rows split along the sequence (load-balanced order); the sums are the same."""
  _, got = trainer.train(dpo_config(tmp_path, pairs_data, data=1, fsdp=4, context=2))
  np.testing.assert_allclose(_losses(got), _losses(one_device_dpo), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_microbatches_precomputed_reference_and_exact_resume(tmp_path, pairs_data, one_device_dpo):
  """On 2 devices (data = 2: microbatching, the precomputed reference and the resume, not the device count, are the
  point). The microbatched run is also the one resumed."""
  two = jax.devices()[:2]
  # Two microbatches: the same update as the whole batch at once.
  c = dpo_config(tmp_path / "micro", pairs_data, data=2)
  c.train.microbatches = 2
  c.checkpoint.update(every_steps=2, verify=True)  # (resumed below: fingerprinted and checked, as a run's are)
  _, micro = trainer.train(c, devices=two)
  np.testing.assert_allclose(_losses(micro), _losses(one_device_dpo), rtol=0, atol=1e-5)
  # Reference log-probs precomputed into the folder (tools/reference_logps.py's function): the same losses.
  data = tmp_path / "data"
  import shutil
  shutil.copytree(pairs_data, data)
  c = dpo_config(tmp_path / "pre", os.fspath(data), data=2)
  c.preference.reference = "precomputed"
  with pytest.raises(DataError, match="precomputed reference log-probs"):
    trainer.train(c, devices=two)
  computed = preference.compute_reference(trainer.build(c, two))
  assert computed["train"].shape == (len(pref_data.Pairs(os.fspath(data), pref_data.open_manifest(os.fspath(data)),
                                                         "train")), 2)
  _, pre = trainer.train(c, devices=two)
  np.testing.assert_allclose(_losses(pre), _losses(one_device_dpo), rtol=0, atol=1e-5)
  # Resume: the microbatched run's workdir with its step-3 checkpoint removed (as if stopped after its step-2 save)
  # goes on to 3: bitwise the uninterrupted run's step 3.
  shutil.copytree(tmp_path / "micro", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "3")
  resumed = dpo_config(tmp_path / "resumed", pairs_data, data=2)
  resumed.train.microbatches = 2
  resumed.checkpoint.verify = True
  _, rest = trainer.train(resumed, devices=two)
  assert [h["step"] for h in rest if "loss" in h] == [3]
  assert _losses(rest) == _losses(micro)[2:]
  assert _losses(rest, "rewards/margin") == _losses(micro, "rewards/margin")[2:]


def test_config_mistakes_are_one_line(tmp_path, pairs_data):
  from jaxtrain import config as config_lib
  c = dpo_config(tmp_path, pairs_data)
  for key, value, message in [("preference.loss", "hinge", "'hinge' is not one of sigmoid, ipo"),
                              ("preference.reference", "adapters_off", "adapters_off needs LoRA"),
                              ("preference.beta", 0.0, "must be > 0")]:
    bad = ml_collections.ConfigDict(c.to_dict())
    grp, name = key.split(".")
    bad[grp][name] = value
    with pytest.raises(config_lib.ConfigError, match=message):
      config_lib.resolve(bad)
  bad = ml_collections.ConfigDict(c.to_dict())
  bad.train.objective = "simpo"
  bad.preference.orpo_lambda = 0.5
  with pytest.raises(config_lib.ConfigError, match="preference.orpo_lambda: is set but train.objective=simpo"):
    config_lib.resolve(bad)
  bad = ml_collections.ConfigDict(c.to_dict())
  bad.mesh.update(data=2, pipeline=4)
  with pytest.raises(config_lib.ConfigError, match="mesh.pipeline: train.objective=dpo does not run pipelined"):
    config_lib.resolve(bad)


def test_dry_run_counts_the_frozen_reference_and_not_the_adapters_off_one(tmp_path, pairs_data):
  """The dry run compiles the DPO step without allocating anything: a frozen reference is one more copy of the
  params among the step's arguments; with LoRA and adapters off there is none."""
  def arguments(**overrides):
    c = dpo_config(tmp_path, pairs_data)
    c.model.lora.update(rank=4, alpha=8.0, targets="q,v")
    c.preference.update(**overrides)
    return trainer.dry_run(c)["memory_per_device"]["argument"]
  run = trainer.build(dpo_config(tmp_path, pairs_data))
  params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run.model.abstract_params))  # (replicated)
  frozen, off = arguments(reference="frozen"), arguments(reference="adapters_off")
  assert frozen - off >= params * 0.9, (frozen, off, params)


@pytest.mark.slow
@pytest.mark.parametrize("objective,overrides", [("dpo", {}), ("simpo", {"beta": 2.0}), ("orpo", {})])
def test_training_reaches_held_out_accuracy_with_a_growing_margin(tmp_path, pairs_data, objective, overrides):
  """A tiny model from scratch learns to prefer the corpus's true continuations over shuffled ones: on the
  held-out pairs rewards/accuracy >= 0.9 and the reward margin grows."""
  c = dpo_config(tmp_path, pairs_data, objective)
  c.preference.update(**overrides)
  c.train.update(steps=40, log_every=10)
  c.eval.every_steps = 20
  trainer.train(c)
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  evals = [h for h in records if "eval_rewards/accuracy" in h]
  assert [h["step"] for h in evals] == [20, 40]
  assert evals[-1]["eval_rewards/accuracy"] >= 0.9, evals
  assert evals[0]["eval_rewards/margin"] < evals[-1]["eval_rewards/margin"], evals
  assert evals[-1]["eval_pairs"] == len(pref_data.Pairs(pairs_data, pref_data.open_manifest(pairs_data), "eval"))

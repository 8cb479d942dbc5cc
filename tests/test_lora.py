"""LoRA fine-tuning (jaxtrain/models/lora.py): an adapted model starts equal to its base, trains only its adapters
(the base bitwise unchanged, optimizer state for the adapters alone), shards and pipelines like any run, starts
from an imported Hugging Face checkpoint and exports merged weights that transformers loads; bad settings are
one-line config errors."""

import itertools
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import models
from jaxtrain.config import ConfigError, base_config, validate_values
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.models import lora
from jaxtrain.train import trainer
from tests import forked
from tests.conftest import small_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALL = "q,k,v,o,gate,up,down"


def _lora_config(workdir, rank=4, alpha=8.0, targets=ALL, **mesh):
  c = small_config(workdir, **mesh)
  c.model.lora.update(rank=rank, alpha=alpha, targets=targets)
  c.optim.update(lr=3e-2, warmup_steps=1, decay_steps=5)  # adapters start at B = 0: a larger lr than full FT
  return c


def _train(config, **kw):
  """trainer.train on one repeated batch (so that a few LoRA steps on a random base visibly lower the loss)."""
  batch = next(SyntheticSource(config.data.seq_len, 256, config.train.global_batch_size, seed=0))
  return trainer.train(config, data=itertools.repeat(batch), **kw)


def _inputs(batch=2, length=16, seed=0):
  tokens = np.random.default_rng(seed).integers(0, 256, (batch, length)).astype(np.int32)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
  return tokens, positions, np.ones((batch, length), np.int32)


def _bitwise_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
      np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
      for x, y in zip(la, lb))


def _base(params):
  return {k: v for k, v in params.items() if k != "lora"}


def _recording_starts(monkeypatch):
  """``(fresh, started)``: lists to which each trainer.train run then appends (on the host) the params of its fresh
  init and those it starts its loop from (a checkpoint's, or the init with ``checkpoint.restore_from``'s params):
  what the run itself started from, without compiling another init for the test."""
  from jaxtrain.train import start
  fresh, started = [], []
  init_state, restore_or_init = start.init_state, trainer.restore_or_init

  def recording_init(run):
    state = init_state(run)
    fresh.append(jax.device_get(state.params))
    return state

  def recording_start(*args):
    state, meta = restore_or_init(*args)
    started.append(jax.device_get(state.params))
    return state, meta
  monkeypatch.setattr(start, "init_state", recording_init)
  monkeypatch.setattr(trainer, "restore_or_init", recording_start)
  return fresh, started


@pytest.mark.slow
def test_adapters_mirror_their_kernels_and_start_at_the_base(tmp_path):
  """Adapters under params['lora'] with the split rule's shapes and the kernels' logical names; at init (B = 0)
  the base params are those of the model without LoRA (same seed) and the logits are identical."""
  plain = models.Model.from_config(small_config(tmp_path).model)
  cfg = _lora_config(tmp_path, targets="q,o,down,lm_head")
  adapted = models.Model.from_config(cfg.model)
  shapes = jax.tree.map(lambda a: a.shape, adapted.abstract_params["lora"])
  # q [layers, embed | heads, head_dim]; o [layers, heads, head_dim | embed]; down [layers, mlp | embed];
  # lm_head [embed | vocab] (not stacked).
  assert shapes == {"layers": {"attn": {"q": {"a": (2, 64, 4), "b": (2, 4, 8, 16)},
                                        "o": {"a": (2, 8, 16, 4), "b": (2, 4, 64)}},
                               "mlp": {"down": {"a": (2, 128, 4), "b": (2, 4, 64)}}},
                    "lm_head": {"a": (64, 4), "b": (4, 256)}}
  P = jax.sharding.PartitionSpec
  specs = adapted.logical_specs["lora"]
  assert specs["layers"]["attn"]["q"] == {"a": P("layers", "embed", None), "b": P("layers", None, "heads", "head_dim")}
  assert specs["layers"]["attn"]["o"] == {"a": P("layers", "heads", "head_dim", None), "b": P("layers", None, "embed")}
  assert specs["lm_head"] == {"a": P("embed", None), "b": P(None, "vocab")}
  rng = jax.random.key(3)
  p0, p1 = jax.jit(plain.init)(rng), jax.jit(adapted.init)(rng)
  assert _bitwise_equal(_base(p1), p0)
  for ab in jax.tree.leaves(p1["lora"], is_leaf=lambda x: isinstance(x, dict) and "a" in x):
    assert not np.any(np.asarray(ab["b"])) and np.std(np.asarray(ab["a"])) > 0
  a = np.asarray(p1["lora"]["layers"]["mlp"]["down"]["a"])
  assert np.abs(a).max() <= 1 / math.sqrt(128)  # uniform in +-1/sqrt(fan_in), fan_in = mlp_dim
  assert adapted.num_params() == plain.num_params() + sum(x.size for x in jax.tree.leaves(p1["lora"]))
  assert adapted.flops_per_token(32) == plain.flops_per_token(32)  # the merged model computes like the base
  x = _inputs()
  assert np.array_equal(np.asarray(jax.jit(adapted.apply)(p1, *x)), np.asarray(jax.jit(plain.apply)(p0, *x)))


@pytest.mark.slow
def test_merge_is_w_plus_scaled_ab_and_is_the_adapted_forward(tmp_path):
  """merge(): W + alpha / rank * A @ B exactly (hand-made A, B whose products are exact in float32), the lora key
  gone; the adapted forward equals the base model on the merged params; the gradient reaches only the adapters
  (the base is under stop_gradient)."""
  cfg = _lora_config(tmp_path, rank=4, alpha=8.0, targets="q,down")  # scale 2
  model = models.Model.from_config(cfg.model)
  plain = models.Model.from_config(small_config(tmp_path).model)
  params = jax.device_get(jax.jit(model.init)(jax.random.key(0)))
  rng = np.random.default_rng(0)
  for path in (("layers", "attn", "q"), ("layers", "mlp", "down")):
    ab = params["lora"][path[0]][path[1]][path[2]]
    ab["a"] = rng.integers(-3, 4, ab["a"].shape).astype(np.float32) / 4
    ab["b"] = rng.integers(-3, 4, ab["b"].shape).astype(np.float32) / 8
  merged = jax.device_get(lora.merge(params, cfg.model.lora))
  assert set(merged) == set(params) - {"lora"}
  q, qa = params["layers"]["attn"]["q"]["kernel"], params["lora"]["layers"]["attn"]["q"]
  want = q + np.float32(2.0) * np.einsum("ldr,lrnh->ldnh", qa["a"], qa["b"])
  assert merged["layers"]["attn"]["q"]["kernel"].tobytes() == want.tobytes()
  d, da = params["layers"]["mlp"]["down"]["kernel"], params["lora"]["layers"]["mlp"]["down"]
  want = d + np.float32(2.0) * (da["a"] @ da["b"])
  assert merged["layers"]["mlp"]["down"]["kernel"].tobytes() == want.tobytes()
  assert not np.array_equal(merged["layers"]["mlp"]["down"]["kernel"], d)
  assert _bitwise_equal(merged["layers"]["attn"]["k"], params["layers"]["attn"]["k"])  # untargeted
  assert _bitwise_equal(merged["embed"], params["embed"])

  x = _inputs()
  adapted = np.asarray(jax.jit(model.apply)(params, *x))
  plain_apply = jax.jit(plain.apply)  # (one compile for both params below)
  on_merged = np.asarray(plain_apply(merged, *x))
  assert np.max(np.abs(adapted - on_merged)) <= 1e-6 * np.max(np.abs(on_merged))
  assert not np.allclose(adapted, np.asarray(plain_apply(_base(params), *x)))

  grads = jax.jit(jax.grad(lambda p: jnp.mean(model.apply(p, *x) ** 2)))(params)
  assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(_base(grads)))  # frozen: zero gradient
  assert all(np.any(np.asarray(g)) for g in jax.tree.leaves(grads["lora"]))


def _opt_leaf_owners(opt_state):
  """The param path each array leaf of the optimizer state belongs to (its path's suffix after mu / nu), and the
  bytes of the scalar leaves (counters)."""
  owners, scalar_bytes = [], 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    field = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)][-1]
    if leaf.ndim == 0:
      scalar_bytes += leaf.nbytes
    else:
      owners.append((field, tuple(keys[1:])))  # keys[0]: multi_transform's label ('train')
  return owners, scalar_bytes


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
  """5 LoRA steps on a data=2 x fsdp=2 x tensor=2 mesh, with its initial params (as the run started from them)."""
  workdir = tmp_path_factory.mktemp("lora_sharded")
  config = _lora_config(workdir, data=2, fsdp=2, tensor=2)
  config.checkpoint.every_steps = 3
  run = trainer.build(config)
  with pytest.MonkeyPatch.context() as monkeypatch:
    _, started = _recording_starts(monkeypatch)
    state, history = _train(config)
  return config, run, started[0], jax.device_get(state), history


@pytest.mark.slow
def test_lora_trains_only_the_adapters(sharded_run, tmp_path):
  """The base params are bitwise those of the initial state after 5 steps; every adapter moved; the loss falls;
  the optimizer state holds AdamW's two moments of the adapters and nothing else (no state for any frozen param),
  and its bytes are exactly 2 x the adapters' + the two int32 counters, as trainer.report and tools/estimate.py
  say."""
  from tests.test_distributed import _estimate_module
  config, run, initial, state, history = sharded_run
  assert _bitwise_equal(_base(state.params), _base(initial))
  for before, after in zip(jax.tree.leaves(initial["lora"]), jax.tree.leaves(state.params["lora"]), strict=True):
    assert not np.array_equal(before, after)
  losses = [h["loss"] for h in history]
  assert len(losses) == 5 and all(math.isfinite(x) for x in losses) and not any(h["skipped"] for h in history)
  assert losses[-1] < losses[0] - 0.1, losses  # measured: 5.555 -> 5.392 (the first step's lr is 0)

  adapters = {tuple(str(k.key) for k in p): a for p, a in jax.tree_util.tree_leaves_with_path(state.params["lora"])}
  owners, scalar_bytes = _opt_leaf_owners(state.opt_state)
  assert sorted(owners) == sorted((f, ("lora",) + p) for f in ("mu", "nu") for p in adapters)
  adapter_bytes = sum(a.nbytes for a in adapters.values())
  assert scalar_bytes == 2 * 4  # AdamW's count and the schedule's, int32
  report = trainer.report(run)
  assert report["opt_bytes_total"] == 2 * adapter_bytes + scalar_bytes
  assert report["trainable_params"] == sum(a.size for a in adapters.values())
  full = trainer.report(trainer.build(small_config(tmp_path, data=2, fsdp=2, tensor=2)))
  assert full["opt_bytes_total"] == 2 * full["param_bytes_total"] + 8
  print(f"opt-state bytes: LoRA {report['opt_bytes_total']:,} (adapters {adapter_bytes:,}), full fine-tuning "
        f"{full['opt_bytes_total']:,}")
  estimate = _estimate_module()
  predicted = estimate.estimate(config, 8)["bytes_per_device"]
  assert predicted["optimizer"] == report["opt_bytes_per_device"]
  assert predicted["params"] == report["param_bytes_per_device"]


@pytest.mark.slow
def test_lora_run_resumes_exactly_and_refuses_a_plain_model(sharded_run, tmp_path):
  """A LoRA run's checkpoints hold base + adapters: resumed to 5 from the step-3 checkpoint (a copy of the
  uninterrupted run's workdir without its step 5), equal the 5 uninterrupted steps bitwise. Restoring them into a
  model without LoRA is a one-line error naming the adapters."""
  import shutil
  config, _, _, state, history = sharded_run
  shutil.copytree(config.workdir, tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "5")
  resumed = _lora_config(tmp_path / "resumed", data=2, fsdp=2, tensor=2)
  state2, history2 = _train(resumed)
  assert [h["step"] for h in history2] == [4, 5]
  assert [h["loss"] for h in history2] == [h["loss"] for h in history[3:]]
  assert _bitwise_equal(jax.device_get(state2.params), state.params)
  assert _bitwise_equal(jax.device_get(state2.opt_state), state.opt_state)

  plain = trainer.build(small_config(tmp_path / "plain", fsdp=8))
  abstract = plain.abstract_state()
  with pytest.raises(checkpoint_lib.CheckpointError) as e:
    checkpoint_lib.restore_from(os.path.join(config.workdir, "checkpoints"), abstract, params_only=True)
  assert "\n" not in str(e.value) and "holds params of another model (it has params/lora/" in str(e.value)


@pytest.mark.slow
def test_lora_sharded_and_pipelined_equal_one_device(sharded_run, tmp_path):
  """The same LoRA run on one device and on a 2-stage 1F1B pipeline (2 devices: the adapters' gradients come out of
  the schedule's own backward, through the merge) gives the (2, 2, 2) mesh's losses."""
  _, _, _, _, sharded = sharded_run
  single = _lora_config(tmp_path / "single")
  single.checkpoint.verify = False  # (no fingerprint program compiled for the final save: nothing restores it)
  _, single = _train(single, devices=jax.devices()[:1])
  np.testing.assert_allclose([h["loss"] for h in single], [h["loss"] for h in sharded], rtol=1e-5)
  pipelined = _lora_config(tmp_path / "pipelined", pipeline=2)
  pipelined.pipeline.schedule = "1f1b"
  pipelined.checkpoint.verify = False
  state, history = _train(pipelined, devices=jax.devices()[:2])
  assert state.params["lora"]["layers"]["attn"]["q"]["a"].sharding.spec[0] == "pipeline"
  np.testing.assert_allclose([h["loss"] for h in history], [h["loss"] for h in sharded], rtol=1e-5)


@pytest.mark.slow
def test_lora_on_multi_head_latent_attention_trains_sharded_equal_to_one_device(tmp_path, monkeypatch):
  """DeepSeek-V3's latent attention adapted (the query and key/value down- and up-projections, and the output):
  4 steps on fsdp 2 x tensor 2 x expert 2 give one device's losses within 1e-5; every adapter moved, the base is
  bitwise unchanged."""
  from tests.test_deepseek_v3 import _config as deepseek_config
  _, started = _recording_starts(monkeypatch)
  runs = {}
  for name, mesh in (("one", {}), ("sharded", dict(fsdp=2, tensor=2, expert=2))):
    c = deepseek_config(tmp_path / name, **mesh)
    c.model.lora.update(rank=4, alpha=8.0, targets="q_a,q_b,kv_a,kv_b,o")
    c.optim.update(lr=3e-2, warmup_steps=1, decay_steps=5)
    c.train.steps = 4
    c.checkpoint.verify = False  # (no fingerprint program compiled for the final save: nothing restores it)
    state, history = _train(c, devices=jax.devices()[:1] if not mesh else None)
    runs[name] = started[-1], jax.device_get(state.params), [h["loss"] for h in history]
  initial, final, losses = runs["sharded"]
  adapted = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(final["lora"])}
  assert {a.split("']['")[-2] for a in adapted} == {"q_a", "q_b", "kv_a", "kv_b", "o"}
  assert all("dense_layers" in a or "['layers']" in a for a in adapted)
  # The dense first layers are a stack of their own: each layer's own rank-4 adapter, as in the MoE stack.
  dense, moe = final["lora"]["dense_layers"]["attn"]["kv_b"], final["lora"]["layers"]["attn"]["kv_b"]
  assert (dense["a"].shape, dense["b"].shape) == ((1, 16, 4), (1, 4, 4, 28))
  assert (moe["a"].shape, moe["b"].shape) == ((2, 16, 4), (2, 4, 4, 28))
  for before, after in zip(jax.tree.leaves(initial["lora"]), jax.tree.leaves(final["lora"]), strict=True):
    assert not np.array_equal(before, after)
  assert _bitwise_equal(_base(final), _base(initial))
  assert losses[-1] < losses[0]
  np.testing.assert_allclose(losses, runs["one"][2], rtol=1e-5)


@pytest.mark.parametrize("key,value,message", [
    ("targets", "q,qkv", "model.lora.targets: 'qkv' names no kernel of this model; use names from the kernels' "
                         "paths: attn, down, gate, k, layers, lm_head, mlp, o, q, up, v"),
    ("rank", -1, "model.lora.rank: must be an integer >= 0, got -1"),
    ("alpha", 0.0, "model.lora.alpha: must be > 0, got 0.0"),
    ("targets", " , ", "model.lora.targets: is empty"),
])
def test_bad_lora_config_is_a_config_error(key, value, message):
  c = base_config()
  c.model.lora.rank = 4
  c.model.lora[key] = value
  with pytest.raises(ConfigError) as e:
    validate_values(c)
  assert e.value.subject == f"model.lora.{key}" and "\n" not in str(e.value)
  assert str(e.value).startswith(message), str(e.value)


def test_bad_lora_target_on_the_command_line_is_one_line(tmp_path):
  result = forked.run(["-m", "jaxtrain.main", "--config=configs/tiny.py", "--config.model.lora.rank=8",
                       "--config.model.lora.targets=q,proj", f"--config.workdir={tmp_path}/run"])
  errors = [line for line in result.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
  assert "model.lora.targets: 'proj' names no kernel of this model" in errors[0]
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_fine_tune_imported_checkpoint_with_lora_then_export(tmp_path, monkeypatch):
  """Import an HF Llama, fine-tune it with LoRA from OUT/config.py (restore_mode=params: the import's weights,
  fresh adapters), export: transformers loads the merged weights with no missing or unexpected keys, and its
  logits are jaxtrain's adapted model's; untargeted tensors are exported bitwise as imported."""
  pytest.importorskip("torch", reason="torch (test-only) is not installed: the Hugging Face comparison needs it")
  transformers = pytest.importorskip("transformers", reason="transformers (test-only) is not installed: the "
                                     "Hugging Face comparison needs it")
  from safetensors.numpy import load_file
  from jaxtrain import hf
  from tests import test_hf
  test_hf._hf_model(tmp_path / "src", **test_hf.CONFIGS["gqa_untied"])
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  assert "# c.model.lora.update(rank=8" in (tmp_path / "out" / "config.py").read_text()
  cfg = test_hf._load_config(tmp_path / "out" / "config.py")
  cfg.workdir = str(tmp_path / "run")
  cfg.model.lora.update(rank=4, alpha=8.0, targets="q,k,v,o,gate,up,down")
  cfg.data.update(source="synthetic", seq_len=16)
  cfg.train.update(steps=3, global_batch_size=8, log_every=1)
  cfg.optim.update(lr=1e-2, warmup_steps=1)
  _, _, imported = test_hf._restore(tmp_path / "out")

  fresh, started = _recording_starts(monkeypatch)
  run = trainer.build(cfg)
  state, _ = trainer.train(cfg)
  # The start (the run's own): the imported weights and exactly the fresh adapters.
  assert len(fresh) == len(started) == 1
  assert _bitwise_equal(_base(started[0]), jax.device_get(imported))
  assert _bitwise_equal(started[0]["lora"], fresh[0]["lora"])
  params = jax.device_get(state.params)
  assert _bitwise_equal(_base(params), jax.device_get(imported))
  hf.export_model(str(tmp_path / "run"), str(tmp_path / "exported"))
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert not any(info.values()), info
  ours_t, source = load_file(str(tmp_path / "exported" / "model.safetensors")), load_file(
      str(tmp_path / "src" / "model.safetensors"))
  assert ours_t.keys() == source.keys()
  for name in source:
    same = ours_t[name].tobytes() == source[name].tobytes()
    assert same == (not any(f"{t}_proj" in name for t in ("q", "k", "v", "o", "gate", "up", "down"))), name
  tokens = np.random.default_rng(2).integers(0, 128, (2, 16)).astype(np.int32)
  model = models.Model.from_config(run.config.model)  # (jitted: eagerly, op by op, it costs several times the CPU)
  ours = np.asarray(jax.jit(model.apply)(params, tokens, np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16)),
                                         np.ones((2, 16), np.int32)))
  theirs = test_hf._hf_logits(loaded.eval(), tokens)
  err = test_hf._rel_err(ours, theirs)
  print(f"LoRA export: max relative logit error {err:.2e}")
  assert err < test_hf.TOL

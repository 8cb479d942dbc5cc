"""The optimizer and schedule registries: every registered optimizer trains from the command line, its state is
laid out like the params (factored moments too), and tools/estimate.py predicts its bytes to the byte and the
update's FLOPs as XLA counts them."""

import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import metrics, models, optim
from jaxtrain.train import step as step_lib
from jaxtrain.train import trainer
from jaxtrain.train.state import TrainState
from jaxtrain.config import ConfigError, base_config
from tests import forked
from tests.conftest import small_config
from tests.test_distributed import _estimate_module  # one loader: tools/estimate.py defines absl flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
NEW = ["lion", "adafactor", "muon"]


def _cli(*args):
  return forked.run(["-m", "jaxtrain.main", "--config=configs/tiny.py", *args])


def _wsd(step, lr=1.0, warmup=5, horizon=20, fraction=0.2, end=0.1):
  """The documented warmup-stable-decay lr: linear warmup, lr, then a linear decay to lr * end over the last
  round(fraction * horizon) steps, lr * end after the horizon."""
  decay_start = horizon - round(fraction * horizon)
  if step < warmup:
    return lr * step / warmup
  if step < decay_start:
    return lr
  return lr - (lr - lr * end) * min(step - decay_start, horizon - decay_start) / (horizon - decay_start)


@pytest.mark.slow
@pytest.mark.parametrize("name,lr", [("lion", 1e-3), ("adafactor", 3e-3), ("muon", 3e-3)])
def test_optimizer_trains_from_the_command_line_with_wsd(name, lr, tmp_path):
  """20 steps of configs/tiny.py (8 x 64 tokens a step) on the bundled corpus with --config.optim.name=NAME and the
  wsd schedule: the loss goes down, and the logged lr is the wsd formula's at every step (warmup 5, stable, decay
  over 16..20)."""
  result = _cli(f"--config.optim.name={name}", f"--config.optim.lr={lr}", "--config.optim.schedule=wsd",
                "--config.optim.warmup_steps=5", "--config.train.steps=20", "--config.train.log_every=1",
                "--config.data.seq_len=64", "--config.train.global_batch_size=8", f"--config.workdir={tmp_path}")
  assert result.returncode == 0, result.stderr[-3000:]
  records = metrics.read_records(tmp_path)
  assert [r["step"] for r in records] == list(range(1, 21))
  losses = [r["loss"] for r in records]
  assert all(math.isfinite(x) for x in losses) and not any(r["skipped"] for r in records), losses
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.0, losses  # from ~5.5 (ln 256): a clear drop
  # The record of step s is the update with the lr of step s - 1.
  np.testing.assert_allclose([r["lr"] for r in records], [_wsd(s - 1, lr=lr) for s in range(1, 21)], rtol=1e-5)
  assert records[-1]["lr"] < lr and records[12]["lr"] == pytest.approx(lr)  # it decays, after a stable phase


def test_wsd_schedule_values():
  """Warmup 10, horizon 100, decay over the last 20 steps from lr=1 to 0.1."""
  c = base_config().optim
  c.update(lr=1.0, schedule="wsd", warmup_steps=10, end_lr_ratio=0.1, wsd_decay_fraction=0.2)
  lr = optim.schedule(c, train_steps=100)
  expected = {0: 0.0, 5: 0.5, 10: 1.0, 50: 1.0, 79: 1.0, 80: 1.0, 85: 0.775, 90: 0.55, 95: 0.325, 100: 0.1,
              150: 0.1}
  for step, want in expected.items():
    assert float(lr(step)) == pytest.approx(want, abs=1e-6), step
    assert _wsd(step, warmup=10, horizon=100) == pytest.approx(want), step  # the formula the CLI test uses
  c.decay_steps = 50  # the horizon: decay over 40..50
  lr = optim.schedule(c, train_steps=100)
  assert [round(float(lr(s)), 6) for s in (39, 40, 45, 50, 60)] == [1.0, 1.0, 0.55, 0.1, 0.1]


def test_unknown_optimizer_is_a_one_line_config_error(tmp_path):
  c = base_config()
  c.optim.name = "adamz"
  with pytest.raises(ConfigError) as e:
    optim.validate(c)
  message = str(e.value)
  assert e.value.subject == "optim.name" and "\n" not in message
  assert "'adamz' is not a registered optimizer" in message and "adafactor, adamw, lion, muon" in message
  c.optim.update(name="adamw", schedule="cosinus")
  with pytest.raises(ConfigError, match="optim.schedule: 'cosinus' is not a registered schedule; .*wsd"):
    optim.validate(c)
  result = _cli("--config.optim.name=adamz", f"--config.workdir={tmp_path}/run")
  errors = [line for line in result.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
  assert "optim.name: 'adamz' is not a registered optimizer; use one of adafactor, adamw, lion, muon" in errors[0]
  assert not (tmp_path / "run").exists()


def test_registering_an_optimizer_is_one_call(monkeypatch):
  monkeypatch.setitem(optim.OPTIMIZERS._entries, "sgd", None)  # removed again after the test
  optim.OPTIMIZERS.register("sgd", lambda cfg, learning_rate: optax.sgd(learning_rate))
  c = base_config()
  c.optim.update(name="sgd", lr=0.5, warmup_steps=0, schedule="constant", clip_norm=0.0)
  optim.validate(c)
  tx = optim.make(c.optim, 10)
  params = {"w": np.ones(3, np.float32)}
  updates, _ = tx.update({"w": np.full(3, 2.0, np.float32)}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -1.0)



def test_the_logged_lr_is_the_one_the_update_applied_after_steps_that_applied_none(monkeypatch):
  """Steps that apply no update (a known bad batch replayed: ``skip``; a float16 overflow the dynamic scale skips)
  leave optax's own count behind the loop's step. Under SGD (the change of a param is -lr x its gradient) with a
  warmup, each applied step logs the lr its param change shows, and a step not applied logs the rate the next
  applied one uses. (Logged at the loop's step instead, the last step said 0.75 where 0.375 was applied.)"""
  monkeypatch.setitem(optim.OPTIMIZERS._entries, "sgd", None)  # removed again after the test
  optim.OPTIMIZERS.register("sgd", lambda cfg, learning_rate: optax.sgd(learning_rate))
  c = small_config("unused")
  c.optim.update(name="sgd", lr=1.0, warmup_steps=8, schedule="constant", clip_norm=0.0, loss_scale="dynamic",
                 loss_scale_init=4.0)
  model = models.Model.from_config(c.model)
  tx, schedule = optim.make(c.optim, 20), optim.schedule(c.optim, 20)
  params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), model.abstract_params)
  state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params))
  update = jax.jit(functools.partial(step_lib.apply_update, model, tx, schedule, scaler=tx))
  ones = jax.tree.map(jnp.ones_like, params)
  overflow = jax.tree.map(lambda g: g * jnp.inf, ones)  # (already unscaled: what an overflow at the scale gives)
  plan = [(ones, False), (ones, False), (ones, True), (overflow, False), (ones, False), (ones, True), (ones, False)]
  logged, applied = [], []
  for grads, skip in plan:
    before = np.asarray(jax.tree.leaves(state.params)[0]).ravel()[0]
    state, metrics = update(state, grads, jnp.float32(1.0), jnp.float32(1.0), jnp.bool_(skip))
    after = np.asarray(jax.tree.leaves(state.params)[0]).ravel()[0]
    assert metrics["nonfinite"] == 0 and bool(metrics["skipped"]) == (skip or grads is overflow)
    logged.append(float(metrics["lr"]))
    applied.append(None if metrics["skipped"] else float(before - after))
  assert int(state.step) == 7 and int(step_lib.schedule_count(state.opt_state)) == 4
  for i, lr in enumerate(logged):
    used = applied[i] if applied[i] is not None else next(a for a in applied[i:] if a is not None)
    assert lr == pytest.approx(used, rel=1e-6, abs=1e-9), (i, logged, applied)
  assert applied[-1] == pytest.approx(0.375) and logged[-1] == pytest.approx(0.375)  # the 4th update: count 3 of 8
  # Every built-in optimizer has the count, under a loss scale, with and without LoRA's multi_transform.
  for name in sorted(optim.OPTIMIZERS._entries):
    if name != "sgd":
      c.optim.update(name=name)  # (loss-scaled, as above)
      for trainable in (None, lambda p: jax.tree.map(lambda _: True, p)):
        counts = step_lib.schedule_count(optim.make(c.optim, 20, trainable).init(params))
        assert counts is not None and int(counts) == 0, name


def test_muon_matrices():
  """Muon takes the stacked layers' kernels (one matrix per layer, split where fan-in and fan-out are closest);
  AdamW the rest."""
  def dims(path, shape):
    keys = tuple(jax.tree_util.DictKey(k) for k in path)
    d = optim.muon_dimension_numbers(keys, shape)
    return d and (tuple(d.reduction_axis), tuple(d.output_axis))

  assert dims(("layers", "attn", "q", "kernel"), (2, 128, 8, 16)) == ((1,), (2, 3))
  assert dims(("layers", "attn", "k", "kernel"), (2, 128, 2, 32)) == ((1,), (2, 3))
  assert dims(("layers", "attn", "o", "kernel"), (2, 8, 16, 128)) == ((1, 2), (3,))
  assert dims(("layers", "mlp", "down", "kernel"), (2, 384, 128)) == ((1,), (2,))
  assert dims(("layers", "attn_norm", "scale"), (2, 128)) is None
  assert dims(("dense_layers", "mlp", "down", "kernel"), (1, 384, 128)) == ((1,), (2,))  # (the MoE families')
  assert dims(("dense_layers", "mlp_norm", "scale"), (1, 128)) is None
  assert dims(("embed", "embedding"), (256, 128)) is None
  assert dims(("lm_head", "kernel"), (128, 256)) is None

  # With the model's logical axes: an expert kernel is one matrix per layer and expert.
  expert = P("layers", "experts", "embed", "expert_mlp")
  assert optim.muon_dimension_numbers(tuple(jax.tree_util.DictKey(k) for k in ("layers", "moe", "up")),
                                      (2, 8, 128, 192), tuple(expert)) == ((2,), (3,))


def _muon_config(lr=0.02):
  c = base_config()
  c.optim.update(name="muon", lr=lr, warmup_steps=0, schedule="constant", clip_norm=0.0, weight_decay=0.0)
  return c.optim


def test_muon_orthogonalizes_each_layer_and_expert_as_optax_muon_does_a_plain_matrix():
  """Three steps of jaxtrain's Muon on a stacked expert kernel ``[layers, experts, in, out]`` and an attention
  kernel ``[layers, embed, heads, head_dim]`` equal ``optax.contrib.muon`` run on each layer's (and expert's)
  plain 2D matrix alone (the heads flattened), within 1e-6: the layer and expert axes are batch axes, never part
  of the orthogonalized matrix."""
  rng = np.random.default_rng(0)
  shapes = {"up": (2, 3, 8, 6), "q": (2, 8, 2, 4)}
  specs = {"layers": {"moe": {"up": P("layers", "experts", "embed", "expert_mlp")},
                      "attn": {"q": {"kernel": P("layers", "embed", "heads", "head_dim")}}}}
  params = {"layers": {"moe": {"up": rng.normal(size=shapes["up"]).astype(np.float32)},
                       "attn": {"q": {"kernel": rng.normal(size=shapes["q"]).astype(np.float32)}}}}
  grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params) for _ in range(3)]
  cfg = _muon_config()
  tx = optim.make(cfg, 10, None, specs)
  state, got = tx.init(params), params
  for g in grads:
    updates, state = tx.update(g, state, got)
    got = optax.apply_updates(got, updates)

  def plain(matrix, gs):  # optax's Muon on one 2D matrix, its default reduction/output axes
    ref = optax.contrib.muon(cfg.lr, eps=cfg.eps, consistent_rms=0.2)
    ref_state, m = ref.init(matrix), matrix
    for g in gs:
      u, ref_state = ref.update(g, ref_state, m)
      m = optax.apply_updates(m, u)
    return np.asarray(m)

  for layer in range(2):
    for e in range(3):
      want = plain(params["layers"]["moe"]["up"][layer, e], [g["layers"]["moe"]["up"][layer, e] for g in grads])
      np.testing.assert_allclose(got["layers"]["moe"]["up"][layer, e], want, atol=1e-6)
    q = lambda t: t["layers"]["attn"]["q"]["kernel"][layer].reshape(8, 8)  # noqa: E731 - embed x (heads*head_dim)
    np.testing.assert_allclose(q(got), plain(q(params), [q(g) for g in grads]), atol=1e-6)


def test_muon_on_a_model_without_layer_matrices_is_one_config_error():
  params = {"embed": {"embedding": np.zeros((16, 8), np.float32)}, "layers": {"norm": {"scale": np.zeros((2, 8))}}}
  specs = {"embed": {"embedding": P("vocab", "embed")}, "layers": {"norm": {"scale": P("layers", "embed")}}}
  with pytest.raises(ConfigError, match="optim.name: muon orthogonalizes the weight matrices of the stacked layers, "
                                        "and model 'mine' has none .* use optim.name=adamw"):
    optim.check_muon(params, specs, "mine")


@pytest.mark.parametrize("config,name", [("configs/tiny_family.py:deepseek_v3", "muon"), ("configs/tiny.py", "adamw")])
def test_estimate_counts_the_optimizer_update_as_the_compiler_does(config, name, tmp_path):
  """tools/estimate.py's optimizer FLOPs on one device equal XLA's count of the jitted update (the run's own
  optimizer: clipping, Muon's Newton-Schulz per layer and expert, the AdamW part, the routers' balance update)
  within 1%; its optimizer bytes are the state Muon keeps, to the byte: one float32 momentum per Muon param, two
  moments per AdamW param, no state for the balanced choice biases, plus the scalar counters."""
  estimate = _estimate_module()
  c = estimate.load_config(config, [f"optim.name={name}", f"workdir={tmp_path}"])
  predicted = estimate.estimate(c, 1)
  model = models.Model.from_config(c.model)
  args = (model.trainable_mask(), model.logical_specs, model.balance())
  tx = optim.make(c.optim, c.train.steps, *args)
  params = model.abstract_params
  cost = jax.jit(tx.update).lower(params, jax.eval_shape(tx.init, params), params).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  assert predicted["optimizer_flops_per_step_per_device"] == pytest.approx(cost["flops"], rel=0.01)

  dims = optim._muon_dimensions(params, model.logical_specs) if name == "muon" else jax.tree.map(lambda _: None,
                                                                                                 params)
  balanced = args[2][0](params) if args[2] else jax.tree.map(lambda _: False, params)
  leaves = zip(jax.tree.leaves(params), jax.tree.leaves(dims, is_leaf=lambda d: d is None or isinstance(
      d, optax.contrib.MuonDimensionNumbers)), jax.tree.leaves(balanced), strict=True)
  moments = sum((0 if b else 1 if d is not None else 2) * math.prod(p.shape) for p, d, b in leaves)
  scalars = predicted["bytes_per_device"]["optimizer"] - 4 * moments
  assert 0 < scalars <= 64, scalars  # step counters (and Muon's three Newton-Schulz coefficients)
  if name == "muon":
    assert any(balanced_leaf for balanced_leaf in jax.tree.leaves(balanced))  # the balance update is counted


@pytest.mark.slow
def test_muon_trains_an_expert_parallel_moe_as_one_device(tmp_path):
  """Muon's per-expert Newton-Schulz iterations on experts split over the expert axis, the fsdp and tensor axes
  splitting each matrix: the same losses as one device within 1e-5 (4 steps)."""
  from tests.test_moe import training_config  # (the MoE tests' tiny model and run)
  runs = {}
  for name, mesh in (("one", {}), ("sharded", dict(fsdp=2, expert=2, tensor=2))):
    c = training_config(tmp_path / name, steps=4, **mesh)
    c.optim.name = "muon"
    c.checkpoint.verify = False  # (nothing restores its checkpoint: no fingerprint program compiled)
    runs[name] = trainer.train(c, devices=jax.devices()[:1] if not mesh else None)[1]
  losses = {k: [h["loss"] for h in h_] for k, h_ in runs.items()}
  np.testing.assert_allclose(losses["sharded"], losses["one"], rtol=1e-5)
  assert losses["one"][-1] < losses["one"][0]


def test_muon_takes_expert_kernels_experts_first_the_same_values_with_far_fewer_temporaries(tmp_path, monkeypatch):
  """optax's Muon flattens an expert kernel's batch axes ``[layers, experts]`` into one before its Newton-Schulz
  iterations; with the experts split over ``expert`` and the layers not, XLA replicates that flattened axis
  (jaxtrain.optim._experts_major). The update jaxtrain compiles, experts first, for a MoE on expert 4 x fsdp 2 needs
  at most 0.6x the temporaries of optax's order (measured: 9 MiB against 26), and on one device it
  computes optax's update and momentum bitwise (the state kept in the params' layout)."""
  c = base_config(model="moe")
  c.model.update(num_layers=2, d_model=128, num_heads=2, num_kv_heads=2, head_dim=64, num_experts=16,
                 expert_mlp_dim=256, vocab_size=256)
  c.optim.name = "muon"
  c.workdir = str(tmp_path)
  c.data.update(source="synthetic", seq_len=32)
  c.train.global_batch_size = 8

  def run_of(**mesh):
    cfg = c.copy_and_resolve_references()
    cfg.mesh.update(**mesh)
    return trainer.build(cfg, jax.devices()[:int(np.prod(list(mesh.values()) or [1]))])

  temporaries, outs, params = {}, {}, None
  for experts_first in (True, False):
    with monkeypatch.context() as patch:
      if not experts_first:  # optax's own order: no param moved (the moved axis names and the wrapper alike)
        patch.setattr(optim, "_experts_first", lambda logical: None)
      run = run_of(expert=4, fsdp=2)
      shardings = run.state_shardings
      update = jax.jit(run.tx.update, in_shardings=(shardings.params, shardings.opt_state, shardings.params),
                       out_shardings=(shardings.params, shardings.opt_state))
      abstract = run.abstract_state(sharded=False)
      compiled = update.lower(abstract.params, abstract.opt_state, abstract.params).compile()
      temporaries[experts_first] = compiled.memory_analysis().temp_size_in_bytes
      tx = run_of().tx
      if params is None:
        params = jax.jit(run.model.init)(jax.random.key(0))
        grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)
      state = tx.init(params)
      _, state = jax.jit(tx.update)(grads, state, params)
      outs[experts_first] = jax.device_get(jax.jit(tx.update)(grads, state, params))  # (two steps' momentum)
  print(f"muon update temporaries, expert 4 x fsdp 2: experts first {temporaries[True] / 2**20:.0f} MiB, optax's "
        f"order {temporaries[False] / 2**20:.0f} MiB")
  assert temporaries[True] <= 0.6 * temporaries[False]
  moments = [m for m in jax.tree.leaves(outs[True][1], is_leaf=lambda x: isinstance(x, optax.contrib.MuonState))
             if isinstance(m, optax.contrib.MuonState)]
  assert moments and moments[0].mu["layers"]["moe"]["up"].shape[:2] == (2, 16)  # the params' layout: [layers, experts]
  jax.tree.map(np.testing.assert_array_equal, outs[True], outs[False])


def _factored_dims(shape):
  """Adafactor's rule: with two dims >= 128, v_row is the moment with the largest dim averaged out, v_col with
  the second largest (argsort order)."""
  order = np.argsort(shape)
  return None if len(shape) < 2 or shape[order[-2]] < 128 else (int(order[-2]), int(order[-1]))


def _expected_spec(state_path, leaf, param, param_spec):
  """The layout an optimizer-state leaf of ``param`` must have: the param's if it has its shape; for Adafactor's
  factored moments, the param's with the averaged-out dim dropped; replicated otherwise."""
  if leaf.shape == param.shape:
    return param_spec
  field = next(k.name for k in reversed(state_path) if isinstance(k, jax.tree_util.GetAttrKey))
  factored = _factored_dims(param.shape)
  entries = tuple(param_spec) + (None,) * (param.ndim - len(param_spec))
  if factored and field in ("v_row", "v_col"):
    drop = factored[1] if field == "v_row" else factored[0]
    assert leaf.shape == tuple(np.delete(param.shape, drop))
    return P(*(e for i, e in enumerate(entries) if i != drop))
  return P()


@pytest.mark.parametrize("name", ["adamw"] + NEW)
def test_opt_state_is_sharded_like_the_params(name, tmp_path):
  """On a data=2 x fsdp=2 x tensor=2 mesh, every optimizer-state leaf of a param is laid out like it (Adafactor's
  factored moments: less the factored dim), and holds on each device exactly that layout's shard."""
  from jaxtrain.train import trainer
  config = small_config(tmp_path, data=2, fsdp=2, tensor=2)
  config.model.update(d_model=128, mlp_dim=256)  # dims >= 128: Adafactor factors the embeddings and the MLP
  config.optim.name = name
  run = trainer.build(config)
  state = trainer.init_state(run)
  mesh = dict(run.mesh.shape)
  params = {jax.tree_util.keystr(p): (a, a.sharding.spec)
            for p, a in jax.tree_util.tree_leaves_with_path(state.params)}
  seen = {"param-shaped": set(), "factored": set()}
  device_bytes = expected_bytes = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):
    key = jax.tree_util.keystr(path)
    owner = next((p for p in params if key.endswith(p)), None)
    param, spec = params[owner] if owner else (None, P())
    want = _expected_spec(path, leaf, param, spec) if owner else P()
    assert leaf.sharding.is_equivalent_to(NamedSharding(run.mesh, want), leaf.ndim), (key, leaf.sharding, want)
    split = math.prod(mesh[a] for e in want if e for a in ((e,) if isinstance(e, str) else e))
    assert leaf.addressable_shards[0].data.nbytes * split == leaf.nbytes, key
    device_bytes += leaf.addressable_shards[0].data.nbytes
    expected_bytes += leaf.nbytes // split
    if owner and want != P():
      seen["param-shaped" if leaf.shape == param.shape else "factored"].add(owner)
  assert device_bytes == expected_bytes == trainer.report(run)["opt_bytes_per_device"]
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(state.opt_state))
  if name == "adafactor":  # every factored param: both vectors sharded; the rest: a param-shaped moment
    factored = {p for p, (a, _) in params.items() if _factored_dims(a.shape)}
    assert factored == seen["factored"] == {"['embed']['embedding']", "['lm_head']['kernel']",
                                            "['layers']['mlp']['down']['kernel']",
                                            "['layers']['mlp']['gate']['kernel']",
                                            "['layers']['mlp']['up']['kernel']"}
    assert seen["param-shaped"] == set(params) - factored
    assert device_bytes < total / 3, (device_bytes, total)
  else:  # every param's moments (Muon's or AdamW's part) are sharded like it
    assert seen["param-shaped"] == set(params) and not seen["factored"]
    assert device_bytes < total / 3.5, (device_bytes, total)


@pytest.mark.parametrize("name,mesh", [(n, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]) for n in NEW]
                         + [("adafactor", [])], ids=[f"{n}-2x2x2" for n in NEW] + ["adafactor-fsdp8"])
def test_estimate_matches_compiled_optimizer_bytes(name, mesh, tmp_path):
  """tools/estimate.py's optimizer bytes per device = the run's layout (trainer.report) = what the compiled step
  takes as the train state besides the params, to the byte."""
  from jaxtrain.data import batch as batch_lib
  from jaxtrain.train import trainer
  estimate = _estimate_module()
  config = estimate.load_config("configs/tiny.py", mesh + [f"optim.name={name}", f"workdir={tmp_path}"])
  predicted = estimate.estimate(config, 8)
  per_device = predicted["bytes_per_device"]
  run = trainer.build(config)
  report = trainer.report(run)
  assert per_device["optimizer"] == report["opt_bytes_per_device"] < report["opt_bytes_total"] / 3
  compiled = trainer.compile_step(run).memory_analysis()
  batch = len(batch_lib.KEYS) * predicted["local_batch_rows"] * config.data.seq_len * 4 + 1
  state = per_device["params"] + per_device["optimizer"] + 4
  assert (compiled.argument_size_in_bytes, compiled.alias_size_in_bytes) == (state + batch, state)

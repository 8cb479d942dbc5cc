"""Mixture-of-Experts: routing and expert computation against per-token references, the router losses against
their formulas, expert parallelism (all-to-all over ``mesh.expert``) against one device, checkpoints across
expert-parallel sizes, validation, FLOPs from active parameters and the configs' parameter counts."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtrain import data as data_lib
from jaxtrain import metrics, models, sharding
from jaxtrain import sampling as sampling_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain.config import ConfigError, base_config
from jaxtrain.data.synthetic import SyntheticSource
from jaxtrain.models import moe
from jaxtrain.parallel import experts
from jaxtrain.train import step as step_lib
from jaxtrain.train import trainer
from tests.conftest import resumable_copy


def moe_config(workdir, steps=5, **mesh):
  """Every feature at once: a dense first layer, sigmoid routing with normalized top-2 weights, a shared expert."""
  c = base_config(model="moe")
  c.workdir = str(workdir)
  c.model.update(num_layers=3, first_dense_layers=1, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                 mlp_dim=64, vocab_size=256, num_experts=8, experts_per_token=2, expert_mlp_dim=32,
                 num_shared_experts=1, router_scores="sigmoid", load_balance_weight=0.1, router_z_weight=0.01)
  c.data.update(seq_len=32, source="synthetic")
  c.train.update(steps=steps, global_batch_size=16, log_every=1, microbatches=2)
  c.optim.update(lr=3e-3, warmup_steps=1)
  c.mesh.update(data=1, fsdp=1, tensor=1, expert=1)
  c.mesh.update(**mesh)
  return c


# Routing and the expert computation --------------------------------------------------------------------------


def _swiglu(x, gate, up, down):
  h = x @ gate
  return ((h / (1 + np.exp(-h))) * (x @ up)) @ down


def _reference(x, ids, weights, valid, gate, up, down, capacity=None, groups=1):
  """Loop over tokens in order (rows split into ``groups`` devices' shares) and their k experts; with a capacity,
  an expert takes at most ``capacity`` choices per group, later ones dropped. Returns (output, dropped)."""
  x, ids, weights = (np.asarray(a, np.float64) for a in (x, ids, weights))
  gate, up, down = (np.asarray(a, np.float64) for a in (gate, up, down))
  out, dropped = np.zeros_like(x), 0
  rows_per_group = x.shape[0] // groups
  for g in range(groups):
    taken = np.zeros(gate.shape[0], int)
    for b in range(g * rows_per_group, (g + 1) * rows_per_group):
      for t in range(x.shape[1]):
        if not valid[b, t]:
          continue
        for e, w in zip(ids[b, t].astype(int), weights[b, t]):
          if capacity is not None and taken[e] >= capacity:
            dropped += 1
            continue
          taken[e] += 1
          out[b, t] += w * _swiglu(x[b, t], gate[e], up[e], down[e])
  return out, dropped


def _routing_problem(seed=0, b=8, t=12, d=16, f=8, e=8, k=2):
  keys = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(keys[0], (b, t, d))
  scores = jax.random.normal(keys[1], (b, t, e))
  scores = scores.at[..., 0].add(1.5)  # expert 0 popular: capacity matters
  weights, ids = jax.lax.top_k(jax.nn.softmax(scores), k)
  valid = jax.random.uniform(keys[2], (b, t)) > 0.15
  gate, up = (jax.random.normal(kk, (e, d, f)) * 0.3 for kk in keys[3:5])
  down = jax.random.normal(keys[5], (e, f, d)) * 0.3
  return x, ids, weights, valid, gate, up, down


@pytest.mark.slow
def test_dropless_and_capacity_equal_a_per_token_loop():
  x, ids, w, valid, gate, up, down = problem = _routing_problem()
  want, _ = _reference(*problem)
  got, dropped = experts.moe_ffn(*problem, mode="dropless")
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert int(dropped) == 0 and float(jnp.abs(got[~valid]).max()) == 0.0  # padding is not dispatched
  roomy, dropped = experts.moe_ffn(*problem, mode="capacity", capacity_factor=float(8))  # room for every choice
  np.testing.assert_allclose(roomy, got, rtol=1e-5, atol=1e-6)
  assert int(dropped) == 0
  slots = experts.capacity(8 * 12 * 2, 8, 0.5)  # 12 slots per expert: expert 0 overflows
  want, want_dropped = _reference(*problem, capacity=slots)
  tight, dropped = experts.moe_ffn(*problem, mode="capacity", capacity_factor=0.5)
  assert want_dropped > 12 and int(dropped) == want_dropped
  np.testing.assert_allclose(tight, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["dropless", "capacity"])
def test_expert_parallel_dispatch_equals_the_loop(mode):
  """Under an 8-device mesh (expert=4 x fsdp=2 x ... the batch over all 8, experts over 4): the all-to-all path
  gives each device's tokens what the loop gives them; capacity counts per device, as the loop over each device's
  rows does."""
  problem = _routing_problem(seed=1)
  mesh_cfg = base_config().mesh
  mesh_cfg.update(fsdp=2, expert=4)
  mesh = mesh_lib.make_mesh(mesh_cfg)
  factor = 0.75 if mode == "capacity" else 1.0
  slots = experts.capacity(12 * 2, 8, factor)  # one row (12 tokens x 2 choices) per device
  want, want_dropped = _reference(*problem, capacity=slots if mode == "capacity" else None, groups=8)
  rules = sharding.rules_from_config(base_config().sharding)
  with jax.set_mesh(mesh), sharding.axis_rules(rules):
    compiled = jax.jit(lambda *a: experts.moe_ffn(*a, mode=mode, capacity_factor=factor)).lower(*problem).compile()
    got, dropped = compiled(*problem)  # (the program whose text is read: compiled once)
    text = compiled.as_text()
  assert text.count("all-to-all(") >= 2  # dispatch and return (dropless: the expert ids travel too)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert int(dropped) == want_dropped and (want_dropped > 0) == (mode == "capacity")


@pytest.mark.parametrize("scores", ["softmax", "sigmoid"])
def test_routing_picks_the_top_k_scores(scores):
  c = moe_config("unused").model
  c.router_scores = scores
  with nnx.use_eager_sharding(False):
    layer = moe.MoE(c, jnp.float32, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (2, 5, c.d_model))
  logits, probs, ids, weights = layer.route(x)
  want_logits = np.einsum("btd,de->bte", np.asarray(x, np.float64), np.asarray(layer.router[...], np.float64))
  s = 1 / (1 + np.exp(-want_logits)) if scores == "sigmoid" else np.exp(want_logits) / np.exp(
      want_logits).sum(-1, keepdims=True)
  top = np.argsort(-s, axis=-1)[..., :2]
  top_s = np.take_along_axis(s, top, -1)
  np.testing.assert_array_equal(ids, top)
  np.testing.assert_allclose(weights, top_s / top_s.sum(-1, keepdims=True), rtol=1e-5)  # normalize_topk
  np.testing.assert_allclose(probs, s / s.sum(-1, keepdims=True), rtol=1e-5)


def test_router_losses_equal_their_formulas_on_a_hand_made_routing():
  """4 real tokens and 1 pad, E = 4, k = 2. Choices: tokens 0-2 pick (0, 1), token 3 picks (2, 1): f = (3, 4, 1,
  0) / 8; probabilities chosen by hand: P = column means over the real tokens."""
  probs = np.array([[0.4, 0.3, 0.2, 0.1], [0.5, 0.3, 0.1, 0.1], [0.6, 0.2, 0.1, 0.1], [0.1, 0.3, 0.5, 0.1],
                    [0.0, 0.0, 0.0, 1.0]], np.float32)[None]
  ids = np.array([[0, 1], [0, 1], [0, 1], [2, 1], [3, 3]], np.int32)[None]
  valid = np.array([[True, True, True, True, False]])
  logits = np.log(probs + 1e-3)
  aux, load = moe.router_losses(jnp.asarray(logits), jnp.asarray(probs), jnp.asarray(ids), jnp.asarray(valid))
  f = np.array([3, 4, 1, 0]) / 8
  p = probs[0, :4].mean(0)
  np.testing.assert_allclose(load, f, rtol=1e-6)
  assert float(aux["load_balance"]) == pytest.approx(4 * float(np.sum(f * p)), rel=1e-6)  # 4 x 0.3125 = 1.25
  lse = np.log(np.exp(logits[0, :4].astype(np.float64)).sum(-1))
  assert float(aux["router_z"]) == pytest.approx(float(np.mean(lse ** 2)), rel=1e-5)
  even = np.full((1, 8, 4), 0.25, np.float32)  # perfectly even routing and probabilities: 1.0
  even_ids = np.array([[0, 1], [2, 3]] * 4, np.int32)[None]
  balanced, _ = moe.router_losses(jnp.log(even), jnp.asarray(even), jnp.asarray(even_ids), jnp.ones((1, 8), bool))
  assert float(balanced["load_balance"]) == pytest.approx(1.0, rel=1e-6)


# Expert parallelism in training ------------------------------------------------------------------------------


def training_config(workdir, steps=6, **mesh):
  c = moe_config(workdir, steps=steps, **mesh)
  c.checkpoint.every_steps = 2
  c.optim.decay_steps = 6
  return c


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """The reference: the same run on one device (microbatches 2, as the pipelined runs use). Its checkpoints are
  not fingerprinted (no fingerprint program compiled; nothing restores them)."""
  config = training_config(tmp_path_factory.mktemp("one"))
  config.checkpoint.verify = False
  state, history = trainer.train(config, devices=jax.devices()[:1])
  return state, history


# fsdp 2 x expert 2: the checkpoint test's first run, against the same one-device losses. Context parallelism: each
# device routes and dispatches its own half of every row's tokens (in the load-balanced order), the all-to-all over
# expert and the psum over tensor as without it.
LAYOUTS = {"expert8": dict(expert=8), "expert2_context2_tensor2": dict(context=2, expert=2, tensor=2),
           "expert2_pipeline2": dict(fsdp=2, expert=2, pipeline=2)}  # (the 1F1B schedules: test_1f1b_schedules_...)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_training_equals_one_device(one_device, tmp_path, layout):
  """(expert = 2 x fsdp = 2 and expert = 4 are the checkpoint test's layouts.)"""
  _, want = one_device
  config = training_config(tmp_path, **LAYOUTS[layout])
  config.checkpoint.verify = False  # (no fingerprint program compiled: the checkpoint test verifies its own saves)
  state, got = trainer.train(config)
  np.testing.assert_allclose([h["loss"] for h in got], [h["loss"] for h in want], rtol=1e-5)
  for key in ("aux_loss/load_balance", "aux_loss/router_z", "moe/load_max", "moe/load/e03"):
    np.testing.assert_allclose([h[key] for h in got], [h[key] for h in want], rtol=1e-5, err_msg=key)
  assert got[-1]["loss"] < got[0]["loss"]
  gate = state.params["layers"]["moe"]["gate"]
  mesh = LAYOUTS[layout]
  assert gate.sharding.spec == P("pipeline", "expert", "fsdp", "tensor")  # [layers, experts, embed, expert_mlp]
  assert gate.addressable_shards[0].data.shape == (2 // mesh.get("pipeline", 1), 8 // mesh["expert"],
                                                   32 // mesh.get("fsdp", 1), 32 // mesh.get("tensor", 1))
  moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
             if "['layers']['moe']['gate']" in jax.tree_util.keystr(path)]
  assert len(moments) == 2  # Adam's mu and nu, sharded like the expert weights
  assert all(m.sharding.spec == gate.sharding.spec for m in moments)


@pytest.mark.slow
def test_1f1b_schedules_over_experts_equal_one_device(tmp_path):
  """1F1B and interleaved 1F1B over expert 2 x pipeline 2 (4 MoE layers after a dense one: 2 stages, x 2 virtual
  stages for interleaved): one train step from the same params and batch gives one device's loss, router losses,
  load, gradient norm and new params (the routers' losses reach the gradient through the schedules' own backward),
  the experts' weights and their moments sharded over both the stages and the experts. (GPipe over experts:
  test_expert_parallel_training_equals_one_device.) Both start from one device's initial state put on their
  shardings (no init compiled per layout: a sharded init over expert x pipeline holds one device's values in
  test_expert_parallel_training_equals_one_device[expert2_pipeline2])."""
  initial = []

  def step(devices, schedule="gpipe", **mesh):
    c = moe_config(tmp_path, **mesh)
    c.model.num_layers = 5
    c.pipeline.schedule = schedule
    run = trainer.build(c, jax.devices()[:devices])
    if not initial:
      initial.append(jax.device_get(trainer.init_state(run)))
    state = jax.device_put(initial[0], run.state_shardings)
    batch = next(SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size, seed=0))
    return trainer.compile_step(run)(state, data_lib.to_global(batch, run.batch_sharding), np.bool_(False))

  want_state, want = jax.device_get(step(1))
  for schedule in ("1f1b", "interleaved_1f1b"):
    state, got = step(4, schedule, expert=2, pipeline=2)
    for key in ("loss", "aux_loss/load_balance", "aux_loss/router_z", "moe/load_max", "grad_norm"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{schedule} {key}")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(state.params)),
                            jax.tree.leaves(want_state.params), strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{schedule}{jax.tree_util.keystr(path)}")
    gate = state.params["layers"]["moe"]["gate"]  # [layers, experts, embed, expert_mlp]
    assert gate.sharding.spec == P("pipeline", "expert", "fsdp", "tensor")
    assert gate.addressable_shards[0].data.shape == (2, 4, 32, 32)
    moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
               if "['layers']['moe']['gate']" in jax.tree_util.keystr(path)]
    assert len(moments) == 2 and all(m.sharding.spec == gate.sharding.spec for m in moments)


def _gradients(run, params, batch):
  """The gradient of the step's objective (mean cross-entropy + weighted router losses) under run's layout."""
  def objective(p):
    out = step_lib.forward_losses(run.model, p, batch, run.pipeline_schedule)
    aux = sum(w * out["aux"][n] / out["forwards"] for n, w in run.aux_weights.items())
    return out["loss_sum"] / out["tokens"] + aux
  with jax.set_mesh(run.mesh), sharding.axis_rules(run.rules):
    return jax.device_get(jax.jit(jax.grad(objective))(params))


@pytest.mark.slow
def test_gradients_of_router_and_every_expert_match_one_device(tmp_path):
  batch = {k: jnp.asarray(v) for k, v in next(SyntheticSource(32, 256, 16, 0, 0, 1)).items() if k != "doc_ids"}
  reference = trainer.build(moe_config(tmp_path, microbatches=1), devices=jax.devices()[:1])
  params = jax.device_get(trainer.init_state(reference).params)
  want = _gradients(reference, params, batch)
  assert set(want["layers"]["moe"]) == {"router", "gate", "up", "down", "shared"}
  for layout, mesh in (("expert8", LAYOUTS["expert8"]), ("expert2_fsdp2_tensor2", dict(expert=2, fsdp=2, tensor=2))):
    run = trainer.build(moe_config(tmp_path, **mesh))
    got = _gradients(run, jax.device_put(params, run.state_shardings.params), batch)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
      scale = float(np.abs(w).max())
      assert scale > 0, jax.tree_util.keystr(path)  # every expert gets gradient on this batch
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=f"{layout}{jax.tree_util.keystr(path)}")


@pytest.mark.slow
def test_checkpoint_resumes_exactly_and_onto_another_expert_parallel_size(one_device, tmp_path):
  """Expert = 2 x fsdp = 2 equals one device; from its step-2 checkpoint it resumes bitwise, and from its step-4
  checkpoint onto expert = 4 within 1e-5 (4 devices: the resume, not the device count, is the point)."""
  config, four = training_config, jax.devices()[:4]
  _, full = trainer.train(config(tmp_path / "full", 6, fsdp=2, expert=2), devices=four)  # saves at 2, 4 and 6
  np.testing.assert_allclose([h["loss"] for h in full], [h["loss"] for h in one_device[1]], rtol=1e-5)
  same = resumable_copy(tmp_path / "full", tmp_path / "same", 2)
  _, same = trainer.train(config(same, 6, fsdp=2, expert=2), devices=four)
  assert [h["step"] for h in same] == [3, 4, 5, 6]
  assert [h["loss"] for h in same] == [h["loss"] for h in full[2:]]  # bitwise
  other = resumable_copy(tmp_path / "full", tmp_path / "other", 4)
  state, other = trainer.train(config(other, 6, expert=4), devices=four)
  assert [h["step"] for h in other] == [5, 6]
  np.testing.assert_allclose([h["loss"] for h in other], [h["loss"] for h in full[4:]], rtol=1e-5)
  assert state.params["layers"]["moe"]["down"].addressable_shards[0].data.shape[1] == 2  # 8 experts over 4


@pytest.mark.slow
def test_cached_decoding_equals_the_training_forward():
  """Generation with the KV cache on an expert=2 x fsdp=2 mesh: every step's logits are those of the training
  forward of the row alone (one device, no mesh), through the dense first layer, the routed and the shared experts."""
  model = models.Model.from_config(moe_config("unused").model)
  mesh_cfg = base_config().mesh
  mesh_cfg.update(fsdp=2, expert=2)
  mesh, rules = mesh_lib.make_mesh(mesh_cfg, jax.devices()[:4]), sharding.rules_from_config(base_config().sharding)
  shardings = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  params = jax.device_put(model.init(jax.random.key(3)), shardings)
  prompts = [[5, 17, 33, 2, 90, 41, 7], [12, 99, 3], [64]]
  gen = sampling_lib.Generator(model, mesh, rules, shardings, rows=sampling_lib.padded_rows(3, mesh, rules),
                               prompt_len=7, max_new_tokens=6, return_logits=True)
  out, produced, logits, _ = jax.device_get(gen(params, gen.batch(prompts)))
  np.testing.assert_array_equal(produced[:3], [6, 6, 6])  # (a 4th row pads the batch to its 4 shards)
  queue = sampling_lib.ContinuousGenerator(model, mesh, rules, shardings, requests=3, slots=4, prompt_len=7,
                                           max_new_tokens=6, page_size=4)  # (4 slots: one per batch shard)
  assert queue.generate(params, prompts) == out[:3].tolist()  # continuous batching, a paged cache: the same tokens
  local = jax.device_get(params)
  forward = jax.jit(model.apply)  # (eagerly, op by op, the forwards below cost several times the CPU)
  for r, ids in enumerate(prompts):
    row = np.asarray([ids + out[r, :-1].tolist()], np.int32)
    alone = np.asarray(forward(local, row, np.arange(row.shape[1])[None], np.ones_like(row)))[0]
    np.testing.assert_allclose(logits[r][:6], alone[len(ids) - 1:], atol=1e-4 * np.abs(alone).max(), err_msg=r)


# Configuration, FLOPs, parameter counts ------------------------------------------------------------------------


@pytest.mark.parametrize("change,message", [
    (dict(mesh=dict(fsdp=2, expert=4), model=dict(num_experts=6)),
     "model.num_experts: 6 is not divisible by mesh.expert=4"),
    (dict(model=dict(experts_per_token=9)), "model.experts_per_token: 9 is more than model.num_experts=8"),
    (dict(model=dict(moe_impl="sparse")), "model.moe_impl: 'sparse' is not one of dropless, capacity"),
    (dict(model=dict(router_scores="relu")), "model.router_scores: 'relu' is not one of softmax, sigmoid"),
    (dict(model=dict(first_dense_layers=3)), "model.first_dense_layers: 3 leaves no MoE layer"),
    (dict(model=dict(capacity_factor=0.0)), "model.capacity_factor"),
])
def test_bad_moe_settings_are_one_clear_error(tmp_path, change, message):
  c = moe_config(tmp_path)
  c.mesh.update(fsdp=8)
  for group, values in change.items():
    c[group].update(values)
  with pytest.raises(ConfigError, match=message):
    trainer.build(c)


def test_flops_count_the_active_experts_only(tmp_path):
  run = trainer.build(moe_config(tmp_path, fsdp=8))
  params = run.model.abstract_params
  size = lambda tree: sum(a.size for a in jax.tree.leaves(tree))  # noqa: E731
  routed = sum(params["layers"]["moe"][n].size for n in ("gate", "up", "down"))
  assert routed == 2 * 3 * 8 * 32 * 32  # 2 MoE layers x 3 matrices x 8 experts x 32 x 32
  active = size(params) - size(params["embed"]) - routed + routed * 2 // 8
  assert metrics.flops_per_token(run.model, 32) == 6 * active + 12 * 3 * 4 * 8 * 32
  total, active_all = moe.param_counts(run.model.cfg, params)
  assert (total, active_all) == (size(params), size(params) - routed * 6 // 8)


@pytest.mark.parametrize("name,total,active", [("mixtral_8x7b", 46.7e9, 12.9e9), ("olmoe_1b_7b", 6.9e9, 1.3e9)])
def test_configs_have_the_published_parameter_counts(name, total, active):
  """Published counts are rounded to 0.1B: ours round to them, and are within 1.5% of them."""
  import importlib
  config = importlib.import_module(f"configs.{name}").get_config()
  model = models.Model.from_config(config.model)  # shapes only
  got_total, got_active = moe.param_counts(config.model, model.abstract_params)
  assert round(got_total / 1e8) == round(total / 1e8) and round(got_active / 1e8) == round(active / 1e8)
  assert math.isclose(got_total, total, rel_tol=0.015) and math.isclose(got_active, active, rel_tol=0.015)


@pytest.mark.parametrize("impl", ["dropless", "capacity"])
def test_save_dots_keeps_the_activations_the_estimate_counts(impl):
  """save_dots keeps matmul outputs without a batch dimension: the attention projections', the shared expert's and
  the router's, not the routed experts' (their matmuls carry the expert dimension). What it keeps beyond full remat,
  in the compiled program's temporaries, is what the family's activation estimate (tools/estimate.py) adds for it;
  counting the routed experts' outputs too (as the estimate once did) would be 2.4x that."""
  c = base_config(model="moe").model
  c.update(num_layers=8, first_dense_layers=0, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=256,
           num_experts=8, experts_per_token=2, expert_mlp_dim=256, num_shared_experts=1, moe_impl=impl,
           attention="xla")
  b, t = 2, 64
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (b, t)), jnp.int32)
  inputs = (tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), jnp.ones((b, t), jnp.int32))
  temp, estimated = {}, {}
  for remat in ("full", "save_dots"):
    c.remat = remat
    model = models.Model.from_config(c)
    params = jax.eval_shape(model.init, jax.random.key(0))
    loss = lambda p, model=model: jnp.mean(model.forward(p, *inputs).logits ** 2)  # noqa: E731
    temp[remat] = jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes
    estimated[remat] = moe.activation_estimate(c, b, t, tensor=1)["activation_bytes"]
  kept = 8 * b * t * (64 + 2 * 32 + 64 + 2 * 256 + 8) * 4  # q, k, v, out, shared gate and up, router: float32
  assert estimated["save_dots"] - estimated["full"] == kept
  # Measured: 2,916,472 bytes (jax 0.10.2, both routings; 0.12.0.1 capacity); 0.12.0.1's dropless keeps one more
  # [b, t, d] float32 a layer (+9%).
  assert temp["save_dots"] - temp["full"] == pytest.approx(kept, rel=0.1), (temp, kept)
  print(f"save_dots - full ({impl}): compiled {temp['save_dots'] - temp['full']} bytes, estimated {kept}")

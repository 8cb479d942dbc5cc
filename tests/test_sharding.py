"""Every parameter and optimizer moment lands on the mesh the way the rules declare."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxtrain import mesh as mesh_lib
from jaxtrain.config import ConfigError
from jaxtrain.train import trainer

# What the fsdp_tp preset declares for each parameter, written out by hand (independent of the resolver).
FSDP_TP = {
    "embed/embedding": ("tensor", "fsdp"),
    "final_norm/scale": ("fsdp",),
    "lm_head/kernel": ("fsdp", "tensor"),
    "layers/attn_norm/scale": ("pipeline", "fsdp"),  # the layer stack in contiguous blocks per pipeline stage
    "layers/mlp_norm/scale": ("pipeline", "fsdp"),
    "layers/attn/q/kernel": ("pipeline", "fsdp", "tensor", None),
    "layers/attn/k/kernel": ("pipeline", "fsdp", "tensor", None),
    "layers/attn/v/kernel": ("pipeline", "fsdp", "tensor", None),
    "layers/attn/o/kernel": ("pipeline", "tensor", None, "fsdp"),
    "layers/mlp/gate/kernel": ("pipeline", "fsdp", "tensor"),
    "layers/mlp/up/kernel": ("pipeline", "fsdp", "tensor"),
    "layers/mlp/down/kernel": ("pipeline", "tensor", "fsdp"),
}


def _name(path):
  return "/".join(str(getattr(k, "key", k)) for k in path)


def _norm(spec):
  spec = tuple(spec)
  while spec and spec[-1] is None:
    spec = spec[:-1]
  return spec


def _adam_moments(opt_state):
  return [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)]


@pytest.mark.parametrize("data,fsdp,tensor,pipeline", [(8, 1, 1, 1), (1, 8, 1, 1), (2, 2, 2, 1), (1, 1, 8, 1),
                                                       (1, 2, 2, 2)])
def test_params_and_moments_sharded_as_declared(make_config, data, fsdp, tensor, pipeline):
  config = make_config(data=data, fsdp=fsdp, tensor=tensor, pipeline=pipeline)
  config.model.num_kv_heads = 8  # the tensor-only mesh needs kv_heads divisible by 8
  run = trainer.build(config)
  state = trainer.init_state(run)
  mesh_sizes = dict(run.mesh.shape)
  leaves = jax.tree_util.tree_leaves_with_path(state.params)
  assert {_name(p) for p, _ in leaves} == set(FSDP_TP)
  for path, arr in leaves:
    expected = FSDP_TP[_name(path)]
    assert _norm(arr.sharding.spec) == _norm(expected), _name(path)
    # The bytes each device holds follow from the declared axes.
    shard = tuple(d // (mesh_sizes[a] if a else 1) for d, a in zip(arr.shape, expected + (None,) * 4))
    assert arr.addressable_shards[0].data.shape == shard, _name(path)
  moments = _adam_moments(state.opt_state)
  assert moments, "AdamW state not found"
  for m in moments:
    for tree in (m.mu, m.nu):
      jax.tree.map(lambda p, s: np.testing.assert_equal(s.sharding.spec, p.sharding.spec), state.params, tree)
      jax.tree.map(lambda p, s: np.testing.assert_equal(s.sharding.is_equivalent_to(p.sharding, p.ndim), True),
                   state.params, tree)


def test_fsdp_shards_everything_one_eighth(make_config):
  config = make_config(fsdp=8)
  config.sharding.report_replicated_mib = 0  # report every replicated parameter, however small
  info = trainer.report(trainer.build(config))
  assert info["params"] == 131_392 and info["param_bytes_total"] == 4 * 131_392
  assert info["param_bytes_per_device"] == info["param_bytes_total"] / 8
  # AdamW: two fp32 moments per parameter, sharded like it, plus two replicated int32 step counts
  assert info["opt_bytes_total"] == 2 * info["param_bytes_total"] + 8
  assert info["opt_bytes_per_device"] == 2 * info["param_bytes_per_device"] + 8
  assert info["replicated"] == []


def test_dp_preset_replicates_params_and_splits_batch(make_config):
  config = make_config(data=8)
  config.sharding.preset = "dp"
  config.sharding.report_replicated_mib = 0.01
  run = trainer.build(config)
  state = trainer.init_state(run)
  assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(state.params))
  assert run.batch_sharding.spec == P(("data", "fsdp", "expert"), "context")
  replicated = dict(trainer.report(run)["replicated"])
  assert "['embed']['embedding']" in replicated and "['final_norm']['scale']" not in replicated


def test_rules_override_from_config(make_config):
  config = make_config(fsdp=4, tensor=2)
  config.sharding.rules = "mlp=fsdp+tensor,embed="
  run = trainer.build(config)
  state = trainer.init_state(run)
  assert _norm(state.params["layers"]["mlp"]["up"]["kernel"].sharding.spec) == ("pipeline", None, ("fsdp", "tensor"))
  assert _norm(state.params["lm_head"]["kernel"].sharding.spec) == (None, "tensor")


def test_mesh_fill_and_hybrid_shape(make_config):
  config = make_config(data=2, fsdp=-1, tensor=2)
  mesh = mesh_lib.make_mesh(config.mesh)
  assert dict(mesh.shape) == {"data": 2, "pipeline": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ConfigError, match="mesh.fsdp"):
    mesh_lib.make_mesh(make_config(data=-1, fsdp=-1).mesh)


def test_bad_rule_text(make_config):
  config = make_config(fsdp=8)
  config.sharding.rules = "mlp=tensr"
  with pytest.raises(ConfigError, match="'tensr' .* is not a mesh axis"):
    trainer.build(config)


class FakeDevice:
  """Stands in for a GPU device of a 2-process job (mesh_utils reads only these attributes)."""

  platform, device_kind = "gpu", "fake"

  def __init__(self, id, process_index):
    self.id, self.process_index = id, process_index

  def __repr__(self):
    return f"D{self.id}@p{self.process_index}"


def test_hybrid_mesh_puts_dcn_axis_across_processes(make_config):
  devices = [FakeDevice(i, i // 4) for i in range(8)]  # 2 processes x 4 local devices
  config = make_config(data=1, fsdp=2, tensor=2)
  config.mesh.dcn_data = 2
  grid = mesh_lib.device_grid(config.mesh, devices)
  assert grid.shape == (2, 1, 2, 1, 1, 2)  # data (DCN) x pipeline x fsdp x expert x context x tensor (ICI)
  for data_index in range(2):
    assert {d.process_index for d in grid[data_index].flat} == {data_index}
  config.mesh.dcn_data = 4
  with pytest.raises(ConfigError, match="DCN mesh .* = 4 slices \\(or processes\\), but there are 2"):
    mesh_lib.device_grid(config.mesh, devices)


@pytest.mark.parametrize("preset,sizes", [("fsdp", dict(fsdp=8)), ("fsdp_tp", dict(data=2, fsdp=2, tensor=2)),
                                          ("fsdp_tp", dict(fsdp=8)), ("fsdp", dict(data=2, fsdp=2, expert=2)),
                                          ("dp", dict(data=4, fsdp=2))])
def test_embedding_lookup_and_its_gradient_equal_a_plain_take_under_every_layout(preset, sizes):
  """llama.lookup looks rows up where an FSDP-split table is (ids all-gathered, one all-to-all back; vocab-parallel
  under tensor; what every platform compiles), or from the gathered table (the dp preset's, and the other path
  asked for): the rows
  and the float32 table gradient equal ``table[tokens]``'s. A vocabulary named on a tensor axis of 1 is not split:
  no masking and no sum over that axis in the program."""
  import types

  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding

  from jaxtrain import sharding
  from jaxtrain.models import llama

  shape = [sizes.get(a, 1) for a in mesh_lib.MESH_AXES]
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), mesh_lib.MESH_AXES,
              axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
  rules = sharding.PRESETS[preset]
  table = jax.random.normal(jax.random.key(0), (64, 16), jnp.float32)
  tokens = jax.random.randint(jax.random.key(1), (8, 6), 0, 64).at[0, :3].set(7)  # a token seen several times
  weights = jax.random.normal(jax.random.key(2), (8, 6, 16), jnp.float32)

  def objective(table, tokens, dtype, where_the_table_is):
    rows = llama.lookup(types.SimpleNamespace(embedding=table, dtype=dtype), tokens, where_the_table_is)
    return jnp.sum(rows.astype(jnp.float32) * weights), rows

  reference_rows = table[tokens]
  layout = lambda *names: NamedSharding(mesh, sharding.logical_to_mesh_spec(P(*names), rules))  # noqa: E731
  for dtype, where_the_table_is in ((jnp.float32, True), (jnp.bfloat16, True), (jnp.bfloat16, False)):
    with jax.set_mesh(mesh), sharding.axis_rules(rules):
      (_, rows), grad = jax.jit(jax.value_and_grad(objective, has_aux=True), static_argnums=(2, 3))(
          jax.device_put(table, layout("vocab", "embed")), jax.device_put(tokens, layout("batch", "length")), dtype,
          where_the_table_is)
    assert rows.dtype == dtype and grad.dtype == jnp.float32
    if where_the_table_is:
      with jax.set_mesh(mesh), sharding.axis_rules(rules):
        program = str(jax.make_jaxpr(objective, static_argnums=(2, 3))(
            jax.device_put(table, layout("vocab", "embed")), tokens, dtype, where_the_table_is))
      assert ("psum" in program) == (preset == "fsdp_tp" and sizes.get("tensor", 1) > 1), program
    np.testing.assert_array_equal(rows, reference_rows.astype(dtype))
    # The rows' gradient arrives in their dtype; the table's is summed in float32 (token 7's four rows included).
    expected = jnp.zeros_like(table).at[tokens].add(weights.astype(dtype).astype(jnp.float32))
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-6)

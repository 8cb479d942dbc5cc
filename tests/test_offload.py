"""The optimizer state in host memory (``optim.offload_state``): the same losses to the bit, the moments in pinned host
memory and out of the device's arguments (the dry run's account), checkpoints resumed both ways, refusals."""

import types

import jax
import numpy as np
import pytest

from jaxtrain import mesh as mesh_lib
from jaxtrain import models, optim, sharding
from jaxtrain.errors import ConfigError
from jaxtrain.train import offload as offload_lib
from jaxtrain.train import state as state_lib
from jaxtrain.train import trainer
from tests.conftest import resumable_copy, small_config


def _config(workdir, offload: bool, dry_run: bool = False):
  c = small_config(workdir, data=2, fsdp=4)
  c.train.steps, c.checkpoint.every_steps = 6, 3
  c.optim.offload_state, c.dry_run = offload, dry_run
  c.optim.clip_norm = 0.05  # below the gradients' norm: the steps are clipped (the streamed update's global norm)
  return c


@pytest.mark.slow
def test_offloaded_state_trains_bitwise_resumes_both_ways_and_leaves_the_device(tmp_path):
  """AdamW, fsdp 4 x data 2: the same losses, params and moments bitwise with the moments in host memory (the update
  streamed a layer at a time); a run resumes with offload from
  a checkpoint written without it and the other way round, bitwise; the dry run counts the moments on the host, and
  the device's arguments are a third of those without offload (params only, where AdamW adds two moments)."""
  plain_state, plain = trainer.train(_config(tmp_path / "plain", False))
  state, offloaded = trainer.train(_config(tmp_path / "offloaded", True))
  losses = [h["loss"] for h in plain]
  assert [h["loss"] for h in offloaded] == losses
  # (streamed a layer at a time: jaxtrain/train/offload.py) the params and the moments too, to the bit
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), (plain_state.params,
                      plain_state.opt_state), (state.params, state.opt_state))
  assert all(jax.tree.leaves(same))
  kinds = {(a.ndim > 0, a.sharding.memory_kind) for a in jax.tree.leaves(state.opt_state)}
  assert kinds == {(True, "pinned_host"), (False, "device")}  # the moments on the host, the counters not
  for source, offload in (("plain", True), ("offloaded", False)):
    workdir = resumable_copy(tmp_path / source, tmp_path / f"{source}_resumed", 3)
    state, resumed = trainer.train(_config(workdir, offload))
    assert [h["step"] for h in resumed] == [4, 5, 6]
    assert [h["loss"] for h in resumed] == losses[3:], source
    moments = [a for a in jax.tree.leaves(state.opt_state) if a.ndim]
    assert {a.sharding.memory_kind for a in moments} == {"pinned_host" if offload else "device"}
  dry = {o: trainer.dry_run(_config(tmp_path / f"dry_{o}", o, dry_run=True)) for o in (False, True)}
  device, host = dry[True]["memory_per_device"], dry[True]["host_memory_per_device"]
  assert device["argument"] <= 0.45 * dry[False]["memory_per_device"]["argument"]
  assert host["argument"] == dry[True]["opt_bytes_on_host_per_device"] > 0
  # (the CPU backend has no memory apart for the host: it counts the host buffer the streamed update writes the new
  # moments into among the device's temporaries; the TPU compiler counts it as the host's, docs/parallelism.md)
  assert dry[True]["peak_bytes_per_device"] - host["argument"] < dry[False]["peak_bytes_per_device"]
  np.testing.assert_equal(dry[False]["host_memory_per_device"]["argument"], 0)


def test_offload_refuses_a_backend_without_host_memory_and_an_optimizer_without_state():
  """One ConfigError line naming optim.offload_state each."""
  def mesh(*kinds):
    device = types.SimpleNamespace(platform="metal", addressable_memories=lambda: [
        types.SimpleNamespace(kind=k) for k in kinds])
    return types.SimpleNamespace(devices=np.array([device]))

  moments = {"mu": jax.ShapeDtypeStruct((4, 4), np.float32), "count": jax.ShapeDtypeStruct((), np.int32)}
  with pytest.raises(ConfigError, match=r"^optim.offload_state: the metal backend has no 'pinned_host' memory"):
    state_lib.check_offload(mesh("device"), moments, "adamw")
  with pytest.raises(ConfigError, match=r"^optim.offload_state: optimizer 'sgd' keeps no per-parameter state"):
    state_lib.check_offload(mesh("device", "pinned_host"), {"count": moments["count"]}, "sgd")
  state_lib.check_offload(mesh("device", "pinned_host"), moments, "adamw")


@pytest.mark.parametrize("name", ["adamw", "lion", "adafactor", "muon"])
def test_offloaded_update_streams_an_elementwise_optimizer_over_the_stacked_layers(tmp_path, name):
  """AdamW's and Lion's moments stream a layer at a time (the stacked layers' moments by the layer, embeddings, norm
  and head whole, counters shared); Adafactor's and Muon's state, and layers split over pipeline stages, come
  over whole (plan None)."""
  c = small_config(tmp_path, data=2, fsdp=4)
  c.optim.name = name
  model = models.Model.from_config(c.model)
  tx = optim.make(c.optim, 10, None, model.logical_specs)
  rules = sharding.rules_from_config(c.sharding)
  for stages in (1, 2):
    sizes = {a: {"data": 2, "fsdp": 4 // stages, "pipeline": stages}.get(a, 1) for a in mesh_lib.MESH_AXES}
    mesh = jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes))
    layout = state_lib.shardings(model, tx, mesh, rules, offload=True)
    opt_state = jax.eval_shape(tx.init, model.abstract_params)
    plan = offload_lib.plan(tx, model, model.abstract_params, opt_state, layout.opt_state)
    if name in ("adafactor", "muon") or stages > 1:
      assert plan is None
      continue
    layers = model.num_layers()
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(opt_state)]
    assert {p: g for p, g in zip(paths, plan.state) if "embed" in p or "count" in p} == {
        p: offload_lib.SHARED if "count" in p else None for p in paths if "embed" in p or "count" in p}
    assert all(g == layers for p, g in zip(paths, plan.state) if "['layers']" in p)

"""The private APIs of JAX, XLA and qwix that jaxtrain uses, all in jaxtrain/_compat.py: nothing else imports one;
each is there on the installed release and does what jaxtrain needs of it; a missing one is one line naming the
installed version and breaks only its feature; the install bounds are the tested releases. .ci/run runs these (the
``compat`` marker) on each tested jax."""

import ast
import configparser
import dataclasses
import importlib
import inspect
import logging
import pathlib
import re
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packaging.specifiers import SpecifierSet

from jaxtrain import _compat
from jaxtrain.errors import UserError

pytestmark = pytest.mark.compat

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("jaxtrain", "tests", "tools", "benchmarks", "configs")


def private_imports(source: str) -> list[tuple[int, str]]:
  """(line, module) of every import of a ``_src`` module in ``source``: import statements (at the top or in a
  function) and importlib.import_module / __import__ calls with a literal name."""
  found = []
  for node in ast.walk(ast.parse(source)):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and isinstance(
        node.args[0].value, str):
      func = node.func
      called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
      if called in ("import_module", "__import__"):
        names = [node.args[0].value]
    hits = {name for name in names if "_src" in name.split(".")}
    found += [(node.lineno, name) for name in sorted(hits)][:1]
  return sorted(found)


def test_no_module_but_compat_imports_a_private_module():
  offenders = []
  for folder in SCANNED:
    for path in sorted((ROOT / folder).rglob("*.py")):
      if path == ROOT / "jaxtrain" / "_compat.py":
        continue
      offenders += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in private_imports(path.read_text())]
  assert not offenders, "private modules imported outside jaxtrain/_compat.py:\n" + "\n".join(offenders)
  # The check finds what it looks for (each form once), and leaves the rest alone.
  planted = ("from jax._src import distributed\nimport qwix._src.core as c\ndef f():\n  from jax import _src\n"
             "importlib.import_module('jax._src.cudnn')\nimport jax.numpy\nfrom jax.experimental import shard_map\n"
             "x = 'jax._src.compiler'\n")
  assert [line for line, _ in private_imports(planted)] == [1, 2, 4, 5]
  # jaxtrain/_compat.py itself imports them, by name, where an accessor is called.
  assert len(re.findall(r'"(jax|qwix)\._src[.\w]*"', (ROOT / "jaxtrain" / "_compat.py").read_text())) >= 5


def test_the_coordination_client_and_the_clusters_are_where_compat_looks():
  assert _compat.coordination_client() is None  # a single process: jax.distributed not initialized
  clusters, cloud_tpu_cluster, cluster = _compat.jax_clusters()
  assert callable(clusters.ClusterEnv.auto_detect_unset_distributed_params)
  assert hasattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm") and hasattr(cluster, "running_in_cloud_tpu_vm")


def test_cudnns_packed_attention_takes_the_arguments_jaxtrain_passes():
  """The cudnn backend (GPU) calls dot_product_attention with cuDNN's packed layout; on CPU its signature is what
  can be checked: every keyword jaxtrain.models.attention passes, and the mask type it names."""
  module = _compat.cudnn_fused_attention()
  parameters = inspect.signature(module.dot_product_attention).parameters
  passed = re.search(r"cudnn_attention\.dot_product_attention\((.*?)\)\n",
                     (ROOT / "jaxtrain" / "models" / "attention.py").read_text(), re.S).group(1)
  keywords = set(re.findall(r"(\w+)=", passed))
  assert keywords >= {"q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type", "qkv_layout"}
  assert keywords <= set(parameters), keywords - set(parameters)
  assert module.MaskType.PADDING_CAUSAL is not None


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_qwix_quantized_matmuls_run_with_the_configs_jaxtrain_builds(name):
  """jaxtrain.models.quantization builds qwix's configs by keyword and calls its ops: both run here, forward and
  backward, and the quantized product is the float one within the recipe's rounding."""
  from jaxtrain.models import quantization
  dot_general_qt, ragged_dot_qt = _compat.qwix_quantized_training()
  fields = {f.name for f in dataclasses.fields(dot_general_qt.DotGeneralQtConfig)}
  assert {"lhs_qtype", "rhs_qtype", "dlhs_grad_qtype", "drhs_grad_qtype"} <= fields
  lhs, rhs = jax.random.normal(jax.random.key(0), (8, 64)), jax.random.normal(jax.random.key(1), (64, 16))
  dims = (((1,), (0,)), ((), ()))
  quantized = quantization.dot_general(name)
  exact = jax.lax.dot_general(lhs, rhs, dims)
  tolerance = {"int8": 0.05, "fp8": 0.15}[name] * float(jnp.abs(exact).max())
  np.testing.assert_allclose(quantized(lhs, rhs, dims), exact, atol=tolerance)
  grads = jax.grad(lambda a, b: quantized(a, b, dims).sum(), (0, 1))(lhs, rhs)
  assert all(bool(jnp.isfinite(g).all()) for g in grads)
  groups = jnp.array([3, 5], jnp.int32)
  ragged = quantization.ragged_dot(name)(lhs, jnp.stack([rhs, 2 * rhs]), groups)
  np.testing.assert_allclose(ragged, jnp.concatenate([exact[:3], 2 * exact[3:]]), atol=2 * tolerance)


def test_jax_reports_a_compile_on_the_compiling_thread_trace_lowering_then_backend():
  """The watchdog leaves compiles out by these events (jaxtrain.monitor.Watchdog): a jit cache miss reports its
  trace, its lowering and its backend compile, in that order, on the thread that compiles; a cache hit reports
  nothing."""
  seen = []

  def listen(event, duration, **kwargs):
    if event.startswith("/jax/core/compile/"):
      seen.append((event, threading.get_ident()))

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    f = jax.jit(lambda x: jnp.cos(x) * 5.0)
    f(np.arange(11.0)).block_until_ready()
    first = list(seen)
    f(np.arange(11.0)).block_until_ready()
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  events = [event for event, _ in first]
  order = [_compat.TRACE_EVENT, _compat.LOWER_EVENT, _compat.BACKEND_COMPILE_EVENT]
  assert [e for e in events if e in order][-3:] == order, events
  assert {thread for _, thread in first} == {threading.get_ident()}
  assert seen == first  # the second call hit the cache


def test_replicated_arrays_are_saved_on_cpu_without_compiling_and_restore_equal(tmp_path):
  """On CPU devices each array of a save is written from one of its replicas (jaxtrain._compat.orbax_one_replica_
  writes, through a private attribute of Orbax's): saving arrays replicated over 8 devices, or split over 4 and
  replicated twice, compiles no program (Orbax's default splits each replicated shard among its replicas, a slice
  program compiled per array and device), and the step restores equal onto the same shardings."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxtrain import checkpoint as checkpoint_lib
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
  values = {"replicated": np.arange(64 * 24, dtype=np.float32).reshape(64, 24),
            "split": np.arange(32 * 8, dtype=np.float32).reshape(32, 8) - 7.5}
  layouts = {"replicated": NamedSharding(mesh, P()), "split": NamedSharding(mesh, P("fsdp"))}
  state = {k: jax.device_put(v, layouts[k]) for k, v in values.items()}
  ckpt = checkpoint_lib.PersistentTier(tmp_path, async_save=False, verify=False)
  compiles = []

  def listener(event, duration, **kwargs):
    if event == _compat.BACKEND_COMPILE_EVENT:
      compiles.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    ckpt.save(1, state, iter([]), meta={}, config={}, force=True)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  restored, _ = ckpt.restore(1, abstract, iter([]))
  ckpt.close()
  for k, v in values.items():
    np.testing.assert_array_equal(np.asarray(restored[k]), v)
    assert restored[k].sharding == layouts[k]


def test_a_missing_private_api_is_one_line_naming_the_installed_version_and_breaks_only_its_feature(monkeypatch):
  for name in ("jax._src.cudnn.fused_attention_stablehlo", "qwix._src.core.dot_general_qt"):
    monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError, as if it were gone
  with pytest.raises(_compat.PrivateAPIMissing) as e:
    _compat.cudnn_fused_attention()
  assert isinstance(e.value, UserError) and "\n" not in str(e.value)  # main: one line, exit 2
  assert re.match(re.escape(
      "model.attention=cudnn: needs jax._src.cudnn.fused_attention_stablehlo (checked on jax 0.10.2, 0.12.0.1), "
      f"which jax {_compat.installed('jax')} lacks (") + r"(ModuleNotFoundError|ImportError): ", str(e.value))
  assert str(e.value).endswith("; install a tested jax (pip install -e .) or turn the feature off")
  with pytest.raises(_compat.PrivateAPIMissing, match=r"^model.quantization: needs qwix._src.core.dot_general_qt "
                     rf"\(checked on qwix 0.1.8\), which qwix {re.escape(_compat.installed('qwix'))} lacks"):
    _compat.qwix_quantized_training()
  # With qwix gone altogether, jaxtrain still imports and trains unquantized: only model.quantization needs it.
  code = ("import sys; sys.modules['qwix'] = None\n"
          "import jaxtrain.main, jaxtrain.generate, jaxtrain.hf\n"
          "from jaxtrain.models import quantization\n"
          "assert quantization.dot_general('none') is quantization.jax.lax.dot_general\n"
          "try:\n  quantization.dot_general('int8')\nexcept Exception as e:\n  print(type(e).__name__, e)\n")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("PrivateAPIMissing model.quantization: needs qwix._src.core.dot_general_qt (checked on "
                             "qwix 0.1.8), which qwix 0.1.8 lacks (ModuleNotFoundError: "), r.stdout


def test_an_untested_jax_is_warned_about_once(monkeypatch, caplog):
  monkeypatch.setattr(_compat, "_warned", [])
  with caplog.at_level(logging.WARNING):
    assert _compat.warn_if_untested(_compat.TESTED_JAX[0]) is None
    message = _compat.warn_if_untested("0.13.0")
    assert _compat.warn_if_untested("0.13.0") is None and _compat.warn_if_untested("0.9.0") is None
  assert message == ("jax 0.13.0 is not a release jaxtrain was tested with (0.10.2, 0.12.0.1); the private APIs of "
                     "jaxtrain/_compat.py may differ there (pip install -e . installs a tested one)")
  assert caplog.text.count("is not a release jaxtrain was tested with") == 1
  assert _compat.installed("jax") in _compat.TESTED_JAX  # this test environment is a tested one


def test_the_install_bounds_and_ci_are_the_tested_releases():
  """setup.cfg's jax and qwix bounds admit every tested release and exclude the next minor ones; .ci/run's two legs
  run the oldest and the newest tested jax."""
  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  lines = [line.strip() for line in cfg["options"]["install_requires"].splitlines()]
  requires = {re.split(r"[<>=!\[ ]", line, maxsplit=1)[0]: line for line in lines if line and line[0] != "#"}
  jax_bounds = SpecifierSet(requires["jax"].removeprefix("jax"))
  qwix_bounds = SpecifierSet(requires["qwix"].removeprefix("qwix"))
  assert all(v in jax_bounds for v in _compat.TESTED_JAX)
  assert "0.10.1" not in jax_bounds and "0.13.0" not in jax_bounds
  assert all(v in qwix_bounds for v in _compat.TESTED_QWIX) and "0.2.0" not in qwix_bounds
  assert "==" not in requires["qwix"]  # a range, not a pin, in a library's requirements
  ci = (ROOT / ".ci" / "run").read_text()
  assert f"jax=={_compat.TESTED_JAX[0]}" in ci and f"jax=={_compat.TESTED_JAX[-1]}" in ci

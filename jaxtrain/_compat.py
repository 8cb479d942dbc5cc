"""The one home of what jaxtrain uses from JAX, XLA, qwix, Orbax and gcsfs that they do not promise to keep: their
private modules (``jax._src``, ``qwix._src``, ``orbax.checkpoint._src``) and the names they read. Nothing else under
jaxtrain/, tests/, tools/ or benchmarks/ imports a ``_src`` module (tests/test_compat.py fails on one).

Each accessor imports what it needs when it is called, never when this module is imported, so that a private API
that moved breaks only the feature that needs it, never every start. Each says the versions it was checked on; when
what it needs is missing it raises :class:`PrivateAPIMissing`, one line naming the feature, the installed version and
the tested ones (printed by main as a user error, exit 2: install a tested release, or do without the feature).
setup.cfg bounds jax and qwix to the tested releases; :func:`warn_if_untested` warns once on any other jax.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os

from absl import logging

from jaxtrain.errors import UserError

# The releases the test suite runs on (.ci/run: Python 3.11 with the first, Python 3.12 with the last). setup.cfg's
# install bounds are jax>=0.10.2,<0.13 and qwix>=0.1.8,<0.2.
TESTED_JAX = ("0.10.2", "0.12.0.1")
TESTED_QWIX = ("0.1.8",)
TESTED_ORBAX = ("0.12.8",)


class PrivateAPIMissing(UserError):
  """A private API a feature needs is not in the installed release."""

  def __init__(self, feature: str, api: str, package: str, tested: tuple[str, ...], cause: BaseException):
    why = (str(cause).splitlines() or [""])[0][:120]
    super().__init__(feature, f"needs {api} (checked on {package} {', '.join(tested)}), which {package} "
                     f"{installed(package)} lacks ({type(cause).__name__}: {why})",
                     f"install a tested {package} (pip install -e .) or turn the feature off")


def installed(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "(not installed)"


def _attribute(module: str, name: str, feature: str, package: str, tested: tuple[str, ...]):
  """``module.name``, imported now; :class:`PrivateAPIMissing` if either is gone."""
  try:
    found = importlib.import_module(module)
    return getattr(found, name) if name else found
  except (ImportError, AttributeError) as e:
    raise PrivateAPIMissing(feature, f"{module}{'.' + name if name else ''}", package, tested, e) from None


# JAX's coordination service ---------------------------------------------------------------------------------------


def coordination_client():
  """The client of JAX's coordination service (key-value store, barriers), or None when ``jax.distributed`` was not
  initialized. JAX has no public handle on it (checked on jax 0.10.2 and 0.12.0.1). Used by the peer watch
  (jaxtrain.distributed.PeerWatch) and the multi-process preemption notice (jaxtrain.train.preemption)."""
  state = _attribute("jax._src.distributed", "global_state", "the peer watch and the preemption notice", "jax",
                     TESTED_JAX)
  try:
    return state.client
  except AttributeError as e:
    raise PrivateAPIMissing("the peer watch and the preemption notice", "jax._src.distributed.global_state.client",
                            "jax", TESTED_JAX, e) from None


# The key whose appearance in the coordination service's store starts XLA's preemption sync protocol on every
# process (xla/tsl/distributed_runtime/preemption/preemption_sync_manager.cc; checked on jax 0.10.2 and 0.12.0.1:
# tests/test_compat.py posts it between two processes and both reach the same sync point).
PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"


def post_preemption_notice(client, when: str) -> None:
  """Starts the preemption sync protocol, as JAX's own SIGTERM notifier would (``when``: the expected time of death,
  ISO 8601). Raises the client's error when another process posted it first (ALREADY_EXISTS)."""
  client.key_value_set(PREEMPTION_NOTICE_KEY, when)


# Compiles, as jax.monitoring reports them ---------------------------------------------------------------------------

# Duration events JAX records on the compiling thread when a jit call misses its caches, in this order: the trace
# ends, the lowering to MLIR ends, the backend compile ends (jax._src.dispatch's *_EVENT names; checked on jax 0.10.2
# and 0.12.0.1: tests/test_compat.py). The watchdog does not count the span from a trace's start to its backend
# compile's end.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# Kernels ----------------------------------------------------------------------------------------------------------


def cudnn_fused_attention():
  """``jax._src.cudnn.fused_attention_stablehlo``: cuDNN's fused attention with the packed layout (segment offsets
  and lengths) that the public ``jax.nn.dot_product_attention`` does not take (checked on jax 0.10.2 and 0.12.0.1;
  the attention backend ``cudnn``)."""
  return _attribute("jax._src.cudnn.fused_attention_stablehlo", "", "model.attention=cudnn", "jax", TESTED_JAX)


def qwix_quantized_training():
  """``(dot_general_qt, ragged_dot_qt)`` of ``qwix._src.core``: qwix's quantized-training matmuls, which its public
  ``quantize_model`` reaches only through interception that jaxtrain's layers do not go through (checked on qwix
  0.1.8; model.quantization)."""
  return tuple(_attribute(f"qwix._src.core.{name}", "", "model.quantization", "qwix", TESTED_QWIX)
               for name in ("dot_general_qt", "ragged_dot_qt"))


def lm_eval_yaml_loader():
  """``lm_eval.tasks._yaml_loader.load_yaml``: the reader the harness's task index reads task YAMLs with (its
  includes and ``!function`` tags), to name a YAML the index skips without a word (checked on lm-eval 0.4.13;
  jaxtrain.evaluate and eval.harness_tasks). None where it moved: the caller falls back to YAML's syntax alone."""
  try:
    return _attribute("lm_eval.tasks._yaml_loader", "load_yaml", "the harness's task check", "lm-eval", ("0.4.13",))
  except PrivateAPIMissing:
    return None


# Orbax on object stores ---------------------------------------------------------------------------------------------


def orbax_object_stores() -> None:
  """Has Orbax's TensorStore writes and reads reach ``s3://`` and ``gs://`` through :mod:`jaxtrain.stores`
  (idempotent; checked on orbax-checkpoint 0.12.8, which warns once on another release).

  Why: Orbax builds every TensorStore kvstore of a checkpoint in one private function
  (``orbax.checkpoint._src.serialization.tensorstore_utils.build_kvstore_tspec``), which knows ``gs://`` only: an
  ``s3://`` directory is normalized to ``s3:/...`` and refused ("Checkpoint path should be absolute"), and TensorStore
  reaching S3 by URL would not read ``AWS_ENDPOINT_URL`` anyway (an S3-compatible server needs the endpoint in the
  spec). Orbax has no option for either, nor for TensorStore's retries (32 over ~15 minutes by default: a store that
  is down would hang a save that long). So the function is wrapped: an ``s3://`` directory goes through Orbax's own
  ``gs://`` path (the same OCDBT layout, no local-path checks) and every gcs kvstore in the spec it returns is
  replaced with :func:`jaxtrain.stores.tensorstore_kvstore`'s (the s3 driver with the environment's endpoint, or the
  gcs driver, both with bounded retries). Local paths are left alone."""
  feature = "checkpoints on s3:// and gs://"
  ts_utils = _attribute("orbax.checkpoint._src.serialization.tensorstore_utils", "", feature, "orbax-checkpoint",
                        TESTED_ORBAX)
  original = getattr(ts_utils, "build_kvstore_tspec", None)
  if original is None:
    raise PrivateAPIMissing(feature, "orbax.checkpoint._src.serialization.tensorstore_utils.build_kvstore_tspec",
                            "orbax-checkpoint", TESTED_ORBAX, AttributeError("build_kvstore_tspec"))
  if getattr(original, "jaxtrain_object_stores", False):
    return
  _warn_if_untested_package("orbax-checkpoint", TESTED_ORBAX)
  from jaxtrain import stores  # pylint: disable=import-outside-toplevel

  def swap(spec, s3: bool):
    if isinstance(spec, dict):
      if spec.get("driver") in ("gcs", "gcs_grpc") and "bucket" in spec:
        url = f"{'s3' if s3 else 'gs'}://{spec['bucket']}/{spec.get('path', '')}"
        return {**{k: v for k, v in spec.items() if k not in ("driver", "bucket", "path")},
                **stores.tensorstore_kvstore(url)}
      return {k: swap(v, s3) for k, v in spec.items()}
    if isinstance(spec, list):
      return [swap(v, s3) for v in spec]
    return spec

  def build_kvstore_tspec(directory, *args, **kwargs):
    path = os.fspath(directory)
    if not stores.is_store(path):
      return original(directory, *args, **kwargs)
    s3 = stores.scheme(path) == "s3"
    return swap(original("gs://" + path.split("://", 1)[1] if s3 else path, *args, **kwargs), s3)

  build_kvstore_tspec.jaxtrain_object_stores = True
  ts_utils.build_kvstore_tspec = build_kvstore_tspec


def orbax_one_replica_writes() -> None:
  """Has Orbax write each ``jax.Array`` of a save from one of its replicas (idempotent; checked on orbax-checkpoint
  0.12.8). Called where the devices are CPUs (:class:`jaxtrain.checkpoint.persistent.PersistentTier`).

  Why: by default (except on GPU) Orbax splits each replicated shard among its replicas, each copying its part to the
  host, so that accelerators share the device-to-host copies. On CPUs, device memory is host memory: there is nothing
  to share, and each part is cut by a slice program that JAX compiles per array shape and device (a tiny
  data-parallel run's first save: 72 of them, ~1.2 s; tests/test_lora.py's MLA test: 22 -> 17 CPU-s). Orbax has no
  public option for it, and registering another ``jax.Array`` handler would log a warning at every start: the
  registered handler's own switch (``_use_replica_parallel``, read at each save) is turned off, Orbax's choice on
  GPU. What is written is the same arrays; only the zarr chunks are whole shards instead of parts. A release without
  that attribute is left as it is (its saves cost more; nothing else changes)."""
  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  handler = ocp.type_handlers.get_type_handler(jax.Array)
  if getattr(handler, "_use_replica_parallel", None) is False:
    return
  _warn_if_untested_package("orbax-checkpoint", TESTED_ORBAX)
  if hasattr(handler, "_use_replica_parallel"):  # else saves stay as that release makes them: slower, not wrong
    handler._use_replica_parallel = False  # noqa: SLF001


# gcsfs ------------------------------------------------------------------------------------------------------------

TESTED_GCSFS = ("2026.10.1",)


def gcsfs_json_api(fs):
  """``(call, location)`` of the gcsfs filesystem ``fs``: its request method (``call(method, url, *args,
  json_out=False, **query_params)``, which raises gcsfs's error for the answer's status: a 412 is FileExistsError, an
  HttpError with code 412 before gcsfs 2026.x) and the base URL of the Cloud Storage JSON API it reaches (its
  ``endpoint_url``, else ``STORAGE_EMULATOR_HOST``'s, else Google's). Both are gcsfs's own, undocumented (checked on
  gcsfs 2026.10.1; the same in 2024.2.0's source).

  Why: the workdir's lease on ``gs://`` (:mod:`jaxtrain.lease`) replaces its object only if it is still the
  generation read (``ifGenerationMatch=<generation>``); gcsfs's uploads take no precondition but
  ``ifGenerationMatch=0`` (``mode="create"``), so the lease makes the JSON API's upload itself, with gcsfs's session,
  credentials, endpoint and retries."""
  try:
    return fs.call, fs._location  # noqa: SLF001
  except AttributeError as e:
    raise PrivateAPIMissing("the workdir's lease on gs://", "gcsfs.GCSFileSystem.call and ._location", "gcsfs",
                            TESTED_GCSFS, e) from None


# Tests ------------------------------------------------------------------------------------------------------------


def jax_clusters():
  """``(clusters, cloud_tpu_cluster, cluster)`` of ``jax._src.clusters``: JAX's detection of the cluster a process
  runs in, for the tests that check what jaxtrain joins in each environment (checked on jax 0.10.2 and 0.12.0.1)."""
  return tuple(_attribute(name, "", "the cluster detection tests", "jax", TESTED_JAX)
               for name in ("jax._src.clusters", "jax._src.clusters.cloud_tpu_cluster", "jax._src.clusters.cluster"))


# The installed jax ------------------------------------------------------------------------------------------------

_warned: list[str] = []
_warned_packages: set[str] = set()


def _warn_if_untested_package(package: str, tested: tuple[str, ...]) -> None:
  """Warns once per process when ``package`` is not a release the private API above was checked on."""
  version = installed(package)
  if version in tested or package in _warned_packages:
    return
  _warned_packages.add(package)
  logging.warning("%s %s is not a release jaxtrain was tested with (%s); the private APIs of jaxtrain/_compat.py may "
                  "differ there (pip install -e . installs a tested one)", package, version, ", ".join(tested))


def warn_if_untested(version: str | None = None) -> str | None:
  """Warns once per process when the installed jax (or ``version``) is not a release the suite ran on: the private
  APIs above may differ there. Returns the warning, or None."""
  version = version or installed("jax")
  if version in TESTED_JAX or _warned:
    return None
  message = (f"jax {version} is not a release jaxtrain was tested with ({', '.join(TESTED_JAX)}); the private APIs "
             "of jaxtrain/_compat.py may differ there (pip install -e . installs a tested one)")
  _warned.append(message)
  logging.warning(message)
  return message

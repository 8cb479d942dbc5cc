"""Object stores: ``gs://`` (Google Cloud Storage) and ``s3://`` (Amazon S3 and the S3-compatible servers: MinIO,
Ceph, Cloudflare R2). Which client library a scheme needs (:func:`check_client`), how TensorStore, under Orbax,
reaches a store (:func:`tensorstore_kvstore`), and a store that does not answer (:func:`unreachable`) or refuses the
caller (:func:`refused`) told apart from other failures.

Python reaches the stores through etils.epath and fsspec (gcsfs, s3fs), the checkpoints' tensors through
TensorStore's own ``gcs`` and ``s3`` drivers. Both take the endpoint and credentials the way the clouds' own tools
do: for S3, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (an S3-compatible server), ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` with ``~/.aws/credentials``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``;
for GCS, Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth
application-default login``, a VM's service account) and, for an emulator, ``STORAGE_EMULATOR_HOST`` (gcsfs) with
``TENSORSTORE_GCS_HTTP_URL`` (TensorStore). TensorStore's s3 driver does not read the endpoint variables itself:
:func:`tensorstore_kvstore` hands it the endpoint.

Every wait on a store is bounded. TensorStore retries a failed request 32 times over up to ~15 minutes by default;
here :data:`RETRIES` (5 retries, 0.5 s doubling to 8 s: ~16 s of back-off per request). s3fs gives up on a store
that refuses connections after ~10 s, gcsfs after ~35 s (their own retries, measured on localhost). A store that
accepts connections and never answers costs TensorStore 5 tries of its 60 s low-speed window (~6 minutes,
``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``), s3fs ~7 minutes, and gcsfs, which sets no request timeout, waits
until one is set (``FSSPEC_GCS='{"requests_timeout": 60}'``): docs/object_stores.md.
"""

from __future__ import annotations

import importlib.util
import os
from urllib import parse

from jaxtrain import failures
from jaxtrain.errors import UserError

# scheme -> (the fsspec client etils.epath needs, the extra of setup.cfg that installs it)
CLIENTS = {"gs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3")}

# TensorStore's retries of a failed request to a store (its context resources gcs_request_retries and
# s3_request_retries): a store that does not answer fails a save within ~16 s of back-off, not ~15 minutes.
RETRIES = {"max_retries": 5, "initial_delay": "0.5s", "max_delay": "8s"}


def scheme(path: str) -> str:
  """``'gs'``, ``'s3'``, another URL's scheme, or ``''`` for a local path."""
  return path.split("://", 1)[0].lower() if "://" in path else ""


def is_store(path: str) -> bool:
  """Whether ``path`` is on an object store (``gs://`` or ``s3://``)."""
  return scheme(path) in CLIENTS


def check_client(path: str, what: str) -> None:
  """Raises a UserError (one line: the package and the extra to install) when ``path`` is on an object store whose
  client library is not installed. ``what``: the config key or argument that names ``path``."""
  found = CLIENTS.get(scheme(path))
  if found and importlib.util.find_spec(found[0]) is None:
    raise UserError(what, f"{'' if what == path else repr(path) + ' '}needs the {found[0]} package, which is not "
                    "installed",
                    f"pip install -e '.[{found[1]}]' (or pip install {found[0]})")


def split(url: str) -> tuple[str, str]:
  """``(bucket, key prefix)`` of ``gs://bucket/a/b`` or ``s3://bucket/a/b``."""
  parsed = parse.urlparse(url)
  return parsed.netloc, parsed.path.lstrip("/")


def s3_endpoint() -> str:
  """The S3 endpoint the AWS tools use (boto3's order: ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``), or ''
  for Amazon's."""
  return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""


def tensorstore_kvstore(url: str) -> dict:
  """TensorStore's kvstore spec of ``url`` (``gs://`` or ``s3://``), with the endpoint the environment names and
  bounded retries (:data:`RETRIES`)."""
  bucket, path = split(url)
  if scheme(url) == "gs":
    return {"driver": os.environ.get("TENSORSTORE_GCS_BACKEND", "gcs"), "bucket": bucket, "path": path,
            "gcs_request_retries": dict(RETRIES)}
  spec = {"driver": "s3", "bucket": bucket, "path": path, "s3_request_retries": dict(RETRIES)}
  if os.environ.get("AWS_ACCESS_KEY_ID"):
    # Keys in the environment come first, as for boto3 (TensorStore's default chain would also read them, after
    # logging an error for each of ~/.aws/config and ~/.aws/credentials that is missing).
    spec["aws_credentials"] = {"type": "environment"}
  endpoint = s3_endpoint()
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if endpoint:
    # An S3-compatible server has no region to look up: boto3 signs for us-east-1 unless told otherwise.
    spec.update(endpoint=endpoint, aws_region=region or "us-east-1")
  elif region:
    spec["aws_region"] = region
  return spec


def move_folder(src: str, dst: str) -> None:
  """Moves the objects under ``src`` to ``dst`` on the same store: an object store has no rename, so each object is
  copied, then all are deleted (etils.epath's rename does not take a folder on S3)."""
  import fsspec  # pylint: disable=import-outside-toplevel  (installed with gcsfs and s3fs)
  fs, source = fsspec.core.url_to_fs(src)
  target = fsspec.core.url_to_fs(dst)[1]
  fs.invalidate_cache()  # listings another client (etils.epath, Orbax) changed since
  files = fs.find(source)
  for f in files:
    fs.copy(f, target + f[len(source):])
  fs.rm(files)


def unreachable(e: BaseException) -> BaseException | None:
  """The error behind ``e`` (itself, its causes or contexts, an exception group's members) that says an object store
  did not answer or throttled (:func:`jaxtrain.failures.classify`: refused, reset, timed out, 429, 5xx), or None. Such
  a failure passes when the store is back: a restart cures it."""
  failure = failures.classify(e)
  return failure.error if failure is not None and failure.kind in (failures.UNREACHABLE, failures.THROTTLED) else None


def refused(e: BaseException) -> BaseException | None:
  """The error behind ``e`` that says an object store refused the caller (:func:`jaxtrain.failures.classify`: 401,
  403, missing or wrong credentials, no permission), or None. A restart does not cure it: the user's credentials or
  the bucket's permissions do."""
  failure = failures.classify(e)
  return failure.error if failure is not None and failure.kind == failures.DENIED else None

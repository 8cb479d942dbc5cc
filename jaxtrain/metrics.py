"""What a run reports: model FLOPs and MFU, and the writers (console or progress bar, JSONL, TensorBoard,
optional Weights & Biases). Only process 0 writes.

FLOPs per token (training, forward + backward) are the model family's own (``Family.flops_per_token``; dense
decoders use PaLM's ``6 N + 12 layers heads head_dim seq_len``, see jaxtrain.models.dense_flops_per_token).
"""

from __future__ import annotations

import json
import os
import sys

import jax
from absl import logging
from etils import epath
import ml_collections
from jaxtrain import failures, logs, paths
from jaxtrain.errors import check_choice, check_positive


METRICS = "metrics.jsonl"


def defaults() -> ml_collections.ConfigDict:
  """The ``metrics`` config group."""
  return ml_collections.ConfigDict(dict(
      peak_tflops=0.0,  # per-device peak for MFU; 0 = from the device kind (TPU v4-v6e, A100, H100, H200)
      tensorboard=True,  # event files in <workdir>/tensorboard
      wandb=False,  # Weights & Biases, when installed
      wandb_project="",
      progress="auto",  # auto (a bar on a TTY, log lines otherwise) | bar | log
      profile_start=-1,  # capture a jax.profiler trace from this step ...
      profile_steps=3,  # ... for this many steps, into <workdir>/profile
  ))


def validate(config) -> None:
  check_choice(config, "metrics.progress", ("auto", "bar", "log"))
  check_positive(config, ["metrics.peak_tflops"], allow_zero=True)
  check_positive(config, ["metrics.profile_steps"])

# Dense bf16 peak FLOP/s per chip.
PEAK_FLOPS = (("v6 lite", 918e12), ("v6e", 918e12), ("v5 lite", 197e12), ("v5e", 197e12), ("v5p", 459e12),
              ("v5", 459e12), ("v4", 275e12), ("a100", 312e12), ("h100", 989e12), ("h200", 989e12))


def flops_per_token(model, seq_len: int) -> float:
  """Training FLOPs per token of ``model`` (a jaxtrain.models.Model): its family's own count."""
  return model.flops_per_token(seq_len)


def peak_flops_per_device(override_tflops: float = 0.0, device=None) -> float | None:
  """Peak FLOP/s of one device: the override if given, else from the device kind; None if unknown (CPU)."""
  if override_tflops:
    return override_tflops * 1e12
  kind = (device or jax.devices()[0]).device_kind.lower()
  return next((peak for name, peak in PEAK_FLOPS if name in kind), None)


def device_memory_bytes() -> int | None:
  """Bytes in use on this process's first device, where the backend reports it (GPU, TPU)."""
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:  # noqa: BLE001 - some backends raise instead of returning None
    return None
  return stats.get("bytes_in_use") if stats else None


def read_records(path) -> list[dict]:
  """The complete records of a ``metrics.jsonl`` (or of the one in a workdir): a line still being appended by a
  live run (or cut by a kill) is left out. Steps logged again after a resume appear again, the last one latest. On an
  object store the records are its segments, run after run (:mod:`jaxtrain.logs`), after the whole object an earlier
  version wrote; ``path`` is then the workdir, or a ``.jsonl`` object in it."""
  path = os.fspath(path)
  if paths.is_url(path):
    text = logs.read(path if path.endswith(".jsonl") else paths.join(path, METRICS))
  else:
    local = epath.Path(path)
    local = local / METRICS if local.is_dir() else local
    text = local.read_text() if local.exists() else ""
  return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def _drop_torn_line(path: epath.Path) -> None:
  """A run killed while appending a record leaves a partial last line; cut it so the file stays JSON Lines."""
  if not path.exists():
    return
  data = path.read_bytes()
  if data and not data.endswith(b"\n"):
    logging.warning("%s: dropping a partial last record (the previous run was killed while writing it)", path)
    path.write_bytes(data[:data.rfind(b"\n") + 1])


def _summary_writer_class():
  """tensorboardX's SummaryWriter, imported without torch. tensorboardX's writer module imports torch, where it is
  installed, only to accept torch tensors; we log Python floats, and importing torch costs a process start over a
  second (torch is in the test extra for the transformers reference, so every run in the suite paid it). While
  tensorboardX is imported for the first time, ``import torch`` fails as if it were absent, unless the program
  already imported torch itself."""
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  sys.modules["torch"] = None  # the import system's marker for "not importable": `import torch` raises ImportError
  try:
    from tensorboardX import SummaryWriter
  finally:
    del sys.modules["torch"]
  return SummaryWriter


class MetricWriter:
  """Console (a tqdm bar on a TTY, plain log lines otherwise), ``metrics.jsonl``, TensorBoard and W&B.

  A local ``metrics.jsonl`` is appended to: each record is in it when :meth:`write` returns. An object store
  (``gs://``, ``s3://``) cannot append: there the records are a :class:`jaxtrain.logs.Stream`'s segments under
  ``metrics.jsonl.d/``, written by a thread at most once a second (:data:`jaxtrain.logs.INTERVAL_S`), so that a
  record costs the same bytes and requests at step 10 and at step 1,000,000 and the loop never waits for the store; a
  kill loses the records of the last second (during an outage, those not written yet), and :func:`read_records` reads
  them back as one file. TensorBoard's event files are tensorboardX's: it writes them to ``gs://`` and ``s3://``
  itself, whole at each flush, there every two minutes (its ``flush_secs``) rather than at every record."""

  def __init__(self, workdir: str, total_steps: int, start_step: int, metrics_cfg, config_dict: dict,
               console: tuple[str, ...] = ()):
    """``console``: the objective's own metrics the console line shows after loss and grad_norm (those a record
    holds)."""
    self.enabled = jax.process_index() == 0
    self.total_steps = total_steps
    self.console = tuple(console)
    self.path = epath.Path(workdir) / METRICS
    self.tb = self.wandb = self.bar = None
    self.stream: logs.Stream | None = None  # an object store's metrics.jsonl (None: a local file)
    if not self.enabled:
      return
    if paths.is_url(os.fspath(workdir)):
      self.stream = logs.Stream(logs.segments(paths.join(os.fspath(workdir), METRICS)), "metrics", ".jsonl")
    else:
      _drop_torn_line(self.path)
    if metrics_cfg.tensorboard:
      SummaryWriter = _summary_writer_class()
      # A resumed run re-logs the steps after its checkpoint: TensorBoard hides the earlier run's copies.
      # On an object store tensorboardX uploads an event file whole at each flush: there its own thread flushes
      # every flush_secs (120 s) instead of the loop at every record, with room to queue records meanwhile.
      self.tb = SummaryWriter(str(epath.Path(workdir) / "tensorboard"),
                              purge_step=start_step + 1 if start_step else None,
                              **({"max_queue": 1000} if self.stream is not None else {}))
    if metrics_cfg.wandb:
      try:
        import wandb
        self.wandb = wandb.init(project=metrics_cfg.wandb_project or "jaxtrain", config=config_dict,
                                dir=str(workdir), resume="allow")
      except ImportError:
        logging.warning("metrics.wandb=True but wandb is not installed (pip install wandb); skipping W&B")
    progress = metrics_cfg.progress
    if progress == "bar" or (progress == "auto" and sys.stderr.isatty()):
      from tqdm import tqdm
      self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    record = {"step": step, **{k: float(v) for k, v in metrics.items() if v is not None}}
    if self.stream is None:
      try:
        with self.path.open("a") as f:
          f.write(json.dumps(record) + "\n")
      except OSError as e:  # a full or failing disk: the run stops by its cause (the checkpoint's save would too)
        failures.reraise(e, os.fspath(self.path), f"writing step {step}'s metrics",
                         "the checkpoints are intact: a restart resumes and logs the steps since the newest one")
        raise
    else:
      self.stream.write(json.dumps(record) + "\n")
    for k, v in record.items():
      if k != "step" and self.tb is not None:
        self.tb.add_scalar(k, v, step)
    if self.tb is not None and self.stream is None:
      self.tb.flush()
    if self.wandb is not None:
      self.wandb.log(record, step=step)
    if "loss" not in record:  # an eval-only record
      logging.info("step %d | %s", step, " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
      return
    mfu = f" | MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
    own = "".join(f" | {k} {record[k]:.4f}" for k in self.console if k in record)
    line = (f"loss {record['loss']:.4f} | grad_norm {record['grad_norm']:.3f}{own} | lr {record['lr']:.2e} | "
            f"{record['tokens_per_sec']:,.0f} tok/s | {record['tflops_per_device']:.3g} TFLOP/s/device{mfu} | "
            f"{record['step_time']:.3f}s/step")
    if self.bar is not None:
      self.bar.n = step
      self.bar.set_postfix_str(line, refresh=True)
    else:
      logging.info("step %d/%d | %s", step, self.total_steps, line)

  def close(self) -> None:
    if self.stream is not None:
      self.stream.close()
    if self.bar is not None:
      self.bar.close()
    if self.tb is not None:
      self.tb.close()
    if self.wandb is not None:
      self.wandb.finish()


"""What a run reports: model FLOPs and MFU, and the writers (console or progress bar, JSONL, TensorBoard,
optional Weights & Biases). Only process 0 writes.

FLOPs per token (training, forward + backward) are the model family's own (``Family.flops_per_token``; dense
decoders use PaLM's ``6 N + 12 layers heads head_dim seq_len``, see jaxtrain.models.dense_flops_per_token).
"""

from __future__ import annotations

import json
import os
import sys

import fsspec
import jax
from absl import logging
from etils import epath
import ml_collections
from jaxtrain import paths
from jaxtrain.errors import check_choice, check_positive




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
  live run (or cut by a kill) is left out. Steps logged again after a resume appear again, the last one latest."""
  if paths.is_url(os.fspath(path)):
    text = _read_object(os.fspath(path))
  else:
    path = epath.Path(path)
    path = path / "metrics.jsonl" if path.is_dir() else path
    text = path.read_text() if path.exists() else ""
  return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def _read_object(url: str) -> str:
  """``metrics.jsonl`` on an object store (``url`` it, or its workdir), as it is now: one fresh read, not through the
  client's cached listing or a file object tied to the version it first saw (a live run replaces the object at every
  record)."""
  fs, path = fsspec.core.url_to_fs(url)
  fs.invalidate_cache()
  for name in (path, path.rstrip("/") + "/metrics.jsonl"):
    try:
      return fs.cat_file(name).decode()
    except (FileNotFoundError, IsADirectoryError):
      continue
  return ""


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

  Each record is in ``metrics.jsonl`` when :meth:`write` returns. A local file is appended to. An object store
  (``gs://``, ``s3://``) cannot append: there the writer keeps the file's text (read once at start) and writes it
  whole as the object at each record, which the store makes visible whole or not at all; a kill loses nothing
  written before, and a write that fails (the store unreachable) is warned about and made good by the next one.
  TensorBoard's event files are tensorboardX's: it writes them to ``gs://`` and ``s3://`` itself, whole at each
  flush."""

  def __init__(self, workdir: str, total_steps: int, start_step: int, metrics_cfg, config_dict: dict):
    self.enabled = jax.process_index() == 0
    self.total_steps = total_steps
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.tb = self.wandb = self.bar = None
    self.text: str | None = None  # an object store's metrics.jsonl as written so far (None: a local file)
    self.unwritten = False  # the last write to the store failed
    if not self.enabled:
      return
    if paths.is_url(os.fspath(workdir)):
      self.text = self.path.read_text() if self.path.exists() else ""
      self.text = self.text[:self.text.rfind("\n") + 1]  # never torn (a whole object), but written by anything
    else:
      _drop_torn_line(self.path)
    if metrics_cfg.tensorboard:
      SummaryWriter = _summary_writer_class()
      # A resumed run re-logs the steps after its checkpoint: TensorBoard hides the earlier run's copies.
      self.tb = SummaryWriter(str(epath.Path(workdir) / "tensorboard"),
                              purge_step=start_step + 1 if start_step else None)
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
    if self.text is None:
      with self.path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    else:
      self.text += json.dumps(record) + "\n"
      self._flush()
    for k, v in record.items():
      if k != "step" and self.tb is not None:
        self.tb.add_scalar(k, v, step)
    if self.tb is not None:
      self.tb.flush()
    if self.wandb is not None:
      self.wandb.log(record, step=step)
    if "loss" not in record:  # an eval-only record
      logging.info("step %d | %s", step, " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
      return
    mfu = f" | MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
    line = (f"loss {record['loss']:.4f} | grad_norm {record['grad_norm']:.3f} | lr {record['lr']:.2e} | "
            f"{record['tokens_per_sec']:,.0f} tok/s | {record['tflops_per_device']:.3g} TFLOP/s/device{mfu} | "
            f"{record['step_time']:.3f}s/step")
    if self.bar is not None:
      self.bar.n = step
      self.bar.set_postfix_str(line, refresh=True)
    else:
      logging.info("step %d/%d | %s", step, self.total_steps, line)

  def _flush(self) -> None:
    """Writes the object store's ``metrics.jsonl`` whole (a failure is warned about and retried at the next
    record)."""
    try:
      self.path.write_text(self.text)
    except Exception as e:  # noqa: BLE001 - each store's client raises its own
      if not self.unwritten:
        logging.warning("could not write %s (%s); the next record tries again", self.path, e)
      self.unwritten = True
    else:
      self.unwritten = False

  def close(self) -> None:
    if self.text is not None and self.unwritten:
      self._flush()
    if self.bar is not None:
      self.bar.close()
    if self.tb is not None:
      self.tb.close()
    if self.wandb is not None:
      self.wandb.finish()


"""The GPU checks of tests/test_gpu.py, in a process that sees the GPU (the test process is CPU-only): prints one
JSON line.

- ``cases``: the cudnn backend (bf16) against the float32 reference on the same bf16 inputs, outputs and the
  gradients of q, k and v, on packed rows with grouped-query heads: documents of several lengths, a document
  continued from the row before (positions not starting at 0), padding, a length that is not a multiple of the
  kernel's tiles, a sliding window, and a row of more documents than cuDNN's packed layout is given (the blockwise
  fallback). The xla backend in bf16 beside it, for the scale of bf16's own error. For the fallback case also
  cuDNN's packed call without the fallback, which must be wrong there (else the case tests nothing).
- ``auto``: what ``model.attention=auto`` chooses here for bf16 and float32.
- ``losses``: a 2-layer Llama in bf16, 4 train steps with cudnn and with xla on the same batches.
- ``families``: configs/tiny_family.py's DeepSeek-V3 (multi-head latent attention: its padded head dims and explicit
  softmax scale) with cudnn and with xla, and GPT-OSS (attention sinks, which no kernel has) with blockwise (sinks
  rescaled from its log-sum-exp) and with xla (written out), 4 bf16 train steps each on the same batches, and the
  backend ``auto`` chooses for each.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain.models import attention  # noqa: E402
from tests.test_attention import _loader_rows  # noqa: E402  (rows as the loader packs them)


def errors(fn, q, k, v, seg, pos, variant, reference):
  """Max |x - ref| / max |ref| of the output and of each gradient (of sum(out * w))."""
  w = jax.random.normal(jax.random.key(7), q.shape, jnp.float32)

  def loss(f):
    return lambda q, k, v: (f(q, k, v, seg, pos, variant).astype(jnp.float32) * w).sum()

  out = jax.jit(lambda q, k, v: fn(q, k, v, seg, pos, variant))(q, k, v)
  grads = jax.jit(jax.grad(loss(fn), (0, 1, 2)))(q, k, v)
  ref_grads = jax.grad(loss(reference), (0, 1, 2))(q, k, v)
  ref_out = reference(q, k, v, seg, pos, variant)
  rel = lambda x, r: float(jnp.abs(x.astype(jnp.float32) - r.astype(jnp.float32)).max() / jnp.abs(r).max())  # noqa: E731
  return {"out": rel(out, ref_out), **{f"d{n}": rel(g, r) for n, g, r in zip("qkv", grads, ref_grads)}}


def backend(name):
  return lambda q, k, v, seg, pos, variant: attention.attend(name, q, k, v, seg, pos, variant=variant)


def reference(q, k, v, seg, pos, variant):
  return attention.reference(q, k, v, seg, pos, variant=variant)


def no_fallback(q, k, v, seg, pos, variant):
  return attention._cudnn_packed(q, k, v, seg, variant, attention.CUDNN_MAX_SEGMENTS)


def cases() -> list[dict]:
  many = attention.CUDNN_MAX_SEGMENTS + 8
  specs = [  # name, length, documents per row, first positions, window
      ("packed", 1024, [[300, 500, 124], [1024]], [0, 200], 0),
      ("length 1000", 1000, [[337, 600], [999]], [0, 5], 0),
      ("window 128", 1024, [[700, 300], [1024]], [0, 0], 128),
      (f"{many} documents in a row", 1024, [[1024 // many] * many, [512, 512]], [0, 0], 0),
  ]
  out = []
  for name, length, docs, first, window in specs:
    seg, pos = _loader_rows(length, docs, first)
    keys = jax.random.split(jax.random.key(len(out)), 3)
    q = jax.random.normal(keys[0], (2, length, 8, 64), jnp.bfloat16)
    k, v = (jax.random.normal(x, (2, length, 2, 64), jnp.bfloat16) for x in keys[1:])
    variant = attention.Variant(window=window)
    row = {"case": name}
    for label, fn in (("cudnn", backend("cudnn")), ("xla", backend("xla"))):
      row[label] = errors(fn, q, k, v, seg, pos, variant, reference)
    if len(docs[0]) > attention.CUDNN_MAX_SEGMENTS:
      row["cudnn without the fallback"] = errors(no_fallback, q, k, v, seg, pos, variant, reference)
    out.append(row)
  return out


def _train(c, steps: int = 4) -> list[float]:
  """``steps`` losses of config ``c`` on synthetic batches (the same for every backend)."""
  from jaxtrain import data as data_lib
  from jaxtrain.config import validate_values
  from jaxtrain.data.synthetic import SyntheticSource
  from jaxtrain.train import trainer
  c.workdir = "/tmp/gpu_worker"
  c.data.source = "synthetic"
  c.mesh.update(data=1, fsdp=1, tensor=1)
  validate_values(c)
  run = trainer.build(c)
  step, state = trainer.compile_step(run), trainer.init_state(run)
  source = SyntheticSource(c.data.seq_len, c.model.vocab_size, c.train.global_batch_size, 0)
  values = []
  for _ in range(steps):
    state, metrics = step(state, data_lib.to_global(next(source), run.batch_sharding), np.bool_(False))
    values.append(float(metrics["loss"]))
  return values


def losses(backends=("cudnn", "xla")) -> dict:
  from jaxtrain.config import base_config
  result = {}
  for name in backends:
    c = base_config()
    c.model.update(num_layers=2, d_model=256, num_heads=8, num_kv_heads=4, head_dim=32, mlp_dim=512,
                   vocab_size=512, dtype="bfloat16", attention=name)
    c.data.seq_len = 512
    c.train.global_batch_size = 4
    c.optim.update(lr=3e-3, warmup_steps=1)
    result[name] = _train(c)
  return result


def families() -> dict:
  from jaxtrain.config import load_file
  result = {}
  for family, backends in (("deepseek_v3", ("cudnn", "xla")), ("gpt_oss", ("blockwise", "xla"))):
    row = {}
    for name in backends:
      c = load_file(f"configs/tiny_family.py:{family}", [f"model.attention={name}", "model.dtype=bfloat16",
                                                          "train.global_batch_size=4", "optim.warmup_steps=1"])
      if name == "xla":
        row["auto is"] = attention.choose(jax.default_backend(), c.data.seq_len, dtype=c.model.dtype,
                                          sinks=bool(c.model.get("attention_sinks")))
      row[name] = _train(c)
    result[family] = row
  return result


def main():
  auto = {dtype: attention.choose(jax.default_backend(), 8192, dtype=dtype) for dtype in ("bfloat16", "float32")}
  print(json.dumps({"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "auto": auto, "cases": cases(), "losses": losses(), "families": families()}))


if __name__ == "__main__":
  main()

"""On a GPU (skipped, with the reason printed, where there is none): the cudnn attention backend equals the float32
reference on packed rows, ``auto`` chooses it, and a model trains with it as with xla. tests/gpu_worker.py runs the
checks in a process that sees the GPU (this one is CPU-only: conftest.py)."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = 2e-2  # bf16 inputs and outputs: their own rounding is 2^-8 relative; xla in bf16 lands at ~1e-2 here


@pytest.fixture(scope="module")
def gpu():
  if not glob.glob("/dev/nvidia[0-9]*"):
    pytest.skip("no NVIDIA GPU on this machine: the cudnn backend's checks run where one is")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu_worker.py")], env=env, capture_output=True,
                     text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  result = json.loads(r.stdout.strip().splitlines()[-1])
  if result["backend"] != "gpu":
    pytest.skip(f"jax sees no GPU here (its backend is {result['backend']}): install jaxtrain[cuda]")
  print(json.dumps(result, indent=1))
  return result


def test_cudnn_equals_the_reference_on_packed_rows(gpu):
  for case in gpu["cases"]:
    for what, error in case["cudnn"].items():
      assert error < BF16, (case["case"], what, error, case["xla"][what])


def test_more_documents_than_cudnn_is_given_fall_back_and_stay_exact(gpu):
  [case] = [c for c in gpu["cases"] if "cudnn without the fallback" in c]
  assert max(case["cudnn"].values()) < BF16
  # Without the fallback the documents past the 32nd are attended across: the case needs the fallback.
  assert case["cudnn without the fallback"]["out"] > 0.1


def test_auto_chooses_cudnn_in_16_bits(gpu):
  hopper = any(k in gpu["device"] for k in ("H100", "H200", "H20", "B200", "GH200"))
  assert gpu["auto"] == {"bfloat16": "cudnn" if hopper else "blockwise", "float32": "blockwise"}


def test_a_model_trains_with_cudnn_as_with_xla(gpu):
  cudnn, xla = gpu["losses"]["cudnn"], gpu["losses"]["xla"]
  assert cudnn[-1] < cudnn[0] - 0.03  # it learns (xla on CPU: 6.278 -> 6.228)
  for a, b in zip(cudnn, xla):
    assert a == pytest.approx(b, rel=1e-3)  # measured on an H200: 2.4e-5 at most


def test_latent_attention_trains_with_cudnn_as_with_xla(gpu):
  """DeepSeek-V3's multi-head latent attention (head dims padded to one width, an explicit softmax scale) through the
  cuDNN kernel."""
  row = gpu["families"]["deepseek_v3"]
  for a, b in zip(row["cudnn"], row["xla"]):
    assert a == pytest.approx(b, rel=1e-3)


def test_attention_sinks_train_with_blockwise_as_with_xla_and_auto_takes_no_kernel(gpu):
  """GPT-OSS's sinks: blockwise's rescaling from its log-sum-exp trains as xla's written-out softmax does, and
  ``auto`` takes no kernel (none has sinks)."""
  row = gpu["families"]["gpt_oss"]
  assert row["auto is"] in ("xla", "blockwise")
  for a, b in zip(row["blockwise"], row["xla"]):
    assert a == pytest.approx(b, rel=1e-3)

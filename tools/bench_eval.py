"""Harness benchmark: loglikelihood requests per second through jaxtrain's harness model on the CPU mesh against the
lm-evaluation-harness's own ``hf`` model (transformers, PyTorch) on the same CPU, on the same model.

  python tools/bench_eval.py [--requests=96] [--batch_size=16] [--d_model=512] [--layers=8] [--vocab=32000]
      [--reps=2] [--out=benchmarks/results/eval_cpu.json]

A random Llama (transformers) with a small byte-level BPE tokenizer is saved as a Hugging Face folder and imported
(tools/convert_hf.py's import); ``--requests`` (context, continuation) pairs of 40 to 200 tokens (random words of the
tokenizer's corpus, 3 continuations per context, as a multiple-choice task asks) go to both models'
``loglikelihood`` (the harness's tokenization, batching and scoring; float32 both). Each is warmed up once on
all the requests (jaxtrain compiles its row lengths there: reported as ``compile_s``), then timed ``--reps`` times
(median), the two models' passes in turn. Also checked: the two models' log-likelihoods agree (``max_abs_diff``).
The devices are 8 simulated CPU devices unless XLA_FLAGS says otherwise (``--xla_force_host_platform_device_count=1``:
the CPU as one device).
"""

from __future__ import annotations

import _bench  # tools/ is on sys.path when a script runs

_bench.setup()

import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

_REQUESTS = flags.DEFINE_integer("requests", 96, "Loglikelihood requests.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Rows per batch (both models).")
_D_MODEL = flags.DEFINE_integer("d_model", 512, "Hidden size of the random Llama.")
_LAYERS = flags.DEFINE_integer("layers", 8, "Layers of the random Llama.")
_VOCAB = flags.DEFINE_integer("vocab", 32000, "Vocabulary (logits) of the random Llama.")
_REPS = flags.DEFINE_integer("reps", 2, "Timed passes over the requests (median).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/eval_cpu.json", "Where to write the JSON results.")


def build(folder: str):
  import torch
  import transformers
  from tests import harness_data
  d = _D_MODEL.value
  config = transformers.LlamaConfig(vocab_size=_VOCAB.value, hidden_size=d, intermediate_size=3 * d,
                                    num_hidden_layers=_LAYERS.value, num_attention_heads=d // 64,
                                    num_key_value_heads=max(1, d // 128), max_position_embeddings=512,
                                    bos_token_id=0, eos_token_id=1)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
  tok, tok_config = harness_data.bpe_tokenizer()
  tok.save(os.path.join(folder, "tokenizer.json"))
  tok_config["model_max_length"] = 512
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    import json
    json.dump(tok_config, f)


def requests(n: int):
  from lm_eval.api.instance import Instance
  from tests import harness_data
  words = " ".join(harness_data.SENTENCES).split()
  rng = np.random.default_rng(0)
  out = []
  while len(out) < n:
    context = " ".join(rng.choice(words, int(rng.integers(30, 150))))
    for _ in range(3):
      out.append(Instance("loglikelihood", {}, (context, " " + " ".join(rng.choice(words, int(rng.integers(3, 30))))),
                          len(out)))
  return out[:n]


def timed(lms: dict, reqs) -> dict:
  """name -> (median seconds of a pass, the first pass's results, the first pass's seconds): every model warmed up
  once, then the timed passes taken in turn (A B A B: a shared host's load falls on both alike)."""
  first, warm, times = {}, {}, {name: [] for name in lms}
  for name, lm in lms.items():
    t = time.perf_counter()
    first[name] = lm.loglikelihood(reqs, disable_tqdm=True)  # warm-up (jaxtrain: its compiles)
    warm[name] = time.perf_counter() - t
  for _ in range(_REPS.value):
    for name, lm in lms.items():
      t = time.perf_counter()
      lm.loglikelihood(reqs, disable_tqdm=True)
      times[name].append(time.perf_counter() - t)
  return {name: (statistics.median(times[name]), first[name], warm[name]) for name in lms}


def main(argv):
  del argv
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  import torch
  from lm_eval.models.huggingface import HFLM
  from jaxtrain import hf
  import jaxtrain.evaluate as evaluate_lib
  work = tempfile.mkdtemp(prefix="bench_eval_")
  build(os.path.join(work, "src"))
  hf.import_model(os.path.join(work, "src"), os.path.join(work, "out"))
  reqs = requests(_REQUESTS.value)
  ours_lm = evaluate_lib.CheckpointLM(os.path.join(work, "out"), batch_size=_BATCH.value)
  tokens = sum(len(ours_lm.tok_encode(r.args[0] + r.args[1])) for r in reqs)
  ref_lm = HFLM(pretrained=os.path.join(work, "src"), dtype="float32", batch_size=_BATCH.value, device="cpu")
  measured = timed({"jaxtrain": ours_lm, "hf": ref_lm}, reqs)
  (ours_s, ours_out, ours_warm), (ref_s, ref_out, _) = measured["jaxtrain"], measured["hf"]
  diff = max(abs(a[0] - b[0]) for a, b in zip(ours_out, ref_out))
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ours_lm.model.abstract_params))
  row = {"requests": len(reqs), "tokens": tokens, "batch_size": _BATCH.value, "params": params,
         "mesh": dict(ours_lm.mesh.shape), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
         "jaxtrain": {"seconds": ours_s, "requests_per_s": len(reqs) / ours_s, "tokens_per_s": tokens / ours_s,
                      "first_pass_s": ours_warm, "compiles": ours_lm.compiles,
                      "compile_s": ours_lm.scorer.compile_s, "row_lengths": list(ours_lm.scorer.lengths)},
         "hf": {"seconds": ref_s, "requests_per_s": len(reqs) / ref_s, "tokens_per_s": tokens / ref_s},
         "ratio": ref_s / ours_s, "max_abs_diff": diff}
  print(f"{'model':<10} {'params':>10} {'mesh':<28} {'requests/s':>11} {'tokens/s':>10} {'compile s':>10}")
  print(f"{'jaxtrain':<10} {params:>10,} {str(row['mesh']):<28} {row['jaxtrain']['requests_per_s']:>11.1f} "
        f"{row['jaxtrain']['tokens_per_s']:>10.0f} {row['jaxtrain']['compile_s']:>10.1f}")
  print(f"{'hf':<10} {params:>10,} {'torch, ' + str(row['torch_threads']) + ' threads':<28} "
        f"{row['hf']['requests_per_s']:>11.1f} {row['hf']['tokens_per_s']:>10.0f} {'-':>10}")
  print(f"jaxtrain / hf: {row['ratio']:.2f}x requests/s; max |log-likelihood difference| {diff:.2e}; "
        f"{ours_lm.compiles} programs compiled")
  print("wrote", _bench.write_json(_OUT.value, row))


if __name__ == "__main__":
  app.run(main)

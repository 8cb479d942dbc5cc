"""The commands of README.md and docs/*.md, run as a new user types them.

Each command is parsed from the pages (tests/readme.py), never copied here, and run with ``bash -c`` in a fresh
copy of the repository as the current folder, with a fresh ``HOME``, none of the test suite's ``XLA_FLAGS`` /
``JAX_*`` settings and the configs' default (relative) workdirs. The only changes: ``--config.train.steps=N``
appended to training commands, to keep them short (2 steps where the test checks that a command trains, not its
losses), a smaller batch (SMALLER_BATCH: fewer, shorter rows; DPO's pairs prepared and trained at 128 tokens
instead of 512) appended to the training commands whose test checks what the command does rather than its losses,
and, for every command after the quick start, XLA's quick CPU compile and one thread per op (``XLA_FLAGS`` =
tests/xla_flags.py's FAST_COMPILE, optimization level 0, and ONE_THREAD_PER_OP; added to the value of a command that
sets ``XLA_FLAGS`` itself): they change how much CPU time XLA takes to compile and run a command's program, not
what the command does. The quick start runs exactly as typed, and its
losses are checked to all digits. ``pip install`` runs too, in a new virtualenv that sees the
already installed dependencies (a ``.pth`` file), so the editable install of the copy is real and the test
environment's own install is left alone.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import site
import subprocess
import sys
import time
import sysconfig

import numpy as np
import pytest

from tests import readme
from tests.xla_flags import FAST_COMPILE, ONE_THREAD_PER_OP

QUICK = f"{FAST_COMPILE} {ONE_THREAD_PER_OP}"

pytestmark = pytest.mark.slow  # every command of the docs, from a fresh install

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The commands this module runs (a unique part of each): the README's, then the docs pages'.
QUICK_START, TEST_COMMAND = readme.quick_start()
TRAIN_LONGER = "--config.train.steps=300"
INSPECT = "tools/inspect_checkpoint.py"
PLOT = "tools/plot_metrics.py"
TP = "configs/tiny.py:tp"
DRY_RUN = "configs/llama3_8b.py --config.dry_run=true"
ONE_F_ONE_B = "--config.workdir=runs/1f1b"
CIRCULAR = "--config.workdir=runs/circular"
MOE = "configs/moe_tiny.py --config.mesh.expert=4"
CONTEXT = "--config.mesh.context=4"
PREPARE = "--input=my_texts --output=data/my_texts"
TRAIN_PREPARED = "--config.data.path=data/my_texts"
PREPARE_BEAM = "--runner=FnApiRunner"
TRAIN_RAW = "--config.data.source=raw --config.data.path=my_texts"
MIX_PREPARE_WEB = "--output=data/web"
MIX_PREPARE_CODE = "--output=data/code"
MIX_TRAIN = "--config.workdir=runs/mixture"
PREPARE_SFT = "--output=data/chats"
TRAIN_SFT = "--config.data.path=data/chats"
GENERATE = "--checkpoint=runs/tiny --prompt="
GENERATE_SLOTS = "--checkpoint=runs/tiny --prompts_file=prompts.txt --slots="  # continuous batching
HF_IMPORT = "import --hf=hf/my-llama"
HF_PREPARE = "--tokenizer=imported/my-llama/hf"
HF_TRAIN = "--config.data.path=data/llama_chats --config.model.lora.rank=8"
# docs/recipes/lora_tpu_pod.md's rehearsal of a pod run
HF_POD_CONFIG = "mkdir -p configs/imported"  # the recipe's copy of the import's config.py for the workers
HF_REHEARSAL = "--config=imported/my-llama/config.py --config.data.path=data/llama_chats --config.model.lora.rank=16"
ATTENTION_AUTO = "--config.data.seq_len=4096 --config.dry_run=true 2>&1 | grep model.attention=auto"
ATTENTION_BLOCKWISE = "--config.workdir=runs/tiny_blockwise"
ESTIMATE_70B = "tools/estimate.py --config=configs/llama3_70b.py --devices=256"
RESTART_BUDGET = "--config_value=distributed.max_restarts_per_hour"
FLOAT16 = "--config.optim.loss_scale=dynamic"
HF_GENERATE = "--checkpoint=runs/my-llama --prompt"
HF_EXPORT = "export --checkpoint=runs/my-llama"
GRPO_DATA = "tools/arithmetic_prompts.py"
GRPO_SFT = "--config.workdir=runs/arithmetic_sft"
GRPO_TRAIN = "configs/grpo_math.py"
DPO_IMPORT = "import --hf=hf/instruct-llama"
DPO_PREPARE = "--output=data/prefs"
DPO_TRAIN = "--config.train.objective=dpo --config.data.path=data/prefs"
LOCAL = "tools/launch/local.sh configs/tiny.py runs/long"
GOODPUT = "tools/goodput.py runs/long"
EVAL_RUN = "--tasks=shakespeare_mc,shakespeare_ppl"
EVAL_IMPORT = "--checkpoint imported/my-llama"
EVAL_EVERY_SAVE = "--step=$step"
EVAL_IN_RUN = "--config.workdir=runs/tiny_harness"
# Appended (with --config.train.steps) to the training commands whose test checks what the command does (it trains on
# that data, that mesh, that dtype; the launcher's stop, restart and account; the harness inside a run), not its
# losses: a quarter of the tokens a step.
SMALLER_BATCH = "--config.train.global_batch_size=8 --config.data.seq_len=64"
SHORT = f"--config.train.steps=2 {SMALLER_BATCH}"  # two steps: the second one has a learning rate above 0
# Run as written by another test file, which reads them from the page (tests/readme.py) and checks what they do:
# not a second time here.
RUN_ELSEWHERE = {
    "tools/letter_prompts.py": "tests/test_grpo.py (the letters fixture)",
    "configs/grpo_letters.py:sft": "tests/test_grpo.py (the letters fixture)",
    "configs/grpo_letters.py:grpo": "tests/test_grpo.py::test_grpo_raises_the_held_out_reward (100 steps: the "
                                    "held-out reward rises by >= 0.3)",
}
# Shown but not runnable here, with the reason.
NOT_RUN = {
    TEST_COMMAND: "the test command itself: .ci/run runs it, read from the README "
                  "(test_ci_runs_the_readme_test_command)",
    "--config.workdir=gs://bucket/run1": "needs a Cloud Storage bucket and the memory of an 8B model",
    "--runner=DataflowRunner": "needs a Google Cloud project and bucket",
    "dask scheduler --port=8786": "starts a Dask scheduler that would outlive the test (tests/test_prepare_cluster.py "
                                  "starts one, and two workers, on a free port and stops them)",
    "dask worker tcp://SCHEDULER": "needs the Dask scheduler above (tests/test_prepare_cluster.py starts workers)",
    "--runner=DaskRunner": "needs a Dask scheduler at SCHEDULER and storage its workers share (tests/"
                           "test_prepare_cluster.py runs this command on a scheduler and two workers it starts)",
    "--runner=FlinkRunner": "needs a Flink cluster and a container image with jaxtrain",
    "--runner=SparkRunner": "needs a Spark cluster and a container image with jaxtrain",
    "gcloud storage cp -r imported/my-llama": "needs a Cloud Storage bucket",
    "gcloud storage cp -r data/llama_chats": "needs a Cloud Storage bucket",
    "gcloud compute tpus tpu-vm scp": "needs a TPU VM slice",
    "tools/launch/tpu_vm.sh": "needs a TPU VM slice, gcloud and a bucket (its flags: tests/test_docs.py)",
    "export --checkpoint=gs://": "needs a Cloud Storage bucket holding a run",
    "v5p:4x4x4 --config.dry_run=true 2>&1": "needs libtpu and minutes of TPU compiles of Llama 3 8B "
                                                "(tests/test_tpu_compile.py compiles that path for a small model)",
    "--config.dry_run_topology=v6e:16x16": "needs libtpu and many minutes of TPU compiles of Llama 3 70B "
                                           "(tests/test_tpu_compile.py compiles that path for a small model)",
    "configs/llama3_8b.py:v5p --config.dry_run=true":
        "needs libtpu and minutes of TPU compiles of Llama 3 8B (tests/test_tpu_compile.py compiles that path for a "
        "small model)",
    "sbatch --nodes=4": "needs a Slurm cluster (tests/test_distributed.py runs the script with stand-in srun)",
    "sacct -j": "needs a Slurm cluster",
    "tail -n 3 /shared/runs": "reads a Slurm job's workdir",
    "tools/goodput.py /shared/runs": "reads a Slurm job's workdir (tools/goodput.py runs on runs/long here)",
    "--tasks=hellaswag,arc_easy": "needs the Hugging Face hub (the harness's datasets)",
    "tools/fault_drill.py --steps=300": "minutes of real runs (eleven starts of a 300-step run through ten faults); "
                                        "tests/test_faults.py raises every fault of the matrix, and the drill's "
                                        "figures are benchmarks/results/fault_drill.json",
}


def test_every_readme_command_is_run_by_a_test():
  """A command added to the README or a docs page without a test here (or one a test no longer finds) fails."""
  parts = (TRAIN_LONGER, INSPECT, PLOT, TP, DRY_RUN, ONE_F_ONE_B, CIRCULAR, MOE, CONTEXT, PREPARE, TRAIN_PREPARED,
           PREPARE_BEAM, TRAIN_RAW, MIX_PREPARE_WEB, MIX_PREPARE_CODE, MIX_TRAIN, PREPARE_SFT, TRAIN_SFT, GENERATE,
           GENERATE_SLOTS, HF_IMPORT, HF_PREPARE, HF_TRAIN, HF_GENERATE, HF_EXPORT, HF_POD_CONFIG, LOCAL, GOODPUT, HF_REHEARSAL,
           ATTENTION_AUTO,
           ATTENTION_BLOCKWISE, ESTIMATE_70B, RESTART_BUDGET, FLOAT16, GRPO_DATA, GRPO_SFT,
           GRPO_TRAIN, DPO_IMPORT, DPO_PREPARE, DPO_TRAIN, EVAL_RUN, EVAL_IMPORT,
           EVAL_EVERY_SAVE, EVAL_IN_RUN)
  run = [QUICK_START] + [readme.command(part) for part in parts]
  not_run = [readme.command(part) for part in NOT_RUN]
  elsewhere = [readme.command(part) for part in RUN_ELSEWHERE]
  assert sorted(run + not_run + elsewhere) == sorted(readme.commands())
  for command, where in zip(elsewhere, RUN_ELSEWHERE.values()):
    assert (ROOT / where.split(" ")[0].split("::")[0]).is_file(), where
    print(f"run by {where}: {command}")
  for command, why in zip(not_run, NOT_RUN.values()):  # shown, with the reason it is not run here
    assert why.strip(), command
    print(f"not run here: {command}\n  why: {why}")


def test_ci_runs_the_readme_test_command():
  result = subprocess.run([sys.executable, str(ROOT / "tests" / "readme.py"), "test-command"], capture_output=True,
                          text=True, check=True)
  assert result.stdout.strip() == TEST_COMMAND == "pip install -e '.[test]' && python -m pytest -q tests"
  ci = (ROOT / ".ci" / "run").read_text()
  assert 'command="$(python3 tests/readme.py test-command)"' in ci and 'bash -c "$command"' in ci


class NewUser:
  """A fresh copy of the repository, a fresh HOME and a new virtualenv; runs shell commands there."""

  def __init__(self, base: pathlib.Path):
    self.repo, self.home, venv = base / "jaxtrain", base / "home", base / "venv"
    self.home.mkdir()
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
      if (ROOT / name).is_file():
        (self.repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, self.repo / name)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    # The new venv sees the packages installed for the tests, so `pip install` finds its dependencies there.
    outer = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
    pathlib.Path(purelib, "_test_environment.pth").write_text("\n".join(dict.fromkeys(outer)) + "\n")
    self.exact_env = {"HOME": str(self.home), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
                      "LANG": "C.UTF-8", "TMPDIR": os.environ.get("TMPDIR", "/tmp")}
    self.env = {**self.exact_env, "XLA_FLAGS": QUICK}

  def run(self, command: str, *extra: str, timeout: float = 600, exact: bool = False) -> subprocess.CompletedProcess:
    """``exact``: with no XLA_FLAGS at all, as the user typed it. Otherwise XLA_FLAGS is QUICK, also where the
    command sets XLA_FLAGS itself (the simulated devices): QUICK is added to its value."""
    if not exact:
      command = re.sub(r"\bXLA_FLAGS=(\S+)", lambda m: f"XLA_FLAGS='{m.group(1)} {QUICK}'", command)
    result = subprocess.run(["bash", "-c", " ".join([command, *extra])], cwd=self.repo,
                            env=self.exact_env if exact else self.env, capture_output=True, text=True,
                            timeout=timeout)
    result.command = command
    return result

  def records(self, workdir: str) -> list[dict]:
    return [json.loads(line) for line in (self.repo / workdir / "metrics.jsonl").read_text().splitlines()]

  def committed(self, workdir: str) -> list[int]:
    return sorted(int(p.name) for p in (self.repo / workdir / "checkpoints").iterdir() if p.name.isdigit())


def _ok(result: subprocess.CompletedProcess) -> str:
  assert result.returncode == 0, f"{result.command}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
  return result.stderr


@pytest.fixture(scope="module")
def user(tmp_path_factory):
  """The first quick-start command has run, shortened to 12 steps."""
  u = NewUser(tmp_path_factory.mktemp("new_user"))
  u.first = u.run(QUICK_START, "--config.train.steps=12", exact=True)
  return u


def test_quick_start_trains_checkpoints_and_summarizes(user):
  err = _ok(user.first)
  assert "optim.warmup_steps=20 is longer than the 12-step schedule" in err  # clipped, not refused
  # That is the one warning a user sees (absl's W and E lines: jaxtrain's and its libraries' logs).
  warned = [line for line in err.splitlines() if re.match(r"[WE]\d{4} ", line)]
  assert len(warned) == 1 and "optim.warmup_steps=20" in warned[0], warned
  assert user.committed("runs/tiny") == [12]
  assert [r["step"] for r in user.records("runs/tiny")] == [10, 12]
  # Recorded on jax 0.10.2 and 0.12.0 (equal to all digits); CPU runs are deterministic, so any change to the
  # model, data order, optimizer or schedule moves these.
  np.testing.assert_allclose([r["loss"] for r in user.records("runs/tiny")], [4.0628485679626465, 3.6878035068511963],
                             rtol=1e-5)
  resolved = json.loads((user.repo / "runs/tiny/config.json").read_text())
  workdir = user.repo / "runs" / "tiny"
  assert resolved["workdir"] == str(workdir) and resolved["checkpoint"]["dir"] == str(workdir / "checkpoints")
  assert resolved["data"]["cache_dir"] == str(user.home / ".cache" / "jaxtrain")
  assert (user.home / ".cache" / "jaxtrain").is_dir()  # the bundled corpus, prepared under the fresh HOME
  summary = [line for line in err.splitlines() if "] done: step 12/12, loss " in line]
  assert len(summary) == 1, err[-3000:]
  loss = user.records("runs/tiny")[-1]["loss"]
  assert f"loss {loss:.4f}," in summary[0] and f"checkpoint {workdir / 'checkpoints' / '12'}," in summary[0]
  assert f"plot: python tools/plot_metrics.py {workdir} --out={workdir / 'metrics.png'}" in summary[0]
  assert "train.log" in os.listdir(workdir) and "run.lock" not in os.listdir(workdir)
  assert "done: step 12/12" in (workdir / "train.log").read_text()


def test_same_command_again_says_it_is_done_without_compiling(user):
  err = _ok(user.run(QUICK_START, "--config.train.steps=12"))
  assert "runs/tiny is already at step 12 (train.steps=12): nothing to train" in err
  assert "--config.train.steps=N for some N > 12" in err
  assert "compiled" not in err and user.committed("runs/tiny") == [12]


def test_train_longer_resumes(user):
  command = readme.command(TRAIN_LONGER)
  err = _ok(user.run(command, "--config.train.steps=14"))  # appended: the last value wins
  assert "resumed from checkpoint step 12" in err and "done: step 14/14" in err
  assert [r["step"] for r in user.records("runs/tiny")] == [10, 12, 14]
  assert user.committed("runs/tiny") == [12, 14]


def test_inspect_checkpoint(user):
  out = _ok_out(user.run(readme.command(INSPECT)))
  assert f"{user.repo / 'runs/tiny/checkpoints'}: steps 12" in out
  assert "params/embed/embedding" in out and "total" in out and "fingerprints=39 arrays" in out


def test_plot(user):
  out = _ok_out(user.run(readme.command(PLOT)))
  png = user.repo / "runs" / "tiny" / "metrics.png"
  assert "wrote runs/tiny/metrics.png" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _ok_out(result):
  _ok(result)
  return result.stdout


def test_tensor_parallel_variant_on_simulated_devices(user):
  err = _ok(user.run(readme.command(TP), SHORT))
  assert "on 8 cpu devices" in err and "'fsdp': 4, 'expert': 1, 'context': 1, 'tensor': 2" in err
  assert user.committed("runs/tiny_tp") == [2]


def test_dry_run(user):
  result = user.run(readme.command(DRY_RUN))
  _ok(result)
  info = json.loads(result.stdout.strip().splitlines()[-1])
  assert info["params"] == 8_030_261_248 and info["flops_per_token"] == 57_914_449_920
  assert not (user.repo / "runs" / "llama3_8b").exists()  # a dry run writes nothing


@pytest.mark.parametrize("part,stages,shorter", [
    (ONE_F_ONE_B, "2 stages, 1F1B, 4 microbatches, 2 layers per stage -> bubble 20.0% ((S-1)/(R*M+S-1)), at most "
                  "3 microbatch activations in flight per stage", "--config.train.steps=2 --config.data.seq_len=64"),
    # 8 microbatches of 2 rows (mesh.fsdp=2): the batch stays 16
    (CIRCULAR, "2 stages, circular x 2 repeats, 8 microbatches, 2 layers per stage -> bubble 5.9%",
     "--config.train.steps=2 --config.data.seq_len=64")])
def test_pipeline_commands(user, part, stages, shorter):
  err = _ok(user.run(readme.command(part), shorter))
  assert f"pipeline: {stages}" in err
  assert user.committed(part.split("=")[1]) == [2]


def test_mixture_of_experts_command(user):
  err = _ok(user.run(readme.command(MOE), SHORT))
  assert "'fsdp': 2, 'expert': 4, 'context': 1, 'tensor': 1" in err and "2,626,688 parameters" in err
  assert user.committed("runs/moe_tiny") == [2]


def test_context_parallel_command(user):
  err = _ok(user.run(readme.command(CONTEXT), SHORT))
  assert "'fsdp': 2, 'expert': 1, 'context': 4, 'tensor': 1" in err
  assert user.committed("runs/tiny_context") == [2] and "done: step 2/2" in err


def test_prepare_data_and_train_on_it(user):
  docs = (user.repo / "jaxtrain/data/corpus/tinyshakespeare.txt").read_text().split("\n\n")[:400]
  (user.repo / "my_texts").mkdir()
  (user.repo / "my_texts" / "a.txt").write_text("\n\n".join(docs[:200]))
  (user.repo / "my_texts" / "b.txt").write_text("\n\n".join(docs[200:]))
  out = _ok_out(user.run(readme.command(PREPARE)))
  manifest = json.loads((user.repo / "data" / "my_texts" / "manifest.json").read_text())
  assert out.strip().endswith("-> data/my_texts") and manifest["documents"] + manifest["duplicates_removed"] == 400
  err = _ok(user.run(readme.command(TRAIN_PREPARED), SHORT))
  resolved = json.loads((user.repo / "runs/my_texts/config.json").read_text())
  assert resolved["data"]["path"] == str(user.repo / "data" / "my_texts")
  assert user.committed("runs/my_texts") == [2] and "done: step 2/2" in err
  _ok_out(user.run(readme.command(PREPARE_BEAM)))  # the same preparation on Apache Beam: the same bytes
  beam, local = user.repo / "data" / "beam_texts", user.repo / "data" / "my_texts"
  assert {p.name: p.read_bytes() for p in beam.iterdir()} == {p.name: p.read_bytes() for p in local.iterdir()}
  err = _ok(user.run(readme.command(TRAIN_RAW), SHORT))  # the raw files, streamed
  assert user.committed("runs/raw") == [2] and "done: step 2/2" in err


def test_mixture_commands(user):
  """docs/data.md's mixture: two prepared folders and raw text files, weighted, with an eval set."""
  docs = [d for d in (user.repo / "jaxtrain/data/corpus/tinyshakespeare.txt").read_text().split("\n\n") if d.strip()]
  for name, part in (("web_texts", docs[:600]), ("code_texts", docs[600:1000]), ("book_texts", docs[1000:1200]),
                     ("letter_texts", docs[1200:1300])):
    (user.repo / name).mkdir()
    (user.repo / name / "a.txt").write_text("\n\n".join(part) + "\n")
  for command, name in ((MIX_PREPARE_WEB, "web"), (MIX_PREPARE_CODE, "code")):
    assert _ok_out(user.run(readme.command(command))).strip().endswith(f"-> data/{name}")
  err = _ok(user.run(readme.command(MIX_TRAIN), SHORT, "--config.train.log_every=1", "--config.eval.every_steps=1"))
  assert user.committed("runs/mixture") == [2] and "done: step 2/2" in err
  records = user.records("runs/mixture")
  train = [r for r in records if "loss" in r]
  evals = [r for r in records if "eval_loss" in r]
  assert all(abs(sum(r[f"mix/{n}"] for n in ("web", "code", "books")) - 1) < 1e-6 for r in train), train
  assert [r["step"] for r in evals] == [1, 2]
  assert {k for k in evals[-1] if k.startswith("eval_loss/")} == {"eval_loss/web", "eval_loss/code",
                                                                   "eval_loss/letters"}  # raw books: no eval split
  resolved = json.loads((user.repo / "runs/mixture/config.json").read_text())
  assert resolved["data"]["mixture"] == (f"books={user.repo / 'book_texts'}:0.1,code={user.repo / 'data/code'}:0.2,"
                                         f"web={user.repo / 'data/web'}:0.7")
  assert resolved["eval"]["sets"] == f"letters={user.repo / 'letter_texts'}"


def _write_chats(path):
  lines = [{"prompt": f"Q{i}: what rhymes with {w}? ", "response": f"A{i}: {w}-ish, perhaps."}
           for i, w in enumerate(["moon", "June", "spoon", "tune", "dune", "rune"] * 20)]
  lines += [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}!"}]}
            for i in range(40)]
  path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_prepare_sft_data_and_train_on_it(user):
  _write_chats(user.repo / "chats.jsonl")
  out = _ok_out(user.run(readme.command(PREPARE_SFT)))
  manifest = json.loads((user.repo / "data" / "chats" / "manifest.json").read_text())
  assert out.strip().endswith("-> data/chats") and manifest["format"] == "jaxtrain.sft.v1"
  assert manifest["documents"] == 160 and 0 < manifest["trained_tokens"] < manifest["tokens"]
  err = _ok(user.run(readme.command(TRAIN_SFT), SHORT))
  assert user.committed("runs/chats") == [2] and "done: step 2/2" in err


def test_generate_from_the_quick_start_run(user):
  result = user.run(readme.command(GENERATE))
  out = _ok_out(result)
  lines = out.splitlines()
  # one line: the 64 bytes that follow the prompt (the byte tokenizer has no EOS), newlines written as \\n
  assert len(lines) == 1 and len(lines[0].replace("\\n", "\n").encode()) >= 60, out
  # Continuous batching (docs/huggingface.md): the same prompt from a file, through slots: the same greedy completion.
  (user.repo / "prompts.txt").write_text("ROMEO:\n")
  again = _ok_out(user.run(readme.command(GENERATE_SLOTS)))
  assert again == out


def test_grpo_on_arithmetic(user):
  """The post-training page's GRPO commands: the problems written, the format fine-tuned, GRPO resumed from it."""
  assert "401 training and 40 held-out problems" in _ok_out(user.run(readme.command(GRPO_DATA)))
  _ok(user.run(readme.command(GRPO_SFT), "--config.train.steps=2", "--config.train.global_batch_size=8"))
  err = _ok(user.run(readme.command(GRPO_TRAIN), "--config.train.steps=2"))
  assert "runs/arithmetic_sft/checkpoints" in err and "done: step 2/2" in err
  last = user.records("runs/grpo_math")
  assert {"rl/reward_mean", "rl/kl", "rl/logp_mismatch", "rl/rollout_s"} <= set(last[-2]) | set(last[-1])
  assert any("eval_reward_mean" in r for r in last)  # the eval at the last step


def test_hugging_face_import_lora_fine_tune_generate_export(user):
  """The README's Hugging Face flow on a small random Llama whose folder has a real (tiny BPE) tokenizer with a
  Llama 3 chat template: every command exits 0, the LoRA run trains only adapters, and the export equals the
  source except the adapted q and v projections."""
  torch = pytest.importorskip("torch", reason="torch (test-only) builds the random Hugging Face Llama")
  transformers = pytest.importorskip("transformers", reason="transformers (test-only) builds and loads the Llama")
  from safetensors.numpy import load_file
  from tests import test_sft
  folder = user.repo / "hf" / "my-llama"
  test_sft._tokenizer_folder(folder, "llama3", test_sft.LLAMA3)
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                    bos_token_id=0, eos_token_id=3)
  transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
  _write_chats(user.repo / "chats.jsonl")
  _ok(user.run(readme.command(HF_IMPORT)))
  assert (user.repo / "imported/my-llama/hf/tokenizer_config.json").exists()
  out = _ok_out(user.run(readme.command(HF_PREPARE)))
  assert json.loads((user.repo / "data/llama_chats/manifest.json").read_text())["sft"]["template"] == "chat_template"
  err = _ok(user.run(readme.command(HF_TRAIN), SHORT))
  assert "LoRA rank 8" in err and "done: step 2/2" in err, err[-3000:]
  assert user.committed("runs/my-llama") == [2]
  # docs/recipes/lora_tpu_pod.md's rehearsal: the pod run's overrides (shorter rows, fewer), compiled here, nothing
  # written.
  _ok(user.run(readme.command(HF_POD_CONFIG)))  # the config the workers get: the import's, without its weights
  assert (user.repo / "configs/imported/my_llama.py").read_text() == (user.repo / "imported/my-llama/config.py"
                                                                       ).read_text()
  rehearsal = user.run(readme.command(HF_REHEARSAL), "--config.data.seq_len=256", "--config.train.global_batch_size=8")
  _ok(rehearsal)
  info = json.loads(rehearsal.stdout.strip().splitlines()[-1])
  assert 0 < info["trainable_params"] < info["params"], info  # the adapters only
  assert user.committed("runs/my-llama") == [2]
  out = _ok_out(user.run(readme.command(HF_GENERATE)))
  assert len(out.splitlines()) == 1
  _ok(user.run(readme.command(HF_EXPORT)))
  source = load_file(folder / "model.safetensors")
  exported = load_file(user.repo / "exported/my-llama/model.safetensors")
  assert sorted(source) == sorted(exported)
  changed = sorted(k for k in source if source[k].tobytes() != exported[k].tobytes())
  assert changed and all(".q_proj." in k or ".v_proj." in k for k in changed), changed


def test_post_training_dpo_with_lora_from_an_imported_llama(user):
  """docs/post_training.md's DPO commands on a small random Llama with a Llama 3 chat template: the pairs are
  rendered with it, and the LoRA run trains with the adapters-off reference from ln 2."""
  torch = pytest.importorskip("torch", reason="torch (test-only) builds the random Hugging Face Llama")
  transformers = pytest.importorskip("transformers", reason="transformers (test-only) builds and loads the Llama")
  from tests import test_sft
  folder = user.repo / "hf" / "instruct-llama"
  test_sft._tokenizer_folder(folder, "llama3", test_sft.LLAMA3)
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                    bos_token_id=0, eos_token_id=3)
  transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
  pairs = [{"prompt": f"Q{i}: what rhymes with {w}?", "chosen": f"{w}-ish, perhaps.", "rejected": "I do not know."}
           for i, w in enumerate(["moon", "June", "spoon", "tune", "dune", "rune"] * 10)]
  (user.repo / "prefs.jsonl").write_text("\n".join(json.dumps(x) for x in pairs) + "\n")
  _ok(user.run(readme.command(DPO_IMPORT)))
  out = _ok_out(user.run(readme.command(DPO_PREPARE), "--seq_len=128"))  # appended: the last value wins
  manifest = json.loads((user.repo / "data/prefs/manifest.json").read_text())
  assert manifest["format"] == "jaxtrain.preference.v1" and manifest["preference"]["template"] == "chat_template"
  assert "preference pairs" in out
  err = _ok(user.run(readme.command(DPO_TRAIN), "--config.train.steps=2", "--config.train.global_batch_size=8",
                     "--config.data.seq_len=128", "--config.train.log_every=1"))
  assert "done: step 2/2" in err, err[-3000:]
  assert user.committed("runs/my-llama-dpo") == [2]
  first = json.loads((user.repo / "runs/my-llama-dpo/metrics.jsonl").read_text().splitlines()[0])
  assert abs(first["loss"] - np.log(2)) < 1e-5 and "rewards/accuracy" in first


def test_local_launcher_starts_a_run_stopped_by_sigterm_again_and_it_resumes(user):
  command = readme.command(LOCAL)
  p = subprocess.Popen(["bash", "-c", f"{command} --config.train.steps=20 --config.train.log_every=5 {SMALLER_BATCH}"],
                       cwd=user.repo, env=user.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  metrics = user.repo / "runs/long/metrics.jsonl"
  deadline = time.monotonic() + 600  # a bound for a loaded machine, not a wait for luck: the event ends it
  while not (metrics.exists() and metrics.read_text().strip()):
    assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
    time.sleep(0.1)
  [child] = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
  os.kill(int(child), signal.SIGTERM)  # a preemption of jaxtrain, not of the launcher
  err = p.communicate(timeout=600)[1]
  assert p.returncode == 0, err[-3000:]
  saved = re.search(r"preempted: saved step (\d+), exiting", err).group(1)
  assert "jaxtrain exited 75 (restartable): starting it again (restart 1)" in err, err[-3000:]
  assert f"resumed from checkpoint step {saved} (" in err and "done: step 20/20" in err, err[-3000:]

  # Its goodput, over both runs: the table, the plot, and goodput.json equal to the tool's account.
  out = _ok_out(user.run(readme.command(GOODPUT)))
  summary = json.loads((user.repo / "runs/long/goodput.json").read_text())
  assert summary["runs"] == 2 and f"\ngoodput {100 * summary['goodput']:.1f}% of " in out  # after pip's lines
  for part in ("productive", "startup", "down", "lost"):
    assert re.search(rf"^{part} +[\d.]+ +[\d.]+%$", out, re.M), out
  assert (user.repo / "runs/long/goodput.png").stat().st_size > 10_000
  # A workdir with no run: one line, exit 2.
  r = user.run("python tools/goodput.py runs/nothing")
  assert r.returncode == 2 and r.stderr == "goodput: error: runs/nothing: no run recorded there (no events in " \
      "goodput/); pass the workdir of a run\n", r.stderr


def test_attention_backend_recipe(user):
  """docs/recipes/attention_backend.md: auto's choice is one console line; a chosen backend trains."""
  out = _ok_out(user.run(readme.command(ATTENTION_AUTO)))
  assert out.strip().endswith("model.attention=auto: blockwise (cpu, seq_len 4096, mesh.context 1)"), out
  err = _ok(user.run(readme.command(ATTENTION_BLOCKWISE), SHORT))
  assert "model.attention=auto" not in err and user.committed("runs/tiny_blockwise") == [2]
  assert json.loads((user.repo / "runs/tiny_blockwise/config.json").read_text())["model"]["attention"] == "blockwise"


def test_estimate_recipe(user):
  """docs/recipes/size_a_slice.md: Llama 3 70B on 256 chips, the figures the page quotes."""
  out = _ok_out(user.run(readme.command(ESTIMATE_70B)))
  assert "70,553,706,496 params on mesh" in out and "'fsdp': 256" in out, out[-2000:]
  for part, gib in (("activations", "10.000"), ("transient", "7.828"), ("total", "21.935")):
    assert re.search(rf"^  {part} +{gib} GiB per device$", out, re.M), out[-2000:]


def test_restart_budget_recipe(user):
  """docs/recipes/resume_on_slurm.md: the budget the Slurm script asks jaxtrain for."""
  result = user.run(readme.command(RESTART_BUDGET))
  assert _ok_out(result).strip() == "6"


def test_float16_command(user):
  """docs/parallelism.md's float16 run, shortened: it trains with a loss scale, logged with every step."""
  _ok(user.run(readme.command(FLOAT16), SHORT, "--config.train.log_every=1"))
  records = [r for r in user.records("runs/tiny_fp16") if "loss" in r]
  assert [r["step"] for r in records] == [1, 2] and all(r["loss_scale"] >= 2 ** 14 for r in records), records


OFFLINE = "export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1; "  # the docs' tasks are local: nothing may come from the hub


def test_evaluation_commands(user):
  """docs/evaluation.md: the quick start's run scored on the local tasks (the harness's table and results JSON), at
  every saved step, the README's Hugging Face import scored (after the test that imports it), and a run that scores
  itself while it trains."""
  pytest.importorskip("lm_eval", reason="lm-eval (the eval extra, in the test extra) is not installed")
  out = _ok_out(user.run(OFFLINE + readme.command(EVAL_RUN)))
  results = json.loads((user.repo / "runs/tiny/harness.json").read_text())
  assert set(results["results"]) == {"shakespeare_mc", "shakespeare_ppl"} and "shakespeare_mc" in out
  assert results["n-samples"]["shakespeare_mc"]["effective"] == 40
  _ok(user.run(OFFLINE + readme.command(EVAL_EVERY_SAVE)))
  for step in user.committed("runs/tiny"):
    saved = json.loads((user.repo / f"runs/tiny/harness_{step}.json").read_text())
    assert saved["results"]["shakespeare_mc"]["acc,none"] >= 0
  if (user.repo / "imported/my-llama/hf").exists():  # the README's Hugging Face flow ran (it needs transformers)
    out = _ok_out(user.run(OFFLINE + readme.command(EVAL_IMPORT)))
    assert "shakespeare_mc" in out
  err = _ok(user.run(OFFLINE + readme.command(EVAL_IN_RUN), SHORT, "--config.eval.harness_every=1",
                     "--config.eval.harness_limit=8"))
  scored = [json.loads(line) for line in (user.repo / "runs/tiny_harness/metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in scored if "harness/shakespeare_mc/acc" in r] == [1, 2], err[-3000:]
  assert all("harness/shakespeare_ppl/word_perplexity" in r for r in scored if "harness/shakespeare_mc/acc" in r)

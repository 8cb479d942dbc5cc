"""The command line: every user mistake gives one line, exit code 2; the README command trains."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests import forked, readme


ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args, timeout=300, env=None, fork=True, optimized=True):
  """``python -m jaxtrain.main *args``, in the tests' environment or ``env`` (a training run's: tests/forked.py
  ``run_env``, with RUN_FLAGS if ``optimized``); forked from a process with the libraries imported unless ``fork``
  is false: a fresh interpreter, for an ``env`` whose ``JAX_*`` variables differ from the tests' (JAX reads them at
  import)."""
  if fork:
    return forked.run(["-m", "jaxtrain.main", *args], env=env, timeout=timeout, optimized=optimized)
  return subprocess.run([sys.executable, "-m", "jaxtrain.main", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=timeout, env=forked.run_env(env, optimized))


TINY = "--config=configs/tiny.py"
ERRORS = [
    # (arguments, text the one error line must contain)
    ([TINY, "--config.train.stepz=5"], "train.stepz: unknown config key; did you mean 'train.steps'?"),
    ([TINY, "--config.optim.lr=fast"], "--config.optim.lr=fast"),
    ([TINY, "--config.mesh.fsdp=3"],
     "mesh: ICI mesh data=1 x pipeline=1 x fsdp=3 x expert=1 x context=1 x tensor=1 = 3 devices, but there are 8"),
    ([TINY, "--config.mesh.data=3", "--config.mesh.fsdp=-1"], "mesh.fsdp: cannot fill"),
    ([TINY, "--config.train.global_batch_size=12"], "train.global_batch_size: each of the 1 microbatches has 12 "
                                                    "rows, not divisible by mesh.data=1 x mesh.fsdp=8"),
    ([TINY, "--config.mesh.tensor=8", "--config.mesh.fsdp=1"], "model.num_kv_heads: 2 is not divisible by "
                                                               "mesh.tensor=8"),
    ([TINY, "--config.mesh.tensor=2", "--config.model.mlp_dim=385"], "model.mlp_dim: 385 is not divisible by "
                                                                     "mesh.tensor=2"),
    ([TINY, "--config.mesh.tensor=2", "--config.model.vocab_size=255"], "model.vocab_size: 255 is not divisible"),
    ([TINY, "--config.model.d_model=100", "--config.model.head_dim=25"], "model.d_model: 100 is not divisible by "
                                                                          "mesh.fsdp=8"),
    ([TINY, "--config.model.num_kv_heads=3"], "model.num_kv_heads: 3 does not divide model.num_heads=4"),
    ([TINY, "--config.train.microbatches=3"], "train.microbatches: 3 does not divide"),
    ([TINY, "--config.model.name=gpt9"],
     "model.name: 'gpt9' is not a registered model; use one of deepseek_v3, gemma2, gemma3, glm4_moe, gpt_oss, llama, "
     "llama4, mistral, moe, olmoe, qwen2, qwen3, qwen3_moe, qwen3_next, or register"),
    ([TINY, "--config.model.remat=everything"],
     "model.remat: 'everything' is not a registered remat policy; use one of full, minimal, none, offload_dots, "
     "offload_full, offload_minimal, save_dots, save_out_proj, save_qkv_proj"),
    ([TINY, "--config.sharding.preset=zero9"], "sharding.preset: 'zero9' is not a preset"),
    ([TINY, "--config.data.num_workers=3"], "data.num_workers: 3 does not divide the 16 rows"),
    ([TINY, "--config.mesh.pipeline=4", "--config.pipeline.schedule=circular"],
     "model.num_layers: 4 layers do not split evenly into 4 stages x 2 repeats"),
    ([TINY, "--config.mesh.pipeline=4", "--config.train.microbatches=2"],
     "train.microbatches: 2 microbatches are fewer than the 4 pipeline stages"),
    ([TINY, "--config.mesh.pipeline=2", "--config.pipeline.schedule=1f2b"],
     "pipeline.schedule: '1f2b' is not one of gpipe, circular, 1f1b, interleaved_1f1b"),
    ([TINY, "--config.mesh.pipeline=2", "--config.sharding.rules=layers="],
     "sharding.rules: 'layers' must map to the pipeline mesh axis when mesh.pipeline > 1"),
    (["--config=configs/missing.py"], "No such file or directory: 'configs/missing.py'"),
    (["--config=configs/tiny.py:nope"], "unknown variant 'nope'"),
]


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
  """(result, workdir) of every ERRORS command, each with its own workdir, run as forks of one process that has
  the libraries imported (tests/forked.py: a command that ends at a mistake costs the fork, not a Python start)."""
  workdirs = [tmp_path_factory.mktemp("mistake") / "run" for _ in ERRORS]
  argvs = [["-m", "jaxtrain.main", *args, f"--config.workdir={workdir}" if args[0] == TINY else "--noalsologtostderr"]
           for (args, _), workdir in zip(ERRORS, workdirs)]
  return list(zip(forked.run_many(argvs), workdirs))


@pytest.mark.parametrize("case", range(len(ERRORS)), ids=[" ".join(a[1:]) or a[0] for a, _ in ERRORS])
def test_user_mistake_gives_one_line_and_exit_2(case, mistakes):
  message, (result, workdir) = ERRORS[case][1], mistakes[case]
  errors = [line for line in result.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert result.returncode == 2, result.stderr
  assert len(errors) == 1 and message in errors[0], result.stderr
  assert "Traceback" not in result.stderr
  assert not workdir.exists()  # refused before anything is written: not even the workdir


# Every shipped config, by whether a CPU can train it (a new config must be added to one list).
CPU_CONFIGS = ["configs/tiny.py", "configs/tiny.py:dp", "configs/tiny.py:tp", "configs/cpu_50m.py",
               "configs/moe_tiny.py", "configs/tiny_family.py:gemma2", "configs/tiny_family.py:qwen3_moe",
               "configs/grpo_math.py", "configs/tiny_family.py:gpt_oss", "configs/tiny_family.py:deepseek_v3",
               "configs/grpo_letters.py:sft", "configs/grpo_letters.py:grpo"]
POD_CONFIGS = ["configs/llama3_1b.py", "configs/llama3_8b.py", "configs/llama3_70b.py", "configs/mixtral_8x7b.py",
               "configs/olmoe_1b_7b.py", "configs/qwen2_5_7b.py", "configs/qwen3_8b.py", "configs/qwen3_30b_a3b.py",
               "configs/mistral_7b.py", "configs/gemma2_9b.py", "configs/gemma3_1b.py", "configs/gpt_oss_20b.py",
               "configs/gpt_oss_120b.py", "configs/deepseek_v3_671b.py", "configs/glm4_5_air.py",
               "configs/llama4_scout.py", "configs/qwen3_next_80b_a3b.py", "configs/kimi_k2_1t.py"]


# CPU configs whose training command in the docs tests/test_readme.py runs as typed (plus --config.train.steps,
# and the same checks: steps clipped, a checkpoint, the summary line), or tests/test_grpo.py does (grpo_letters, its
# whole runs): not trained a second time here.
TRAINED_BY_THE_DOCS = ["configs/tiny.py", "configs/tiny.py:tp", "configs/moe_tiny.py", "configs/grpo_math.py",
                       "configs/grpo_letters.py:sft", "configs/grpo_letters.py:grpo"]


def test_every_config_is_listed():
  shipped = {f"configs/{p.name}" for p in (ROOT / "configs").glob("*.py") if p.name != "__init__.py"}
  assert {c.split(":")[0] for c in CPU_CONFIGS + POD_CONFIGS} == shipped
  trains = [c for c in readme.commands() if "python -m jaxtrain.main" in c and "dry_run" not in c]
  for config in TRAINED_BY_THE_DOCS:
    assert config in CPU_CONFIGS and any(re.search(rf"--config={re.escape(config)}( |$)", c) for c in trains), config


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for c in CPU_CONFIGS if c not in TRAINED_BY_THE_DOCS])
def test_three_steps_of_every_cpu_config(config, tmp_path):
  """--config.train.steps=3 shortens any config (its warmup is clipped) and ends with a checkpoint. The 50M model
  trains on 8 x 32 tokens a step, not its own 16 x 256 (1.2 TFLOP a step, about 20 s each here)."""
  shorter = ["--config.train.global_batch_size=8", "--config.data.seq_len=32"] if config == "configs/cpu_50m.py" else []
  # Three steps of a tiny model compile fast (not optimized), as the in-process tests' programs do: that costs less
  # than the steps it slows. The 50M model's steps are 20x slower unoptimized: those keep RUN_FLAGS.
  result = _run(f"--config={config}", "--config.train.steps=3", "--config.train.log_every=1", *shorter,
                f"--config.workdir={tmp_path}", optimized=config == "configs/cpu_50m.py")
  assert result.returncode == 0, result.stderr[-3000:]
  assert "is longer than the 3-step schedule" in result.stderr
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in records)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]
  assert "done: step 3/3" in result.stderr


@pytest.mark.slow
def test_the_same_command_again_loads_its_step_from_the_compilation_cache(tmp_path):
  """compilation_cache_dir (default ~/.cache/jaxtrain/xla): the first run compiles the train step and keeps it; the
  same step again (a restart, a resume, another workdir) is loaded, not compiled. Without the tests' own cache
  folder, and JAX's debug log of its cache on. (The tests' JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 stays:
  with their fast-compile flags this step compiles in under JAX's default threshold of a second.)"""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(HOME=str(tmp_path / "home"), JAX_DEBUG_LOG_MODULES="jax._src.compiler")
  cache = tmp_path / "home" / ".cache" / "jaxtrain" / "xla"
  small = [TINY, "--config.train.steps=2", "--config.train.global_batch_size=8", "--config.data.seq_len=64"]
  # (The tests' fast-compile flags, not RUN_FLAGS: what is cached and found does not depend on the flags, and two
  # steps do not repay the optimized compile.)
  runs = [_run(*small, f"--config.workdir={tmp_path / workdir}", env=env, fork=False, optimized=False)
          for workdir in ("first", "again")]
  for r in runs:
    assert r.returncode == 0, r.stderr[-3000:]
  assert "PERSISTENT COMPILATION CACHE MISS for 'jit_train_step'" in runs[0].stderr, runs[0].stderr[-3000:]
  assert "Persistent compilation cache hit for 'jit_train_step'" in runs[1].stderr, runs[1].stderr[-3000:]
  assert "COMPILATION CACHE MISS for 'jit_train_step'" not in runs[1].stderr
  assert any(cache.iterdir())
  resolved = json.loads((tmp_path / "first" / "config.json").read_text())
  assert resolved["compilation_cache_dir"] == str(cache)

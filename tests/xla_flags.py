"""The XLA flags of the tests (tests/conftest.py sets TEST_XLA_FLAGS for every test process) and of the training
runs they start as single processes (RUN_FLAGS added: tests/forked.py ``run_env``)."""

import importlib.metadata

# XLA's CPU collectives abort the process (SIGABRT, "Termination timeout for `all reduce ...` of N seconds exceeded.
# Exiting to ensure a consistent program state") when a collective's device threads do not all arrive within a
# fixed timeout. Simulated devices share 2 cores here, with other test processes beside them: a thread can fall that
# far behind with nothing wrong (the intermittent SIGABRT seen under load). Every test process (tests/conftest.py)
# and every process the tests start (tests/multiprocess.py, tests/forked.py) waits as long as the tests' own bounds
# instead.
PATIENT_COLLECTIVES = "--xla_cpu_collective_call_terminate_timeout_seconds=600"
# The tests' programs are tiny: compiling them costs far more than running them, and most of the compile time is
# LLVM optimizing the generated CPU code. Without its expensive passes and at optimization level 0 a test compiles
# in about 70% of the time (tests/test_moe.py + tests/test_context.py: 260 s -> 184 s on 2 cores), computing the
# same values (XLA's HLO passes, which decide what is computed, are unchanged). Where jaxlib still has the
# elemental emitters (0.10; 0.12 has only the fusion emitters and aborts on the flag), they cost less again:
# tests/test_moe.py + tests/test_checkpoint.py, 366 s -> 261 s on 2 cores.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA splits the generated code into modules for parallel LLVM jobs; the tests' cores are busy with other processes,
# and the split costs more than it saves: one module. It changes no value and no buffer (tests/test_moe.py's
# expert-parallel tests + LoRA on MLA, cold, one process: ~5% less compile time). Not also here: turning off the
# concurrency-optimized scheduler or copy insertion's region analysis (together ~8% less), which change buffer
# assignment (tests/test_moe.py's and tests/test_models.py's temporary-memory checks failed); with both off,
# tests/test_preference.py's context-parallel run also aborted (SIGABRT) in the full suite, twice (not isolated to
# one of the two; never alone).
FAST_COMPILE += " --xla_cpu_parallel_codegen_split_count=1"
if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11):
  FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"
# Each simulated device runs its programs on a thread of its own; XLA's CPU backend also splits an op (a matmul) over
# a pool of threads the size of the machine. With 8 simulated devices and two test workers on 2 cores, those
# threads only take turns (and spin waiting for their turn): one thread per op costs less. Measured on
# tests/test_moe.py + tests/test_checkpoint.py, cold: 334 -> 292 CPU-seconds, 200 -> 178 s.
ONE_THREAD_PER_OP = "--xla_cpu_multi_thread_eigen=false"
TEST_XLA_FLAGS = f"{PATIENT_COLLECTIVES} {FAST_COMPILE} {ONE_THREAD_PER_OP}"
# A training run a test starts as a single process (tests/forked.py ``popen``/``run``: the kill and restart tests'
# runs, the CLI tests' runs) compiles one program, which the persistent compilation cache shared by the suite keeps,
# and runs it for tens of steps; its restarts load it. There code LLVM has optimized pays: at level 0 a tiny step
# takes ~0.14 s, at level 1 with the expensive passes ~0.01-0.08 s. Measured cold, 2 workers, /proc/stat CPU:
# - test_checkpoint + test_monitor + test_workdir + test_stream: 194 s / 346 CPU-s with TEST_XLA_FLAGS alone,
#   161 s / 285 CPU-s with RUN_FLAGS on the runs (171 s with level 1 but the expensive passes still off);
# - test_data, test_mixture, test_optimizers, test_generate, test_cli, test_lora, test_extensions: 349 and 342
#   CPU-s, the same (fewer steps a run);
# - not on multi-process jobs (tests/multiprocess.py: 1 device a process, few steps, a program per device count):
#   test_distributed 149 CPU-s without, 217 with;
# - nor on the in-process tests, which compile many programs and run each a few steps: test_moe + test_context at
#   level 1, 94 -> 148 s.
# A process's values are those of its flags: every run a test compares bitwise with another is started the same way.
RUN_FLAGS = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=false"

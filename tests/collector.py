"""The garbage collector in the test processes: the test workers (tests/conftest.py) and the process that
tests/forked.py forks its runs from (tests/preload.py).

Python collects its oldest generation whenever the objects that survived since the last full collection exceed a
quarter of those it found then, checked every 10th middle collection: tracing and compiling the tests' programs
fill JAX's caches with long-lived objects at such a pace that full collections ran every few seconds, each walking
every object not frozen (~0.13 s in a worker). Measured on tests/test_moe.py + test_lora.py + test_families.py in
one process: 31 full collections, 11.7 s of 170 CPU-s. So a full collection is left to a 1,000th middle one (about
every 7 million allocations), and a worker collects in full itself between test files (``between_files``), where
the objects of the file before are gone: 1.7 s of collections, 162 CPU-s, peak memory 3.3 GB instead of 3.2.
"""

import gc

FULL_AFTER_MIDDLE = 1000  # Python's default: 10


def freeze() -> None:
  """Everything alive now out of the collector's sight (``gc.freeze``), and full collections made rare."""
  gc.freeze()
  young, middle, _ = gc.get_threshold()
  gc.set_threshold(young, middle, FULL_AFTER_MIDDLE)


def between_files() -> None:
  """A full collection (the cycles the last file left), then :func:`freeze`."""
  gc.collect()
  freeze()

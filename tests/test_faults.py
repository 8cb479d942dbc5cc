"""The fault matrix: every fault at every boundary a pod meets (tests/faults.py ``MATRIX``), raised where real ones come
from, each ending as the table of docs/operations.md says; the table and the matrix are the same."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import faults

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTION = "## What each fault does"
OUTCOME_WORDS = {  # what the one line names, by the fault's kind (one of)
    "denied": ("denied", "refused access"), "not_found": ("missing",), "throttled": ("store unreachable",),
    "server_error": ("store unreachable",), "reset": ("store unreachable",), "silent": ("store unreachable",),
    "enospc": ("disk full", "do not fit"), "eacces": ("denied",), "eio": ("storage I/O",), "estale": ("storage I/O",),
    "device_oom": ("device out of memory", "ran out of memory"),
}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
  """Every cell, run once in one process with the disk faults preloaded (tests/fault_matrix.py)."""
  out = tmp_path_factory.mktemp("matrix") / "cells.json"
  env = {**os.environ, **faults.FaultyDisk.environ(), "PYTHONPATH": str(ROOT)}
  r = subprocess.run([sys.executable, "-m", "tests.fault_matrix", str(out)], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  cells = json.loads(out.read_text()) if out.exists() else {}
  assert r.returncode == 0, (r.returncode, r.stderr[-4000:], cells)
  return cells


@pytest.mark.slow  # (the matrix's one process: about a minute)
@pytest.mark.parametrize("row", faults.MATRIX, ids=lambda row: row.id)
def test_each_fault_ends_as_the_table_says(matrix, row):
  seen = matrix[row.id]
  assert seen["outcome"] == row.expect, seen
  if row.expect.startswith("exit"):
    line = seen["line"]
    assert "\n" not in line and "Traceback" not in line, line  # one line, no traceback
    named = ("lease lost",) if row.boundary == "lease renew" else OUTCOME_WORDS[row.fault]  # (what it cost the run)
    assert any(words in line for words in named), line  # naming the cause


def test_the_docs_table_is_the_matrix():
  page = (ROOT / "docs" / "operations.md").read_text()
  section = page.split(SECTION, 1)[1].split("\n## ", 1)[0]
  lines = section.splitlines()
  start = lines.index(faults.table().splitlines()[0])  # the matrix's header (the section's first table is the causes')
  table = "\n".join(line for line in lines[start:] if line.startswith("|"))
  assert table == faults.table(), "docs/operations.md's table differs from tests/faults.py MATRIX: " \
                                  "python -m tests.faults prints the table"
  assert {row.expect for row in faults.MATRIX} == set(faults.OUTCOMES)  # every row of the outcome table is seen

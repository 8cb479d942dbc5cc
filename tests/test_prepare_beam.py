"""Data preparation on Apache Beam (tools/prepare_data.py --runner=...) and in process: the same bytes for any
executor and worker count, the documents, split and order the spec gives (checked against a reference written
here from the spec), exact and near duplicates removed and counted, bad input named with nothing left behind."""

import hashlib
import json
import os
import random
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxtrain.data import loader, prepare
from tests import forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("apache_beam", reason="the Beam preparation needs apache-beam (pip install -e '.[test]')")
pytest.importorskip("datasketch", reason="near-duplicate removal needs datasketch (pip install -e '.[test]')")


def _words(rng: random.Random, n: int) -> str:
  return " ".join(rng.choice(_VOCAB) for _ in range(n))


_VOCAB = [f"w{i}" for i in range(2000)] + ["the", "and", "of", "to", "café", "naïve", "数据"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """180 distinct documents in JSONL, text and Parquet files, 12 of them repeated in other files (exact
  duplicates), 4 empty records; returns (folder, the distinct documents)."""
  rng = random.Random(7)
  docs = [_words(rng, rng.randint(5, 120)) for _ in range(180)]
  folder = tmp_path_factory.mktemp("raw")
  repeats = docs[:12]
  (folder / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:70] + [""] * 2))
  (folder / "b.txt").write_text("\n\n".join(docs[70:130] + repeats[:6]) + "\n")
  pq.write_table(pa.table({"text": docs[130:] + repeats[6:] + ["", ""]}), folder / "c.parquet")
  return folder, docs


def _prepare(folder, out, **kw) -> dict:
  return prepare.prepare(prepare.Options(inputs=[os.fspath(folder)], output=os.fspath(out), seed=3,
                                         eval_fraction=0.2, shard_mib=0.004, progress=False, **kw))


def _files(folder) -> dict:
  return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def _decoded(folder, manifest, split) -> list[str]:
  source = loader.TokenSource(os.fspath(folder), manifest, split)
  return [bytes(np.asarray(source[i], np.uint8)).decode("utf-8") for i in range(len(source))]


@pytest.mark.slow
def test_every_executor_gives_the_documents_split_and_order_of_the_spec(corpus, tmp_path):
  folder, docs = corpus
  outs = {"in process": _prepare(folder, tmp_path / "local"),
          "2 processes": _prepare(folder, tmp_path / "pool", workers=2),
          "Beam FnApiRunner": _prepare(folder, tmp_path / "beam1", runner="FnApiRunner"),
          "Beam FnApiRunner, 2 workers": _prepare(folder, tmp_path / "beam2", runner="FnApiRunner", workers=2)}
  want = _files(tmp_path / "local")
  for name, out in zip(outs, ("local", "pool", "beam1", "beam2")):
    assert _files(tmp_path / out) == want, name  # shards and manifest, byte for byte
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temporary folder left

  # The spec, written out independently: a document is eval when the second 8 bytes of
  # SHA-256("jaxtrain.prepare\0" + seed as int64 LE + SHA-256(text)), as a fraction of 2^64, are below
  # eval_fraction; each split is ordered by the first 8 bytes.
  def key(d):
    h = hashlib.sha256(b"jaxtrain.prepare\0" + (3).to_bytes(8, "little") + hashlib.sha256(d.encode()).digest())
    h = h.digest()
    return int.from_bytes(h[:8], "big"), int.from_bytes(h[8:16], "big") / 2**64

  expected = {"eval": sorted((d for d in docs if key(d)[1] < 0.2), key=key),
              "train": sorted((d for d in docs if key(d)[1] >= 0.2), key=key)}
  manifest = outs["in process"]
  assert all(out == manifest for out in outs.values())
  assert manifest["duplicates_removed"] == 12 and manifest["near_duplicates_removed"] == 0
  assert manifest["documents"] == 180 and len(expected["eval"]) == manifest["splits"]["eval"]["documents"] > 10
  for split in ("eval", "train"):
    assert _decoded(tmp_path / "local", manifest, split) == expected[split]
  train_shards = [s for s in manifest["shards"] if s["split"] == "train"]
  assert len(train_shards) >= 3 and [s["file"] for s in train_shards] == \
      [f"train-{i:05d}-of-{len(train_shards):05d}.array_record" for i in range(len(train_shards))]
  for s in manifest["shards"]:
    data = (tmp_path / "local" / s["file"]).read_bytes()
    assert s["bytes"] == len(data) and s["sha256"] == hashlib.sha256(data).hexdigest()
  assert manifest["tokens"] == sum(len(d.encode()) for d in docs)

  other_seed = prepare.prepare(prepare.Options(inputs=[os.fspath(folder)], output=os.fspath(tmp_path / "seed4"),
                                               seed=4, eval_fraction=0.2, shard_mib=0.004, progress=False))
  assert _decoded(tmp_path / "seed4", other_seed, "train") != expected["train"]


def test_near_duplicates_are_found_and_counted(tmp_path):
  """40 documents of 150 words, 8 of them planted again with 3 words changed (Jaccard of word 5-grams about
  0.83) and 3 again verbatim: threshold 0.7 removes exactly the 8 (one of each pair kept), 3 exact."""
  rng = random.Random(11)
  docs = [_words(rng, 150) for _ in range(40)]
  planted = []
  for d in docs[:8]:
    words = d.split()
    for i in rng.sample(range(150), 3):
      words[i] = "changed"
    planted.append(" ".join(words))
  (tmp_path / "in").mkdir()
  (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs + docs[30:33]))
  (tmp_path / "in" / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in planted))
  outs = [prepare.prepare(prepare.Options(inputs=[os.fspath(tmp_path / "in")], output=os.fspath(tmp_path / o),
                                          near_dup_threshold=0.7, eval_fraction=0.0, progress=False, **kw))
          for o, kw in (("local", {}), ("beam", {"runner": "FnApiRunner", "workers": 2}))]
  assert outs[0] == outs[1] and _files(tmp_path / "local") == _files(tmp_path / "beam")
  manifest = outs[0]
  assert manifest["near_duplicates_removed"] == 8 and manifest["duplicates_removed"] == 3
  assert manifest["near_dup"] == {"threshold": 0.7, "ngram": 5, "num_perm": 128}
  kept = set(_decoded(tmp_path / "local", manifest, "train"))
  assert len(kept) == manifest["documents"] == 40 and set(docs[8:]) <= kept
  assert all((d in kept) != (p in kept) for d, p in zip(docs, planted))  # one of each pair
  plain = prepare.prepare(prepare.Options(inputs=[os.fspath(tmp_path / "in")], output=os.fspath(tmp_path / "off"),
                                          eval_fraction=0.0, progress=False))
  assert plain["documents"] == 48 and plain["near_duplicates_removed"] == 0 and plain["near_dup"] is None


def _cli(*args):
  return subprocess.run([sys.executable, "tools/prepare_data.py", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)


@pytest.mark.slow
def test_bad_input_fails_the_pipeline_with_the_file_named(tmp_path):
  lines = [json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(30)]
  good = "".join(lines)
  cases = {
      "utf8": ({"a.jsonl": good.encode(), "b.jsonl": "".join(lines[:5]).encode() + b'{"text": "caf\xe9"}\n'},
               "b.jsonl:6: not valid UTF-8"),
      "field": ({"a.jsonl": good.encode(), "b.jsonl": b'{"body": "x"}\n'}, "b.jsonl:1: no field 'text'"),
      "unreadable": ({"a.jsonl": good.encode()}, "gone.jsonl: cannot be read"),
  }
  runs = []
  for name, (files, message) in cases.items():
    folder = tmp_path / name
    folder.mkdir()
    for f, data in files.items():
      (folder / f).write_bytes(data)
    if name == "unreadable":
      os.symlink(tmp_path / "nowhere", folder / "gone.jsonl")  # listed, but opening it fails
    # The first error is raised in a worker process (2 of them: a Beam harness each, seconds to start), the
    # others in-process: the message is the same one line either way.
    workers = 2 if name == "utf8" else 0
    runs.append(([f"--input={folder}", "--runner=FnApiRunner", f"--workers={workers}"], message))
  one = f"--input={tmp_path / 'field' / 'a.jsonl'}"
  runs += [([one, "--runner=NoSuchRunner"], "--runner: 'NoSuchRunner' is not a usable Beam runner"),
           ([one, "--", "--project=p"], "--project=p: an extra argument without --runner")]
  # The commands run as forks of one process that has Beam imported (tests/forked.py).
  results = forked.run_many([["tools/prepare_data.py", *args[:1], f"--output={tmp_path / 'out'}", *args[1:]]
                             for args, _ in runs], preload=("apache_beam",))
  for r, (args, message) in zip(results, runs):
    errors = [line for line in r.stderr.splitlines() if line.startswith("prepare_data: error:")]
    assert r.returncode == 2 and len(errors) == 1 and message in errors[0], (args, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
  assert sorted(p for p in os.listdir(tmp_path) if p not in cases) == []  # no output, no temporary folder
  r = _cli(one, f"--output={tmp_path / 'out'}", "--runner=FnApiRunner", "--near_dup_threshold=0.8",
           "--eval_fraction=0.1")
  assert r.returncode == 0 and "0 near duplicates removed" in r.stdout, r.stderr[-2000:]
  manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert manifest["documents"] == 30 and manifest["splits"]["eval"]["documents"] >= 1

"""data.source=raw (jaxtrain.data.stream): JSONL / Parquet / text read and tokenized in the Grain pipeline, packed
like prepared data, deterministic, resumable after a SIGKILL, disjoint per process, bad input named."""

import json
import os
import pathlib
import re
import signal

import numpy as np
import pytest

from jaxtrain import data as data_lib
from jaxtrain.config import DataError, base_config
from jaxtrain.data import batch as batch_lib
from jaxtrain.data import loader, prepare, stream, tokenizers
from tests import forked, multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ, BATCH = 64, 8


def _paragraphs() -> list[str]:
  text = prepare.BUNDLED.read_text()
  return [p.strip("\n") for p in text.split("\n\n") if p.strip()][:1200]


def _write(folder: pathlib.Path, kind: str, docs: list[str], field: str = "text") -> pathlib.Path:
  """``docs`` in two files of ``kind`` (jsonl, parquet, text) under ``folder``."""
  folder.mkdir(parents=True, exist_ok=True)
  half = len(docs) // 2
  for i, part in enumerate((docs[:half], docs[half:])):
    if kind == "jsonl":
      (folder / f"part{i}.jsonl").write_text("".join(json.dumps({field: d, "n": j}) + "\n"
                                                     for j, d in enumerate(part)))
    elif kind == "parquet":
      import pyarrow as pa
      import pyarrow.parquet as pq
      pq.write_table(pa.table({field: part, "n": list(range(len(part)))}), folder / f"part{i}.parquet",
                     row_group_size=100)
    else:
      (folder / f"part{i}.txt").write_text("\n\n".join(part) + "\n")
  return folder


def _config(path, **data):
  c = base_config()
  c.data.update(source="raw", path=os.fspath(path), seq_len=SEQ, **data)
  c.train.global_batch_size = BATCH
  return c


def _take(it, n):
  out = [next(it) for _ in range(n)]
  data_lib.close(it)
  return out


class _Docs:
  def __init__(self, docs, tokenizer):
    self.docs, self.tok = docs, tokenizers.load(tokenizer)

  def __getitem__(self, i):
    return self.tok.encode(self.docs[i])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  tk = pytest.importorskip("tokenizers")
  hf = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
  hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel()
  hf.train_from_iterator(_paragraphs(), tk.trainers.BpeTrainer(vocab_size=256, special_tokens=["[UNK]"]))
  path = tmp_path_factory.mktemp("tok") / "tok.json"
  hf.save(os.fspath(path))
  return os.fspath(path)


@pytest.mark.parametrize("kind,tok", [("jsonl", "byte"), ("parquet", "bpe"), ("text", "byte")])
def test_batches_equal_the_packing_of_the_same_documents(tmp_path, bpe, kind, tok):
  docs = _paragraphs()
  tokenizer = bpe if tok == "bpe" else "byte"
  c = _config(_write(tmp_path / "in", kind, docs), tokenizer=tokenizer)
  got = _take(data_lib.open_train(c), 12)
  # The same documents, in memory, through the existing lanes and packer.
  order = stream.LaneOrder(len(docs), BATCH)
  want = _take(iter(loader.lanes_dataset(order, _Docs(docs, tokenizer), seq_len=SEQ, global_batch=BATCH,
                                         process_index=0, process_count=1)), 12)
  for g, w in zip(got, want):
    for k in batch_lib.KEYS + ("doc_ids",):
      np.testing.assert_array_equal(g[k], w[k], err_msg=k)
  # Independently: lane r streams the contiguous r-th eighth of the documents, in file order.
  tok = tokenizers.load(tokenizer)
  for r in range(BATCH):
    lane = np.concatenate([tok.encode(docs[d]) for d in stream.lane_documents(c, r)[:40]])
    rows = np.concatenate([np.concatenate([b["inputs"][r], b["targets"][r, -1:]]) for b in got])
    np.testing.assert_array_equal(rows, lane[:len(rows)])
  assert got[0]["inputs"].max() < tok.vocab_size


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
  return _write(tmp_path_factory.mktemp("jsonl"), "jsonl", _paragraphs())


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_deterministic_and_resumes_from_its_state(jsonl, workers):
  c = _config(jsonl, num_workers=workers)
  it = data_lib.open_train(c)
  first = [next(it) for _ in range(5)]
  state = it.get_state()
  rest = _take(it, 6)
  again = data_lib.open_train(c)  # another run: the same stream
  for a, b in zip(first + rest, _take(again, 11)):
    for k in batch_lib.KEYS:
      np.testing.assert_array_equal(a[k], b[k])
  resumed = data_lib.open_train(c)
  resumed.set_state(json.loads(json.dumps(state)))  # as a checkpoint stores it
  for a, b in zip(rest, _take(resumed, 6)):
    for k in batch_lib.KEYS:
      np.testing.assert_array_equal(a[k], b[k])


def test_worker_count_does_not_change_the_stream(jsonl):
  zero, two = (_take(data_lib.open_train(_config(jsonl, num_workers=w)), 6) for w in (0, 2))
  for a, b in zip(zero, two):
    for k in batch_lib.KEYS:
      np.testing.assert_array_equal(a[k], b[k])


def test_eval_split_and_provenance(jsonl, tmp_path):
  docs = _paragraphs()
  c = _config(jsonl, eval_fraction=0.05)
  c.eval.max_batches = 2
  held_out = int(np.ceil(len(docs) * 0.05))
  train = _take(data_lib.open_train(c), 40)
  seen = {int(d) for b in train for d in np.unique(b["doc_ids"]) if d >= 0}
  assert max(seen) < len(docs) - held_out  # training never reads the held-out tail
  evals = data_lib.open_eval(c)
  assert len(evals) == 2 and evals[0]["doc_ids"][0, 0] == len(docs) - held_out
  assert evals[0]["inputs"][0, :20].tolist() == list(docs[len(docs) - held_out].encode()[:20])
  report = data_lib.provenance(c, 1, train[0]["doc_ids"])
  assert report["records"][0] == f"{jsonl}/part0.jsonl:1" and len(report["records"]) == len(report["documents"])
  c2 = _config(jsonl, eval_path=os.fspath(_write(tmp_path / "ev", "text", docs[:30])))
  assert len(data_lib.open_eval(c2)) >= 1


def test_two_processes_read_disjoint_documents(jsonl, tmp_path):
  args = ["--data", os.fspath(jsonl), f"--global_batch={BATCH}", f"--seq_len={SEQ}", "--batches=30",
          "--num_workers=0", "--out", os.fspath(tmp_path / "p{}.json")]
  for r in multiprocess.run("tests/stream_worker.py", args, timeout=180):
    assert r.returncode == 0, r.stderr[-3000:]
  seen = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
  assert seen[0]["rows"] == seen[1]["rows"] == BATCH // 2
  n = len(_paragraphs())
  assert seen[0]["doc_ids"] and max(seen[0]["doc_ids"]) < n // 2 <= min(seen[1]["doc_ids"])  # disjoint halves
  single = _take(data_lib.open_train(_config(jsonl)), 1)[0]  # the global batch is the one-process batch
  for k in batch_lib.KEYS:
    np.testing.assert_array_equal(np.asarray(seen[0]["batch"][k]), single[k])
    np.testing.assert_array_equal(np.asarray(seen[1]["batch"][k]), single[k])


def _main(*args, timeout=300):
  return forked.run(["-m", "jaxtrain.main", "--config=configs/tiny.py", *args], timeout=timeout)


def _error(r) -> str:
  lines = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
  return lines[0]


@pytest.mark.slow
def test_bad_inputs_are_one_line_before_compiling(tmp_path, jsonl):
  (tmp_path / "empty").mkdir()
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "x.csv").write_text("a,b\n")
  pq_dir = _write(tmp_path / "pq", "parquet", _paragraphs()[:40], field="body")
  cases = [
      ([f"--config.data.path={tmp_path / 'nope'}"], "data.path: " + os.fspath(tmp_path / "nope") + ": no such file"),
      ([f"--config.data.path={tmp_path / 'empty'}"], "the folder holds no .jsonl"),
      ([f"--config.data.path={tmp_path / 'other' / '*.jsonl'}"], "the glob matches no"),
      ([f"--config.data.path={jsonl}", "--config.data.field=body"], "data.field: 'body' is not a field of"),
      ([f"--config.data.path={pq_dir}"], "data.field: 'text' is not a column of"),
      ([f"--config.data.path={jsonl}", "--config.eval.every_steps=5"], "eval.every_steps: is set but data.source"),
      (["--config.data.source=arrayrecord", "--config.data.field=body"], "data.field: is set but only"),
  ]
  results = forked.run_many([["-m", "jaxtrain.main", "--config=configs/tiny.py", f"--config.workdir={tmp_path / f'run{i}'}",
                              "--config.data.source=raw", *args] for i, (args, _) in enumerate(cases)])
  for i, (r, (args, message)) in enumerate(zip(results, cases)):
    assert message in _error(r), (args, _error(r))
    assert not (tmp_path / f"run{i}").exists()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_bad_records_name_file_and_line(tmp_path, workers):
  good = [json.dumps({"text": d}).encode() for d in _paragraphs()[:64]]
  for bad, record, message in ((20, b'{"text": "caf\xe9"}', "part.jsonl:21: not valid UTF-8"),
                               (40, b'{"body": "no text here"}', "part.jsonl:41: no field 'text' (its fields: body)")):
    folder = tmp_path / f"bad{bad}"
    folder.mkdir()
    (folder / "part.jsonl").write_bytes(b"\n".join(good[:bad] + [record] + good[:10]) + b"\n")
    c = _config(folder, num_workers=workers)
    c.train.global_batch_size = 2
    it = data_lib.open_train(c)
    with pytest.raises(DataError, match=re.escape(message)):
      for _ in range(500):
        next(it)
    data_lib.close(it)


def _records(workdir) -> dict:
  """step -> the last record logged for it (training and eval records merged)."""
  out = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    r = json.loads(line)
    out.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k in ("loss", "tokens", "eval_loss")})
  return out


@pytest.mark.slow
def test_sigkill_and_resume_gives_the_uninterrupted_batches(jsonl, tmp_path, monkeypatch):
  # Its runs (forked: the flag is read when their backend starts) on 2 simulated devices, not 8: the kill and the
  # resume are the point, and a step takes a fraction of the time.
  monkeypatch.setenv("XLA_FLAGS", f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=2")
  args = [f"--config.data.path={jsonl}", "--config.data.source=raw", "--config.data.seq_len=64",
          "--config.data.eval_fraction=0.02", "--config.eval.every_steps=3", "--config.eval.max_batches=2",
          "--config.train.steps=9", "--config.train.log_every=1", "--config.checkpoint.every_steps=3",
          "--config.data.num_workers=2"]
  r = _main(f"--config.workdir={tmp_path / 'a'}", *args)
  assert r.returncode == 0, r.stderr[-3000:]
  code = multiprocess.main_killed_at_save(6, ["--config=configs/tiny.py", f"--config.workdir={tmp_path / 'b'}",
                                               *args], tmp_path / "killed.log")
  assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
  r = _main(f"--config.workdir={tmp_path / 'b'}", *args)
  assert r.returncode == 0 and "resumed from checkpoint step 3" in r.stderr, r.stderr[-3000:]
  want, got = _records(tmp_path / "a"), _records(tmp_path / "b")
  assert sorted(want) == list(range(1, 10)) and "eval_loss" in want[9]
  assert got == want  # steps 4-9 read the same batches: same token counts, bitwise the same losses

"""Data: prepare_data, the Grain input pipeline (jaxtrain.data.loader: resume, multi-process, packing), bad input,
training on it."""

import hashlib
import json
import os
import pathlib

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import data as data_lib
from jaxtrain.config import DataError
from jaxtrain.data import batch as batch_lib
from jaxtrain.data import loader, prepare, tokenizers
from jaxtrain.train import trainer
from tests import forked, multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = "the of and to in a is that for it as was with be by on not he I this are or his from at which".split()


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
  out = tmp_path_factory.mktemp("data") / "shakespeare"
  prepare.prepare(prepare.Options(inputs=[os.fspath(prepare.BUNDLED)], output=os.fspath(out), progress=False,
                                  eval_fraction=0.05))
  return os.fspath(out)


def _dataset(root, **kw):
  args = dict(seq_len=64, global_batch=8, seed=0, process_index=0, process_count=1)
  return loader.train_dataset(root, loader.load_manifest(root), **{**args, **kw})


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(batches_a, batches_b):
  assert len(batches_a) == len(batches_b)
  for a, b in zip(batches_a, batches_b):
    for k in batch_lib.KEYS:
      np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_iterator_state(shakespeare, workers):
  it = iter(_dataset(shakespeare, num_workers=workers))
  _take(it, 5)
  state = it.get_state()
  expected = _take(it, 6)
  data_lib.close(it)
  resumed = iter(_dataset(shakespeare, num_workers=workers))
  resumed.set_state(state)
  _assert_same(_take(resumed, 6), expected)
  data_lib.close(resumed)


def test_state_survives_json(shakespeare):
  it = iter(_dataset(shakespeare))
  _take(it, 3)
  state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
  expected = _take(it, 2)
  resumed = iter(_dataset(shakespeare))
  resumed.set_state(state)
  _assert_same(_take(resumed, 2), expected)


@pytest.mark.parametrize("before,after,workers,steps", [
    (2, 1, (0, 0), 3), (1, 2, (0, 0), 3), (2, 4, (0, 0), 3),
    (2, 1, (2, 2), 3),  # Grain worker pools on both sides (lanes strided over workers)
    (2, 1, (2, 0), 0)])  # saved before the worker pool started (every worker lists every lane)
def test_data_position_moves_to_another_process_count(shakespeare, before, after, workers, steps):
  """A position saved by ``before`` processes after ``steps`` batches, re-split for ``after`` (what a
  checkpoint resumed on fewer or more hosts does): the global batches that follow equal the uninterrupted
  one-process stream. ``workers``: Grain worker processes per process, before and after."""
  single = iter(_dataset(shakespeare))
  _take(single, steps)
  expected = _take(single, 2)

  def process(i, count, resume=False):
    it = loader.TrainIterator(_dataset(shakespeare, process_index=i, process_count=count,
                                       num_workers=workers[resume]), 8, i, count)
    if resume:
      it.set_state(it.resplit(saved))
    return it

  saved = []
  for i in range(before):
    it = process(i, before)
    _take(it, steps)
    saved.append(json.loads(json.dumps(it.get_state())))
    data_lib.close(it)
  parts = []
  for i in range(after):
    it = process(i, after, resume=True)
    parts.append(_take(it, 2))
    data_lib.close(it)
  for step in range(2):
    for k in batch_lib.KEYS:
      np.testing.assert_array_equal(np.concatenate([p[step][k] for p in parts]), expected[step][k])


def test_data_position_refuses_another_global_batch(shakespeare):
  it = iter(_dataset(shakespeare))
  _take(it, 2)
  bigger = loader.TrainIterator(_dataset(shakespeare, global_batch=16, process_count=2), 16, 0, 2)
  with pytest.raises(DataError, match="global_batch_size changed"):
    bigger.resplit([it.get_state()])
  with pytest.raises(DataError, match="global_batch_size changed"):
    iter(_dataset(shakespeare, global_batch=16)).set_state(it.get_state())


def test_checkpoint_whose_data_item_grain_wrote_resumes_the_stream(shakespeare, tmp_path):
  """Checkpoints written before jaxtrain.checkpoint.DataPosition held the data position in Grain's Orbax handler's
  format (its item ``data``): the checkpointer restores it into the train iterator, which goes on exactly."""
  it = iter(_dataset(shakespeare))
  _take(it, 3)
  with ocp.CheckpointManager(tmp_path, item_names=("state", "data", "meta", "config")) as old:  # the old layout
    old.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": np.arange(4.0, dtype=np.float32)}),
                                        data=grain.checkpoint.CheckpointSave(it), meta=ocp.args.JsonSave({}),
                                        config=ocp.args.JsonSave({})))
  assert [f for f in os.listdir(tmp_path / "3" / "data") if f.endswith(".json")] == ["process_0-of-1.json"]
  expected = _take(it, 2)
  resumed = loader.TrainIterator(_dataset(shakespeare), 8, 0, 1)
  ckpt = checkpoint_lib.PersistentTier(tmp_path)
  try:
    state, _, _ = checkpoint_lib.Checkpointer([ckpt]).restore({"w": jax.ShapeDtypeStruct((4,), np.float32)}, resumed)
  finally:
    ckpt.close()
  np.testing.assert_array_equal(state["w"], np.arange(4.0))
  _assert_same(_take(resumed, 2), expected)


@pytest.fixture(scope="module")
def two_processes(shakespeare, tmp_path_factory):
  """What each of 2 real processes read (tests/data_worker.py): its lanes' documents of the first epoch, the
  first global batch assembled across both, and its share of the eval batches."""
  tmp = tmp_path_factory.mktemp("two_processes")
  args = ["--data", shakespeare, "--global_batch=8", "--seq_len=64", "--seed=3"]
  outs = ["--out", os.fspath(tmp / "p{}.json"), "--eval_out", os.fspath(tmp / "p{}.npz")]
  results = multiprocess.run("tests/data_worker.py", args + outs, timeout=300)
  for r in results:
    assert r.returncode == 0, r.stderr[-3000:]
  evals = [dict(np.load(tmp / f"p{i}.npz")) for i in range(2)]
  return {"train": [json.loads((tmp / f"p{i}.json").read_text()) for i in range(2)], "eval": evals}


def test_two_processes_split_the_epoch_and_build_the_same_global_batch(shakespeare, two_processes):
  seen = two_processes["train"]
  # Disjoint, and together every training document of the epoch exactly once.
  src = loader.TokenSource(shakespeare, loader.load_manifest(shakespeare), "train")
  every = sorted(hashlib.sha256(src[i].tobytes()).hexdigest() for i in range(len(src)))
  assert not set(seen[0]["docs"]) & set(seen[1]["docs"])
  assert sorted(seen[0]["docs"] + seen[1]["docs"]) == every
  # The assembled global batch equals the one-process batch for the same seed.
  single = next(iter(_dataset(shakespeare, global_batch=8, seed=3)))
  for k in batch_lib.KEYS:
    np.testing.assert_array_equal(np.asarray(seen[0]["batch"][k]), single[k])
    np.testing.assert_array_equal(np.asarray(seen[1]["batch"][k]), single[k])


def _lane_documents(src, lane, tokens, seed=0, lanes=8):
  """The ids of lane ``lane``'s documents as the loader's docstring specifies them (documents lane,
  lane + lanes, ... of the seeded shuffle), as many as hold ``tokens`` tokens."""
  order, doc_ids, size = grain.MapDataset.range(len(src)).seed(seed).shuffle(), [], 0
  while size < tokens:
    doc_ids.append(order[lane + lanes * len(doc_ids)])
    size += src[doc_ids[-1]].size
  return doc_ids


def test_packed_batch_masks_document_boundaries(shakespeare):
  """Lane r packs its documents end to end and cuts them into rows of seq_len + 1 tokens. Every field of its
  first rows is rebuilt here from the documents alone: each document is one segment (ids 1, 2, ... change
  exactly where a document ends), its positions run 0, 1, 2, ... from its start (a document cut off at a row's
  end goes on in the lane's next row, its positions counting on), and its last token's target is masked (the
  next token belongs to another document)."""
  src = loader.TokenSource(shakespeare, loader.load_manifest(shakespeare), "train")
  batches = _take(iter(_dataset(shakespeare, seq_len=256)), 3)
  n = len(batches) * 257
  for row in range(8):
    doc_ids = _lane_documents(src, row, n)
    docs = [src[i] for i in doc_ids]
    tokens = np.concatenate(docs)[:n].reshape(-1, 257)
    doc = np.repeat(np.arange(len(docs)), [d.size for d in docs])[:n].reshape(-1, 257)  # each token's document
    pos = np.concatenate([np.arange(d.size) for d in docs])[:n].reshape(-1, 257)  # its position in it
    for b, t, d, p in zip(batches, tokens, doc, pos):
      np.testing.assert_array_equal(b["inputs"][row], t[:-1])
      np.testing.assert_array_equal(b["targets"][row], t[1:])
      np.testing.assert_array_equal(b["positions"][row], p[:-1])
      np.testing.assert_array_equal(b["segment_ids"][row], d[:-1] - d[0] + 1)
      np.testing.assert_array_equal(b["loss_mask"][row], d[1:] == d[:-1])
      np.testing.assert_array_equal(b["doc_ids"][row], np.asarray(doc_ids)[d[:-1]])
  segments = np.stack([b["segment_ids"] for b in batches])
  assert (segments.max(axis=-1) >= 2).any(), "no row holds two documents: packing is not tested"
  assert (np.stack([b["positions"] for b in batches])[..., 0] > 0).any(), "no row goes on with a cut document"


def test_padding_mode_masks_padding(shakespeare):
  """Without packing, lane r's rows hold the starts of its documents, one each (seq_len + 1 tokens at most, the
  rest dropped), then padding: segment 0, position 0, no loss."""
  src = loader.TokenSource(shakespeare, loader.load_manifest(shakespeare), "train")
  order = grain.MapDataset.range(len(src)).seed(0).shuffle()
  batches = _take(iter(_dataset(shakespeare, seq_len=128, packing=False)), 2)
  segments = np.stack([b["segment_ids"] for b in batches])
  assert (segments == 0).any() and (segments == 1).all(axis=-1).any()  # padded rows and cut documents
  for step, b in enumerate(batches):
    for row in range(8):
      doc = src[order[row + 8 * step]][:129]
      real = np.arange(129) < doc.size
      tokens = np.pad(doc, (0, 129 - doc.size))
      np.testing.assert_array_equal(b["inputs"][row], tokens[:-1])
      np.testing.assert_array_equal(b["targets"][row], tokens[1:])
      np.testing.assert_array_equal(b["segment_ids"][row], real[:-1])
      np.testing.assert_array_equal(b["positions"][row], np.where(real, np.arange(129), 0)[:-1])
      np.testing.assert_array_equal(b["loss_mask"][row], real[1:])


def test_from_packed_masks():
  tokens = np.array([[5, 6, 7, 8, 9, 0, 0]])
  segs = np.array([[1, 1, 2, 2, 2, 0, 0]])
  pos = np.array([[0, 1, 0, 1, 2, 0, 0]])
  b = batch_lib.from_packed(tokens, segs, pos)
  np.testing.assert_array_equal(b["loss_mask"][0], [1, 0, 1, 1, 0, 0])


def test_logits_of_a_document_ignore_its_row_neighbours(shakespeare, make_config):
  config = make_config(fsdp=8)
  run = trainer.build(config)
  params = trainer.init_state(run).params
  b = next(iter(_dataset(shakespeare, seq_len=128)))
  row = int(np.argmax((b["segment_ids"] == 2).any(axis=1)))
  assert (b["segment_ids"][row] == 2).any(), "no row holds two documents"
  other = {k: v.copy() for k, v in b.items()}
  first_doc = other["segment_ids"][row] == 1
  other["inputs"][row][first_doc] = (other["inputs"][row][first_doc] + 11) % 256
  apply = jax.jit(lambda p, x: run.model.apply(p, x["inputs"], x["positions"], x["segment_ids"]))
  with jax.set_mesh(run.mesh):
    a, c = np.asarray(apply(params, b)), np.asarray(apply(params, other))
  np.testing.assert_allclose(a[row][~first_doc], c[row][~first_doc], atol=1e-5)
  assert not np.allclose(a[row][first_doc], c[row][first_doc])


def _eval_documents(root):
  """The eval split's documents, read straight from its shards (not through jaxtrain's reader)."""
  from array_record.python.array_record_module import ArrayRecordReader
  manifest, docs = loader.load_manifest(root), []
  for shard in (s for s in manifest["shards"] if s["split"] == "eval"):
    reader = ArrayRecordReader(os.fspath(pathlib.Path(root, shard["file"])))
    docs += [np.frombuffer(r, manifest["dtype"]).astype(np.int32) for r in reader.read_all()]
    reader.close()
  assert len(docs) == manifest["splits"]["eval"]["documents"] > 1
  return docs


def _assert_eval_split_once(batches, docs, seq_len=64, global_batch=8):
  """The global eval ``batches`` hold the eval documents' tokens exactly once, in order: rows of seq_len + 1
  tokens (a row's last token is only its last input's target), the last global batch padded with zeros that
  count nothing; a target counts exactly when it continues its input's document."""
  row, total = seq_len + 1, sum(d.size for d in docs)
  assert len(batches) == -(-total // (row * global_batch))
  size = len(batches) * global_batch * row
  tokens = np.pad(np.concatenate(docs), (0, size - total)).reshape(-1, row)
  doc = np.repeat(np.arange(1, len(docs) + 1), [d.size for d in docs])  # each token's document (0: padding)
  doc = np.pad(doc, (0, size - total)).reshape(-1, row)
  got = {k: np.concatenate([b[k] for b in batches]) for k in batch_lib.KEYS}
  np.testing.assert_array_equal(got["inputs"], tokens[:, :-1])
  np.testing.assert_array_equal(got["targets"], tokens[:, 1:])
  np.testing.assert_array_equal(got["segment_ids"] > 0, doc[:, :-1] > 0)
  np.testing.assert_array_equal(got["loss_mask"], (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] > 0))


def test_eval_batches_cover_the_eval_split_once(shakespeare, two_processes):
  docs = _eval_documents(shakespeare)
  single = loader.eval_batches(shakespeare, loader.load_manifest(shakespeare), seq_len=64, global_batch=8,
                               process_index=0, process_count=1)
  _assert_eval_split_once(single, docs)
  # Two processes (real ones, as training opens its eval batches): each has every batch, and their rows
  # together (process 0's then process 1's) make the same global batches.
  evals = two_processes["eval"]
  assert len(evals[0]["inputs"]) == len(evals[1]["inputs"])
  _assert_eval_split_once([{k: np.concatenate([e[k][i] for e in evals]) for k in batch_lib.KEYS}
                           for i in range(len(evals[0]["inputs"]))], docs)


# ---------------------------------------------------------------------------------------------- prepare_data


def _corpus(folder: pathlib.Path, duplicates: int) -> int:
  """Writes unique documents over a text file and a JSONL file, then `duplicates` exact copies."""
  rng = np.random.default_rng(0)
  docs = [" ".join(rng.choice(WORDS, rng.integers(5, 40))) + f" #{i}" for i in range(300)]
  folder.mkdir(parents=True)
  (folder / "a.txt").write_text("\n\n".join(docs[:150]) + "\n")
  lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[150:])]
  lines += [json.dumps({"text": docs[i * 7]}) for i in range(duplicates)]  # copies of earlier documents
  (folder / "b.jsonl").write_text("\n".join(lines) + "\n")
  return len(docs)


def _prepare_cli(*args, timeout=300):
  return forked.run(["tools/prepare_data.py", *args], timeout=timeout)


def test_prepare_removes_duplicates_and_is_deterministic(tmp_path):
  unique = _corpus(tmp_path / "in", duplicates=9)
  runs = []
  for name, extra in (("one", []), ("two", []), ("par", ["--workers=2"])):
    r = _prepare_cli(f"--input={tmp_path / 'in'}", f"--output={tmp_path / name}", "--seed=5", *extra)
    assert r.returncode == 0, r.stderr
    runs.append(tmp_path / name)
  manifest = json.loads((runs[0] / "manifest.json").read_text())
  assert manifest["duplicates_removed"] == 9 and manifest["documents"] == unique
  assert {"documents", "tokens", "duplicates_removed", "tokenizer", "vocab_size", "shards"} <= set(manifest)
  assert manifest["tokenizer"] == "byte" and manifest["vocab_size"] == 256
  assert "9 duplicates removed" in r.stdout
  for other in runs[1:]:
    assert sorted(os.listdir(other)) == sorted(os.listdir(runs[0]))
    for f in os.listdir(runs[0]):
      assert (other / f).read_bytes() == (runs[0] / f).read_bytes(), f
  for shard in manifest["shards"]:
    assert hashlib.sha256((runs[0] / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]


def test_prepare_reads_parquet_and_globs(tmp_path):
  pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
  (tmp_path / "in").mkdir()
  pq.write_table(pa.table({"body": ["first document", "second one", "first document"]}),
                 tmp_path / "in" / "x.parquet")
  (tmp_path / "in" / "y.txt").write_text("third\n\nfourth")
  manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(tmp_path / "in" / "*.parquet"),
                                                     os.fspath(tmp_path / "in" / "y.txt")],
                                             output=os.fspath(tmp_path / "out"), field="body",
                                             eval_fraction=0.0, progress=False))
  assert manifest["documents"] == 4 and manifest["duplicates_removed"] == 1


def test_prepare_with_hf_and_sentencepiece_tokenizers(tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  spm = pytest.importorskip("sentencepiece")
  corpus = tmp_path / "c.txt"
  text = prepare.BUNDLED.read_text()[:200_000]
  corpus.write_text(text)
  hf = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
  hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  hf.train_from_iterator([text], tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
  hf.save(os.fspath(tmp_path / "tok.json"))
  spm.SentencePieceTrainer.train(input=os.fspath(corpus), model_prefix=os.fspath(tmp_path / "sp"),
                                 vocab_size=200, model_type="bpe", minloglevel=2)
  for tok_file, kind, vocab in ((tmp_path / "tok.json", "hf:", hf.get_vocab_size()),
                                (tmp_path / "sp.model", "sentencepiece:", 200)):
    out = tmp_path / f"out-{kind[:-1]}"
    manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(corpus)], output=os.fspath(out),
                                               tokenizer=os.fspath(tok_file), progress=False))
    assert manifest["tokenizer"].startswith(kind) and manifest["vocab_size"] == vocab
    assert manifest["tokens"] < 0.75 * len(text)  # real subword tokens, not bytes
    docs = loader.TokenSource(os.fspath(out), manifest, "train")
    assert max(int(docs[i].max()) for i in range(len(docs))) < vocab


def test_prepare_large_vocab_writes_uint32_tokens(tmp_path):
  """A vocabulary over 65,536 ids is stored as uint32, and ids above 65,535 read back as they were written."""
  tokenizers = pytest.importorskip("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.save(os.fspath(tmp_path / "big.json"))
  rng = np.random.default_rng(0)
  docs = [[65_535, 65_536, 69_999, 1]] + [rng.integers(0, 70_000, rng.integers(3, 30)).tolist() for _ in range(19)]
  (tmp_path / "c.txt").write_text("\n\n".join(" ".join(f"w{i}" for i in d) for d in docs) + "\n")
  manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(tmp_path / "c.txt")], output=os.fspath(tmp_path / "o"),
                                             tokenizer=os.fspath(tmp_path / "big.json"), progress=False))
  assert manifest["vocab_size"] == 70_000 and manifest["dtype"] == "uint32"
  back = [loader.TokenSource(os.fspath(tmp_path / "o"), manifest, split) for split in ("train", "eval")]
  assert sorted(src[i].tolist() for src in back for i in range(len(src))) == sorted(docs)


# ------------------------------------------------------------------------------------------------- bad input


@pytest.mark.slow
def test_prepare_bad_inputs(tmp_path):
  (tmp_path / "empty.txt").write_text("\n\n")
  (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "keep.txt").write_text("precious")
  cases = [
      ([f"--input={tmp_path / 'missing.txt'}", f"--output={tmp_path / 'o1'}"], "missing.txt: no such file"),
      ([f"--input={tmp_path / 'empty.txt'}", f"--output={tmp_path / 'o2'}"], "the input holds no documents"),
      ([f"--input={tmp_path / 'latin1.txt'}", f"--output={tmp_path / 'o3'}"], "latin1.txt:1: not valid UTF-8 "
                                                                              "(byte 3"),
      ([f"--input={prepare.BUNDLED}", f"--output={tmp_path / 'out'}"], "output folder exists and is not empty"),
  ]
  for r, (_, message) in zip(forked.run_many([["tools/prepare_data.py", *args] for args, _ in cases]), cases):
    errors = [line for line in r.stderr.splitlines() if line.startswith("prepare_data: error:")]
    assert r.returncode == 2 and len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr
  assert os.listdir(tmp_path / "out") == ["keep.txt"] and (tmp_path / "out" / "keep.txt").read_text() == "precious"
  assert sorted(os.listdir(tmp_path)) == ["empty.txt", "latin1.txt", "out"]  # no output, no temporary folder


def _main(*args):
  return forked.run(["-m", "jaxtrain.main", "--config=configs/tiny.py", *args])


@pytest.fixture
def broken_copies(shakespeare, tmp_path):
  def copy(name, damage):
    target = tmp_path / name
    target.mkdir()
    for f in os.listdir(shakespeare):
      (target / f).write_bytes(pathlib.Path(shakespeare, f).read_bytes())
    damage(target)
    return target
  return copy


def _flip_byte(folder):
  shard = folder / "train-00000-of-00001.array_record"
  data = bytearray(shard.read_bytes())
  data[len(data) // 2] ^= 0xFF
  shard.write_bytes(bytes(data))


def _truncate(folder):
  shard = folder / "train-00000-of-00001.array_record"
  shard.write_bytes(shard.read_bytes()[:1000])


def _name_a_shard_outside(folder):
  manifest = json.loads((folder / "manifest.json").read_text())
  manifest["shards"][-1]["file"] = "../corrupt/train-00000-of-00001.array_record"  # another folder's shard
  (folder / "manifest.json").write_text(json.dumps(manifest))


def _contents(*folders):
  return {os.fspath(f / name): (f / name).read_bytes() for f in folders for name in sorted(os.listdir(f))}


@pytest.mark.slow
def test_training_bad_data(broken_copies, tmp_path):
  (tmp_path / "empty").mkdir()
  corrupt = broken_copies("corrupt", _flip_byte)
  truncated = broken_copies("truncated", _truncate)
  outside = broken_copies("outside", _name_a_shard_outside)
  cases = [
      ([f"--config.data.path={tmp_path / 'nope'}"], "nope: no such data folder"),
      ([f"--config.data.path={tmp_path / 'empty'}"], "no manifest.json"),
      ([f"--config.data.path={corrupt}"], "train-00000-of-00001.array_record: shard checksum does not match"),
      ([f"--config.data.path={truncated}"], "train-00000-of-00001.array_record: shard is truncated"),
      ([f"--config.data.path={outside}"], "outside/manifest.json: names the shard '../corrupt/train-00000-of-"
                                           "00001.array_record', not a file name in its folder"),
      ([f"--config.data.path={truncated.parent / 'corrupt'}", "--config.data.verify_checksums=False",
        "--config.model.vocab_size=128"], "need vocab_size 256 (tokenizer byte) but model.vocab_size=128"),
      ([f"--config.data.path={corrupt}", "--config.data.verify_checksums=False",
        f"--config.data.tokenizer={tmp_path / 'nope.model'}"], "nope.model: no such tokenizer file or folder"),
  ]
  before = _contents(corrupt, truncated, outside)
  results = forked.run_many([["-m", "jaxtrain.main", "--config=configs/tiny.py",
                              f"--config.workdir={tmp_path / f'run{i}'}", *args] for i, (args, _) in enumerate(cases)])
  for i, (r, (args, message)) in enumerate(zip(results, cases)):
    errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-2000:]
    assert message in errors[0], errors
    assert "Traceback" not in r.stderr
    assert not (tmp_path / f"run{i}").exists(), args  # refused before the workdir was created
  assert _contents(corrupt, truncated, outside) == before  # the data is only read


def test_a_wrong_tokenizer_folder_says_what_a_tokenizer_folder_holds(tmp_path):
  """A folder without tokenizer.json: one line with the files a tokenizer folder needs, what this one holds, and the
  folder or file inside it to pass instead when there is one."""
  model = tmp_path / "model"
  (model / "hf").mkdir(parents=True)
  for name in ("config.json", "model.safetensors", "hf/tokenizer.json"):
    (model / name).write_text("{}")
  (tmp_path / "sp").mkdir()
  (tmp_path / "sp" / "tokenizer.model").write_bytes(b"")
  needs = "is not a tokenizer folder: a folder needs tokenizer.json (tokenizer_config.json for the special tokens " \
          "and the chat template), and this one holds "
  for spec, line in [(model, f"{model}: {needs}config.json, hf/, model.safetensors; pass {model / 'hf'}, the folder "
                              "that holds tokenizer.json"),
                     (tmp_path / "sp", f"{tmp_path / 'sp'}: {needs}tokenizer.model; pass the SentencePiece model "
                                       f"{tmp_path / 'sp' / 'tokenizer.model'} itself"),
                     (model / "hf" / "nope", "nope: no such tokenizer file or folder; pass a Hugging Face tokenizer "
                                             "folder (tokenizer.json, with tokenizer_config.json")]:
    with pytest.raises(DataError) as e:
      tokenizers.load(os.fspath(spec))
    assert line in str(e.value), str(e.value)


def test_tokenizer_mismatch_is_refused(shakespeare, tmp_path):
  spm = pytest.importorskip("sentencepiece")
  corpus = tmp_path / "c.txt"
  corpus.write_text(prepare.BUNDLED.read_text()[:50_000])
  spm.SentencePieceTrainer.train(input=os.fspath(corpus), model_prefix=os.fspath(tmp_path / "sp"),
                                 vocab_size=100, minloglevel=2)
  r = _main(f"--config.workdir={tmp_path / 'run'}", f"--config.data.path={shakespeare}",
            f"--config.data.tokenizer={tmp_path / 'sp.model'}")
  errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert r.returncode == 2 and len(errors) == 1 and "prepared with tokenizer byte, but data.tokenizer=" in errors[0]
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_main_trains_on_prepared_data(shakespeare, tmp_path):
  r = _main(f"--config.workdir={tmp_path}", f"--config.data.path={shakespeare}", "--config.train.steps=20",
            "--config.train.global_batch_size=8", "--config.data.seq_len=64")
  assert r.returncode == 0, r.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  records = [m for m in records if "loss" in m]  # training records (not eval ones)
  assert [m["step"] for m in records] == [10, 20]
  # Steps 10 and 20 trained on batches 10 and 20 of the prepared data (global batch 8, seq_len 64, seed 0): a
  # step's token count is its batch's loss mask.
  stream = _take(iter(_dataset(shakespeare, seq_len=64, global_batch=8)), 20)
  assert [m["tokens"] for m in records] == [stream[9]["loss_mask"].sum(), stream[19]["loss_mask"].sum()]
  # Recorded from this command (CPU, 8 devices; runs repeat bit for bit; 1 or 4 devices differ by < 4e-6 at
  # step 20). Update both if the model, its initialisation, the optimizer or the data change on purpose.
  np.testing.assert_allclose([m["loss"] for m in records], [4.564189434051514, 3.302764654159546], rtol=1e-5)
  assert "Exception ignored" not in r.stderr


def test_batches_record_their_documents(shakespeare):
  manifest = loader.load_manifest(shakespeare)
  b = next(iter(_dataset(shakespeare, seq_len=128)))
  src = loader.TokenSource(shakespeare, manifest, "train")
  for row in range(8):
    for seg in np.unique(b["segment_ids"][row]):
      piece = b["segment_ids"][row] == seg
      (doc_id,) = np.unique(b["doc_ids"][row][piece])
      start = b["positions"][row][piece][0]
      doc = src[int(doc_id)]
      np.testing.assert_array_equal(b["inputs"][row][piece], doc[start:start + piece.sum()])
      shard, index = loader.locate(manifest, "train", int(doc_id))
      assert shard.startswith("train-") and 0 <= index < manifest["splits"]["train"]["documents"]

"""Token ids outside [0, model.vocab_size) are refused, never clipped, from every source (jaxtrain.data.ids): prepared
folders, SFT (chat) data, raw files, mixtures and registered sources, naming the source, the document, the
position, the id and the vocabulary; the run ends with one line and exit 2 and trains nothing on them."""

import json
import os
import pathlib
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain.data import batch as batch_lib
from jaxtrain.data import ids, prepare
from jaxtrain.errors import DataError
from tests import forked
from tests.conftest import small_config

WORDS = "the of and to in a is that for it as was with be by on not he I this are or his from at which".split()
BAD_ID, VOCAB, BATCH, SEQ = 300, 256, 8, 32


@pytest.fixture(scope="module")
def sparse_tokenizer(tmp_path_factory):
  """A word-level tokenizer.json whose ids are not contiguous: it reports a vocabulary of len(WORDS) + 2 tokens
  (which fits model.vocab_size=256, so every config-time check passes) and gives "thou" the id 300."""
  tk = pytest.importorskip("tokenizers")
  vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}, "thou": BAD_ID}
  tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
  path = tmp_path_factory.mktemp("tok") / "sparse.json"
  tok.save(os.fspath(path))
  assert tok.get_vocab_size(with_added_tokens=True) < VOCAB and tok.encode("the thou").ids == [1, BAD_ID]
  return os.fspath(path)


def _texts(n: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, int(rng.integers(10, 30)))) for _ in range(n)]


def _with_thou(text: str, at: int) -> str:
  """``text`` with its word ``at`` replaced by "thou" (token ``at`` of the document: one token per word)."""
  words = text.split()
  words[at] = "thou"
  return " ".join(words)


def _jsonl(path: pathlib.Path, texts: list[str]) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  return path


def _config(tok: str, **data):
  c = small_config("/tmp/unused")
  c.data.update(tokenizer=tok, seq_len=SEQ, **data)
  c.train.global_batch_size = BATCH
  return config_lib.resolve(c)


def _first_error(c, steps: int = 40) -> str:
  """The training stream of ``c`` through data.to_global (the loop's assembly of each step's batch) until it
  refuses one: that error's message. Fails if ``steps`` batches pass."""
  sharding = NamedSharding(jax.make_mesh((BATCH,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)), P("data"))
  it = data_lib.open_train(c)
  try:
    for _ in range(steps):
      try:
        data_lib.to_global(next(it), sharding, c)
      except ids.TokenIdError as e:
        assert isinstance(e, DataError) and "\n" not in str(e)
        return str(e)
  finally:
    data_lib.close(it)
  raise AssertionError(f"{steps} batches passed the check")


def _problem(position: int) -> str:
  return f"token id {BAD_ID} at position {position} of the document ("


FIX = f"model.vocab_size={VOCAB}); set model.vocab_size to the tokenizer's vocabulary size (at least {BAD_ID + 1}), or "


def _shard_tokens(root: str) -> list[tuple[str, int, np.ndarray]]:
  """(shard file, record number, token ids) of every record of a prepared folder, read with ArrayRecord's own
  reader (SFT records: the ids before the flags), not through jaxtrain's."""
  from array_record.python.array_record_module import ArrayRecordReader
  manifest = json.loads(pathlib.Path(root, "manifest.json").read_text())
  itemsize, sft, out = np.dtype(manifest["dtype"]).itemsize, manifest.get("loss_mask", False), []
  for shard in manifest["shards"]:
    file = os.fspath(pathlib.Path(root, shard["file"]))
    reader = ArrayRecordReader(file)
    for k, raw in enumerate(reader.read_all()):
      n = len(raw) // (itemsize + sft)
      out.append((file, k, np.frombuffer(raw[:n * itemsize], manifest["dtype"])))
    reader.close()
  return out


def _where_prepared(root: str) -> tuple[str, int]:
  """The one record of a prepared folder that holds BAD_ID: 'file (record k)' and the id's position."""
  (hit,) = [(f, k, int(np.flatnonzero(t == BAD_ID)[0])) for f, k, t in _shard_tokens(root) if (t == BAD_ID).any()]
  return f"{hit[0]} (record {hit[1]})", hit[2]


def test_prepared_folder(sparse_tokenizer, tmp_path):
  texts = _texts(60, 0)
  texts[17] = _with_thou(texts[17], 4)
  out = os.fspath(tmp_path / "prepared")
  manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(_jsonl(tmp_path / "in.jsonl", texts))], output=out,
                                             tokenizer=sparse_tokenizer, eval_fraction=0.0, progress=False))
  assert manifest["vocab_size"] < VOCAB  # the manifest's check (kept, at start) cannot see it
  where, position = _where_prepared(out)
  assert position == 4
  message = _first_error(_config(sparse_tokenizer, source="arrayrecord", path=out))
  assert message.startswith(f"{where}: {_problem(4)}") and FIX + "re-prepare the data" in message, message


def test_prepare_refuses_an_id_its_records_cannot_hold(tmp_path):
  """A tokenizer reporting 3 tokens gets uint16 records; its id 70000 would wrap to 4464 there: refused instead."""
  tk = pytest.importorskip("tokenizers")
  tok = tk.Tokenizer(tk.models.WordLevel({"[UNK]": 0, "the": 1, "thou": 70_000}, unk_token="[UNK]"))
  tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
  tok.save(os.fspath(tmp_path / "wide.json"))
  src = _jsonl(tmp_path / "in.jsonl", ["the the the", "the thou the"])
  with pytest.raises(DataError, match=f"^{re.escape(os.fspath(src))}: the tokenizer gives token id 70000, more than "
                                      "its uint16 records hold"):
    prepare.prepare(prepare.Options(inputs=[os.fspath(src)], output=os.fspath(tmp_path / "out"),
                                    tokenizer=os.fspath(tmp_path / "wide.json"), eval_fraction=0.0, progress=False))
  assert not (tmp_path / "out").exists()


def test_chat_data(sparse_tokenizer, tmp_path):
  """SFT records (the plain format of a bare tokenizer.json): "thou" in a response is a trained target; in a
  prompt it is an input the model looks up, refused as well."""
  rng = np.random.default_rng(1)
  records = [{"prompt": " ".join(rng.choice(WORDS, 5)), "response": t} for t in _texts(50, 1)]
  for i, field, at in ((11, "response", 3), (23, "prompt", 2)):
    rows = [dict(r) for r in records]
    rows[i][field] = _with_thou(rows[i][field], at)
    src = tmp_path / field / "chat.jsonl"
    src.parent.mkdir()
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = os.fspath(tmp_path / field / "prepared")
    manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(src)], output=out, tokenizer=sparse_tokenizer,
                                               eval_fraction=0.0, progress=False))
    assert manifest["loss_mask"] is True
    where, position = _where_prepared(out)
    assert position == (5 + at if field == "response" else at)  # the prompt's 5 tokens come first
    message = _first_error(_config(sparse_tokenizer, source="arrayrecord", path=out))
    assert message.startswith(f"{where}: {_problem(position)}") and FIX in message, (field, message)


def test_raw_files_training_and_eval(sparse_tokenizer, tmp_path):
  texts = _texts(80, 2)
  texts[50] = _with_thou(texts[50], 7)  # part1.jsonl, line 11
  _jsonl(tmp_path / "raw" / "part0.jsonl", texts[:40])
  _jsonl(tmp_path / "raw" / "part1.jsonl", texts[40:])
  c = _config(sparse_tokenizer, source="raw", path=os.fspath(tmp_path / "raw"))
  message = _first_error(c)
  assert message.startswith(f"{tmp_path / 'raw' / 'part1.jsonl'}:11: {_problem(7)}"), message
  assert FIX + "set data.tokenizer to the model's tokenizer" in message
  # The eval batches are checked when the evaluator takes them, naming the eval file's line.
  evals = _texts(10, 3)
  evals[6] = _with_thou(evals[6], 0)
  c = _config(sparse_tokenizer, source="raw", path=os.fspath(tmp_path / "raw" / "part0.jsonl"),
              eval_path=os.fspath(_jsonl(tmp_path / "eval.jsonl", evals)))
  with pytest.raises(ids.TokenIdError) as e:
    data_lib.eval_sets(c)
  assert str(e.value).startswith(f"{tmp_path / 'eval.jsonl'}:7: {_problem(0)}"), e.value


def test_mixture_names_the_component(sparse_tokenizer, tmp_path):
  good, bad = _texts(40, 4), _texts(40, 5)
  bad[9] = _with_thou(bad[9], 2)
  paths = {name: os.fspath(_jsonl(tmp_path / name / "docs.jsonl", texts).parent)
           for name, texts in (("good", good), ("web", bad))}
  c = _config(sparse_tokenizer, source="arrayrecord", mixture=f"good={paths['good']}:0.5,web={paths['web']}:0.5")
  message = _first_error(c)
  assert message.startswith(f"data.mixture (web): {tmp_path / 'web' / 'docs.jsonl'}:10: {_problem(2)}"), message


def test_the_check_refuses_inputs_everywhere_and_targets_under_the_loss_mask():
  """A registered source may pad targets with an id of its own under loss mask 0; never an input."""
  tokens = np.arange(2 * 9, dtype=np.int32).reshape(2, 9) % 200
  where = lambda doc: ("data.source 'mine'" + (f", document {doc}" if doc is not None else ""), "fix it")  # noqa: E731
  batch = batch_lib.from_tokens(tokens)
  ids.check(batch, VOCAB, where)  # in range: nothing
  batch["targets"][1, 5:], batch["loss_mask"][1, 5:] = -100, 0  # padded targets, not counted: accepted
  ids.check(batch, VOCAB, where)
  batch["loss_mask"][1, 6] = 1  # one of them counted: refused
  with pytest.raises(ids.TokenIdError) as e:
    ids.check(batch, VOCAB, where)
  assert str(e.value) == ("data.source 'mine': token id -100 at position 7 of the document (target row 1, column 6 "
                          "of this process's batch) is outside the model's vocabulary [0, 256) (model.vocab_size=256)"
                          "; token ids are never negative: fix it")
  batch = batch_lib.from_tokens(tokens)
  batch["inputs"][0, 3] = VOCAB  # the first id past the table
  batch["doc_ids"] = np.full((2, 8), 41, np.int32)
  with pytest.raises(ids.TokenIdError, match=r"^data.source 'mine', document 41: token id 256 at position 3 .*"
                                             r"input row 0, column 3 .*\(at least 257\), or fix it$"):
    ids.check(batch, VOCAB, where)
  batch = batch_lib.from_tokens(tokens)
  batch["targets"][1, 7] = VOCAB + 5  # the row's last token: a target only, position 8 of its document
  with pytest.raises(ids.TokenIdError, match=r"token id 261 at position 8 .*target row 1, column 7"):
    ids.check(batch, VOCAB, where)




_ROWS_CONFIG = '''
import jax
import numpy as np
from jaxtrain import data as data_lib
from jaxtrain.data import batch as batch_lib
from tests.conftest import small_config


class Rows:
  """This process's rows: in range, but for step 3's on process {bad} (id 256 at row 1, column 7; document 301).
  A config file that registers its source: on one process or several."""

  def __init__(self, c):
    self.c, self.step = c, 0

  def __iter__(self):
    return self

  def __next__(self):
    self.step += 1
    rows = self.c.train.global_batch_size // jax.process_count()
    tokens = np.arange(rows * (self.c.data.seq_len + 1)).reshape(rows, -1) % 200
    if self.step == 3 and jax.process_index() == {bad}:
      tokens[1, 7] = 256
    batch = batch_lib.from_tokens(tokens.astype(np.int32))
    batch["doc_ids"] = 100 * self.step + np.arange(rows)[:, None] + 0 * batch["inputs"]
    return batch


data_lib.SOURCES.register("rows_test", data_lib.Source(open_train=Rows, open_eval=lambda c: [],
                                                       provenance=lambda c, step, doc_ids: {{}}, reads_path=False))


def get_config():
  c = small_config("unused", fsdp=8)
  c.data.source = "rows_test"
  c.train.steps = 6
  c.checkpoint.every_steps = 1
  c.metrics.tensorboard = False
  c.mesh.fsdp = -1  # every device of the job
  c.distributed.heartbeat_timeout_s = 5.0
  return c
'''


def test_registered_source_ends_the_run_with_one_line_and_trains_nothing_on_it(tmp_path):
  """End to end: python -m jaxtrain.main on a source registered by the config file. Steps 1 and 2 train and save;
  step 3's batch is refused before it reaches a device: exit 2, one line, no checkpoint or metrics past step 2."""
  config_file = tmp_path / "rows_config.py"
  config_file.write_text(_ROWS_CONFIG.format(bad=0))
  r = forked.run(["-m", "jaxtrain.main", f"--config={config_file}", f"--config.workdir={tmp_path / 'run'}"])
  errors = [line for line in r.stderr.splitlines() if line.startswith("jaxtrain: error:")]
  assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
  assert errors[0] == ("jaxtrain: error: data.source 'rows_test', document 301: token id 256 at position 7 of the "
                       "document (input row 1, column 7 of this process's batch) is outside the model's vocabulary "
                       "[0, 256) (model.vocab_size=256); set model.vocab_size to the tokenizer's vocabulary size (at "
                       "least 257), or fix data.source 'rows_test'"), errors
  assert "Traceback" not in r.stderr
  steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
  assert steps and steps[-1] == 2, steps  # what steps 1 and 2 saved, nothing after
  logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert max(m["step"] for m in logged if "loss" in m) == 2




@pytest.mark.slow
@pytest.mark.parametrize("bad", [0, 1])
def test_a_bad_id_on_one_process_stops_every_process_of_the_job_with_its_line_and_exit_2(tmp_path, bad):
  """Two processes; only process ``bad``'s rows of step 3 hold an id outside the vocabulary. Every process ends with
  exit 2 and the one line that names the document (the others say which process stopped the job), not as a lost
  peer (75, a restart that fails the same way) nor, when the refusing process is the coordinator, as the abort
  that follows the coordination service's end."""
  from tests import multiprocess
  config_file = tmp_path / "rows_config.py"
  config_file.write_text(_ROWS_CONFIG.format(bad=bad))
  procs = multiprocess.start_main([f"--config={config_file}", f"--config.workdir={tmp_path / 'run'}"])
  codes = multiprocess.wait_all(procs, 300)
  errs = [p.err_path.read_text() for p in procs]
  assert codes == [2, 2], [e[-2000:] for e in errs]
  line = ("data.source 'rows_test', document 301: token id 256 at position 7 of the document (input row 1, column 7 "
          "of this process's batch) is outside the model's vocabulary [0, 256) (model.vocab_size=256); set "
          "model.vocab_size to the tokenizer's vocabulary size (at least 257), or fix data.source 'rows_test'")
  for i, err in enumerate(errs):
    said = [x for x in err.splitlines() if x.startswith("jaxtrain: error:")]
    expected = f"jaxtrain: error: {line}" if i == bad else f"jaxtrain: error: process {bad} stopped the job: {line}"
    assert said == [expected], err[-2000:]
    assert "Traceback" not in err and "a process of the job is gone" not in err, err[-2000:]
  assert not (tmp_path / "run" / "restarts").exists() or not list((tmp_path / "run" / "restarts").iterdir())
  steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
  assert steps[-1] == 2, steps

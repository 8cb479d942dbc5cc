"""A run's lineage (jaxtrain/checkpoint/lineage.py): a chain import -> SFT -> DPO -> GRPO -> export, each run
restored from the previous one's workdir with the Hugging Face source and then the import moved away, carries its
tokenizer, chat template and generation config to the export; transformers' greedy completions on the export equal
``jaxtrain.generate --chat`` on the last run, both stopping at EOS; the lineage reads back to the import."""

import hashlib
import json
import os
import runpy
import shutil

import pytest

from jaxtrain import hf
from jaxtrain.checkpoint import lineage
from jaxtrain.data import prepare
from jaxtrain.train import trainer
from tests import forked, harness_data

ANSWER = "the cat sat"
QUESTIONS = ["where is the ball", "when does the train leave", "what boils water", "who wrote the letter",
             "why do birds build nests", "how does the river run", "which book did he read", "where do children play"]


def _jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return os.fspath(path)


def _run(name, tmp_path, parent, imported, objective, steps, lr, **data):
  """A run of the import's own config (its config.py), started from ``parent`` (a workdir)."""
  c = runpy.run_path(os.fspath(imported / "config.py"))["get_config"]()
  c.workdir = os.fspath(tmp_path / name)
  c.checkpoint.restore_from = os.fspath(parent)
  c.data.update(seq_len=48, **data)
  c.train.update(objective=objective, steps=steps, global_batch_size=8, log_every=1, seed=1)
  if objective == "grpo":
    c.data.seq_len = 40
    c.rl.update(group_size=4, max_new_tokens=6)
  c.optim.update(lr=lr, warmup_steps=0, schedule="constant")
  c.metrics.tensorboard = False
  trainer.train(c)
  return tmp_path / name


@pytest.mark.slow
def test_a_chain_of_runs_carries_its_tokenizer_to_an_export_that_generates_as_jaxtrain_does(tmp_path):
  torch = pytest.importorskip("torch", reason="torch (test-only) is not installed: the comparison needs it")
  transformers = pytest.importorskip("transformers", reason="transformers (test-only) is not installed")
  harness_data.hf_model(tmp_path / "src", qwen=True)  # Qwen 3, its BPE tokenizer with a ChatML template
  source_template = json.loads((tmp_path / "src" / "tokenizer_config.json").read_text())["chat_template"]
  hf.import_model(os.fspath(tmp_path / "src"), os.fspath(tmp_path / "import"))
  shutil.move(tmp_path / "src", tmp_path / "gone" / "src")  # the source is gone after the import
  chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}]}
           for q in QUESTIONS * 8]
  pairs = [{"prompt": q, "chosen": ANSWER, "rejected": "the sun rises"} for q in QUESTIONS * 4]
  prompts = [{"prompt": [{"role": "user", "content": q}], "answer": ANSWER} for q in QUESTIONS]
  tokenizer = os.fspath(tmp_path / "import" / "hf")
  for name, records, fmt in (("sft", chats, "sft"), ("pairs", pairs, "preference")):
    prepare.prepare(prepare.Options(inputs=[_jsonl(tmp_path / f"{name}.jsonl", records)],
                                    output=os.fspath(tmp_path / f"{name}_data"), progress=False, eval_fraction=0.0,
                                    format=fmt, seq_len=48, tokenizer=tokenizer))

  imported = tmp_path / "import"
  sft = _run("sft", tmp_path, imported, imported, "lm", 12, 1e-2, source="arrayrecord",
             path=os.fspath(tmp_path / "sft_data"), tokenizer=tokenizer)
  shutil.move(imported, tmp_path / "gone" / "import")  # and then the import
  imported = tmp_path / "gone" / "import"
  dpo = _run("dpo", tmp_path, sft, imported, "dpo", 1, 1e-4, source="arrayrecord",  # nothing named but the parent
             path=os.fspath(tmp_path / "pairs_data"))
  grpo = _run("grpo", tmp_path, dpo, imported, "grpo", 1, 1e-4, source="prompts",  # data.tokenizer unset: the
              path=_jsonl(tmp_path / "prompts.jsonl", prompts))                    # one the lineage carries
  logged = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines()]
  assert logged[-1]["rl/reward_mean"] > 0  # its prompts were encoded with the model's tokenizer: it answers

  # Every run carries the side files; the lineage reads back to the import.
  for run in (sft, dpo, grpo):
    assert lineage.has_tokenizer(os.fspath(run / "hf")) and (run / "hf" / "generation_config.json").exists()
  manifest = (tmp_path / "sft_data" / "manifest.json").read_bytes()
  assert lineage.read(os.fspath(sft))["data"] == {os.fspath(tmp_path / "sft_data"):
                                                  "sha256:" + hashlib.sha256(manifest).hexdigest()}
  chain = lineage.chain(lineage.read(os.fspath(grpo)))
  assert [link["parent"] for link in chain] == [os.fspath(dpo / "checkpoints" / "1"),
                                                os.fspath(sft / "checkpoints" / "12"),
                                                os.fspath(tmp_path / "import" / "checkpoints" / "0"), None]
  assert chain[3]["import"] == os.fspath(tmp_path / "src") and chain[3]["jaxtrain"]["version"]
  shown = forked.run(["tools/inspect_checkpoint.py", os.fspath(grpo), "--json"], timeout=120)
  assert shown.returncode == 0, shown.stderr[-2000:]
  shown = json.loads(shown.stdout)
  assert shown["lineage"] == chain and "tokenizer_config.json" in shown["side_files"] and shown["step"] == 1

  # The export: a complete Hugging Face folder whose tokenizer renders the source's chat template.
  hf.export_model(os.fspath(grpo), os.fspath(tmp_path / "exported"))
  tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
  assert tok.chat_template == source_template and tok.encode("the cat") != []
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
  new = 12
  eos = transformers.GenerationConfig.from_pretrained(tmp_path / "exported").eos_token_id
  theirs = []
  for q in QUESTIONS[:4]:
    ids = list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"])
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new, eos_token_id=eos,
                           pad_token_id=0)[0, len(ids):].tolist()
    theirs.append(out)
  stops = set(eos if isinstance(eos, list) else [eos])
  assert all(row and row[-1] in stops and len(row) < new for row in theirs), theirs  # every row stopped at EOS
  result = forked.run(["-m", "jaxtrain.generate", f"--checkpoint={grpo}", "--chat", "--format=jsonl",
                       f"--max_new_tokens={new}", *[f"--prompt={q}" for q in QUESTIONS[:4]]], timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  ours = [json.loads(line) for line in result.stdout.splitlines()]
  assert [r["completion"] for r in ours] == [tok.decode(row, skip_special_tokens=True) for row in theirs]
  assert [r["tokens"] + 1 for r in ours] == [len(row) for row in theirs]  # ended at the same EOS (not printed)



def test_data_prepared_with_another_tokenizer_than_the_lineages_is_one_line(tmp_path):
  """A run whose lineage carries a tokenizer (an import's descendant) refuses prepared data of another tokenizer when
  data.tokenizer is left empty (the model would train on ids it does not read as they were meant); data.tokenizer
  set says which tokenizer made the data, and wins."""
  from jaxtrain.data import loader, tokenizers
  from jaxtrain.errors import DataError
  tok, config = harness_data.bpe_tokenizer(qwen=True)
  (tmp_path / "run" / "hf").mkdir(parents=True)
  tok.save(os.fspath(tmp_path / "run" / "hf" / "tokenizer.json"))
  (tmp_path / "run" / "hf" / "tokenizer_config.json").write_text(json.dumps(config))
  carried = lineage.tokenizer_of({"workdir": os.fspath(tmp_path / "run"), "checkpoint": {"restore_from": ""}})
  assert carried == os.fspath(tmp_path / "run" / "hf")
  byte_data = {"vocab_size": 256, "tokenizer": "byte"}
  with pytest.raises(DataError, match=r"data: prepared with tokenizer byte, but the model's lineage carries the "
                     r"tokenizer .*/run/hf, which it was trained with; prepare the data with --tokenizer="):
    loader.check_compatible(byte_data, "data", 320, "", carried)
  loader.check_compatible(byte_data, "data", 320, "byte", carried)  # said: the data's tokenizer is byte-level
  loader.check_compatible({"vocab_size": 300, "tokenizer": tokenizers.load(carried).name}, "data", 320, "", carried)
  assert lineage.tokenizer_of({"workdir": os.fspath(tmp_path / "fresh"), "checkpoint": {"restore_from": ""}}) == ""

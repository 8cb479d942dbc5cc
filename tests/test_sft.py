"""Supervised fine-tuning data: prompt/response and chat JSONL -> tokens with per-token trained flags
(jaxtrain.data.chat, prepare), chat templates rendered as transformers renders them, and the loss mask through
the loader, packing, resume and the train step (prompt tokens get no gradient)."""

import json
import os
import pathlib

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import data as data_lib
from jaxtrain import models
from jaxtrain.config import base_config
from jaxtrain.data import batch as batch_lib
from jaxtrain.data import loader, packing, prepare
from jaxtrain.data import tokenizers as tokenizers_lib
from jaxtrain.train import step as step_lib
from tests import forked
from tests.test_data import _lane_documents, _main, _prepare_cli, _take

WORDS = "the of and to in a is that for it as was with be by on not he I this are or his from at which".split()

# --------------------------------------------------------------------------------------------------- helpers


def _write_jsonl(path: pathlib.Path, records) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in records))
  return path


def _prepare(tmp_path, records, name="out", **opts) -> tuple[str, dict]:
  src = _write_jsonl(tmp_path / f"{name}-in" / "sft.jsonl", records)
  out = tmp_path / name
  manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(src)], output=os.fspath(out), progress=False,
                                             **{"eval_fraction": 0.0, **opts}))
  return os.fspath(out), manifest


def _shard_records(root) -> list[tuple[np.ndarray, np.ndarray]]:
  """Every (tokens, trained flags) record of the shards, in file order, read straight from the record layout
  prepare.py documents (n token ids of the manifest's dtype, then n uint8 flags), not through jaxtrain's reader."""
  from array_record.python.array_record_module import ArrayRecordReader
  manifest, records = json.loads(pathlib.Path(root, "manifest.json").read_text()), []
  itemsize = np.dtype(manifest["dtype"]).itemsize
  for shard in manifest["shards"]:
    reader = ArrayRecordReader(os.fspath(pathlib.Path(root, shard["file"])))
    for raw in reader.read_all():
      n = len(raw) // (itemsize + 1)
      assert n * (itemsize + 1) == len(raw)
      records.append((np.frombuffer(raw[:n * itemsize], manifest["dtype"]).astype(np.int64),
                      np.frombuffer(raw[n * itemsize:], np.uint8).astype(np.int64)))
    reader.close()
  return records


def _by_text(records) -> dict[str, np.ndarray]:
  """Byte-tokenized records keyed by their text: {text: trained flags}."""
  return {bytes(t.astype(np.uint8)).decode("utf-8"): m for t, m in records}


def _flags(*pieces) -> np.ndarray:
  """Expected byte flags: ``pieces`` are (text, trained) in order."""
  return np.concatenate([np.full(len(text.encode("utf-8")), int(on)) for text, on in pieces])


def _sft_records(n=60, seed=0):
  """A mix of prompt/response pairs and chats of varying lengths (some longer than a 32-token row)."""
  rng = np.random.default_rng(seed)

  def words(lo, hi):
    return " ".join(rng.choice(WORDS, rng.integers(lo, hi)))

  records = []
  for i in range(n):
    if i % 2:
      records.append({"prompt": f"Q{i}: {words(2, 12)}?\n", "response": f"A: {words(1, 20)}."})
    else:
      records.append({"messages": [{"role": "system", "content": f"S{i}."},
                                   {"role": "user", "content": words(1, 8)},
                                   {"role": "assistant", "content": words(1, 10)},
                                   {"role": "user", "content": words(1, 5)},
                                   {"role": "assistant", "content": words(2, 15) + f" #{i}"}]})
  return records


# ---------------------------------------------------------------------------------- (a) byte tokenizer, plain


def test_byte_pairs_and_messages_mark_exactly_the_responses(tmp_path):
  records = [
      {"prompt": "Q: 2+2?\n", "response": "A: 4"},
      {"prompt": "Say caf\u00e9: ", "response": "caf\u00e9 \u2014 ok", "extra": 1},
      {"messages": [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "hi "},
                    {"role": "assistant", "content": "hello!"}, {"role": "user", "content": " more?"},
                    {"role": "assistant", "content": " no."}]},
      {"prompt": "Q: 2+2?\n", "response": "A: 4"},  # an exact duplicate
  ]
  root, manifest = _prepare(tmp_path, records)
  assert manifest["format"] == prepare.FORMAT_SFT and manifest["loss_mask"] is True
  assert manifest["sft"]["template"] == "plain" and manifest["duplicates_removed"] == 1
  got = _by_text(_shard_records(root))
  expected = {
      "Q: 2+2?\nA: 4": _flags(("Q: 2+2?\n", 0), ("A: 4", 1)),
      "Say caf\u00e9: caf\u00e9 \u2014 ok": _flags(("Say caf\u00e9: ", 0), ("caf\u00e9 \u2014 ok", 1)),
      "Be brief. hi hello! more? no.": _flags(("Be brief. hi ", 0), ("hello!", 1), (" more?", 0), (" no.", 1)),
  }
  assert sorted(got) == sorted(expected)
  for text, flags in expected.items():
    np.testing.assert_array_equal(got[text], flags, err_msg=text)
  assert manifest["trained_tokens"] == sum(int(f.sum()) for f in expected.values()) == 4 + 12 + 6 + 4
  assert manifest["tokens"] == sum(f.size for f in expected.values())
  # jaxtrain's reader gives the same records as [2, n] (tokens, flags).
  source = loader.TokenSource(root, loader.load_manifest(root), "train")
  assert source.masked and len(source) == 3
  for i in range(3):
    doc = source[i]
    assert doc.shape[0] == 2 and doc.dtype == np.int32
    np.testing.assert_array_equal(doc[1], got[bytes(doc[0].astype(np.uint8)).decode()])


def test_field_names_and_format_flags(tmp_path):
  records = [{"q": "why?", "a": "because", "text": "ignored"}, {"q": "how?", "a": "so"}]
  root, manifest = _prepare(tmp_path, records, prompt_field="q", response_field="a")
  assert manifest["format"] == prepare.FORMAT_SFT
  assert {k: v.tolist() for k, v in _by_text(_shard_records(root)).items()} == {
      "why?because": _flags(("why?", 0), ("because", 1)).tolist(), "how?so": _flags(("how?", 0), ("so", 1)).tolist()}
  # Lines with a text field and no pair / chat are pretraining text (auto), and --format=text forces text.
  _, auto = _prepare(tmp_path, [{"text": "a document"}, {"text": "another"}], name="auto")
  assert auto["format"] == prepare.FORMAT and auto["documents"] == 2 and "loss_mask" not in auto
  _, text = _prepare(tmp_path, [{"prompt": "p", "response": "r", "text": "doc"}], name="text", format="text")
  assert text["format"] == prepare.FORMAT and text["tokens"] == 3


def test_prepare_sft_is_deterministic_and_splits_eval(tmp_path):
  _write_jsonl(tmp_path / "in" / "a.jsonl", _sft_records(30))
  _write_jsonl(tmp_path / "in" / "b.jsonl", _sft_records(40)[30:] + _sft_records(3))  # 3 duplicates
  outs = []
  for name, extra in (("one", []), ("two", []), ("par", ["--workers=2"])):
    r = _prepare_cli(f"--input={tmp_path / 'in'}", f"--output={tmp_path / name}", "--seed=3", "--eval_fraction=0.1",
                     *extra)
    assert r.returncode == 0, r.stderr
    assert "trained (SFT, plain)" in r.stdout and "3 duplicates removed" in r.stdout
    outs.append(tmp_path / name)
  for other in outs[1:]:  # same input and seed: the same bytes, with any number of workers
    assert sorted(os.listdir(other)) == sorted(os.listdir(outs[0]))
    for f in os.listdir(outs[0]):
      assert (other / f).read_bytes() == (outs[0] / f).read_bytes(), f
  manifest = json.loads((outs[0] / "manifest.json").read_text())
  assert manifest["splits"]["eval"]["documents"] == 4 and manifest["splits"]["train"]["documents"] == 36
  assert manifest["splits"]["eval"]["trained_tokens"] + manifest["splits"]["train"]["trained_tokens"] == \
      manifest["trained_tokens"] == sum(s["trained_tokens"] for s in manifest["shards"])
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary folder left


# ----------------------------------------------------------------------------- (b) chat templates (a folder)

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
# ChatML written over several lines: renders right only with trim_blocks and lstrip_blocks (as transformers sets
# them); a default system message, roles checked with raise_exception.
CHATML = """{% if messages[0]['role'] != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
# Llama 3 with {% generation %} blocks: transformers' assistant-token mask is the reference for the others.
LLAMA3_GEN = ("{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}{{ "
              "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}{% if message['role'] == "
              "'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
              "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}")
CHATML_GEN = CHATML.replace("{{ message['content'] }}<|im_end|>\n", "{% if message['role'] == 'assistant' %}"
                            "{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}{% else %}"
                            "{{ message['content'] }}<|im_end|>{% endif %}\n\n")  # trim_blocks eats one newline
SPECIALS = {"llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}
CONFIGS = {"llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
           "chatml": {"bos_token": None, "eos_token": {"content": "<|im_end|>", "special": True,
                                                        "__type": "AddedToken"}, "pad_token": "<|endoftext|>"}}
TEMPLATES = {"llama3": (LLAMA3, LLAMA3_GEN), "chatml": (CHATML, CHATML_GEN)}
CHATS = [
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the treasure?"},
     {"role": "assistant", "content": "  Under the old oak, matey.\n"},
     {"role": "user", "content": "And the map?\n\n"}, {"role": "assistant", "content": "Burnt. Sorry! \u2620"}],
    [{"role": "user", "content": "hello hello"}, {"role": "assistant", "content": "hello"}],
    [{"role": "user", "content": "Say it twice: the end"}, {"role": "assistant", "content": "the end\n\nthe end"},
     {"role": "user", "content": "thanks"}],
]


def _tokenizer_folder(folder: pathlib.Path, family: str, template: str | None, like: pathlib.Path | None = None):
  """A tiny real tokenizer (byte-level BPE trained on a few strings, with its family's special tokens) saved as a
  Hugging Face folder with ``template`` in tokenizer_config.json; ``like``: another such folder whose
  tokenizer.json to copy (BPE training does not number the vocabulary the same way twice)."""
  tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is needed for tokenizer folders")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.post_processor = tokenizers.processors.ByteLevel(trim_offsets=True)
  corpus = [" ".join(m["content"] for m in c) for c in CHATS] + [" ".join(WORDS)] * 3
  tok.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
      vocab_size=400, special_tokens=SPECIALS[family], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  folder.mkdir(parents=True)
  tok.save(os.fspath(folder / "tokenizer.json"))
  if like is not None:  # (without the post-processor's trim_offsets, which only changes offsets)
    tok_json = json.loads((like / "tokenizer.json").read_text())
    tok_json["post_processor"]["trim_offsets"] = False
    (folder / "tokenizer.json").write_text(json.dumps(tok_json))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, **CONFIGS[family]}
  if template is not None:
    config["chat_template"] = template
  (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
  return folder


def _transformers_tokenizer(folder):
  transformers = pytest.importorskip("transformers", reason="transformers (a test-only dependency) checks that "
                                     "chat templates render as it renders them")
  return transformers.PreTrainedTokenizerFast.from_pretrained(os.fspath(folder))


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_chat_template_renders_and_tokenizes_as_transformers(tmp_path, family):
  """The rendered text and token ids equal transformers' apply_chat_template on the same folder; the trained
  tokens equal transformers' assistant-token mask of the same template with {% generation %} blocks around the
  assistant content and end-of-turn token; and through prepare the shards hold exactly these records. (That
  reference folder's tokenizer does not trim offsets: with ByteLevel's trim_offsets a token of spaces has an
  empty span, and transformers' mask loses a message that starts with one; jaxtrain reads untrimmed offsets.)"""
  template, generation = TEMPLATES[family]
  folder = _tokenizer_folder(tmp_path / "tok", family, template)
  hf = _transformers_tokenizer(folder)
  hf_gen = _transformers_tokenizer(_tokenizer_folder(tmp_path / "tok_gen", family, generation, like=folder))
  tokenizer = tokenizers_lib.load(os.fspath(folder))
  assert tokenizer.chat_template == template and tokenizer.special_tokens["eos_token"] == CONFIGS[family][
      "eos_token"]["content" if family == "chatml" else slice(None)]
  encoder = prepare.encoder(os.fspath(folder), "")
  gen_encoder = prepare.encoder(os.fspath(tmp_path / "tok_gen"), "")
  assert gen_encoder.template.tracks_generation and not encoder.template.tracks_generation
  for messages in CHATS:
    text, _ = encoder.template.render(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False), text
    ids, trained = encoder.encode(messages)
    out = hf_gen.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert hf_gen.apply_chat_template(messages, tokenize=False) == text  # the same text, with generation blocks
    assert ids.tolist() == out["input_ids"]
    assert trained.tolist() == out["assistant_masks"], (hf.convert_ids_to_tokens(ids.tolist()), trained)
    assert gen_encoder.encode(messages)[1].tolist() == out["assistant_masks"]
    # Read back: each run of trained tokens is one assistant message (as rendered) and its end-of-turn token.
    runs = np.split(np.arange(ids.size), np.flatnonzero(np.diff(trained)) + 1)
    spoken = [hf.decode(ids[r].tolist()) for r in runs if trained[r[0]]]
    eot = "<|eot_id|>" if family == "llama3" else "<|im_end|>"
    contents = [m["content"].strip() if family == "llama3" else m["content"] for m in messages
                if m["role"] == "assistant"]
    assert spoken == [c + eot for c in contents]
  # A pair is the chat [user, assistant]; through prepare (the folder as --tokenizer), the shards hold the records.
  records = [{"messages": m} for m in CHATS] + [{"prompt": "Where is it?", "response": "Here."}]
  root, manifest = _prepare(tmp_path, records, tokenizer=os.fspath(folder))
  assert manifest["sft"] == {"template": "chat_template", "chat_template_sha256": encoder.template.sha256,
                             "prompt_field": "prompt", "response_field": "response", "messages_field": "messages"}
  assert manifest["tokenizer"] == tokenizers_lib.load(os.fspath(folder / "tokenizer.json")).name
  expected = [encoder.encode(m) for m in CHATS + [[{"role": "user", "content": "Where is it?"},
                                                    {"role": "assistant", "content": "Here."}]]]
  got = sorted((t.tolist(), m.tolist()) for t, m in _shard_records(root))
  assert got == sorted((t.tolist(), m.tolist()) for t, m in expected)


def test_folder_without_template_uses_the_plain_format_with_bos_and_eos(tmp_path):
  folder = _tokenizer_folder(tmp_path / "tok", "llama3", None)
  tok = tokenizers_lib.load(os.fspath(folder))
  bos, eos = (int(tok.encode(t)[0]) for t in ("<|begin_of_text|>", "<|eot_id|>"))
  root, manifest = _prepare(tmp_path, [{"prompt": "Where is the treasure?", "response": " Under the oak."}],
                            tokenizer=os.fspath(folder))
  assert manifest["sft"]["template"] == "plain"
  [(tokens, trained)] = _shard_records(root)
  prompt, response = tok.encode("Where is the treasure?"), tok.encode(" Under the oak.")
  np.testing.assert_array_equal(tokens, [bos, *prompt, *response, eos])
  np.testing.assert_array_equal(trained, [0] * (1 + prompt.size) + [1] * (response.size + 1))


def test_chat_template_file_with_the_byte_tokenizer(tmp_path):
  """--chat_template gives any tokenizer a template; byte offsets map multi-byte characters."""
  (tmp_path / "t.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}")
  root, _ = _prepare(tmp_path, [{"prompt": "caf\u00e9?", "response": "s\u00ed \u2615"}],
                     chat_template=os.fspath(tmp_path / "t.jinja"))
  [(tokens, trained)] = _shard_records(root)
  assert bytes(tokens.astype(np.uint8)).decode() == "<user>caf\u00e9?\n<assistant>s\u00ed \u2615\n"
  np.testing.assert_array_equal(trained, _flags(("<user>caf\u00e9?\n<assistant>", 0), ("s\u00ed \u2615", 1),
                                                ("\n", 0)))  # no special end-of-turn token: only the content


# ------------------------------------------------------------------------ (c) prompt tokens get no gradient


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("sft")
  src = _write_jsonl(tmp / "in" / "sft.jsonl", _sft_records(60))
  manifest = prepare.prepare(prepare.Options(inputs=[os.fspath(src)], output=os.fspath(tmp / "out"),
                                             eval_fraction=0.1, progress=False))
  assert manifest["format"] == prepare.FORMAT_SFT
  return os.fspath(tmp / "out")


def _dataset(root, **kw):
  args = dict(seq_len=32, global_batch=4, seed=0, process_index=0, process_count=1)
  return loader.train_dataset(root, loader.load_manifest(root), **{**args, **kw})


def _reference_mask(src, b) -> np.ndarray:
  """From the documents alone: input j (document d, position p) has a trained target iff d's token p + 1
  exists and is trained (the target is then that token: checked)."""
  mask = np.zeros(b["inputs"].shape, np.float32)
  for row, col in np.ndindex(*mask.shape):
    d, p = int(b["doc_ids"][row, col]), int(b["positions"][row, col])
    if d < 0:
      continue
    tokens, trained = src[d]
    if p + 1 < tokens.size and (col + 1 == mask.shape[1] or b["doc_ids"][row, col + 1] == d):
      assert b["targets"][row, col] == tokens[p + 1]
      mask[row, col] = trained[p + 1]
  return mask


@pytest.mark.slow
def test_prompt_tokens_get_no_gradient(sft_data):
  src = loader.TokenSource(sft_data, loader.load_manifest(sft_data), "train")
  b = next(iter(_dataset(sft_data)))
  mask = _reference_mask(src, b)
  np.testing.assert_array_equal(b["loss_mask"], mask)
  seen = b["segment_ids"] > 0
  assert 0 < mask.sum() < 0.7 * seen.sum(), "the batch should hold both prompt and response targets"

  cfg = base_config().model
  cfg.update(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, vocab_size=256)
  model = models.Model.from_config(cfg)
  params = model.init(jax.random.key(0))
  batch = {k: jnp.asarray(b[k]) for k in batch_lib.KEYS}

  def step_loss(params, batch):
    loss_sum, tokens = step_lib.loss_fn(model, params, batch)
    return loss_sum / tokens

  def reference_loss(params, batch):  # cross-entropy over the response targets only, by hand
    logits = model.apply(params, batch["inputs"], batch["positions"], batch["segment_ids"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / mask.sum()

  loss, grads = jax.jit(jax.value_and_grad(step_loss))(params, batch)
  ref, ref_grads = jax.jit(jax.value_and_grad(reference_loss))(params, batch)
  np.testing.assert_allclose(loss, ref, rtol=1e-6, atol=1e-6)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
  # Changing the targets of prompt tokens (not the inputs) changes nothing; changing a response target does.
  rng = np.random.default_rng(0)
  other = dict(batch, targets=jnp.asarray(np.where(mask > 0, b["targets"], rng.integers(0, 256, mask.shape))))
  assert (np.asarray(other["targets"]) != b["targets"]).sum() > 20
  loss2, grads2 = jax.jit(jax.value_and_grad(step_loss))(params, other)
  assert float(loss2) == float(loss)
  for g, g2 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
    np.testing.assert_array_equal(g, g2)
  row, col = np.argwhere(mask > 0)[0]
  response_changed = dict(batch, targets=batch["targets"].at[row, col].set((b["targets"][row, col] + 1) % 256))
  assert float(jax.jit(step_loss)(params, response_changed)) != float(loss)


# ----------------------------------------------------------------------- (d) packing, padding, eval, plain


class _Tokens:
  """An SFT source's documents' tokens alone (what tests/test_data.py's helpers read)."""

  def __init__(self, src):
    self.src = src

  def __len__(self):
    return len(self.src)

  def __getitem__(self, i):
    return self.src[i][0]


def test_packed_masks_stay_aligned_across_row_cuts(sft_data):
  """Lane r's rows are its documents cut into rows of seq_len + 1 tokens; every field, the loss mask included,
  is rebuilt from the documents and their trained flags alone (as tests/test_data.py does for plain data)."""
  src = loader.TokenSource(sft_data, loader.load_manifest(sft_data), "train")
  lanes, width = 4, 33
  batches = _take(iter(_dataset(sft_data)), 6)
  n = len(batches) * width
  for row in range(lanes):
    doc_ids = _lane_documents(_Tokens(src), row, n, lanes=lanes)
    docs = [src[i] for i in doc_ids]
    tokens = np.concatenate([d[0] for d in docs])[:n].reshape(-1, width)
    trained = np.concatenate([d[1] for d in docs])[:n].reshape(-1, width)
    doc = np.repeat(np.arange(len(docs)), [d.shape[1] for d in docs])[:n].reshape(-1, width)
    pos = np.concatenate([np.arange(d.shape[1]) for d in docs])[:n].reshape(-1, width)
    for b, t, m, d, p in zip(batches, tokens, trained, doc, pos):
      np.testing.assert_array_equal(b["inputs"][row], t[:-1])
      np.testing.assert_array_equal(b["targets"][row], t[1:])
      np.testing.assert_array_equal(b["positions"][row], p[:-1])
      np.testing.assert_array_equal(b["segment_ids"][row], d[:-1] - d[0] + 1)
      np.testing.assert_array_equal(b["loss_mask"][row], (d[1:] == d[:-1]) & (m[1:] > 0))
  starts = np.stack([b["positions"][:, 0] for b in batches])
  continued = starts > 0  # rows that go on with a document cut at the previous row's end
  assert continued.any(), "no document is continued into the next row: cuts are not tested"
  first_masks = np.stack([b["loss_mask"][:, 0] for b in batches])
  assert (first_masks[continued] > 0).any(), "no continued row starts inside a response"
  assert (np.stack([b["segment_ids"] for b in batches]).max(axis=-1) >= 2).any(), "no row holds two documents"


def test_padding_mode_and_eval_batches_carry_the_mask(sft_data):
  manifest = loader.load_manifest(sft_data)
  src = loader.TokenSource(sft_data, manifest, "train")
  order = grain.MapDataset.range(len(src)).seed(0).shuffle()
  for step, b in enumerate(_take(iter(_dataset(sft_data, packing=False)), 2)):
    for row in range(4):
      tokens, trained = src[order[row + 4 * step]][:, :33]
      real = np.arange(33) < tokens.size
      np.testing.assert_array_equal(b["inputs"][row], np.pad(tokens, (0, 33 - tokens.size))[:-1])
      np.testing.assert_array_equal(b["loss_mask"][row], real[1:] & (np.pad(trained, (0, 33 - tokens.size))[1:] > 0))
  evals = loader.eval_batches(sft_data, manifest, seq_len=32, global_batch=4, process_index=0, process_count=1)
  eval_src = loader.TokenSource(sft_data, manifest, "eval")
  docs = [eval_src[i] for i in range(len(eval_src))]
  total = sum(d.shape[1] for d in docs)
  size = len(evals) * 4 * 33
  trained = np.pad(np.concatenate([d[1] for d in docs]), (0, size - total)).reshape(-1, 33)
  doc = np.pad(np.repeat(np.arange(1, len(docs) + 1), [d.shape[1] for d in docs]), (0, size - total)).reshape(-1, 33)
  got = np.concatenate([b["loss_mask"] for b in evals])
  np.testing.assert_array_equal(got, (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] > 0) & (trained[:, 1:] > 0))


def test_plain_data_batches_are_unchanged(tmp_path):
  """Pretraining data: a plain manifest, rows with exactly the fields they had, and the same-document loss
  mask (tests/test_data.py checks whole plain batches field by field)."""
  root, manifest = _prepare(tmp_path, [{"text": " ".join(WORDS[i:] + WORDS[:i])} for i in range(20)])
  assert manifest["format"] == prepare.FORMAT and "loss_mask" not in manifest and "sft" not in manifest
  src = loader.TokenSource(root, loader.load_manifest(root), "train")
  assert not src.masked and src[0].ndim == 1
  rows = list(packing.PackedLanes(grain.MapDataset.range(len(src)), src, [0], 1, 33))
  assert set(rows[0]) == {"tokens", "segment_ids", "positions", "doc_ids"}
  tokens, segs = np.arange(14).reshape(2, 7), np.array([[1, 1, 2, 2, 2, 0, 0]] * 2)
  plain = batch_lib.from_packed(tokens, segs, np.zeros((2, 7), np.int32))
  np.testing.assert_array_equal(plain["loss_mask"][0], [1, 0, 1, 1, 0, 0])
  all_trained = batch_lib.from_packed(tokens, segs, np.zeros((2, 7), np.int32), np.ones((2, 7), np.int32))
  np.testing.assert_array_equal(all_trained["loss_mask"], plain["loss_mask"])
  masked = batch_lib.from_packed(tokens, segs, np.zeros((2, 7), np.int32), np.array([[0, 1, 0, 0, 1, 1, 1]] * 2))
  np.testing.assert_array_equal(masked["loss_mask"][0], [1, 0, 0, 1, 0, 0])


# ----------------------------------------------------------------------------------------------- (e) resume


@pytest.mark.parametrize("workers", [0, 2])
def test_sft_loader_resumes_exactly(sft_data, workers):
  it = loader.TrainIterator(_dataset(sft_data, num_workers=workers), 4, 0, 1)
  _take(it, 4)
  state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
  expected = _take(it, 5)
  data_lib.close(it)
  resumed = loader.TrainIterator(_dataset(sft_data, num_workers=workers), 4, 0, 1)
  resumed.set_state(state)
  got = _take(resumed, 5)
  data_lib.close(resumed)
  for a, b in zip(got, expected):
    for k in (*batch_lib.KEYS, "doc_ids"):
      np.testing.assert_array_equal(a[k], b[k])
  assert all(0 < b["loss_mask"].sum() < (b["segment_ids"] > 0).sum() for b in expected)


# ------------------------------------------------------------------------------------------- (f) end to end


@pytest.mark.slow
def test_prepare_and_train_on_sft_data(tmp_path):
  src = _write_jsonl(tmp_path / "in" / "chat.jsonl", _sft_records(40))
  r = _prepare_cli(f"--input={src}", f"--output={tmp_path / 'data'}", "--eval_fraction=0.1")
  assert r.returncode == 0, r.stderr
  r = _main(f"--config.workdir={tmp_path / 'run'}", f"--config.data.path={tmp_path / 'data'}",
            "--config.train.steps=3", "--config.train.log_every=1", "--config.eval.every_steps=3",
            "--config.checkpoint.every_steps=0")
  assert r.returncode == 0, r.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  train = [m for m in records if "loss" in m]
  assert [m["step"] for m in train] == [1, 2, 3] and all(np.isfinite(m["loss"]) for m in train)
  # A step's token count is its batch's SFT loss mask: response targets only.
  stream = _take(iter(_dataset(os.fspath(tmp_path / "data"), seq_len=128, global_batch=16)), 3)
  assert [m["tokens"] for m in train] == [float(b["loss_mask"].sum()) for b in stream]
  assert all(b["loss_mask"].sum() < 0.8 * (b["segment_ids"] > 0).sum() for b in stream)


# ---------------------------------------------------------------------------------------------- (g) bad input


@pytest.mark.slow
def test_bad_sft_input_gives_one_line_and_exit_2(tmp_path):
  good = json.dumps({"prompt": "p", "response": "r"})
  chat_ok = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
  cases = {
      "no_response.jsonl": ([good, json.dumps({"prompt": "p"})], "no_response.jsonl:2: no field 'response'"),
      "no_fields.jsonl": ([good, good.replace("r\"", "s\""), json.dumps({"question": "q"})],
                          "no_fields.jsonl:3: no field 'prompt'"),
      "role.jsonl": ([json.dumps(chat_ok), json.dumps({"messages": [{"role": "user", "content": "u"},
                                                                   {"role": "robot", "content": "a"}]})],
                     "role.jsonl:2: message 1 has unknown role 'robot'"),
      "no_assistant.jsonl": ([json.dumps(chat_ok), "", json.dumps({"messages": [{"role": "user", "content": "u"}]})],
                             "no_assistant.jsonl:3: the messages have no assistant turn"),
      "not_json.jsonl": ([good, "{oops"], "not_json.jsonl:2: not a JSON line"),
      "empty.jsonl": ([good, json.dumps({"prompt": "p", "response": " "})], "empty.jsonl:2: the response is empty"),
  }
  for name, (lines, _) in cases.items():
    _write_jsonl(tmp_path / "in" / name, lines)
  (tmp_path / "in" / "latin1.jsonl").write_bytes(good.encode() + b"\n" + json.dumps(
      {"prompt": "caf\u00e9", "response": "r"}, ensure_ascii=False).encode("latin-1") + b"\n")
  cases["latin1.jsonl"] = (None, "latin1.jsonl:2: not valid UTF-8 (byte")
  runs = [([f"--input={tmp_path / 'in' / name}"], message) for name, (_, message) in cases.items()]
  (tmp_path / "roles.jinja").write_text("{% for m in messages %}{% if m['role'] == 'system' %}"
                                        "{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }}"
                                        "{% endfor %}")
  _write_jsonl(tmp_path / "in2" / "sys.jsonl", [json.dumps(chat_ok), json.dumps(
      {"messages": [{"role": "system", "content": "s"}] + chat_ok["messages"]})])
  runs.append(([f"--input={tmp_path / 'in2' / 'sys.jsonl'}", f"--chat_template={tmp_path / 'roles.jinja'}"],
               "sys.jsonl:2: the chat template refused the record: no system messages"))
  runs.append(([f"--input={tmp_path / 'in' / 'role.jsonl'}", "--format=text"], "role.jsonl:1: no field 'text' (its "
               "fields: messages); its 'messages' holds chat messages: for SFT chat data pass --format=sft"))
  # A chat whose messages field is named otherwise: the hint names the SFT flag, not the pretraining --field.
  _write_jsonl(tmp_path / "in3" / "conv.jsonl", [json.dumps({"conversations": chat_ok["messages"]})])
  for fmt, message in (("auto", "conv.jsonl:1: no field 'text' (its fields: conversations); its 'conversations' "
                                "holds chat messages: for SFT chat data pass --format=sft --messages_field=conversations"),
                       ("sft", "conv.jsonl:1: no field 'prompt' (nor 'messages'), its fields: conversations; its "
                               "'conversations' holds chat messages: pass --messages_field=conversations")):
    runs.append(([f"--input={tmp_path / 'in3' / 'conv.jsonl'}", f"--format={fmt}"], message))
  # With --format=sft, any JSONL line that is not a pair or a chat is an error (auto would read it as text).
  runs.append(([f"--input={tmp_path / 'in' / 'no_fields.jsonl'}", "--format=sft"], "no_fields.jsonl:3: no field "
                                                                                  "'prompt'"))
  before = sorted(os.listdir(tmp_path))
  results = forked.run_many([["tools/prepare_data.py", *args, f"--output={tmp_path / f'out{i}'}"]
                             for i, (args, _) in enumerate(runs)])
  for r, (args, message) in zip(results, runs):
    errors = [line for line in r.stderr.splitlines() if line.startswith("prepare_data: error:")]
    assert r.returncode == 2 and len(errors) == 1 and message in errors[0], (message, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
  assert sorted(os.listdir(tmp_path)) == before  # no output, no temporary folder

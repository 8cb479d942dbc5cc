"""What the harness tests evaluate: local lm-evaluation-harness tasks (task YAMLs and JSONL written by the test: a
multiple-choice task, a generation task, a perplexity task; nothing from the network) and small random Hugging Face
models (a Llama, a Qwen3) with a real byte-level BPE tokenizer, saved as folders that transformers, the harness's
``hf`` model and tools/convert_hf.py all read."""

from __future__ import annotations

import json
import pathlib

SENTENCES = [
    "the cat sat on the mat and looked at the door", "a dog ran across the field to find the ball",
    "the sun rises in the east and sets in the west", "water boils when it is heated to one hundred degrees",
    "she wrote a letter to her friend in the city", "the river runs past the old mill near the town",
    "birds build nests in the spring before the rain", "he read the book twice and still liked the end",
    "the train left the station at nine in the morning", "children play games in the park after school",
]

MC = [
    {"question": "Where did the cat sit?", "choices": [" on the mat", " in the river", " at the station"], "answer": 0},
    {"question": "What did the dog find?", "choices": [" a letter", " the ball", " the sun"], "answer": 1},
    {"question": "Where does the sun rise?", "choices": [" in the west", " in the park", " in the east"], "answer": 2},
    {"question": "What boils when heated?", "choices": [" water", " a book", " a nest"], "answer": 0},
    {"question": "Who got the letter?", "choices": [" her dog", " her friend", " the train"], "answer": 1},
    {"question": "What runs past the mill?", "choices": [" the river", " the children", " the cat"], "answer": 0},
]

GEN = [{"prompt": " ".join(s.split()[:4]), "target": " " + " ".join(s.split()[4:7])} for s in SENTENCES[:6]]

PPL = [{"text": s + "."} for s in SENTENCES[:5]]

TASKS = {
    "jt_mc": """task: jt_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "jt_gen": """task: jt_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "jt_ppl": """task: jt_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/ppl.jsonl
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
}


def write_tasks(folder: pathlib.Path, data_dir: str | None = None) -> pathlib.Path:
  """The three task YAMLs and their JSONL files in ``folder`` (the YAMLs name the data by ``data_dir``, default the
  folder's absolute path)."""
  folder.mkdir(parents=True, exist_ok=True)
  for name, rows in (("mc", MC), ("gen", GEN), ("ppl", PPL)):
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  for name, text in TASKS.items():
    (folder / f"{name}.yaml").write_text(text.format(dir=data_dir or folder.resolve()))
  return folder


def bpe_tokenizer(vocab_size: int = 300, qwen: bool = False):
  """A byte-level BPE trained on the sentences: Llama's conventions (``<s>`` prepended by the post-processor,
  ``</s>`` ends) or, with ``qwen``, Qwen's (no BOS, ``<|endoftext|>``, ``<|im_start|>``/``<|im_end|>`` and a chat
  template). Returns (tokenizers.Tokenizer, tokenizer_config dict)."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if qwen else ["<s>", "</s>"]
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  corpus = SENTENCES + [m["question"] + c for m in MC for c in m["choices"]] + [g["prompt"] for g in GEN]
  tok.train_from_iterator(corpus * 3, trainer)
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128, "clean_up_tokenization_spaces":
            False}
  if qwen:
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config.update(eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
  else:
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 0)])
    config.update(bos_token="<s>", eos_token="</s>")
  return tok, config


def _save(model, folder: pathlib.Path, qwen: bool) -> None:
  folder = pathlib.Path(folder)
  model.save_pretrained(folder, safe_serialization=True)
  tok, config = bpe_tokenizer(qwen=qwen)
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps(config))


def hf_model(folder: pathlib.Path, qwen: bool = False, seed: int = 0):
  """A random LlamaForCausalLM (or, with ``qwen``, Qwen3ForCausalLM: q/k norms) of vocab 320 saved with its
  tokenizer: 2 layers, d_model 64, max_position_embeddings 128 (the harness's max_length)."""
  import torch
  import transformers
  kw = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=128, rope_theta=10_000.0)
  torch.manual_seed(seed)
  if qwen:
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw, head_dim=16, bos_token_id=None,
                                                                   eos_token_id=2, pad_token_id=0)).eval()
  else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw, bos_token_id=0, eos_token_id=1)).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  _save(model, folder, qwen)
  return model

"""Text generation (jaxtrain/generate.py): KV-cache logits equal a full recompute at every step, sampling is reproducible, a sharded mesh generates what one device does, the
command line prints completions (one line and exit 2 for mistakes), every tokenizer ends a row at its EOS, and
training logs samples. Greedy decoding equal to transformers' on an export: tests/test_lineage.py."""

import json
import pathlib
import types

import jax
import numpy as np
import pytest

from jaxtrain import generate
from jaxtrain import sampling as sampling_lib
from jaxtrain import models
from jaxtrain import mesh as mesh_lib
from jaxtrain import sharding
from jaxtrain.config import base_config
from jaxtrain.data.tokenizers import ByteTokenizer
from tests import forked
from tests.conftest import small_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Three prompts of different lengths (left-padded into one batch), one of a single token.
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [12, 99, 3], [64]]


def _model(vocab=256):
  c = base_config()
  c.model.update(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128, vocab_size=vocab)
  return models.Model.from_config(c.model)


def _layout(devices=1, **mesh):
  c = base_config()
  c.mesh.update(**{"data": 1, "fsdp": 1, "tensor": 1, **mesh})
  mesh = mesh_lib.make_mesh(c.mesh, jax.devices()[:devices])
  return mesh, sharding.rules_from_config(c.sharding)


@pytest.fixture(scope="module")
def tiny():
  """A random 2-layer model on one device: model, mesh, rules, param shardings, params."""
  model = _model()
  mesh, rules = _layout()
  shardings = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  params = jax.device_put(model.init(jax.random.key(3)), shardings)
  return model, mesh, rules, shardings, params


def _generator(tiny, prompts=PROMPTS, **kw):
  model, mesh, rules, shardings, _ = tiny
  kw.setdefault("max_new_tokens", 12)
  return sampling_lib.Generator(model, mesh, rules, shardings, rows=sampling_lib.padded_rows(len(prompts), mesh, rules),
                            prompt_len=max(map(len, prompts)), **kw)


# (b) The KV cache against a full recompute ------------------------------------------------------------------------


@pytest.mark.slow
def test_cached_logits_equal_full_recompute_at_every_step(tiny):
  params = tiny[-1]
  results = {}
  for use_cache in (True, False):
    gen = _generator(tiny, use_cache=use_cache, return_logits=True)
    batch = gen.batch(PROMPTS)
    out, produced, logits, _ = jax.device_get(gen(params, batch))
    results[use_cache] = out, produced, logits
  (out, produced, logits), (ref_out, ref_produced, ref_logits) = results[True], results[False]
  np.testing.assert_array_equal(produced, [12, 12, 12])
  np.testing.assert_array_equal(ref_produced, [12, 12, 12])
  np.testing.assert_array_equal(out, ref_out)
  err = np.max(np.abs(logits - ref_logits))
  print(f"max |cached - recomputed| logit over 3 rows x 12 steps: {err:.2e}")
  assert err < 1e-5 and np.max(np.abs(ref_logits)) > 0.1  # logits that are not all ~0
  # Every step's logits are those of the training forward of the row alone (prompt + the tokens generated
  # before that step, unpadded, positions from 0) at the step's input token.
  model = tiny[0]
  for r, ids in enumerate(PROMPTS):
    row = np.asarray([ids + out[r, :-1].tolist()], np.int32)
    alone = np.asarray(model.apply(params, row, np.arange(row.shape[1])[None], np.ones_like(row)))[0]
    assert np.max(np.abs(logits[r] - alone[len(ids) - 1:])) < 1e-5, r


def test_cache_mask_is_by_segment_and_position():
  from jaxtrain.models.attention import cached_mask
  q_seg, q_pos = np.array([[1, 1]]), np.array([[1, 2]])
  kv_seg, kv_pos = np.array([[0, 1, 1, 1, 2, 0]]), np.array([[0, 0, 1, 2, 0, 9]])
  np.testing.assert_array_equal(np.asarray(cached_mask(q_seg, q_pos, kv_seg, kv_pos))[0, 0],
                                [[0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]])


# (c) Sampling ------------------------------------------------------------------------------------------------------


def test_sampling_is_reproducible_and_top_k_1_is_greedy(tiny):
  params = tiny[-1]
  greedy = _generator(tiny).generate(params, PROMPTS)
  hot = _generator(tiny, sampling=sampling_lib.Sampling(temperature=1.5))
  a, b, c = (hot.generate(params, PROMPTS, seed=s) for s in (7, 7, 8))
  assert a == b and a != c and a != greedy
  assert _generator(tiny, sampling=sampling_lib.Sampling(temperature=1.5, top_k=1)).generate(params, PROMPTS) == greedy
  assert _generator(tiny, sampling=sampling_lib.Sampling(temperature=1.5, top_p=1e-6)).generate(params, PROMPTS) == greedy
  # A row's draws do not depend on the other rows of the batch.
  assert hot.generate(params, PROMPTS[:1], seed=7) == a[:1]


def test_top_k_and_top_p_keep_exactly_their_tokens():
  logits = np.log(np.array([[0.05, 0.5, 0.15, 0.3]] * 256, np.float32))
  key = jax.random.key(0)

  def drawn(**kw):
    return set(np.asarray(sampling_lib.next_tokens(logits, key, sampling_lib.Sampling(temperature=1.0, **kw))).tolist())

  assert drawn() == {0, 1, 2, 3}
  assert drawn(top_k=2) == {1, 3}
  assert drawn(top_k=3) == {1, 2, 3}
  assert drawn(top_p=0.7) == {1, 3}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is {1, 3}
  assert drawn(top_p=0.8) == {1, 3}
  assert drawn(top_p=0.81) == {1, 2, 3}
  assert drawn(top_p=0.5) == {1}
  assert set(np.asarray(sampling_lib.next_tokens(logits, key, sampling_lib.Sampling())).tolist()) == {1}


def test_eos_ends_a_row(tiny):
  params = tiny[-1]
  full = _generator(tiny).generate(params, PROMPTS)
  eos = full[0][4]  # row 0's fifth new token
  stopped = _generator(tiny, eos_ids=(eos,)).generate(params, PROMPTS)
  for row, ref in zip(stopped, full):
    assert row == (ref[:ref.index(eos)] if eos in ref else ref)
  assert len(stopped[0]) <= 4


# (d) Sharded -------------------------------------------------------------------------------------------------------


def test_sharded_mesh_generates_what_one_device_does(tiny):
  model, _, _, _, params = tiny
  expected = {s: _generator(tiny, sampling=sampling_lib.Sampling(s)).generate(params, PROMPTS, seed=1)
              for s in (0.0, 1.0)}
  mesh, rules = _layout(8, data=2, fsdp=2, tensor=2)
  shardings = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  sharded = jax.device_put(jax.device_get(params), shardings)
  spec = sharded["layers"]["attn"]["k"]["kernel"].sharding.spec
  assert spec == jax.sharding.PartitionSpec("pipeline", "fsdp", "tensor", None)  # sharded over all 8 devices
  for temperature, want in expected.items():
    gen = sampling_lib.Generator(model, mesh, rules, shardings, rows=sampling_lib.padded_rows(3, mesh, rules), prompt_len=7,
                             max_new_tokens=12, sampling=sampling_lib.Sampling(temperature))
    assert gen.rows == 4  # padded to the data x fsdp = 4 batch shards
    assert gen.generate(sharded, PROMPTS, seed=1) == want


# (g) Continuous batching (a paged KV cache, slots refilled from a queue) ---------------------------------------

# Nine requests of 1 to 7 tokens, each with its own budget (1 to 12 new tokens): more requests than slots (slots are
# refilled), one that ends at its first token.
QUEUE = [[5, 17, 33, 2, 90, 41, 7], [12, 99, 3], [64], [7, 7, 1, 200], [31, 4], [250, 9, 8, 77, 3, 3], [101],
         [18, 44, 2, 6, 120], [3, 3, 3]]
BUDGETS = [12, 3, 7, 1, 12, 5, 9, 2, 11]


def _logp(logits, tokens):
  return jax.nn.log_softmax(logits)[np.arange(logits.shape[0]), tokens]


@pytest.fixture(scope="module")
def static_queue(tiny):
  """The static generator on QUEUE (one batch, each row stopped at its budget), greedy and sampled (seed 7): tokens,
  produced, log-probabilities."""
  out = {}
  for temperature in (0.0, 1.5):
    gen = _generator(tiny, QUEUE, sampling=sampling_lib.Sampling(temperature), token_logp=_logp)
    out[temperature] = jax.device_get(gen(tiny[-1], gen.batch(QUEUE, BUDGETS), seed=7))[:3]
  return out


def _continuous(tiny, mesh=None, rules=None, shardings=None, **kw):
  model, one_mesh, one_rules, one_shardings, _ = tiny
  return sampling_lib.ContinuousGenerator(model, mesh or one_mesh, rules or one_rules, shardings or one_shardings,
                                          requests=len(QUEUE), prompt_len=7, max_new_tokens=12, token_logp=_logp,
                                          page_size=4, **kw)


def test_continuous_batching_gives_the_static_batch_tokens(tiny, static_queue):
  """Two slots over nine requests: greedy with an EOS token, the pool (7 pages of 4 tokens) smaller than 2 slots x
  5 pages, so requests also wait for pages; sampled, three slots: the static batch's tokens for every request."""
  params = tiny[-1]
  tokens, produced, logps = static_queue[0.0]
  eos = int(tokens[0, 4])
  gen = _continuous(tiny, slots=2, pages=7, eos_ids=(eos,))
  assert gen.pages_per_slot == 5  # 7 + 12 - 1 tokens at most
  got, got_produced, got_logps, stats = jax.device_get(gen(params, gen.batch(QUEUE, BUDGETS), seed=7))
  for q, budget in enumerate(BUDGETS):  # the static answer up to the budget, then up to its first EOS
    want = tokens[q, :budget].tolist()
    want = want[:want.index(eos) + 1] if eos in want else want
    assert got[q].tolist() == want + [0] * (12 - len(want)) and got_produced[q] == len(want), q
    np.testing.assert_allclose(got_logps[q, :len(want)], logps[q, :len(want)], atol=1e-5)
  assert got_produced[0] == 5 and stats["prefills"] == len(QUEUE)  # one device: one request a prefill
  hot = _continuous(tiny, slots=3, sampling=sampling_lib.Sampling(1.5))
  got, got_produced, got_logps, stats = jax.device_get(hot(params, hot.batch(QUEUE, BUDGETS), seed=7))
  tokens, produced, logps = static_queue[1.5]
  np.testing.assert_array_equal(got, tokens)
  np.testing.assert_array_equal(got_produced, BUDGETS)
  np.testing.assert_allclose(got_logps, logps, atol=1e-5)
  assert stats["steps"] < sum(BUDGETS) / 2  # three slots at a time (the static batch: 11 steps of 9 rows)
  # What the caller may not ask: one line each, before anything is compiled.
  with pytest.raises(sampling_lib.GenerateError, match="pages: 4 pages: each of the 1 batch shards needs at least 5"):
    _continuous(tiny, slots=2, pages=4)
  with pytest.raises(sampling_lib.GenerateError, match="budgets: must be 9 values from 1 to max_new_tokens=12"):
    hot(params, hot.batch(QUEUE, [13] * 9))


def test_continuous_batching_on_a_sharded_mesh(tiny, static_queue):
  """data 2 x tensor 2: two slots and five pages per shard (less than 4 slots x 5 pages), sampled: the static
  batch's tokens on one device."""
  model, _, _, _, params = tiny
  mesh, rules = _layout(4, data=2, tensor=2)
  shardings = sharding.logical_to_sharding(model.logical_specs, mesh, rules)
  sharded = jax.device_put(jax.device_get(params), shardings)
  with pytest.raises(sampling_lib.GenerateError, match="slots: 3 is not a positive multiple of the 2 batch shards"):
    _continuous(tiny, mesh, rules, shardings, slots=3)
  gen = _continuous(tiny, mesh, rules, shardings, slots=4, pages=10, sampling=sampling_lib.Sampling(1.5))
  with jax.set_mesh(mesh):
    got, got_produced, got_logps, stats = jax.device_get(gen(sharded, gen.batch(QUEUE, BUDGETS), seed=7))
  tokens, produced, logps = static_queue[1.5]
  np.testing.assert_array_equal(got, tokens)
  np.testing.assert_array_equal(got_produced, BUDGETS)
  np.testing.assert_allclose(got_logps, logps, atol=1e-5)
  assert stats["prefills"] < len(QUEUE)  # two requests (one per shard) in a prefill at times


def test_grpo_rollout_slots_sample_the_static_rollouts_completions(tmp_path):
  """rl.rollout_slots=8: GRPO's rollout sampler is the continuous one, and its completions and log-probabilities are
  the static rollout's (64 rows, 8 slots)."""
  from jaxtrain import config as config_lib
  from jaxtrain.data import prompts as prompts_lib
  from jaxtrain.errors import ConfigError
  from jaxtrain.train import start, trainer
  from jaxtrain.train.objectives import grpo
  from tests.test_grpo import MODEL, grpo_config, write_task
  c = grpo_config(tmp_path / "run", write_task(tmp_path / "task"))
  c.model.update(**MODEL)
  run = trainer.build(config_lib.resolve(c), jax.devices()[:1])
  params = start.starting_state(run).params
  table = prompts_lib.load(c.data.path, run.config)
  done = {}
  for slots in (0, 8):
    run.config.rl.update(rollout_slots=slots)
    gen = grpo.rollout_generator(run, 64, (10,))
    assert isinstance(gen.generator, sampling_lib.ContinuousGenerator) == bool(slots)
    batch = gen.batch([table.ids[i % len(table.ids)] for i in range(64)])
    with jax.set_mesh(run.mesh):
      done[slots] = grpo.Completions(gen(params, batch, seed=3), (10,), prompts_lib._tokenizer("byte"))
  np.testing.assert_array_equal(done[8].tokens, done[0].tokens)
  np.testing.assert_array_equal(done[8].produced, done[0].produced)
  np.testing.assert_allclose(done[8].logps, done[0].logps, atol=1e-5)
  run.config.rl.update(rollout_slots=-8)
  with pytest.raises(ConfigError, match="rl.rollout_slots: must be 0 or a positive multiple"):
    grpo.rollout_generator(run, 64, (10,))


# (a) transformers ------------------------------------------------------------------------------------------------


# Greedy tokens equal transformers' generate on an export, prompts of different lengths in one batch on an 8-way
# FSDP mesh, through the command line's --chat: tests/test_lineage.py.


# (e) The command line --------------------------------------------------------------------------------------------


def _cli(*args, timeout=300):
  return forked.run(["-m", "jaxtrain.generate", *args], timeout=timeout)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  """configs/tiny.py trained 3 steps on the bundled corpus (byte-level)."""
  from configs import tiny
  from jaxtrain.train import trainer
  c = tiny.get_config()
  c.workdir = str(tmp_path_factory.mktemp("tiny_run"))
  c.data.seq_len = 32
  c.train.update(steps=3, global_batch_size=8, log_every=1)
  c.optim.warmup_steps = 1
  c.metrics.tensorboard = False
  trainer.train(c)
  return pathlib.Path(c.workdir)


@pytest.mark.slow
def test_cli_prints_completions_and_they_equal_the_api(trained_run):
  result = _cli(f"--checkpoint={trained_run}", "--prompt=ROMEO:", "--prompt=To be", "--max_new_tokens=10")
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.splitlines()
  assert len(lines) == 2
  loaded = generate.load(str(trained_run))
  assert loaded.step_dir == str(trained_run / "checkpoints" / "3")
  tok = sampling_lib.tokenizer_for(loaded.config, loaded.saved, loaded.step_dir)
  assert isinstance(tok.tokenizer, ByteTokenizer) and tok.eos_ids == ()
  gen = sampling_lib.Generator(loaded.model, loaded.mesh, loaded.rules, loaded.param_shardings, rows=8, prompt_len=6,
                           max_new_tokens=10)
  ids = gen.generate(loaded.params, [tok.encode("ROMEO:"), tok.encode("To be")])
  assert [len(i) for i in ids] == [10, 10]
  assert lines == [tok.decode(i).replace("\\", "\\\\").replace("\n", "\\n") for i in ids]
  # Another mesh (data=2, fsdp=2, tensor=2) from the command line, jsonl: the same completions.
  sharded = _cli(f"--checkpoint={trained_run / 'checkpoints'}", "--prompt=ROMEO:", "--prompt=To be",
                 "--max_new_tokens=10", "--config.mesh.data=2", "--config.mesh.fsdp=2", "--set=mesh.tensor=2",
                 "--format=jsonl", "--no_cache")
  assert sharded.returncode == 0, sharded.stderr[-3000:]
  assert "'data': 2, 'pipeline': 1, 'fsdp': 2, 'expert': 1, 'context': 1, 'tensor': 2" in sharded.stderr
  records = [json.loads(line) for line in sharded.stdout.splitlines()]
  assert [r["completion"] for r in records] == [tok.decode(i) for i in ids]
  assert [r["prompt"] for r in records] == ["ROMEO:", "To be"]
  # Continuous batching (--slots rounded up to the mesh's 8 batch shards): the same completions.
  queued = _cli(f"--checkpoint={trained_run}", "--prompt=ROMEO:", "--prompt=To be", "--max_new_tokens=10",
                "--slots=1")
  assert queued.returncode == 0, queued.stderr[-3000:]
  assert queued.stdout.splitlines() == lines and "slots, paged KV cache" in queued.stderr


CLI_ERRORS = [
    (["--checkpoint={tmp}/nothing", "--prompt=a"], "does not exist"),
    (["--checkpoint={tmp}", "--prompt=a"], "holds no committed checkpoint"),
    (["--checkpoint={run}", "--prompt="], "prompt 1: is empty"),
    (["--checkpoint={run}"], "--prompt: no prompt given"),
    (["--checkpoint={run}", "--prompt=a", "--temperature=-1"], "--temperature: must be >= 0, got -1.0"),
    (["--checkpoint={run}", "--prompt=a", "--top_p=0"], "--top_p: must be in (0, 1], got 0.0"),
    (["--checkpoint={run}", "--prompt=a", "--max_new_tokens=0"], "--max_new_tokens: must be > 0, got 0"),
    (["--checkpoint={run}", "--prompt=a", "--max_new_tokens=many"], "--max_new_tokens=many"),
    (["--checkpoint={run}", "--prompt=a", "--slots=2", "--no_cache"], "--slots: continuous batching decodes with "
     "the KV cache"),
    (["--checkpoint={run}", "--prompt=a", "--set=model.num_layers=2"], "model.num_layers: cannot be overridden"),
    (["--checkpoint={run}", "--prompt=a", "--config.mesh.fsdp=3"], "mesh: ICI mesh data=1 x pipeline=1 x fsdp=3"),
    (["--checkpoint={run}", "--prompt=a", "--prompts_file={tmp}/missing.txt"], "missing.txt: cannot be read"),
    (["--checkpoint={run}", "--prompts_file={tmp}/bad.jsonl"], "bad.jsonl:2: has no 'prompt' text nor 'messages' "
     "list (it has text)"),
    (["--checkpoint={run}", "--prompts_file={tmp}/chats.jsonl"], "--prompts_file: holds conversations ('messages' "
     "records); pass --chat"),
    (["--checkpoint={run}", "--prompt=a", "--chat"], "--chat: the tokenizer (byte-level) has no chat template"),
    (["--prompt=a"], "--checkpoint: is required"),
]


@pytest.fixture(scope="module")
def cli_mistakes(trained_run, tmp_path_factory):
  """The result of every CLI_ERRORS command ({tmp}: an empty folder of its own), run as forks of one process
  (tests/forked.py)."""
  folders = [tmp_path_factory.mktemp("mistake") for _ in CLI_ERRORS]
  for folder in folders:
    (folder / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    (folder / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
  return forked.run_many([["-m", "jaxtrain.generate", *(a.format(tmp=tmp, run=trained_run) for a in args)]
                          for (args, _), tmp in zip(CLI_ERRORS, folders)])


@pytest.mark.parametrize("case", range(len(CLI_ERRORS)), ids=[m.split(":")[0] + ":" + m.split(":")[-1][:20]
                                                             for _, m in CLI_ERRORS])
def test_cli_mistakes_give_one_line_and_exit_2(case, cli_mistakes):
  message, result = CLI_ERRORS[case][1], cli_mistakes[case]
  errors = [line for line in result.stderr.splitlines() if line.startswith("generate: error:")]
  assert result.returncode == 2, result.stderr[-3000:]
  assert len(errors) == 1 and message in errors[0], result.stderr[-3000:]
  assert "Traceback" not in result.stderr and not result.stdout


def test_every_tokenizer_ends_a_row_at_its_eos_and_renders_its_chat_template(tmp_path):
  """A run's data.tokenizer (a folder), or --tokenizer, ends a row at its own EOS token, as an import's does, and
  the GRPO sampler stops at the same ids; --chat renders the template with the generation prompt; a JSONL prompts
  file holds prompts with newlines and conversations."""
  from jaxtrain.train.objectives import grpo
  from tests import harness_data
  from tests.conftest import small_config
  tok, config = harness_data.bpe_tokenizer(qwen=True)  # ChatML: <|im_end|> (id 2) ends a turn
  (tmp_path / "tok").mkdir()
  tok.save(str(tmp_path / "tok" / "tokenizer.json"))
  (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
  c = small_config(tmp_path / "run")
  c.data.tokenizer = str(tmp_path / "tok")
  found = sampling_lib.tokenizer_for(c)
  assert found.eos_ids == (2,)
  c.data.tokenizer = "byte"
  assert sampling_lib.tokenizer_for(c, override=str(tmp_path / "tok")).eos_ids == (2,)
  c.data.tokenizer = str(tmp_path / "tok")
  c.rl.stop = ("\n",)
  assert set(grpo.stop_ids(c, found.tokenizer)) == {2, *found.tokenizer.encode("\n").tolist()}
  ids = found.encode_chat([{"role": "user", "content": "the cat"}])
  assert found.decode(ids) == "user\nthe cat\nassistant\n"  # the special tokens are skipped when decoding
  assert ids == tok.encode("<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n").ids
  (tmp_path / "p.jsonl").write_text('{"prompt": "two\\nlines"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
  flags = types.SimpleNamespace(prompt=["first"], prompts_file=str(tmp_path / "p.jsonl"))
  assert generate._prompts(flags) == ["first", "two\nlines", [{"role": "user", "content": "hi"}]]
  # The tokenizer a checkpoint's lineage carries (an import's hf/ folder): BOS prepended to a plain prompt and EOS
  # from its config.json, generation_config.json winning.
  import tokenizers
  word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
  word_level.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  word_level.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins the words with spaces
  (tmp_path / "import" / "hf").mkdir(parents=True)
  word_level.save(str(tmp_path / "import" / "hf" / "tokenizer.json"))
  (tmp_path / "import" / "hf" / "config.json").write_text('{"bos_token_id": 1, "eos_token_id": 9}')
  (tmp_path / "import" / "hf" / "generation_config.json").write_text('{"eos_token_id": [5, 6]}')
  imported = sampling_lib.tokenizer_for(c, {}, str(tmp_path / "import" / "checkpoints" / "0"))
  assert imported.where.endswith("hf/tokenizer.json") and imported.bos_id == 1 and imported.eos_ids == (5, 6)
  assert imported.encode("w12 w99 w3") == [1, 12, 99, 3] and imported.decode([12, 99]) == "w12 w99"


# (f) Samples during training ---------------------------------------------------------------------------------------


def test_training_logs_greedy_samples(tmp_path, monkeypatch):
  from jaxtrain.train import trainer
  compiled = []
  init = sampling_lib.Generator.__init__

  def counting(self, *args, **kw):
    compiled.append(1)
    init(self, *args, **kw)

  monkeypatch.setattr(sampling_lib.Generator, "__init__", counting)
  c = small_config(tmp_path, fsdp=8)
  c.train.update(steps=5, sample_every=2, sample_prompts=("ROMEO:", "ab"), sample_tokens=6)
  state, _ = trainer.train(c)
  samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
  assert [(s["step"], s["prompt"]) for s in samples] == [(2, "ROMEO:"), (2, "ab"), (4, "ROMEO:"), (4, "ab"),
                                                         (5, "ROMEO:"), (5, "ab")]
  assert len(compiled) == 1  # one Generator for the whole run
  # The last samples are the greedy continuations of the final params.
  run = trainer.build(c)
  gen = sampling_lib.Generator(run.model, run.mesh, run.rules, run.state_shardings.params, rows=8, prompt_len=6,
                           max_new_tokens=6)
  ids = gen.generate(state.params, [list(b"ROMEO:"), list(b"ab")])
  byte = ByteTokenizer()
  assert [s["completion"] for s in samples[-2:]] == [byte.decode(i) for i in ids]
  assert all(len(s["completion"].encode("utf-8", errors="surrogatepass")) >= 1 for s in samples)


def test_sample_config_is_validated(tmp_path):
  from jaxtrain.config import ConfigError, validate_values
  c = small_config(tmp_path)
  c.train.update(sample_every=2, sample_prompts=("ROMEO:", ""))
  with pytest.raises(ConfigError, match="train.sample_prompts"):
    validate_values(c)
  c.train.update(sample_every=-1, sample_prompts=("ROMEO:",))
  with pytest.raises(ConfigError, match="train.sample_every: must be >= 0, got -1"):
    validate_values(c)

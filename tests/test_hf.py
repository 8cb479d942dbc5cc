"""Hugging Face Llama and Mixtral checkpoints in and out (jaxtrain/hf.py, tools/convert_hf.py): jaxtrain's logits on
an imported checkpoint equal transformers' (padded batch, packed row), exports load in transformers with the same
logits, import -> export is bitwise, and bad inputs give one line and exit 2 with nothing written."""

import importlib.util
import json
import pathlib

import jax
import numpy as np
import pytest

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import hf
from jaxtrain import models
from jaxtrain.train.state import TrainState
from tests import forked

torch = pytest.importorskip("torch", reason="torch (test-only, pinned for Python 3.11 in setup.cfg's test extra) "
                            "is not installed: the Hugging Face comparisons need it")
transformers = pytest.importorskip("transformers", reason="transformers (test-only) is not installed: the "
                                   "Hugging Face comparisons need it")
from safetensors.numpy import load_file  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1e-4  # max |jaxtrain - transformers| / max |logit|

CONFIGS = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500_000.0),
    "mha_tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500_000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),  # wavelengths of all three regimes at head_dim 16
    "wide_heads": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),  # 4 x 32 != 64
    # Mixtral: 4 experts, top-2 (the hub's per-expert w1/w2/w3 tensors; transformers fuses them when loading).
    "mixtral": dict(mixtral=True, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, rope_theta=1e6, sliding_window=None),
}


def _hf_model(folder, seed=0, mixtral=False, **overrides):
  """A small random LlamaForCausalLM (or MixtralForCausalLM) saved as safetensors (norm weights random too, so that
  they are tested)."""
  kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5,
            max_position_embeddings=128)
  kw.update(overrides)
  torch.manual_seed(seed)
  if mixtral:
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw)).eval()
  else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.05)
  model.save_pretrained(folder, safe_serialization=True)
  (pathlib.Path(folder) / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
  (pathlib.Path(folder) / "tokenizer_config.json").write_text('{"model_max_length": 128}')
  return model


def _load_config(path):
  spec = importlib.util.spec_from_file_location("imported_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _restore(out):
  """The imported config (from OUT/config.py) and params, read as the trainer's restore_from reads them."""
  cfg = _load_config(out / "config.py")
  model = models.Model.from_config(cfg.model)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), model.abstract_params)
  target = TrainState(step=jax.ShapeDtypeStruct((), np.int32, sharding=device), params=abstract, opt_state={})
  restored, step = checkpoint_lib.restore_from(cfg.checkpoint.restore_from, target, params_only=True)
  assert step == 0
  return cfg, model, restored["params"]


def _hf_logits(model, tokens, attention_mask=None):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(np.asarray(tokens)),
                attention_mask=None if attention_mask is None else torch.tensor(np.asarray(attention_mask)))
  return out.logits.numpy()


def _rel_err(a, b):
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_imported_logits_equal_transformers(name, tmp_path):
  ref = _hf_model(tmp_path / "src", **CONFIGS[name])
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  cfg, model, params = _restore(tmp_path / "out")
  assert cfg.checkpoint.restore_mode == "params"
  assert (tmp_path / "out" / "hf" / "tokenizer.json").exists()
  padded_err, packed_err = logit_errors(model, params, ref, vocab=128)
  print(f"{name}: max relative logit error padded {padded_err:.2e}, packed {packed_err:.2e}")
  assert padded_err < TOL and packed_err < TOL


def logit_errors(model, params, ref, vocab=256):
  """(padded batch, packed row): the largest relative logit error against the transformers model ``ref`` on a
  right-padded batch (row 1 has 7 real tokens, then padding: segment 0 in jaxtrain, attention_mask 0 in HF) and on
  a packed row of documents of 9 and 15 tokens (segment ids 1 and 2, positions restarting at 0), each document
  against itself alone in transformers."""
  rng = np.random.default_rng(0)
  t, real = 24, 7
  tokens = rng.integers(0, vocab, (2, t)).astype(np.int32)
  mask = np.ones((2, t), np.int32)
  mask[1, real:] = 0
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (2, t))
  ours = np.asarray(model.apply(params, tokens, positions, mask))
  theirs = _hf_logits(ref, tokens, mask)
  padded = max(_rel_err(ours[0], theirs[0]), _rel_err(ours[1, :real], theirs[1, :real]))
  a, b = tokens[0, :9], tokens[1, :15]
  row = np.concatenate([a, b])[None]
  seg = np.array([[1] * 9 + [2] * 15], np.int32)
  pos = np.array([list(range(9)) + list(range(15))], np.int32)
  packed = np.asarray(model.apply(params, row, pos, seg))[0]
  return padded, max(_rel_err(packed[:9], _hf_logits(ref, a[None])[0]),
                     _rel_err(packed[9:], _hf_logits(ref, b[None])[0]))


def _exported_equals_source(src, exported):
  ours = load_file(str(exported / "model.safetensors"))
  theirs = load_file(str(src / "model.safetensors"))
  assert ours.keys() == theirs.keys()
  for k in theirs:
    assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
    assert ours[k].tobytes() == theirs[k].tobytes(), k


@pytest.mark.parametrize("name", ["gqa_untied", "mha_tied", "llama3_rope", "mixtral"])
def test_import_export_is_bitwise_and_loads_in_transformers(name, tmp_path):
  ref = _hf_model(tmp_path / "src", **CONFIGS[name])
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  hf.export_model(str(tmp_path / "out" / "checkpoints"), str(tmp_path / "exported"))
  _exported_equals_source(tmp_path / "src", tmp_path / "exported")
  assert (tmp_path / "exported" / "tokenizer.json").read_text() == (tmp_path / "src" / "tokenizer.json").read_text()
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  arch = "MixtralForCausalLM" if name == "mixtral" else "LlamaForCausalLM"
  assert config["architectures"] == [arch] and config["bos_token_id"] == 1
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert not any(info.values()), info  # no missing, unexpected or mismatched keys
  assert loaded.config.rope_parameters["rope_type"] == ref.config.rope_parameters["rope_type"]
  tokens = np.random.default_rng(1).integers(0, 128, (2, 20))
  np.testing.assert_array_equal(_hf_logits(loaded.eval(), tokens), _hf_logits(ref, tokens))


def test_sharded_source_and_sharded_export(tmp_path):
  """A source in several safetensors files with an index; an export past --max_shard_mb is sharded likewise."""
  ref = _hf_model(tmp_path / "one", **CONFIGS["gqa_untied"])
  ref.save_pretrained(tmp_path / "src", safe_serialization=True, max_shard_size="100KB")
  assert (tmp_path / "src" / "model.safetensors.index.json").exists()
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  info = hf.export_model(str(tmp_path / "out"), str(tmp_path / "exported"), max_shard_mb=0.1)
  assert info["shards"] > 1
  index = json.loads((tmp_path / "exported" / "model.safetensors.index.json").read_text())
  tensors = {}
  for f in set(index["weight_map"].values()):
    tensors.update(load_file(str(tmp_path / "exported" / f)))
  theirs = load_file(str(tmp_path / "one" / "model.safetensors"))
  assert tensors.keys() == theirs.keys() and all(tensors[k].tobytes() == theirs[k].tobytes() for k in theirs)
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert not any(info.values()), info


@pytest.mark.slow
def test_fine_tune_from_import_then_export(tmp_path):
  """OUT/config.py trains (restore_from the import, restore_mode=params); the run's workdir exports, finds the
  import's tokenizer through restore_from, and transformers computes jaxtrain's logits of the trained params."""
  from jaxtrain.train import trainer
  _hf_model(tmp_path / "src", **CONFIGS["llama3_rope"])
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  cfg = _load_config(tmp_path / "out" / "config.py")
  cfg.workdir = str(tmp_path / "run")
  cfg.data.update(source="synthetic", seq_len=16)
  cfg.train.update(steps=2, global_batch_size=8, log_every=1)
  cfg.optim.update(lr=1e-2, warmup_steps=1)
  state, _ = trainer.train(cfg)
  hf.export_model(str(tmp_path / "run"), str(tmp_path / "exported"))
  assert (tmp_path / "exported" / "tokenizer_config.json").exists()
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert not any(info.values()), info
  params = jax.device_get(state.params)
  _, _, imported = _restore(tmp_path / "out")
  assert not np.array_equal(params["layers"]["mlp"]["up"]["kernel"], imported["layers"]["mlp"]["up"]["kernel"])
  tokens = np.random.default_rng(2).integers(0, 128, (2, 16)).astype(np.int32)
  model = models.Model.from_config(cfg.model)
  ours = np.asarray(model.apply(params, tokens, np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16)),
                                np.ones((2, 16), np.int32)))
  assert _rel_err(ours, _hf_logits(loaded.eval(), tokens)) < TOL


def _break(folder, how):
  folder = pathlib.Path(folder)
  if how == "not_llama":
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
  elif how == "shape_mismatch":
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "intermediate_size": 100}))
  elif how == "truncated":
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
  elif how == "missing_config":
    (folder / "config.json").unlink()
  elif how == "biases":
    c = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**c, "attention_bias": True}))
  elif how.startswith("weight_map_"):  # an index naming a whole, readable copy of the weights outside the folder
    outside = folder.parent.parent / f"{folder.parent.name}-outside"
    outside.mkdir()
    (outside / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    file = str(outside / "model.safetensors") if how == "weight_map_absolute" else \
        f"../../{outside.name}/model.safetensors"
    names = sorted(load_file(str(folder / "model.safetensors")))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: file for n in names}}))


BAD = [("not_llama", "is a 'gpt2' model"), ("shape_mismatch", "model.layers.0.mlp.gate_proj.weight is [96, 64], "
                                                              "config.json says [100, 64]"),
       ("truncated", "is not a readable safetensors file"), ("missing_config", "has no config.json"),
       ("biases", "sets attention_bias=true"),
       ("weight_map_parent", "model.safetensors.index.json: maps lm_head.weight to '../../weight_map_parent"),
       ("weight_map_absolute", "/model.safetensors', not a file in the folder; an index names files next to it: "
                               "download the model again")]


@pytest.fixture(scope="module")
def bad_imports(tmp_path_factory):
  """Per BAD case, (its folder, holding the broken model as src/, and ``convert_hf.py import``'s result), the
  commands run as forks of one process (tests/forked.py)."""
  folders = [tmp_path_factory.mktemp(how) for how, _ in BAD]
  for folder, (how, _) in zip(folders, BAD):
    _hf_model(folder / "src", **CONFIGS["gqa_untied"])
    _break(folder / "src", how)
  results = forked.run_many([["tools/convert_hf.py", "import", f"--hf={folder / 'src'}", f"--output={folder / 'out'}"]
                             for folder in folders])
  return list(zip(folders, results))


@pytest.mark.parametrize("case", range(len(BAD)), ids=[b for b, _ in BAD])
def test_bad_input_gives_one_line_and_exit_2(case, bad_imports):
  message, (folder, result) = BAD[case][1], bad_imports[case]
  lines = [line for line in result.stderr.splitlines() if line.startswith("convert_hf: error:")]
  assert result.returncode == 2, result.stderr
  assert len(lines) == 1 and message in lines[0], result.stderr
  assert "Traceback" not in result.stderr
  assert sorted(p.name for p in folder.iterdir()) == ["src"]  # no output, no leftover temporary folder


def test_the_generated_config_names_its_paths_exactly_whatever_they_hold(tmp_path):
  """Folders named with quotes, triple quotes, a newline and (the source's) backslashes: OUT/config.py loads, and
  its SOURCE, CONFIG and checkpoint.restore_from are the paths, character for character. (The output folder has
  no backslash: TensorStore, under Orbax, reads one as a path separator.)"""
  odd = tmp_path / 'it\'s """a\n" '
  source, output = odd / 'src\\"""\\', odd / "out"
  _hf_model(source, **CONFIGS["mha_tied"])
  hf.import_model(str(source), str(output))
  spec = importlib.util.spec_from_file_location("imported_config", output / "config.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert (module.SOURCE, module.CONFIG) == (str(source), str(output / "config.py"))
  config = module.get_config()
  assert config.checkpoint.restore_from == str(output / "checkpoints") and config.workdir == f"runs/{output.name}"
  _, _, params = _restore(output)  # the checkpoint it names restores
  assert params["embed"]["embedding"].shape == (128, 64)


def test_export_refuses_existing_output_and_missing_step(tmp_path):
  _hf_model(tmp_path / "src", **CONFIGS["mha_tied"])
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  with pytest.raises(hf.HFError, match="already exists"):
    hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  with pytest.raises(checkpoint_lib.CheckpointError, match="has no step 7"):
    hf.export_model(str(tmp_path / "out"), str(tmp_path / "exported"), step=7)
  assert not (tmp_path / "exported").exists()


def test_llama3_rope_frequencies_equal_transformers():
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  from jaxtrain.models import llama
  config = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_theta=500_000.0,
                                    max_position_embeddings=131072, rope_scaling={
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192})
  theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
  ours = np.asarray(llama.rope_frequencies(128, 500_000.0, (8.0, 1.0, 4.0, 8192)))
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
  assert not np.allclose(ours, np.asarray(llama.rope_frequencies(128, 500_000.0)))

"""Llama 4, text (jaxtrain/models/llama4; its chunked attention in each backend: tests/test_attention.py): a random
small Llama4ForCausalLM built by transformers itself (chunks of 5 positions on 24-token texts, a NoPE layer with a
temperature that bites, QK L2-norm, a MoE every other layer with its shared expert, top-1 sigmoid routing onto the
experts' inputs, Llama 3 RoPE scaling): imported, its logits equal transformers' on a padded batch and a packed row;
each of its features mapped wrong fails that comparison; greedy generation through the KV cache equals transformers'
token for token; the export loads in transformers with its logits. Sharded training equals one device; LoRA exports
what jaxtrain computes; the published size has the published parameter counts."""

import importlib
import json

import numpy as np
import pytest

from jaxtrain import generate, hf
from jaxtrain import models
from jaxtrain import sampling as sampling_lib
from jaxtrain.models import llama4
from tests import forked
from tests.conftest import small_config
from tests.test_families import sft_data  # noqa: F401 (a fixture)
# (torch and transformers: test_hf's, skipped with it where they are not installed)
from tests.test_hf import (_exported_equals_source, _hf_logits, imported_fixture, logit_errors,
                           lora_fine_tune_exports_what_jaxtrain_computes, mis_mapping_errors, random_builder, torch,
                           transformers)

TOL = 1e-5  # max |jaxtrain - transformers| / max |logit|, float32 (the bound)

# Layers: dense RoPE, MoE RoPE, dense RoPE, MoE NoPE (no_rope_layer_interval 4). A floor_scale of 3 makes the NoPE
# layer's temperature grow over the 24 tokens (1 to 2.0); head_dim 16 under theta 5e5 and 16 original positions puts
# the dims on both sides of Llama 3's ramp.
HF_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                 num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=5, no_rope_layer_interval=4,
                 use_qk_norm=True, attn_temperature_tuning=True, floor_scale=3, attn_scale=0.5, rms_norm_eps=1e-5,
                 max_position_embeddings=128, pad_token_id=0,
                 rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                  "rope_theta": 500_000.0})


_hf_llama4 = random_builder(transformers.Llama4ForCausalLM, transformers.Llama4TextConfig, HF_CONFIG)
imported = imported_fixture("llama4", _hf_llama4)


def _chunk_plus_one(params, cfg):
  cfg.attention_chunk_size += 1


def _every_layer_rope(params, cfg):  # the NoPE layer turned (and chunked, and normed) as the others
  cfg.global_every = 0


def _no_temperature(params, cfg):
  cfg.attn_temperature_tuning = False


def _no_qk_norm(params, cfg):
  cfg.qk_l2_norm = False


def _no_llama3_scaling(params, cfg):
  cfg.rope_scaling = ""


def _gate_up_swapped(params, cfg):
  params["layers"]["sparse"]["moe"]["gate_up"] = params["layers"]["sparse"]["moe"]["gate_up"][..., ::-1, :]


def _no_shared_expert(params, cfg):
  params["layers"]["sparse"]["moe"]["shared"]["down"]["kernel"][...] = 0


def _weights_on_outputs(params, cfg):  # with llama4.MoE.weigh_inputs off: the routing weights on the outputs
  del params, cfg


MIS_MAPS = [_chunk_plus_one, _every_layer_rope, _no_temperature, _no_qk_norm, _no_llama3_scaling, _gate_up_swapped,
            _no_shared_expert]


def test_imported_logits_equal_transformers(imported):
  """Within 1e-5 on a right-padded batch and a packed row (transformers' model on each document alone)."""
  _, ref, cfg, model, params = imported
  m = cfg.model
  assert (m.name, m.moe_every, m.global_every, m.attention_chunk_size, m.mlp_dim, m.expert_mlp_dim, m.floor_scale,
          m.qk_l2_norm, m.rope_scaling) == ("llama4", 2, 4, 5, 96, 32, 3, True, "llama3")
  padded, packed = logit_errors(model, params, ref)
  print(f"llama4: max relative logit error padded {padded:.2e}, packed {packed:.2e}")
  assert padded < TOL and packed < TOL


@pytest.mark.slow
def test_each_mis_mapping_fails(imported, monkeypatch):
  """Each feature mapped wrong misses by far, the routing weight on the experts' outputs (not their inputs) too."""
  _, ref, cfg, _, params = imported
  errors = mis_mapping_errors(cfg.model, params, ref, MIS_MAPS)
  monkeypatch.setattr(llama4.MoE, "weigh_inputs", False)  # (its mis-mapping: the class's, not the params')
  errors.update(mis_mapping_errors(cfg.model, params, ref, [_weights_on_outputs]))
  for name, wrong in errors.items():
    print(f"llama4: mis-mapped ({name}): {wrong:.2e}")
    assert wrong > 1000 * TOL, name


@pytest.mark.slow
def test_greedy_generation_and_export_equal_transformers(imported, tmp_path):
  """Left-padded prompts longer than a chunk, 10 new tokens through the KV cache (across chunk ends): each prompt's
  tokens as transformers generates them for that prompt alone (transformers' temperature counts a left-padded row's
  padding as positions; jaxtrain's the token's position). The export is the source bitwise and transformers loads it
  with no missing or unexpected keys, its logits the source's."""
  tmp, ref, *_ = imported
  prompts, new = [[5, 17, 33, 2, 90, 11, 64], [7, 8, 9], [100, 3, 55, 21]], 10
  loaded = generate.load(str(tmp / "out"))
  gen = sampling_lib.Generator(loaded.model, loaded.mesh, loaded.rules, loaded.param_shardings,
                               rows=sampling_lib.padded_rows(len(prompts), loaded.mesh, loaded.rules), prompt_len=7,
                               max_new_tokens=new, eos_ids=())
  ours = gen.generate(loaded.params, prompts)
  with torch.no_grad():
    theirs = [ref.generate(input_ids=torch.tensor([p]), do_sample=False, max_new_tokens=new, pad_token_id=0,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
  assert ours == theirs
  hf.export_model(str(tmp / "out" / "checkpoints"), str(tmp_path / "exported"))
  _exported_equals_source(tmp / "src", tmp_path / "exported")
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert (config["model_type"], config["architectures"]) == ("llama4_text", ["Llama4ForCausalLM"])
  back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"), output_loading_info=True)
  assert not any(info.values()), info  # no missing, unexpected or mismatched keys
  assert (back.config.layer_types, back.config.moe_layers) == (ref.config.layer_types, ref.config.moe_layers)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 20))
  np.testing.assert_array_equal(_hf_logits(back.eval(), tokens), _hf_logits(ref, tokens))


def _config(workdir, **mesh):
  c = small_config(workdir, **mesh)
  m = models.defaults("llama4")
  m.update(num_layers=4, vocab_size=256, moe_every=2, attention_chunk_size=6, floor_scale=4, num_experts=4,
           experts_per_token=2, expert_mlp_dim=32, load_balance_weight=0.01, router_z_weight=0.001,
           rope_original_max_positions=16)
  c.model = m
  return c


@pytest.mark.slow
def test_trains_sharded_equal_to_one_device(tmp_path):
  """fsdp 2 x tensor 2 x expert 2, and context 2 x expert 2 (blockwise: chunks masked by position over gathered
  keys), against one device (packed rows, chunks shorter than the documents, a NoPE layer, top-2 weighted inputs,
  the auxiliary losses on): the loss and every gradient within 1e-5."""
  from tests.test_pipeline import assert_trains_like_one_device
  assert_trains_like_one_device(lambda name, **mesh: _config(tmp_path / name, **mesh),
                                [(dict(fsdp=2, tensor=2, expert=2), {}),
                                 (dict(context=2, expert=2), {"attention": "blockwise"})],
                                one_device_params=True)


@pytest.mark.slow
def test_lora_fine_tune_of_an_import_exports_what_jaxtrain_computes(tmp_path, sft_data):  # noqa: F811
  _hf_llama4(tmp_path / "src")
  lora_fine_tune_exports_what_jaxtrain_computes(tmp_path, sft_data)


def test_scout_has_the_published_parameter_counts():
  """configs/llama4_scout.py: total transformers' count for the config.json jaxtrain would export (built on the meta
  device), the published 109B less the vision encoder and projector; active (1 of 16 routed experts and the shared
  one) the published 17B."""
  model_cfg = importlib.import_module("configs.llama4_scout").get_config().model
  total, active = llama4.param_counts(model_cfg, models.Model.from_config(model_cfg).abstract_params)
  hf_cfg = transformers.AutoConfig.for_model(**hf.hf_config(model_cfg))
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
  assert total == theirs == 107_769_861_120
  assert round(active / 1e9) == 17


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
  """Forked commands: chunked attention on splash; the multimodal checkpoint's import."""
  tmp = tmp_path_factory.mktemp("refused")
  (tmp / "vision").mkdir()
  (tmp / "vision" / "config.json").write_text(json.dumps({"model_type": "llama4", "architectures": [
      "Llama4ForConditionalGeneration"]}))
  return tmp, forked.run_many([
      ["-m", "jaxtrain.main", "--config=configs/tiny.py", "--config.model.name=llama4",
       "--config.model.attention=splash", f"--config.workdir={tmp / 'splash'}"],
      ["tools/convert_hf.py", "import", f"--hf={tmp / 'vision'}", f"--output={tmp / 'out'}"]])


@pytest.mark.parametrize("case,message", [
    (0, "model.attention: the backend 'splash' masks by token index and has no chunked attention"),
    (1, "is Llama 4's multimodal checkpoint (Llama4ForConditionalGeneration)")])
def test_bad_settings_are_one_line_exit_2(refusals, case, message):
  tmp, results = refusals
  errors = [line for line in results[case].stderr.splitlines() if ": error:" in line]
  assert results[case].returncode == 2, results[case].stderr
  assert len(errors) == 1 and message in errors[0] and "Traceback" not in results[case].stderr, results[case].stderr
  assert sorted(p.name for p in tmp.iterdir()) == ["vision"]  # nothing written: no workdir, no output

"""DeepSeek-V3 (jaxtrain/models/deepseek_v3): random small DeepseekV3ForCausalLMs built by transformers itself (MLA
with a query rank and without one, the value head dim below and above the query/key one, YaRN with DeepSeek's
mscale, 8 experts in 4 groups of which 2 compete, top-3, a shared expert, a dense first layer, a random choice bias;
the first with a multi-token-prediction layer beside, named as the released checkpoints' layer 61):
imported, their logits equal transformers' on a padded batch and a packed row; each feature mapped wrong on purpose
fails that comparison; the MTP module computes DeepSeek's formula on the imported layer; greedy generation (the KV
cache) equals transformers' token for token; import -> export is bitwise (the MTP layer too); fp8 block-quantized
weights dequantize as transformers' do; the bad inputs are one line, exit 2."""

import copy
import json
import pathlib
import types

import jax
import numpy as np
import pytest

from jaxtrain import hf
from jaxtrain import models
from tests import forked
from tests.test_hf import (TOL, _hf_logits, _rel_err, _restore, assert_export_equals_source,
                           assert_greedy_generation_equals, import_quantized, logit_errors, mis_mapping_errors,
                           set_quantization)

from tests.test_hf import torch, transformers  # (skipped there, with why, where they are not installed)

# YaRN over 16 original positions of a 24-token text, mscale != mscale_all_dim (so both cos/sin and the softmax are
# scaled); 8 experts in 4 groups, 2 groups chosen, top 3.
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
            num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=12, routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=64,
            num_nextn_predict_layers=0)
HF_CONFIGS = {
    # (with an MTP layer: _add_mtp_layer)
    "q_lora": dict(BASE, q_lora_rank=24, v_head_dim=10, num_nextn_predict_layers=1, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7,
        "original_max_position_embeddings": 16, "rope_theta": 1e4}),
    "plain_q": dict(BASE, q_lora_rank=None, v_head_dim=24),  # v wider than q/k (20): q and k padded
}


def _hf_deepseek(folder, name="q_lora", seed=0):
  torch.manual_seed(seed)
  model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_CONFIGS[name])).eval()
  with torch.no_grad():
    for n, p in model.named_parameters():  # norms random too, the latents' of a size that matters
      p.add_(torch.randn_like(p) * (0.5 if n.endswith("_a_layernorm.weight") else 0.05))
    for n, b in model.named_buffers():  # a choice bias of the size of the scores' spread
      if n.endswith("e_score_correction_bias"):
        b.copy_(torch.randn_like(b) * 0.02)
  model.save_pretrained(folder, safe_serialization=True)
  (pathlib.Path(folder) / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
  if HF_CONFIGS[name]["num_nextn_predict_layers"]:
    _add_mtp_layer(folder, seed)
  return model


def _add_mtp_layer(folder, seed):
  """The multi-token-prediction layer the released checkpoints carry (transformers' model has none) added to the
  saved weights as layer num_hidden_layers: ``enorm``, ``hnorm``, ``eh_proj``, a MoE decoder layer (layer 1's
  tensors plus noise), ``shared_head.norm``, and copies of the embedding and head (``embed_tokens``,
  ``shared_head.head``)."""
  from safetensors.torch import load_file, save_file
  file = str(pathlib.Path(folder) / "model.safetensors")
  tensors, gen = load_file(file), torch.Generator().manual_seed(seed + 7)
  n = BASE["num_hidden_layers"]
  noise = lambda t, s: t + torch.randn(t.shape, generator=gen) * s  # noqa: E731
  for name in [k for k in tensors if k.startswith("model.layers.1.")]:
    tensors[name.replace("model.layers.1.", f"model.layers.{n}.")] = noise(tensors[name], 0.05).contiguous()
  d = BASE["hidden_size"]
  for name in ("enorm", "hnorm", "shared_head.norm"):
    tensors[f"model.layers.{n}.{name}.weight"] = noise(torch.ones(d), 0.1)
  tensors[f"model.layers.{n}.eh_proj.weight"] = noise(torch.zeros(d, 2 * d), 0.1)
  tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
  tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
  save_file(tensors, file, metadata={"format": "pt"})


def _jitted(model):
  """``model`` with its ``apply`` jitted: the same forward compiled once per input shape, instead of run eagerly op by
  op (measured: 1.9 CPU-s instead of 8.9 for tests/test_hf.py's logit_errors on the q_lora model)."""
  return types.SimpleNamespace(apply=jax.jit(model.apply))


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def imported(request, tmp_path_factory):
  """(name, folder, the transformers model, the imported config, model and params)."""
  tmp = tmp_path_factory.mktemp(request.param)
  ref = _hf_deepseek(tmp / "src", request.param)
  hf.import_model(str(tmp / "src"), str(tmp / "out"))
  cfg, model, params = _restore(tmp / "out")
  return request.param, tmp, ref, cfg, model, params


# Each feature mapped wrong: (what it does to a copy of the imported config and params).
def _no_choice_bias(params, cfg):
  params["layers"]["moe"]["score_bias"] = np.zeros_like(params["layers"]["moe"]["score_bias"])


def _bias_in_the_weights(params, cfg):  # transformers weighs by the scores without the bias
  cfg.routed_scaling_factor = 2.0


def _no_groups(params, cfg):
  cfg.num_groups = 1


def _unnormalized_topk(params, cfg):
  cfg.normalize_topk = False


def _no_shared_expert(params, cfg):
  shared = params["layers"]["moe"]["shared"]["down"]["kernel"]
  params["layers"]["moe"]["shared"]["down"]["kernel"] = np.zeros_like(shared)


def _dense_layer_as_moe_layer_norms(params, cfg):  # the dense layer's MLP norm read from the MoE layer's
  params["dense_layers"]["mlp_norm"]["scale"] = params["layers"]["mlp_norm"]["scale"][:1].copy()


def _rope_not_interleaved(params, cfg):
  cfg.rope_interleave = False


def _kv_latent_unnormalized(params, cfg):
  for stack in ("dense_layers", "layers"):
    params[stack]["attn"]["kv_norm"]["scale"] = np.ones_like(params[stack]["attn"]["kv_norm"]["scale"])


def _rope_key_from_the_latent_end(params, cfg):  # kv_a's [latent | rope key] split the other way round
  for stack in ("dense_layers", "layers"):
    kv_a = params[stack]["attn"]["kv_a"]["kernel"]
    params[stack]["attn"]["kv_a"]["kernel"] = np.concatenate([kv_a[..., -cfg.kv_lora_rank:],
                                                              kv_a[..., :-cfg.kv_lora_rank]], axis=-1)


def _keys_values_swapped_heads(params, cfg):  # kv_b's heads in the wrong order
  for stack in ("dense_layers", "layers"):
    params[stack]["attn"]["kv_b"]["kernel"] = params[stack]["attn"]["kv_b"]["kernel"][..., ::-1, :].copy()


def _q_latent_unnormalized(params, cfg):
  for stack in ("dense_layers", "layers"):
    params[stack]["attn"]["q_norm"]["scale"] = np.ones_like(params[stack]["attn"]["q_norm"]["scale"])


def _no_mscale(params, cfg):
  cfg.rope_yarn_mscale_all_dim = 0.0


def _no_yarn(params, cfg):
  cfg.rope_scaling = ""


MIS_MAPS = [_no_choice_bias, _bias_in_the_weights, _no_groups, _unnormalized_topk, _no_shared_expert,
            _dense_layer_as_moe_layer_norms, _rope_not_interleaved, _kv_latent_unnormalized,
            _rope_key_from_the_latent_end, _keys_values_swapped_heads]
MIS_MAPS_Q_LORA = [_q_latent_unnormalized, _no_mscale, _no_yarn]  # (the other config has none of these)


def test_imported_logits_equal_transformers_and_each_mis_mapping_fails(imported):
  name, _, ref, cfg, model, params = imported
  m = cfg.model
  assert m.name == "deepseek_v3"
  assert (m.q_lora_rank, m.v_head_dim, m.num_groups, m.topk_groups, m.first_dense_layers, m.num_shared_experts) == (
      24 if name == "q_lora" else 0, 10 if name == "q_lora" else 24, 4, 2, 1, 1)
  assert (m.rope_scaling, m.rope_yarn_mscale_all_dim) == (("yarn", 0.7) if name == "q_lora" else ("", 1.0))
  padded, packed = logit_errors(_jitted(model), params, ref)
  print(f"deepseek_v3 {name}: max relative logit error padded {padded:.2e}, packed {packed:.2e}")
  assert padded < TOL and packed < TOL
  without_mtp = m.copy_and_resolve_references()
  without_mtp.mtp_depth = 0  # (the logits without the MTP module's work)
  errors = mis_mapping_errors(without_mtp, {k: v for k, v in params.items() if k != "mtp"}, ref,
                              MIS_MAPS + (MIS_MAPS_Q_LORA if name == "q_lora" else []))
  for mis_map, wrong in errors.items():
    print(f"deepseek_v3 {name}: mis-mapped ({mis_map}): {wrong:.2e}")
    assert wrong > 100 * TOL, mis_map


@pytest.mark.parametrize("mla_cache", ["latent", "full"])
def test_greedy_generation_equals_transformers(imported, mla_cache):
  """Left-padded prompts, the compressed cache (the latent and the rope key a token, W_kvb absorbed) and the full
  one (every head's keys and values): token for token; the cache's bytes per token are cache_bytes_per_token's."""
  from jaxtrain.models import deepseek_v3
  _, tmp, ref, cfg, *_ = imported
  loaded = assert_greedy_generation_equals(tmp / "out", ref, [f"model.mla_cache={mla_cache}"])
  cache = loaded.model.init_cache(4, 17)
  per_token = deepseek_v3.cache_bytes_per_token(loaded.model.cfg)
  assert (cache.k.nbytes + cache.v.nbytes) / (4 * 17) == per_token[mla_cache]
  print(f"deepseek_v3 cache bytes per token ({cfg.model.num_layers} layers): {per_token}")


def test_import_export_is_bitwise_and_loads_in_transformers(imported, tmp_path, monkeypatch):
  """The MTP layer (q_lora) too: transformers ignores it as it ignores the released checkpoints' layer 61."""
  name, tmp, ref, *_ = imported
  n = BASE["num_hidden_layers"]
  monkeypatch.setattr(transformers.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected",
                      [rf"model\.layers\.{n}\..*"])
  assert_export_equals_source(tmp, ref, tmp_path / "exported")
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert config["num_nextn_predict_layers"] == (1 if name == "q_lora" else 0)


def test_the_mtp_module_computes_deepseeks_formula_on_the_imported_layer(imported, tmp_path):
  """The imported MTP layer (model.mtp_depth 1, from the weights) computes DeepSeek's module: ``logits =
  head(shared_head.norm(Block(eh_proj([enorm(Emb(t_{i+1})) | hnorm(h_i)]))))``, h_i the main model's output
  (transformers' last hidden state), Block the checkpoint's layer-N decoder layer run by transformers (a one-layer
  DeepseekV3ForCausalLM holding it, shared_head.norm as its final norm, shared_head.head as its head), the norms and
  eh_proj in torch, all from the source file's tensors: within TOL of jaxtrain's module."""
  from safetensors.torch import load_file, save_file
  name, tmp, ref, cfg, model, params = imported
  if name != "q_lora":
    pytest.skip("the config with an MTP layer")
  assert cfg.model.mtp_depth == 1
  src, p = load_file(str(tmp / "src" / "model.safetensors")), f"model.layers.{BASE['num_hidden_layers']}."
  own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
  tensors = {"model.layers.0." + k[len(p):]: v for k, v in src.items()
             if k.startswith(p) and not k[len(p):].startswith(own)}
  tensors.update({"model.embed_tokens.weight": src[p + "embed_tokens.weight"],
                  "model.norm.weight": src[p + "shared_head.norm.weight"],
                  "lm_head.weight": src[p + "shared_head.head.weight"]})
  (tmp_path / "block").mkdir()
  save_file(tensors, str(tmp_path / "block" / "model.safetensors"), metadata={"format": "pt"})
  transformers.DeepseekV3Config(**dict(HF_CONFIGS[name], num_hidden_layers=1, first_k_dense_replace=0,
                                       num_nextn_predict_layers=0)).save_pretrained(tmp_path / "block")
  block, info = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "block", output_loading_info=True)
  assert not any(info.values()), info
  tokens = np.random.default_rng(2).integers(0, 256, (2, 24)).astype(np.int32)

  def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
  with torch.no_grad():
    h = ref.model(input_ids=torch.tensor(tokens, dtype=torch.long)).last_hidden_state
    emb = src[p + "embed_tokens.weight"][torch.tensor(tokens[:, 1:], dtype=torch.long)]
    mixed = torch.cat([rms(emb, src[p + "enorm.weight"]), rms(h[:, :-1], src[p + "hnorm.weight"])], -1)
    theirs = block.eval()(inputs_embeds=mixed @ src[p + "eh_proj.weight"].T).logits.numpy()
  positions, segments = np.broadcast_to(np.arange(24, dtype=np.int32), (2, 24)), np.ones((2, 24), np.int32)
  def mtp_logits(params, tokens, positions, segments):  # (jitted: eagerly, op by op, it costs several times the CPU)
    module = model.bind(params)
    x, _ = module.stack(tokens, positions, segments)
    return module.mtp_logits(x, tokens, positions, segments)[0][0]
  ours = np.asarray(jax.jit(mtp_logits)(params, tokens, positions, segments), np.float32)[:, :-1]
  err = _rel_err(ours, theirs)
  print(f"deepseek_v3 mtp module: max relative logit error {err:.2e}")
  assert err < TOL
  # The layer's copy of the embedding one bit off the model's: refused (jaxtrain holds one embedding).
  src[p + "embed_tokens.weight"] = src[p + "embed_tokens.weight"].clone()
  src[p + "embed_tokens.weight"][0, 0] = torch.nextafter(src[p + "embed_tokens.weight"][0, 0], torch.tensor(1.0))
  save_file(src, str(tmp_path / "block" / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(hf.HFError, match=r"has model.layers.3.embed_tokens.weight unequal to model.embed_tokens.weight"
                                       r", which jaxtrain holds as one tensor"):
    hf.read_params(str(tmp_path / "block"), cfg.model)


def test_fp8_blocks_dequantize_on_import_as_transformers_does(imported, tmp_path):
  """The released checkpoints' form: every linear weight of the layers as float8_e4m3fn with a float32
  ``weight_scale_inv`` per 128 x 128 block (random codes, scales 2^-8 to 2^-5), the rest bf16, an MTP layer
  beside (imported). The import's weights are bitwise transformers' own dequantization (``_dequantize_fp8_weight``,
  in bf16; the MTP layer's too), and its logits equal those of transformers' model holding them."""
  from safetensors.torch import load_file, save_file
  from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
  name, tmp, ref, *_ = imported
  if name != "q_lora":
    pytest.skip("one config is enough")
  (tmp_path / "src").mkdir()
  tensors, dequantized = load_file(str(tmp / "src" / "model.safetensors")), {}
  gen = torch.Generator().manual_seed(3)
  for n in [n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")]:
    out_dim, in_dim = tensors[n].shape
    codes = (torch.randn(out_dim, in_dim, generator=gen) * 8).to(torch.float8_e4m3fn)
    scale = 2.0 ** -torch.randint(5, 9, (-(-out_dim // 128), -(-in_dim // 128)), generator=gen).float()
    tensors[n], tensors[n + "_scale_inv"] = codes, scale
    dequantized[n] = _dequantize_fp8_weight(codes, scale, [128, 128], torch.float32).to(torch.bfloat16)
  for n in [n for n in tensors if tensors[n].dtype == torch.float32 and not n.endswith("_scale_inv")]:
    tensors[n] = tensors[n].to(torch.bfloat16)
  save_file(tensors, str(tmp_path / "src" / "model.safetensors"))
  model, params = import_quantized(tmp / "src", tmp_path, {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
                                                            [128, 128], "activation_scheme": "dynamic"})
  theirs = copy.deepcopy(ref)
  with torch.no_grad():
    for n, value in tensors.items():
      if n in dequantized:
        value = dequantized[n]
      # (transformers holds the experts fused: gate_up_proj [E, 2f, d], down_proj [E, d, f]: below)
      if not n.endswith("_scale_inv") and not n.startswith("model.layers.3.") and ".experts." not in n:
        target = theirs.get_parameter(n) if not n.endswith("e_score_correction_bias") else theirs.get_buffer(n)
        target.copy_(value.float())
    for layer in range(1, 3):
      experts = theirs.model.layers[layer].mlp.experts
      for e in range(8):
        p = f"model.layers.{layer}.mlp.experts.{e}."
        experts.gate_up_proj[e].copy_(torch.cat([dequantized[p + "gate_proj.weight"],
                                                 dequantized[p + "up_proj.weight"]]).float())
        experts.down_proj[e].copy_(dequantized[p + "down_proj.weight"].float())
  q_b = np.asarray(params["layers"]["attn"]["q_b"]["kernel"][0])
  np.testing.assert_array_equal(q_b.reshape(q_b.shape[0], -1).T,
                                dequantized["model.layers.1.self_attn.q_b_proj.weight"].float().numpy())
  np.testing.assert_array_equal(np.asarray(params["mtp"]["eh_proj"]["kernel"][0]).T,
                                dequantized["model.layers.3.eh_proj.weight"].float().numpy())
  padded, packed = logit_errors(_jitted(model), params, theirs.eval())
  print(f"deepseek_v3 fp8: max relative logit error padded {padded:.2e}, packed {packed:.2e}")
  assert padded < TOL and packed < TOL


def test_a_kimi_k2_checkpoint_imports_as_deepseek_v3_and_exports_without_its_remote_code(imported, tmp_path):
  """Kimi K2's config.json (``model_type`` kimi_k2, its own modeling code in ``auto_map``) over the plain_q model:
  the import is DeepSeek-V3's (the same model group, the same params bitwise); the export is ``deepseek_v3`` without
  ``auto_map``, the source's tensors bitwise, and transformers loads it with its own class (no remote code), no
  missing or unexpected keys, and the source's logits."""
  import shutil
  from tests.test_hf import _exported_equals_source
  name, tmp, ref, cfg, _, params = imported
  if name != "plain_q":
    pytest.skip("one config is enough")
  shutil.copytree(tmp / "src", tmp_path / "src")
  config = json.loads((tmp_path / "src" / "config.json").read_text())
  config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
  (tmp_path / "src" / "config.json").write_text(json.dumps(config))
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  kimi_cfg, _, kimi_params = _restore(tmp_path / "out")
  assert kimi_cfg.model.to_dict() == cfg.model.to_dict()
  jax.tree.map(np.testing.assert_array_equal, kimi_params, params)
  hf.export_model(str(tmp_path / "out" / "checkpoints"), str(tmp_path / "exported"))
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert exported["model_type"] == "deepseek_v3" and "auto_map" not in exported
  _exported_equals_source(tmp_path / "src", tmp_path / "exported")
  loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                                   output_loading_info=True)
  assert type(loaded) is transformers.DeepseekV3ForCausalLM and not any(info.values()), info
  tokens = np.random.default_rng(1).integers(0, 256, (2, 20))
  np.testing.assert_array_equal(_hf_logits(loaded.eval(), tokens), _hf_logits(ref, tokens))


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
  """Forked commands: a model of an odd rope dim, expert groups that do not divide the experts, and an import of
  another quantization."""
  tmp = tmp_path_factory.mktemp("refused")
  src = tmp / "int4"
  _hf_deepseek(src)
  set_quantization(src, {"quant_method": "awq"})
  base = ["-m", "jaxtrain.main", "--config=configs/tiny.py", "--config.model.name=deepseek_v3"]
  clip = base + ["--config.model.qk_clip=100"]
  argvs = [base + ["--config.model.qk_rope_head_dim=7", f"--config.workdir={tmp / 'odd'}"],
           base + ["--config.model.num_groups=3", f"--config.workdir={tmp / 'groups'}"],
           ["tools/convert_hf.py", "import", f"--hf={src}", f"--output={tmp / 'out'}"],
           clip + ["--config.mesh.pipeline=2", f"--config.workdir={tmp / 'clip_pipeline'}"],
           clip + ["--config.model.lora.rank=4", f"--config.workdir={tmp / 'clip_lora'}"],
           clip + ["--config.train.objective=dpo", f"--config.workdir={tmp / 'clip_dpo'}"],
           base + ["--config.model.qk_clip=-1", f"--config.workdir={tmp / 'clip_negative'}"]]
  return tmp, forked.run_many(argvs)


@pytest.mark.parametrize("case,message", [
    (0, "jaxtrain: error: model.qk_rope_head_dim: 7 is odd; RoPE turns pairs of dims"),
    (1, "jaxtrain: error: model.num_groups: 3 does not divide model.num_experts=8"),
    (2, "is quantized (awq); only DeepSeek's fp8 e4m3 128 x 128 blocks are dequantized on import"),
    (3, "model.qk_clip: QK-clip is not measured through pipeline stages; set mesh.pipeline=1"),
    (4, "model.qk_clip: QK-clip rescales the base weights, which LoRA freezes; train without model.lora"),
    (5, "model.qk_clip: QK-clip reads the maxima of the lm objective's forward, not train.objective=dpo's"),
    (6, "model.qk_clip")])
def test_bad_inputs_are_one_line_exit_2(refusals, case, message):
  tmp, results = refusals
  forked.assert_one_line_exit_2(results[case], message)
  assert sorted(p.name for p in tmp.iterdir()) == ["int4"]  # nothing written: no workdir, no output


@pytest.mark.slow  # (15 s alone, 39 s in the suite)
def test_the_choice_bias_moves_the_load_toward_uniform(tmp_path):
  """A skewed router (every expert's router row a multiple, -4 to 4, of one direction: a token picks experts
  from one end of the row, by the sign of its hidden state along that direction) imported and trained 30 steps at
  lr 1e-9 (only the choice biases move, by bias_update_speed a step), against the same run with the biases fixed
  (speed 0): the MoE layers' load (``moe/load_max``, the largest expert's load x E: 1 is uniform) is the same at
  step 1 and falls toward 1 with the update only; every bias moved by whole steps of the speed (no weight decay, no
  Adam), and the aux loss that carries the load to the biases is logged as 0. One device: the balancing, not the
  sharding, is the point (measured: the last 10 steps' mean load 1.62 fixed, 1.36 updated)."""
  from jaxtrain.train import trainer
  from tests.test_hf import _load_config
  model = _hf_deepseek(tmp_path / "src", "plain_q")
  with torch.no_grad():
    direction = torch.randn(64)
    for layer in model.model.layers[1:]:
      layer.mlp.gate.weight.copy_(torch.linspace(-4.0, 4.0, 8)[:, None] * direction[None] / 8)
      layer.mlp.gate.e_score_correction_bias.zero_()
  model.save_pretrained(tmp_path / "src", safe_serialization=True)
  (tmp_path / "src" / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')  # (an export carries one)
  hf.import_model(str(tmp_path / "src"), str(tmp_path / "out"))
  runs = {}
  for speed in (0.0, 0.01):
    cfg = _load_config(tmp_path / "out" / "config.py")
    cfg.workdir = str(tmp_path / f"run{speed}")
    cfg.model.bias_update_speed = speed
    cfg.data.update(source="synthetic", seq_len=32)
    cfg.train.update(steps=30, global_batch_size=8, log_every=1)
    cfg.optim.update(lr=1e-9, warmup_steps=0, weight_decay=0.1)
    cfg.checkpoint.verify = False  # (no fingerprint program compiled for the final save: nothing restores it)
    runs[speed] = trainer.train(cfg, devices=jax.devices()[:1])
  (fixed, fixed_logged), (state, logged) = runs[0.0], runs[0.01]
  fixed_load = [m["moe/load_max"] for m in fixed_logged]
  load = [m["moe/load_max"] for m in logged]
  assert len(load) == len(fixed_load) == 30
  print(f"deepseek_v3 balancing: moe/load_max at step 1 {load[0]:.3f}; mean of the last 10 steps: biases fixed "
        f"{np.mean(fixed_load[-10:]):.3f}, updated {np.mean(load[-10:]):.3f}")
  assert load[0] == pytest.approx(fixed_load[0], rel=1e-5) and load[0] > 1.5
  assert np.mean(fixed_load[-10:]) > 1.5 and np.mean(load[-10:]) < np.mean(fixed_load[-10:]) - 0.2
  assert all(m["aux_loss/bias_feedback"] == 0 for m in logged) and "aux_loss/bias_feedback" in logged[-1]
  bias = np.asarray(jax.device_get(state.params["layers"]["moe"]["score_bias"]))
  np.testing.assert_allclose(bias / 0.01, np.round(bias / 0.01), atol=1e-3)  # whole steps of the speed
  assert np.abs(bias).max() > 0.05
  assert not np.any(np.asarray(jax.device_get(fixed.params["layers"]["moe"]["score_bias"])))


@pytest.mark.parametrize("name,moe_layers,experts,total,active", [
    ("deepseek_v3_671b", 58, 256, 671_026_419_200, 37_552_297_472),
    ("kimi_k2_1t", 60, 384, 1_026_408_232_448, 32_861_500_928)])
def test_the_published_sizes_have_the_published_parameter_counts(name, moe_layers, experts, total, active):
  """configs/deepseek_v3_671b.py and configs/kimi_k2_1t.py: the total transformers' count for the config.json
  jaxtrain would export (built on the meta device) plus the choice biases it holds as buffers (a MoE layer's E);
  the published 671B and 37B active (8 of 256 routed experts), 1T and 32B active (8 of 384)."""
  import importlib
  from jaxtrain.models import deepseek_v3
  model_cfg = importlib.import_module(f"configs.{name}").get_config().model
  ours, ours_active = deepseek_v3.param_counts(model_cfg, models.Model.from_config(model_cfg).abstract_params)
  hf_cfg = transformers.AutoConfig.for_model(**hf.hf_config(model_cfg))
  with torch.device("meta"):
    theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(hf_cfg).parameters())
  assert ours == theirs + moe_layers * experts == total
  assert ours_active == active
  assert int(active // 1e9) == (37 if experts == 256 else 32) and round(total / 1e12, 2) in (0.67, 1.03)


def test_the_estimator_sizes_the_published_config_as_its_docstring_says():
  """tools/estimate.py on 1024 chips, expert 64 x fsdp 16, the config's capacity mode and 15 microbatches."""
  import re
  result = forked.run_many([["tools/estimate.py", "--config=configs/deepseek_v3_671b.py", "--devices=1024",
                             "--set=mesh.expert=64", "--set=mesh.fsdp=16"]])[0]
  assert result.returncode == 0, result.stderr[-2000:]
  total = re.search(r"^ +total +([0-9.]+) GiB per device", result.stdout + result.stderr, re.M)
  assert total and round(float(total.group(1)), 1) == 34.2
  assert "34.2 GiB per chip" in (pathlib.Path(__file__).parents[1] / "configs" / "deepseek_v3_671b.py").read_text()


def _config(tmp_path, **mesh):
  from tests.conftest import small_config
  c = small_config(tmp_path, **mesh)
  m = models.defaults("deepseek_v3")
  m.update(num_layers=3, d_model=64, num_heads=4, vocab_size=256, q_lora_rank=32, kv_lora_rank=16,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_experts=8, experts_per_token=2,
           expert_mlp_dim=32, num_groups=4, topk_groups=2, first_dense_layers=1, load_balance_weight=0.01,
           router_z_weight=0.001, rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_positions=16)
  c.model = m
  return c


@pytest.mark.slow
def test_trains_sharded_equal_to_one_device(tmp_path):
  """fsdp 2 x tensor 2 x expert 2 (dropless), tensor 2 x expert 2 (capacity with room for every token), context 2 x
  expert 2 (blockwise: MLA's keys and values gathered over the context axis) and pipeline 2 x expert 2, against one
  device (packed rows, the auxiliary losses on): the loss and every gradient within 1e-5. (fsdp splits the weights
  in the first mesh; the others add their own axis to the expert split on 4 devices.)"""
  from tests.test_pipeline import assert_trains_like_one_device
  assert_trains_like_one_device(lambda name, **mesh: _config(tmp_path / name, **mesh), [
      (mesh, dict(attention="blockwise" if "context" in mesh else "auto", moe_impl=impl, capacity_factor=8.0))
      for mesh, impl in [(dict(fsdp=2, tensor=2, expert=2), "dropless"), (dict(tensor=2, expert=2), "capacity"),
                         (dict(context=2, expert=2), "dropless"), (dict(pipeline=2, expert=2), "dropless")]],
      one_device_params=True)


def _seq_aux_reference(logits, ids, seg) -> float:
  """DeepSeek-V3's sequence-wise balance loss (technical report eq. 17-20, without alpha) in float64, token by token:
  per row of real tokens (T of them) sum_i f_i P_i, f_i = N_r / (K_r T) x the tokens that chose expert i, P_i the
  mean of s'_{i,t} = s_{i,t} / sum_j s_{j,t} (s the sigmoid scores); the mean over the rows holding a token."""
  s = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
  n_r, k_r, ids = s.shape[-1], ids.shape[-1], np.asarray(ids)
  rows = []
  for b in range(s.shape[0]):
    real = [t for t in range(s.shape[1]) if seg[b, t] != 0]
    if real:
      f = [n_r / (k_r * len(real)) * sum(i in ids[b, t] for t in real) for i in range(n_r)]
      p = np.mean([s[b, t] / np.sum(s[b, t]) for t in real], axis=0)
      rows.append(np.dot(f, p))
  return float(np.mean(rows))


def test_multi_token_prediction_and_sequence_wise_losses_equal_independent_computations():
  """mtp_depth 2 on a packed row of two documents and padding, a row of one document and padding, and a row of
  padding only: the aux loss ``mtp`` (weighted by model.mtp_weight, logged as aux_loss/mtp) equals the mean over the
  two modules of their mean cross-entropy computed here in numpy from the stack's output (each module: h_k =
  Block([enorm(Emb(t_{i+k})) | hnorm(h_{k-1})] W_eh), h_0 the stack's normalized output; logits the shared head's
  of post_norm(h_k); targets t_{i+k+1} of the same document only); the logits are those of the model without the
  modules. The modules' MoE blocks count among the MoE layers: ``load_balance`` and ``seq_aux`` (model.seq_aux_weight
  > 0; _seq_aux_reference, float64, from each block's routing) are the means over the stack's layer and the two
  blocks (the trainer moving the blocks' choice biases: test_a_training_step_moves_the_mtp_blocks_choice_bias)."""
  from jaxtrain.train import step as step_lib
  from flax import nnx
  m = models.defaults("deepseek_v3")
  m.update(mtp_depth=2, vocab_size=64, seq_aux_weight=1e-4)
  model = models.Model.from_config(m)
  weights = model.aux_loss_weights(step_lib.aux_loss_names(model, 8))
  assert (weights["mtp"], weights["seq_aux"], weights["bias_feedback"]) == (0.3, 1e-4, 1.0)
  params = jax.tree.map(lambda a: a + 0.1 * np.random.default_rng(0).standard_normal(a.shape).astype(np.float32),
                        model.init(jax.random.key(0)))
  t = 16
  tokens = np.random.default_rng(1).integers(0, 64, (3, t)).astype(np.int32)
  seg = np.array([[1] * 7 + [2] * 6 + [0] * 3, [1] * 11 + [0] * 5, [0] * t], np.int32)
  pos = np.array([list(range(7)) + list(range(6)) + [0] * 3, list(range(11)) + [0] * 5, [0] * t], np.int32)
  out = model.forward(params, tokens, pos, seg)
  plain = {k: v for k, v in params.items() if k != "mtp"}
  m0 = m.copy_and_resolve_references()
  m0.mtp_depth = 0
  np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(models.Model.from_config(m0).forward(
      plain, tokens, pos, seg).logits))

  module = model.bind(params)

  def routed(block, x):  # (the block's aux losses, its routing's seq_aux in float64)
    moe_in = block.mlp_norm(x + block.attn(block.attn_norm(x), pos, seg))
    logits, _, ids, _ = block.moe.route(moe_in)
    return block(x, pos, seg)[1], _seq_aux_reference(logits, ids, seg)

  x, blocks = module.embed_tokens(tokens, pos, seg), []
  for i in range(m.num_layers - m.first_dense_layers):
    w = jax.tree.map(lambda a, i=i: a[i], nnx.state(module.layers))
    blocks.append(routed(nnx.merge(nnx.graphdef(module.layers), w), x))
    x, _ = module.apply_layer(w, x, (pos, seg))

  def rms(v, scale, eps=m.norm_eps):
    v = np.asarray(v, np.float64)
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * np.asarray(scale)

  mtp, table, head = params["mtp"], np.asarray(params["embed"]["embedding"]), np.asarray(params["lm_head"]["kernel"])
  h, losses, mtp_loads = rms(x, params["final_norm"]["scale"]), [], []
  for k in (1, 2):
    w = jax.tree.map(lambda a, k=k: np.asarray(a[k - 1]), mtp)
    ahead = np.array([[row[min(i + k, t - 1)] for i in range(t)] for row in tokens])
    mixed = np.concatenate([rms(table[ahead], w["enorm"]["scale"]), rms(h, w["hnorm"]["scale"])], -1)
    block = nnx.merge(nnx.graphdef(module.mtp), jax.tree.map(lambda a, k=k: a[k - 1], nnx.state(module.mtp))).block
    block_in = jax.numpy.asarray(mixed @ w["eh_proj"]["kernel"], jax.numpy.float32)
    blocks.append(routed(block, block_in))
    h, _, metrics = block(block_in, pos, seg)  # h_k: the next module's input
    mtp_loads.append(np.array([metrics[f"moe/load/e{e:02d}"] for e in range(m.num_experts)]))
    logits = rms(h, w["post_norm"]["scale"]) @ head
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    nll = [-logp[b, i, tokens[b, i + k + 1]] for b in range(3) for i in range(t - k - 1)
           if seg[b, i] != 0 and seg[b, i + k + 1] == seg[b, i]]
    assert len(nll) == (7 - k - 1) + (6 - k - 1) + (11 - k - 1)
    losses.append(np.mean(nll))
  ours = float(out.aux_losses["mtp"])
  print(f"deepseek_v3 mtp: {ours:.6f}, independent {np.mean(losses):.6f}")
  assert ours == pytest.approx(np.mean(losses), rel=1e-5)
  assert len(blocks) == 3  # the stack's MoE layer and the two modules' blocks
  assert float(out.aux_losses["load_balance"]) == pytest.approx(np.mean([float(a["load_balance"])
                                                                          for a, _ in blocks]), rel=1e-5)
  seq_aux = np.mean([r for _, r in blocks])
  print(f"deepseek_v3 seq_aux: {float(out.aux_losses['seq_aux']):.6f}, float64 {seq_aux:.6f}")
  assert float(out.aux_losses["seq_aux"]) == pytest.approx(seq_aux, rel=1e-5) and seq_aux > 1.0


def test_muon_takes_the_dense_and_mtp_layers_matrices():
  """optim.name=muon on DeepSeek-V3 with MTP: the dense first layers' and the MTP modules' matrices (stacked,
  leading axis the layer) get Muon's momentum like the MoE layers', not AdamW's mu and nu; their norm scales, the
  embedding and head stay AdamW's; the choice biases neither's (the balance update)."""
  from jaxtrain import optim
  from jaxtrain.config import base_config
  m = models.defaults("deepseek_v3")
  m.update(mtp_depth=1, vocab_size=64)
  model = models.Model.from_config(m)
  c = base_config()
  c.optim.name = "muon"
  optim.check_muon(model.abstract_params, model.logical_specs, "deepseek_v3")
  tx = optim.make(c.optim, 10, model.trainable_mask(), model.logical_specs, model.balance())
  state = jax.eval_shape(tx.init, model.abstract_params)
  held = {"muon": set(), "adamw": set()}
  for path, _ in jax.tree_util.tree_leaves_with_path(state):
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    part = next((k for k in keys if k in held), None)
    if part and "mu" in keys:
      held[part].add("/".join(str(k) for k in keys[keys.index("mu") + 1:]))
  for name in ("dense_layers/mlp/gate/kernel", "dense_layers/mlp/down/kernel", "dense_layers/attn/kv_b/kernel",
               "dense_layers/attn/q_a/kernel", "mtp/eh_proj/kernel", "mtp/block/moe/up", "layers/attn/o/kernel"):
    assert name in held["muon"] and name not in held["adamw"], name
  for name in ("dense_layers/mlp_norm/scale", "mtp/enorm/scale", "embed/embedding", "lm_head/kernel"):
    assert name in held["adamw"] and name not in held["muon"], name
  assert not any("score_bias" in n for n in held["muon"] | held["adamw"])


@pytest.mark.slow
def test_a_training_step_moves_the_mtp_blocks_choice_bias(tmp_path):
  """Three steps of the trainer (Muon, the sequence-wise loss on, MTP depth 1, bias_update_speed 0.01): the MTP
  block's choice bias moves by whole steps of the speed, as the stack's does (its load reaches it through the aux
  loss bias_feedback, the modules' MoE outputs kept): at least half of each stack's biases away from 0 after
  three steps; aux_loss/seq_aux and aux_loss/mtp are logged."""
  from jaxtrain.train import trainer
  c = _config(tmp_path)
  c.model.update(mtp_depth=1, seq_aux_weight=1e-4, bias_update_speed=0.01)
  c.optim.update(name="muon", lr=1e-9, warmup_steps=0)
  c.train.update(steps=3, global_batch_size=4)
  c.data.seq_len = 16
  c.checkpoint.verify = False  # (no fingerprint program compiled for the final save: nothing restores it)
  state, logged = trainer.train(c, devices=jax.devices()[:1])
  assert {"aux_loss/seq_aux", "aux_loss/mtp", "aux_loss/bias_feedback"} <= set(logged[-1])
  print(f"deepseek_v3 training step: seq_aux {logged[-1]['aux_loss/seq_aux']:.4f}, "
        f"mtp {logged[-1]['aux_loss/mtp']:.4f}")
  for stack in ("mtp", "layers"):
    p = state.params[stack]
    bias = np.asarray(jax.device_get((p["block"] if stack == "mtp" else p)["moe"]["score_bias"]))
    np.testing.assert_allclose(bias / 0.01, np.round(bias / 0.01), atol=1e-3)
    assert np.count_nonzero(np.round(bias / 0.01)) >= bias.size // 2, stack


def test_mla_dims_the_cudnn_kernel_cannot_take_are_one_line():
  """The family's check (validation runs it after the backend's own, which refuses cudnn off a GPU first): the
  padded head dim max(qk_nope + qk_rope, v) past cuDNN's 256 or not a multiple of 8 names model.attention."""
  from jaxtrain.errors import ConfigError
  from jaxtrain.models import deepseek_v3
  m = models.defaults("deepseek_v3")
  m.update(attention="cudnn", qk_nope_head_dim=250)
  with pytest.raises(ConfigError, match=r"model.attention: 'cudnn' needs a head dim that is a multiple of 8 up to "
                     r"256 and MLA's is 258"):
    deepseek_v3.validate(m)
  m.update(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)  # DeepSeek-V3's: 192
  deepseek_v3.validate(m)

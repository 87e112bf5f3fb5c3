"""HF-format import (attnprec.checkpoints.hf) against transformers, the independent reference.

For each model type a tiny random model is built with transformers' own config and model
classes, saved with `save_pretrained`, imported, and its float32 logits compared with
transformers' (eager attention) on random tokens.

Tolerance: max abs 1e-4 on logits of magnitude ~1-10. Both sides compute in float32
(XLA:CPU and torch CPU differ only in summation order, ~1e-6 here); any convention error
(transposes, norm (1 + w), RoPE layout or base, window off-by-one, soft-cap, query scale)
moves logits by > 1e-2, which each ablation below demonstrates for its feature.
"""
import dataclasses
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

from attnprec import checkpoints  # noqa: E402
from attnprec.checkpoints.hf_config import config_from_hf  # noqa: E402
from attnprec.errors import UserError  # noqa: E402
from attnprec.model import transformed  # noqa: E402
from attnprec.precision import Precision  # noqa: E402

TOL = 1e-4
B, T = 2, 16          # T > every sliding window below, so windows bind
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, rms_norm_eps=1e-6)


def _hf_config(model_type):
  tf = transformers
  if model_type == "llama":
    return tf.LlamaConfig(**COMMON, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "linear", "factor": 2.0,
                                           "rope_theta": 500.0})
  if model_type == "qwen2":
    return tf.Qwen2Config(**{k: v for k, v in COMMON.items() if k != "head_dim"},
                          tie_word_embeddings=True, use_sliding_window=True,
                          sliding_window=4, max_window_layers=1,
                          rope_parameters={"rope_type": "default", "rope_theta": 300.0})
  if model_type == "gemma":
    return tf.GemmaConfig(**COMMON, hidden_act="gelu_pytorch_tanh")
  if model_type == "gemma2":
    return tf.Gemma2Config(**COMMON, sliding_window=4, query_pre_attn_scalar=32,
                           attn_logit_softcapping=2.0, final_logit_softcapping=1.5)
  if model_type == "gemma3":
    return tf.Gemma3TextConfig(
        **COMMON, sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
  raise ValueError(model_type)


def _randomize(model, model_type):
  """Random weights everywhere (HF zero-inits biases and norms); q/k scaled up for gemma2
  so its attention soft-cap binds."""
  gen = torch.Generator().manual_seed(0)
  gemma = model_type.startswith("gemma")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (0.0 if gemma else 1.0))
      else:
        p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
      if model_type == "gemma2" and ("q_proj" in name or "k_proj" in name):
        p.mul_(3.0)


def save_tiny(model_type, directory, **save_kwargs):
  """A random transformers model of `model_type` saved to `directory`; returns it."""
  torch.manual_seed(0)
  config = _hf_config(model_type)
  config._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  _randomize(model, model_type)
  model.eval()
  model.save_pretrained(directory, **save_kwargs)
  return model


def hf_logits(model, tokens_BxT):
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens_BxT))).logits.float().numpy()


def random_tokens(vocab=COMMON["vocab_size"]):
  return np.random.default_rng(1).integers(0, vocab, (B, T)).astype(np.int32)


# Each ablation turns one feature off in OUR config; it must move the logits by far more
# than TOL, so the parity check above actually covers that feature.
ABLATIONS = {
    "llama": [dict(rope_scale=1.0), dict(rope_base=10_000.0)],
    "qwen2": [dict(sliding_window=None, layer_pattern=("global",)), "zero_bias"],
    "gemma": [dict(embed_scale=False), dict(norm_plus_one=False)],
    "gemma2": [dict(attn_logit_soft_cap=None), dict(final_logit_soft_cap=None),
               dict(sliding_window=None, layer_pattern=("global",)), dict(query_scale=None)],
    "gemma3": [dict(sliding_window=None, layer_pattern=("global",)),
               dict(rope_base_local=None), dict(rope_scale=1.0), dict(query_scale=None)],
}


@pytest.mark.parametrize("model_type", list(ABLATIONS))
def test_hf_import_matches_transformers(model_type, tmp_path):
  """Tiny random model of each type: our import's float32 logits == transformers'."""
  model = save_tiny(model_type, tmp_path)
  ckpt = checkpoints.load(tmp_path)
  tokens = random_tokens()
  ours = np.asarray(checkpoints.logits(ckpt, tokens))
  ref = hf_logits(model, tokens)
  assert ours.shape == ref.shape == (B, T, COMMON["vocab_size"])
  diff = float(np.abs(ours - ref).max())
  print(f"{model_type}: max abs diff {diff:.2e}")
  assert diff <= TOL, f"{model_type}: max abs diff {diff:.2e} > {TOL}"

  for ablation in ABLATIONS[model_type]:
    config, params = ckpt.config, ckpt.params
    if ablation == "zero_bias":
      params = {m: {n: (0 * v if n == "b" else v) for n, v in d.items()}
                for m, d in params.items()}
    else:
      config = dataclasses.replace(config, **ablation)
    with jax.disable_jit():   # op by op: far cheaper than compiling each variant
      ablated = transformed(config).apply(params, tokens, precision=Precision()).logits
    moved = float(np.abs(np.asarray(ablated) - ref).max())
    assert moved > 100 * TOL, f"{model_type}: {ablation} does not change the logits"


def test_config_matches_transformers_semantics(tmp_path):
  """The imported configs carry what transformers' modeling code uses."""
  save_tiny("gemma3", tmp_path)
  cfg = checkpoints.load(tmp_path).config
  assert cfg.layer_pattern == ("local", "local", "global")
  assert cfg.sliding_window == 4 and cfg.qk_norm and cfg.norm_plus_one and cfg.embed_scale
  assert (cfg.rope_base, cfg.rope_scale, cfg.rope_base_local) == (1e6, 4.0, 1e4)
  assert cfg.query_scale == pytest.approx(24 ** -0.5)


def test_legacy_and_multimodal_gemma3_configs():
  """Older config.json keys (rope_theta, rope_scaling, rope_local_base_freq,
  sliding_window_pattern) and the multimodal nesting give what transformers parses."""
  legacy = dict(model_type="gemma3_text", vocab_size=96, hidden_size=64,
                intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, rope_theta=1e6,
                rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                sliding_window=512, sliding_window_pattern=4, query_pre_attn_scalar=256)
  ref = transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items()
                                         if k != "model_type"})
  for raw in (legacy, {"model_type": "gemma3", "text_config": legacy}):
    cfg = config_from_hf(raw)
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
    assert kinds == [{"sliding_attention": "local", "full_attention": "global"}[t]
                     for t in ref.layer_types]
    assert cfg.rope_base == ref.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.rope_scale == ref.rope_parameters["full_attention"]["factor"]
    assert cfg.rope_base_local == ref.rope_parameters["sliding_attention"]["rope_theta"]
    assert cfg.tie_embeddings and cfg.query_scale == 256 ** -0.5


def test_sharded_and_bfloat16(tmp_path):
  """A sharded checkpoint (index + several files) imports the same params; bfloat16
  params are the float32 ones rounded."""
  save_tiny("llama", tmp_path / "one")
  save_tiny("llama", tmp_path / "many", max_shard_size="40KB")
  shards = [f for f in os.listdir(tmp_path / "many") if f.endswith(".safetensors")]
  assert len(shards) > 2 and os.path.exists(tmp_path / "many/model.safetensors.index.json")
  one, many = checkpoints.load(tmp_path / "one"), checkpoints.load(tmp_path / "many")
  bf16 = checkpoints.load(tmp_path / "many", param_dtype="bfloat16")
  for m, d in one.params.items():
    for n, v in d.items():
      np.testing.assert_array_equal(np.asarray(v), np.asarray(many.params[m][n]))
      assert str(bf16.params[m][n].dtype) == "bfloat16"
      np.testing.assert_array_equal(np.asarray(v.astype("bfloat16")),
                                    np.asarray(bf16.params[m][n]))


# ----------------------------------------------------------------------------- errors
def _edit_config(directory, **changes):
  path = directory / "config.json"
  cfg = json.loads(path.read_text())
  cfg.update(changes)
  path.write_text(json.dumps(cfg))


def test_error_missing_paths(tmp_path):
  with pytest.raises(UserError, match="does not exist"):
    checkpoints.load(tmp_path / "nope")
  with pytest.raises(UserError, match="no config.json"):
    checkpoints.load(tmp_path)
  save_tiny("llama", tmp_path / "m")
  os.remove(tmp_path / "m/model.safetensors")
  with pytest.raises(UserError, match="no weights"):
    checkpoints.load(tmp_path / "m")


def test_error_unsupported_architecture(tmp_path):
  save_tiny("llama", tmp_path)
  _edit_config(tmp_path, model_type="mistral")
  with pytest.raises(UserError, match=r"Unsupported model_type 'mistral'.*llama, qwen2, "
                                      r"gemma, gemma2, gemma3"):
    checkpoints.load(tmp_path)
  _edit_config(tmp_path, model_type="llama", rope_parameters={"rope_type": "yarn",
                                                              "rope_theta": 1e4})
  with pytest.raises(UserError, match="unsupported RoPE type 'yarn'"):
    checkpoints.load(tmp_path)


@pytest.mark.parametrize("keep", ["4 bytes", "mid header", "half", "all but 3 bytes"])
def test_error_truncated_safetensors(tmp_path, keep):
  save_tiny("llama", tmp_path)
  path = tmp_path / "model.safetensors"
  data = path.read_bytes()
  cut = {"4 bytes": 4, "mid header": 40, "half": len(data) // 2,
         "all but 3 bytes": len(data) - 3}[keep]
  path.write_bytes(data[:cut])
  with pytest.raises(UserError, match=r"model.safetensors is not a valid .safetensors file.*"
                                      r"truncated"):
    checkpoints.load(tmp_path)
  path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
  with pytest.raises(UserError, match="header cannot be read"):
    checkpoints.load(tmp_path)


def test_error_shape_disagrees_with_config(tmp_path):
  save_tiny("llama", tmp_path)
  _edit_config(tmp_path, intermediate_size=96)
  with pytest.raises(UserError) as e:
    checkpoints.load(tmp_path)
  msg = str(e.value)
  assert "model.layers.0.mlp.down_proj.weight" in msg and "model.safetensors" in msg
  assert "(64, 128)" in msg and "(64, 96)" in msg


def test_error_tensor_without_a_place(tmp_path):
  """A tensor our architecture lacks (here q/k/v biases in a llama file) is an error,
  never silently dropped."""
  save_tiny("qwen2", tmp_path)
  _edit_config(tmp_path, model_type="llama")
  with pytest.raises(UserError, match=r"'model.layers.0.self_attn.[qkv]_proj.bias'.*no place"):
    checkpoints.load(tmp_path)


def test_safetensors_file_reads_bfloat16_exactly(tmp_path):
  """bfloat16 and float32 tensors come back bit for bit (written by safetensors.numpy)."""
  import ml_dtypes
  from safetensors.numpy import save_file
  from attnprec.checkpoints.safetensors_file import SafetensorsFile
  rng = np.random.default_rng(0)
  want = {"w": rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16),
          "b": rng.normal(size=(7,)).astype(np.float32)}
  save_file(want, str(tmp_path / "t.safetensors"))
  f = SafetensorsFile(tmp_path / "t.safetensors")
  assert sorted(f.keys()) == ["b", "w"] and f.shape("w") == (3, 5)
  for name, array in want.items():
    got = f.get(name)
    assert got.dtype == array.dtype
    np.testing.assert_array_equal(got.view(np.uint16) if name == "w" else got,
                                  array.view(np.uint16) if name == "w" else array)

"""The sink / key-bias analysis (`attnprec.study.sinks`) on a tiny qwen2-like model.

* `capture`'s NumPy forward pass gives the attention inputs whose attention equals the
  independent float64 forward pass's (`attnprec.study.float64`) layer by layer;
* the logit profile on hand-made queries and keys gives the values computed by hand;
* the kernel's own error: a large key bias (a shared logit offset of ~150, as Qwen2's
  layer 0 has) makes the bf16 QK product's error large, `float32_qk_product` removes it,
  `float32_logits` alone does not, and centring the keys (the same attention function)
  removes it too; the fp32 preset's error is at float32 rounding;
* `analyze` + `plot` write the three PNGs.
"""
import dataclasses

import jax
import numpy as np

from attnprec.config import ModelConfig
from attnprec.study import float64, measure, sinks
from attnprec import presets as preset_lib
from test_train_utils import numpy_params, runner_exit  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
CONFIG = ModelConfig(vocab_size=29, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_hidden=48, qkv_bias=True, tie_embeddings=False,
                     rope_base=1e6)


def tiny(k_bias: float = 0.0):
  """Random params; layer 0's k and q biases share a direction in the slowly rotating RoPE
  dimensions (as Qwen2's do, rope base 1e6), so q . b_k is a large offset shared by every
  key of a query, of ~k_bias * 2."""
  rng = np.random.default_rng(0)
  params = numpy_params(CONFIG, rng)
  params = jax.tree_util.tree_map(
      lambda x: np.asarray(x) + 0.2 * rng.standard_normal(x.shape).astype(np.float32), params)
  if k_bias:
    e = np.zeros(16, np.float32)
    e[[6, 7, 14, 15]] = 0.5                          # the slowest RoPE frequencies
    params["decoder/layer_0/attn/q"]["b"] = np.tile(8 * e, 4)
    params["decoder/layer_0/attn/k"]["b"] = np.tile(k_bias * e, 2)
  return params


def test_capture_matches_the_float64_forward():
  params = tiny(k_bias=40.0)
  tokens = np.random.default_rng(1).integers(0, 29, (2, 12))
  layers = sinks.capture(CONFIG, params, tokens, dtype=np.float64)
  _, attn64 = float64.forward(CONFIG, params, tokens)
  mask = np.tril(np.ones((12, 12), bool))[None, None]
  for layer, a64 in zip(layers, attn64):
    a = sinks.contract.reference_attention_np(layer.q_BxTxNxH, layer.k_BxTxKxH,
                                              layer.v_BxTxKxH, mask=mask)
    assert measure.rel_l2(a, a64) < 1e-10
  # the bias part at position 0 is the bias itself (RoPE at position 0 is the identity)
  b = np.asarray(params["decoder/layer_0/attn/k"]["b"]).reshape(2, 16)
  np.testing.assert_allclose(layers[0].kb_BxTxKxH[0, 0], b, rtol=1e-12)
  f32 = sinks.capture(CONFIG, params, tokens)
  assert f32[0].q_BxTxNxH.dtype == np.float32
  assert measure.rel_l2(f32[1].k_BxTxKxH, layers[1].k_BxTxKxH) < 1e-5


def test_logit_profile_by_hand():
  cfg = dataclasses.replace(CONFIG, num_heads=1, num_kv_heads=1, head_dim=2,
                            query_scale=1.0)
  # 3 positions; logits q_t . k_s with k = [[10, 0], [0, 1], [0, 2]], q_t = [1, 1]
  q = np.ones((1, 3, 1, 2))
  k = np.array([[10.0, 0], [0, 1], [0, 2]]).reshape(1, 3, 1, 2)
  kb = np.zeros_like(k)
  kb[0, :, 0, 0] = 9.0                               # 9 of the sink's 10 is bias
  prof = sinks.logit_profile(cfg, sinks.LayerInputs(q, k, np.zeros_like(k), kb))
  # rows t = 1 (keys 10, 1) and t = 2 (keys 10, 1, 2)
  assert prof["max_abs_logit"] == 10.0
  assert prof["median_sink_logit"] == 10.0
  assert prof["median_other_max"] == 1.5             # median of 1 and 2
  assert prof["median_sink_gap"] == 8.5
  assert np.isclose(prof["median_row_mean"], (5.5 + 13 / 3) / 2)
  mass = [np.exp(10) / (np.exp(10) + np.exp(1)),
          np.exp(10) / (np.exp(10) + np.exp(1) + np.exp(2))]
  assert np.isclose(prof["median_sink_mass"], np.median(mass))
  assert np.isclose(prof["mean_sink_mass"], np.mean(mass))
  assert prof["median_sink_bias_logit"] == 9.0


def test_a_large_key_bias_is_what_the_bf16_qk_product_rounds():
  params = tiny(k_bias=60.0)
  tokens = np.random.default_rng(2).integers(0, 29, (2, 24))
  layer0 = sinks.capture(CONFIG, params, tokens)[0]
  prof = sinks.logit_profile(CONFIG, layer0)
  assert prof["median_abs_row_mean"] > 50           # a large shared offset
  sweep = dict(preset_lib.load_sweep(("bf16", "fp32_logits", "fp32_qk", "fp32"), ()))
  err = {n: sinks.local_error(CONFIG, layer0, p) for n, p in sweep.items()}
  centred = sinks.local_error(CONFIG, layer0, sweep["bf16"], center_keys=True)
  assert err["fp32"] < 1e-5
  assert err["fp32_qk"] < 0.2 * err["bf16"]
  assert err["fp32_logits"] > 0.5 * err["bf16"]     # the softmax upcast alone: no help
  assert centred < 0.2 * err["bf16"]                 # same function, small logits
  # The key offset's fixed c (the bias in the slow RoPE pairs): the same effect as centring.
  offset = sinks.local_error(CONFIG, layer0, sweep["bf16"],
                             key_offset_KxH=sinks.bias_offsets(CONFIG, params)[0])
  assert offset < 0.2 * err["bf16"]
  small = sinks.capture(CONFIG, tiny(), tokens)[0]   # without the bias: a small error
  assert sinks.local_error(CONFIG, small, sweep["bf16"]) < 0.2 * err["bf16"]


def test_analyze_and_plot(tmp_path):
  params = tiny(k_bias=60.0)
  tokens = np.random.default_rng(3).integers(0, 29, (1, 10))
  sweep = preset_lib.load_sweep(("bf16", "fp32_qk"), ())
  res = sinks.analyze(CONFIG, params, {"with": tokens, "without": tokens[:, 1:]}, sweep)
  assert set(res["variants"]) == {"with", "without"}
  assert len(res["bias_norms"]) == 2 and res["bias_norms"][0]["max_abs_bk"] == 30.0
  for v in res["variants"].values():
    assert len(v["profile"]) == 2 and set(v["local"]) == {"bf16", "fp32_qk"}
    assert len(v["local_bias_offset"]["bf16"]) == 2
  assert "key-bias offset" in sinks.report(dict(res, model="tiny", windows=1, length=10))
  no_bias = dataclasses.replace(CONFIG, qkv_bias=False)
  assert sinks.bias_offsets(no_bias, params) is None
  paths = sinks.plot(res, str(tmp_path / "sinks"), "tiny")
  assert len(paths) == 3
  for p in paths:
    assert open(p, "rb").read(8) == PNG


def test_runner_bad_input_exit_2(tmp_path, monkeypatch):
  """Refused before any model is loaded or anything is written: exit code 2 and one
  message naming the setting. The first case runs the runner as a process (its exit
  code); the second drives its `main(argv)` in-process (the same checks, without a
  second process's start-up)."""
  for binding, needle, process in (("sinks.variants=('bos',)", "sinks.variants", True),
                                   ("sinks.length=4", "sinks.length", False)):
    argv = [f"--gin_bindings={binding}", f"--run_dir={tmp_path / 'run'}"]
    rc, err = runner_exit("sinks.py", argv, process=process, monkeypatch=monkeypatch)
    assert rc == 2, err[-2000:]
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_query_scale_placement_costs_nothing_when_the_scale_is_a_power_of_two():
  """prescale_query folds the query scale into q before the bf16 rounding. At head dim 16
  (1/4) and 64 (1/8) the scale is exact in bf16, so the error is bit-identical to the
  contract's; at head dim 128 (1/sqrt(128), as Qwen2.5-1.5B has) q * scale in bf16 is a
  second rounding, which the prescaled variant does not pay: the errors differ."""
  params = tiny(k_bias=60.0)
  tokens = np.random.default_rng(4).integers(0, 29, (2, 24))
  layer0 = sinks.capture(CONFIG, params, tokens)[0]
  sweep = dict(preset_lib.load_sweep(("bf16", "fp32_qk"), ()))
  bf16 = sweep["bf16"]
  assert sinks.local_error(CONFIG, layer0, bf16, prescale_query=True) == \
      sinks.local_error(CONFIG, layer0, bf16)
  # The same inputs viewed as head dim 128 would need new params; instead make the scale
  # explicit and not a power of two (query_scale = 128 ** -0.5 on head dim 16).
  odd = dataclasses.replace(CONFIG, query_scale=128 ** -0.5)
  contract_err = sinks.local_error(odd, layer0, bf16)
  prescaled = sinks.local_error(odd, layer0, bf16, prescale_query=True)
  assert prescaled != contract_err and prescaled > 0

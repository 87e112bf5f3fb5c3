"""The study's logit offset (`study.logit_offset`, attnprec/study/offsets.py): a key bias after
RoPE that shifts each query's logits by a constant.

Comparisons: the float64 NumPy forward pass (an independent implementation) with and
without the offset — the same function, since the softmax ignores a per-query constant;
the offsets the calibration promises against a per-head loop over the queries the probes
collect (attnprec/study/probes.py);
and each precision preset's attention error against float64 with and without the offset.
"""
import jax
import numpy as np
import pytest

from attnprec import model as model_lib
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import REFERENCE, Precision
from attnprec.study import float64, measure, offsets, probes
from test_train_utils import numpy_params  # noqa: E402

CONFIG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=64, mlp_hidden=96, qkv_bias=True, max_seq_len=128)


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(0)
  params = numpy_params(CONFIG, rng)
  # A common query component, as trained models have (their queries share a large mean
  # direction); random-init queries have none.
  for i in range(CONFIG.num_layers):
    b = params[f"decoder/layer_{i}/attn/q"]["b"]
    params[f"decoder/layer_{i}/attn/q"]["b"] = (3.0 * rng.standard_normal(b.shape)).astype(
        np.float32)
  tokens = rng.integers(0, CONFIG.vocab_size, (2, 96)).astype(np.int32)
  p, stats = offsets.add_key_offsets(CONFIG, params, tokens, 200.0)
  return params, tokens, CONFIG, p, stats


def test_offset_leaves_the_function_unchanged(setup):
  params, tokens, cfg, p, _ = setup
  assert probes.has_offsets(p) and not probes.has_offsets(params)
  logits64, attn64 = float64.forward(CONFIG, params, tokens)
  logits64_off, attn64_off = float64.forward(cfg, p, tokens)
  assert np.abs(p["decoder/layer_0/attn/kernel"]["k_offset"]).max() > 10      # a real offset
  np.testing.assert_allclose(logits64_off, logits64, rtol=0, atol=1e-9 * np.abs(logits64).max())
  for a, a_off in zip(attn64, attn64_off):
    assert measure.rel_l2(a_off, a) < 1e-9
  # the fp32 reference is fp32-accurate with the offset too
  _, attn, _ = measure.collect(cfg, p, tokens, REFERENCE)
  for a, a64 in zip(attn, attn64):
    assert measure.rel_l2(a, a64) < 1e-4


def test_offsets_are_what_was_asked(setup):
  _, tokens, cfg, p, stats = setup
  _, _, queries = measure.collect(cfg, p, tokens, REFERENCE)
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  for i, q_BxTxNxH in enumerate(queries):
    b_KxH = np.asarray(p[f"decoder/layer_{i}/attn/kernel"]["k_offset"], np.float64)
    q = np.asarray(q_BxTxNxH, np.float64)
    for kv in range(K):   # query head n reads kv head n // (N // K)
      heads = [n for n in range(N) if n // (N // K) == kv]
      shift = H ** -0.5 * q[:, :, heads, :] @ b_KxH[kv]
      assert shift.mean() == pytest.approx(200.0, rel=1e-4)
    assert stats[i]["mean"] == pytest.approx(200.0, rel=1e-4)
    assert stats[i]["p10"] > 50     # coherent queries: most rows get a large offset


def test_bf16_qk_product_suffers_and_the_float32_product_restores(setup):
  """With the offset, an all-bf16 attention's error grows several-fold; float32_logits
  alone does not help (the rounding happens in the QK product); float32_qk_product does."""
  params, tokens, cfg, p, _ = setup
  _, attn64 = float64.forward(CONFIG, params, tokens)

  def err(config, prm, float32_qk_product=False, float32_logits=False):
    prec = Precision(dtype="bfloat16", float32_qk_product=float32_qk_product,
                     float32_logits=float32_logits)
    _, attn, _ = measure.collect(config, prm, tokens, prec)
    return max(measure.rel_l2(a, a64) for a, a64 in zip(attn, attn64))

  plain = err(CONFIG, params)
  bf16 = err(cfg, p)
  logits_only = err(cfg, p, float32_logits=True)
  qk = err(cfg, p, float32_qk_product=True)
  print(f"bf16 {plain:.4f} -> {bf16:.4f} with the offset; fp32 logits {logits_only:.4f}; "
        f"fp32 qk {qk:.4f}")
  assert bf16 > 3 * plain
  assert logits_only > 0.7 * bf16
  assert qk < 0.5 * bf16


def test_bad_offset_is_refused(setup):
  params, tokens, *_ = setup
  with pytest.raises(UserError, match="must be > 0"):
    offsets.add_key_offsets(CONFIG, params, tokens, -1.0)
  # an offset whose key bias float32 cannot hold: refused before any model runs with it
  with pytest.raises(UserError, match=r"logit_offset = 1e\+308 needs a key bias beyond "
                                      r"float32's range in layer 0.*valid: offsets up to"):
    offsets.add_key_offsets(CONFIG, params, tokens, 1e308)


def test_offsets_must_match_the_architecture(setup):
  params, _, cfg, p, _ = setup
  offsets.check_offsets(cfg, p)
  with pytest.raises(UserError, match="k_offset missing"):
    offsets.check_offsets(cfg, params, "test")
  bad = {**p, "decoder/layer_1/attn/kernel": {"k_offset": np.zeros((3, 3), np.float32)}}
  with pytest.raises(UserError, match=r"has shape \(3, 3\), expected \(2, 64\)"):
    offsets.check_offsets(cfg, bad, "test")


def test_the_model_returns_logits_and_cache_only(setup):
  """The probes observe from outside: with them attached, the model's own output (and
  its parameters) are what they are without them."""
  params, tokens, cfg, _, _ = setup
  apply = model_lib.transformed(cfg).apply
  plain = apply(params, tokens, precision=REFERENCE)
  # `hidden` is filled only when a loss asks for it (`hidden_only`), never by a probe
  assert plain._fields == ("logits", "cache", "hidden") and plain.hidden is None
  logits, attn, queries = measure.collect(cfg, params, tokens, REFERENCE)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain.logits))
  assert len(attn) == len(queries) == cfg.num_layers
  assert set(jax.eval_shape(lambda: model_lib.init_params(cfg, jax.random.PRNGKey(0)))) == set(params)

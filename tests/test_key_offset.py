"""The key offset (`precision.key_offset`, attnprec/keyoffset.py): exact in exact arithmetic,
smaller bf16 error on a key-bias model, the same c for every key a query sees.

References: the float64 NumPy attention of `contract.reference_attention_np` (independent of
JAX) for the invariance; the float32 forward without offset ('none', float32/HIGHEST) for the
model-level errors; an exact complex-number average for the RoPE means.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import decoding, keyoffset
from attnprec import model as model_lib
from attnprec.cache import init_cache
from attnprec.config import ModelConfig
from attnprec.contract import KEY_OFFSETS, causal_mask, reference_attention_np
from attnprec.errors import UserError
from attnprec.precision import Precision

# A small Qwen2-like model: q/k/v biases, GQA (4 query heads over 2 kv heads), head dim 16.
CONFIG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_hidden=64, qkv_bias=True, max_seq_len=256)
BF16 = dict(dtype="bfloat16", float32_qk_product=False, float32_logits=False)
F32_REF = Precision(dtype="float32", matmul_precision="highest", einsum_precision="highest")


@functools.lru_cache(maxsize=None)    # made once (its arrays are immutable; no test edits it)
def _params(bias=150.0, seed=0):
  """Random weights with a Qwen2-like key bias: a large shared component in the two
  lowest-frequency RoPE pairs (their rotation over 256 positions is < 0.05 rad), so that
  every key carries a vector of norm ~200 that bf16 rounds on a grid of 0.5-1."""
  params = jax.jit(model_lib.init_params, static_argnums=0)(CONFIG, jax.random.PRNGKey(seed))
  params = jax.tree_util.tree_map(lambda x: x, params)
  H, half = CONFIG.head_dim, CONFIG.head_dim // 2
  b = np.zeros((CONFIG.num_kv_heads, H), np.float32)
  for pair in (half - 1, half - 2):
    b[:, pair], b[:, pair + half] = bias, -0.6 * bias
  for name in params:
    if name.endswith("attn/k"):
      params[name]["b"] = jnp.asarray(b.reshape(-1))
  return params


def _tokens(B=2, T=48, seed=1):
  return jnp.asarray(np.random.RandomState(seed).randint(0, CONFIG.vocab_size, (B, T)),
                     jnp.int32)


@functools.partial(jax.jit, static_argnames=("precision", "config"))
def _logits(params, tokens, precision, cache=None, config=CONFIG):
  return model_lib.transformed(config).apply(params, tokens, None, cache,
                                             precision=precision).logits


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("window", [None, 5])
def test_any_common_offset_leaves_float64_attention_unchanged(window):
  """softmax(q.(k - c)) == softmax(q.k) in float64 for any c, causal and sliding-window
  masks, GQA and right padding (padded keys at the end, hidden by the mask)."""
  rng = np.random.RandomState(0)
  B, T, N, K, H = 2, 12, 6, 2, 8
  q, k, v = rng.randn(B, T, N, H), rng.randn(B, T, K, H) + 40.0, rng.randn(B, T, K, H)
  pos = np.broadcast_to(np.arange(T), (B, T))
  mask = np.asarray(causal_mask(jnp.asarray(pos), jnp.asarray(pos), sliding_window=window))
  want = reference_attention_np(q, k, v, mask=mask)
  for c in (rng.randn(B, 1, K, H) * 100, np.full((1, 1, K, H), 40.0), rng.randn(1, 1, 1, H)):
    got = reference_attention_np(q, k - c, v, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_a_different_offset_for_two_keys_of_one_query_changes_the_result():
  """The invariance needs one c for all keys of a query: the deliberately wrong variant
  (another c for one key) moves the float64 output far beyond rounding, so the tests
  above and the cache tests below would catch a kernel or cache that mixed offsets."""
  rng = np.random.RandomState(1)
  B, T, N, K, H = 1, 10, 2, 1, 8
  q, k, v = rng.randn(B, T, N, H), rng.randn(B, T, K, H), rng.randn(B, T, K, H)
  c = np.zeros((B, T, K, H))
  c[:, 3] = rng.randn(H) * 3    # key 3 carries another offset than the rest
  want = reference_attention_np(q, k, v)
  got = reference_attention_np(q, k - c, v)
  assert np.abs(got - want).max() > 1e-2


def test_rotation_means_match_a_direct_average():
  """`rotation_means` (a geometric series) against the average of exp(i p theta) over every
  position, computed directly in complex128."""
  m = keyoffset.rotation_means(CONFIG, 0)
  H, L = CONFIG.head_dim, CONFIG.max_seq_len
  theta = 1.0 / (CONFIG.rope_base ** (np.arange(0, H, 2) / H))
  direct = np.exp(1j * np.arange(L)[:, None] * theta[None]).mean(0)
  np.testing.assert_allclose(m, direct, rtol=0, atol=1e-12)


def test_bias_offset_is_the_mean_rotated_bias_and_its_residual_bound_holds():
  """c = E_p[R(p)] b: against the float64 average of the rotated bias (`layers.rope` on the
  bias at every position), and no position's rotated bias is farther from c than the
  bound `bias_residual` states."""
  from attnprec.layers import rope
  rng = np.random.RandomState(2)
  K, H, L = CONFIG.num_kv_heads, CONFIG.head_dim, CONFIG.max_seq_len
  b = rng.randn(K, H).astype(np.float32) * 50
  rotated = np.asarray(rope(jnp.broadcast_to(jnp.asarray(b), (1, L, K, H)),
                            jnp.arange(L)[None], base=CONFIG.rope_base), np.float64)[0]
  c = np.asarray(keyoffset.bias_offset(jnp.asarray(b), CONFIG, 0))
  np.testing.assert_allclose(c, rotated.mean(0), atol=2e-3)
  half = H // 2
  resid = rotated - c[None]
  pair_norm = np.hypot(resid[..., :half], resid[..., half:]).max(0)   # [K, H/2]
  assert np.all(pair_norm <= keyoffset.bias_residual(b, CONFIG, 0) + 1e-3)


@pytest.mark.parametrize("name", ["zero", "bias", "prefill_mean"])
def test_float32_offset_forward_matches_no_offset(name):
  """In float32 the offset changes only roundings: the logits of every offset match the
  offset-free forward to float32 accuracy (bias ~200 on every key)."""
  params, tokens = _params(), _tokens()
  want = _logits(params, tokens, F32_REF)
  got = _logits(params, tokens, dataclasses.replace(F32_REF, key_offset=name))
  np.testing.assert_allclose(got, want, atol=5e-4 * float(jnp.abs(want).max()))


def test_none_is_todays_forward_bit_for_bit():
  params, tokens = _params(), _tokens()
  for prec in (Precision(**BF16), Precision(dtype="bfloat16")):
    np.testing.assert_array_equal(_logits(params, tokens, prec),
                                  _logits(params, tokens, dataclasses.replace(
                                      prec, key_offset="none")))


# ----------------------------------------------------------------------------- bf16 error
@functools.partial(jax.jit, static_argnames="precisions")
def _all_logits(params, tokens, precisions):
  """The logits under each precision, as one program (one compile for them all)."""
  apply = model_lib.transformed(CONFIG).apply
  return [apply(params, tokens, None, None, precision=p).logits for p in precisions]


def _errors(params, tokens, *precs):
  """RMS error of the logits under each precision against the float32 reference."""
  want, *got = _all_logits(params, tokens, (F32_REF,) + precs)
  want = np.asarray(want, np.float64)
  return [float(np.sqrt(np.mean(np.square(np.asarray(g, np.float64) - want)))) for g in got]


def test_offset_reduces_the_bf16_error_on_a_key_bias_model():
  """bf16 everywhere: with the key-bias or prefill-mean offset the logits' RMS error
  against the float32 reference falls well below the offset-free bf16 error, and below the
  c = 0 control (which has the single rounding but not the offset)."""
  params, tokens = _params(), _tokens(T=64)
  none, zero, bias, mean = _errors(params, tokens, *(
      Precision(**BF16, key_offset=name) for name in ("none", "zero", "bias",
                                                      "prefill_mean")))
  assert bias < 0.5 * none and mean < 0.5 * none, (none, bias, mean)
  assert bias < 0.7 * zero, (zero, bias)


@pytest.mark.parametrize("qk_f32", [False, True])
def test_three_bf16_passes_on_the_qk_product_are_no_alternative(qk_f32):
  """BF16_BF16_F32_X3 (the 'cheap alternative' of three bf16 passes) on a bf16 model: its
  operands are bf16 already, so the low parts of the split are zero and the product is the
  one exact bf16 pass; what rounds is the keys (before the dot) and the logits (after it).
  XLA:CPU keeps the algorithm in the compiled dot and computes it in float32 (a different
  summation order from its bf16 dot, so not bitwise). Against the float32 reference the
  model's logits error is the same with and without the preset, under either QK flag, and
  the key-bias offset, not the passes, is what removes it."""
  params, tokens = _params(), _tokens(T=32)
  flags = dict(BF16, float32_qk_product=qk_f32)
  plain, x3, bias = _errors(params, tokens, Precision(**flags),
                            Precision(**flags, einsum_precision="BF16_BF16_F32_X3"),
                            Precision(**flags, key_offset="bias"))
  assert 0.8 * plain < x3 < 1.25 * plain, (plain, x3)
  assert bias < 0.5 * x3, (x3, bias)


def test_offset_lets_the_int8_per_token_key_cache_quantize_the_residual():
  """int8 keys with one scale per token: without the offset the scale is set by the bias
  (absmax ~200) and the key's own part gets a few codes; with it, the residual's absmax.
  Full forwards through the quantized cache, against the float32 reference."""
  params, tokens = _params(), _tokens(T=64)
  kv = dict(dtype="bfloat16", kv_cache_k_dtype="int8", kv_cache_k_scale="token")

  def err(prec):
    cache = init_cache(CONFIG, tokens.shape[0], tokens.shape[1], prec.compute_dtype,
                       prec.cache_storage)
    got = _logits(params, tokens, prec, cache)
    want = _logits(params, tokens, F32_REF)
    return float(jnp.sqrt(jnp.mean(jnp.square(got - want))))

  plain = err(Precision(**kv))
  offset = err(Precision(**kv, key_offset="bias"))
  assert offset < 0.5 * plain, (plain, offset)


# ----------------------------------------------------------------------------- the cache
def _prefill_then_decode(params, tokens, P, prec):
  """Logits of positions P-1 .. T-2 (predicting P .. T-1) by prefill of P tokens and
  teacher-forced decode steps through the cache."""
  B, T = tokens.shape
  prefill = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=prec,
                                      cache_length=T))
  step = jax.jit(functools.partial(decoding.decode_step, config=CONFIG, precision=prec))
  state = prefill(params, tokens[:, :P], jnp.full((B,), P, jnp.int32))
  rows = [state.last_BxV]
  for t in range(P, T - 1):
    state = step(params, state, tokens[:, t])
    rows.append(state.last_BxV)
  return jnp.stack(rows, axis=1)


@pytest.mark.parametrize("name", ["bias", "prefill_mean"])
def test_prefill_and_decode_through_the_cache_equal_a_full_forward(name):
  """float32: the logits of a prefill + decode steps (the offset frozen at prefill) equal a
  full forward without a cache, to float32 accuracy."""
  params, tokens, P = _params(), _tokens(T=24), 16
  prec = dataclasses.replace(F32_REF, key_offset=name)
  got = _prefill_then_decode(params, tokens, P, prec)
  want = _logits(params, tokens, F32_REF)[:, P - 1:-1]
  np.testing.assert_allclose(got, want, atol=5e-4 * float(jnp.abs(want).max()))


def test_decode_steps_that_take_a_new_offset_are_caught(monkeypatch):
  """The deliberately wrong cache: each decode step subtracts the mean of its own key
  instead of the prefill's c, so the keys a query sees carry different offsets. The
  comparison of the test above then fails by far more than rounding."""
  from attnprec import cache as cache_lib
  params, tokens, P = _params(), _tokens(T=24), 16
  prec = dataclasses.replace(F32_REF, key_offset="prefill_mean")
  good = _prefill_then_decode(params, tokens, P, prec)

  def fresh_every_time(self, name, fresh_BxKxH, positions_BxT):
    return fresh_BxKxH, self.replace(key_offset={name: fresh_BxKxH})

  monkeypatch.setattr(cache_lib.LayerCache, "offset_for", fresh_every_time)
  bad = _prefill_then_decode(params, tokens, P, prec)
  want = _logits(params, tokens, F32_REF)[:, P - 1:-1]
  tol = 5e-4 * float(jnp.abs(want).max())
  assert float(jnp.abs(good - want).max()) < tol
  assert float(jnp.abs(bad[:, 1:] - want[:, 1:]).max()) > 20 * tol


def test_prefill_mean_ignores_the_padding_of_a_right_padded_prompt():
  """Two prompts, one padded: its offset is the mean over its real tokens only, so its
  decode matches the same prompt decoded alone (unpadded)."""
  params = _params()
  prec = Precision(**BF16, key_offset="prefill_mean")
  long, short = list(np.arange(20) % 64), list((np.arange(12) * 7) % 64)
  prompt, lengths = decoding.pad_prompts([long, short], pad_id=3)
  both = decoding.generate(params, prompt, lengths, jax.random.PRNGKey(0), config=CONFIG,
                           precision=prec, max_new_tokens=6, cache_length=32)
  alone_prompt, alone_len = decoding.pad_prompts([short])
  alone = decoding.generate(params, alone_prompt, alone_len, jax.random.PRNGKey(0),
                            config=CONFIG, precision=prec, max_new_tokens=6, cache_length=32)
  np.testing.assert_array_equal(both.logits_BxMxV[1], alone.logits_BxMxV[0])


@pytest.mark.parametrize("filled,reads", [("bias", "none"), ("none", "bias"),
                                          ("bias", "prefill_mean")])
def test_a_cache_filled_under_another_offset_is_refused(filled, reads):
  """Refused while tracing (shapes only: nothing runs)."""
  params, tokens = _params(), _tokens(T=8)
  state = jax.eval_shape(lambda: decoding.prefill(
      params, tokens, jnp.full((2,), 8, jnp.int32), config=CONFIG,
      precision=Precision(**BF16, key_offset=filled), cache_length=12))
  with pytest.raises(UserError, match=f"stored with key offset '{filled}'.*'{reads}'"):
    jax.eval_shape(lambda s: decoding.decode_step(
        params, s, tokens[:, 0], config=CONFIG,
        precision=Precision(**BF16, key_offset=reads)), state)


# ----------------------------------------------------------------------------- refusals
def test_unknown_offset_names_are_refused_naming_the_valid_ones():
  with pytest.raises(UserError) as e:
    Precision(key_offset="mean")
  for name in ("'mean'",) + tuple(repr(k) for k in KEY_OFFSETS):
    assert name in str(e.value)


@pytest.mark.parametrize("config,name,needle", [
    (dataclasses.replace(CONFIG, attn_logit_soft_cap=50.0), "bias", "soft-capped"),
    (dataclasses.replace(CONFIG, attn_logit_soft_cap=50.0), "prefill_mean", "soft-capped"),
    (dataclasses.replace(CONFIG, qkv_bias=False), "bias", "has none"),
    (dataclasses.replace(CONFIG, qk_norm=True), "bias", "normalises its keys"),
])
def test_offsets_that_are_not_exact_are_refused_while_tracing(config, name, needle):
  params = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.PRNGKey(0)))
  with pytest.raises(UserError, match=needle):
    jax.eval_shape(lambda p: model_lib.transformed(config).apply(
        p, _tokens(T=4), precision=Precision(key_offset=name)), params)


def test_prefill_mean_is_refused_in_the_train_phase():
  why = keyoffset.refusal(CONFIG, "prefill_mean", phase="train")
  assert why and "train phase" in why and "'bias'" in why
  assert keyoffset.refusal(CONFIG, "bias", phase="train") is None


def test_precision_line_names_the_offset():
  assert "key_offset=bias" in Precision(key_offset="bias").describe()
  assert "key_offset" not in Precision().describe()


def test_the_offset_travels_in_the_attention_flags_and_the_stage_table():
  """One value carries it (`Precision.attention`), and the table's 'keys' row says where the
  keys are formed before their one rounding: c without an offset, float32 with one."""
  from attnprec import contract
  prec = Precision(**BF16, key_offset="prefill_mean")
  assert prec.attention.key_offset == "prefill_mean"
  assert contract.stage_dtypes(jnp.bfloat16, prec.attention)["keys"] == jnp.float32
  assert contract.stage_dtypes(jnp.bfloat16, Precision(**BF16).attention)["keys"] == \
      jnp.bfloat16
  # every kernel honours it: the offset is subtracted before any kernel runs
  for kernel in ("dot_product", "blockwise", "jax_nn", "auto"):
    Precision(kernel=kernel, key_offset="bias")


# ----------------------------------------------------------------------------- the audit
AUDIT_CONFIG = dataclasses.replace(CONFIG, vocab_size=13, d_model=16, head_dim=8, mlp_hidden=32)


@pytest.mark.parametrize("name,kernel,kv", [
    ("bias", "dot_product", "compute"), ("prefill_mean", "blockwise", "compute"),
    ("zero", "auto", "int8")])
def test_audit_proves_the_offset_is_subtracted_in_float32_before_the_rounding(name, kernel,
                                                                              kv):
  """From the lowered train step, prefill and decode step: every attention's keys come
  through a float32 subtraction in the offset's scope, with no rounding before it (the
  quantized cache's codes included)."""
  from attnprec import audit
  prec = Precision(**BF16, kernel=kernel, key_offset=name, kv_cache_k_dtype=kv,
                   kv_cache_k_scale="token" if kv == "int8" else None)
  train = dataclasses.replace(Precision(**BF16), key_offset="bias" if name == "bias" else
                              "none")
  result = audit.run_audit(AUDIT_CONFIG, train, prec, compile=False)
  assert result["ok"], result["problems"]
  for phase in ("prefill", "decode"):
    paths = [r for r in result["phases"][phase]["attention"] if r["site"] == "qk"]
    assert len(paths) == AUDIT_CONFIG.num_layers


def test_audit_fails_an_offset_subtracted_after_the_rounding(monkeypatch):
  """The deliberately wrong layer: keys rounded to bf16 first, the offset subtracted from
  the rounded keys (in float32, then rounded again). Exact in exact arithmetic, but the
  rounding saw the offset: the audit names the stage in prefill and decode."""
  from attnprec import audit, layers
  good = layers.Attention._subtract_offset

  def rounded_first(self, k32, k_proj, positions, cache, lengths, c):
    k_rounded = k32.astype(c).astype(jnp.float32)
    return good(self, k_rounded, k_proj, positions, cache, lengths, c)

  monkeypatch.setattr(layers.Attention, "_subtract_offset", rounded_first)
  prec = Precision(**BF16, key_offset="bias")
  result = audit.run_audit(AUDIT_CONFIG, Precision(**BF16), prec, compile=False)
  assert not result["ok"]
  for phase in ("prefill", "decode"):
    assert any(p.startswith(f"{phase} layer") and "rounded (f32->bf16) before the offset"
               in p for p in result["problems"]), result["problems"]


def test_audit_fails_an_offset_the_decode_step_leaves_out(monkeypatch):
  """A decode step that writes its new key without the offset: the keys reach the qk dot
  partly unoffset, and the audit says so."""
  from attnprec import audit, layers
  good = layers.Attention._subtract_offset

  def prefill_only(self, k32, k_proj, positions, cache, lengths, c):
    k, cache = good(self, k32, k_proj, positions, cache, lengths, c)
    return (k if k32.shape[1] > 1 else k32.astype(c)), cache

  monkeypatch.setattr(layers.Attention, "_subtract_offset", prefill_only)
  prec = Precision(**BF16, key_offset="bias")
  result = audit.run_audit(AUDIT_CONFIG, Precision(**BF16), prec, compile=False)
  assert any(p.startswith("decode layer") and "key offset: " in p and "subtraction" in p
             for p in result["problems"]), result["problems"]
  assert not any(p.startswith("prefill") for p in result["problems"])

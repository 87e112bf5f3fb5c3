"""The KV cache's precision (issue 20): quantization, the kernels' cache rows, decode.

Each test names what it compares against:
  * `float64` — NumPy in float64 (codes and scales taken from the quantizer, or an
    independent NumPy quantizer: float32 division, `np.rint`, ml_dtypes' float8 casts);
  * `dot_product` on dequantized values — `contract.reference_attention_np` on
    code * scale formed in float64, i.e. the exact attention of the values the cache
    represents;
  * `full forward` — the model over the whole sequence in one call through a fresh cache
    of the same storage (prefill attends to the cache it writes: the same codes).
Bounds: float32 compute 2e-5 (as tests/test_kernels.py); bfloat16 compute a few bf16
ulps of O(1) outputs (measured: 3.4e-3 with float32_qk_product, 6.8e-3 without).
"""
import functools
import os

import haiku as hk
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from attnprec import contract, decoding, kernels, kvquant
from attnprec.cache import init_cache, side_dtype, storage_dtype
from attnprec.config import ModelConfig
from attnprec.contract import CacheStorage, KVScales
from attnprec.errors import UserError
from attnprec.kernels import blockwise, dot_product
from attnprec.layers import AttentionKernel
from attnprec.model import init_params, transformed
from attnprec.precision import Precision
from platform_bounds import tol

SCALED = ("int8", "float8_e4m3fn", "float8_e5m2")
FLAGS = [(qk, lg) for qk in (False, True) for lg in (False, True)]
NP_CODE = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
           "float8_e5m2": ml_dtypes.float8_e5m2}
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def np_quantize_token(x, scale, name):
  """Independent reference codes for the quantizer's float32 scales: the quotient in
  float64, clip, round to nearest even (np.rint; ml_dtypes' float8 cast rounds to nearest
  even). Returns (codes, the float64 quotients)."""
  safe = np.where(scale > 0, scale, 1.0).astype(np.float64)
  y = np.clip(np.asarray(x, np.float64) / safe[..., None], -QMAX[name], QMAX[name])
  codes = np.rint(y) if name == "int8" else y.astype(NP_CODE[name]).astype(np.float64)
  return codes, y


def assert_codes_match(got, want, y):
  """Codes equal the float64 reference's, except where the quotient lies within 1e-5
  (relative) of the midpoint between the two: XLA:CPU's float32 division is within an
  ulp of the exact quotient, not correctly rounded (measured: 27% of quotients differ in
  the last bit from NumPy's), which can move a near-tie to the other neighbour."""
  got = np.asarray(got).astype(np.float64)
  off = got != want
  tie = np.abs(np.abs(y - got) - np.abs(y - want)) <= 1e-5 * np.maximum(np.abs(y), 1e-30)
  assert np.all(tie[off]), (got[off & ~tie][:5], want[off & ~tie][:5])
  assert off.mean() < 1e-3


def roundtrip_bound(x, scale, name):
  """|code * scale - x| allowed per element, from the code grid (float64)."""
  x, scale = np.abs(np.asarray(x, np.float64)), np.asarray(scale, np.float64)
  if name == "int8":
    return 0.5 * scale * (1 + 1e-6)
  mant, min_sub = {"float8_e4m3fn": (3, 2.0 ** -9), "float8_e5m2": (2, 2.0 ** -16)}[name]
  return np.maximum(x * 2.0 ** -(mant + 1), 0.5 * min_sub * scale) * (1 + 1e-6)


# ----------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_quantization_against_numpy(name, dtype):
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 7, 3, 16)) * np.exp(rng.uniform(-6, 6, (2, 7, 3, 1)))
  x[0, 2, 1] = 0.0                                   # an all-zero row
  x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
  codes, scale = jax.jit(kvquant.quantize_token, static_argnums=1)(jnp.asarray(x, dtype),
                                                                   name)
  assert codes.dtype == kvquant.code_dtype(name) and scale.dtype == jnp.float32
  # scale = absmax / qmax in float32, within an ulp (XLA:CPU multiplies by 1/qmax).
  want_scale = np.abs(x).max(-1) / QMAX[name]
  np.testing.assert_allclose(np.asarray(scale, np.float64), want_scale, rtol=2 ** -23)
  want_codes, y = np_quantize_token(x, np.asarray(scale), name)
  assert_codes_match(codes, want_codes, y)
  back = np.asarray(codes).astype(np.float64) * np.asarray(scale, np.float64)[..., None]
  assert np.all(np.abs(back - x) <= roundtrip_bound(x, scale[..., None], name))
  # The absmax element of each row is represented to within its grid (never overflows).
  assert np.abs(np.asarray(codes).astype(np.float64)).max() <= QMAX[name]
  # The zero row: scale 0, codes 0, exact zeros back (no division by a zero scale).
  assert float(scale[0, 2, 1]) == 0.0 and not np.asarray(codes)[0, 2, 1].astype(float).any()
  assert np.all(back[0, 2, 1] == 0.0) and np.isfinite(back).all()


@pytest.mark.parametrize("name", SCALED)
def test_absmax_quotient_above_qmax_is_clipped_not_overflowed(name):
  """absmax / (absmax / qmax) rounds above qmax in float32 for some rows (checked: the
  clip is exercised); their absmax elements get the code +-qmax (int8 127, never a wrap
  to -128; float8_e4m3fn 448, never NaN)."""
  m = QMAX[name]
  a = np.random.default_rng(0).uniform(1, 2, (4000, 1, 1)).astype(np.float32)
  x = np.concatenate([a, -a, a * 0.5], axis=-1)[None]          # [1, 4000, 1, 3]
  scale = kvquant.absmax_scale(jnp.asarray(x), -1, name)
  raw = np.asarray(jax.jit(lambda x, s: x / s[..., None])(jnp.asarray(x), scale))
  assert (raw > m).any(), "no row whose absmax quotient rounds above qmax"
  codes, _ = kvquant.quantize_token(jnp.asarray(x), name)
  c = np.asarray(codes).astype(np.float64)
  np.testing.assert_array_equal(c[..., 0], m)
  np.testing.assert_array_equal(c[..., 1], -m)
  assert np.isfinite(c).all() and np.abs(c).max() <= m


@pytest.mark.parametrize("name", SCALED)
def test_non_finite_input_is_reported_not_stored(name):
  x = np.ones((1, 4, 2, 8), np.float32)
  x[0, 1, 0, 3], x[0, 2, 1, 0] = np.nan, np.inf
  codes, scale = kvquant.quantize_token(jnp.asarray(x), name)
  s = np.asarray(scale)
  assert np.isnan(s[0, 1, 0]) and np.isnan(s[0, 2, 1])         # the bad groups
  assert np.isfinite(np.delete(s.reshape(-1), [2, 5])).all()    # the others untouched
  assert np.isfinite(np.asarray(codes).astype(np.float64)).all()  # no NaN/Inf codes stored
  assert not bool(kvquant.finite(scale))
  # Per channel: the channel holding the NaN gets a NaN scale.
  cs = kvquant.channel_scale(jnp.asarray(x), name)
  assert np.isnan(np.asarray(cs)[0, 0, 3]) and np.isnan(np.asarray(cs)[0, 1, 0])
  _, cs2 = kvquant.quantize_channel(jnp.asarray(x), jnp.ones((1, 2, 8)), name)
  assert np.isnan(np.asarray(cs2)[0, 0, 3]) and np.isfinite(np.asarray(cs2)[0, 0, 2])


def test_channel_scale_is_fixed_at_the_first_write():
  cfg = ModelConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=4, mlp_hidden=8)
  storage = CacheStorage("int8", "int8", "channel", "token")
  layer = init_cache(cfg, 1, 8, jnp.float32, storage).layers[0]
  rng = np.random.default_rng(0)
  k1 = jnp.asarray(rng.standard_normal((1, 3, 1, 4)), jnp.float32)
  v1 = jnp.asarray(rng.standard_normal((1, 3, 1, 4)), jnp.float32)
  write = jax.jit(lambda c, k, v, pos: c.write(k, v, pos, storage))
  layer = write(layer, k1, v1, jnp.arange(3)[None])
  first = np.asarray(layer.k_scale)
  np.testing.assert_array_equal(first, np.asarray(kvquant.channel_scale(k1, "int8")))
  k2 = k1[:, :1] * 10.0                               # past the prompt's range: clips
  layer = write(layer, k2, v1[:, :1], jnp.array([[3]]))
  np.testing.assert_array_equal(np.asarray(layer.k_scale), first)
  codes = np.asarray(layer.k)[0, 0, 3]
  assert np.all(np.abs(codes) == 127)


# ----------------------------------------------------------------------------- kernels
STORAGES = [CacheStorage("int8", "int8", "token", "token"),
            CacheStorage("float8_e4m3fn", "float8_e5m2", "channel", "token"),
            CacheStorage("float8_e5m2", "compute", "token", None),
            CacheStorage("compute", "int8", None, "token")]
B, T, S, N, K, H = 2, 3, 24, 4, 2, 16


# the quantizers as one program each (op by op they compile a program per operation)
_quantize_token = jax.jit(kvquant.quantize_token, static_argnums=1)
_quantize_channel = jax.jit(
    lambda x, name: kvquant.quantize_channel(x, kvquant.channel_scale(x, name), name),
    static_argnums=1)


def _quantized_inputs(storage, dtype, seed=0):
  """q in `dtype`; k, v as a cache of `storage` holds them ([B, S, K, H] codes) with
  their KVScales; and the float64 values code * scale they represent."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)) * 2, dtype)
  k = jnp.asarray(rng.standard_normal((B, S, K, H)) * 2 + 0.5, dtype)
  v = jnp.asarray(rng.standard_normal((B, S, K, H)), dtype)
  scales, exact = {}, {}

  def side(x, name, gran, which):
    if gran is None:
      exact[which] = np.asarray(x.astype(jnp.float32), np.float64)
      return x
    if gran == "token":
      codes, s_BxSxK = _quantize_token(x, name)
      scales[f"{which}_token_BxKxS"] = jnp.swapaxes(s_BxSxK, 1, 2)
      exact[which] = np.asarray(codes).astype(np.float64) * np.asarray(
          s_BxSxK, np.float64)[..., None]
    else:
      codes, s_BxKxH = _quantize_channel(x, name)
      scales[f"{which}_channel_BxKxH"] = s_BxKxH
      exact[which] = np.asarray(codes).astype(np.float64) * np.asarray(
          s_BxKxH, np.float64)[:, None]
    return codes

  kc = side(k, storage.k_dtype, storage.k_scale, "k")
  vc = side(v, storage.v_dtype, storage.v_scale, "v")
  return q, kc, vc, KVScales(**scales), exact["k"], exact["v"]


def _mask(decode):
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  q_pos = jnp.array([[9], [S - 1]], jnp.int32) if decode else k_pos[:, S - T:]
  return contract.CausalMask(q_pos, k_pos)


# dot_product on int8, on mixed float8 (per-channel float8_e4m3fn keys, float8_e5m2
# values) and on compute keys with int8 values; blockwise on the mixed float8 and on int8;
# bfloat16 on both kernels; flash on three storages, its key blocks past the cache's
# 24 keys unpadded (the decode geometry: what lies past them is masked).
KERNEL_CASES = ([("dot_product", s, "float32") for s in (STORAGES[0], STORAGES[1],
                                                          STORAGES[3])]
                + [("blockwise", STORAGES[1], "float32"),
                   ("dot_product", STORAGES[1], "bfloat16"),
                   ("blockwise", STORAGES[0], "bfloat16"),
                   # flash reads codes and scales in its body (interpreted here; on a
                   # TPU by make test-tpu): int8, the mixed float8 and compute/int8
                   ("flash", STORAGES[0], "bfloat16"), ("flash", STORAGES[1], "float32"),
                   ("flash", STORAGES[3], "float32")])


@pytest.mark.parametrize("kernel,storage,dtype", KERNEL_CASES,
                         ids=[f"{k}-{s.describe()}-{d}" for k, s, d in KERNEL_CASES])
def test_kernel_with_quantized_cache_matches_float64_on_dequantized_values(kernel, storage,
                                                                           dtype):
  """Every flag combination, prefill-shaped (T queries) and decode (1 query). Bounds:
  float32 2e-5; bfloat16 (measured over all four storages, both kernels) 1.2e-2 with
  float32_qk_product (measured 7.3e-3: the bf16 output's rounding), 0.1 without
  (measured 0.067: bf16 logits of magnitude ~20 round by ~0.06, as they do for a
  compute-dtype cache)."""
  q, kc, vc, scales, k64, v64 = _quantized_inputs(storage, dtype)
  q64 = np.asarray(q.astype(jnp.float32), np.float64)
  precs = {(qk, lg): Precision(
      dtype=dtype, kernel=kernel, float32_qk_product=qk, float32_logits=lg,
      kv_cache_k_dtype=storage.k_dtype, kv_cache_v_dtype=storage.v_dtype,
      kv_cache_k_scale=storage.k_scale, kv_cache_v_scale=storage.v_scale,
      block_sizes=blockwise.BlockSizes(q_block=2, kv_block=8, decode_kv_block=8))
      for qk, lg in FLAGS}
  masks = {decode: _mask(decode) for decode in (False, True)}

  @jax.jit    # the eight calls (flags x prefill / decode) as one program: one compile
  def attend_all(q, kc, vc, masks, scales):
    return {(decode, qk, lg): kernels.attend(prec, q[:, :1] if decode else q, kc, vc,
                                             mask=masks[decode], kv_scales=scales)
            for decode in (False, True) for (qk, lg), prec in precs.items()}

  outs = attend_all(q, kc, vc, masks, scales)
  for decode in (False, True):
    mask = masks[decode]
    q_ref = q64[:, :1] if decode else q64
    want = contract.reference_attention_np(q_ref, k64, v64, mask=np.asarray(mask.dense()))
    for qk, lg in FLAGS:
      got = outs[(decode, qk, lg)]
      assert got.dtype == jnp.dtype(dtype)
      err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want).max()
      # float32: blockwise's bound where f32 dots multiply in f32; on a TPU at DEFAULT
      # (one bf16 pass) KERNEL_UNITS of its rounding unit (tests/platform_bounds.py)
      bound = (tol(2e-5, scale=float(np.abs(want).max())) if dtype == "float32" else
               (1.2e-2 if qk else 0.1))
      assert err <= bound, (decode, qk, lg, err)


def test_cache_rows_of_the_table():
  bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  for qk, lg in FLAGS:
    flags = contract.AttentionFlags(float32_qk_product=qk, float32_logits=lg)
    base = contract.stage_dtypes(bf16, flags)
    tok = contract.cache_stage_dtypes(bf16, STORAGES[0], flags)
    assert (tok["k_cache"], tok["v_cache"]) == (jnp.dtype(jnp.int8),) * 2
    assert tok["scale_dtype"] == f32 and tok["k_scale"] == tok["v_scale"] == "token"
    assert tok["k_scale_in"] == base["logits"] and tok["v_scale_in"] == base["probs"]
    assert tok["q_into_qk"] == tok["k_into_qk"] == bf16 and tok["v_into_wv"] == base["probs"]
    ch = contract.cache_stage_dtypes(bf16, STORAGES[1], flags)
    assert ch["k_scale_in"] == ch["q_into_qk"] == ch["k_into_qk"] == (f32 if qk else bf16)
    # q and the probabilities are never quantized.
    for rows in (tok, ch):
      assert rows["q_into_qk"] in (bf16, f32) and rows["v_into_wv"] in (bf16, f32)


def test_kernels_assert_the_cache_rows():
  """The kernels' checks of the cache rows hold while tracing (`jax.eval_shape`: the
  checks run, nothing is compiled)."""
  storage = STORAGES[0]
  q, kc, vc, scales, *_ = _quantized_inputs(storage, "bfloat16")
  kw = dict(kv_cache=storage, kv_scales=scales)
  traced = lambda f, *args, **kwargs: jax.eval_shape(  # noqa: E731
      lambda *a: f(*a, **kwargs), *args)
  traced(dot_product.dot_product_attention, q, kc, vc, **kw)              # fine
  with pytest.raises(AssertionError):                                      # k not codes
    traced(dot_product.dot_product_attention, q, kc.astype(jnp.bfloat16), vc, **kw)
  with pytest.raises(AssertionError):                                      # scale not f32
    traced(dot_product.dot_product_attention, q, kc, vc, kv_cache=storage,
           kv_scales=KVScales(k_token_BxKxS=scales.k_token_BxKxS.astype(jnp.bfloat16),
                              v_token_BxKxS=scales.v_token_BxKxS))
  with pytest.raises(UserError, match="needs KVScales.v_token_BxKxS"):    # scale missing
    traced(blockwise.blockwise_attention, q, kc, vc, kv_cache=storage,
           kv_scales=KVScales(k_token_BxKxS=scales.k_token_BxKxS))
  with pytest.raises(UserError, match="unscaled"):                         # no such cache
    traced(dot_product.dot_product_attention, q, q[:, :1].repeat(S, 1)[:, :, :K], vc,
           kv_scales=scales)


# ----------------------------------------------------------------------------- decode
CONFIG = ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_hidden=32)
PARAMS = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.PRNGKey(0))


def _prec(storage, dtype="float32", kernel="dot_product"):
  return Precision(dtype=dtype, kernel=kernel, kv_cache_k_dtype=storage.k_dtype,
                   kv_cache_v_dtype=storage.v_dtype, kv_cache_k_scale=storage.k_scale,
                   kv_cache_v_scale=storage.v_scale)


@functools.lru_cache(maxsize=None)
def _apply(prec):
  return jax.jit(functools.partial(transformed(CONFIG).apply, precision=prec))


def _decode_logits(prec, tokens_BxL, P):
  """Prefill tokens[:, :P], then one decode step per remaining token: the logits that
  predict positions P..L (each row [B, V])."""
  B, L = tokens_BxL.shape
  state = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=prec,
                                    cache_length=L))(
      PARAMS, tokens_BxL[:, :P], jnp.full((B,), P, jnp.int32))
  out, step = [state.last_BxV], decoding.step_fn(CONFIG, prec)
  for t in range(P, L - 1):
    state = step(PARAMS, state, tokens_BxL[:, t])
    out.append(state.last_BxV)
  return np.stack([np.asarray(x) for x in out], 1), state


TOKENS = jnp.asarray(np.random.default_rng(3).integers(0, 32, (2, 12)), jnp.int32)
P = 6


DECODE_CASES = [(s, "float32") for s in STORAGES[:2]] + [(STORAGES[0], "bfloat16")]


@pytest.mark.parametrize("storage,dtype", DECODE_CASES,
                         ids=[f"{s.describe()}-{d}" for s, d in DECODE_CASES])
def test_decode_equals_a_full_forward_quantized_the_same_way(storage, dtype):
  """Decode reads the quantized cache: its logits equal those of one forward over the
  whole sequence through a cache of the same storage (the same codes: per token from the
  token alone; per channel from the prompt, so that forward starts from the prefilled
  cache, whose scales it keeps). Bound: float32 2e-4 (the existing decode == forward
  bound, tests/test_decoding.py); bfloat16 0.1 on O(1-10) logits (a different dot shape
  rounds k once differently in bf16, and a code may move by one step)."""
  prec = _prec(storage, dtype)
  L = TOKENS.shape[1]
  decoded, final = _decode_logits(prec, TOKENS, P)
  if storage.k_scale == "channel":
    start = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=prec,
                                      cache_length=L))(
        PARAMS, TOKENS[:, :P], jnp.full((2,), P, jnp.int32)).cache
  else:
    start = init_cache(CONFIG, 2, L, prec.compute_dtype, prec.cache_storage)
  full = _apply(prec)(PARAMS, TOKENS, None, start)
  want = np.asarray(full.logits)[:, P - 1:L - 1]
  tol = 2e-4 if dtype == "float32" else 0.1
  np.testing.assert_allclose(decoded, want, atol=tol, rtol=tol)
  # The two caches hold (nearly) the same codes and the same kind of scales.
  a, b = final.cache.layers[0], full.cache.layers[0]
  assert a.k.dtype == side_dtype(storage.k_dtype, dtype) and a.k_scale.dtype == jnp.float32
  same = np.mean(np.asarray(a.k)[:, :, :L - 1] == np.asarray(b.k)[:, :, :L - 1])
  assert same > (0.999 if dtype == "float32" else 0.97), same


def test_generate_with_a_quantized_cache_is_finite_and_reports_nan():
  prec = _prec(STORAGES[0], "bfloat16")
  prompts, lengths = decoding.pad_prompts([[1, 2, 3, 4], [5, 6]])
  out = decoding.generate(PARAMS, prompts, lengths, jax.random.PRNGKey(0), config=CONFIG,
                          precision=prec, max_new_tokens=4)
  assert bool(out.finite_B.all())
  bad = jax.tree_util.tree_map(lambda x: x, PARAMS)
  w = bad["decoder/layer_0/attn/k"]["w"]
  bad["decoder/layer_0/attn/k"] = {"w": w.at[3, 5].set(jnp.nan)}
  out = decoding.generate(bad, prompts, lengths, jax.random.PRNGKey(0), config=CONFIG,
                          precision=prec, max_new_tokens=4)
  assert not bool(out.finite_B.any())        # the NaN key was reported, not stored as 0


def test_default_cache_is_todays_cache():
  """'compute' (the default) is today's cache: the same buffers (the compute dtype, as
  raw bits for 16-bit types), no scale leaves, and the kernel is called exactly as
  before (q, k, v in c, no kv_scales)."""
  for dtype in ("float32", "bfloat16"):
    cache = init_cache(CONFIG, 2, 8, dtype)
    leaves = jax.tree_util.tree_leaves(cache)
    assert len(leaves) == 2 * CONFIG.num_layers
    assert all(x.dtype == storage_dtype(dtype) and x.shape == (2, 2, 8, 16) for x in leaves)
    assert Precision(dtype=dtype).cache_storage == contract.COMPUTE_CACHE
  seen = []

  def spy(next_f, args, kwargs, context):
    if isinstance(context.module, AttentionKernel) and context.method_name == "__call__":
      seen.append(([a.dtype for a in args[:3]], dict(kwargs)))
    return next_f(*args, **kwargs)

  prec = Precision(dtype="bfloat16")
  with hk.experimental.intercept_methods(spy):     # traced: the calls, nothing run
    jax.eval_shape(lambda p, t: transformed(CONFIG).apply(
        p, t, None, init_cache(CONFIG, 2, 8, "bfloat16"), precision=prec),
        PARAMS, TOKENS[:, :4])
  assert seen and all(d == [jnp.dtype(jnp.bfloat16)] * 3 and not kw for d, kw in seen)


@pytest.mark.parametrize("storage", STORAGES, ids=lambda s: s.describe())
def test_cache_bytes(storage):
  c = init_cache(CONFIG, 2, 64, "bfloat16", storage)
  full = init_cache(CONFIG, 2, 64, "bfloat16").nbytes
  per = lambda d: 2 if d == "compute" else 1  # noqa: E731
  want = CONFIG.num_layers * 2 * 2 * 64 * 16 * (per(storage.k_dtype) + per(storage.v_dtype))
  want += sum(CONFIG.num_layers * 4 * 2 * 2 * (64 if g == "token" else 16)
              for g in (storage.k_scale, storage.v_scale) if g)
  assert c.nbytes == want < full


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw,needles", [
    (dict(kv_cache_k_dtype="int4"), ["kv_cache_k_dtype = 'int4'", "'int8'", "'compute'"]),
    (dict(kv_cache_v_dtype="fp8"), ["kv_cache_v_dtype = 'fp8'", "'float8_e4m3fn'"]),
    (dict(kv_cache_k_scale="token"), ["kv_cache_k_scale = 'token'", "takes none"]),
    (dict(kv_cache_k_dtype="bfloat16", kv_cache_k_scale="channel"),
     ["kv_cache_k_scale = 'channel'", "'bfloat16' is stored unscaled"]),
    (dict(kv_cache_v_dtype="int8", kv_cache_v_scale="channel"),
     ["kv_cache_v_scale = 'channel'", "values take 'token'"]),
    (dict(kv_cache_k_dtype="int8", kv_cache_k_scale="block"),
     ["kv_cache_k_scale = 'block'", "'token', 'channel'"]),
    (dict(kernel="jax_nn", kv_cache_k_dtype="int8"),
     ["'jax_nn'", "quantized KV cache", "'compute', 'float32', 'bfloat16'"]),
    (dict(kernel="jax_nn", kv_cache_v_dtype="float8_e5m2"), ["'jax_nn'", "'float8_e5m2'"]),
    (dict(dtype="float16", kv_cache_v_dtype="bfloat16"), ["'bfloat16'", "'float16'"]),
])
def test_bad_cache_settings_are_user_errors(kw, needles):
  with pytest.raises(UserError) as e:
    Precision(**kw)
  for needle in needles:
    assert needle in str(e.value), (needle, str(e.value))


def test_accepted_settings_and_describe():
  assert Precision(kernel="jax_nn", kv_cache_k_dtype="bfloat16").cache_storage.k_dtype == \
      "bfloat16"
  p = Precision(dtype="bfloat16", kernel="auto", kv_cache_k_dtype="int8",
                kv_cache_k_scale="channel", kv_cache_v_dtype="float8_e4m3fn")
  assert p.cache_storage == CacheStorage("int8", "float8_e4m3fn", "channel", "token")
  assert "kv_cache=k:int8/channel,v:float8_e4m3fn/token" in p.describe()
  assert "kv_cache=k:compute,v:compute" in Precision().describe()


@pytest.mark.parametrize("preset,storage", [
    ("precision/kv_int8.gin", CacheStorage("int8", "int8", "token", "token")),
    ("precision/kv_fp8.gin", CacheStorage("float8_e4m3fn", "float8_e4m3fn", "token",
                                          "token"))])
def test_gin_presets(preset, storage):
  import gin
  from attnprec import ginutils
  from attnprec.precision import phase_precision
  try:
    ginutils.parse([preset], [])
    with gin.config_scope("decode"):
      p = phase_precision()
    assert p.cache_storage == storage and p.dtype == "bfloat16"
    assert p.float32_qk_product and p.float32_logits
    gin.clear_config()
    with pytest.raises(UserError, match="kv_cache_k_dtype = 'int3'"):
      ginutils.parse([], ["precision.kv_cache_k_dtype = 'int3'"])
  finally:
    gin.clear_config()


@pytest.mark.parametrize("compute,store", [("float32", "bfloat16"), ("bfloat16", "float32"),
                                           ("float32", "float32"), ("bfloat16", "bfloat16")])
def test_unscaled_storage_reads_back_as_the_compute_dtype(compute, store):
  """float32 / bfloat16 storage: written rounded to nearest even into the storage dtype,
  read back cast to the compute dtype (exact), with no scales for the kernels."""
  storage = CacheStorage(store, store)
  layer = init_cache(CONFIG, 2, 8, compute, storage).layers[0]
  assert layer.k.dtype == side_dtype(store, compute) and layer.k_scale is None
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 2, 16)), compute)
  pos = jnp.array([[0, 1, 2], [4, 5, 6]])
  layer = layer.write(x, x, pos, storage)
  k, v = layer.read(compute, storage)
  assert k.dtype == v.dtype == jnp.dtype(compute) and layer.scales(storage) is None
  want = np.asarray(x.astype(store).astype(compute).astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(k.astype(jnp.float32))[0, :, :3],
                                want[0].transpose(1, 0, 2))


def test_a_train_phase_cache_setting_is_refused_not_ignored(tmp_path):
  """Training runs no KV cache: a cache setting for it would be silently ignored, so the
  train runner refuses it (exit 2, one paragraph, no run directory)."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run_dir = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "runners", "train.py"),
       "--gin_file=experiments/recall.gin", "--gin.train/precision.kv_cache_k_dtype='int8'",
       f"--run_dir={run_dir}"], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  assert "train phase never reads it" in proc.stderr and "Traceback" not in proc.stderr
  assert not run_dir.exists()

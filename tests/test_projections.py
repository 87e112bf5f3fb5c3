"""The dense projections' form (`layers.project`): the same numbers as the forms it
replaced, up to float32 summation order, and the dot types the backend compiles.

A 16-bit projection of MIN_ROWS_C_DOT rows or more is a bf16 x bf16 dot with a float32
result rounded once; below that, on float32-held weights, a float32 dot on the weights'
bf16 values (the float32-carried form of `decoding.for_serving`). Both form exact
products of bf16 values and accumulate them in float32.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import decoding, layers
from attnprec.inspect import compiled
from attnprec import model as model_lib
from attnprec.bench import projections as forms
from attnprec.cache import init_cache
from attnprec.config import ModelConfig
from attnprec.model import init_params
from attnprec.precision import Precision

BF16_FLAGS = Precision(dtype="bfloat16", float32_qk_product=True, float32_logits=True)
CONFIG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_hidden=128, max_seq_len=64)


def _bf16_values(a):
  return jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def _ulps(a, b):
  """Distance in bf16 units in the last place (same-sign values)."""
  bits = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16).astype(np.int64)
  return np.abs(bits(a) - bits(b))


@pytest.mark.parametrize("M,K,N", [(16, 576, 384), (64, 384, 128), (4, 64, 96)])
def test_bf16_projection_is_one_rounding_of_a_float32_accumulation(M, K, N):
  """bf16 x bf16 -> float32, rounded once: the float32 result is within float32
  accumulation error of the float64 product of the same bf16 values (measured: at most
  6.2e-8 x sum|x||w| at K = 1536, either form; asserted 2^-22 ~ 2.4e-7), the bf16 result
  is that float32 result rounded, and it is within 1 bf16 ulp of the float32-carried
  form's (different summation order can cross a rounding boundary: measured bitwise equal
  at 99.98% of outputs)."""
  rng = np.random.default_rng(M)
  x_MxK = jnp.asarray(rng.standard_normal((M, K)), jnp.float32).astype(jnp.bfloat16)
  w_KxN = _bf16_values(rng.standard_normal((K, N)) / np.sqrt(K))
  project = functools.partial(layers.project, spec="mk,kn->mn", precision=None,
                              carrier=True)
  y32 = np.asarray(project(x_MxK, w_KxN, out_dtype=jnp.float32))
  y16 = project(x_MxK, w_KxN)
  assert y16.dtype == jnp.bfloat16
  x64, w64 = np.asarray(x_MxK, np.float64), np.asarray(w_KxN, np.float64)
  err = np.abs(y32 - x64 @ w64) / (np.abs(x64) @ np.abs(w64))
  assert err.max() <= 2.0 ** -22, err.max()
  np.testing.assert_array_equal(np.asarray(y16), np.asarray(jnp.asarray(y32, jnp.bfloat16)))
  carried = forms._fixed_project("carried")(x_MxK, w_KxN, "mk,kn->mn", precision=None,
                                            carrier=True)
  assert _ulps(y16, carried).max() <= 1


def test_few_rows_are_the_float32_carried_dot_bit_for_bit():
  """Below MIN_ROWS_C_DOT rows (a decode step at batch 1) on float32-held weights the
  projection IS the float32-carried form (XLA:CPU's bf16 matrix-vector path is slow)."""
  rng = np.random.default_rng(0)
  w = _bf16_values(rng.standard_normal((64, 96)) / 8)
  for rows in (1, 2, 3, 8, layers.MIN_ROWS_C_DOT - 1):
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32).astype(jnp.bfloat16)
    for out in (None, jnp.float32):
      new = layers.project(x, w, "mk,kn->mn", precision=None, carrier=True, out_dtype=out)
      old = forms._fixed_project("carried")(x, w, "mk,kn->mn", precision=None, carrier=True,
                                            out_dtype=out)
      np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


def _logits(form, params, precision, tokens_BxT):
  jax.clear_caches()
  apply = model_lib.transformed(CONFIG).apply
  with forms.projection_form(form):
    return np.asarray(jax.jit(lambda p, t: apply(p, t, precision=precision).logits)(
        params, tokens_BxT))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tiny_model_logits_before_and_after(seed):
  """Whole-model logits (2 layers, bf16 + both attention flags, 2 x 64 tokens) of the
  bf16 x bf16 -> float32 form against the float32-carried form it replaced. Both
  accumulate exact products in float32, in different orders; where that moves an
  activation across a bf16 rounding boundary (1 bf16 ulp, 2^-8 relative), the change
  propagates. Measured, seeds 0-3: max abs 2.4e-7 / 9.8e-3 / 4.8e-7 / 4.9e-3 on logits of
  magnitude <= 3.6; 0 / 1.6% / 0 / 0.8% of positions differ by more than 1e-5; argmax
  identical everywhere. Asserted: max abs <= 0.03, <= 5% of positions beyond 1e-5 (float32
  order elsewhere), every argmax equal. float32 compute is bit-for-bit unchanged."""
  params = init_params(CONFIG, jax.random.PRNGKey(seed))
  params, carried = decoding.for_serving(params, BF16_FLAGS, backend="cpu")
  assert carried.carrier_weights
  tokens = jax.random.randint(jax.random.PRNGKey(seed + 10), (2, 64), 0, CONFIG.vocab_size)
  assert tokens.size >= layers.MIN_ROWS_C_DOT       # the bf16 x bf16 -> f32 form runs
  after = _logits("current", params, carried, tokens)
  before = _logits("carried", params, carried, tokens)
  diff = np.abs(after - before)
  assert diff.max() <= 0.03, diff.max()
  assert np.mean(diff.max(-1) > 1e-5) <= 0.05
  np.testing.assert_array_equal(after.argmax(-1), before.argmax(-1))
  fp32 = Precision()
  np.testing.assert_array_equal(_logits("current", params, fp32, tokens),
                                _logits("c_result", params, fp32, tokens))


def _dense_dots(compiled_text):
  return [d for d in compiled.compiled_summary(compiled_text)["dots"] if d.site == "dense"]


def test_compiled_dense_dots_are_bf16_x_bf16_to_f32():
  """What XLA:CPU compiled for a bf16 prefill (2 x 64 = 128 rows): every dense dot of
  the q/k/v/o projections and the MLP takes bf16 x bf16 operands and returns f32 (the fast
  path); a decode step (1 row) on the float32-carried weights runs f32 x f32."""
  params = jax.eval_shape(lambda: init_params(CONFIG, jax.random.PRNGKey(0)))
  prec = decoding.serving_precision(BF16_FLAGS, backend="cpu")
  prefill = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=prec,
                                      cache_length=64))
  tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
  assert 2 * 64 >= layers.MIN_ROWS_C_DOT
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  text = prefill.lower(params, tokens, lengths).compile().as_text()
  dots = _dense_dots(text)
  layer_dots = [d for d in dots if d.layer is not None]
  assert len(layer_dots) >= 7 * CONFIG.num_layers, [d.name for d in dots]
  assert {d.types for d in layer_dots} == {"bf16xbf16->f32"}, {d.types for d in layer_dots}
  state = decoding.DecodeState(init_cache(CONFIG, 1, 16, prec.compute_dtype),
                               jax.ShapeDtypeStruct((1, CONFIG.vocab_size), jnp.float32),
                               jax.ShapeDtypeStruct((1,), jnp.int32))
  step = jax.jit(functools.partial(decoding.decode_step, config=CONFIG, precision=prec))
  step_dots = _dense_dots(step.lower(params, state, jax.ShapeDtypeStruct(
      (1,), jnp.int32)).compile().as_text())
  assert step_dots and {d.types for d in step_dots} == {"f32xf32->f32"}, \
      {d.types for d in step_dots}

"""The Pallas kernel (`attnprec.kernels.pallas`): interpreted on CPU against float64, the
flags against dot_product, refusals, the TPU / GPU lowerings, the body's audit.

Each test names what it compares against:
  * `float64` — `contract.reference_attention_np` (NumPy, no JAX);
  * `dot_product` — the dense kernel under the same flags.
Tolerance (fp32, O(1) values): ATOL = RTOL = 2e-5, blockwise's bound in
tests/test_kernels.py.
"""
import functools
import re
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import audit, contract, kernels
from attnprec.config import ModelConfig
from attnprec.contract import AttentionFlags, CausalMask
from attnprec.errors import UserError
from attnprec.inspect import pallas_check
from attnprec.kernels import dot_product, pallas
from attnprec.precision import Precision
from platform_bounds import MODEL_UNITS, tol

ATOL = RTOL = tol(2e-5)     # tests/test_kernels.py: every kernel vs float64
B, N, H = 2, 4, 16
BF16 = jnp.bfloat16


def _qkv(T, S, K, dtype=jnp.float32, seed=0, logit_scale=3.0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, H)) * logit_scale
  k, v = rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, H))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


@functools.partial(jax.jit, static_argnames=("window", "cap", "flags"))
def _pallas(q, k, v, q_pos, k_pos, dense, *, window=None, cap=None,
            flags=AttentionFlags()):
  return pallas.pallas_attention(q, k, v, mask=dense, causal=True, q_positions_BxT=q_pos,
                                 k_positions_BxS=k_pos, sliding_window=window,
                                 logits_soft_cap=cap, flags=flags)


_dot_product = jax.jit(dot_product.dot_product_attention,
                       static_argnames=("flags", "logits_soft_cap"))


@pytest.mark.parametrize("case,T,S,K,window,cap", [
    ("prefill_causal_gqa_cap", 37, 37, 2, None, 5.0),     # padded rows, keys, head dim
    ("prefill_window_mqa_lengths", 37, 37, 1, 6, None),   # + a padding mask (lengths)
    ("decode_over_cache_gqa_cap", 1, 200, 2, None, 5.0),  # at 20 / 190: 2 key blocks
])
def test_matches_float64_and_dot_product(case, T, S, K, window, cap):
  """fp32, interpreted: == float64 and == dot_product within blockwise's bound."""
  q, k, v = _qkv(T, S, K)
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  q_pos = jnp.asarray([[20], [190]], jnp.int32) if T == 1 else k_pos[:, S - T:]
  dense = None
  want_mask = contract.causal_mask(q_pos, k_pos, sliding_window=window)
  if "lengths" in case:   # the second sequence has 33 real tokens: keys past it hidden
    dense = (k_pos < jnp.asarray([[37], [33]]))[:, None, None, :]
    want_mask = want_mask & dense
  out = _pallas(q, k, v, q_pos, k_pos, dense, window=window, cap=cap)
  ref = contract.reference_attention_np(q, k, v, mask=want_mask, logits_soft_cap=cap)
  bound = tol(2e-5, scale=np.abs(ref).max())
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=bound, rtol=bound)
  want = _dot_product(q, k, v, mask=want_mask, logits_soft_cap=cap)
  chex.assert_trees_all_close(out, want, atol=bound, rtol=bound)


def test_flags_change_the_numbers_as_dot_products_do():
  """bf16, sharp causal attention: with both flags off pallas is within a few bf16 ulps
  of dot_product under the same flags, and its float64 error is well above that with
  both flags on (and within 1.05x of dot_product's, which rounds more: blockwise's
  statistics argument)."""
  T = S = 32
  q, k, v = _qkv(T, S, 2, BF16, seed=3, logit_scale=4.0)
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  mask = contract.causal_mask(pos, pos)
  ref = contract.reference_attention_np(q, k, v, mask=mask)
  err = lambda out: float(np.abs(np.asarray(out, np.float64) - ref).max())  # noqa: E731
  off = AttentionFlags(float32_qk_product=False, float32_logits=False)
  on = AttentionFlags()
  p_off, p_on = (_pallas(q, k, v, pos, pos, None, flags=f) for f in (off, on))
  d_off = _dot_product(q, k, v, mask=mask, flags=off)
  np.testing.assert_allclose(np.asarray(p_off, np.float32), np.asarray(d_off, np.float32),
                             atol=0.1, rtol=0.1)
  assert err(p_off) > 2 * err(p_on), (err(p_off), err(p_on))
  assert err(p_off) <= 1.05 * err(d_off), (err(p_off), err(d_off))


@pytest.mark.parametrize("settings,named", [
    (dict(einsum_precision="high"), "einsum_precision='high'"),
    (dict(einsum_precision="BF16_BF16_F32"), "einsum_precision='BF16_BF16_F32'"),
    (dict(kv_cache_k_dtype="int8"), "precision.kv_cache_k_dtype = 'int8'"),
])
def test_refused_settings_name_the_knob(settings, named):
  with pytest.raises(UserError) as err:
    Precision(kernel="pallas", **settings)
  assert named in str(err.value) and "Valid" in str(err.value)


def test_gradient_is_a_user_error():
  q, k, v = _qkv(4, 4, 2)
  with pytest.raises(UserError, match="'pallas' attention kernel has no gradient"):
    jax.jit(jax.grad(lambda q: kernels.attend(Precision(kernel="pallas"), q, k, v).sum()))(q)


@pytest.mark.parametrize("platform,call", [("tpu", "tpu_custom_call"),
                                           ("cuda", "__gpu$xla.gpu.triton")])
def test_lowers_to_the_backends_custom_call(platform, call):
  """Lowered (not run) for TPU: Mosaic in a tpu_custom_call; for CUDA: a Triton call.
  bf16 with both flags off (the narrowest body: bf16 logits, soft-cap, exp), two key
  blocks (the loop and the block skip), a sliding window."""
  q, k, v = _qkv(37, 200, 2, BF16)
  prec = Precision(dtype="bfloat16", kernel="pallas", float32_qk_product=False,
                   float32_logits=False)
  k_pos = jnp.broadcast_to(jnp.arange(200, dtype=jnp.int32), (B, 200))
  mask = CausalMask(k_pos[:, -37:], k_pos, sliding_window=8)
  f = lambda *x: kernels.attend(prec, *x, mask=mask, logits_soft_cap=30.0)  # noqa: E731
  text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=(platform,)).as_text()
  assert set(re.findall(r"custom_call @(\S+)\(", text)) == {call}
  assert "stablehlo.dot_general" not in text      # the attention is inside the kernel


def _narrowed(real):
  """A make_body that builds the body from a table row with bf16 logits (and so the
  query scale on bf16 logits): the QK accumulation narrowed."""
  def make_body(geo, stages, **kw):
    return real(geo, dict(stages, logits=jnp.dtype(BF16), scale=jnp.dtype(BF16)), **kw)
  return make_body


def test_pallas_check_passes_the_kernel_and_fails_a_narrowed_body():
  """The body read from the jaxpr: both dots (types, precision), exp / max / sum."""
  q, k, v = _qkv(8, 8, 2, BF16)
  flags = AttentionFlags(einsum_precision="highest")
  fn = functools.partial(pallas.pallas_attention, flags=flags, causal=True)
  r = pallas_check.check_function(fn, q, k, v, compute_dtype=BF16, flags=flags)
  assert r["ok"], r["problems"]
  (qk,) = [d for d in r["bodies"][0]["dots"] if d["scope"] == "qk"]
  # 'highest': float32 operands (the one form Mosaic multiplies at fp32 precision)
  assert (qk["lhs"], qk["result"], qk["precision"]) == ("float32", "float32", "HIGHEST")
  assert r["bodies"][0]["softmax"] == {"exp": ["float32"], "max": ["float32"],
                                       "stats exp": ["float32"], "sum": ["float32"]}
  fn = functools.partial(pallas.pallas_attention, flags=flags, causal=True)  # not cached
  with mock.patch.object(pallas, "make_body", _narrowed(pallas.make_body)):
    bad = pallas_check.check_function(fn, q, k, v, compute_dtype=BF16, flags=flags)
  assert not bad["ok"]
  assert any("qk accumulation (stage 'logits'): preferred_element_type float32 rounded to "
             "bfloat16, expected float32" in p for p in bad["problems"]), bad["problems"]
  # A body whose qk dot accumulates in bf16 (preferred_element_type bf16), and one that
  # narrows the probabilities into the wv dot.
  body = pallas_check.KernelBody(
      name="variant", dots=[pallas_check.BodyDot("qk", "bfloat16", "bfloat16", "bfloat16",
                                                 "HIGHEST"),
                            pallas_check.BodyDot("wv", "bfloat16", "bfloat16", "float32",
                                                 "HIGHEST")],
      block_exps=["float32"], stat_exps=["float32"], maxes=["float32"], sums=["float32"])
  assert pallas_check.check_body(body, BF16, flags) == [
      "qk accumulation (stage 'logits'): preferred_element_type bfloat16, expected float32",
      "wv operands (stage 'probs'): bfloat16 x bfloat16, expected float32 x float32"]


CONFIG = ModelConfig(vocab_size=13, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=32, max_seq_len=64)


def test_audit_checks_the_kernel_body():
  """`make audit` with decode/precision.kernel = 'pallas': the prefill and decode step's
  kernel bodies are checked; a narrowed body fails the audit naming the stage."""
  train, decode = Precision(dtype="bfloat16"), Precision(dtype="bfloat16", kernel="pallas")
  result = audit.run_audit(CONFIG, train, decode, compile=False, prompt_len=2, new_tokens=1)
  assert result["ok"], result["problems"]
  assert "pallas" not in result["phases"]["train"]
  assert all(b["ok"] for ph in ("prefill", "decode")
             for b in result["phases"][ph]["pallas"]["bodies"])
  with mock.patch.object(pallas, "make_body", _narrowed(pallas.make_body)):
    bad = audit.run_audit(CONFIG, train, decode, compile=False, prompt_len=2, new_tokens=1)
  assert any(p.startswith("decode pallas body: qk accumulation (stage 'logits')")
             for p in bad["problems"]), bad["problems"]


def test_audit_for_tpu_reads_the_custom_calls_from_the_jaxpr():
  """Lowered for TPU the kernel is one `tpu_custom_call` per layer, which the dot search
  cannot open: the audit for --platform=tpu checks its bodies from the jaxpr instead (no
  'layer has 0 attentions' problem), and a narrowed body still fails."""
  train, decode = Precision(dtype="bfloat16"), Precision(dtype="bfloat16", kernel="pallas")
  result = audit.run_audit(CONFIG, train, decode, compile=False, prompt_len=2, new_tokens=1,
                           platform="tpu")
  assert result["ok"], result["problems"]
  assert all(b["ok"] for ph in ("prefill", "decode")
             for b in result["phases"][ph]["pallas"]["bodies"])
  with mock.patch.object(pallas, "make_body", _narrowed(pallas.make_body)):
    bad = audit.run_audit(CONFIG, train, decode, compile=False, prompt_len=2, new_tokens=1,
                          platform="tpu")
  assert any("pallas body: qk accumulation (stage 'logits')" in p
             for p in bad["problems"]), bad["problems"]


def test_model_prefill_and_decode_match_dot_product():
  """Decoder logits, pallas vs dot_product: a prefill into a cache, then one cached
  decode step (a sliding-window layer, GQA, soft-cap), fp32."""
  from attnprec import model as model_lib
  from attnprec.cache import init_cache
  cfg = ModelConfig(vocab_size=50, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                    head_dim=8, mlp_hidden=64, sliding_window=5, layer_pattern=("local",),
                    attn_logit_soft_cap=20.0)
  params = jax.jit(model_lib.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
  apply = model_lib.transformed(cfg).apply
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, 50)

  @functools.partial(jax.jit, static_argnums=0)
  def run(kernel, params, tokens):      # prefill and a decode step: one program
    prec = Precision(kernel=kernel)
    out = apply(params, tokens, None, init_cache(cfg, 2, 32, jnp.float32), precision=prec)
    step = apply(params, tokens[:, :1], jnp.full((2, 1), 21), out.cache, precision=prec)
    return out.logits, step.logits

  chex.assert_trees_all_close(run("pallas", params, tokens),
                              run("dot_product", params, tokens),
                              atol=tol(1e-4, MODEL_UNITS), rtol=tol(1e-4, MODEL_UNITS))


def test_the_train_phase_refuses_pallas_before_anything_runs():
  """'pallas' has no gradient (`KernelSpec.trains`): the train phase (and the audit's
  train step) refuses it by name, listing the kernels that train."""
  from attnprec import train
  with pytest.raises(UserError, match=r"'pallas' has no gradient.*'dot_product'"):
    train.check_kernel(Precision(kernel="pallas"))
  train.check_kernel(Precision(kernel="blockwise"))   # a kernel with a gradient passes

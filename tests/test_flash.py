"""The flash kernel (`attnprec.kernels.flash`): forward and backward against float64 and
dot_product, the blocks it skips, its refusals, its TPU lowering, its bodies' audit.

Interpreted on CPU; on a TPU (`make test-tpu`) the same tests run the Mosaic body.
Each test names what it compares against:
  * `float64` — `contract.reference_attention_np` (NumPy, no JAX);
  * `dot_product` — the dense kernel under the same flags (and `jax.grad` through it for
    the gradients: an independent implementation of the backward pass).
Tolerance (fp32, O(1) values): ATOL = RTOL = 2e-5, blockwise's bound in
tests/test_kernels.py, scaled to the platform's f32 arithmetic (tests/platform_bounds.py).
"""
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import contract, kernels
from attnprec.contract import AttentionFlags, CausalMask
from attnprec.errors import UserError
from attnprec.inspect import pallas_check
from attnprec.kernels import dot_product, flash
from attnprec.precision import Precision
from platform_bounds import assert_gradients_match, tol

B, N, H = 2, 4, 16
BF16 = jnp.bfloat16
# Small blocks: several q and kv blocks per call (forward 32 rows x 256 keys, backward
# 16 x 128), so the streaming, the skips and the padding all run
# (the forward's kv blocks of 256 keys, two chunks of 128: a block on the mask's edge runs
# chunk by chunk, skipping chunks; the backward's blocks one chunk each)
SMALL = flash.Blocks(q=32, k=256, q_bwd=16, k_bwd=128, chunk=128)


def _qkv(T, S, K, dtype=jnp.float32, seed=0, logit_scale=3.0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, H)) * logit_scale
  k, v = rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, H))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _positions(T, S):
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  q_pos = jnp.asarray([[20], [190]], jnp.int32) if T == 1 else k_pos[:, S - T:]
  return q_pos, k_pos


CASES = [  # case, T, S, K, window, cap
    ("prefill_causal_gqa_cap", 37, 37, 2, None, 5.0),       # padded rows, keys, head dim
    ("prefill_window_mqa_lengths", 300, 300, 1, 40, None),  # 2 kv blocks, a dense mask
    ("decode_over_cache_gqa_cap", 1, 200, 2, None, 5.0),    # at 20 / 190: 2 key blocks
]


def _setup(case, T, S, K, window):
  q, k, v = _qkv(T, S, K)
  q_pos, k_pos = _positions(T, S)
  dense = None
  want_mask = contract.causal_mask(q_pos, k_pos, sliding_window=window)
  if "lengths" in case:   # the second sequence has 270 real tokens: keys past it hidden
    dense = (k_pos < jnp.asarray([[S], [270]]))[:, None, None, :]
    want_mask = want_mask & dense
  return q, k, v, q_pos, k_pos, dense, want_mask


def _flash_fn(q_pos, k_pos, dense, window, cap, flags=AttentionFlags()):
  return lambda q, k, v: flash.flash_attention(
      q, k, v, mask=dense, causal=True, q_positions_BxT=q_pos, k_positions_BxS=k_pos,
      sliding_window=window, logits_soft_cap=cap, flags=flags, blocks=SMALL)


@pytest.mark.parametrize("case,T,S,K,window,cap", CASES)
def test_forward_and_gradients_match_float64_and_dot_product(case, T, S, K, window, cap):
  """fp32: the output == float64 and == dot_product; d(output . w)/d(q, k, v) ==
  jax.grad through dot_product (within blockwise's bound, scaled by the largest value)."""
  q, k, v, q_pos, k_pos, dense, want_mask = _setup(case, T, S, K, window)
  f = _flash_fn(q_pos, k_pos, dense, window, cap)
  d = lambda q, k, v: dot_product.dot_product_attention(  # noqa: E731
      q, k, v, mask=want_mask, logits_soft_cap=cap)
  out = jax.jit(f)(q, k, v)
  ref = contract.reference_attention_np(q, k, v, mask=want_mask, logits_soft_cap=cap)
  bound = tol(2e-5, scale=np.abs(ref).max())
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=bound, rtol=bound)
  assert_gradients_match(f, d, (q, k, v), jnp.cos(jnp.arange(H, dtype=jnp.float32)))


def test_a_128_wide_head_is_read_where_the_caller_holds_it():
  """H = 128, lengths the blocks divide: the direct geometry (q, k, v, o, dq, dk, dv in
  the caller's layout, a q block's G heads gathered into rows in VMEM): the output ==
  float64 and the gradients == jax.grad through dot_product (blockwise's bound), under
  a causal mask and a window; lowered for TPU, the forward and its gradient move no
  q, k, v or output around the Mosaic calls (no transpose: the backward's row sums
  rowsum(dO * O) are made in VMEM, `flash._gather_delta`), except under 'highest'."""
  H128, K, T = 128, 2, 256
  blocks = flash.Blocks(q=64, k=128, q_bwd=64, k_bwd=128, chunk=128, direct_q=64)
  fgeo, bgeo = flash.direct_geometries(B, K, T, N // K, T, H128, blocks)
  assert (fgeo.direct, fgeo.Tt, fgeo.Tq, fgeo.Rp) == (True, 32, 64, 512)
  assert flash.direct_geometries(B, K, T, N // K, T, 64, blocks) is None    # half a lane row
  assert flash.direct_geometries(B, K, 200, N // K, 200, H128, blocks) is None  # 200 % 32
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(B, T, N, H128)) * 3, jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, T, K, H128)), jnp.float32) for _ in range(2))
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  w = jnp.cos(jnp.arange(H128, dtype=jnp.float32))
  for window in (None, 70):
    want = contract.causal_mask(pos, pos, sliding_window=window)
    f = lambda q, k, v: flash.flash_attention(  # noqa: E731
        q, k, v, causal=True, q_positions_BxT=pos, k_positions_BxS=pos,
        sliding_window=window, blocks=blocks)
    ref = contract.reference_attention_np(q, k, v, mask=want)
    bound = tol(2e-5, scale=np.abs(ref).max())
    np.testing.assert_allclose(np.asarray(jax.jit(f)(q, k, v), np.float64), ref,
                               atol=bound, rtol=bound)
    assert_gradients_match(f, lambda q, k, v: dot_product.dot_product_attention(
        q, k, v, mask=want), (q, k, v), w)
  g = jax.grad(lambda *x: (f(*x) * w).sum(), argnums=(0, 1, 2))
  for fn, calls, transposes in ((f, 1, 0), (g, 3, 0)):
    text = jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()
    assert len(re.findall(r"custom_call @tpu_custom_call\(", text)) == calls
    assert len(re.findall(r"stablehlo.transpose", text)) == transposes
  # 'highest' keeps the row-packed geometry (measured faster there): q and o are moved
  highest = lambda q, k, v: flash.flash_attention(  # noqa: E731
      q, k, v, causal=True, blocks=blocks, flags=AttentionFlags(einsum_precision="highest"))
  text = jax.jit(highest).trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()
  assert len(re.findall(r"stablehlo.transpose", text)) >= 2


def test_bf16_flags_change_the_numbers_as_dot_products_do():
  """bf16, sharp causal attention: flags off, flash is within a few bf16 ulps of
  dot_product under the same flags (bf16 logits: declared, so run) and its float64 error
  is well above flags on's; flags on it is within 1.05x of dot_product's error."""
  T = S = 160
  q, k, v = _qkv(T, S, 2, BF16, seed=3, logit_scale=4.0)
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  mask = contract.causal_mask(pos, pos)
  ref = contract.reference_attention_np(q, k, v, mask=mask)
  err = lambda out: float(np.abs(np.asarray(out, np.float64) - ref).max())  # noqa: E731
  off = AttentionFlags(float32_qk_product=False, float32_logits=False)
  on = AttentionFlags()
  # the four calls as one program
  f_off, f_on, d_off, d_on = jax.jit(lambda q, k, v: [
      _flash_fn(pos, pos, None, None, None, fl)(q, k, v) for fl in (off, on)] + [
      dot_product.dot_product_attention(q, k, v, mask=mask, flags=fl) for fl in (off, on)])(
          q, k, v)
  np.testing.assert_allclose(np.asarray(f_off, np.float32), np.asarray(d_off, np.float32),
                             atol=0.1, rtol=0.1)
  assert err(f_off) > 2 * err(f_on), (err(f_off), err(f_on))
  assert err(f_on) <= 1.05 * err(d_on) + 2 ** -9, (err(f_on), err(d_on))


def test_both_flags_run_the_softmax_in_base_2(monkeypatch):
  """Both flags on bf16 inputs, no soft-cap (`Spec.base2`): the logits are multiplied
  by scale * log2(e) and every body's exps are exp2, forward and backward; flags off, or
  a soft-cap, keep exp. The same softmax: output and gradients equal the kernel's with
  base 2 turned off to one bf16 ulp of their largest value (the float32 difference of
  the two forms, ~2^-22 relative, can move a bf16 rounding by one ulp, no more)."""
  T = S = 48
  q, k, v = _qkv(T, S, 2, BF16, seed=3, logit_scale=4.0)
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  w = jnp.cos(jnp.arange(H, dtype=jnp.float32))

  def run(flags, cap=None, execute=True):
    f = _flash_fn(pos, pos, None, None, cap, flags)
    g = jax.grad(lambda *x: (f(*x).astype(jnp.float32) * w).sum(), argnums=(0, 1, 2))
    text = str(jax.make_jaxpr(g)(q, k, v))
    return ((jax.jit(f)(q, k, v),) + jax.jit(g)(q, k, v) if execute else None), text

  on = AttentionFlags()
  got, text = run(on)
  assert len(re.findall(r"= exp2 ", text)) >= 3 and not re.findall(r"= exp ", text)
  for flags, cap in ((AttentionFlags(float32_qk_product=False, float32_logits=False), None),
                     (on, 5.0)):
    _, other = run(flags, cap, execute=False)
    assert re.findall(r"= exp ", other) and not re.findall(r"= exp2 ", other)
  flash._attention.clear_cache()     # its traces are cached on the (equal) Specs
  try:
    monkeypatch.setattr(flash.Spec, "base2", property(lambda self: False))
    want, text = run(on)
  finally:
    monkeypatch.undo()
    flash._attention.clear_cache()
  assert not re.findall(r"= exp2 ", text)
  for a, b in zip(got, want):
    a, b = (np.asarray(x.astype(jnp.float32), np.float64) for x in (a, b))
    assert np.abs(a - b).max() <= 2 ** -8 * np.abs(b).max()


def test_hidden_blocks_are_neither_read_nor_computed():
  """A causal prefill of 4 q blocks over 4 kv blocks: q block i reads kv blocks 0..i
  (lo, hi), kv block j is read by q blocks j..3; a sliding window narrows both; the
  bounds hold per sequence (a batch at different positions)."""
  small = flash.Blocks(q=128, k=128, q_bwd=128, k_bwd=128, chunk=128)
  geo, _ = flash.geometries(1, 1, 512, 1, 512, 64, small)
  pos = jnp.arange(512, dtype=jnp.int32)[None]
  _, _, _, _, lo, hi, qlo, qhi, cmin, cmax = flash._bounds(pos, pos, geo, causal=True,
                                                          window=None)
  assert lo.tolist() == [0, 0, 0, 0] and hi.tolist() == [0, 1, 2, 3]
  assert qlo.tolist() == [0, 1, 2, 3] and qhi.tolist() == [3, 3, 3, 3]
  # a block on the diagonal runs chunk by chunk: each chunk's key positions bound it
  assert geo.chunk == 128 and cmin.tolist() == [0, 128, 256, 384]
  assert cmax.tolist() == [127, 255, 383, 511]
  _, _, _, _, lo, hi, *_ = flash._bounds(pos, pos, geo, causal=True, window=128)
  assert lo.tolist() == [0, 0, 1, 2] and hi.tolist() == [0, 1, 2, 3]
  # a decode step at position 130 over a 512-key cache: one row block, kv blocks 0..1
  geo1, _ = flash.geometries(1, 1, 1, 1, 512, 64, small)
  qpos = jnp.full((1, geo1.Rp), 130, jnp.int32)
  _, _, _, _, lo, hi, *_ = flash._bounds(qpos, pos, geo1, causal=True, window=None)
  assert (lo.tolist(), hi.tolist()) == ([0], [1])


@pytest.mark.parametrize("settings,named", [
    (dict(einsum_precision="high"), "einsum_precision='high'"),
    (dict(einsum_precision="BF16_BF16_F32"), "einsum_precision='BF16_BF16_F32'"),
])
def test_refused_settings_name_the_knob(settings, named):
  with pytest.raises(UserError) as err:
    Precision(kernel="flash", **settings)
  assert named in str(err.value) and "Valid" in str(err.value)


def test_a_quantized_cache_is_read_and_has_no_gradient():
  """An int8 cache is honoured (tests/test_kvcache_quant.py holds its numbers to float64);
  a gradient through it is refused by name before anything runs."""
  from attnprec import kvquant
  q, k, v = _qkv(1, 40, 2)
  codes, scale_BxSxK = kvquant.quantize_token(k, "int8")
  scales = contract.KVScales(k_token_BxKxS=jnp.swapaxes(scale_BxSxK, 1, 2))
  storage = contract.CacheStorage("int8", "compute", "token", None)
  f = lambda q: flash.flash_attention(q, codes, v, kv_cache=storage,  # noqa: E731
                                      kv_scales=scales).sum()
  assert np.isfinite(float(jax.jit(f)(q)))
  with pytest.raises(UserError, match="quantized KV cache .* has no gradient"):
    jax.grad(f)(q)


@pytest.mark.parametrize("blocks,named", [
    (flash.Blocks(q=100), "q=100"),            # not a multiple of 16
    (flash.Blocks(k=200), "k=200"),            # not a multiple of 128
    (flash.Blocks(q_bwd=0), "q_bwd=0"),
    (flash.Blocks(q=8192, k=8192), "8192x8192"),   # past the VMEM it may use
    (flash.Blocks(k=1024, chunk=384), "chunk=384 does not divide"),
    (flash.Blocks(decode_k=1000), "decode_k=1000"),
    (flash.Blocks(decode_k=131072), "128x131072"),   # a decode block past the VMEM
])
def test_blocks_that_cannot_tile_or_fit_are_refused(blocks, named):
  q, k, v = _qkv(4, 4, 2)
  with pytest.raises(UserError) as err:
    flash.flash_attention(q, k, v, causal=True, blocks=blocks)
  assert named in str(err.value) and "Valid" in str(err.value), str(err.value)


def test_lowers_for_tpu_to_mosaic_calls_forward_and_backward():
  """Lowered (not run) for TPU, bf16 with both flags off, a window and a soft-cap: the
  forward is one tpu_custom_call, its gradient three (forward with the logsumexp, dq,
  dk/dv), and no attention dot outside them."""
  q, k, v = _qkv(37, 200, 2, BF16)
  prec = Precision(dtype="bfloat16", kernel="flash", float32_qk_product=False,
                   float32_logits=False)
  k_pos = jnp.broadcast_to(jnp.arange(200, dtype=jnp.int32), (B, 200))
  mask = CausalMask(k_pos[:, -37:], k_pos, sliding_window=8)
  f = lambda q, k, v: kernels.attend(prec, q, k, v, mask=mask, logits_soft_cap=30.0)  # noqa: E731
  g = jax.grad(lambda *x: f(*x).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  for fn, calls in ((f, 1), (g, 3)):
    text = jax.jit(fn).trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()
    assert set(re.findall(r"custom_call @(\S+)\(", text)) == {"tpu_custom_call"}
    assert len(re.findall(r"custom_call @tpu_custom_call\(", text)) == calls
    assert "stablehlo.dot_general" not in text


def _narrowed(real):
  """A _logits whose table row has bf16 logits: the QK accumulation narrowed."""
  def narrowed(spec, *args):
    import dataclasses
    stages = dict(spec.stages, logits=jnp.dtype(BF16), scale=jnp.dtype(BF16))
    return real(dataclasses.replace(spec, stages=tuple(stages.items())), *args)
  return narrowed


@pytest.mark.parametrize("einsum", ["default", "highest"])
def test_bodies_hold_the_table_forward_and_backward(einsum, monkeypatch):
  """The forward body and the two backward bodies read from the jaxpr of the gradient:
  the qk dot as the table says, the backward's dots on c operands (P and dS rounded to
  c; float32 under 'highest') accumulating float32 (`contract.backward_stage_dtypes`);
  a body whose QK accumulation is narrowed fails naming the stage."""
  q, k, v = _qkv(8, 8, 2, BF16)
  flags = AttentionFlags(einsum_precision=einsum)
  f = functools.partial(flash.flash_attention, flags=flags, causal=True)
  g = jax.grad(lambda *x: f(*x).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  r = pallas_check.check_function(g, q, k, v, compute_dtype=BF16, flags=flags)
  assert r["ok"], r["problems"]
  names = {re.search(r"attn_flash_\w+", b["kernel"]).group(0) for b in r["bodies"]}
  assert names == {"attn_flash_fwd", "attn_flash_dq", "attn_flash_dkv"}, names
  grads = [d for b in r["bodies"] for d in b["dots"] if d["scope"] == "grad"]
  assert grads and {d["result"] for d in grads} == {"float32"}
  assert {d["lhs"] for d in grads} == {"float32" if einsum == "highest" else "bfloat16"}
  monkeypatch.setattr(flash, "_logits", _narrowed(flash._logits))
  f = functools.partial(flash.flash_attention, flags=flags, causal=True, scale=0.3)
  bad = pallas_check.check_function(f, q, k, v, compute_dtype=BF16, flags=flags)
  assert any("qk accumulation (stage 'logits')" in p for p in bad["problems"]), bad


def test_audit_checks_every_phase_s_bodies():
  """`make audit` with precision.kernel = 'flash' in every phase (the train step too: its
  backward kernels), lowered for cpu and for tpu: the bodies hold the table; a narrowed
  QK accumulation fails the audit naming the phase and the stage."""
  from attnprec import audit, train
  from attnprec.config import ModelConfig
  train.check_kernel(Precision(kernel="flash"))     # it has a gradient: the train phase runs it
  config = ModelConfig(vocab_size=13, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_hidden=32, max_seq_len=64)
  prec = Precision(dtype="bfloat16", kernel="flash")
  for platform in ("cpu", "tpu"):
    result = audit.run_audit(config, prec, prec, compile=False, prompt_len=2, new_tokens=1,
                             platform=platform)
    assert result["ok"], result["problems"]
    bodies = result["phases"]["train"]["pallas"]["bodies"]
    assert any("attn_flash_dkv" in b["kernel"] for b in bodies), bodies
  real = flash._logits
  other = Precision(dtype="bfloat16", kernel="flash", einsum_precision="highest")  # not cached
  try:
    flash._logits = _narrowed(real)
    bad = audit.run_audit(config, other, other, compile=False, prompt_len=2, new_tokens=1,
                          platform="tpu")
  finally:
    flash._logits = real
  assert any(p.startswith("train pallas body: backward qk accumulation") or
             p.startswith("train pallas body: qk accumulation") for p in bad["problems"]), \
      bad["problems"]
  assert any(p.startswith("prefill pallas body: qk accumulation (stage 'logits')")
             for p in bad["problems"]), bad["problems"]


def test_the_docs_tables_are_the_tpu_runs():
  """docs/performance.md quotes each TPU run's flags table to the character, rendered
  from its file (`tpu_attention.flags_table`): results/tpu-flash/sweep7.json (the flash
  kernel beside splash fed the same inputs and splash alone: five cases of six rows) and
  flags.json (the dense kernel's flags, three cases of eight rows); each file's rows ran
  the code its provenance digest names."""
  import json
  import os
  from attnprec.bench import tpu_attention
  root = os.path.join(os.path.dirname(__file__), "..")
  with open(os.path.join(root, "docs", "performance.md")) as f:
    doc = f.read()
  for name, cases, rows, same in (("sweep7.json", 5, 6, True), ("flags.json", 3, 8, False)):
    with open(os.path.join(root, "results", "tpu-flash", name)) as f:
      result = json.load(f)
    assert result["backend"] == "tpu" and result["provenance"]["source"], name
    # a NaN or infinite figure would print as 'nan' / 'inf' and still match a doc that
    # quotes it: every figure of the record is a finite number
    assert tpu_attention._non_finite(result["cases"], "cases") is None, name
    table = tpu_attention.flags_table(result)
    assert table.count("\n") == 2 + cases * rows, name
    assert ("/ splash, same inputs" in table) == same, name
    assert table in doc, name


def test_model_prefill_decode_and_loss_gradient_match_dot_product():
  """The decoder with kernel 'flash' vs 'dot_product' (fp32; a sliding-window layer and
  a global one, GQA, soft-cap): prefill logits into a cache and one cached decode step,
  and the train loss's gradient w.r.t. every parameter (the backward kernels inside a
  model: `jax.grad` through dot_product is the independent implementation)."""
  from attnprec import model as model_lib, train
  from attnprec.cache import init_cache
  from attnprec.config import ModelConfig
  from platform_bounds import MODEL_UNITS
  cfg = ModelConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, mlp_hidden=64, sliding_window=5,
                    layer_pattern=("local", "global"), attn_logit_soft_cap=20.0)
  params = jax.jit(model_lib.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
  apply = model_lib.transformed(cfg).apply
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, 50)

  @functools.partial(jax.jit, static_argnums=0)
  def run(kernel, params, tokens):
    prec = Precision(kernel=kernel)
    out = apply(params, tokens, None, init_cache(cfg, 2, 32, jnp.float32), precision=prec)
    step = apply(params, tokens[:, :1], jnp.full((2, 1), 21), out.cache, precision=prec)
    grads = jax.grad(lambda p: train.loss_fn(p, tokens, jnp.ones_like(tokens), config=cfg,
                                             precision=prec)[0])(params)
    return out.logits, step.logits, grads

  bound = tol(1e-4, MODEL_UNITS)
  chex.assert_trees_all_close(run("flash", params, tokens), run("dot_product", params, tokens),
                              atol=bound, rtol=bound)


def test_unequal_pass_blocks_and_a_scalar_array_scale():
  """A forward block of 16 rows beside a backward one of 1024 pads the rows to 1024: the
  padded rows (hidden under the causal mask: `PAD_POSITION`) change nothing; a concrete
  JAX scalar scale and soft-cap are read once (a traced one is refused by name)."""
  q, k, v = _qkv(20, 20, 2)
  blocks = flash.Blocks(q=16, k=128, q_bwd=1024, k_bwd=128, chunk=128)
  fgeo, bgeo = flash.geometries(B, 2, 20, 2, 20, H, blocks)
  assert (fgeo.Tq, bgeo.Tq, fgeo.Rp) == (16, 1024, 1024)
  out = flash.flash_attention(q, k, v, causal=True, scale=jnp.float32(0.3),
                              logits_soft_cap=jnp.float32(5.0), blocks=blocks)
  pos = jnp.broadcast_to(jnp.arange(20), (B, 20))
  ref = contract.reference_attention_np(q, k, v, mask=contract.causal_mask(pos, pos),
                                        scale=0.3, logits_soft_cap=5.0)
  bound = tol(2e-5, scale=np.abs(ref).max())
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=bound, rtol=bound)
  with pytest.raises(UserError, match="logits_soft_cap must be a number known"):
    jax.jit(lambda c: flash.flash_attention(q, k, v, causal=True, logits_soft_cap=c))(5.0)


def test_a_tpu_bench_rerun_resumes_only_this_codes_finite_same_settings_file(tmp_path):
  """`tpu_attention.previous`: the file a rerun into the same --out resumes from is
  refused, naming it, when a figure is NaN, another code wrote it, or its settings
  differ (its cases would lack the rows asked for)."""
  import json
  from attnprec import runs
  from attnprec.bench import tpu_attention
  settings = {"kernels": ["flash"], "flag_rows": ["both"], "blocks": [[1024, 1024]],
              "rounds": 3}
  path = tmp_path / "tpu_attention.json"
  assert tpu_attention.previous(str(path), settings)["cases"] == {}
  good = {"settings": settings, "provenance": {"source": runs.code_identity()["source"]},
          "cases": {"qwen2-7b prefill S=2048": {"rows": {"flash both": {"median_ms": 0.8}}}}}
  path.write_text(json.dumps(good))
  assert tpu_attention.previous(str(path), settings)["cases"] == good["cases"]
  for edit, says in (
      (lambda d: d["cases"]["qwen2-7b prefill S=2048"]["rows"]["flash both"].update(
          median_ms=float("nan")), "is not a finite number"),
      (lambda d: d["provenance"].update(source="0123"), "written by other code"),
      (lambda d: d["settings"].update(rounds=5), "measured with other settings")):
    bad = json.loads(json.dumps(good))
    edit(bad)
    path.write_text(json.dumps(bad))
    with pytest.raises(UserError, match="cannot be resumed") as e:
      tpu_attention.previous(str(path), settings)
    assert says in str(e.value) and str(path) in str(e.value)
  path.write_bytes(b"\xff\xfe")
  with pytest.raises(UserError, match="not UTF-8 text"):
    tpu_attention.previous(str(path), settings)


def test_the_tpu_bench_gives_every_row_the_same_numbers_in_either_input_form(monkeypatch):
  """`tpu_attention.run_case` on the CPU at a small length (the Qwen2-7B shape, 256
  tokens, dot_product under both flags): q, k, v as a model's projections give them
  ([1, S, N * H]) and as [1, S, N, H] are the same numbers, so the row's error against
  the float64 reference is the same in both forms; a 'native' splash row's inputs are
  splash's [heads, S, H] with q scaled (`prepare`), and its [N, S, H] output is read back
  in the bench's order (`_as_output`); splash, a Mosaic kernel, is recorded as refused on
  the CPU, never dropped (on a TPU its two rows give the same error). An unknown form is refused by name."""
  from attnprec.bench import tpu_attention as tb
  monkeypatch.setattr(tb, "_reps", lambda S: 1)
  cases = {form: tb.run_case("qwen2-7b", 256, False, kernel_names=["dot_product"],
                             flag_rows=["both"], blocks=[(256, 256)], rounds=1,
                             inputs=form, progress=lambda m: None)
           for form in tb.INPUT_FORMS}
  rows = {form: c["rows"] for form, c in cases.items()}
  assert set(rows["projection"]) == {"dot_product both", "splash 256x256",
                                     "splash 256x256 native"}
  got = {form: r["dot_product both"]["rel_l2"] for form, r in rows.items()}
  assert got["projection"] == got["heads"] and 1e-4 < got["projection"] < 1e-2, got
  splash = [rows["projection"][n] for n in ("splash 256x256", "splash 256x256 native")]
  if jax.default_backend() == "tpu":   # the same kernel on the same numbers, either way
    assert splash[0]["rel_l2"] == splash[1]["rel_l2"] < 1e-2, splash
  else:
    assert all("Mosaic" in r["error"] or "interpret" in r["error"] for r in splash), splash
  N, K, H = tb.SHAPES["qwen2-7b"]
  qkv = tb._inputs("qwen2-7b", 256)
  assert [x.shape for x in qkv] == [(1, 256, N * H), (1, 256, K * H), (1, 256, K * H)]
  qs, ks, vs = tb.prepare("splash 256x256 native", H, qkv)
  assert (qs.shape, ks.shape) == ((N, 256, H), (K, 256, H))
  np.testing.assert_array_equal(
      np.asarray(qs[3, 5], np.float32),
      np.asarray(qkv[0][0, 5, 3 * H:4 * H] * jnp.asarray(H ** -0.5, jnp.bfloat16),
                 np.float32))     # head 3 of position 5, scaled in bf16 as splash's rows
  assert tb.prepare("splash 256x256", H, qkv) is qkv
  back = tb._as_output("splash 256x256 native", qs, 256, H)
  assert back.shape == (1, 256, N, H) and bool(jnp.all(back[0, :, 3] == qs[3]))
  with pytest.raises(UserError, match="inputs='rows' is not one of"):
    tb._inputs("qwen2-7b", 256, form="rows")


def test_a_decode_step_reads_a_64_wide_cache_keys_minor():
  """A decode step (one query, no gradient) at head dim 64 runs the decode geometry with
  keys and values as [H, S] blocks (`flash.KEYS_MINOR_BELOW`), over a cache of 1000 keys
  that its 384-key blocks do not divide (the last block partial, nothing padded), at
  positions 20 and 990: == float64 and == dot_product (fp32, blockwise's bound), an int8
  cache == dot_product over the same codes; and it lowers for a TPU to one Mosaic call
  whose operands are the cache's keys-minor transpose (no padded copy)."""
  from attnprec import kvquant
  S, K, H64 = 1000, 2, 64
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(B, 1, N, H64)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, S, K, H64)), jnp.float32) for _ in "kv")
  q_pos = jnp.asarray([[20], [990]], jnp.int32)
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  blocks = flash.Blocks(chunk=128, decode_k=384)
  geo = flash.decode_geometry(flash.geometries(B, K, 1, N // K, S, H64, blocks)[0], blocks,
                              dense_mask=False)
  assert (geo.keys_minor, geo.pad_keys, geo.Sk, geo.nk) == (True, False, 384, 3)
  run = lambda q, k, v, **kw: flash.flash_attention(  # noqa: E731
      q, k, v, causal=True, q_positions_BxT=q_pos, k_positions_BxS=k_pos, blocks=blocks,
      **kw)
  mask = contract.causal_mask(q_pos, k_pos)
  dense = lambda q, k, v, **kw: dot_product.dot_product_attention(  # noqa: E731
      q, k, v, mask=mask, **kw)
  got = jax.jit(run)(q, k, v)
  want = contract.reference_attention_np(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                         mask=np.asarray(mask))
  np.testing.assert_allclose(got, want, atol=tol(2e-5), rtol=tol(2e-5))
  np.testing.assert_allclose(got, jax.jit(dense)(q, k, v), atol=tol(2e-5), rtol=tol(2e-5))
  storage = contract.CacheStorage("int8", "int8", "token", "token")
  (kc, ks), (vc, vs) = (jax.jit(kvquant.quantize_token, static_argnums=1)(x, "int8")
                        for x in (k, v))
  scales = contract.KVScales(k_token_BxKxS=jnp.swapaxes(ks, 1, 2),
                             v_token_BxKxS=jnp.swapaxes(vs, 1, 2))
  quantized = dict(kv_cache=storage, kv_scales=scales)
  np.testing.assert_allclose(
      jax.jit(functools.partial(run, **quantized))(q, kc, vc),
      jax.jit(functools.partial(dense, **quantized))(q, kc, vc),
      atol=tol(2e-5), rtol=tol(2e-5))
  cache_BxKxSxH = jnp.swapaxes(k, 1, 2).astype(BF16)
  text = jax.jit(lambda q, c: run(q, jnp.swapaxes(c, 1, 2), jnp.swapaxes(c, 1, 2))).trace(
      q.astype(BF16), cache_BxKxSxH).lower(lowering_platforms=("tpu",)).as_text()
  assert len(re.findall(r"custom_call @tpu_custom_call\(", text)) == 1
  assert not re.search(rf"stablehlo.pad[^\n]*\(tensor<[0-9x]*{S}[0-9x]*xbf16>", text), \
      "the cache is padded (copied)"
  assert re.search(rf"tensor<{B}x{K}x{H64}x{S}xbf16>", text), "keys enter as [B, K, H, S]"


def test_a_decode_step_reads_one_layer_of_a_stack_in_place():
  """`layer=`: given a stack of 3 layers' caches [L, B, S, K, H] (int8 codes and their
  per-token scales too), a decode step reads layer l == dot_product over that layer
  alone (fp32, blockwise's bound), for a traced l; lowered for a TPU, the stack enters
  the one Mosaic call whole (no slice of it is copied out); a gradient, a call with
  more rows than a decode step, a layer outside the stack or keys that are not a stack
  are refused by name."""
  from attnprec import kvquant
  L, S, K, H64 = 3, 300, 2, 64
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.normal(size=(B, 1, N, H64)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(L, B, S, K, H64)), jnp.float32) for _ in "kv")
  q_pos = jnp.asarray([[20], [290]], jnp.int32)
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  mask = contract.causal_mask(q_pos, k_pos)
  blocks = flash.Blocks(chunk=128, decode_k=256)
  run = jax.jit(lambda q, k, v, layer, kv_cache=contract.COMPUTE_CACHE, kv_scales=None:
                flash.flash_attention(q, k, v, causal=True, q_positions_BxT=q_pos,
                                      k_positions_BxS=k_pos, blocks=blocks, layer=layer,
                                      kv_cache=kv_cache, kv_scales=kv_scales),
                static_argnames="kv_cache")
  dense = jax.jit(lambda q, k, v, kv_cache=contract.COMPUTE_CACHE, kv_scales=None:
                  dot_product.dot_product_attention(q, k, v, mask=mask, kv_cache=kv_cache,
                                                    kv_scales=kv_scales),
                  static_argnames="kv_cache")
  for layer in (0, 2):
    np.testing.assert_allclose(run(q, k, v, layer), dense(q, k[layer], v[layer]),
                               atol=tol(2e-5), rtol=tol(2e-5))
  storage = contract.CacheStorage("int8", "int8", "token", "token")
  (kc, ks), (vc, vs) = (jax.jit(jax.vmap(lambda x: kvquant.quantize_token(x, "int8")))(x)
                        for x in (k, v))
  scales = contract.KVScales(k_token_BxKxS=jnp.swapaxes(ks, 2, 3),
                             v_token_BxKxS=jnp.swapaxes(vs, 2, 3))
  one = contract.KVScales(k_token_BxKxS=scales.k_token_BxKxS[1],
                          v_token_BxKxS=scales.v_token_BxKxS[1])
  np.testing.assert_allclose(
      run(q, kc, vc, 1, kv_cache=storage, kv_scales=scales),
      dense(q, kc[1], vc[1], kv_cache=storage, kv_scales=one),
      atol=tol(2e-5), rtol=tol(2e-5))
  text = jax.jit(lambda q, c, layer: flash.flash_attention(
      q, c, c, causal=True, q_positions_BxT=q_pos, k_positions_BxS=k_pos, blocks=blocks,
      layer=layer)).trace(q.astype(BF16), k.astype(BF16), 1).lower(
          lowering_platforms=("tpu",)).as_text()
  assert len(re.findall(r"custom_call @tpu_custom_call\(", text)) == 1
  assert not re.search(rf"slice[^\n]*\(tensor<{L}x", text), "a layer sliced out of the stack"
  with pytest.raises(UserError, match="stack of layers' caches .* has no gradient"):
    jax.grad(lambda q: run(q, k, v, 0).sum())(q)
  with pytest.raises(UserError, match=r"layer=3 is not a layer .* valid layers 0 \.\. 2"):
    flash.flash_attention(q, k, v, causal=True, layer=3, blocks=blocks)
  with pytest.raises(UserError, match="reads a stack of layers' caches"):
    flash.flash_attention(q, k[0], v[0], causal=True, layer=0, blocks=blocks)
  with pytest.raises(UserError, match="only in a decode call"):
    flash.flash_attention(jnp.zeros((B, 100, N, H64)), k, v, causal=True, layer=0,
                          blocks=blocks)


def test_a_long_prefill_over_a_quantized_cache_pads_its_scales():
  """A prefill of 100 tokens (200 rows per kv head: the forward geometry, keys padded to
  its blocks) over an int8 per-token cache and over float8 per-channel keys with int8
  values == dot_product over the same codes and scales (fp32, blockwise's bound)."""
  from attnprec import kvquant
  T, S, K = 100, 300, 2
  q, k, v = _qkv(T, S, K, logit_scale=1.0)
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  q_pos = k_pos[:, S - T:]
  mask = contract.causal_mask(q_pos, k_pos)
  vc, vs = kvquant.quantize_token(v, "int8")
  got_fn = jax.jit(lambda q, kc, vc, scales, storage: flash.flash_attention(
      q, kc, vc, causal=True, q_positions_BxT=q_pos, k_positions_BxS=k_pos, blocks=SMALL,
      kv_cache=storage, kv_scales=scales), static_argnames="storage")
  want_fn = jax.jit(lambda q, kc, vc, scales, storage: dot_product.dot_product_attention(
      q, kc, vc, mask=mask, kv_cache=storage, kv_scales=scales), static_argnames="storage")
  for storage in (contract.CacheStorage("int8", "int8", "token", "token"),
                  contract.CacheStorage("float8_e4m3fn", "int8", "channel", "token")):
    if storage.k_scale == "token":
      kc, ks = kvquant.quantize_token(k, "int8")
      scales = contract.KVScales(k_token_BxKxS=jnp.swapaxes(ks, 1, 2),
                                 v_token_BxKxS=jnp.swapaxes(vs, 1, 2))
    else:
      kc, kch = kvquant.quantize_channel(k, kvquant.channel_scale(k, storage.k_dtype),
                                         storage.k_dtype)
      scales = contract.KVScales(k_channel_BxKxH=kch, v_token_BxKxS=jnp.swapaxes(vs, 1, 2))
    got = got_fn(q, kc, vc, scales, storage=storage)
    want = want_fn(q, kc, vc, scales, storage=storage)
    np.testing.assert_allclose(got, want, atol=tol(2e-5), rtol=tol(2e-5),
                               err_msg=storage.describe())

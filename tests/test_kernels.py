"""Attention kernels (blockwise, jax_nn) against the dot_product kernel and float64.

Each test names what it compares against:
  * `dot_product` — the independent, dense fp32 kernel `attnprec.kernels.dot_product`;
  * `float64` — `contract.reference_attention_np`, NumPy in float64 (no JAX).
Tolerances (fp32 inputs with O(1) values, outputs O(1)): ATOL = RTOL = 2e-5 for every
kernel against both where float32 dots multiply in float32 (XLA:CPU; measured differences
are ~1e-6); on a TPU, whose float32 dots at DEFAULT take one bf16 pass, the bound of
tests/platform_bounds.py (KERNEL_UNITS, MODEL_UNITS units of 2^-8).
"""
import ast
import functools
import inspect
import re
import sys
from unittest import mock

import chex
import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from attnprec import cache as cache_lib
from attnprec import contract, kernels
from attnprec.contract import AttentionFlags, CausalMask
from attnprec.errors import UserError
from attnprec.kernels import blockwise, dot_product, jax_nn
from attnprec.precision import Precision, parse_precision
from attnprec.inspect.report import compiled_text  # noqa: E402
from platform_bounds import MODEL_UNITS, exact_f32_dots, tol

ATOL = RTOL = tol(2e-5)
B, N, H = 2, 4, 16
FLAGS = [(qk, lg) for qk in (False, True) for lg in (False, True)]


# The independent reference kernel, jitted (one compile instead of many eager op compiles).
_dot_product = jax.jit(dot_product.dot_product_attention,
                       static_argnames=("flags", "logits_soft_cap", "scale"))


def _qkv(T, S, K, dtype=jnp.float32, seed=0, logit_scale=1.0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, H)) * logit_scale
  k, v = rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, H))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _positions(T, S, decode_pos=None):
  """Prefill: q_pos = k_pos = arange. Decode: one query at decode_pos[b] over a cache."""
  k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  if decode_pos is None:
    return k_pos[:, S - T:], k_pos
  return jnp.asarray(decode_pos, jnp.int32).reshape(B, 1), k_pos


def _run(kernel, q, k, v, q_pos, k_pos, dense, *, window=None, **kw):
  """kernel on a CausalMask built from (q_pos, k_pos, window) — blockwise uses it
  structurally — or, when q_pos is None, on the dense mask."""
  cmask = None if q_pos is None else CausalMask(q_pos, k_pos, sliding_window=window)
  if kernel == "blockwise":
    masking = blockwise.mask_kwargs(cmask) if cmask is not None else dict(mask=dense)
    return blockwise.blockwise_attention(q, k, v, q_block=8, kv_block=16, **masking, **kw)
  return jax_nn.jax_nn_attention(q, k, v, mask=dense if cmask is None else cmask.dense(),
                                 **kw)


class KernelsMatchTest(chex.TestCase, parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.named_parameters(
      # (kernel, mask case, K kv heads (4 MHA, 2 GQA, 1 MQA), logits soft-cap)
      ("blockwise_prefill_causal_gqa_cap", "blockwise", "prefill_causal", 2, 5.0),
      ("blockwise_prefill_window_mqa", "blockwise", "prefill_window", 1, None),
      ("blockwise_prefill_dense_mha_cap", "blockwise", "prefill_dense", 4, 5.0),
      ("blockwise_no_mask_gqa", "blockwise", "no_mask", 2, None),
      ("blockwise_decode_mqa_cap", "blockwise", "decode", 1, 5.0),
      ("blockwise_decode_window_gqa", "blockwise", "decode_window", 2, None),
      ("jax_nn_prefill_window_mqa", "jax_nn", "prefill_window", 1, None),
      ("jax_nn_prefill_dense_mha", "jax_nn", "prefill_dense", 4, None),
      ("jax_nn_decode_gqa", "jax_nn", "decode", 2, None),
  )
  def test_matches_dot_product_and_float64(self, kernel, case, K, soft_cap):
    """fp32 kernel == dot_product (fp32) and == float64 reference, within ATOL/RTOL."""
    window = 6 if case.endswith("window") else None
    T, S = (1, 100) if case.startswith("decode") else (37, 37)
    q, k, v = _qkv(T, S, K, logit_scale=3.0)
    q_pos = k_pos = dense = None
    if case.startswith("decode") or case in ("prefill_causal", "prefill_window"):
      q_pos, k_pos = _positions(T, S, decode_pos=[40, 71] if T == 1 else None)
      dense = contract.causal_mask(q_pos, k_pos, sliding_window=window)
    elif case == "prefill_dense":
      dense = jnp.asarray(np.random.default_rng(1).random((B, 1, T, S)) < 0.7)
      dense = dense.at[..., 0].set(True)  # every row sees a key (see the empty-row test)
    fn = self.variant(functools.partial(_run, kernel, window=window,
                                        logits_soft_cap=soft_cap))
    out = fn(q, k, v, q_pos, k_pos, dense)
    want = _dot_product(q, k, v, mask=dense, logits_soft_cap=soft_cap)
    ref = contract.reference_attention_np(q, k, v, mask=dense, logits_soft_cap=soft_cap)
    bound = tol(2e-5, scale=np.abs(ref).max())
    chex.assert_trees_all_close(out, want, atol=bound, rtol=bound)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=bound, rtol=bound)

  def test_blockwise_default_positions_are_bottom_right_causal(self):
    """causal=True without positions == dot_product with the T-last-keys causal mask."""
    q, k, v = _qkv(5, 29, 2)
    out = jax.jit(functools.partial(blockwise.blockwise_attention, causal=True,
                                    q_block=4, kv_block=8))(q, k, v)
    q_pos, k_pos = _positions(5, 29)
    want = _dot_product(q, k, v, mask=contract.causal_mask(q_pos, k_pos))
    chex.assert_trees_all_close(out, want, atol=ATOL, rtol=RTOL)

  def test_blockwise_gradients_match_dot_product(self):
    """d(sum(out * w))/d(q, k, v) of blockwise == that of dot_product (fp32)."""
    q, k, v = _qkv(13, 13, 2)
    q_pos, k_pos = _positions(13, 13)
    cmask = CausalMask(q_pos, k_pos, sliding_window=7)
    w = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)
    loss_bw = lambda *x: jnp.sum(blockwise.blockwise_attention(
        *x, q_block=8, kv_block=8, **blockwise.mask_kwargs(cmask)) * w)
    loss_dp = lambda *x: jnp.sum(dot_product.dot_product_attention(
        *x, mask=cmask.dense()) * w)
    chex.assert_trees_all_close(jax.jit(jax.grad(loss_bw, (0, 1, 2)))(q, k, v),
                                jax.jit(jax.grad(loss_dp, (0, 1, 2)))(q, k, v),
                                atol=tol(1e-4), rtol=tol(1e-4))


class EmptyRowsTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters("blockwise", "jax_nn")
  def test_fully_masked_row_is_finite(self, kernel):
    """A query that sees no key: no NaN; other rows == dot_product; blockwise gives 0."""
    q, k, v = _qkv(12, 12, 2)
    dense = jnp.ones((B, 1, 12, 12), bool).at[:, :, 3, :].set(False)
    out = jax.jit(functools.partial(_run, kernel))(q, k, v, None, None, dense)
    chex.assert_tree_all_finite(out)
    want = _dot_product(q, k, v, mask=dense)
    chex.assert_trees_all_close(jnp.delete(out, 3, axis=1), jnp.delete(want, 3, axis=1),
                                atol=ATOL, rtol=RTOL)
    if kernel == "blockwise":
      np.testing.assert_array_equal(out[:, 3], 0.0)

  @parameterized.parameters(jnp.float32, jnp.bfloat16)
  def test_blockwise_structured_empty_rows_are_zero(self, dtype):
    """Queries positioned before every key (causal): all blocks skipped, output 0."""
    q, k, v = _qkv(4, 32, 2, dtype)
    q_pos = jnp.full((B, 4), -1, jnp.int32)
    k_pos = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (B, 32))
    out, stats = jax.jit(functools.partial(
        blockwise.blockwise_attention, causal=True, kv_block=8, return_stats=True))(
            q, k, v, q_positions_BxT=q_pos, k_positions_BxS=k_pos)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
    self.assertEqual(int(stats["blocks_computed"]), 0)


class BlockSkippingTest(chex.TestCase, parameterized.TestCase):
  """Skipped blocks are never computed: counted, and proven by NaN poisoning."""

  @parameterized.named_parameters(
      # (T, S, window, decode position, q_block, kv_block, expected computed blocks)
      ("causal_prefill", 64, 64, None, None, 16, 16, 4 + 3 + 2 + 1),   # lower triangle
      ("window_prefill", 64, 64, 16, None, 16, 16, 4 + 3),             # diagonal + one
      ("decode_early", 1, 128, None, 20, 1, 16, 2),                    # keys 0..20
      ("decode_window", 1, 128, 8, 100, 1, 16, 2),                     # keys 93..100
  )
  def test_computed_block_count(self, T, S, window, pos, q_block, kv_block, expected):
    """blocks_computed (incremented only in the compute branch) == the visible blocks."""
    q, k, v = _qkv(T, S, 2)
    q_pos, k_pos = _positions(T, S, decode_pos=None if pos is None else [pos] * B)
    fn = jax.jit(functools.partial(
        blockwise.blockwise_attention, causal=True, sliding_window=window,
        q_block=q_block, kv_block=kv_block, return_stats=True))
    _, stats = fn(q, k, v, q_positions_BxT=q_pos, k_positions_BxS=k_pos)
    self.assertEqual(int(stats["blocks_computed"]), expected)
    self.assertEqual(stats["blocks_total"], (T // q_block) * (S // kv_block))

  def test_skipped_blocks_are_not_read(self):
    """NaN in k/v of hidden blocks: blockwise stays finite and == dot_product on clean
    data; dot_product itself (which reads every key) turns NaN."""
    T, S, pos = 1, 128, 37
    q, k, v = _qkv(T, S, 2)
    q_pos, k_pos = _positions(T, S, decode_pos=[pos] * B)
    hidden = (np.arange(S) >= 48)[None, :, None, None]           # blocks 3.. of 16 keys
    k_bad, v_bad = (jnp.asarray(np.where(hidden, np.nan, np.asarray(x)), jnp.float32)
                    for x in (k, v))
    cmask = CausalMask(q_pos, k_pos)
    out = jax.jit(lambda *x: blockwise.blockwise_attention(
        *x, kv_block=16, **blockwise.mask_kwargs(cmask)))(q, k_bad, v_bad)
    chex.assert_tree_all_finite(out)
    want = _dot_product(q, k, v, mask=cmask.dense())
    chex.assert_trees_all_close(out, want, atol=ATOL, rtol=RTOL)
    poisoned = _dot_product(q, k_bad, v_bad, mask=cmask.dense())
    self.assertTrue(bool(jnp.isnan(poisoned).any()))


class DecodeBlockOverlapTest(parameterized.TestCase):
  """A decode step whose key block does not divide the cache (S = 100, Sk = 16) reads its
  last block at S - Sk, masking the keys the block before already counted, instead of
  padding the cache: the same attention as dot_product and float64, with a quantized
  cache too, and no padded copy of the cache in the compiled program."""

  @parameterized.parameters(40, 71, 99, 87)
  def test_overlapped_last_block_matches_dot_product(self, pos):
    T, S = 1, 100
    q, k, v = _qkv(T, S, 2, logit_scale=3.0)
    q_pos, k_pos = _positions(T, S, decode_pos=[pos, 95])
    cmask = CausalMask(q_pos, k_pos)
    out = blockwise.blockwise_attention(q, k, v, kv_block=16, **blockwise.mask_kwargs(cmask))
    want = _dot_product(q, k, v, mask=cmask.dense())
    ref = contract.reference_attention_np(q, k, v, mask=cmask.dense())
    chex.assert_trees_all_close(out, want, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=ATOL, rtol=RTOL)

  @parameterized.parameters(("int8", "int8"), ("float8_e4m3fn", "float8_e4m3fn"),
                            ("int8", "compute"), ("compute", "float8_e5m2"))
  def test_overlapped_last_block_with_a_quantized_cache(self, k_dtype, v_dtype):
    """int8 and float8 codes (float8 sliced as uint8 bits per block), and a cache with one
    side quantized and the other bf16 (sliced as uint16 bits): as dot_product."""
    T, S, K = 1, 100, 2
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.bfloat16)

    def side(name):
      if name == "int8":
        return jnp.asarray(rng.integers(-127, 128, (B, S, K, H)), jnp.int8)
      if name == "compute":
        return jnp.asarray(rng.normal(size=(B, S, K, H)), jnp.bfloat16)
      return jnp.asarray(rng.normal(size=(B, S, K, H)) * 8, jnp.dtype(name))
    kc, vc = side(k_dtype), side(v_dtype)
    scale = lambda name, size: (None if name == "compute" else  # noqa: E731
                                jnp.asarray(rng.random((B, K, S)) * size, jnp.float32))
    scales = contract.KVScales(k_token_BxKxS=scale(k_dtype, 0.05),
                               v_token_BxKxS=scale(v_dtype, 0.05))
    storage = contract.CacheStorage(
        k_dtype=k_dtype, v_dtype=v_dtype, k_scale=None if k_dtype == "compute" else "token",
        v_scale=None if v_dtype == "compute" else "token")
    flags = AttentionFlags(float32_qk_product=True, float32_logits=True)
    q_pos, k_pos = _positions(T, S, decode_pos=[99, 83])
    cmask = CausalMask(q_pos, k_pos)
    kw = dict(flags=flags, kv_cache=storage, kv_scales=scales)
    fn = jax.jit(lambda q, kc, vc: blockwise.blockwise_attention(
        q, kc, vc, kv_block=16, **blockwise.mask_kwargs(cmask), **kw))
    out = fn(q, kc, vc)
    want = jax.jit(lambda q, kc, vc: dot_product.dot_product_attention(
        q, kc, vc, mask=cmask.dense(), **kw))(q, kc, vc)
    # bf16 outputs of O(1): the two kernels differ in float32 summation order only
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=1e-2, rtol=1e-2)
    text = compiled_text(fn.lower(q, kc, vc))
    for name in (k_dtype, v_dtype):   # each side sliced per block as it is stored
      stored = {"int8": "s8", "compute": "u16"}.get(name, "u8")
      self.assertRegex(text, rf"{stored}\[{B},2,16,16\]")

  @parameterized.product(dtype=["bfloat16", "float16"], batch=[1, 2])
  def test_16_bit_decode_reads_bits_per_block(self, dtype, batch):
    """A decode step over bf16 / f16 keys and values slices their uint16 bits per block
    and reinterprets each block (the model's cache stores them so): the same attention as
    dot_product and float64, and the compiled step slices u16 blocks."""
    T, S = 1, 100
    q, k, v = (x[:batch] for x in _qkv(T, S, 2, dtype=jnp.dtype(dtype), logit_scale=3.0))
    q_pos, k_pos = (x[:batch] for x in _positions(T, S, decode_pos=[87, 99]))
    cmask = CausalMask(q_pos, k_pos)
    flags = AttentionFlags(float32_qk_product=True, float32_logits=True)
    fn = jax.jit(lambda q, k, v: blockwise.blockwise_attention(
        q, k, v, flags=flags, kv_block=16, **blockwise.mask_kwargs(cmask)))
    out = fn(q, k, v)
    self.assertEqual(out.dtype, jnp.dtype(dtype))
    want = _dot_product(q, k, v, mask=cmask.dense(), flags=flags)
    ref = contract.reference_attention_np(q, k, v, mask=cmask.dense())
    # 16-bit outputs of O(1): the kernels differ in float32 summation order only
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=2e-2, rtol=2e-2)
    self.assertRegex(compiled_text(fn.lower(q, k, v)), rf"u16\[{batch},2,16,16\]")

  def test_no_padded_copy_of_the_cache(self):
    T, S = 1, 100
    q, k, v = _qkv(T, S, 2)
    q_pos, k_pos = _positions(T, S, decode_pos=[99, 99])
    fn = jax.jit(lambda q, k, v: blockwise.blockwise_attention(
        q, k, v, kv_block=16, **blockwise.mask_kwargs(CausalMask(q_pos, k_pos))))
    text = compiled_text(fn.lower(q, k, v))
    self.assertNotRegex(text, r"f32\[2,112,2,16\]")      # Sp = 7 * 16 = 112 keys
    self.assertRegex(text, r"f32\[2,100,2,16\]")


def _contracted(dot_eqn) -> int:
  """Size of the contracted axis of a dot_general equation."""
  (lhs_contract, _), _ = dot_eqn.params["dimension_numbers"]
  return dot_eqn.invars[0].aval.shape[lhs_contract[0]]


def _dots_and_exps(fn, *args):
  """(dot_general eqns, exp eqns) of fn's jaxpr, recursing into scan/cond/pjit."""
  dots, exps = [], []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        dots.append(eqn)
      elif eqn.primitive.name == "exp":
        exps.append(eqn)
      for param in eqn.params.values():
        for sub in (param if isinstance(param, (tuple, list)) else (param,)):
          if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)
          elif hasattr(sub, "eqns"):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return dots, exps


class StageDtypesTest(parameterized.TestCase):
  """The traced program of blockwise follows the contract table, checked from the jaxpr
  (independently of the kernel's own chex assertions, which must also pass)."""

  @parameterized.product(dtype=("bfloat16", "float32"), flags=FLAGS,
                         einsum_precision=("default", "highest"), T=(12, 1))
  def test_blockwise_dots_follow_the_table(self, dtype, flags, einsum_precision, T):
    """Prefill (T=12) and decode (T=1) paths."""
    qk, lg = flags
    c = jnp.dtype(dtype)
    flags = AttentionFlags(float32_qk_product=qk, float32_logits=lg,
                           einsum_precision=einsum_precision)
    want = contract.stage_dtypes(c, flags)
    q, k, v = _qkv(T, 40, 2, c)  # Sk=8: qk dots contract H=16, wv dots Sk=8
    fn = functools.partial(blockwise.blockwise_attention, causal=True, q_block=4,
                           kv_block=8, flags=flags)
    # Tracing runs the kernel's own chex stage assertions; they must hold.
    dots, exps = _dots_and_exps(fn, q, k, v)
    qk_dots = [e for e in dots if _contracted(e) == H]
    wv_dots = [e for e in dots if _contracted(e) == 8]
    self.assertLen(qk_dots, 1)  # one computing branch
    self.assertLen(wv_dots, 1)
    p = parse_precision(einsum_precision)
    for e in qk_dots:
      self.assertEqual([x.aval.dtype for x in e.invars], [c, c])
      self.assertEqual(e.outvars[0].aval.dtype, want["logits"])
      self.assertEqual(e.params["precision"], (p, p))
    for e in wv_dots:
      self.assertEqual([x.aval.dtype for x in e.invars], [want["probs"]] * 2)
      self.assertEqual(e.outvars[0].aval.dtype, jnp.float32)  # documented: f32 accumulator
      self.assertEqual(e.params["precision"], (p, p))
    block_exps = [e for e in exps if e.outvars[0].aval.ndim == 5]      # exp(logits - m)
    stat_exps = [e for e in exps if e.outvars[0].aval.ndim == 4]       # rescale factors
    self.assertLen(block_exps, 1)
    self.assertLen(stat_exps, 1)
    for e in block_exps:
      self.assertEqual(e.outvars[0].aval.dtype, want["softmax"])
    for e in stat_exps:
      self.assertEqual(e.outvars[0].aval.dtype, jnp.float32)  # statistics: always f32
    self.assertEqual(jax.eval_shape(fn, q, k, v).dtype, c)

  def test_blockwise_rejects_mixed_input_dtypes(self):
    """The chex stage check fires when q, k, v are not all in the compute dtype."""
    q, k, v = _qkv(4, 8, 2)
    with self.assertRaises(AssertionError):
      blockwise.blockwise_attention(q.astype(jnp.bfloat16), k, v)

  @parameterized.parameters("bfloat16", "float32")
  def test_jax_nn_xla_feeds_float32_into_both_dots(self, dtype):
    """jax_nn ('xla') honours the (T, T) column: f32 logits and f32 probabilities."""
    q, k, v = _qkv(6, 6, 2, jnp.dtype(dtype))
    dots, _ = _dots_and_exps(jax_nn.jax_nn_attention, q, k, v)
    self.assertEqual(sorted(_contracted(e) for e in dots), [6, H])  # wv (S=6), qk (H)
    for e in dots:
      self.assertEqual([x.aval.dtype for x in e.invars], [jnp.float32] * 2)
      self.assertEqual(e.outvars[0].aval.dtype, jnp.float32)
    self.assertEqual(jax_nn.jax_nn_attention(q, k, v).dtype, jnp.dtype(dtype))

  def test_bf16_blockwise_no_less_accurate_than_dot_product(self):
    """Flags off, bf16: blockwise's error vs float64 <= dot_product's (its statistics and
    accumulator are f32, as documented), on sharp causal attention at S=256."""
    q, k, v = _qkv(256, 256, 2, jnp.bfloat16, seed=3, logit_scale=4.0)
    q_pos, k_pos = _positions(256, 256)
    cmask = CausalMask(q_pos, k_pos)
    off = dict(flags=AttentionFlags(float32_qk_product=False, float32_logits=False))
    ref = contract.reference_attention_np(q, k, v, mask=cmask.dense())
    err = lambda out: float(np.abs(np.asarray(out, np.float64) - ref).max())
    err_bw = err(jax.jit(lambda *x: blockwise.blockwise_attention(
        *x, **blockwise.mask_kwargs(cmask), **off))(q, k, v))
    err_dp = err(_dot_product(q, k, v, mask=cmask.dense(), **off))
    self.assertLessEqual(err_bw, err_dp)


class JaxNnRefusesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("qk_off", dict(flags=AttentionFlags(float32_qk_product=False)),
       "float32_qk_product=False"),
      ("logits_off", dict(flags=AttentionFlags(float32_logits=False)), "float32_logits=False"),
      ("highest", dict(flags=AttentionFlags(einsum_precision="highest")),
       "einsum_precision='highest'"),
      ("preset", dict(flags=AttentionFlags(einsum_precision="BF16_BF16_F32")),
       "einsum_precision='BF16_BF16_F32'"),
      ("soft_cap", dict(logits_soft_cap=50.0), "logits_soft_cap=50.0"),
      ("cudnn_on_cpu", dict(implementation="cudnn"), "'cudnn' needs a GPU"),
  )
  def test_unsupported_settings_raise_user_error(self, kwargs, named):
    """The error names the bad value and the valid ones."""
    q, k, v = _qkv(4, 4, 2)
    with self.assertRaises(UserError) as ctx:
      jax_nn.jax_nn_attention(q, k, v, **kwargs)
    msg = str(ctx.exception)
    self.assertIn(named, msg)
    self.assertTrue("valid" in msg.lower() or "Valid" in msg)

  def test_precision_refuses_when_constructed(self):
    """Precision(kernel='jax_nn', float32_logits=False) fails at configuration time (the
    registry asks the kernel), before anything is traced."""
    with self.assertRaisesRegex(UserError, "float32_logits=False.*Valid float32_logits"):
      Precision(kernel="jax_nn", float32_logits=False)

  def test_attend_refuses_soft_cap(self):
    """The soft-cap comes from the model, not the Precision: attend asks the kernel."""
    q, k, v = _qkv(4, 4, 2)
    self.assertIsNotNone(kernels.refusal(Precision(kernel="jax_nn"), logits_soft_cap=5.0))
    with self.assertRaisesRegex(UserError, "logits_soft_cap=5.0.*valid: None"):
      kernels.attend(Precision(kernel="jax_nn"), q, k, v, logits_soft_cap=5.0)


class RegistryTest(parameterized.TestCase):

  def test_names(self):
    self.assertEqual(kernels.NAMES, ("dot_product", "blockwise", "jax_nn", "pallas", "flash",
                                     "splash"))
    for name, spec in kernels.REGISTRY.items():
      self.assertEqual(spec.name, name)

  @parameterized.parameters(*kernels.NAMES)
  def test_declared_scopes_hold_the_dots(self, kernel):
    """A kernel that declares qk/wv scopes has a dot_general in each (the audit reads
    them back); one that declares none has none of the contract's scopes."""
    spec = kernels.get(kernel)
    q, k, v = _qkv(4, 4, 2)
    # lowered for cpu on every machine: a Pallas kernel lowered for a TPU is one custom
    # call whose body holds the scopes no more (tests/test_tpu_fixtures.py reads it)
    text = jax.jit(lambda *x: kernels.attend(Precision(kernel=kernel), *x)).trace(
        q, k, v).lower(lowering_platforms=("cpu",)).as_text(debug_info=True)
    # Debug locations name each op by its scope path: '.../attn_qk/<einsum>/dot_general'.
    dot_scopes = set(re.findall(r'loc\("[^"]*?(\w+)/[A-Z]+,[A-Z]+->[A-Z]+/dot_general"', text))
    for scope in (spec.qk_scope, spec.wv_scope):
      if scope is not None:
        self.assertIn(scope, dot_scopes)
    if spec.qk_scope is None:
      self.assertFalse({contract.QK_SCOPE, contract.WV_SCOPE} & dot_scopes, dot_scopes)


  @parameterized.parameters(*kernels.NAMES)
  def test_every_kernel_runs_the_one_preamble(self, kernel):
    """Each kernel checks its inputs and reads the table through `contract.prepare`, once,
    with the phase's knobs as one value, and repeats none of it itself."""
    prec = Precision(dtype="bfloat16", kernel=kernel)
    seen = []
    real = contract.prepare

    def spy(*args, **kwargs):
      seen.append(args[3])   # the AttentionFlags
      return real(*args, **kwargs)

    q, k, v = _qkv(4, 4, 2, jnp.bfloat16)
    with mock.patch.object(contract, "prepare", spy):   # traced: the preamble runs once
      jax.eval_shape(lambda *x: kernels.attend(prec, *x), q, k, v)
    self.assertEqual(seen, [prec.attention])
    tree = ast.parse(inspect.getsource(sys.modules[kernels.get(kernel).attend.__module__]))
    called = {getattr(n.func, "attr", getattr(n.func, "id", None))
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    self.assertIn("prepare", called)
    self.assertFalse(called & {"check_heads", "stage_dtypes", "check_cache_operands",
                               "parse_precision", "scale_queries", "query_operand"})


# The kernels that take any positions (a cache, a decode step); 'splash' takes only a
# sequence's own positions and refuses the rest by name (tests/test_splash.py).
POSITIONED = tuple(n for n in kernels.NAMES if n != "splash")


class AutoTest(parameterized.TestCase):
  """`precision.kernel = 'auto'`: the platform's decode kernel for a decode step (one
  query), its long kernel from AUTO_MIN_QUERIES queries or AUTO_MIN_KEYS keys (blockwise
  where that one refuses the precision), else dot_product."""

  def test_resolve(self):
    m, n = kernels.AUTO_MIN_QUERIES, kernels.AUTO_MIN_KEYS
    self.assertEqual(kernels.resolve("auto", 2, 64), "dot_product")
    self.assertEqual(kernels.resolve("auto", m - 1, n - 1), "dot_product")
    self.assertEqual(kernels.resolve("auto", m, m), "blockwise")       # long prefill
    self.assertEqual(kernels.resolve("auto", 2, n), "blockwise")       # long cache
    self.assertEqual(kernels.resolve("auto", 1, 8), "blockwise")       # decode step
    self.assertEqual(kernels.resolve("auto", 1, n), "blockwise")
    self.assertEqual(kernels.resolve("jax_nn", 10 * m, 10 * n), "jax_nn")
    # a decode step runs the platform's choice (platforms.Platform.auto_decode): the dense
    # kernel on a TPU, where blockwise decode steps were measured slower; prefills do not
    # change with the platform
    self.assertEqual(kernels.resolve("auto", 1, n, "tpu"), "dot_product")
    self.assertEqual(kernels.resolve("auto", 1, n, "cpu"), "blockwise")
    # a long call runs the platform's long kernel (Platform.auto_long): flash on a TPU,
    # where it was measured 2.8-6x faster than the dense kernel (a quantized cache too:
    # flash reads its codes and scales); blockwise where flash would refuse the precision
    # (an einsum precision Mosaic does not take), blockwise on XLA:CPU
    self.assertEqual(kernels.resolve("auto", m, m, "tpu"), "flash")
    self.assertEqual(kernels.resolve("auto", 2, n, "tpu"), "flash")
    self.assertEqual(kernels.resolve("auto", m - 1, n - 1, "tpu"), "dot_product")
    both = dict(dtype="bfloat16", float32_qk_product=True, float32_logits=True)
    self.assertEqual(kernels.resolve("auto", m, m, "tpu", Precision(kernel="auto", **both)),
                     "flash")
    int8 = Precision(kernel="auto", **both, kv_cache_k_dtype="int8", kv_cache_k_scale="token")
    self.assertIsNone(kernels.REGISTRY["flash"].refusal(int8))
    self.assertEqual(kernels.resolve("auto", m, m, "tpu", int8), "flash")
    for refused in (dict(einsum_precision="high"),):
      prec = Precision(kernel="auto", **both, **refused)
      self.assertIsNotNone(kernels.REGISTRY["flash"].refusal(prec))
      self.assertEqual(kernels.resolve("auto", m, m, "tpu", prec), "blockwise")
      self.assertIsNone(kernels.refusal(prec))      # 'auto' itself refuses nothing
    self.assertEqual(kernels.resolve("auto", m, m, "cpu", Precision(kernel="auto", **both)),
                     "blockwise")
    from attnprec import platforms
    for p in platforms.TABLE.values():   # every choice a registered kernel, with its source
      self.assertIn(p.auto_decode, kernels.NAMES)
      self.assertIn(p.auto_long, kernels.NAMES)
      if p.auto_long != "blockwise":
        self.assertTrue(p.auto_long_source, p.name)
      self.assertIn(p.decode_write, cache_lib.WRITE_FORMS)
      self.assertIn(p.decode_write_codes, cache_lib.WRITE_FORMS)
      if "slices" in (p.decode_write, p.decode_write_codes):
        self.assertTrue(p.decode_write_source, p.name)
    with self.assertRaisesRegex(UserError, "'autox'.*valid.*'jax_nn', 'pallas', 'flash', 'splash', 'auto'"):
      kernels.resolve("autox", 1)
    with self.assertRaisesRegex(UserError, "'autox'.*'auto'"):
      Precision(kernel="autox")

  @parameterized.parameters((1, 64), (8, 272), (kernels.AUTO_MIN_QUERIES, 272),
                            (1, kernels.AUTO_MIN_KEYS), (2, 64))
  def test_runs_the_chosen_kernel_bit_for_bit(self, T, S):
    """attend('auto') is bitwise the output of the kernel `resolve` names (compared with
    that kernel run directly, bf16 with both flags, causal), close to float64 (bf16
    inputs given to both; tolerance: a few bf16 ulps of O(1) outputs), and its lowered
    program loops over blocks exactly when the choice is blockwise."""
    q, k, v = _qkv(T, S, 2, dtype=jnp.bfloat16)
    q_pos, k_pos = _positions(T, S)
    cmask = CausalMask(q_pos, k_pos)
    prec = dict(dtype="bfloat16", float32_qk_product=True, float32_logits=True)
    run = jax.jit(lambda p, *x: kernels.attend(p, *x, mask=cmask), static_argnums=0)
    out = run(Precision(kernel="auto", **prec), q, k, v)
    # the platform attend resolves for: the one this test runs on
    chosen = kernels.resolve("auto", T, S, Precision(kernel="auto", **prec).platform())
    want = run(Precision(kernel=chosen, **prec), q, k, v)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    ref = contract.reference_attention_np(q, k, v, mask=cmask.dense())
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=3e-2, rtol=3e-2)
    # The choice is visible in the program: only the blockwise kernel loops over blocks.
    text = run.lower(Precision(kernel="auto", **prec), q, k, v).as_text()
    self.assertEqual("stablehlo.while" in text, chosen == "blockwise")

  def test_blockwise_sizes_are_read_under_auto(self):
    from attnprec import ginutils
    from attnprec.precision import phase_precision
    gin.clear_config()
    try:
      ginutils.parse([], ["decode/precision.kernel = 'auto'",
                          "decode/blockwise.q_block = 64"], phases=("decode",))
      with ginutils.phase("decode"):
        self.assertEqual(phase_precision().block_sizes.q_block, 64)
    finally:
      gin.clear_config()


class WiringTest(parameterized.TestCase):

  @parameterized.parameters(*POSITIONED)
  def test_attend_with_causal_mask_matches_dot_product_and_float64(self, kernel):
    """attend(kernel, CausalMask) == attend('dot_product', same CausalMask) and == the
    float64 reference on the dense equivalent (every kernel that takes a decode step's
    positions)."""
    q, k, v = _qkv(1, 50, 2)
    q_pos, k_pos = _positions(1, 50, decode_pos=[10, 44])
    cmask = CausalMask(q_pos, k_pos, sliding_window=20)
    out, want = jax.jit(lambda *x: [kernels.attend(Precision(kernel=name), *x, mask=cmask)
                                    for name in (kernel, "dot_product")])(q, k, v)
    chex.assert_trees_all_close(out, want, atol=ATOL, rtol=RTOL)
    ref = contract.reference_attention_np(q, k, v, mask=cmask.dense())
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=ATOL, rtol=RTOL)

  def test_gin_selects_kernel_and_block_sizes(self):
    """`precision.kernel` and `blockwise.kv_block` bind through gin, into the Precision."""
    from attnprec.precision import phase_precision
    gin.parse_config("precision.kernel = 'blockwise'\nblockwise.kv_block = 4\n"
                     "blockwise.q_block = 2")
    prec = phase_precision()
    self.assertEqual(prec.kernel, "blockwise")
    self.assertEqual(prec.block_sizes, blockwise.BlockSizes(q_block=2, kv_block=4))
    q, k, v = _qkv(8, 8, 2)
    _, stats = jax.jit(functools.partial(blockwise.blockwise_attention,
                                         block_sizes=prec.block_sizes, return_stats=True))(
                                             q, k, v)
    self.assertEqual(stats["blocks_total"], 4 * 2)

  def test_block_sizes_are_static_data_in_the_jit_key(self):
    """Rebinding blockwise.* after a first call is honoured: the sizes travel in the
    Precision (a static jit argument), so a new value is a new program, and the kernel
    never reads gin while tracing (the old Precision keeps its program)."""
    from attnprec import ginutils
    from attnprec.precision import phase_precision
    q, k, v = _qkv(8, 8, 2)

    @functools.partial(jax.jit, static_argnames="precision")
    def blocks(q, k, v, *, precision):
      return blockwise.blockwise_attention(q, k, v, block_sizes=precision.block_sizes,
                                           return_stats=True)[1]["blocks_computed"]

    gin.parse_config("blockwise.q_block = 2\nblockwise.kv_block = 2")
    first = phase_precision()
    self.assertEqual(int(blocks(q, k, v, precision=first)), 16)
    gin.clear_config()
    gin.parse_config("blockwise.q_block = 4\nblockwise.kv_block = 8")
    second = phase_precision()
    self.assertNotEqual(first, second)
    self.assertEqual(int(blocks(q, k, v, precision=second)), 2)    # the new binding
    self.assertEqual(int(blocks(q, k, v, precision=first)), 16)    # no gin read at trace
    # A phase scope selects the sizes of its phase only.
    gin.clear_config()
    ginutils.parse([], ["decode/blockwise.kv_block = 2",
                        "decode/precision.kernel = 'blockwise'"])
    with ginutils.phase("decode"):
      self.assertEqual(phase_precision().block_sizes.kv_block, 2)
    with ginutils.phase("train"):
      self.assertEqual(phase_precision().block_sizes.kv_block, 256)

  def test_unknown_kernel_is_a_user_error(self):
    with self.assertRaisesRegex(UserError, "valid values are: 'dot_product', 'blockwise'"):
      Precision(kernel="flashy")

  def test_model_logits_match_across_kernels(self):
    """Decoder logits, blockwise vs dot_product: prefill into a cache, then one cached
    decode step; local and global layers, GQA, soft-cap."""
    from attnprec import model as model_lib
    from attnprec.cache import init_cache
    from attnprec.config import ModelConfig
    cfg = ModelConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_hidden=64, sliding_window=5,
                      layer_pattern=("local", "global"), attn_logit_soft_cap=20.0)
    params = jax.jit(model_lib.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    apply = model_lib.transformed(cfg).apply
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, 50)

    @functools.partial(jax.jit, static_argnums=0)    # prefill and step: one program
    def run(kernel, params, tokens):
      prec = Precision(kernel=kernel)
      out = apply(params, tokens, None, init_cache(cfg, 2, 32, jnp.float32), precision=prec)
      step = apply(params, tokens[:, :1], jnp.full((2, 1), 21), out.cache, precision=prec)
      return out.logits, step.logits

    chex.assert_trees_all_close(run("blockwise", params, tokens),
                                run("dot_product", params, tokens),
                                atol=tol(1e-4, MODEL_UNITS), rtol=tol(1e-4, MODEL_UNITS))


class ScaleTest(parameterized.TestCase):
  """The query scale goes where the contract table says, in every kernel: with the
  float32 QK product on the f32 logits, so on sharp bf16 input the output is at the bf16
  rounding floor (vs float64) for every head dim, also H = 128 whose 1/sqrt(H) is not a
  power of two. Scaling q in bf16 first (the old way) is 1.5x+ above the floor there."""

  S, N, SHARP = 128, 2, 8.0   # logit standard deviation ~ SHARP: sharp attention

  def _inputs(self, H):
    rng = np.random.default_rng(H)
    q, k, v = (rng.standard_normal((1, self.S, self.N, H)) for _ in range(3))
    q, k = q * self.SHARP ** 0.5, k * self.SHARP ** 0.5
    return [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]

  @staticmethod
  def _rel(out, ref):
    out = np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))

  @parameterized.product(kernel=kernels.NAMES, H=(64, 128, 256))
  def test_output_at_the_bf16_floor_with_both_flags(self, kernel, H):
    # Where float32 dots at DEFAULT do not multiply in float32 (a TPU: one bf16 pass) the
    # float32 probabilities are rounded to bf16 in the PV dot at DEFAULT (1.25-1.34x the
    # floor measured on a TPU v5e): the floor is reached there under 'highest'. jax_nn
    # takes no precision, so there it is held to the bound of that one more rounding, of
    # the same relative size as the output's own: twice the floor.
    # splash likewise (its dots take no precision); with head dim 128 its query scale
    # (not a power of two) cannot go where the table puts it: refused.
    einsum = "default" if exact_f32_dots() else "highest"
    bound = 1.05
    if kernel in ("jax_nn", "splash") and einsum != "default":
      einsum, bound = "default", 2.0
    q, k, v = self._inputs(H)
    pos = jnp.arange(self.S)[None]
    cmask = CausalMask(pos, pos, own_positions=True)
    if kernel == "splash" and H == 128:
      with self.assertRaisesRegex(UserError, "power of two"):
        kernels.attend(Precision(dtype="bfloat16", kernel=kernel), q, k, v, mask=cmask)
      return
    ref = contract.reference_attention_np(q, k, v, mask=np.asarray(cmask.dense()))  # f64
    floor = self._rel(jnp.asarray(ref, jnp.bfloat16), ref)   # rounding the exact output
    prec = Precision(dtype="bfloat16", kernel=kernel,        # both flags on (default)
                     einsum_precision=einsum)
    # The old way (q * scale rounded to bf16, then an unscaled product) for contrast;
    # both calls one program
    q_scaled = q * jnp.asarray(H ** -0.5, jnp.bfloat16)
    new, old = jax.jit(lambda q, q_scaled, k, v: (
        kernels.attend(prec, q, k, v, mask=cmask),
        kernels.attend(prec, q_scaled, k, v, mask=cmask, scale=1.0)))(q, q_scaled, k, v)
    err = self._rel(new, ref)
    self.assertLessEqual(err, bound * floor, (err, floor))
    old = self._rel(old, ref)
    if H == 128:
      self.assertGreater(old, 1.5 * floor, (old, floor))
    else:                      # 1/8 and 1/16 are powers of two: exact in bf16 either way
      self.assertLessEqual(old, bound * floor, (old, floor))

  @parameterized.parameters("dot_product", "blockwise")
  def test_flags_off_keep_the_scale_on_q_in_c(self, kernel):
    """With float32_qk_product off the table keeps the scale on q in c: the same program
    as scaling q first (bitwise)."""
    H = 128
    q, k, v = self._inputs(H)
    prec = Precision(dtype="bfloat16", kernel=kernel, float32_qk_product=False,
                     float32_logits=False)
    out, pre = jax.jit(lambda q, q_scaled, k, v: (          # both calls one program
        kernels.attend(prec, q, k, v), kernels.attend(prec, q_scaled, k, v, scale=1.0)))(
            q, q * jnp.asarray(H ** -0.5, jnp.bfloat16), k, v)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(pre, np.float32))

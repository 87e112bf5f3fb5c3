"""dot_product_attention against a float64 NumPy reference (`reference_attention_np`,
independent of JAX), for every flag combination, bf16 and fp32, with and without jit."""
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from attnprec import contract
from attnprec.kernels import dot_product
from attnprec.errors import UserError
from attnprec import platforms
from platform_bounds import local, tol

FLAGS = list(itertools.product([False, True], [False, True]))  # (qk, logits)


def _flags(qk, lg):
  return contract.AttentionFlags(float32_qk_product=qk, float32_logits=lg)


def _inputs(key, B=2, T=8, S=8, N=4, K=2, H=16, sharp=1.0, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(key), 3)
  q = jax.random.normal(kq, (B, T, N, H)) * sharp
  k = jax.random.normal(kk, (B, S, K, H)) * sharp
  v = jax.random.normal(kv, (B, S, K, H))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _ref(q, k, v, **kw):
  # The reference sees exactly the (possibly bf16-rounded) inputs the kernel sees.
  return contract.reference_attention_np(np.asarray(q, np.float64), np.asarray(k, np.float64),
                                          np.asarray(v, np.float64), **kw)


class AttentionVsFloat64(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(flags=FLAGS, kind=["plain", "causal", "window", "softcap", "mqa"])
  def test_fp32_matches_reference(self, flags, kind):
    qk, lg = flags
    q, k, v = _inputs(0, K=1 if kind == "mqa" else 2)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    mask = None
    cap = None
    if kind == "causal":
      mask = contract.causal_mask(pos, pos)
    if kind == "window":
      mask = contract.causal_mask(pos, pos, sliding_window=3)
    if kind == "softcap":
      cap = 2.0   # binds: logits of N(0, 1) inputs reach well past 2
    fn = self.variant(lambda q, k, v: dot_product.dot_product_attention(
        q, k, v, mask=mask, flags=_flags(qk, lg), logits_soft_cap=cap))
    out = fn(q, k, v)
    chex.assert_shape(out, q.shape)
    chex.assert_type(out, jnp.float32)
    ref = _ref(q, k, v, mask=None if mask is None else np.asarray(mask), logits_soft_cap=cap)
    # float32 end to end: only float32 rounding separates the two (on a TPU, whose f32
    # dots at DEFAULT take one bf16 pass, the bound of tests/platform_bounds.py).
    np.testing.assert_allclose(out, ref, atol=tol(2e-5), rtol=tol(1e-5))

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(flags=FLAGS)
  def test_bf16_within_rounding_of_reference(self, flags):
    qk, lg = flags
    q, k, v = _inputs(1, dtype=jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    mask = contract.causal_mask(pos, pos)
    out = self.variant(lambda q, k, v: dot_product.dot_product_attention(
        q, k, v, mask=mask, flags=_flags(qk, lg)))(q, k, v)
    chex.assert_type(out, jnp.bfloat16)
    ref = _ref(q, k, v, mask=np.asarray(mask))
    # bf16 has 8 significant bits (eps 2^-7 = 0.0078): soft attention on |v| ~ 1 stays
    # within a few bf16 steps of the exact answer.
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=0.06)

  def test_fully_masked_rows_give_no_nan(self):
    q, k, v = _inputs(2)
    mask = jnp.zeros((2, 1, 8, 8), bool)
    for dtype in (jnp.float32, jnp.bfloat16):
      for qk, lg in FLAGS:
        out = dot_product.dot_product_attention(q.astype(dtype), k.astype(dtype),
                                                v.astype(dtype), mask=mask,
                                                flags=_flags(qk, lg))
        chex.assert_tree_all_finite(out)


def _sharp_errors(S=256, seed=0):
  """Sharp attention (large logits) in bf16: max abs error vs float64 per flag combo."""
  B, N, H = 1, 4, 64
  rng = np.random.default_rng(seed)
  # Logits of magnitude ~20-30 where bf16 spacing is 0.125: softmax is very sensitive.
  q = rng.normal(size=(B, S, N, H)) * 2.4
  k = rng.normal(size=(B, S, N, H)) * 2.4
  v = rng.normal(size=(B, S, N, H))
  qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  pos = jnp.broadcast_to(jnp.arange(S), (B, S))
  mask = contract.causal_mask(pos, pos)
  ref = _ref(qb, kb, vb, mask=np.asarray(mask))
  errs = {}
  for qk, lg in FLAGS:
    out = jax.jit(lambda q, k, v, qk=qk, lg=lg: dot_product.dot_product_attention(
        q, k, v, mask=mask, flags=_flags(qk, lg)))(qb, kb, vb)
    errs[(qk, lg)] = float(np.abs(np.asarray(out, np.float64) - ref).max())
  return errs


def test_errors_order_as_the_contract_implies():
  """On sharp attention the fp32 QK product is far closer to float64 than all-bf16."""
  errs = _sharp_errors()
  all_bf16, qk_only, both = errs[(False, False)], errs[(True, False)], errs[(True, True)]
  assert qk_only < all_bf16 / 3, errs
  assert both < all_bf16 / 3, errs
  # float32 logits alone keep the bf16 rounding of the QK product: no better than 3x.
  assert errs[(False, True)] > both, errs


@pytest.mark.parametrize("n,k", [(4, 3), (6, 4)])
def test_heads_not_divisible_is_a_clear_error(n, k):
  q = jnp.zeros((1, 2, n, 8))
  kv = jnp.zeros((1, 2, k, 8))
  with pytest.raises(UserError, match=rf"N={n} is not a multiple of key/value heads K={k}"):
    dot_product.dot_product_attention(q, kv, kv)


def test_a_kernel_traced_for_a_platform_refuses_what_it_does_not_honour():
  """Traced for a TPU (`precision.target_backend`, as the audit and inspect do for
  --platform=tpu), every kernel refuses F32_F32_F32 before anything is lowered: a TPU has
  no such dot, and would run another."""
  from attnprec.precision import target_backend
  q, k, v = _inputs(3)
  flags = contract.AttentionFlags(einsum_precision="F32_F32_F32")
  with target_backend("tpu"):
    with pytest.raises(UserError, match="Platform 'tpu' cannot honour einsum_precision="
                                        "'F32_F32_F32'"):
      jax.jit(lambda *x: dot_product.dot_product_attention(*x, flags=flags)).trace(q, k, v)
  if local() == "cpu":                                   # XLA:CPU honours it
    assert dot_product.dot_product_attention(q, k, v, flags=flags).shape == q.shape


def test_invalid_precision_name_lists_valid_ones():
  q = jnp.zeros((1, 2, 2, 8))
  with pytest.raises(UserError, match="valid values are: 'default', 'high', 'highest'"):
    dot_product.dot_product_attention(q, q, q, flags=contract.AttentionFlags(
        einsum_precision="ultra"))


@pytest.mark.parametrize("name", ["DEFAULT", "High", "highest", "BF16_BF16_F32",
                                  "F32_F32_F32"])
def test_precision_names_accepted(name):
  """Every name the platform honours is taken; its float32 result is within the bound of
  the arithmetic it selects there (f32 on XLA:CPU for all; on a TPU DEFAULT and
  BF16_BF16_F32 one bf16 pass, 'high' 3 passes, 'highest' 6). A name the platform does
  not honour (F32_F32_F32 on a TPU) is refused by the kernel itself, naming it."""
  q, k, v = _inputs(3)
  if platforms.refusal(local(), name):
    with pytest.raises(UserError, match=f"cannot honour einsum_precision={name!r}"):
      dot_product.dot_product_attention(
          q, k, v, flags=contract.AttentionFlags(einsum_precision=name))
    return
  out = dot_product.dot_product_attention(
      q, k, v, flags=contract.AttentionFlags(einsum_precision=name))
  np.testing.assert_allclose(out, _ref(q, k, v), atol=tol(2e-5, precision=name))

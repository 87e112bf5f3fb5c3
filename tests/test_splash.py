"""The 'splash' kernel: jax's splash attention behind the contract (attnprec/kernels/splash.py).

On CPU splash runs interpreted (the same body as on a TPU, its dots in float32), so here
it is held to the float64 reference and to `dot_product` under the same flags; on a TPU
(`make test-tpu`) the same tests run its Mosaic kernel, within the platform's bound
(`platform_bounds.tol`). What it cannot honour is refused by name before anything runs.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import contract, kernels
from attnprec.config import ModelConfig
from attnprec.contract import AttentionFlags, CausalMask
from attnprec.errors import UserError
from attnprec.kernels import dot_product, splash
from attnprec.precision import Precision
from platform_bounds import assert_gradients_match, tol

B, N, H = 2, 4, 16           # scale 1/4: a power of two, exact in bf16
BF16 = jnp.bfloat16


def _qkv(T, S, K, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, H))
  k, v = rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, H))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _own(T, window=None):
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  return CausalMask(pos, pos, sliding_window=window, own_positions=True)


@pytest.mark.parametrize("T,K,window,cap", [(37, 2, None, 5.0), (300, 1, 40, None)])
def test_forward_and_gradients_match_float64_and_dot_product(T, K, window, cap):
  """fp32, a sequence attending to itself (padded to splash's blocks; GQA and MQA; a
  soft-cap; a sliding window over 3 blocks): the output == float64 and the gradients of
  output . w == jax.grad through dot_product (within blockwise's bound, scaled by the
  largest value)."""
  q, k, v = _qkv(T, T, K)
  mask = _own(T, window)
  f = lambda q, k, v: splash.splash_attention(q, k, v, mask=mask, logits_soft_cap=cap)  # noqa: E731
  d = lambda q, k, v: dot_product.dot_product_attention(  # noqa: E731
      q, k, v, mask=mask.dense(), logits_soft_cap=cap)
  out = jax.jit(f)(q, k, v)
  ref = contract.reference_attention_np(q, k, v, mask=mask.dense(), logits_soft_cap=cap)
  bound = tol(2e-5, scale=np.abs(ref).max())
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=bound, rtol=bound)
  assert_gradients_match(f, d, (q, k, v), jnp.cos(jnp.arange(H, dtype=jnp.float32)))


def test_no_mask_hides_the_padded_keys():
  """No mask, 50 queries over 150 keys (both padded to 256): every real key seen, no
  padded one (float64 reference, fp32)."""
  q, k, v = _qkv(50, 150, 2)
  out = jax.jit(splash.splash_attention)(q, k, v)
  ref = contract.reference_attention_np(q, k, v)
  bound = tol(2e-5, scale=np.abs(ref).max())
  np.testing.assert_allclose(np.asarray(out, np.float64), ref, atol=bound, rtol=bound)


def test_bf16_with_both_flags_is_dot_product_s_error():
  """bf16 with both flags (the one setting it honours): its error against float64 is
  dot_product's under the same flags, within 1.05x (both take bf16 q, k, v into
  float32 logits and softmax)."""
  T = 160
  q, k, v = _qkv(T, T, 2, BF16, seed=3)
  mask = _own(T)
  ref = contract.reference_attention_np(q, k, v, mask=mask.dense())
  err = lambda out: float(np.abs(np.asarray(out, np.float64) - ref).max())  # noqa: E731
  prec = Precision(dtype="bfloat16", kernel="splash")
  got = jax.jit(lambda *x: kernels.attend(prec, *x, mask=mask))(q, k, v)
  want = jax.jit(lambda *x: dot_product.dot_product_attention(*x, mask=mask.dense()))(
      q, k, v)
  assert err(got) <= 1.05 * err(want) + 2 ** -9, (err(got), err(want))


def test_what_it_cannot_honour_is_refused_by_name():
  """bf16 logits, 'highest', a quantized cache: refused when the Precision is made; a
  query scale that is not a power of two in bf16, a cache's positions, a dense mask:
  refused at trace, before anything runs; each naming the value and the valid ones."""
  for kw, needle in ((dict(float32_qk_product=False), "float32_qk_product=False.*Valid"),
                     (dict(float32_logits=False), "float32_logits=False"),
                     (dict(einsum_precision="highest"), "einsum_precision='highest'"),
                     (dict(kv_cache_k_dtype="int8", kv_cache_k_scale="token"),
                      "quantized KV cache.*'compute', 'float32', 'bfloat16'")):
    with pytest.raises(UserError, match=needle):
      Precision(dtype="bfloat16", kernel="splash", **kw)
  prec = Precision(dtype="bfloat16", kernel="splash")
  rng = np.random.default_rng(0)
  q128 = jnp.asarray(rng.normal(size=(B, 8, 2, 128)), BF16)
  traced = lambda f, *x: jax.eval_shape(f, *x)  # noqa: E731  (refused while tracing)
  with pytest.raises(UserError, match=r"query scale 0\.0883.*head dim 128.*power of two"):
    traced(lambda *x: kernels.attend(prec, *x), q128, q128, q128)
  # float32: the table scales q itself, so any scale runs
  f32 = jax.jit(lambda *x: kernels.attend(Precision(kernel="splash"), *x))(
      *(q128.astype(jnp.float32),) * 3)
  assert f32.shape == q128.shape
  q, k, v = _qkv(1, 40, 2, BF16)
  k_pos = jnp.broadcast_to(jnp.arange(40, dtype=jnp.int32), (B, 40))
  decode = CausalMask(jnp.asarray([[10], [30]], jnp.int32), k_pos)
  with pytest.raises(UserError, match="positions other than the sequence's own.*'flash'"):
    traced(lambda *x: kernels.attend(prec, *x, mask=decode), q, k, v)
  with pytest.raises(UserError, match="a dense mask"):
    traced(lambda *x: kernels.attend(prec, *x, mask=decode.dense()), q, k, v)


def test_the_model_trains_with_it_as_with_dot_product():
  """A tiny model's loss and gradients with kernel='splash' (the train phase: no cache,
  the sequence's own positions) == with dot_product, float32 (within blockwise's bound);
  with a cache (prefill into it) the model's mask is refused by name."""
  from attnprec import train
  from attnprec.model import init_params
  config = ModelConfig(vocab_size=40, d_model=32, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, mlp_hidden=64, max_seq_len=64)
  params = jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 25)), jnp.int32)
  mask = jnp.ones(tokens.shape, jnp.float32)

  def loss_and_grad(kernel):
    f = lambda p: train.loss_fn(p, tokens, mask, config=config,  # noqa: E731
                                precision=Precision(kernel=kernel))[0]
    return jax.jit(jax.value_and_grad(f))(params)

  (l_s, g_s), (l_d, g_d) = loss_and_grad("splash"), loss_and_grad("dot_product")
  np.testing.assert_allclose(float(l_s), float(l_d), rtol=tol(1e-5))
  for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_d)):
    bound = tol(2e-5, scale=float(jnp.abs(b).max()))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=bound, rtol=bound)
  from attnprec import decoding
  with pytest.raises(UserError, match="positions other than the sequence's own"):
    jax.eval_shape(lambda p: decoding.prefill(   # refused while tracing
        p, tokens, jnp.full((2,), 25, jnp.int32), config=config,
        precision=Precision(kernel="splash"), cache_length=32), params)


def test_the_audit_reads_its_bodies():
  """`make audit` with train/precision.kernel = 'splash', bf16: its dots sit in no named
  scope, so the audit attributes them by their place in splash's bodies (forward: qk,
  wv; dq and dk/dv: the recomputed qk, then gradient dots) and holds them to the table
  (forward) and the backward row: every body passes. The same forward body held to the
  flags-off row fails at the logits, and a body of another shape is not attributed by
  guess: both name the stage or the body."""
  from attnprec import audit
  from attnprec.inspect import pallas_check
  config = ModelConfig(vocab_size=13, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                       head_dim=16, mlp_hidden=32, max_seq_len=64)
  prec = Precision(dtype="bfloat16", kernel="splash")
  result = audit.run_audit(config, prec, Precision(dtype="bfloat16"), compile=False,
                           prompt_len=2, new_tokens=1, platform="cpu")
  assert result["ok"], result["problems"]
  bodies = result["phases"]["train"]["pallas"]["bodies"]
  # each body twice: the interpreted (cpu) and the Mosaic (tpu) branch of the call
  assert sorted(b["kernel"].split("_")[2] for b in bodies) == [
      "dkv", "dkv", "dq", "dq", "fwd", "fwd"], bodies
  q = jnp.ones((1, 128, 4, 16), BF16)
  k = jnp.ones((1, 128, 2, 16), BF16)
  jaxpr = jax.make_jaxpr(lambda q, k, v: splash.splash_attention(q, k, v, mask=_own(128)))(
      q, k, k)
  eqn, mosaic_branch = pallas_check.kernel_bodies(jaxpr)
  assert eqn.params["interpret"] != mosaic_branch.params["interpret"]
  off = AttentionFlags(float32_qk_product=False, float32_logits=False)
  problems = pallas_check.check_body(pallas_check.read_body(eqn), BF16, off)
  assert any(p.startswith("qk accumulation (stage 'logits')") for p in problems), problems
  body = pallas_check.read_body(eqn)
  body.dots.pop()
  assert pallas_check.check_body(body, BF16, AttentionFlags()) == [
      "splash body splash_mha_fwd_no_residuals: 1 dots, expected 2-2 (its dots are "
      "attributed by place, as read from jax 0.10.2's splash source)"]

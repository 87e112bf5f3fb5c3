"""attnprec.inspect on programs it knows nothing about: every attention is found by its
structure (no names), its stage types are read from the lowered program, and the verdict
follows the contract table.

What the expected values are compared against: the types each function's own code asks
for (written next to each case), the contract table (`stage_dtypes`), and, for
attnprec's kernels, `make audit`'s verdict on the same programs.
"""
import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

from attnprec import audit, decoding, kernels
from attnprec.config import ModelConfig
from attnprec.inspect import attention_report, examples, inspect_lowered
from attnprec.precision import Precision

BF16, F32 = jnp.bfloat16, jnp.float32
B, T, N, H = 2, 8, 4, 16
CONFIG = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=32, max_seq_len=64)


def _qkv(dtype=BF16, t=T, s=T):
  q = jax.ShapeDtypeStruct((B, t, N, H), dtype)
  kv = jax.ShapeDtypeStruct((B, s, N, H), dtype)
  return q, kv, kv


def plain_attention(q, k, v, precision=None):
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=precision)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, axis=-1), v,
                    precision=precision)


def seed_attention(q, k, v):
  """f32 QK product, then cast down to bf16: the softmax runs in bf16 (the seed's bug)."""
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=F32)
  probs = jax.nn.softmax(logits.astype(BF16), axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", probs, v)


# ----------------------------------------------------------------------------- other code
def test_jax_nn_dot_product_attention_xla():
  """jax.nn's xla path (jax/_src/nn/functions.py, _dot_product_attention_core): for bf16
  inputs the QK einsum asks for the BF16_BF16_F32 dot algorithm and an f32 result, the
  scale multiplies the f32 logits, mask and softmax run in f32, and the probabilities are
  cast back to bf16 before a DEFAULT wv dot."""
  r = attention_report(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla"), *_qkv())
  (a,) = r.attentions
  assert (a.qk.lhs, a.qk.rhs, a.qk.result) == ("bf16", "bf16", "f32")
  assert "accumulation_type = f32" in a.qk.algorithm and a.wv.algorithm is None
  assert a.softmax["exp"] == "f32" and a.stabilised and not a.online
  assert a.probs_casts == ["f32->bf16"] and "select" in a.mask and a.logits_scale
  assert (a.wv.lhs, a.wv.rhs) == ("bf16", "bf16") and not a.downcasts
  # against the bf16 contract with both flags on: the probabilities must enter as f32,
  # and no single einsum_precision describes both dots
  r = attention_report(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, implementation="xla"), *_qkv(), expect=Precision(dtype="bfloat16"))
  problems = r.problems()
  assert any("probabilities must enter as f32" in p for p in problems), problems
  assert any("qk: precision algorithm <" in p and "expected DEFAULT" in p
             for p in problems), problems
  assert not any("logits are" in p or "softmax:" in p for p in problems), problems


def test_haiku_multi_head_attention():
  """hk.MultiHeadAttention: bf16 logits and softmax (it has no precision argument), its
  four projections listed as dense dots under its module names."""
  args, kwargs = examples.haiku_mha_inputs()
  r = attention_report(examples.haiku_mha, *args, **kwargs)
  (a,) = r.attentions
  assert a.label == "multi_head_attention"
  assert (a.qk.result, a.softmax["exp"], a.wv.lhs) == ("bf16", "bf16", "bf16")
  assert a.mask == ["select"] and not a.soft_cap
  names = sorted(d.name.split("/")[-2] for d in r.dense)
  assert names == ["key", "linear", "query", "value"], names
  ok = attention_report(examples.haiku_mha, *args,
                        expect=Precision(dtype="bfloat16", float32_qk_product=False,
                                         float32_logits=False))
  assert ok.ok, ok.problems()
  bad = attention_report(examples.haiku_mha, *args, expect=Precision(dtype="bfloat16"))
  assert any("QK^T logits are bf16, expected f32" in p for p in bad.problems())
  assert any("softmax runs in bf16, expected f32" in p for p in bad.problems())


def test_maxtext_style_upcast_and_dropped_precision():
  """q and k upcast with astype(float32) before the einsum; a local softmax (the wv dot
  reads the unnormalised exps, the sum divides its output); `precision` never reaches
  the einsums. The types pass the f32 contract; the dropped HIGHEST is caught."""
  args, _ = examples.maxtext_inputs()
  r = attention_report(examples.maxtext_attention, *args,
                       expect=Precision(dtype="bfloat16", einsum_precision="highest"))
  (a,) = r.attentions
  assert (a.qk.lhs, a.qk.lhs_source, a.qk.result) == ("f32", "bf16", "f32")
  assert a.online and a.softmax["exp"] == "f32"
  problems = r.problems()
  assert problems and all("precision DEFAULT, expected HIGHEST" in p for p in problems)
  assert attention_report(examples.maxtext_attention, *args,
                          expect=Precision(dtype="bfloat16")).ok


def test_downcast_before_softmax_is_flagged():
  r = attention_report(seed_attention, *_qkv())
  (a,) = r.attentions
  assert a.downcasts == ["f32->bf16"] and a.qk.result == "f32"
  assert a.softmax["exp"] == "bf16" and a.softmax["max"] == "bf16"
  assert not r.ok and "cast down" in r.verdict()          # flagged with no Precision
  assert "**f32->bf16**" in r.attention_table()
  strict = attention_report(seed_attention, *_qkv(), expect=Precision(dtype="bfloat16"))
  assert any("logits cast down (f32->bf16)" in p for p in strict.problems())
  assert any("softmax runs in bf16, expected f32" in p for p in strict.problems())
  # the same function without the cast: nothing flagged
  clean = attention_report(lambda q, k, v: plain_attention(q, k, v), *_qkv(F32))
  assert clean.ok and not clean.attentions[0].downcasts


def test_softmax_as_exp_of_log_softmax():
  """p = exp(log_softmax(x)): normalised by subtracting log(sum(exp)), no divide."""
  def lse_attention(q, k, v):
    logits = jnp.einsum("btnh,bsnh->bnts", q, k)
    probs = jnp.exp(jax.nn.log_softmax(logits, axis=-1))
    return jnp.einsum("bnts,bsnh->btnh", probs, v)
  (a,) = attention_report(lse_attention, *_qkv(F32)).attentions
  assert a.stabilised and not a.online and a.softmax["exp"] == "f32"


def test_dropout_on_the_probabilities():
  """Dropout (Flax style: probs * keep / keep_prob) between the softmax and the wv dot:
  found in the forward pass and in the gradient, whose dv dot reads the dropped probs."""
  def dropped(q, k, v, key):
    probs = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=-1)
    keep = jax.random.bernoulli(key, 0.9, probs.shape)
    probs = probs * (keep.astype(probs.dtype) / 0.9)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)
  key = jax.random.PRNGKey(0)
  (a,) = attention_report(dropped, *_qkv(F32), key).attentions
  assert any("dropout" in c for c in a.probs_casts)
  grad = jax.grad(lambda q, k, v: jnp.sum(jnp.square(dropped(q, k, v, key))),
                  argnums=(0, 1, 2))
  r = attention_report(grad, *_qkv(F32))
  (a,) = r.attentions
  assert sorted(b.role for b in a.backward) == ["dk", "dp", "dq", "dv"] and not r.dense


def test_two_attentions_both_found():
  def two(q, k, v):
    return seed_attention(q, k, v) + plain_attention(q, k, v).astype(BF16)
  r = attention_report(two, *_qkv())
  assert len(r.attentions) == 2
  assert sorted(bool(a.downcasts) for a in r.attentions) == [False, True]
  assert len({a.qk.source for a in r.attentions}) == 2


def test_forward_and_grad():
  """A train step's gradient: each backward dot is attributed to its attention (dq reads
  k, dk reads q, dp reads v, dv reads the probabilities) and keeps the precision."""
  def loss(q, k, v):
    out = plain_attention(q, k, v, precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(jnp.square(out.astype(F32)))
  r = attention_report(jax.grad(loss, argnums=(0, 1, 2)), *_qkv(F32),
                       expect=Precision(einsum_precision="highest"))
  (a,) = r.attentions
  assert sorted(b.role for b in a.backward) == ["dk", "dp", "dq", "dv"]
  assert all(b.precision == "HIGHEST" for b in a.backward) and r.ok, r.problems()
  assert not r.dense
  # the gradient dots are checked for precision too
  r = attention_report(jax.grad(loss, argnums=(0, 1, 2)), *_qkv(F32),
                       expect=Precision(einsum_precision="default"))
  assert any("backward: dq: precision HIGHEST, expected DEFAULT" in p for p in r.problems())


def test_grad_with_remat():
  """jax.checkpoint: the backward pass recomputes the QK dot (through an
  optimization_barrier); it is told apart from dq and dk."""
  def loss(q, k, v):
    return jnp.sum(jnp.square(jax.checkpoint(plain_attention)(q, k, v)))
  (a,) = attention_report(jax.grad(loss, argnums=(0, 1, 2)), *_qkv(F32)).attentions
  assert sorted(b.role for b in a.backward) == ["dk", "dp", "dq", "dv", "qk (recomputed)"]


def test_soft_cap_in_attnprecs_kernels():
  for name in ("dot_product", "blockwise"):
    prec = Precision(dtype="bfloat16", kernel=name)
    (a,) = attention_report(lambda q, k, v: kernels.attend(
        prec, q, k, v, logits_soft_cap=30.0), *_qkv()).attentions
    assert a.soft_cap and a.softmax["exp"] == "f32", name


def test_prefill_and_decode_with_a_kv_cache():
  """A KV cache written with dynamic_update_slice; a prefill over P tokens and a
  single-token decode step at position `pos` are both recognised."""
  S = 16

  def attend_cached(q, k_new, v_new, cache_k, cache_v, pos):
    cache_k = jax.lax.dynamic_update_slice(cache_k, k_new, (0, pos, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v_new, (0, pos, 0, 0))
    t = q.shape[1]
    logits = jnp.einsum("btnh,bsnh->bnts", q, cache_k, preferred_element_type=F32)
    visible = jnp.arange(S)[None, :] <= pos + jnp.arange(t)[:, None]
    logits = jnp.where(visible, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bnts,bsnh->btnh", probs, cache_v.astype(F32))
    return out.astype(q.dtype), cache_k, cache_v

  cache = jax.ShapeDtypeStruct((B, S, N, H), BF16)
  pos = jax.ShapeDtypeStruct((), jnp.int32)
  for t in (T, 1):
    q, kv, _ = _qkv(t=t, s=t)
    r = attention_report(attend_cached, q, kv, kv, cache, cache, pos,
                         expect=Precision(dtype="bfloat16"))
    (a,) = r.attentions
    assert a.qk.rhs_shape == [B, S, N, H] and a.qk.lhs_shape == [B, t, N, H]
    assert "select" in a.mask and r.ok, r.problems()


def test_no_attention_in_an_mlp_with_a_log_softmax_loss():
  """A dot -> log_softmax -> loss -> gradient dot is not an attention."""
  def loss(w1, w2, x, y):
    logits = jnp.tanh(x @ w1) @ w2
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
  s = jax.ShapeDtypeStruct
  r = attention_report(jax.grad(loss, argnums=(0, 1)), s((8, 16), F32), s((16, 10), F32),
                       s((4, 8), F32), s((4,), jnp.int32))
  assert r.attentions == [] and len(r.dense) >= 4
  assert r.verdict().startswith("NO ATTENTION FOUND") and r.ok
  # with a Precision stated, finding nothing is not a pass
  assert not attention_report(jax.grad(loss, argnums=(0, 1)), s((8, 16), F32),
                              s((16, 10), F32), s((4, 8), F32), s((4,), jnp.int32),
                              expect=Precision()).ok


def test_flax_nnx_multi_head_attention_if_installed():
  """Flax is optional (not a dependency): nnx.MultiHeadAttention when it is importable.
  Its `precision` reaches the four projections; the attention itself is delegated to
  jax.nn.dot_product_attention, which takes no precision (as read in flax 0.12.8):
  the report must show both."""
  nnx = pytest.importorskip("flax.nnx")
  mha = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32, decode=False,
                               rngs=nnx.Rngs(0), dtype=BF16,
                               precision=jax.lax.Precision.HIGHEST)
  graphdef, state = nnx.split(mha)

  def apply(state, x):
    return nnx.merge(graphdef, state)(x)
  r = attention_report(apply, state, jax.ShapeDtypeStruct((2, 8, 32), BF16),
                       expect=Precision(dtype="bfloat16", einsum_precision="highest",
                                        matmul_precision="highest"))
  (a,) = r.attentions
  assert len(r.dense) == 4 and all(d.precision == "HIGHEST" for d in r.dense)
  assert a.wv.precision != "HIGHEST" or a.qk.precision != "HIGHEST"
  assert any("precision" in p and "expected HIGHEST" in p for p in r.problems())


# ----------------------------------------------------------------------------- attnprec
KERNEL_CASES = [("dot_product", (True, True)), ("dot_product", (False, False)),
                ("dot_product", (True, False)), ("blockwise", (False, True)),
                ("blockwise", (True, True)), ("jax_nn", (True, True))]


def test_kernel_cases_cover_the_registry():
  # 'pallas' has no gradient, so no train step to lower: tests/test_pallas.py audits it;
  # 'flash' is one Pallas call per pass, audited from its bodies: tests/test_flash.py;
  # 'splash' (jax's library kernel, no named scopes) is audited from its bodies by the
  # place of each dot: tests/test_splash.py.
  assert {k for k, _ in KERNEL_CASES} == set(kernels.NAMES) - {"pallas", "flash", "splash"}


@pytest.mark.parametrize("kernel,flags", KERNEL_CASES)
def test_attnprecs_kernels_agree_with_the_audit(kernel, flags):
  """attnprec's own programs (train step, prefill, decode step): one attention per layer,
  the table's stage types, and the same verdict as `make audit` (which reads the same
  report), also against a Precision the program does not honour."""
  qk, lg = flags
  prec = Precision(dtype="bfloat16", kernel=kernel, float32_qk_product=qk,
                   float32_logits=lg)
  want = audit.expected_attention(prec)
  programs = audit.lower_programs(CONFIG, prec, prec)
  for phase, (served, lowered) in programs.items():
    # the precision each program runs (decode: `decoding.for_serving`'s, weights carried)
    assert served == (prec if phase == "train" else decoding.serving_precision(prec, "cpu"))
    other = dataclasses.replace(served, float32_qk_product=not qk,
                                **({"kernel": "dot_product"} if kernel == "jax_nn" else {}))
    r = inspect_lowered(lowered, expect=served)
    assert sorted(a.layer for a in r.attentions) == [0, 1], phase
    for a in r.attentions:
      assert a.label == f"decoder/layer_{a.layer}/attn/kernel"
      assert a.softmax["exp"] == want["softmax"], (phase, a.softmax)
      assert a.online == (kernel == "blockwise") and a.loop == (kernel == "blockwise")
      assert not a.downcasts
      if phase == "train":
        assert sorted(b.role for b in a.backward) == ["dk", "dp", "dq", "dv"]
    assert r.ok, (phase, r.problems())
    assert not inspect_lowered(lowered, expect=other).ok
    audited = audit.audit_program(phase, lowered, served, CONFIG, compile=False)
    assert audited["ok"] == r.ok
    assert audit.audit_program(phase, lowered, other, CONFIG, compile=False)["ok"] is False


def test_attnprec_blockwise_kernel_alone_in_its_scan():
  """The blockwise kernel called directly (no model around it): the online softmax inside
  the nested scan / cond bodies is found, its statistics are f32."""
  from attnprec.contract import AttentionFlags
  from attnprec.kernels.blockwise import blockwise_attention
  r = attention_report(lambda q, k, v: blockwise_attention(
      q, k, v, causal=True, q_block=4, kv_block=4,
      flags=AttentionFlags(float32_qk_product=False, float32_logits=False)), *_qkv())
  (a,) = r.attentions
  assert a.online and a.loop and a.qk.result == "bf16" and a.softmax["exp"] == "bf16"
  assert a.softmax["sum"] == "f32"


@pytest.mark.parametrize("dtype,code", [
    ("i8", True), ("ui8", True), ("si4", True), ("f8E4M3FN", True), ("f8E5M2", True),
    ("s8", True), ("u8", True), ("s4", True), ("f8e4m3fn", True), ("f4e2m1fn", True),
    ("i1", False), ("i32", False), ("s32", False), ("f16", False), ("bf16", False),
    ("f32", False), ("pred", False)])
def test_is_code_reads_mlir_and_hlo_spellings(dtype, code):
  """One `is_code` for the lowered program's (MLIR) and the compiled program's (HLO text)
  element types: the quantized cache's codes are found the same way in both."""
  from attnprec.inspect import compiled, finder
  assert finder.is_code(dtype) is code
  assert compiled.is_code is finder.is_code

"""Each attention stage has the dtype the contract table says, and a deliberate violation
trips the chex assertion."""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

from attnprec import contract
from attnprec.errors import UserError
from attnprec.kernels import dot_product
from attnprec.precision import Precision

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
FLAGS = contract.AttentionFlags

# The contract table (docs/contract.md), written out independently.
TABLE = {
    # (qk, logits): (logits stage, softmax stage, probs stage)
    (False, False): (BF16, BF16, BF16),
    (False, True): (BF16, F32, F32),
    (True, False): (F32, F32, F32),
    (True, True): (F32, F32, F32),
}


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=2)))
def test_stage_dtypes_table(flags):
  qk, lg = flags
  got = contract.stage_dtypes(jnp.bfloat16, FLAGS(float32_qk_product=qk, float32_logits=lg))
  assert (got["logits"], got["softmax"], got["probs"]) == TABLE[flags]
  assert got["qkv"] == got["output"] == BF16
  assert got["scale"] == (F32 if qk else BF16)   # on the f32 logits, else on q in c
  # In float32 compute every stage is float32 whatever the flags.
  f32 = contract.stage_dtypes(jnp.float32, FLAGS(float32_qk_product=qk, float32_logits=lg))
  assert set(f32.values()) == {F32}


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=2)))
def test_observed_stage_dtypes(flags, monkeypatch):
  """Records the dtypes the kernel actually produces at the qk einsum and the softmax."""
  qk, lg = flags
  seen = {}
  real_einsum, real_softmax = jnp.einsum, jax.nn.softmax

  def spy_einsum(spec, *args, **kw):
    out = real_einsum(spec, *args, **kw)
    seen.setdefault("einsum", []).append((spec, [a.dtype for a in args], out.dtype))
    return out

  def spy_softmax(x, **kw):
    seen["softmax_in"] = x.dtype
    return real_softmax(x, **kw)

  monkeypatch.setattr(dot_product.jnp, "einsum", spy_einsum)
  monkeypatch.setattr(dot_product.jax.nn, "softmax", spy_softmax)
  x = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
  out = dot_product.dot_product_attention(
      x, x, x, flags=FLAGS(float32_qk_product=qk, float32_logits=lg))
  logits_dt, softmax_dt, probs_dt = TABLE[flags]
  (qk_spec, qk_in, qk_out), (wv_spec, wv_in, wv_out) = seen["einsum"]
  assert qk_in == [BF16, BF16]          # operands stay bf16; f32 comes from accumulation
  assert qk_out == logits_dt
  assert seen["softmax_in"] == softmax_dt
  assert wv_in[0] == probs_dt
  assert out.dtype == BF16


def test_violation_trips_chex(monkeypatch):
  """A softmax that silently returns bf16 while float32_logits is set must be caught."""
  real_softmax = jax.nn.softmax
  monkeypatch.setattr(dot_product.jax.nn, "softmax",
                      lambda x, **kw: real_softmax(x, **kw).astype(jnp.bfloat16))
  x = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
  with pytest.raises(AssertionError, match="bfloat16"):
    dot_product.dot_product_attention(
        x, x, x, flags=FLAGS(float32_qk_product=False, float32_logits=True))
  # ... and under jit too (chex checks run at trace time).
  with pytest.raises(AssertionError):
    jax.jit(lambda a: dot_product.dot_product_attention(
        a, a, a, flags=FLAGS(float32_qk_product=False, float32_logits=True)))(x)


def test_qk_product_not_upcast_is_caught(monkeypatch):
  """An einsum that ignores preferred_element_type (the seed's 'flag has no effect' bug)."""
  real_einsum = jnp.einsum

  def lossy(spec, *args, preferred_element_type=None, **kw):
    return real_einsum(spec, *args, **kw)

  monkeypatch.setattr(dot_product.jnp, "einsum", lossy)
  x = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
  with pytest.raises(AssertionError):
    dot_product.dot_product_attention(
        x, x, x, flags=FLAGS(float32_qk_product=True, float32_logits=True))


def _scale_muls(fn, *args):
  """(dtype, shape) of every multiplication by a scalar constant in fn's jaxpr."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "mul":
        found.append((eqn.outvars[0].aval.dtype, eqn.outvars[0].aval.shape))
      for param in eqn.params.values():
        for sub in (param if isinstance(param, (tuple, list)) else (param,)):
          if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)
          elif hasattr(sub, "eqns"):
            walk(sub)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=2)))
def test_query_scale_is_applied_where_the_table_says(flags):
  """qk=F: q * scale in bf16 (q's shape) before the dot; qk=T: logits * scale in f32
  (the logits' shape) after it, and q enters the dot unscaled."""
  qk, lg = flags
  x = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
  muls = _scale_muls(lambda a: dot_product.dot_product_attention(
      a, a, a, flags=FLAGS(float32_qk_product=qk, float32_logits=lg)), x)
  on_q = [m for m in muls if m == (BF16, (1, 4, 2, 8))]
  on_logits = [m for m in muls if m == (F32, (1, 2, 1, 4, 4))]   # [B, K, G, T, S]
  assert (len(on_q), len(on_logits)) == ((0, 1) if qk else (1, 0)), muls


def test_precision_hands_every_knob_over_as_one_value():
  """Precision has a field for each knob of `AttentionFlags`, with its default, and
  `Precision.attention` carries them all (hashable: it is a static jit argument)."""
  defaults = {f.name: f.default for f in dataclasses.fields(Precision)}
  for f in dataclasses.fields(FLAGS):
    assert defaults[f.name] == f.default, f.name
  prec = Precision(dtype="bfloat16", float32_qk_product=False, einsum_precision="highest")
  want = FLAGS(float32_qk_product=False, float32_logits=True, einsum_precision="highest")
  assert prec.attention == want and hash(prec.attention) == hash(want)
  assert prec.attention != FLAGS()
  for name, value in want.settings().items():
    if name == "key_offset":   # named on the precision line only when one is in force
      assert value == "none" and "key_offset" not in prec.describe()
      continue
    assert f" {name}={value} " in prec.describe()


@pytest.mark.parametrize("knob,value,valid", [
    ("float32_qk_product", 1, "True, False"), ("float32_logits", "yes", "True, False"),
    ("einsum_precision", "ultra", "'default', 'high', 'highest'"),
    ("key_offset", "mean", "'none', 'zero', 'bias', 'prefill_mean'")])
def test_attention_flags_refuse_bad_values(knob, value, valid):
  with pytest.raises(UserError, match=f"Invalid {knob} .*valid values are: {valid}"):
    FLAGS(**{knob: value})

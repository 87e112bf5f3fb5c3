"""The attention's QK dot in the float32 form (`Precision.float32_qk_operands`): where the
projection form in force is 'float32_dot' (a CPU without bf16 dots under 'auto'), the
blockwise and dense kernels run a float32 QK product of a 16-bit compute dtype on q and k
cast exactly to float32, instead of the bf16 x bf16 -> float32 dot XLA:CPU runs slowly
there. Compared here against the c x c -> float32 dot (the same exact products and the
same float32 accumulation: only the summation order may differ) and against a float64
reference computed from the same bf16 values; the lowered programs' dot operand types; the
precision line; the refusals; the audit.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import audit, contract, cpu_features
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.kernels.blockwise import blockwise_attention
from attnprec.kernels.dot_product import dot_product_attention
from attnprec.precision import Precision, target_backend

FLAGS = contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
B, N, K, H = 2, 4, 2, 16


def _causal(T, S):
  return (jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T))[None, None]


KERNELS = {
    "blockwise": lambda q, k, v, **kw: blockwise_attention(
        q, k, v, causal=True, q_block=16, kv_block=16, **kw),
    "dot_product": lambda q, k, v, **kw: dot_product_attention(
        q, k, v, mask=_causal(q.shape[1], k.shape[1]), **kw),
}


def _inputs(T, S, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(2 * rng.standard_normal((B, n, m, H)), jnp.bfloat16)
               for n, m in ((T, N), (S, K), (S, K)))


def _float64_reference(q, k, v):
  """Causal GQA attention of the same bf16 values, every step in float64."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  T, S = q.shape[1], k.shape[1]
  G = N // K
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) * H ** -0.5
  logits = np.where(np.asarray(_causal(T, S)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", p, v)


def _bf16_spacing(x):
  """One bf16 ulp at |x| (the output's last place)."""
  return 2.0 ** (np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126))) - 7)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("T,S", [(48, 48), (1, 40)], ids=["prefill", "decode"])
def test_the_float32_form_is_the_bf16_dot_up_to_summation_order(kernel, T, S):
  """Both forms' bf16 outputs are the float64 reference rounded, within one bf16 ulp, and
  differ from each other by at most one ulp (a float32 sum in another order can move a
  rounding); an output-wide mismatch (a wrong operand, a lost rounding) would not."""
  q, k, v = _inputs(T, S)
  fn = KERNELS[kernel]
  bf16_dot = np.asarray(jax.jit(lambda *a: fn(*a, flags=FLAGS))(q, k, v), np.float64)
  f32_dot = np.asarray(jax.jit(lambda *a: fn(*a, flags=FLAGS, float32_qk_operands=True))(
      q, k, v), np.float64)
  ref = _float64_reference(q, k, v)
  for out in (bf16_dot, f32_dot):
    assert (np.abs(out - ref) <= _bf16_spacing(ref)).all()
  assert (np.abs(f32_dot - bf16_dot) <= _bf16_spacing(np.maximum(np.abs(f32_dot),
                                                                 np.abs(bf16_dot)))).all()


def _dot_operand_types(lowered_text):
  return re.findall(r"stablehlo\.dot_general.*: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)",
                    lowered_text)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("T,S", [(48, 48), (1, 40)], ids=["prefill", "decode"])
def test_the_float32_form_lowers_no_bf16_dot(kernel, T, S):
  """With both flags the PV dot is float32 already; the float32 form makes the QK dot one
  too, so the lowered kernel holds no bf16 x bf16 dot, where the other form holds one.
  (Asked for directly, a decode step's QK dot takes the form too; `Precision` does not ask
  for it there.)"""
  q, k, v = _inputs(T, S)
  fn = KERNELS[kernel]
  types = {form: _dot_operand_types(jax.jit(lambda *a, f=form: fn(
      *a, flags=FLAGS, float32_qk_operands=f)).lower(q, k, v).as_text())
      for form in (False, True)}
  assert ("bf16", "bf16") in types[False]
  assert types[True] and set(types[True]) == {("f32", "f32")}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_the_float32_form_is_refused_where_it_would_change_a_stage(kernel):
  q, k, v = _inputs(16, 16)
  fn = KERNELS[kernel]
  off = contract.AttentionFlags(float32_qk_product=False, float32_logits=True)
  with pytest.raises(UserError, match="float32_qk_product=False"):
    fn(q, k, v, flags=off, float32_qk_operands=True)
  with pytest.raises(UserError, match="16-bit compute dtype"):
    fn(*(x.astype(jnp.float32) for x in (q, k, v)), flags=FLAGS, float32_qk_operands=True)
  preset = contract.AttentionFlags(float32_qk_product=True, float32_logits=True,
                                   einsum_precision="BF16_BF16_F32")
  with pytest.raises(UserError, match="preset"):
    fn(q, k, v, flags=preset, float32_qk_operands=True)


SAFE_BF16 = dict(dtype="bfloat16", float32_qk_product=True, float32_logits=True)


@pytest.mark.parametrize("kwargs,backend,features,want", [
    (SAFE_BF16, "cpu", (), True),
    (SAFE_BF16, "cpu", ("avx512_bf16",), False),        # the bf16 dot is the fast one
    (SAFE_BF16, "tpu", (), False),                      # 'auto' resolves for the target
    ({**SAFE_BF16, "projection_form": "float32_dot"}, "cpu", ("avx512_bf16",), True),
    # off the CPU a float32 dot at DEFAULT may multiply in fewer bits than c holds (one
    # bf16 pass on tpu, TF32 on cuda): a forced float32_dot leaves the QK dot alone there
    ({**SAFE_BF16, "projection_form": "float32_dot"}, "tpu", (), False),
    ({**SAFE_BF16, "dtype": "float16", "projection_form": "float32_dot"}, "cuda", (), False),
    ({**SAFE_BF16, "dtype": "float16"}, "cpu", (), True),
    ({**SAFE_BF16, "projection_form": "compute_dtype_dot"}, "cpu", (), False),
    (dict(dtype="bfloat16"), "cpu", (), True),          # the default flags are the safe ones
    ({**SAFE_BF16, "float32_qk_product": False}, "cpu", (), False),
    ({**SAFE_BF16, "kernel": "blockwise"}, "cpu", (), True),
    ({**SAFE_BF16, "kernel": "dot_product"}, "cpu", (), True),
    ({**SAFE_BF16, "kernel": "jax_nn"}, "cpu", (), False),
    ({**SAFE_BF16, "kernel": "pallas"}, "cpu", (), False),
    ({**SAFE_BF16, "kv_cache_k_dtype": "int8"}, "cpu", (), False),
    ({**SAFE_BF16, "kv_cache_v_dtype": "int8"}, "cpu", (), True),   # keys are values of c
    ({**SAFE_BF16, "kv_cache_k_dtype": "float32"}, "cpu", (), True),
    ({**SAFE_BF16, "einsum_precision": "BF16_BF16_F32"}, "cpu", (), False),
    ({**SAFE_BF16, "matmul_precision": "BF16_BF16_F32"}, "cpu", (), False),
    (dict(float32_qk_product=True), "cpu", (), False),  # float32 compute
])
def test_where_the_form_is_in_force_and_the_precision_line_says_so(monkeypatch, kwargs,
                                                                   backend, features, want):
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: features)
  prec = Precision(**kwargs)
  assert prec.float32_qk_operands(backend) is want
  assert prec.float32_qk_operands(backend, num_queries=64) is want
  # a decode step (or a one-token prefill) keeps the c x c -> float32 dot
  assert prec.float32_qk_operands(backend, num_queries=1) is False
  assert ("qk_dot=float32_dot(queries>1)" in prec.describe(backend)) is want
  with target_backend(backend):
    assert ("qk_dot=float32_dot(queries>1)" in prec.describe()) is want


def test_a_report_lowered_for_another_platform_states_that_platforms_forms(monkeypatch):
  """On a CPU without bf16 dots, a program lowered for tpu runs bf16 dots: the expected
  line `attnprec.inspect` (and the audit) print resolves 'auto' for tpu, not for here."""
  from attnprec.inspect.report import Report
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: ())
  prec = Precision(**SAFE_BF16)
  here = Report(function="f", findings=None, expect=prec, platform="cpu")._expected_line()
  tpu = Report(function="f", findings=None, expect=prec, platform="tpu")._expected_line()
  assert "qk_dot=float32_dot" in here and "auto:float32_dot(" in here
  assert "qk_dot" not in tpu and "auto:by_rows(tpu)" in tpu


@pytest.mark.parametrize("kernel", ["dot_product", "blockwise"])
def test_the_audit_passes_the_float32_form_and_reads_its_qk_operands(monkeypatch, kernel):
  """The contract allows a float32 QK product's operands upcast from c; the audit reads
  them through the converts ('f32<-bf16') in the train step and the prefill, lowered and
  compiled, for each kernel that takes the form; the decode step's QK dot stays
  bf16 x bf16 -> float32."""
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: ())
  config = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_hidden=32, max_seq_len=64)
  prec = Precision(**SAFE_BF16, kernel=kernel)
  assert prec.float32_qk_operands()
  result = audit.run_audit(config, prec, prec)
  assert result["ok"], result["problems"]
  for phase in audit.PHASES:
    qk = [r for r in result["phases"][phase]["attention"]
          if not r["backward"] and r["site"] == "qk"]
    assert len(qk) == config.num_layers
    upcast = [("f32<-bf16" in r["lhs"]) and ("f32<-bf16" in r["rhs"]) for r in qk]
    assert all(upcast) if phase != "decode" else not any(upcast), (phase, qk)

"""The seed's bug, made impossible: for every flag combination, the lowered train step,
prefill and single-token decode step carry the attention flags.

On CPU `precision` changes no numbers (DEFAULT and HIGHEST are bitwise equal), so this is
checked in the lowered StableHLO (read by `attnprec.inspect`, which finds the attentions by
their structure): the qk dot's result type is f32 exactly when `float32_qk_product` is set,
and `einsum_precision` appears on both attention dots.
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import pytest

from attnprec import decoding, train
from attnprec.cache import init_cache
from attnprec.config import ModelConfig
from attnprec.inspect import inspect_lowered
from attnprec.model import init_params
from attnprec.precision import Precision

CONFIG = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=32, sliding_window=3,
                     layer_pattern=("local", "global"))
PARAMS = init_params(CONFIG, jax.random.PRNGKey(0))


def lower_phases(precision):
  """{phase: lowered program} for the train step, the prefill and one decode step."""
  tokens = jnp.zeros((2, 6), jnp.int32)
  lengths = jnp.array([6, 4], jnp.int32)
  optimizer = train.make_optimizer(total_steps=10)
  state = train.init_state(CONFIG, optimizer, 0)
  lowered = {"train": train.make_update(CONFIG, precision, optimizer).lower(
      state, tokens, jnp.ones((2, 6)))}
  prefill = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=precision,
                                      cache_length=8))
  lowered["prefill"] = prefill.lower(PARAMS, tokens, lengths)
  dstate = decoding.DecodeState(init_cache(CONFIG, 2, 8, precision.compute_dtype),
                                jnp.zeros((2, CONFIG.vocab_size)), lengths)
  step = jax.jit(functools.partial(decoding.decode_step, config=CONFIG, precision=precision))
  lowered["decode"] = step.lower(PARAMS, dstate, jnp.zeros((2,), jnp.int32))
  return lowered


def attention_dots(lowered):
  """The forward qk and wv dots of every attention, as (role, DotSite)."""
  return [(role, dot) for a in inspect_lowered(lowered).attentions
          for role, dot in (("qk", a.qk), ("wv", a.wv))]


CASES = [("bfloat16", qk, lg, ep) for qk, lg in itertools.product([False, True], repeat=2)
         for ep in ("default", "highest")] + [("float32", False, False, "high"),
                                              ("float32", True, True, "default")]


@pytest.mark.parametrize("dtype,qk,logits,einsum_precision", CASES)
def test_flags_reach_every_phase(dtype, qk, logits, einsum_precision):
  prec = Precision(dtype=dtype, float32_qk_product=qk, float32_logits=logits,
                   einsum_precision=einsum_precision)
  c = {"bfloat16": "bf16", "float32": "f32"}[dtype]
  for phase, lowered in lower_phases(prec).items():
    dots = attention_dots(lowered)
    qk_dots = [d for role, d in dots if role == "qk"]
    wv_dots = [d for role, d in dots if role == "wv"]
    assert len(qk_dots) == len(wv_dots) == CONFIG.num_layers, (phase, dots)
    # on a CPU without bf16 dots a prefill's / train step's float32 QK product takes q and
    # k cast exactly to float32 (`Precision.float32_qk_operands`; decode steps keep c)
    upcast = phase != "decode" and prec.float32_qk_operands()
    for d in qk_dots:
      if upcast:
        assert (d.lhs, d.rhs, d.lhs_source, d.rhs_source) == ("f32", "f32", c, c), (phase, d)
      else:
        assert (d.lhs, d.rhs) == (c, c), (phase, d)
      assert d.result == ("f32" if qk else c), (phase, d)
    for d in wv_dots:
      assert d.result == ("f32" if (qk or logits) else c), (phase, d)
    for _, d in dots:
      assert d.precision == einsum_precision.upper(), (phase, d)


def test_algorithm_preset_reaches_both_dots_in_decode():
  prec = Precision(dtype="bfloat16", einsum_precision="BF16_BF16_F32")
  for phase, lowered in lower_phases(prec).items():
    dots = attention_dots(lowered)
    assert dots and all(d.algorithm and "accumulation_type = f32" in d.algorithm
                        for _, d in dots), (phase, dots)


def test_dense_layers_get_matmul_precision_not_einsum_precision():
  prec = Precision(matmul_precision="highest", einsum_precision="default")
  lowered = lower_phases(prec)["decode"]
  dense = inspect_lowered(lowered).dense
  assert len(dense) == 7 * CONFIG.num_layers + 1
  assert all(d.precision == "HIGHEST" for d in dense)
  assert all(d.precision == "DEFAULT" for _, d in attention_dots(lowered))


def test_train_only_flags_would_be_caught():
  """A model that applied the flags only in training (the seed's bug) fails this check:
  the decode-phase program lowered with flags-off differs from the flags-on one."""
  on = attention_dots(lower_phases(Precision(dtype="bfloat16"))["decode"])
  off = attention_dots(lower_phases(Precision(dtype="bfloat16", float32_qk_product=False,
                                              float32_logits=False))["decode"])
  assert {d.result for role, d in on if role == "qk"} == {"f32"}
  assert {d.result for role, d in off if role == "qk"} == {"bf16"}

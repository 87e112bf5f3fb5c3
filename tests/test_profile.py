"""The prefill profile (`attnprec.bench.profile`): the HLO reader and the stage attribution
on a tiny model's compiled prefill, and one traced run (its times are not checked: speed
is measured in `make bench`, never in a test)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import decoding
from attnprec.bench import profile
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import Precision
from test_train_utils import numpy_params  # noqa: E402

CONFIG = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_hidden=64, max_seq_len=512, qkv_bias=True)


# the profiled runs' model (`run_profile`)
TINY = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   head_dim=8, mlp_hidden=16, max_seq_len=256)


def _params(config, seed=0):
  """`test_train_utils.numpy_params`, as jax arrays."""
  return jax.tree_util.tree_map(jnp.asarray, numpy_params(config, seed))


def _compiled(kernel, T=64, key_offset="none"):
  params = _params(CONFIG)
  prec = Precision(dtype="bfloat16", kernel=kernel, key_offset=key_offset)
  fn = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=prec,
                                 cache_length=T + 8))
  tokens, lengths = jnp.zeros((1, T), jnp.int32), jnp.full((1,), T, jnp.int32)
  return fn.lower(params, tokens, lengths).compile(), (params, tokens, lengths)


def test_parse_hlo_reads_opcodes_names_calls_and_operands():
  text = """HloModule m

%fused (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/x/attn/q/dot_general"}
}

ENTRY %main (a: f32[4,4]) -> (f32[4,4], s32[]) {
  %a = f32[4,4]{1,0} parameter(0)
  %f = f32[4,4]{1,0} fusion(%a, %a), kind=kCustom, calls=%fused
  %c = s32[] constant(0)
  ROOT %t = (f32[4,4]{1,0}, s32[]) tuple(%f, %c)
}
"""
  instrs, comps = profile.parse_hlo(text)
  assert set(comps) == {"fused", "main"}
  assert instrs["f"].opcode == "fusion" and instrs["f"].calls == ("fused",)
  assert instrs["f"].operands == ("a", "a")
  assert instrs["t"].opcode == "tuple" and instrs["t"].operands == ("f", "c")
  assert instrs["dot.1"].op_name == "jit(f)/x/attn/q/dot_general"
  assert profile.stage_of("f", instrs, comps) == "projections q, k, v, o"
  assert profile.stage_of("c", instrs, comps) == "copies / converts"


def test_a_fused_weight_cast_is_a_convert_not_the_stage_it_is_named_after():
  """XLA:CPU wraps a float32 weight's cast to bf16 at its use in a fusion named after the
  projection (mlp/up/convert_element_type): its time is a convert's, never 'MLP
  activation'; a fusion that computes (the activation's multiply) keeps its stage."""
  text = """HloModule m

%wrapped (p0: f32[4,4]) -> bf16[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %cv = bf16[4,4]{1,0} convert(%p0), metadata={op_name="jit(f)/decoder/layer_0/mlp/up/convert_element_type"}
}

%act (p0: f32[4,4], p1: f32[4,4]) -> bf16[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  %m = f32[4,4]{1,0} multiply(%p0, %p1), metadata={op_name="jit(f)/decoder/layer_0/mlp/mul"}
  ROOT %cv = bf16[4,4]{1,0} convert(%m)
}

ENTRY %main (a: f32[4,4]) -> (bf16[4,4], bf16[4,4]) {
  %a = f32[4,4]{1,0} parameter(0)
  %w = bf16[4,4]{1,0} fusion(%a), kind=kLoop, calls=%wrapped
  %x = bf16[4,4]{1,0} fusion(%a, %a), kind=kLoop, calls=%act
  ROOT %t = (bf16[4,4]{1,0}, bf16[4,4]{1,0}) tuple(%w, %x)
}
"""
  instrs, comps = profile.parse_hlo(text)
  assert profile.stage_of("w", instrs, comps) == "copies / converts"
  assert profile.stage_of("x", instrs, comps) == "MLP activation"


def test_a_constant_shared_with_the_kernel_does_not_make_the_mlp_activation_softmax():
  """XLA shares one constant 1.0 among its uses: the silu's fusion of a bf16 MLP holds
  the attention kernel's (op name .../attn/kernel/div), and its exponential is the
  silu's; its time is the MLP activation's (it was filed under the softmax, 223 ms of a
  bf16 prefill at 8 x 250 on SmolLM2's shapes)."""
  text = """HloModule m

%act (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %one = f32[] constant(1), metadata={op_name="jit(f)/decoder/layer_0/attn/kernel/div"}
  %b = f32[4,4]{1,0} broadcast(%one), dimensions={}, metadata={op_name="jit(f)/decoder/layer_0/mlp/jit(silu)"}
  %e = f32[4,4]{1,0} exponential(%p0), metadata={op_name="jit(f)/decoder/layer_0/mlp/jit(silu)/exp"}
  ROOT %a = f32[4,4]{1,0} add(%e, %b), metadata={op_name="jit(f)/decoder/layer_0/mlp/jit(silu)/add"}
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  ROOT %x = f32[4,4]{1,0} fusion(%a), kind=kLoop, calls=%act
}
"""
  instrs, comps = profile.parse_hlo(text)
  assert profile.stage_of("x", instrs, comps) == "MLP activation"


def test_every_dot_of_a_dense_prefill_gets_its_stage():
  """The dense kernel's QK and PV dots (which XLA:CPU may rewrite without metadata) are
  found from the data flow; every dot of the model is in a named stage, none in 'other'
  (with the key offset: its float32 key projection is still a projection)."""
  compiled, _ = _compiled("dot_product", key_offset="bias")
  instrs, comps = profile.parse_hlo(compiled.as_text())
  users = profile.users_of(instrs)
  fused = {c for i in instrs.values() if i.opcode == "fusion" for c in i.calls}
  stages = {}   # what runs as a thunk: instructions outside fused computations
  for comp, names in comps.items():
    for name in names:
      if comp not in fused and any(i.opcode in profile.DOTS
                                   for i in profile._inner(name, instrs, comps)):
        stages[name] = profile.stage_of(name, instrs, comps, users)
  counts = {s: list(stages.values()).count(s) for s in set(stages.values())}
  L = CONFIG.num_layers
  assert counts.get("projections q, k, v, o") == 4 * L, counts
  assert counts.get("MLP projections") == 3 * L, counts
  assert counts.get("attention QK dot") == L and counts.get("attention PV dot") == L, counts
  assert "other dots" not in counts, counts


def test_profile_program_covers_the_prefill(tmp_path):
  compiled, args = _compiled("blockwise", T=64)
  row = profile.profile_program(compiled, lambda: compiled(*args), rounds=1)
  assert set(row["stages"]) == set(profile.STAGES)
  assert row["thunks_ms"] > 0 and row["wall_ms"] > 0 and not row["unattributed"]
  assert row["stages"]["projections q, k, v, o"] > 0
  result = dict(config=dict(cpu="x", cpu_count=2, jax="0", xla_flags="", rounds=1),
                rows=[dict(row, model="tiny", batch=1, prompt=64, preset="bf16")])
  text = profile.to_markdown(result)
  assert "| attention QK dot |" in text and "tiny 1x64 bf16" in text
  png = profile.plot(result, str(tmp_path / "profile.png"))
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_run_profile_calls_the_prefill_with_the_params_it_was_compiled_for(monkeypatch):
  """A prefill of >= 128 rows on a CPU with bf16 dots reads the blocks' matrices stored in
  bf16 (`decoding.prefill_params`): the profile must call the compiled prefill with those
  (the carried float32 ones are refused by the compiled program), as `make bench` does."""
  import types

  from attnprec import cpu_features
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: ("avx512_bf16",))
  tiny = types.SimpleNamespace(config=TINY, params=_params(TINY))
  result = profile.run_profile(models=("tiny",), cases=((1, 160),),
                               presets=("bf16_flags", "bf16_flags_carried_prefill"),
                               phases=("prefill", "decode"), rounds=1, progress=False,
                               load=lambda name: tiny)
  rows = {(r["preset"], r["phase"]): r for r in result["rows"]}
  assert set(rows) == {(p, ph) for p in ("bf16_flags", "bf16_flags_carried_prefill")
                       for ph in ("prefill", "decode")}
  for (_, phase), r in rows.items():
    assert r["thunks_ms"] > 0 and r["stages"]["attention QK dot"] > 0
    assert not r["unattributed"]
    assert phase == "decode" or r["stages"]["MLP projections"] > 0
  text = profile.to_markdown(result)
  assert "tiny 1x160 bf16_flags, decode step" in text and "PARTIAL" not in text
  # a run stopped before its last row (what on_row wrote so far) says so
  partial = dict(result, rows=result["rows"][:1])
  partial.pop("complete")
  assert "PARTIAL: the run stopped before its last row" in profile.to_markdown(partial)
  for bad in (("step",), ()):
    with pytest.raises(UserError, match="non-empty list of \\['prefill', 'decode'\\]"):
      profile.run_profile(models=("tiny",), phases=bad, load=lambda name: tiny)


@pytest.mark.parametrize("phases", [("prefill",), ("decode",)])
def test_a_broken_model_is_not_profiled(phases):
  """A model whose logits are NaN has no profile worth reading: the case is refused by
  name before anything is traced (it produced a clean-looking table before). The case is
  the previous test's (its programs, through the compilation cache)."""
  import types
  params = jax.tree_util.tree_map(lambda w: w * np.nan, _params(TINY))
  with pytest.raises(UserError, match="The logits of the prefill of bench case profile "
                                      "tiny 1x160 bf16_flags were not finite"):
    profile.run_profile(models=("tiny",), cases=((1, 160),), presets=("bf16_flags",),
                        rounds=1, phases=phases, progress=False,
                        load=lambda m: types.SimpleNamespace(config=TINY, params=params))

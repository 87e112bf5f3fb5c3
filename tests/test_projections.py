"""The dense projections' form (`layers.project`): the same numbers as the forms it
replaced, up to float32 summation order, and the dot types the backend compiles.

A 16-bit projection of MIN_ROWS_C_DOT rows or more is a bf16 x bf16 dot with a float32
result rounded once; below that, on float32-held weights, a float32 dot on the weights'
bf16 values (the float32-carried form of `decoding.for_serving`). Both form exact
products of bf16 values and accumulate them in float32.
"""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import cpu_features, decoding, layers
from attnprec.errors import UserError
from attnprec.inspect import compiled
from attnprec import model as model_lib
from attnprec.bench import projections as forms
from attnprec.cache import init_cache
from attnprec.config import ModelConfig
from attnprec.model import init_params
from attnprec.precision import Precision
from attnprec.inspect.report import compiled_text  # noqa: E402

BF16_FLAGS = Precision(dtype="bfloat16", float32_qk_product=True, float32_logits=True)
CONFIG = ModelConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_hidden=128, max_seq_len=64)


def _bf16_values(a):
  return jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def _ulps(a, b):
  """Distance in bf16 units in the last place (same-sign values)."""
  bits = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16)).view(np.uint16).astype(np.int64)
  return np.abs(bits(a) - bits(b))


@pytest.mark.parametrize("M,K,N", [(16, 576, 384), (64, 384, 128), (4, 64, 96)])
def test_bf16_projection_is_one_rounding_of_a_float32_accumulation(M, K, N):
  """bf16 x bf16 -> float32, rounded once: the float32 result is within float32
  accumulation error of the float64 product of the same bf16 values (measured: at most
  6.2e-8 x sum|x||w| at K = 1536, either form; asserted 2^-22 ~ 2.4e-7), the bf16 result
  is that float32 result rounded, and it is within 1 bf16 ulp of the float32-carried
  form's (different summation order can cross a rounding boundary: measured bitwise equal
  at 99.98% of outputs)."""
  rng = np.random.default_rng(M)
  x_MxK = jnp.asarray(rng.standard_normal((M, K)), jnp.float32).astype(jnp.bfloat16)
  w_KxN = _bf16_values(rng.standard_normal((K, N)) / np.sqrt(K))
  project = functools.partial(layers.project, spec="mk,kn->mn", precision=None,
                              carrier=True)
  y32 = np.asarray(project(x_MxK, w_KxN, out_dtype=jnp.float32))
  y16 = project(x_MxK, w_KxN)
  assert y16.dtype == jnp.bfloat16
  x64, w64 = np.asarray(x_MxK, np.float64), np.asarray(w_KxN, np.float64)
  err = np.abs(y32 - x64 @ w64) / (np.abs(x64) @ np.abs(w64))
  assert err.max() <= 2.0 ** -22, err.max()
  np.testing.assert_array_equal(np.asarray(y16), np.asarray(jnp.asarray(y32, jnp.bfloat16)))
  carried = forms._fixed_project("carried")(x_MxK, w_KxN, "mk,kn->mn", precision=None,
                                            carrier=True)
  assert _ulps(y16, carried).max() <= 1


def test_few_rows_are_the_float32_carried_dot_bit_for_bit():
  """Below MIN_ROWS_C_DOT rows (a decode step at batch 1) on float32-held weights the
  projection IS the float32-carried form (XLA:CPU's bf16 matrix-vector path is slow)."""
  rng = np.random.default_rng(0)
  w = _bf16_values(rng.standard_normal((64, 96)) / 8)
  for rows in (1, 2, 3, 8, layers.MIN_ROWS_C_DOT - 1):
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32).astype(jnp.bfloat16)
    for out in (None, jnp.float32):
      new = layers.project(x, w, "mk,kn->mn", precision=None, carrier=True, out_dtype=out)
      old = forms._fixed_project("carried")(x, w, "mk,kn->mn", precision=None, carrier=True,
                                            out_dtype=out)
      np.testing.assert_array_equal(np.asarray(new), np.asarray(old))


# init_params as one program (op by op, its ~150 small programs were compiled again after
# each jax.clear_caches of the `bf16_cpu` fixture)
_init = jax.jit(init_params, static_argnums=0)


@functools.partial(jax.jit, static_argnames="runs")
def _logits(params, tokens_BxT, runs):
  """The logits of each (form, precision) in `runs`, each call traced under its form,
  as one program (one compile, shared by every seed: `runs` is its static key)."""
  apply = model_lib.transformed(CONFIG).apply
  out = []
  for form, precision in runs:
    with forms.projection_form(form):
      out.append(apply(params, tokens_BxT, precision=precision).logits)
  return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tiny_model_logits_before_and_after(seed):
  """Whole-model logits (2 layers, bf16 + both attention flags, 2 x 64 tokens) of the
  bf16 x bf16 -> float32 form against the float32-carried form it replaced. Both
  accumulate exact products in float32, in different orders; where that moves an
  activation across a bf16 rounding boundary (1 bf16 ulp, 2^-8 relative), the change
  propagates. Measured, seeds 0-3: max abs 2.4e-7 / 9.8e-3 / 4.8e-7 / 4.9e-3 on logits of
  magnitude <= 3.6; 0 / 1.6% / 0 / 0.8% of positions differ by more than 1e-5; argmax
  identical everywhere. Asserted: max abs <= 0.03, <= 5% of positions beyond 1e-5 (float32
  order elsewhere), every argmax equal. float32 compute is bit-for-bit unchanged."""
  params = _init(CONFIG, jax.random.PRNGKey(seed))
  params, carried = decoding.for_serving(params, BF16_FLAGS, backend="cpu")
  assert carried.carrier_weights
  tokens = jax.random.randint(jax.random.PRNGKey(seed + 10), (2, 64), 0, CONFIG.vocab_size)
  assert tokens.size >= layers.MIN_ROWS_C_DOT       # the bf16 x bf16 -> f32 form runs
  fp32 = Precision()
  after, before, fp32_current, fp32_c_result = (np.asarray(x) for x in _logits(
      params, tokens, (("current", carried), ("carried", carried), ("current", fp32),
                       ("c_result", fp32))))
  diff = np.abs(after - before)
  assert diff.max() <= 0.03, diff.max()
  assert np.mean(diff.max(-1) > 1e-5) <= 0.05
  np.testing.assert_array_equal(after.argmax(-1), before.argmax(-1))
  np.testing.assert_array_equal(fp32_current, fp32_c_result)


def _dense_dots(compiled_text):
  return [d for d in compiled.compiled_summary(compiled_text)["dots"] if d.site == "dense"]


@pytest.fixture
def bf16_cpu(monkeypatch):
  """'auto' as on a CPU with avx512_bf16, whatever this machine has."""
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: ("avx512_bf16",))
  jax.clear_caches()
  yield
  jax.clear_caches()


def test_compiled_dense_dots_are_bf16_x_bf16_to_f32(bf16_cpu):
  """What XLA:CPU compiled for a bf16 prefill (2 x 64 = 128 rows): every dense dot of
  the q/k/v/o projections and the MLP takes bf16 x bf16 operands and returns f32 (the fast
  path); a decode step (1 row) on the float32-carried weights runs f32 x f32."""
  params = jax.eval_shape(lambda: init_params(CONFIG, jax.random.PRNGKey(0)))
  prec = decoding.serving_precision(BF16_FLAGS, backend="cpu")
  prefill = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=prec,
                                      cache_length=64))
  tokens = jax.ShapeDtypeStruct((2, 64), jnp.int32)
  assert 2 * 64 >= layers.MIN_ROWS_C_DOT
  lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
  text = compiled_text(prefill.lower(params, tokens, lengths))
  dots = _dense_dots(text)
  layer_dots = [d for d in dots if d.layer is not None]
  assert len(layer_dots) >= 7 * CONFIG.num_layers, [d.name for d in dots]
  assert {d.types for d in layer_dots} == {"bf16xbf16->f32"}, {d.types for d in layer_dots}
  state = decoding.DecodeState(init_cache(CONFIG, 1, 16, prec.compute_dtype),
                               jax.ShapeDtypeStruct((1, CONFIG.vocab_size), jnp.float32),
                               jax.ShapeDtypeStruct((1,), jnp.int32))
  step = jax.jit(functools.partial(decoding.decode_step, config=CONFIG, precision=prec))
  step_dots = _dense_dots(compiled_text(step.lower(params, state, jax.ShapeDtypeStruct(
      (1,), jnp.int32))))
  assert step_dots and {d.types for d in step_dots} == {"f32xf32->f32"}, \
      {d.types for d in step_dots}


# ----------------------------------------------------------------------------- prefill weights
def test_prefill_params_store_the_blocks_matrices_in_bf16(bf16_cpu):
  """`decoding.prefill_params` on the carried weights: at >= MIN_ROWS_C_DOT rows the
  blocks' dense matrices are stored in bf16 (their carried values, exactly), the
  embedding table and the norm scales / biases are the carried arrays themselves; below
  that many rows, with the float32 form, and in float32 compute the params come back as
  given (the same object)."""
  raw = init_params(CONFIG, jax.random.PRNGKey(0))
  carried, prec = decoding.for_serving(raw, BF16_FLAGS, backend="cpu")
  rows = layers.MIN_ROWS_C_DOT
  stored = decoding.prefill_params(carried, prec, rows)
  matrices = 0
  for module, group in carried.items():
    for name, x in group.items():
      y = stored[module][name]
      if module.startswith("decoder/layer_") and "norm" not in module and name == "w":
        assert y.dtype == jnp.bfloat16, (module, name, y.dtype)
        np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), np.asarray(x))
        matrices += 1
      else:
        assert y is x, (module, name)
  assert matrices == 7 * CONFIG.num_layers
  assert decoding.prefill_params(carried, prec, rows - 1) is carried
  f32_form = dataclasses.replace(prec, projection_form="float32_dot")
  assert decoding.prefill_params(carried, f32_form, rows) is carried
  fp32_params, fp32 = decoding.for_serving(raw, Precision(), backend="cpu")
  assert decoding.prefill_params(fp32_params, fp32, rows) is fp32_params


@pytest.mark.parametrize("kwargs", [{}, {"key_offset": "bias"},
                                    {"mlp_activation": "float32"}])
def test_a_prefill_on_stored_weights_is_the_carried_prefill_bit_for_bit(bf16_cpu, kwargs):
  """The prefill `generate` runs (`prefill_params`: the blocks' matrices stored in bf16)
  against the prefill on the float32-carried weights, each cast to bf16 at its use (the
  form it replaced; an independent path to the same operands): the last logits and every
  cache entry are equal bit for bit (2 x 64 = 128 rows, bf16 + both flags, with the key
  offset and the float32 MLP activation too, whose projections keep float32 results)."""
  config = dataclasses.replace(CONFIG, qkv_bias=True) if kwargs.get("key_offset") else CONFIG
  raw = _init(config, jax.random.PRNGKey(3))
  carried, prec = decoding.for_serving(raw, dataclasses.replace(BF16_FLAGS, **kwargs),
                                       backend="cpu")
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 64), 0, config.vocab_size)
  lengths = jnp.array([64, 50], jnp.int32)
  run = jax.jit(functools.partial(decoding.prefill, config=config, precision=prec,
                                  cache_length=80))
  stored = decoding.prefill_params(carried, prec, tokens.size)
  assert any(x.dtype == jnp.bfloat16 for g in stored.values() for x in g.values())
  got, want = run(stored, tokens, lengths), run(carried, tokens, lengths)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                  np.asarray(b.astype(jnp.float32)))


# ----------------------------------------------------------------------------- per CPU
X86_WITH = "processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\n"
X86_WITHOUT = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
ARM_WITH = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


def test_cpu_features_are_read_from_cpuinfo(tmp_path):
  """x86 'flags' and Arm 'Features' lines; a text with neither is unknown (None), which
  'auto' treats as before the choice existed (the bf16 dot)."""
  assert cpu_features.parse_bf16_features(X86_WITH) == ("avx512_bf16",)
  assert cpu_features.parse_bf16_features(X86_WITHOUT) == ()
  assert cpu_features.parse_bf16_features(ARM_WITH) == ("bf16",)
  assert cpu_features.parse_bf16_features("flags: bf16\n") == ()   # Arm's name, x86 line
  assert cpu_features.parse_bf16_features("model name: x\n") is None
  path = tmp_path / "cpuinfo"
  path.write_text(X86_WITHOUT * 2)
  assert cpu_features.bf16_features(str(path)) == ()
  assert cpu_features.bf16_features(str(tmp_path / "none")) is None


@pytest.mark.parametrize("features,backend,want", [
    (("avx512_bf16",), "cpu", "by_rows"), ((), "cpu", "float32_dot"),
    (None, "cpu", "by_rows"), ((), "tpu", "by_rows"), ((), "cuda", "by_rows")])
def test_auto_form_follows_the_cpu_and_the_precision_line_names_it(monkeypatch, features,
                                                                    backend, want):
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: features)
  prec = Precision(dtype="bfloat16")
  assert prec.projection(backend) == want
  line = prec.describe_projection(backend)
  assert line.startswith(f" projections=auto:{want}(")
  assert (cpu_features.describe(features) if backend == "cpu" else backend) in line
  for form in ("compute_dtype_dot", "float32_dot"):     # a chosen form is in force anywhere
    forced = Precision(dtype="bfloat16", projection_form=form)
    assert forced.projection(backend) == form
    assert f" projections={form} " in forced.describe() + " "
  assert Precision().projection(backend) == "float32"
  assert "projections" not in Precision().describe()


@pytest.mark.parametrize("kwargs,match", [
    (dict(projection_form="float32_dot"), "dtype='float32'"),
    (dict(dtype="bfloat16", projection_form="compute_dtype_dot",
          matmul_precision="BF16_BF16_F32"), "names its own operand types"),
    (dict(dtype="bfloat16", projection_form="fast"), "'auto', 'compute_dtype_dot'")])
def test_a_form_that_would_not_be_used_is_refused(kwargs, match):
  with pytest.raises(UserError, match=match):
    Precision(**kwargs)


@pytest.mark.parametrize("M", [4, 200])
def test_the_two_forms_differ_by_at_most_one_bf16_ulp(M):
  """'compute_dtype_dot' and 'float32_dot' at a decode step's rows (4) and a prefill's
  (200): each is within float32 accumulation error (2^-22 x sum|x||w|) of the float64
  product of the same bf16 values, rounded once (so within 1 bf16 ulp of it), and they
  differ from each other by at most 1 bf16 ulp, plus the float32 accumulation error where
  the sum cancels (the contract's statement). Reference: float64 NumPy."""
  rng = np.random.default_rng(M)
  x = jnp.asarray(rng.standard_normal((M, 576)), jnp.float32).astype(jnp.bfloat16)
  w = _bf16_values(rng.standard_normal((576, 384)) / 24)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  out = {}
  for form in ("compute_dtype_dot", "float32_dot"):
    y32 = np.asarray(layers.project(x, w, "mk,kn->mn", precision=None, carrier=True,
                                    out_dtype=jnp.float32, form=form))
    err = np.abs(y32 - x64 @ w64) / (np.abs(x64) @ np.abs(w64))
    assert err.max() <= 2.0 ** -22, (form, err.max())
    out[form] = layers.project(x, w, "mk,kn->mn", precision=None, carrier=True, form=form)
    assert out[form].dtype == jnp.bfloat16
    y64, bound = x64 @ w64, 2.0 ** -22 * (np.abs(x64) @ np.abs(w64))
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(y64), 1e-30))) - 7)   # bf16 spacing
    assert (np.abs(np.asarray(out[form], np.float64) - y64) <= ulp + bound).all(), form
  a, b = (np.asarray(out[f], np.float64) for f in ("compute_dtype_dot", "float32_dot"))
  spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(a), np.abs(b)))) - 7)
  # where the sum cancels to below float32 accumulation error (1 output in 6400 here,
  # |y| ~ 1e-6), that error is what the two orders differ by
  assert (np.abs(a - b) <= spacing + 2 * bound).all()
  assert np.mean(np.abs(a - b) <= spacing) >= 0.999


def _bf16_dots_of_a_decode_step(form):
  """bf16 x bf16 dots of a decode step as lowered (XLA:CPU itself runs a one-row bf16
  dot as a float32 one and drops its name, so the compiled program cannot tell)."""
  params = jax.eval_shape(lambda: init_params(CONFIG, jax.random.PRNGKey(0)))
  prec = decoding.serving_precision(
      Precision(dtype="bfloat16", projection_form=form), backend="cpu")
  state = decoding.DecodeState(init_cache(CONFIG, 1, 16, prec.compute_dtype),
                               jax.ShapeDtypeStruct((1, CONFIG.vocab_size), jnp.float32),
                               jax.ShapeDtypeStruct((1,), jnp.int32))
  step = jax.jit(functools.partial(decoding.decode_step, config=CONFIG, precision=prec))
  lowered = step.lower(params, state, jax.ShapeDtypeStruct((1,), jnp.int32)).as_text()
  operands = re.findall(r"stablehlo\.dot_general.*: \(tensor<[^>]*x(\w+)>, "
                        r"tensor<[^>]*x(\w+)>\)", lowered)
  return sum(o == ("bf16", "bf16") for o in operands)


@pytest.mark.parametrize("form,types", [("compute_dtype_dot", {"bf16xbf16->f32"}),
                                        ("float32_dot", {"f32xf32->f32"})])
def test_a_forced_form_is_what_xla_compiles_in_prefill(form, types):
  """The chosen form holds at a prefill's row count: every dense dot XLA:CPU compiled is
  of its types."""
  params = jax.eval_shape(lambda: init_params(CONFIG, jax.random.PRNGKey(0)))
  prec = decoding.serving_precision(
      Precision(dtype="bfloat16", projection_form=form), backend="cpu")
  prefill = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=prec,
                                      cache_length=64))
  text = compiled_text(prefill.lower(params, jax.ShapeDtypeStruct((2, 64), jnp.int32),
                       jax.ShapeDtypeStruct((2,), jnp.int32)))
  layer_dots = [d for d in _dense_dots(text) if d.layer is not None]
  assert len(layer_dots) >= 7 * CONFIG.num_layers
  assert {d.types for d in layer_dots} == types


def test_a_forced_form_holds_in_a_decode_step():
  """At one row: 'compute_dtype_dot' emits a bf16 dot for each of the 7 projections per
  layer and the unembedding, where 'float32_dot' emits float32 ones (the attention's own
  dots are the same in both: a decode step keeps the bf16 QK dot,
  `Precision.float32_qk_operands`, tests/test_qk_form.py)."""
  extra = _bf16_dots_of_a_decode_step("compute_dtype_dot") - \
      _bf16_dots_of_a_decode_step("float32_dot")
  assert extra == 7 * CONFIG.num_layers + 1


def test_a_program_traced_for_another_platform_resolves_auto_for_it(monkeypatch):
  """On a CPU without bf16 dots, 'auto' is the float32 form here, but a program traced for
  tpu (the audit's --platform=tpu from this machine) gets the tpu's form."""
  from attnprec.precision import target_backend
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: ())
  prec = Precision(dtype="bfloat16")
  assert prec.projection("cpu") == "float32_dot"
  with target_backend("tpu"):
    assert prec.projection() == "by_rows"
    assert "auto:by_rows(tpu)" in prec.describe()
  with target_backend(None):
    assert prec.projection() == ("float32_dot" if jax.default_backend() == "cpu"
                                 else "by_rows")

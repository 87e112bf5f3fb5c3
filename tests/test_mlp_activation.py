"""`precision.mlp_activation`: where a 16-bit gated MLP rounds.

'float32' keeps the gate and up projections' float32 accumulations, runs the activation
and the gating product in float32 and rounds once into the down projection. Compared
here with a float64 NumPy MLP on the same bf16 values (an independent implementation):
it is closer to it than 'compute' (every op rounded to bf16), and it is exactly that
recipe. 'compute' is the model's MLP as before, bit for bit. 'auto' (the default) is
'float32' where the projection form in force is 'float32_dot' on XLA:CPU (a CPU without
bf16 dots), 'compute' elsewhere.
"""
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import cpu_features
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.layers import MLP
from attnprec.precision import Precision, target_backend

CONFIG = ModelConfig(vocab_size=64, d_model=96, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=24, mlp_hidden=384, max_seq_len=64)


def _mlp(precision):
  return hk.without_apply_rng(hk.transform(lambda x: MLP(CONFIG, precision, name="mlp")(x)))


def _setup(rows, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((1, rows, CONFIG.d_model)), jnp.float32)
  params = _mlp(Precision()).init(jax.random.PRNGKey(seed), x)
  # weights holding bf16 values (as `decoding.for_serving` leaves them), inputs in bf16
  params = jax.tree_util.tree_map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32),
                                  params)
  return params, x.astype(jnp.bfloat16)


def _float64(params, x):
  g, u, d = (np.asarray(params[f"mlp/{n}"]["w"], np.float64)
             for n in ("gate", "up", "down"))
  x64 = np.asarray(x, np.float64)
  a = x64 @ g
  return ((a / (1 + np.exp(-a))) * (x64 @ u)) @ d


@pytest.mark.parametrize("rows", [8, 256])   # a decode step's form and a prefill's
def test_float32_activation_is_closer_to_float64_and_is_its_recipe(rows):
  params, x = _setup(rows)
  ref = _float64(params, x)
  out = {m: np.asarray(jax.jit(_mlp(Precision(dtype="bfloat16", mlp_activation=m)).apply)(
      params, x), np.float64) for m in ("compute", "float32")}
  err = {m: np.linalg.norm(o - ref) / np.linalg.norm(ref) for m, o in out.items()}
  # measured, relative L2: rows 8 / 256: compute 4.0e-3 / 4.5e-3, float32 2.4e-3 / 2.3e-3
  assert err["float32"] < 0.75 * err["compute"], err
  # the recipe, in float32 (f32 products of bf16 values are exact): one rounding of the
  # hidden vector to bf16, then the down projection's float32 accumulation, rounded
  g, u, d = (params[f"mlp/{n}"]["w"] for n in ("gate", "up", "down"))
  x32 = x.astype(jnp.float32)
  hidden = (jax.nn.silu(x32 @ g) * (x32 @ u)).astype(jnp.bfloat16).astype(jnp.float32)
  want = np.asarray((hidden @ d).astype(jnp.bfloat16), np.float64)
  # float32 summation order may differ: at most 1 bf16 ulp (2^-7 relative) of the output,
  # plus where a hidden value's rounding flips by its 1 ulp (2^-8 relative) and the down
  # projection's sum cancels (1 output in 24576 here)
  scale = np.asarray(jnp.abs(hidden) @ jnp.abs(d), np.float64)
  assert (np.abs(out["float32"] - want) <= 2 ** -7 * np.abs(want) + 2 ** -8 * scale).all()
  assert np.mean(np.abs(out["float32"] - want) <= 2 ** -7 * np.abs(want)) >= 0.999


BF16 = dict(dtype="bfloat16")


@pytest.mark.parametrize("kwargs,backend,features,want", [
    (BF16, "cpu", (), "float32"),                         # no bf16 dots: float32_dot form
    (BF16, "cpu", ("avx512_bf16",), "compute"),
    (BF16, "tpu", (), "compute"),                         # 'auto' resolves for the target
    (BF16, "gpu", (), "compute"),
    ({**BF16, "projection_form": "float32_dot"}, "cpu", ("avx512_bf16",), "float32"),
    ({**BF16, "projection_form": "float32_dot"}, "tpu", (), "compute"),
    ({**BF16, "projection_form": "compute_dtype_dot"}, "cpu", (), "compute"),
    ({**BF16, "matmul_precision": "BF16_BF16_F32"}, "cpu", (), "compute"),
    ({**BF16, "mlp_activation": "compute"}, "cpu", (), "compute"),
    ({**BF16, "mlp_activation": "float32"}, "tpu", (), "float32"),
    (dict(dtype="float16"), "cpu", (), "float32"),
    (dict(), "cpu", (), "compute"),                       # float32 compute: one way
    (dict(mlp_activation="compute"), "cpu", (), "compute"),
])
def test_auto_is_the_default_and_resolves_by_the_projection_form(monkeypatch, kwargs,
                                                                  backend, features, want):
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: features)
  prec = Precision(**kwargs)
  assert Precision().mlp_activation == "auto"
  assert prec.mlp_form(backend) == want
  with target_backend(backend):
    assert prec.mlp_form() == want
    line = prec.describe()
  assert line == prec.describe(backend)
  if want == "compute":
    assert "mlp_activation" not in line
  elif prec.mlp_activation == "auto":
    assert " mlp_activation=auto:float32 " in line
  else:
    assert " mlp_activation=float32 " in line


@pytest.mark.parametrize("features,same_as", [((), "float32"),
                                              (("avx512_bf16",), "compute")])
def test_auto_runs_the_form_it_resolves_to_bit_for_bit(monkeypatch, features, same_as):
  """On a CPU without bf16 dots 'auto' is the float32 recipe, on one with them the
  compute-dtype MLP: the same outputs, bit for bit, at a prefill's rows and a decode
  step's."""
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: features)
  for rows in (8, 256):
    params, x = _setup(rows)
    auto, other = (np.asarray(jax.jit(_mlp(Precision(dtype="bfloat16", mlp_activation=m))
                                      .apply)(params, x), np.float64)
                   for m in ("auto", same_as))
    np.testing.assert_array_equal(auto, other)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mlp_activation="float32"), "dtype='float32'"),
    (dict(dtype="bfloat16", mlp_activation="f32"), "'auto', 'compute', 'float32'")])
def test_a_setting_that_would_not_be_used_is_refused(kwargs, match):
  with pytest.raises(UserError, match=match):
    Precision(**kwargs)

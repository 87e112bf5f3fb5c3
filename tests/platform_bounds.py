"""Tolerances of float32 tests on the platform this process runs on, from the contract.

The float32 tolerances of the suite (2e-5 and 1e-4 for unit-scale inputs) hold where a
float32 dot multiplies in float32: XLA:CPU at every precision, a TPU at 'highest'. On a
TPU a float32 dot at DEFAULT multiplies its operands as bf16 values (one bf16 pass:
`attnprec.platforms`, measured in results/tpu-f16 and tests/test_tpu.py), so a float32
attention there is one whose q, k, probabilities and v are each rounded once to 8
significand bits before float32 accumulation: its error against float64, or against
another kernel that rounds at other places, is a few units u = 2^-8 of unit-scale
outputs. The bounds, in units u of the local platform's f32 arithmetic
(`platforms.f32_rounding_unit`):

  KERNEL_UNITS = 4   one attention of unit-scale inputs (four roundings of 2^-9 each,
                     into an output that is a convex combination of v's rows);
  MODEL_UNITS = 16   the tiny model's logits (two layers of attention and seven dense
                     dots each, rounded the same way, plus the unembedding).

`tol(cpu, units, scale=)` is the test's own float32 number where the platform multiplies
f32 in f32 (units * u is then below it), else units * u times the largest |value|
compared where that exceeds 1 (rounding errors are relative: the TPU run showed outputs
of |2| off by 7.5 units of 2^-8 in a 37-token prefill of logit scale 3): a bound derived
from what DEFAULT means there, never a number raised to go green. tests/test_tpu.py checks both bounds on
a TPU: the DEFAULT error exceeds the float32 tolerance (so the rounding is real) and stays
within KERNEL_UNITS; at 'highest' it is back within the float32 tolerance.
"""
import jax

from attnprec import platforms

KERNEL_UNITS = 4
MODEL_UNITS = 16


def local() -> str:
  return platforms.local_platform(jax.default_backend(), getattr(
      jax.devices()[0].client, "platform_version", "")) or "cpu"


def tol(cpu: float, units: int = KERNEL_UNITS, precision: str = "DEFAULT",
        scale: float = 1.0) -> float:
  """The float32 tolerance here: `cpu` where f32 dots multiply in f32, else `units`
  rounding units of the platform's f32 arithmetic at `precision`, times the outputs'
  scale where it exceeds 1 (`scale`: the largest |value| compared; a rounding error is
  relative to the values it rounds)."""
  if precision.upper() not in platforms.LAX_PRECISIONS:      # a dot-algorithm preset
    unit = 2.0 ** -platforms.ARITHMETIC_BITS[platforms.preset_arithmetic(precision)]
    unit = max(unit, platforms.f32_rounding_unit(local(), "DEFAULT")
               if platforms.refusal(local(), precision) else unit)
  else:
    unit = platforms.f32_rounding_unit(local(), precision)
  return max(cpu, units * unit * max(1.0, float(scale)))


def exact_f32_dots(precision: str = "DEFAULT") -> bool:
  """Whether float32 dots at `precision` multiply in float32 here (XLA:CPU; a TPU only
  at 'highest')."""
  return platforms.f32_rounding_unit(local(), precision.upper()) <= 2.0 ** -24


def assert_gradients_match(f, reference, args, weights):
  """d(sum(f(*args) * weights))/d(args) == the same through `reference` (jax.grad,
  jitted), within blockwise's bound (`tol(2e-5)`) scaled by each gradient's largest
  value: a hand-written or library backward pass against autodiff."""
  import chex
  import jax
  import jax.numpy as jnp
  grad = lambda fn: jax.jit(jax.grad(  # noqa: E731
      lambda *x: jnp.sum(fn(*x) * weights), argnums=tuple(range(len(args)))))(*args)
  for i, (got, want) in enumerate(zip(grad(f), grad(reference))):
    bound = tol(2e-5, scale=float(jnp.abs(want).max()))
    chex.assert_trees_all_close(got, want, atol=bound, rtol=bound,
                                custom_message=f"gradient of argument {i}")

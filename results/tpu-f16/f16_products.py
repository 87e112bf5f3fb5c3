"""One-off, on a TPU: how a dot multiplies float16 operands at each lax precision, next
to bf16 and float32 operands (the question: does platforms.TABLE's "exact products" for
16-bit operands hold for float16 on TPU, or does the MXU take one bf16 pass of them?).

Each "dot" is [N, 2] x [2, N] whose second column and row are zeros (passed in as data):
every output is one product, so its value tells how the operands were multiplied (a
contraction of length 1, as first written, XLA rewrites into an element-wise multiply:
f16_products_k1.txt shows every form exact on TPU, the f32 x f32 dot at DEFAULT too).
Compared, as float64, against the exact product of the operand values and against the
product of the operands rounded to bf16 (one bf16 pass). Then [N, 256] x [256, N] dots:
the median error against float64 next to that of one bf16 pass of the same operands.
  python3 results/tpu-f16/f16_products.py
The script sets XLA's excess precision off before jax starts, as every runner does
(attnprec/xla_env.py); the committed outputs were made before it did, with XLA's default
(each program is one dot of its operands as passed: no rounding between two ops for XLA to
drop).
"""
from attnprec.xla_env import disable_excess_precision
disable_excess_precision()   # before jax is imported
import jax, jax.numpy as jnp, numpy as np  # noqa: E402
import ml_dtypes  # noqa: E402

print("backend:", jax.default_backend(), jax.devices()[0].device_kind, "| jax", jax.__version__)
rng = np.random.default_rng(0)
N = 512
KD = 2
x = rng.standard_normal((N, KD)) * np.exp(rng.uniform(-3, 3, (N, KD)))
y = rng.standard_normal((KD, N)) * np.exp(rng.uniform(-3, 3, (KD, N)))
x[:, 1:] = 0.0
y[1:, :] = 0.0
bf = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float64)


def classify(name, xs, ys, fn):
  """xs, ys: the operands' values as float64 (already of the operand type)."""
  exact = (xs @ ys).astype(np.float32).astype(np.float64)   # exact product, one f32 rounding
  one_bf16 = (bf(xs) @ bf(ys)).astype(np.float32).astype(np.float64)
  got = np.asarray(fn(), np.float64)
  rel = np.abs(got - xs @ ys) / np.abs(xs @ ys)
  print(f"{name:58s} equal to exact: {np.mean(got == exact):6.1%}  to one bf16 pass: "
        f"{np.mean(got == one_bf16):6.1%}  max rel err {rel.max():.2e}", flush=True)


for dt_name, dt in (("f16", jnp.float16), ("bf16", jnp.bfloat16), ("f32", jnp.float32)):
  xs = np.asarray(jnp.asarray(x, dt), np.float64)
  ys = np.asarray(jnp.asarray(y, dt), np.float64)
  a, b = jnp.asarray(xs, dt), jnp.asarray(ys, dt)
  for prec in ("DEFAULT", "HIGH", "HIGHEST"):
    P = getattr(jax.lax.Precision, prec)
    classify(f"{dt_name} x {dt_name} -> f32, {prec}",
             xs, ys, lambda: jax.jit(lambda a, b: jnp.dot(a, b, precision=P,
                                     preferred_element_type=jnp.float32))(a, b))
    if dt_name != "f32":
      classify(f"f32({dt_name} values) x f32({dt_name} values) -> f32, {prec}",
               xs, ys, lambda: jax.jit(lambda a, b: jnp.dot(
                   a.astype(jnp.float32), b.astype(jnp.float32), precision=P))(a, b))
  if dt_name == "f16":
    for preset in ("BF16_BF16_F32", "BF16_BF16_F32_X3", "BF16_BF16_F32_X6"):
      try:
        classify(f"f16 x f16, {preset}", xs, ys, lambda: jax.jit(lambda a, b: jnp.dot(
            a, b, precision=preset, preferred_element_type=jnp.float32))(a, b))
      except Exception as e:   # noqa: BLE001
        print(f"f16 x f16, {preset}: refused: {type(e).__name__}: {str(e)[:200]}")


print("\n[N, 256] x [256, N]: median |error| / |exact| against float64")
x = rng.standard_normal((N, 256))
y = rng.standard_normal((256, N))
for dt_name, dt in (("f16", jnp.float16), ("bf16", jnp.bfloat16), ("f32", jnp.float32)):
  xs = np.asarray(jnp.asarray(x, dt), np.float64)
  ys = np.asarray(jnp.asarray(y, dt), np.float64)
  a, b = jnp.asarray(xs, dt), jnp.asarray(ys, dt)
  exact = xs @ ys
  ref_bf16 = np.median(np.abs(bf(xs) @ bf(ys) - exact) / np.abs(exact))
  for prec in ("DEFAULT", "HIGH", "HIGHEST"):
    P = getattr(jax.lax.Precision, prec)
    for form, f in ((f"{dt_name} x {dt_name} -> f32", lambda a, b: jnp.dot(
        a, b, precision=P, preferred_element_type=jnp.float32)),
        (f"f32({dt_name} values) x f32", lambda a, b: jnp.dot(
            a.astype(jnp.float32), b.astype(jnp.float32), precision=P))):
      got = np.asarray(jax.jit(f)(a, b), np.float64)
      err = np.median(np.abs(got - exact) / np.abs(exact))
      print(f"{form + ', ' + prec:40s} {err:.2e}   (one bf16 pass of these operands: "
            f"{ref_bf16:.2e})", flush=True)

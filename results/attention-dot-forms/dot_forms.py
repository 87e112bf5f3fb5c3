"""One-off: the blockwise kernel's two dots alone, one block of SmolLM2's attention (9 query
heads over 3 kv heads, H = 64; q512/kv256, the default prefill blocks), in every layout
the kernel could give them, side by side on XLA:CPU: which form of each dot runs fastest?

QK dot, bf16 x bf16 -> float32 (both flags):
  cur     BKGTH,BKSH->BKGTS   the kernel's form: GQA groups folded into rows (G x Tq), (B, K)
                              leading batch dims, keys as the cache lies ([B, K, S, H])
  kT      BKGTH,BKHS->BKGTS   keys transposed ([B, K, H, S]: a cache laid out that way)
  outT    BKGTH,BKSH->BKGST   logits transposed (keys as rows)
  perG    BKGTH,BKSH->BKGTS   with G as a batch dim (a dot per query head) instead of rows
  f32     as cur, q and k cast to float32 (the float32 QK form of a CPU without bf16 dots)
PV dot, float32 probabilities x values cast to float32 -> float32 (the contract's):
  cur     BKGTS,BKSH->BKGTH   the kernel's form
  vT      BKGTS,BKHS->BKGTH   values transposed ([B, K, H, S])
  outT    BKGTS,BKSH->BKHGT   output transposed
  pT      BKGST,BKSH->BKGTH   probabilities transposed (keys as rows)
  perG    G as a batch dim
  ones65  cur with a column of ones appended to the values: the row sum of the
          probabilities out of the same dot (H + 1 = 65 columns), for the separate sum pass
  bf16p   bf16 probabilities x bf16 values -> float32 (not the contract's: flash kernels')
Each form's output is checked finite (a form whose output is not stops the run) and
compared with the current form's (float32 summation order only).
Interleaved rounds, medians; from the repository root:
  .venv/bin/python results/attention-dot-forms/dot_forms.py   (dot_forms.txt)
The script sets XLA's excess precision off before jax starts, as every runner does
(attnprec/xla_env.py); the committed dot_forms.txt was made before it did, with XLA's
default.
"""
import os, statistics, time
from attnprec.xla_env import disable_excess_precision
disable_excess_precision()   # before jax is imported
import jax, jax.numpy as jnp, numpy as np  # noqa: E402
from attnprec.checkpoints.finite import require_finite  # noqa: E402

B, K, G, T, S, H = 1, 3, 3, 512, 256, 64
R, CALLS = int(os.environ.get("R", 9)), 20
F, BF = jnp.float32, jnp.bfloat16
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, K, G, T, H)), BF)
k = jnp.asarray(rng.standard_normal((B, K, S, H)), BF)
v = jnp.asarray(rng.standard_normal((B, K, S, H)), BF)
p = jnp.asarray(rng.random((B, K, G, T, S)), F)
kT, vT, pT = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3), jnp.swapaxes(p, 3, 4)
e = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=F)   # noqa: E731


def per_g(spec_out, a, b):
  """G as a batch dim: the kv block broadcast over it (a dot per query head)."""
  b = jnp.broadcast_to(b[:, :, None], (B, K, G) + b.shape[2:])
  return jnp.einsum(spec_out, a, b, preferred_element_type=F)


QK = {"cur": (lambda q, k: e("BKGTH,BKSH->BKGTS", q, k), (q, k), None),
      "kT": (lambda q, kT: e("BKGTH,BKHS->BKGTS", q, kT), (q, kT), None),
      "outT": (lambda q, k: e("BKGTH,BKSH->BKGST", q, k), (q, k), lambda o: jnp.swapaxes(o, 3, 4)),
      "perG": (lambda q, k: per_g("BKGTH,BKGSH->BKGTS", q, k), (q, k), None),
      "f32": (lambda q, k: e("BKGTH,BKSH->BKGTS", q.astype(F), k.astype(F)), (q, k), None)}
PV = {"cur": (lambda p, v: e("BKGTS,BKSH->BKGTH", p, v.astype(F)), (p, v), None),
      "vT": (lambda p, vT: e("BKGTS,BKHS->BKGTH", p, vT.astype(F)), (p, vT), None),
      "outT": (lambda p, v: e("BKGTS,BKSH->BKHGT", p, v.astype(F)), (p, v),
               lambda o: jnp.moveaxis(o, 2, 4)),
      "pT": (lambda pT, v: e("BKGST,BKSH->BKGTH", pT, v.astype(F)), (pT, v), None),
      "perG": (lambda p, v: per_g("BKGTS,BKGSH->BKGTH", p, v.astype(F)), (p, v), None),
      "ones65": (lambda p, v: e("BKGTS,BKSH->BKGTH", p, jnp.concatenate(
          [v.astype(F), jnp.ones((B, K, S, 1), F)], -1)), (p, v), lambda o: o[..., :H]),
      "bf16p": (lambda p, v: e("BKGTS,BKSH->BKGTH", p.astype(BF), v), (p, v), None)}
print(f"jax {jax.__version__} {jax.default_backend()}, {os.cpu_count()} cores; one block: "
      f"B={B} K={K} G={G} Tq={T} Sk={S} H={H}; {R} rounds of {CALLS} calls, medians", flush=True)
for dot, forms in (("QK", QK), ("PV", PV)):
  fns = {n: (jax.jit(f), a, back) for n, (f, a, back) in forms.items()}
  outs = {n: require_finite(f"the {dot} dot's output in form {n}",
                            np.asarray(back(f(*a)) if back else f(*a)))
          for n, (f, a, back) in fns.items()}
  rel = {n: float(np.max(np.abs(out - outs["cur"])) / np.max(np.abs(outs["cur"])))
         for n, out in outs.items()}
  ts = {n: [] for n in fns}
  for _ in range(R):
    for n, (f, a, _) in fns.items():
      jax.block_until_ready(f(*a))
      t0 = time.perf_counter()
      for _ in range(CALLS):
        out = f(*a)
      jax.block_until_ready(out)
      ts[n].append((time.perf_counter() - t0) / CALLS)
  flops = 2 * B * K * G * T * S * H
  base = statistics.median(ts["cur"])
  for n in fns:
    m = statistics.median(ts[n])
    print(f"{dot} {n:7s} {m * 1e3:7.3f} ms  {m / base:5.2f}x cur  {flops / m / 1e9:6.0f} GFLOP/s"
          f"  max |diff| / max |cur| {rel[n]:.1e}", flush=True)

"""One-off: the blockwise kernel alone on the CPU this runs on, SmolLM2-135M's attention
shape (9 query / 3 kv heads, H = 64, B = 1, causal prefill of S tokens), three ways:
  fp32:              float32 q / k / v (the fp32 preset's kernel);
  bf16 + flags:      bf16 q / k / v, float32 QK product and softmax (the kernel's QK dot
                     on bf16 operands, bf16 x bf16 -> float32);
  bf16 values, f32:  the same bf16 values cast to float32 first, then the float32 kernel
                     with the same flags: the QK dot on float32 operands (exact casts; the
                     contract's stages are the same: float32 product, float32 softmax,
                     float32 probabilities into the PV dot), output rounded to bf16.
Written for a CPU without avx512_bf16 (the question: does the kernel's bf16 QK dot cost
there, as the bf16 projection dots did?). Interleaved rounds, medians; max abs difference
of each bf16-input form's output against 'bf16 + flags'. From the repository root:
  JAX_PLATFORMS=cpu python3 results/cpu-without-avx512-bf16/attention_forms.py
(SEQ=1000,4096 R=7 to change the lengths / rounds.)
"""
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import contract, cpu_features
from attnprec.kernels.blockwise import blockwise_attention

N, K, H = 9, 3, 64
R = int(os.environ.get("R", 7))
SEQ = [int(s) for s in os.environ.get("SEQ", "1000,4096").split(",")]
FLAGS = contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
print("CPU:", cpu_features.describe(), "| cores:", os.cpu_count(), "| affinity:",
      len(os.sched_getaffinity(0)), "| jax", jax.__version__, jax.default_backend(), flush=True)
for S in SEQ:
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, S, n, H)), jnp.bfloat16) for n in (N, K, K))
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  attn = lambda a, b, c: blockwise_attention(a, b, c, causal=True, flags=FLAGS)
  forms = {
      "fp32": (jax.jit(attn), (q32, k32, v32)),
      "bf16 + flags": (jax.jit(attn), (q, k, v)),
      "bf16 values, f32": (jax.jit(lambda a, b, c: attn(
          a.astype(jnp.float32), b.astype(jnp.float32), c.astype(jnp.float32)
      ).astype(jnp.bfloat16)), (q, k, v)),
  }
  calls, outs = {}, {}
  for name, (fn, args) in forms.items():
    compiled = fn.lower(*args).compile()
    outs[name] = np.asarray(compiled(*args), np.float32)
    if not np.isfinite(outs[name]).all():
      sys.exit(f"{name}: non-finite output at S={S}; not timed")
    calls[name] = lambda c=compiled, a=args: jax.block_until_ready(c(*a))
  times = {n: [] for n in calls}
  for _ in range(R):
    for name, call in calls.items():
      call()
      t0 = time.perf_counter()
      call()
      times[name].append(time.perf_counter() - t0)
  base = statistics.median(times["fp32"])
  for name in calls:
    med = statistics.median(times[name])
    diff = ("" if name == "fp32" else
            f"  max abs vs bf16 + flags {np.abs(outs[name] - outs['bf16 + flags']).max():.1e}")
    print(f"S={S} {name:18s} {1000 * med:8.1f} ms  {med / base:.2f}x fp32{diff}", flush=True)

"""One-off: the blockwise kernel (SmolLM2's heads, 9 over 3, H = 64; bf16, both flags,
causal, 4096 tokens) under XLA:CPU flags that might speed its element-wise passes, each
setting in its own process (XLA reads XLA_FLAGS once), the processes interleaved:
  --xla_cpu_prefer_vector_width=512        element-wise code in 512-bit vectors (LLVM's
                                           default on these CPUs is 256)
  --xla_cpu_experimental_ynn_fusion_type=dot   only dots in YNNPACK fusions: the row max
                                           and row sum become XLA's own reductions, which
                                           can fuse the mask pass into the max
The outputs are checked finite after every run (one that is not stops the run) and
compared with the default's (max abs difference). From the repository root:
  .venv/bin/python results/attention-xla-cpu/xla_flags.py  (xla_flags.txt)
"""
import os, statistics, subprocess, sys, tempfile
import numpy as np
sys.path.insert(0, os.getcwd())
from attnprec.checkpoints.finite import require_finite

SETTINGS = {"default": "", "prefer_vector_width=512": "--xla_cpu_prefer_vector_width=512",
            "ynn_fusion_type=dot": "--xla_cpu_experimental_ynn_fusion_type=dot"}
ROUNDS, CALLS, S = 5, 9, 4096
CHILD = r'''
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import contract
from attnprec.kernels.blockwise import blockwise_attention
S, CALLS, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((1, S, n, 64)), jnp.bfloat16) for n in (9, 3, 3))
f = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, causal=True,
    flags=contract.AttentionFlags(float32_qk_product=True, float32_logits=True)))
np.save(out, np.asarray(f(q, k, v), np.float32))
ts = []
for _ in range(CALLS):
  t = time.perf_counter(); f(q, k, v).block_until_ready(); ts.append(time.perf_counter() - t)
print(statistics.median(ts) * 1e3)
'''


def run(flag, out):
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flag).strip())
  done = subprocess.run([sys.executable, "-c", CHILD, str(S), str(CALLS), out], env=env,
                        capture_output=True, text=True, check=True)
  return float(done.stdout.split()[-1])


res = {n: [] for n in SETTINGS}
tmp = tempfile.TemporaryDirectory(prefix="xla_flags-")   # removed at exit
out = {n: os.path.join(tmp.name, f"{n}.npy") for n in SETTINGS}
for r in range(ROUNDS):
  for n, flag in SETTINGS.items():
    res[n].append(run(flag, out[n]))
    require_finite(f"the kernel's output under {n}", np.load(out[n]))
ref = np.load(out["default"])
base = statistics.median(res["default"])
print(f"blockwise kernel, SmolLM2's heads, {S} tokens, both flags; {ROUNDS} rounds of one "
      f"process per setting, median of {CALLS} calls each, medians over rounds")
for n in SETTINGS:
  m = statistics.median(res[n])
  diff = np.abs(np.load(out[n]) - ref).max()
  print(f"{n:26s} {m:7.1f} ms  {m / base:.2f}x   max abs vs default {diff:.2g}  "
        f"(rounds: {', '.join(f'{x:.0f}' for x in res[n])})")

"""One-off: the decode step's two dots, one key block alone (SmolLM2's heads: K = 3 kv
heads, G = 3 query rows each, H = 64; batch 8, blocks of 512 keys, a scan over 8
blocks), in the forms a decode step could give them, on bf16 keys / values and on int8
codes cast exactly per block:
  QK cur        BKGH,BKSH->BKGS   the kernel's form (3 query rows per kv head)
  QK keys-rows  BKSH,BKGH->BKSG   keys as the dot's rows (512), the 3 queries as columns
  QK f32        the kernel's form on q and keys cast exactly to float32
  PV cur        BKGS,BKSH->BKGH   float32 probabilities x values cast to float32
  PV vals-lhs   BKSH,BKGS->BKHG   the values as the dot's left operand
  QK mixed      the kernel's form as one `lax.dot_general` of bf16 q on the int8 codes as
                they lie (mixed operand types): the operand types of the dot it compiles
                to are printed
Each form's output is checked finite (one that is not stops the run) and compared with
the kernel's form (max abs difference). From the repository
root:  .venv/bin/python results/decode-int8-forms/decode_dot_forms.py  (decode_dot_forms.txt)
"""
import collections, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import cpu_features
from attnprec.checkpoints.finite import require_finite
print("CPU:", cpu_features.describe(), "| 5 interleaved rounds of 20 calls, medians", flush=True)
F, BF = jnp.float32, jnp.bfloat16
B, K, G, S, H, nb = 8, 3, 3, 512, 64, 8
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, K, G, H)), BF)
kb = jnp.asarray(rng.standard_normal((nb, B, K, S, H)), BF)
kc = jnp.asarray(rng.integers(-127, 128, (nb, B, K, S, H)), jnp.int8)
p = jnp.asarray(rng.random((B, K, G, S)), F)
e = lambda spec, a, b: jnp.einsum(spec, a, b, preferred_element_type=F)
forms = {
  "QK cur bf16": (q, kb, lambda q, k: e("BKGH,BKSH->BKGS", q, k)),
  "QK keys-rows bf16": (q, kb, lambda q, k: jnp.swapaxes(e("BKSH,BKGH->BKSG", k, q), 2, 3)),
  "QK cur int8": (q, kc, lambda q, k: e("BKGH,BKSH->BKGS", q, k.astype(BF))),
  "QK keys-rows int8": (q, kc, lambda q, k: jnp.swapaxes(e("BKSH,BKGH->BKSG", k.astype(BF), q), 2, 3)),
  "QK mixed int8": (q, kc, lambda q, k: jax.lax.dot_general(
      q, k, (((3,), (3,)), ((0, 1), (0, 1))), preferred_element_type=F)),
  "QK f32 bf16": (q, kb, lambda q, k: e("BKGH,BKSH->BKGS", q.astype(F), k.astype(F))),
  "QK f32 int8": (q, kc, lambda q, k: e("BKGH,BKSH->BKGS", q.astype(F), k.astype(F))),
  "PV cur bf16": (p, kb, lambda p, v: e("BKGS,BKSH->BKGH", p, v.astype(F))),
  "PV vals-lhs bf16": (p, kb, lambda p, v: jnp.swapaxes(e("BKSH,BKGS->BKHG", v.astype(F), p), 2, 3)),
  "PV cur int8": (p, kc, lambda p, v: e("BKGS,BKSH->BKGH", p, v.astype(F))),
  "PV vals-lhs int8": (p, kc, lambda p, v: jnp.swapaxes(e("BKSH,BKGS->BKHG", v.astype(F), p), 2, 3)),
}
comp = {}
for n, (a, blocks, fn) in forms.items():
  def scan(a, blocks, fn=fn):
    return jax.lax.scan(lambda acc, blk: (acc + fn(a, blk), None), jnp.zeros_like(fn(a, blocks[0])), blocks)[0]
  c = jax.jit(scan).lower(a, blocks).compile()
  comp[n] = (c, a, blocks)
outs = {n: require_finite(f"the output of {n}", np.asarray(c(a, b))) for n, (c, a, b) in comp.items()}
def tm(fn, R=20):
  jax.block_until_ready(fn()); ts = []
  for _ in range(R):
    t = time.perf_counter(); jax.block_until_ready(fn()); ts.append(time.perf_counter() - t)
  return statistics.median(ts) * 1e3
res = collections.defaultdict(list)
for _ in range(5):
  for n, (c, a, b) in comp.items():
    res[n].append(tm(lambda: c(a, b)) / nb)
names = list(comp)
for i, n in enumerate(names):
  ref = f"{n[:2]} cur {n.split()[-1]}"   # the kernel's form, same dot and operands
  print(f"{n:22s} {statistics.median(res[n]):.3f} ms per block  {statistics.median(res[n]) / statistics.median(res[ref]):.2f}x  max diff vs cur {np.abs(outs[n] - outs[ref]).max():.2g}")
import re
hlo = comp["QK mixed int8"][0].as_text()
types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
dots = re.findall(r"= (\w+)\[[^=]*\bdot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
print("QK mixed int8 compiles to:", "; ".join(
    f"a dot of {types[a]} x {types[b]} -> {o}" for o, a, b in dots),
    "| converts:", ", ".join(sorted(set(re.findall(r"= (\w+)\[[^=]*\bconvert\(", hlo)))))

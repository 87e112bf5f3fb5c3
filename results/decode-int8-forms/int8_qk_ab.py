"""One-off: forms of an int8 cache's decode-step QK product (SmolLM2's attention shape:
K=3 kv heads, G=3, H=64; batch 8, cache 4001, per-token scales, both flags).

1. The QK of one key block alone, in a scan over 8 blocks (per block): the dot on the
   codes cast to bf16 (the kernel's form), and a multiply-and-sum in float32 on the codes
   (no dot: every product of a bf16 q and an int8 code is exact in float32, as in the
   dot's float32 accumulation), and the PV product likewise.
2. The whole decode step of one layer: the kernel as it is, a copy whose QK for a
   quantized cache is that multiply-and-sum, and the bf16 cache's step (uint16 bits, as
   the model stores it), interleaved.
From the repository root:
  .venv/bin/python results/decode-int8-forms/int8_qk_ab.py > results/decode-int8-forms/int8_qk_ab.txt"""
import collections, os, statistics, sys, time, types
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import contract, cpu_features
from attnprec.kernels import blockwise

F32 = jnp.float32
rng = np.random.default_rng(0)


def tm(fn, R=20):
  jax.block_until_ready(fn()); ts = []
  for _ in range(R):
    t = time.perf_counter(); jax.block_until_ready(fn()); ts.append(time.perf_counter() - t)
  return statistics.median(ts) * 1e3


print('CPU:', cpu_features.describe(), flush=True)
# 1. one block's products, alone
Bk, G, Sk, H, nb = 24, 3, 512, 64, 8
q = jnp.asarray(rng.standard_normal((Bk, G, H)), jnp.bfloat16)
p = jnp.asarray(rng.random((Bk, G, Sk)), F32)
codes = jnp.asarray(rng.integers(-127, 128, (nb, Bk, Sk, H)), jnp.int8)
forms = {
    'QK dot, codes cast to bf16': (q, lambda q, c: jnp.einsum('BGH,BSH->BGS', q, c.astype(jnp.bfloat16), preferred_element_type=F32)),
    'QK multiply-and-sum, f32': (q, lambda q, c: (q.astype(F32)[:, :, None, :] * c.astype(F32)[:, None]).sum(-1)),
    'PV dot, codes cast to f32': (p, lambda p, c: jnp.einsum('BGS,BSH->BGH', p, c.astype(F32))),
    'PV multiply-and-sum, f32': (p, lambda p, c: (p[:, :, :, None] * c.astype(F32)[:, None]).sum(2)),
}
compiled = {}
for name, (a, fn) in forms.items():
  def scan(a, c, fn=fn):
    return jax.lax.scan(lambda acc, blk: (acc + fn(a, blk).sum(), None), jnp.zeros((), F32), c)[0]
  compiled[name] = (jax.jit(scan).lower(a, codes).compile(), a)
res = collections.defaultdict(list)
for _ in range(3):
  for name, (c, a) in compiled.items():
    res[name].append(tm(lambda: c(a, codes)) / nb)
for name in compiled:
  print(f'one block alone: {name:28s} {statistics.median(res[name]):.3f} ms', flush=True)

# 2. the decode step of one layer
src = open(blockwise.__file__).read().replace(
    'block_sizes = gin.external_configurable(BlockSizes, "blockwise")', '')
old = '''      logits_BxKxGxTqxSk = jnp.einsum(
          "BKGTH,BKSH->BKGTS", q_BxKxGxTqxH, k_blk, precision=prep.einsum,
          preferred_element_type=expected["logits"])'''
assert old in src
src = src.replace(old, '''      logits_BxKxGxTqxSk = (q_BxKxGxTqxH[:, :, :, 0].astype(F32)[:, :, :, None, :]
                            * k_blk.astype(F32)[:, :, None, :, :]).sum(-1)[:, :, :, None]''')
mulsum = types.ModuleType('blockwise_mulsum')
exec(compile(src, 'blockwise_mulsum', 'exec'), mulsum.__dict__)
B, S, K = 8, 4001, 3
flags = contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
st8 = contract.CacheStorage(k_dtype="int8", v_dtype="int8", k_scale="token", v_scale="token")
q1 = jnp.asarray(rng.standard_normal((B, 1, K * G, H)), jnp.bfloat16)
kc, vc = (jnp.asarray(rng.integers(-127, 128, (B, K, S, H)), jnp.int8) for _ in 'kv')
ku, vu = (jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.bfloat16), jnp.uint16) for _ in 'kv')
sc = contract.KVScales(k_token_BxKxS=jnp.asarray(rng.random((B, K, S)) * 0.01, F32),
                       v_token_BxKxS=jnp.asarray(rng.random((B, K, S)) * 0.01, F32))
T = lambda x: jnp.transpose(x, (0, 2, 1, 3))  # noqa: E731
U = lambda x: jax.lax.bitcast_convert_type(x, jnp.bfloat16)  # noqa: E731
steps = {
    'int8 cache, kernel as it is': (lambda: blockwise.blockwise_attention(q1, T(kc), T(vc), flags=flags, kv_cache=st8, kv_scales=sc, causal=True)),
    'int8 cache, QK multiply-and-sum': (lambda: mulsum.blockwise_attention(q1, T(kc), T(vc), flags=flags, kv_cache=st8, kv_scales=sc, causal=True)),
    'bf16 cache (uint16 bits)': (lambda: blockwise.blockwise_attention(q1, T(U(ku)), T(U(vu)), flags=flags, causal=True)),
}
cs = {n: jax.jit(f).lower().compile() for n, f in steps.items()}
a, b = (np.asarray(cs[n](), np.float32) for n in list(cs)[:2])
print(f'one layer step: int8 forms differ by at most {np.abs(a - b).max():.3g} (outputs of O(1), bf16)')
res = collections.defaultdict(list)
for _ in range(5):
  for n, c in cs.items():
    res[n].append(tm(c, R=15))
ref = statistics.median(res['bf16 cache (uint16 bits)'])
for n in cs:
  m = statistics.median(res[n])
  print(f'one layer step: {n:32s} {m:.2f} ms  {m / ref:.2f}x the bf16 cache', flush=True)

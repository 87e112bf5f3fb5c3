"""One-off: the blockwise kernel with a third branch for block pairs in which every
(query, key) pair is visible (no mask pass: the logits go straight to the max and exp)
against the kernel as it is, interleaved. Both flags (the branch exists only where the
softmax runs in float32: it was measured 2.4x slower with the flags off, long ago).
SmolLM2's heads (9 over 3) and Qwen2.5-Coder-0.5B's (14 over 2), H = 64, bf16, causal;
prefill at 1000 and 4096 tokens, and a decode step (batch 8, a cache of 4001; a bf16
cache passed as bf16 arrays, and an int8 cache with per-token scales). The variant is
made from the kernel's own source by replacements that each must match once (so it
follows the kernel as it changes); outputs are checked finite (a case that is not stops
the run) and compared bit for bit. From the repository root:
  .venv/bin/python results/attention-xla-cpu/maskfree_ab.py  (maskfree_ab.txt)
"""
import collections, os, statistics, sys, time, types
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import contract, cpu_features
from attnprec.checkpoints.finite import require_finite
from attnprec.kernels import blockwise

src = open(blockwise.__file__).read().replace(
    'block_sizes = gin.external_configurable(BlockSizes, "blockwise")', '')


def rep(old, new):
  global src
  assert src.count(old) == 1, old
  src = src.replace(old, new)


rep("  def kv_step(i, q_BxKxGxTqxH, qpos_BxTq, carry, j):",
    "  def kv_step(i, q_BxKxGxTqxH, qpos_BxTq, carry, j, masked=True):")
rep("""    if clamp:   # a key of the overlapped last block counts once: from j * Sk on
      allowed""", """    if not masked:
      pass
    elif clamp:   # a key of the overlapped last block counts once: from j * Sk on
      allowed""")
rep("""    if structured:
      kpos_BxSk""", """    if masked and structured:
      kpos_BxSk""")
rep("""    if dense_mask is not None:
      allowed = allowed & _mask_block""", """    if masked and dense_mask is not None:
      allowed = allowed & _mask_block""")
rep("""    logits_BxKxGxTqxSk = jnp.where(allowed, logits_BxKxGxTqxSk,
                                   jnp.asarray(contract.mask_value(sm), sm))""",
    """    if masked:
      logits_BxKxGxTqxSk = jnp.where(allowed, logits_BxKxGxTqxSk,
                                     jnp.asarray(contract.mask_value(sm), sm))""")
rep("""      step = lambda cr: kv_step(i, q_BxKxGxTqxH, qpos_BxTq, cr, j)
      return jax.lax.cond(need_NQxNK[i, j], step, lambda cr: cr, carry), None""",
    """      step = lambda cr: kv_step(i, q_BxKxGxTqxH, qpos_BxTq, cr, j)
      if full_NQxNK is None:
        return jax.lax.cond(need_NQxNK[i, j], step, lambda cr: cr, carry), None
      free = lambda cr: kv_step(i, q_BxKxGxTqxH, qpos_BxTq, cr, j, masked=False)
      branch = jnp.where(full_NQxNK[i, j], 2, need_NQxNK[i, j].astype(jnp.int32))
      return jax.lax.switch(branch, [lambda cr: cr, step, free], carry), None""")
rep("""  structured = causal or sliding_window is not None""",
    """  structured = causal or sliding_window is not None
  full_NQxNK = None
  if structured and mask is None and sm == F32:
    full_NQxNK = _blocks_full(q_pos_BxTp, k_pos_BxSp, T, S, Tq, Sk, causal=causal,
                              sliding_window=sliding_window)""")
src += '''

def _blocks_full(q_pos_BxTp, k_pos_BxSp, T, S, Tq, Sk, *, causal, sliding_window):
  """[nq, nk] bool: every valid query of block i sees every key of block j, and block j
  holds Sk real keys (no padding, no overlap with the block before)."""
  big = jnp.iinfo(jnp.int32).max // 2
  Tp, Sp = q_pos_BxTp.shape[1], k_pos_BxSp.shape[1]
  q_valid = jnp.arange(Tp) < T
  qmin = jnp.where(q_valid, q_pos_BxTp, big).reshape(-1, Tp // Tq, Tq).min((0, 2))
  qmax = jnp.where(q_valid, q_pos_BxTp, -big).reshape(-1, Tp // Tq, Tq).max((0, 2))
  kmin = k_pos_BxSp.reshape(-1, Sp // Sk, Sk).min((0, 2))
  kmax = k_pos_BxSp.reshape(-1, Sp // Sk, Sk).max((0, 2))
  full = jnp.broadcast_to(((jnp.arange(Sp // Sk) + 1) * Sk <= S)[None, :],
                          (Tp // Tq, Sp // Sk))
  if causal:
    full &= kmax[None, :] <= qmin[:, None]
  if sliding_window is not None:
    full &= kmin[None, :] > qmax[:, None] - sliding_window
  return full
'''
variant = types.ModuleType('blockwise_maskfree')
exec(compile(src, 'blockwise_maskfree', 'exec'), variant.__dict__)


def tm(fn, calls):
  jax.block_until_ready(fn()); ts = []
  for _ in range(calls):
    t = time.perf_counter(); jax.block_until_ready(fn()); ts.append(time.perf_counter() - t)
  return statistics.median(ts) * 1e3


rng = np.random.default_rng(0)
BF, F32 = jnp.bfloat16, jnp.float32
flags = contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
cases = []
for name, N, K in (("smollm2", 9, 3), ("qwen2.5-coder-0.5b", 14, 2)):
  for S in (1000, 4096):
    q, k, v = (jnp.asarray(rng.standard_normal((1, S, n, 64)), BF) for n in (N, K, K))
    cases.append((f"{name} prefill {S}", (q, k, v), {}))
B, S, K, G, H = 8, 4001, 3, 3, 64
q1 = jnp.asarray(rng.standard_normal((B, 1, K * G, H)), BF)
kb, vb = (jnp.asarray(rng.standard_normal((B, S, K, H)), BF) for _ in "kv")
pos = jnp.full((B, 1), S - 1)
cases.append(("smollm2 decode 8x4001, bf16", (q1, kb, vb), dict(q_positions_BxT=pos)))
st8 = contract.CacheStorage(k_dtype="int8", v_dtype="int8", k_scale="token", v_scale="token")
kc, vc = (jnp.asarray(rng.integers(-127, 128, (B, S, K, H)), jnp.int8) for _ in "kv")
sc = contract.KVScales(k_token_BxKxS=jnp.asarray(rng.random((B, K, S)) * 0.01, F32),
                       v_token_BxKxS=jnp.asarray(rng.random((B, K, S)) * 0.01, F32))
cases.append(("smollm2 decode 8x4001, int8", (q1, kc, vc),
              dict(q_positions_BxT=pos, kv_cache=st8, kv_scales=sc)))
ROUNDS, CALLS = 7, 5
print(f"CPU: {cpu_features.describe()}; jax {jax.__version__}; both flags; {ROUNDS} "
      f"interleaved rounds of {CALLS} calls, medians", flush=True)


def blocks_taken(T, S, Tq, Sk, B=1):
  """(blocks the mask-free branch takes, blocks computed) for causal attention of the
  last T of S positions, as the kernel pads and positions them."""
  Tp, Sp = -(-T // Tq) * Tq, -(-S // Sk) * Sk
  q_pos = jnp.pad(jnp.broadcast_to(jnp.arange(S - T, S), (B, T)), ((0, 0), (0, Tp - T)))
  k_pos = jnp.pad(jnp.broadcast_to(jnp.arange(S), (B, S)), ((0, 0), (0, Sp - S)))
  kw = dict(causal=True, sliding_window=None)
  full = variant._blocks_full(q_pos, k_pos, T, S, Tq, Sk, **kw)
  need = variant._blocks_needed(q_pos, k_pos, T, S, Tq, Sk, **kw)
  assert bool((need | ~full).all()), "a fully visible block the kernel would skip"
  return int(full.sum()), int(need.sum())


for T, S, Sk in ((1000, 1000, 256), (4096, 4096, 256), (1, 4001, 512)):
  taken, computed = blocks_taken(T, S, min(512, T), Sk, B=1 if T > 1 else 8)
  print(f"T = {T}, S = {S}: the mask-free branch takes {taken} of the {computed} blocks "
        f"computed", flush=True)
for label, args, kw in cases:
  fns = {m: jax.jit(lambda *a, m=m: m.blockwise_attention(*a, causal=True, flags=flags, **kw))
         for m in (blockwise, variant)}
  a, b = (require_finite(f"the output of {label}, {'variant' if m is variant else 'kernel'}",
                         np.asarray(f(*args), np.float32)) for m, f in fns.items())
  res = collections.defaultdict(list)
  for _ in range(ROUNDS):
    for m, f in fns.items():
      res[m].append(tm(lambda: f(*args), CALLS))
  t0, t1 = statistics.median(res[blockwise]), statistics.median(res[variant])
  print(f"{label:36s} as is {t0:8.2f} ms   mask-free branch {t1:8.2f} ms   {t1 / t0:.2f}x   "
        f"bit-identical: {np.array_equal(a, b)}", flush=True)

"""One-off: would bf16 probabilities into the wv dot (flash attention's and torch's choice)
close the blockwise kernel's gap to torch SDPA bf16? The kernel as it is (both flags: f32
logits, f32 softmax, f32 probabilities into the wv dot) against a copy whose wv dot takes
the probabilities and values in bf16 (f32 accumulation), and torch SDPA bf16; causal
prefill at SmolLM2's attention shape (N=9, K=3, H=64), batch 1, interleaved rounds, and
each kernel's max error against the float64 reference (S <= 4096). From the repository
root:  S=4096 .venv/bin/python results/attention-probs/probs_ab.py   (probs_ab.txt)"""
import collections, os, statistics, sys, time, types
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np, torch
from attnprec import contract
from attnprec.kernels import blockwise

src = open(blockwise.__file__).read()
src = src.replace('block_sizes = gin.external_configurable(BlockSizes, "blockwise")', '')
old = '"BKGTS,BKSH->BKGTH", probs_BxKxGxTqxSk, v_blk.astype(expected["probs"]),'
assert old in src
src = src.replace(old, '"BKGTS,BKSH->BKGTH", probs_BxKxGxTqxSk.astype(c), v_blk.astype(c),')
bf16p_mod = types.ModuleType('blockwise_bf16_probs')
exec(compile(src, 'blockwise_bf16_probs', 'exec'), bf16p_mod.__dict__)

flags = contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
S = int(os.environ.get('S', 4096)); K, G, H = 3, 3, 64; N = K * G
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((1, S, N, H)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((1, S, K, H)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((1, S, K, H)), jnp.bfloat16)
f32p = jax.jit(lambda q, k, v: blockwise.blockwise_attention(q, k, v, flags=flags, causal=True)).lower(q, k, v).compile()
bf16p = jax.jit(lambda q, k, v: bf16p_mod.blockwise_attention(q, k, v, flags=flags, causal=True)).lower(q, k, v).compile()
torch.set_num_threads(2)
tq, tk, tv = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).to(torch.bfloat16).transpose(1, 2) for x in (q, k, v))

def sdpa():
  with torch.no_grad():
    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)

print('CPU:', __import__('attnprec.cpu_features', fromlist=['x']).describe(), f'S={S}', flush=True)
if S <= 4096:
  ref = np.asarray(contract.reference_attention_np(q, k, v, mask=np.tril(np.ones((S, S), bool))[None, None]))
  for name, fn in (('f32 probs', f32p), ('bf16 probs', bf16p)):
    out = np.asarray(fn(q, k, v), np.float64)
    print(f'{name}: max |error| against float64 {np.abs(out - ref).max():.3g}, '
          f'mean {np.abs(out - ref).mean():.3g}', flush=True)

def tm(fn, R=5):
  fn(); ts = []
  for _ in range(R):
    t = time.perf_counter(); r = fn()
    if not isinstance(r, torch.Tensor):
      jax.block_until_ready(r)
    ts.append(time.perf_counter() - t)
  return statistics.median(ts) * 1e3

res = collections.defaultdict(list)
for _ in range(3):
  res['f32 probs'].append(tm(lambda: f32p(q, k, v)))
  res['bf16 probs'].append(tm(lambda: bf16p(q, k, v)))
  res['torch sdpa bf16'].append(tm(sdpa))
med = {k_: statistics.median(v_) for k_, v_ in res.items()}
for k_, v_ in med.items():
  print(f'{k_:16s} {v_:8.1f} ms  {v_ / med["torch sdpa bf16"]:.2f}x torch  {v_ / med["f32 probs"]:.2f}x f32 probs')

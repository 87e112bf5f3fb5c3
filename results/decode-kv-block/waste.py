"""One-off: the blockwise decode step of one SmolLM2 layer (K=3, G=3, H=64) over a cache of
S positions with the query at position p (a cache allocated longer than what it holds, as
a generation's is), for each decode_kv_block in DKS, interleaved; a bf16 cache (as uint16
bits, as the model stores it) and an int8 one. From the repository root:
  .venv/bin/python results/decode-kv-block/waste.py > results/decode-kv-block/waste.txt"""
import os, sys, time, statistics, collections
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import contract
from attnprec.kernels import blockwise
K,G,H=3,3,64; N=K*G
flags=contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
st8=contract.CacheStorage(k_dtype="int8",v_dtype="int8",k_scale="token",v_scale="token")
DKS=[int(x) for x in os.environ.get('DK','512,1024,2048').split(',')]
rng=np.random.default_rng(0)
def tm(fn,R=15):
  fn(); ts=[]
  for _ in range(R):
    t=time.perf_counter(); jax.block_until_ready(fn()); ts.append(time.perf_counter()-t)
  return statistics.median(ts)*1e3
for B,S,p in [(1,2048,1100),(1,4096,2100),(1,16384,1000),(1,16384,9000),(8,4096,2100),(8,16384,5000)]:
  q=jnp.asarray(rng.standard_normal((B,1,N,H)),jnp.bfloat16)
  kb=jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((B,K,S,H)),jnp.bfloat16),jnp.uint16)
  vb=jax.lax.bitcast_convert_type(jnp.asarray(rng.standard_normal((B,K,S,H)),jnp.bfloat16),jnp.uint16)
  kc=jnp.asarray(rng.integers(-127,128,(B,K,S,H)),jnp.int8); vc=jnp.asarray(rng.integers(-127,128,(B,K,S,H)),jnp.int8)
  sc=contract.KVScales(k_token_BxKxS=jnp.asarray(rng.random((B,K,S))*0.01,jnp.float32), v_token_BxKxS=jnp.asarray(rng.random((B,K,S))*0.01,jnp.float32))
  qpos=jnp.full((B,1),p,jnp.int32); kpos=jnp.broadcast_to(jnp.arange(S,dtype=jnp.int32),(B,S))
  C={}
  for dk in DKS:
    bs=blockwise.BlockSizes(decode_kv_block=dk)
    def fb(q,kb,vb,bs=bs):
      kb,vb=(jax.lax.bitcast_convert_type(x,jnp.bfloat16) for x in (kb,vb))
      return blockwise.blockwise_attention(q,jnp.transpose(kb,(0,2,1,3)),jnp.transpose(vb,(0,2,1,3)),flags=flags,block_sizes=bs,causal=True,q_positions_BxT=qpos,k_positions_BxS=kpos)
    def f8(q,kc,vc,sc,bs=bs):
      return blockwise.blockwise_attention(q,jnp.transpose(kc,(0,2,1,3)),jnp.transpose(vc,(0,2,1,3)),flags=flags,kv_cache=st8,kv_scales=sc,block_sizes=bs,causal=True,q_positions_BxT=qpos,k_positions_BxS=kpos)
    C[dk]=(jax.jit(fb).lower(q,kb,vb).compile(), jax.jit(f8).lower(q,kc,vc,sc).compile())
  res=collections.defaultdict(list)
  for r in range(5):
    for dk,(a,b) in C.items():
      res[(dk,'bf16')].append(tm(lambda: a(q,kb,vb))); res[(dk,'int8')].append(tm(lambda: b(q,kc,vc,sc)))
  m={k:statistics.median(v) for k,v in res.items()}
  print(f'B={B} S={S} pos={p}: '+'  '.join(f'{dk}: bf16 {m[(dk,"bf16")]:.2f} ({m[(dk,"bf16")]/m[(DKS[0],"bf16")]:.2f}x) int8 {m[(dk,"int8")]:.2f} ({m[(dk,"int8")]/m[(DKS[0],"int8")]:.2f}x)' for dk in DKS), flush=True)

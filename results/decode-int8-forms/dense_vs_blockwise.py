"""One-off: one layer's decode step (SmolLM2's attention shape, batch 8, cache 4001, both
flags) on the blockwise kernel and on the dense kernel over the whole cache, for a cache of
uint16 bits (as the model stores bf16), one stored as bf16, and an int8 one. From the
repository root:
  .venv/bin/python results/decode-int8-forms/dense_vs_blockwise.py > results/decode-int8-forms/dense_vs_blockwise.txt"""
import os, sys, time, statistics, collections
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import contract
from attnprec.kernels import blockwise, dot_product
B,S,K,G,H = int(os.environ.get('B',8)),4001,3,3,64
N=K*G
rng=np.random.default_rng(0)
q=jnp.asarray(rng.standard_normal((B,1,N,H)),jnp.bfloat16)
kbf=jnp.asarray(rng.standard_normal((B,K,S,H)),jnp.bfloat16); vbf=jnp.asarray(rng.standard_normal((B,K,S,H)),jnp.bfloat16)
ku=jax.lax.bitcast_convert_type(kbf,jnp.uint16); vu=jax.lax.bitcast_convert_type(vbf,jnp.uint16)
kc=jnp.asarray(rng.integers(-127,128,(B,K,S,H)),jnp.int8); vc=jnp.asarray(rng.integers(-127,128,(B,K,S,H)),jnp.int8)
sc=contract.KVScales(k_token_BxKxS=jnp.asarray(rng.random((B,K,S))*0.01,jnp.float32), v_token_BxKxS=jnp.asarray(rng.random((B,K,S))*0.01,jnp.float32))
flags=contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
st8=contract.CacheStorage(k_dtype="int8",v_dtype="int8",k_scale="token",v_scale="token")
qpos=jnp.full((B,1),S-1,jnp.int32); kpos=jnp.broadcast_to(jnp.arange(S,dtype=jnp.int32),(B,S))
T=lambda x: jnp.transpose(x,(0,2,1,3))
U=lambda x: jax.lax.bitcast_convert_type(x,jnp.bfloat16)
from attnprec.contract import CausalMask
cm=CausalMask(qpos,kpos)
forms={
 'blockwise_u16': (lambda q,k,v: blockwise.blockwise_attention(q,T(U(k)),T(U(v)),flags=flags,causal=True,q_positions_BxT=qpos,k_positions_BxS=kpos), (q,ku,vu)),
 'blockwise_bf16': (lambda q,k,v: blockwise.blockwise_attention(q,T(k),T(v),flags=flags,causal=True,q_positions_BxT=qpos,k_positions_BxS=kpos), (q,kbf,vbf)),
 'dot_u16': (lambda q,k,v: dot_product.dot_product_attention(q,T(U(k)),T(U(v)),flags=flags,mask=cm.dense()), (q,ku,vu)),
 'dot_bf16': (lambda q,k,v: dot_product.dot_product_attention(q,T(k),T(v),flags=flags,mask=cm.dense()), (q,kbf,vbf)),
 'blockwise_i8': (lambda q,k,v,s: blockwise.blockwise_attention(q,T(k),T(v),flags=flags,kv_cache=st8,kv_scales=s,causal=True,q_positions_BxT=qpos,k_positions_BxS=kpos), (q,kc,vc,sc)),
 'dot_i8': (lambda q,k,v,s: dot_product.dot_product_attention(q,T(k),T(v),flags=flags,kv_cache=st8,kv_scales=s,mask=cm.dense()), (q,kc,vc,sc)),
}
C={n:(jax.jit(f).lower(*a).compile(),a) for n,(f,a) in forms.items()}
def tm(c,a,R=15):
  c(*a); ts=[]
  for _ in range(R):
    t=time.perf_counter(); jax.block_until_ready(c(*a)); ts.append(time.perf_counter()-t)
  return statistics.median(ts)*1e3
res=collections.defaultdict(list)
for r in range(5):
  for n,(c,a) in C.items(): res[n].append(tm(c,a))
for n in C: print('%-16s %.2f ms'%(n,statistics.median(res[n])))

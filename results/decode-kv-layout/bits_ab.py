"""One-off: the decode step with the blockwise kernel before / after it read 16-bit caches
as bits per block, interleaved in one process. The old kernel first:
  git show 5008ca5:attnprec/kernels/blockwise.py > /tmp/exp/blockwise_old.py
then, from the repository root (CASES: preset:form, form old / new / new_b1):
  B=8 P=4000 .venv/bin/python results/decode-kv-layout/bits_ab.py
  B=1 P=1000 R=15 CASES=bf16_flags:old,bf16_flags:new_b1 .venv/bin/python ...
(written when batch 1 was still an exception: new_b1 forced the cache-major read there;
the kernel now has no switch, so 'new' and 'new_b1' are the same program)."""
import os, sys, time, statistics, types
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, numpy as np, jax.numpy as jnp
from attnprec import checkpoints
from attnprec.kernels import blockwise
from attnprec.bench import model as MB
src = open('/tmp/exp/blockwise_old.py').read().replace('gin.external_configurable(BlockSizes, "blockwise")', 'None')
old = types.ModuleType('blockwise_old'); exec(compile(src, 'blockwise_old', 'exec'), old.__dict__)
new_fn = blockwise.blockwise_attention
def old_fn(*a, block_sizes=blockwise.BlockSizes(), **kw):
  bs = old.BlockSizes(q_block=block_sizes.q_block, kv_block=block_sizes.kv_block, decode_kv_block=block_sizes.decode_kv_block)
  return old.blockwise_attention(*a, block_sizes=bs, **kw)
B=int(os.environ.get('B',8)); P=int(os.environ.get('P',4000))
ckpt=checkpoints.load('smollm2-135m')
prompt=np.random.default_rng(0).integers(0,ckpt.config.vocab_size,(B,P)).astype(np.int32)
carried={}; cases={}
for spec in os.environ.get('CASES','bf16_flags:old,bf16_flags:new,bf16_flags_kv_int8:old,bf16_flags_kv_int8:new').split(','):
  preset, form = spec.split(':')
  blockwise.blockwise_attention = old_fn if form == 'old' else new_fn
  jax.clear_caches()
  getattr(MB._programs, 'cache_clear', lambda: None)()
  cases[spec] = MB._AttnprecCase(ckpt.config, ckpt.params, MB.PRESETS[preset], prompt, 1, carried=carried)
  print('built', spec, flush=True)
blockwise.blockwise_attention = new_fn
ts={k: [] for k in cases}; outs={}
for r in range(int(os.environ.get('R', 9))):
  for k, c in cases.items():
    c.decode(); ts[k].append(c.decode())
for k, c in cases.items():
  st = jax.tree_util.tree_map(jnp.copy, c.state0)
  outs[k] = jax.tree_util.tree_leaves(c._decode(c.params, st, c.first))
med = {k: statistics.median(v) for k, v in ts.items()}
for k in ts: print('%-28s %.1f ms' % (k, 1e3 * med[k]))
base = {k.split(':')[0]: med[k] for k in med if k.endswith(':old')}
for k in med:
  p = k.split(':')[0]
  if p in base and not k.endswith(':old'): print(k, 'vs old %.3f' % (med[k] / base[p]))
for k in outs:
  p = k.split(':')[0] + ':old'
  if p in outs and k != p:
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(outs[k], outs[p]))
    print(k, 'outputs bit-identical to old:', same)

"""One-off: the decode step with the blockwise kernel of an older commit ('old') and of the
working tree ('new'), interleaved in one process, and whether their outputs are
bit-identical. The old kernel first, then from the repository root:
  git show 97b9500:attnprec/kernels/blockwise.py > /tmp/exp/blockwise_old.py
  .venv/bin/python results/decode-kv-layout/decode_ab.py             (decode_ab.txt)
  git show 5008ca5:attnprec/kernels/blockwise.py > /tmp/exp/blockwise_old.py
  B=8 P=4000 .venv/bin/python results/decode-kv-layout/decode_ab.py  (bits_ab.txt)
  B=1 P=1000 R=15 CASES=bf16_flags:old,bf16_flags:new .venv/bin/python ...
  git show 3924b33:attnprec/kernels/blockwise.py > /tmp/exp/blockwise_old.py
  B=8 P=4000 CASES=bf16_flags_kv_fp8:old,bf16_flags_kv_fp8:new,bf16_flags:old,bf16_flags:new \
    .venv/bin/python results/decode-kv-layout/decode_ab.py           (fp8_ab.txt)
B batch, P prompt (the cache holds P + 1), R rounds, CASES preset:form pairs (forms old /
new; bits_ab.txt's 'new_b1' rows ran the working tree of their day with its batch-1
exception forced off, the form the kernel now always has)."""
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
ckpt=checkpoints.load(os.environ.get('M','smollm2-135m'))
prompt=np.random.default_rng(0).integers(0,ckpt.config.vocab_size,(B,P)).astype(np.int32)
carried={}; cases={}
for spec in os.environ.get('CASES','bf16_flags:old,bf16_flags:new,bf16_flags_kv_int8:old,bf16_flags_kv_int8:new').split(','):
  preset, form = spec.split(':')
  blockwise.blockwise_attention = old_fn if form == 'old' else new_fn
  jax.clear_caches(); MB._programs.cache_clear()        # a fresh trace per form
  cases[spec] = MB._AttnprecCase(ckpt.config, ckpt.params, MB.PRESETS[preset], prompt, 1, carried=carried)
  print('built', spec, flush=True)
blockwise.blockwise_attention = new_fn
ts={k: [] for k in cases}
for r in range(int(os.environ.get('R', 9))):
  for k, c in cases.items():
    c.decode(); ts[k].append(c.decode())
outs = {k: jax.tree_util.tree_leaves(c._decode(c.params, jax.tree_util.tree_map(jnp.copy, c.state0), c.first))
        for k, c in cases.items()}
med = {k: statistics.median(v) for k, v in ts.items()}
for k in ts: print('%-28s %.1f ms' % (k, 1e3 * med[k]))
for k in med:
  p = k.split(':')[0] + ':old'
  if p in med and k != p:
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(outs[k], outs[p]))
    print(k, 'vs old %.3f, outputs bit-identical: %s' % (med[k] / med[p], same))
bf, i8 = ('bf16_flags:new', 'bf16_flags_kv_int8:new')
if bf in med and i8 in med:
  print('int8/bf16 new %.3f' % (med[i8] / med[bf]))

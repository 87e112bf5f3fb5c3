"""One-off: the decode step at B x P (cache P + 1) with the blockwise kernel before / after
it read the cache as it lies, interleaved in one process. The old kernel first:
  git show 97b9500:attnprec/kernels/blockwise.py > /tmp/exp/blockwise_old.py
then, from the repository root: .venv/bin/python results/decode-kv-layout/decode_ab.py
(P=4015 for a cache of 4016)."""
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
model=os.environ.get('M','smollm2-135m'); B=int(os.environ.get('B',8)); P=int(os.environ.get('P',4000))
ckpt=checkpoints.load(model)
prompt=np.random.default_rng(0).integers(0,ckpt.config.vocab_size,(B,P)).astype(np.int32)
carried={}; cases={}
for preset in os.environ.get('PRE','bf16_flags,bf16_flags_kv_int8').split(','):
  for form, fn in (('old', old_fn), ('new', new_fn)):
    blockwise.blockwise_attention = fn
    MB._programs.cache_clear() if hasattr(MB._programs, 'cache_clear') else None
    cases[(preset, form)] = MB._AttnprecCase(ckpt.config, ckpt.params, MB.PRESETS[preset], prompt, 1, carried=carried)
    print('built', preset, form, flush=True)
blockwise.blockwise_attention = new_fn
ts={k: [] for k in cases}
for r in range(int(os.environ.get('R', 9))):
  for k, c in cases.items():
    c.decode(); ts[k].append(c.decode())
for k in ts: print(k, '%.1f ms' % (1e3 * statistics.median(ts[k])))
for preset in {p for p, _ in cases}:
  print(preset, 'new/old %.3f' % (statistics.median(ts[(preset, 'new')]) / statistics.median(ts[(preset, 'old')])))
bo, bn = (statistics.median(ts[('bf16_flags', f)]) for f in ('old', 'new'))
io, inn = (statistics.median(ts[('bf16_flags_kv_int8', f)]) for f in ('old', 'new'))
print('int8/bf16 old %.3f new %.3f' % (io / bo, inn / bn))

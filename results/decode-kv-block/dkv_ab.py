"""One-off: the decode step under several `decode_kv_block` sizes, interleaved in one
process, per case (batch x prompt) and preset. From the repository root:
  nohup .venv/bin/python results/decode-kv-block/dkv_ab.py > results/decode-kv-block/dkv_ab.txt &
Env: DK block sizes (first is the reference), CASES BxP list, PRESETS, R rounds, M model.
Prints each step's median, its ratio to the reference size, whether the outputs are
bit-identical to the reference's (they need not be: the online softmax's blocks change),
and int8 / bf16 per size. A case whose logits are not finite is not timed
(`MB.ab_cases`; added after dkv_ab.txt was recorded)."""
import dataclasses, os, statistics, sys
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import cpu_features
from attnprec.bench import model as MB
from attnprec.bench.cases import parse_cases
from attnprec.kernels.blockwise import BlockSizes

DKS = [int(x) for x in os.environ.get('DK', '512,1024,2048').split(',')]
CASES = parse_cases(os.environ.get('CASES', '8x4000,1x4000,1x1000'))
PRESETS = os.environ.get('PRESETS', 'bf16_flags,bf16_flags_kv_int8').split(',')
R = int(os.environ.get('R', 9))
print('CPU:', cpu_features.describe(), flush=True)
forms = {dk: lambda p, dk=dk: dataclasses.replace(p, block_sizes=BlockSizes(decode_kv_block=dk))
         for dk in DKS}
for B, P, cases in MB.ab_cases(CASES, PRESETS, forms, model=os.environ.get('M', 'smollm2-135m')):
  ts = {k: [] for k in cases}
  for _ in range(R):
    for k, c in cases.items():
      c.decode(); ts[k].append(c.decode())
  outs = {k: jax.tree_util.tree_leaves(c._decode(c.params, jax.tree_util.tree_map(jnp.copy, c.state0), c.first))
          for k, c in cases.items()}
  med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
  for (preset, dk), ms in med.items():
    ref = (preset, DKS[0])
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(outs[(preset, dk)], outs[ref]))
    print(f'{B}x{P} {preset:20s} decode_kv_block {dk:5d}: {ms:7.1f} ms  {ms / med[ref]:.3f}x  '
          f'bit-identical to {DKS[0]}: {same}', flush=True)
  if len(PRESETS) == 2:
    for dk in DKS:
      print(f'{B}x{P} decode_kv_block {dk:5d}: {PRESETS[1]} / {PRESETS[0]} = '
            f'{med[(PRESETS[1], dk)] / med[(PRESETS[0], dk)]:.3f}', flush=True)
  del cases, outs

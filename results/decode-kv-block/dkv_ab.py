"""One-off: the decode step under several `decode_kv_block` sizes, interleaved in one
process, per case (batch x prompt) and preset. From the repository root:
  nohup .venv/bin/python results/decode-kv-block/dkv_ab.py > results/decode-kv-block/dkv_ab.txt &
Env: DK block sizes (first is the reference), CASES BxP list, PRESETS, R rounds, M model.
Prints each step's median, its ratio to the reference size, whether the outputs are
bit-identical to the reference's (they need not be: the online softmax's blocks change),
and int8 / bf16 per size."""
import dataclasses, os, statistics, sys
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import checkpoints, cpu_features
from attnprec.bench import model as MB
from attnprec.kernels.blockwise import BlockSizes

DKS = [int(x) for x in os.environ.get('DK', '512,1024,2048').split(',')]
CASES = [tuple(int(v) for v in c.split('x')) for c in os.environ.get('CASES', '8x4000,1x4000,1x1000').split(',')]
PRESETS = os.environ.get('PRESETS', 'bf16_flags,bf16_flags_kv_int8').split(',')
R = int(os.environ.get('R', 9))
ckpt = checkpoints.load(os.environ.get('M', 'smollm2-135m'))
print('CPU:', cpu_features.describe(), flush=True)
for B, P in CASES:
  prompt = np.random.default_rng(0).integers(0, ckpt.config.vocab_size, (B, P)).astype(np.int32)
  carried, cases = {}, {}
  for preset in PRESETS:
    for dk in DKS:
      prec = dataclasses.replace(MB.PRESETS[preset], block_sizes=BlockSizes(decode_kv_block=dk))
      cases[(preset, dk)] = MB._AttnprecCase(ckpt.config, ckpt.params, prec, prompt, 1, carried=carried)
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

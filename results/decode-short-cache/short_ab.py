"""One-off: the decode step over a short cache (below `kernels.AUTO_MIN_KEYS`), the dense
kernel (what 'auto' runs there: `bf16_flags`, and `bf16_flags_kv_int8`) against blockwise
(`bf16_flags_blockwise`, and the int8 preset with kernel 'blockwise'), interleaved per
case, SmolLM2, medians of R rounds. From the repository root:
  .venv/bin/python results/decode-short-cache/short_ab.py > results/decode-short-cache/short_ab.txt"""
import dataclasses, os, statistics, sys
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import checkpoints, cpu_features
from attnprec.bench import model as MB

CASES = [tuple(int(v) for v in c.split('x')) for c in os.environ.get(
    'CASES', '1x32,1x128,1x300,1x500,8x32,8x128,8x300,8x500').split(',')]
R = int(os.environ.get('R', 9))
FORMS = {
    'bf16 cache, dense (auto)': MB.PRESETS['bf16_flags'],
    'bf16 cache, blockwise': MB.PRESETS['bf16_flags_blockwise'],
    'int8 cache, dense (auto)': MB.PRESETS['bf16_flags_kv_int8'],
    'int8 cache, blockwise': dataclasses.replace(MB.PRESETS['bf16_flags_kv_int8'], kernel='blockwise'),
}
ckpt = checkpoints.load(os.environ.get('M', 'smollm2-135m'))
print('CPU:', cpu_features.describe(), flush=True)
for B, P in CASES:
  prompt = np.random.default_rng(0).integers(0, ckpt.config.vocab_size, (B, P)).astype(np.int32)
  carried = {}
  cases = {n: MB._AttnprecCase(ckpt.config, ckpt.params, p, prompt, 1, carried=carried)
           for n, p in FORMS.items()}
  ts = {n: [] for n in cases}
  for _ in range(R):
    for n, c in cases.items():
      c.decode(); ts[n].append(c.decode())
  med = {n: statistics.median(v) * 1e3 for n, v in ts.items()}
  print(f'{B}x{P} (cache {P + 1}): ' + '; '.join(f'{n} {m:.1f} ms' for n, m in med.items())
        + f'; blockwise / dense: bf16 {med["bf16 cache, blockwise"] / med["bf16 cache, dense (auto)"]:.3f}, '
        f'int8 {med["int8 cache, blockwise"] / med["int8 cache, dense (auto)"]:.3f}', flush=True)
  del cases

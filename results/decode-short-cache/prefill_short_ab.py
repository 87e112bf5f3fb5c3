"""One-off: a short prefill (fewer than `kernels.AUTO_MIN_QUERIES` queries, into a cache
below `AUTO_MIN_KEYS`), the dense kernel (what 'auto' runs there: `bf16_flags`) against
blockwise (`bf16_flags_blockwise`), interleaved per case, SmolLM2, medians of R rounds.
From the repository root:
  .venv/bin/python results/decode-short-cache/prefill_short_ab.py > results/decode-short-cache/prefill_short_ab.txt"""
import os, statistics, sys
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import numpy as np
from attnprec import checkpoints, cpu_features
from attnprec.bench import model as MB

CASES = [tuple(int(v) for v in c.split('x')) for c in os.environ.get(
    'CASES', '1x64,1x128,1x200,8x64,8x128,8x200').split(',')]
R = int(os.environ.get('R', 9))
FORMS = {'dense (auto)': MB.PRESETS['bf16_flags'], 'blockwise': MB.PRESETS['bf16_flags_blockwise']}
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
      c.prefill(); ts[n].append(c.prefill())
  med = {n: statistics.median(v) * 1e3 for n, v in ts.items()}
  print(f'{B}x{P} prefill (cache {P + 1}): ' + '; '.join(f'{n} {m:.1f} ms' for n, m in med.items())
        + f'; blockwise / dense {med["blockwise"] / med["dense (auto)"]:.3f}', flush=True)
  del cases

"""One-off: for each preset, the kernel 'auto' picks over a short prompt / cache (the dense
one, before this change) against blockwise, per phase (the prefill of the prompt, or one
decode step after it), interleaved per case, SmolLM2, medians of R rounds. From the
repository root:
  .venv/bin/python results/decode-short-cache/auto_ab.py          (auto_ab.txt)
short_ab.txt and prefill_short_ab.txt beside it came from two earlier one-off scripts that
timed the same pairs (the dense kernel then being what 'auto' ran there), as
  PRESETS=bf16_flags,bf16_flags_kv_int8 PHASES=decode R=9 \\
    CASES=1x32,1x128,1x300,1x500,8x32,8x128,8x300,8x500 ...   (then R=15,
    CASES=1x64,1x200,1x500,8x64,8x200,8x400)
  PRESETS=bf16_flags PHASES=prefill R=9 CASES=1x64,1x128,1x200,8x64,8x128,8x200 ...
    (then R=11, CASES=1x16,1x32,1x64,1x200,8x16,8x32,8x200)
and printed the same figures in other words."""
import dataclasses, os, statistics, sys
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import cpu_features
from attnprec.bench import model as MB
from attnprec.bench.cases import parse_cases

CASES = parse_cases(os.environ.get('CASES', '1x32,1x200,8x32,8x200'))
PRESETS = os.environ.get('PRESETS', 'bf16,fp32').split(',')
PHASES = os.environ.get('PHASES', 'prefill,decode').split(',')
R = int(os.environ.get('R', 9))
print('CPU:', cpu_features.describe(), flush=True)
forms = {kernel: lambda p, kernel=kernel: dataclasses.replace(p, kernel=kernel)
         for kernel in ('dot_product', 'blockwise')}
# a timing of a broken program would read like any other: each case's logits are checked
for B, P, cases in MB.ab_cases(CASES, PRESETS, forms, model=os.environ.get('M', 'smollm2-135m')):
  for phase in PHASES:
    ts = {k: [] for k in cases}
    for _ in range(R):
      for k, c in cases.items():
        run = c.prefill if phase == 'prefill' else c.decode
        run(); ts[k].append(run())
    med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
    for preset in PRESETS:
      d, b = med[(preset, 'dot_product')], med[(preset, 'blockwise')]
      print(f'{B}x{P} (cache {P + 1}) {phase:7s} {preset:12s} dot_product {d:8.1f} ms, '
            f'blockwise {b:8.1f} ms: blockwise / dense {b / d:.3f}', flush=True)
  del cases

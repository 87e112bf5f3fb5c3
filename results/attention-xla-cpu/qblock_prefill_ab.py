"""One-off: the whole model's prefill under blockwise query blocks of 512 (the default)
and 256, interleaved in one process per model, bf16 + both flags (`make decode`'s
preset). The kernel alone ran 0.87-0.95x at 1000 tokens with q256/kv256 and 1.02-1.12x
at 4096 (blocks/attention_forms.md beside this). From the repository root:
  .venv/bin/python results/attention-xla-cpu/qblock_prefill_ab.py  (qblock_prefill_ab.txt)
Env: QB query block sizes (the first is the reference), CASES BxP, M models, R rounds.
Prints each prefill's median, its ratio to the reference and whether the logits are
bit-identical to the reference's (they need not be: the dots' row counts change)."""
import dataclasses, os, statistics, sys
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import numpy as np
from attnprec import cpu_features
from attnprec.bench import model as MB
from attnprec.bench.cases import parse_cases
from attnprec.kernels.blockwise import BlockSizes

QBS = [int(x) for x in os.environ.get("QB", "512,256").split(",")]
CASES = parse_cases(os.environ.get("CASES", "1x1000,1x2000,1x4000"))
R = int(os.environ.get("R", 7))
print("CPU:", cpu_features.describe(), flush=True)
forms = {qb: lambda p, qb=qb: dataclasses.replace(p, block_sizes=BlockSizes(q_block=qb))
         for qb in QBS}
for model in os.environ.get("M", "smollm2-135m,qwen2.5-coder-0.5b").split(","):
  for B, P, cases in MB.ab_cases(CASES, ["bf16_flags"], forms, model=model):
    ts = {k: [] for k in cases}
    for _ in range(R):
      for k, c in cases.items():
        ts[k].append(c.prefill())
    logits = {k: np.asarray(c.state0.last_BxV) for k, c in cases.items()}
    med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
    ref = ("bf16_flags", QBS[0])
    for k, ms in med.items():
      print(f"{model} {B}x{P} q_block {k[1]:4d}: prefill {ms:8.1f} ms  {ms / med[ref]:.3f}x  "
            f"bit-identical to {QBS[0]}: {np.array_equal(logits[k], logits[ref])}", flush=True)
    del cases

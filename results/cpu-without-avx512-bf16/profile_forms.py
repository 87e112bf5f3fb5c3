"""One-off: where SmolLM2-135M's prefill spends its time (its shapes, random weights), float32
against bf16 + both flags, on the CPU this runs on: XLA:CPU's own per-thunk trace
(`attnprec.bench.profile.profile_program`, the tool of `make bench ARGS=--suite=profile`)
of the prefill as `generate` runs it (`for_serving`, `prefill_params`, kernel 'auto').
Written for a CPU without avx512_bf16, where bf16 + flags prefill stayed 1.04x (1 x 1000)
and 1.08x (8 x 250) fp32's time on 2 cores (qk_form_2cores.txt): what is the rest? From
the repository root, with JAX on the CPU (no checkpoint, orbax or tqdm needed):
  CASES=1x1000,8x250 taskset -c 0,1 python3 results/cpu-without-avx512-bf16/profile_forms.py
profile_2cores.txt ran before `mlp_activation = 'auto'` (its 'bf16 + flags' column is the
'compute' activation, then the default) and before the profile tool stopped reading a
shared constant's op name (it files the bf16 activation's fusion under the softmax).
"""
import os, sys
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax
import programs
from attnprec import cpu_features, layers
from attnprec.bench.cases import parse_cases
from attnprec.bench.profile import STAGES, profile_program
from attnprec.model import init_params
from attnprec.precision import Precision
from smollm2_shapes import CONFIG

CASES = parse_cases(os.environ.get("CASES", "1x1000"))
R = int(os.environ.get("R", 3))
FLAGS = dict(dtype="bfloat16", float32_qk_product=True, float32_logits=True, kernel="auto")
FORMS = {"fp32": Precision(kernel="auto"),
         "bf16 + flags, mlp_activation=compute": Precision(mlp_activation="compute", **FLAGS),
         "bf16 + flags, mlp_activation=float32": Precision(mlp_activation="float32", **FLAGS)}
print("CPU:", cpu_features.describe(), "| cores:", len(os.sched_getaffinity(0)), "of",
      os.cpu_count(), "| jax", jax.__version__, jax.default_backend(), flush=True)
params = init_params(CONFIG, jax.random.PRNGKey(0))
for B, P in CASES:
  rows = {}
  for name, prec in FORMS.items():
    compiled, pparams, _, serving, prompt, lengths, _ = programs.compiled_prefill(
        params, prec, B, P, P + 1)
    rows[name] = profile_program(compiled, lambda: compiled(pparams, prompt, lengths), R)
    print(f"profiled {B}x{P} {name}: projections={layers.projection_form(serving)} "
          f"wall {rows[name]['wall_ms']:.0f} ms, thunks {rows[name]['thunks_ms']:.0f} ms",
          flush=True)
  names = list(rows)
  print(f"\n{B}x{P}, ms per call (summed thunk time)\n| stage | " + " | ".join(names) + " |")
  print("|---|" + "---:|" * len(names))
  for s in STAGES:
    vals = [rows[n]["stages"][s] for n in names]
    if any(v >= 0.5 for v in vals):
      print(f"| {s} | " + " | ".join(f"{v:.0f}" for v in vals) + " |")
  print("| thunks / wall | " + " | ".join(
      f"{rows[n]['thunks_ms']:.0f} / {rows[n]['wall_ms']:.0f}" for n in names) + " |",
      flush=True)

"""One-off: decode steps (and prefill) with the MLP's activation as `mlp_activation = 'auto'`
runs it on a CPU without bf16 dots (float32) against the 'compute' activation (the default
before), SmolLM2-135M's shapes, random weights, as `generate` runs them; fp32 beside them.
The question: is any decode step slower under the new default? Interleaved rounds, medians.
Timed as qk_form_ab.py is (programs.py). From the repository root, with JAX on the CPU:
  CASES=8x1000,1x1000 R=9 PREFILL=0 taskset -c 0,1 python3 results/cpu-without-avx512-bf16/mlp_decode_ab.py
(mlp_decode_2cores.txt).
"""
import os, sys
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, numpy as np
import programs
from attnprec import cpu_features
from attnprec.model import init_params
from attnprec.precision import Precision
from smollm2_shapes import CONFIG
from attnprec.bench.cases import parse_cases

CASES = parse_cases(os.environ.get("CASES", "1x1000,8x250"))
R = int(os.environ.get("R", 5))
PREFILL = os.environ.get("PREFILL", "1") != "0"
SAFE = Precision(dtype="bfloat16", float32_qk_product=True, float32_logits=True, kernel="auto")
FORMS = {"fp32": Precision(kernel="auto"), "bf16 + flags": SAFE,
         "bf16 + flags, mlp compute": Precision(dtype="bfloat16", float32_qk_product=True,
                                                float32_logits=True, kernel="auto",
                                                mlp_activation="compute")}


print("CPU:", cpu_features.describe(), "| cores:", os.cpu_count(), "| affinity:",
      len(os.sched_getaffinity(0)), "| jax", jax.__version__, jax.default_backend(),
      "| bf16 + flags:", SAFE.describe(), flush=True)
params = init_params(CONFIG, jax.random.PRNGKey(0))
for B, P in CASES:
  runs, logits = {}, {}
  for name, prec in FORMS.items():
    run_prefill, run_step, logits[name] = programs.calls(params, prec, B, P)
    runs[name] = (run_prefill, run_step)
  diff = np.abs(logits["bf16 + flags"] - logits["bf16 + flags, mlp compute"]).max()
  print(f"{B}x{P}: prefill logits, the two bf16 forms: max abs difference {diff:.2e} "
        f"(logits up to {np.abs(logits['bf16 + flags']).max():.1f})", flush=True)
  programs.time_interleaved(f"{B}x{P}", runs, R, PREFILL)

"""One-off: the attention's QK dot in the float32 form (`Precision.float32_qk_operands`) on
the CPU this runs on, SmolLM2-135M's shapes (random weights: the speed does not depend on
the values), as `generate` runs them (`for_serving`, `prefill_params` for the prefill, the
serving weights for one decode step after it, its state donated and copied outside the
timed call):
  fp32:                      the fp32 preset;
  bf16 + flags:              bf16 compute with both flags, 'auto' everywhere: on a CPU
                             without bf16 dots the float32 projection form and, now, the
                             QK dot on q and k cast to float32;
  bf16 + flags, bf16 QK dot: the same, traced with `float32_qk_operands` off (the kernels
                             before the change: the QK dot bf16 x bf16 -> float32).
Interleaved rounds, medians; the two bf16 forms' prefill logits compared (max abs).
Written for a CPU without avx512_bf16. From the repository root, with JAX on the CPU:
  JAX_PLATFORMS=cpu python3 results/cpu-without-avx512-bf16/qk_form_ab.py
(CASES=1x1000,8x250 R=5 to change the cases and rounds; PREFILL=0 times decode steps only.)
qk_form_2cores.txt: CASES=1x1000,8x250 R=5 taskset -c 0,1; qk_decode_2cores.txt:
CASES=1x1000,8x1000,1x250,8x250 R=9 PREFILL=0 taskset -c 0,1. Both ran before decode steps
were given back the bf16 QK dot: their 'bf16 + flags' decode steps are the float32 QK
form's (which is why it is now prefill only). qk_form_13cores.txt: CASES=1x1000,1x4000
R=3 on all 13 cores, the final code (decode steps the same in both bf16 forms).
"""
import contextlib, os, sys
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnprec import xla_env; xla_env.disable_excess_precision()
import programs
from attnprec.precision import Precision

SAFE = Precision(dtype="bfloat16", float32_qk_product=True, float32_logits=True, kernel="auto")


@contextlib.contextmanager
def qk_form(on: bool):
  """Traces with the float32 QK form as `auto` chooses it (on) or off (the old kernels)."""
  real = Precision.float32_qk_operands
  if not on:
    Precision.float32_qk_operands = lambda self, backend=None, num_queries=None: False
  try:
    yield
  finally:
    Precision.float32_qk_operands = real


programs.ab_main({"fp32": (Precision(kernel="auto"), None), "bf16 + flags": (SAFE, None),
                  "bf16 + flags, bf16 QK dot": (SAFE, lambda: qk_form(False))},
                 ("bf16 + flags", "bf16 + flags, bf16 QK dot"), SAFE)

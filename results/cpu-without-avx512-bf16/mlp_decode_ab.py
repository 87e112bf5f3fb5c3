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
import programs
from attnprec.precision import Precision

FLAGS = dict(dtype="bfloat16", float32_qk_product=True, float32_logits=True, kernel="auto")
programs.ab_main({"fp32": (Precision(kernel="auto"), None),
                  "bf16 + flags": (Precision(**FLAGS), None),
                  "bf16 + flags, mlp compute": (Precision(mlp_activation="compute", **FLAGS),
                                                None)},
                 ("bf16 + flags", "bf16 + flags, mlp compute"), Precision(**FLAGS))

"""One-off: SmolLM2-135M's prefill (its shapes, random weights: the speed does not depend
on the values) on the CPU this runs on, float32 against bf16 compute with both flags
under each projection form (`precision.projection_form`: 'auto', which picks by the CPU's
features, 'compute_dtype_dot', 'float32_dot'), as `generate` runs it (`for_serving`,
`prefill_params`, kernel 'auto'), interleaved rounds, medians. Written for a CPU without
avx512_bf16 (the question: is bf16 prefill no slower than float32 there?). From the
repository root, with JAX on the CPU:
  JAX_PLATFORMS=cpu python3 results/cpu-without-avx512-bf16/prefill_forms.py
prefill_2cores.txt (`taskset -c 0,1`) and prefill_13cores.txt ran the first four forms,
before the last two were added and before the finiteness check; prefill_2cores_b.txt ran
  CASES=1x1000 R=7 FORMS="bf16 + flags, projection_form=auto;bf16 + flags, mlp_activation=float32;bf16, flags off" taskset -c 0,1 ...
prefill_mlp_2cores.txt ran the first and the fifth form, before `mlp_activation = 'auto'`
(then 'compute', the default); prefill_auto_2cores.txt, after it (where 'auto' is the
fifth form's 'float32' on this CPU), ran
  CASES=1x1000,8x250 R=7 FORMS="bf16 + flags, projection_form=auto;bf16 + flags, mlp_activation=compute" taskset -c 0,1 ...
"""
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax
import programs
from attnprec import cpu_features, layers
from attnprec.model import init_params
from attnprec.precision import Precision
from smollm2_shapes import CONFIG
from attnprec.bench.cases import parse_cases

CASES = parse_cases(os.environ.get("CASES", '1x1000'))
R = int(os.environ.get('R', 5))
FLAGS = dict(dtype="bfloat16", float32_qk_product=True, float32_logits=True, kernel="auto")
FORMS = {
    'fp32': Precision(kernel="auto"),
    'bf16 + flags, projection_form=auto': Precision(**FLAGS),
    'bf16 + flags, compute_dtype_dot': Precision(projection_form="compute_dtype_dot", **FLAGS),
    'bf16 + flags, float32_dot': Precision(projection_form="float32_dot", **FLAGS),
    'bf16 + flags, mlp_activation=float32': Precision(mlp_activation="float32", **FLAGS),
    'bf16 + flags, mlp_activation=compute': Precision(mlp_activation="compute", **FLAGS),
    'bf16, flags off': Precision(dtype="bfloat16", kernel="auto"),
}
if os.environ.get('FORMS'):
  FORMS = {n: FORMS[n] for n in ['fp32'] + [f for f in os.environ['FORMS'].split(';') if f != 'fp32']}
print('CPU:', cpu_features.describe(), '| cores:', os.cpu_count(), '| jax', jax.__version__,
      jax.default_backend(), flush=True)
params = init_params(CONFIG, jax.random.PRNGKey(0))
for B, P in CASES:
  runs = {}
  for name, prec in FORMS.items():
    compiled, pparams, _, serving, prompt, lengths, _ = programs.compiled_prefill(
        params, prec, B, P, P + 1)
    runs[name] = (compiled, pparams)
    print(f'compiled {name}: projections={layers.projection_form(serving)} mlp={serving.mlp_form()}', flush=True)
  ts = {n: [] for n in runs}
  for _ in range(R):
    for n, (c, p) in runs.items():
      jax.block_until_ready(c(p, prompt, lengths))
      t0 = time.perf_counter(); jax.block_until_ready(c(p, prompt, lengths))
      ts[n].append(time.perf_counter() - t0)
  med = {n: statistics.median(v) for n, v in ts.items()}
  for n, m in med.items():
    print(f'{B}x{P} prefill {n:38s} {m:7.3f} s  {m / med["fp32"]:.2f}x fp32', flush=True)

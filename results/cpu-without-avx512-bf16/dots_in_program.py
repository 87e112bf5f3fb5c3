"""One-off: does a thunk trace say why bf16 + flags prefill at 8 x 250 stays 2-4% slower
than fp32's in the float32 projection form (a CPU without bf16 dots runs that form under
'auto')? XLA:CPU's per-thunk trace (`attnprec.bench.profile.trace_program`, as the profile suite
takes it): the summed time per kind of thunk, with the YNNPACK fusions
told apart by what they compute and their output shape. SmolLM2's shapes, random weights,
the prefill as `generate` runs it (`programs.compiled_prefill`). The two programs are
traced in turn, twice (fp32, bf16, fp32, bf16), 3 calls each. Run on the amx_bf16
machine with `projection_form='float32_dot'` forced, which compiles the program such a
CPU runs under 'auto' (the precision line of each is printed). From the repository root:
  .venv/bin/python results/cpu-without-avx512-bf16/dots_in_program.py  (dots_in_program.txt)
It does not: the same float32 dots summed 6-7% less in the bf16 program in the recorded
run, and 7-8% more in an earlier run of the same traces (not kept); the summed thunk time
of one program moved 13% between its two traces. A 2-4% difference is below what these
traces resolve on this machine.
"""
import collections, os, re, sys
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax
import programs
from attnprec import cpu_features, layers
from attnprec.bench.profile import trace_program
from attnprec.model import init_params
from attnprec.precision import Precision
from smollm2_shapes import CONFIG

B, P, CALLS, TOP = 8, 250, 3, 8
FLAGS = dict(dtype="bfloat16", float32_qk_product=True, float32_logits=True, kernel="auto")
FORMS = {"fp32": Precision(kernel="auto"),
         "bf16 + flags": Precision(projection_form="float32_dot", **FLAGS)}
print("CPU:", cpu_features.describe(), "| jax", jax.__version__, flush=True)
params = init_params(CONFIG, jax.random.PRNGKey(0))
built = {n: programs.compiled_prefill(params, p, B, P, P + 1) for n, p in FORMS.items()}
for name, (compiled, *_rest) in built.items():
  serving = _rest[2]
  print(f"{name}: projections={layers.projection_form(serving)} "
        f"mlp={serving.mlp_form()}", flush=True)


def kind(op, trace, text):
  """A thunk's kind: its name without the number; a YNNPACK fusion also by its output
  shape and the ops it computes."""
  base = re.sub(r"[.\d]+$", "", op)
  if base != "ynn_fusion":
    return base
  shape = re.search(r"%" + re.escape(op) + r" = (\S+) fusion", text).group(1)
  ops = [trace.instrs[c].opcode for comp in trace.instrs[op].calls
         for c in trace.comps.get(comp, [])
         if trace.instrs[c].opcode not in ("parameter", "bitcast", "constant")]
  return f"ynn {'/'.join(ops)} -> {shape.split('{')[0]}"


for name in list(FORMS) * 2:
  compiled, pparams, _, _, prompt, lengths, _ = built[name]
  trace = trace_program(compiled, lambda: compiled(pparams, prompt, lengths), CALLS)
  text = compiled.as_text()
  total, count = collections.defaultdict(float), collections.Counter()
  for op, us in trace.op_us.items():
    if op in trace.instrs:
      k = kind(op, trace, text)
      total[k] += us / 1e3 / CALLS
      count[k] += 1
  print(f"\n{name}: {sum(total.values()):.0f} ms of thunks per call; the {TOP} largest kinds")
  for k, ms in sorted(total.items(), key=lambda kv: -kv[1])[:TOP]:
    print(f"  {ms:8.1f} ms  x{count[k]:<4d} {k}", flush=True)

"""One-off: decode steps (and prefill) with the MLP's activation as `mlp_activation = 'auto'`
runs it on a CPU without bf16 dots (float32) against the 'compute' activation (the default
before), SmolLM2-135M's shapes, random weights, as `generate` runs them; fp32 beside them.
The question: is any decode step slower under the new default? Interleaved rounds, medians.
Made from qk_form_ab.py (same timing). From the repository root, with JAX on the CPU:
  CASES=8x1000,1x1000 R=9 PREFILL=0 taskset -c 0,1 python3 results/cpu-without-avx512-bf16/mlp_decode_ab.py
(mlp_decode_2cores.txt).
"""
import functools, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import cpu_features, decoding
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
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (B, P)), jnp.int32)
  lengths = jnp.full((B,), P, jnp.int32)
  calls, logits = {}, {}
  for name, prec in FORMS.items():
    served, serving = decoding.for_serving(params, prec)
    pparams = decoding.prefill_params(served, serving, B * P)
    pre = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=serving,
                                    cache_length=P + 8)).lower(pparams, prompt, lengths).compile()
    state0 = jax.block_until_ready(pre(pparams, prompt, lengths))
    first = jnp.argmax(state0.last_BxV, axis=-1).astype(jnp.int32)
    step = jax.jit(functools.partial(decoding.decode_step, config=CONFIG, precision=serving),
                   donate_argnums=1).lower(served, state0, first).compile()
    logits[name] = np.asarray(state0.last_BxV, np.float32)
    after = np.asarray(step(served, jax.tree_util.tree_map(jnp.copy, state0), first).last_BxV)
    if not (np.isfinite(logits[name]).all() and np.isfinite(after).all()):
      sys.exit(f"{B}x{P} {name}: non-finite logits; not timed")

    def run_prefill(pre=pre, pparams=pparams):
      t0 = time.perf_counter(); jax.block_until_ready(pre(pparams, prompt, lengths))
      return time.perf_counter() - t0

    def run_step(step=step, served=served, state0=state0, first=first):
      state = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, state0))
      t0 = time.perf_counter(); jax.block_until_ready(step(served, state, first))
      return time.perf_counter() - t0
    calls[name] = (run_prefill, run_step)
  diff = np.abs(logits["bf16 + flags"] - logits["bf16 + flags, mlp compute"]).max()
  print(f"{B}x{P}: prefill logits, the two bf16 forms: max abs difference {diff:.2e} "
        f"(logits up to {np.abs(logits['bf16 + flags']).max():.1f})", flush=True)
  pre_t, dec_t = {n: [] for n in calls}, {n: [] for n in calls}
  for run_prefill, run_step in calls.values():
    run_prefill(); run_step()
  for _ in range(R):
    for n, (run_prefill, run_step) in calls.items():
      pre_t[n].append(run_prefill() if PREFILL else float("nan"))
      run_step()
      dec_t[n].append(run_step())
  base_p, base_d = statistics.median(pre_t["fp32"]), statistics.median(dec_t["fp32"])
  for n in calls:
    p, d = statistics.median(pre_t[n]), statistics.median(dec_t[n])
    print(f"{B}x{P} {n:28s} prefill {p:7.3f} s ({p / base_p:.2f}x fp32)   decode step "
          f"{1000 * d:7.1f} ms ({d / base_d:.2f}x fp32)", flush=True)

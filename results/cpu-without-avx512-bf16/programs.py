"""The serving programs the one-off scripts beside this one time: SmolLM2's shapes
(`smollm2_shapes.CONFIG`), random weights (the speed does not depend on the values), as
`generate` runs them (`decoding.for_serving`; `prefill_params` for the prefill, the
serving weights for a decode step, its state donated and copied outside the timed call).
Every program is checked for finite logits before it is timed: a timing of a broken
program would read like any other. (`attnprec.bench.model._AttnprecCase` does the same
for a checkpoint in `make bench`; it is not used here because it needs packages the
machine these ran on did not have, orbax and tqdm among them, and a checkpoint.)"""
import contextlib, functools, os, statistics, sys, time

import jax, jax.numpy as jnp, numpy as np
from attnprec import cpu_features, decoding
from attnprec.bench.cases import parse_cases
from attnprec.model import init_params
from smollm2_shapes import CONFIG


def prompt(B, P):
  """[B, P] random token ids (seed 0) and their lengths."""
  ids = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (B, P))
  return jnp.asarray(ids, jnp.int32), jnp.full((B,), P, jnp.int32)


def compiled_prefill(params, prec, B, P, cache_length):
  """(the compiled prefill, its parameters, the serving weights and precision, the prompt,
  its lengths, the prefill's state), the prefill's logits checked."""
  tokens, lengths = prompt(B, P)
  served, serving = decoding.for_serving(params, prec)
  pparams = decoding.prefill_params(served, serving, B * P)
  pre = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=serving,
                                  cache_length=cache_length)).lower(
                                      pparams, tokens, lengths).compile()
  state0 = jax.block_until_ready(pre(pparams, tokens, lengths))
  if not np.isfinite(np.asarray(state0.last_BxV, np.float32)).all():
    sys.exit(f"{B}x{P}: non-finite prefill logits under {prec.describe()}; not timed")
  return pre, pparams, served, serving, tokens, lengths, state0


def calls(params, prec, B, P):
  """(run_prefill, run_step, the prefill's logits): each run_* times one call (seconds);
  the decode step's logits checked too."""
  pre, pparams, served, serving, tokens, lengths, state0 = compiled_prefill(
      params, prec, B, P, P + 8)
  first = jnp.argmax(state0.last_BxV, axis=-1).astype(jnp.int32)
  step = jax.jit(functools.partial(decoding.decode_step, config=CONFIG, precision=serving),
                 donate_argnums=1).lower(served, state0, first).compile()
  after = np.asarray(step(served, jax.tree_util.tree_map(jnp.copy, state0), first).last_BxV)
  if not np.isfinite(after).all():
    sys.exit(f"{B}x{P}: non-finite decode-step logits under {prec.describe()}; not timed")

  def run_prefill():
    t0 = time.perf_counter(); jax.block_until_ready(pre(pparams, tokens, lengths))
    return time.perf_counter() - t0

  def run_step():
    state = jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, state0))
    t0 = time.perf_counter(); jax.block_until_ready(step(served, state, first))
    return time.perf_counter() - t0
  return run_prefill, run_step, np.asarray(state0.last_BxV, np.float32)


def time_interleaved(label, runs, rounds, prefill=True, base="fp32"):
  """runs: name -> (run_prefill, run_step). One warm call each, then `rounds` interleaved
  rounds; prints each name's median prefill and decode step against `base`'s."""
  pre_t, dec_t = {n: [] for n in runs}, {n: [] for n in runs}
  for run_prefill, run_step in runs.values():
    run_prefill(); run_step()
  for _ in range(rounds):
    for n, (run_prefill, run_step) in runs.items():
      pre_t[n].append(run_prefill() if prefill else float("nan"))
      run_step()
      dec_t[n].append(run_step())
  base_p, base_d = statistics.median(pre_t[base]), statistics.median(dec_t[base])
  for n in runs:
    p, d = statistics.median(pre_t[n]), statistics.median(dec_t[n])
    print(f"{label} {n:28s} prefill {p:7.3f} s ({p / base_p:.2f}x {base})   decode step "
          f"{1000 * d:7.1f} ms ({d / base_d:.2f}x {base})", flush=True)


def ab_main(forms, pair, describe):
  """The A/B scripts' whole run: `forms` (name -> (Precision, a function making the
  context manager to trace it in, or None)) over the cases of $CASES (default 1x1000,8x250), $R rounds (default 5),
  prefill timed unless $PREFILL=0; the prefill logits of the two forms of `pair` compared;
  `describe` (a Precision) printed with the machine."""
  cases = parse_cases(os.environ.get("CASES", "1x1000,8x250"))
  rounds = int(os.environ.get("R", 5))
  prefill = os.environ.get("PREFILL", "1") != "0"
  print("CPU:", cpu_features.describe(), "| cores:", os.cpu_count(), "| affinity:",
        len(os.sched_getaffinity(0)), "| jax", jax.__version__, jax.default_backend(),
        "|", describe.describe(), flush=True)
  params = init_params(CONFIG, jax.random.PRNGKey(0))
  for B, P in cases:
    runs, logits = {}, {}
    for name, (prec, context) in forms.items():
      with context() if context else contextlib.nullcontext():
        run_prefill, run_step, logits[name] = calls(params, prec, B, P)
      runs[name] = (run_prefill, run_step)
    a, b = pair
    print(f"{B}x{P}: prefill logits, the two bf16 forms: max abs difference "
          f"{np.abs(logits[a] - logits[b]).max():.2e} (logits up to "
          f"{np.abs(logits[a]).max():.1f})", flush=True)
    time_interleaved(f"{B}x{P}", runs, rounds, prefill)

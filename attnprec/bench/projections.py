"""Dense-projection forms, measured side by side (`make bench ARGS=--suite=projections`).

Which form a bf16 (or f16) dense projection should take on this backend, decided by
measurement. The forms (c: the 16-bit compute dtype):

  f32          float32 activations x float32 weights (the fp32 preset; the reference)
  carried      x upcast to f32 x float32 weights holding values of c, f32 result rounded
               to c (`decoding.for_serving` before issue 22: `Precision.carrier_weights`)
  c_result     c x c dot with a c result (the dot XLA is given without
               `preferred_element_type`)
  c_f32        c x c dot with `preferred_element_type=float32`, rounded once to c: exact
               products, float32 accumulation, for every row count
  c_f32_castw  c_f32 on float32 weights cast to c at each use (no stored copy in c)
  current      `layers.project` as it is: c_f32 from MIN_ROWS_C_DOT rows up, a float32
               dot on float32-held weights below

Two parts, one process, interleaved (every round times each form once; min and median
over the rounds), so that drift on a shared machine hits all forms alike:

  * micro: SmolLM2-shaped projections (d 576, MLP 1536, kv 192, vocabulary 49152) at
    M = 1000 rows (a prefill of 1000 tokens) and M = 1, 8 (decode steps), `layers`
    weight matrices of each shape per call (as 30 layers read them), GFLOP/s;
  * model: the whole model's prefill (B = 1, `prefill_tokens`) and a decode program of
    `steps` greedy steps (B = 1 and 8) under bf16 + both attention flags, for each way of
    holding the weights x each projection form (`MODEL_FORMS`: 'form/weights', weights
    'carried' = rounded to values of c, held in float32, as `decoding.for_serving` holds
    them; 'stored' = in c, `decoding.compute_params`), beside fp32.

`settings` runs the same measurement once per XLA:CPU setting (`attnprec.xla_env`:
default, onednn, xnnpack), each in its own subprocess (the flags are process-wide and
read when jax starts). Only ratios measured within one process are comparable.

Shapes: M rows, K inner dimension, N output columns, L weight matrices per call.
"""
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import decoding, layers, presets, xla_env
from attnprec import model as model_lib
from attnprec.bench.model import round_robin  # one interleaving and warm-up rule
from attnprec.cache import init_cache
from attnprec.errors import UserError
from attnprec.precision import Precision
from attnprec.presets import variant

F32, BF16 = jnp.float32, jnp.bfloat16

# (name, K, N) of SmolLM2-135M's projections.
SHAPES = (("q/o", 576, 576), ("k/v", 576, 192), ("mlp up/gate", 576, 1536),
          ("mlp down", 1536, 576), ("unembed", 576, 49152))
MICRO_FORMS = ("f32", "carried", "c_result", "c_f32", "c_f32_castw")


# ----------------------------------------------------------------------------- forms
def _dot(form: str, x, w):
  """x [M, K] (f32 for 'f32', else bf16) @ w [K, N] in `form` -> result in x's dtype."""
  if form == "f32":
    return jnp.dot(x, w, preferred_element_type=F32)
  if form == "carried":
    return jnp.dot(x.astype(F32), w, preferred_element_type=F32).astype(x.dtype)
  if form == "c_result":
    return jnp.dot(x, w.astype(x.dtype))
  if form in ("c_f32", "c_f32_castw"):
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=F32).astype(x.dtype)
  raise UserError(f"unknown projection form {form!r}; valid: {', '.join(MICRO_FORMS)}")


def _weights_dtype(form: str):
  return BF16 if form in ("c_result", "c_f32") else F32


def micro(*, rows=(1000, 8, 1), shapes=SHAPES, forms=MICRO_FORMS, layers_per_call=8,
          rounds=5, seed=0) -> list:
  """GFLOP/s of each form on each (shape, M): `layers_per_call` distinct weight matrices
  per jitted call (so a decode-sized call reads many weights, as a decode step does)."""
  rng = np.random.default_rng(seed)
  out = []
  for M in rows:
    for name, K, N in shapes:
      L = layers_per_call if name != "unembed" else 1
      w_LxKxN = rng.standard_normal((L, K, N), dtype=np.float32) / np.sqrt(K)
      w_LxKxN = np.asarray(jnp.asarray(w_LxKxN).astype(BF16).astype(F32))  # values of c
      x_MxK = jnp.asarray(rng.standard_normal((M, K), dtype=np.float32)).astype(BF16)
      calls = {}
      for form in forms:
        w = [jnp.asarray(w_LxKxN[i]).astype(_weights_dtype(form)) for i in range(L)]
        x = x_MxK.astype(F32) if form == "f32" else x_MxK

        def f(x, ws, form=form):
          # each matrix applied once; the results summed in f32 (a small add next to the dot)
          return sum(_dot(form, x, w).astype(F32) for w in ws)

        program = jax.jit(f).lower(x, w).compile()
        calls[form] = _timer(lambda p=program, x=x, w=w: p(x, w))
      times = round_robin(calls, rounds)
      flops = 2.0 * M * K * N * L
      for form, ts in times.items():
        out.append(dict(shape=name, M=M, K=K, N=N, layers=L, form=form,
                        min_s=min(ts), median_s=statistics.median(ts),
                        gflops=flops / min(ts) / 1e9))
  return out


# ----------------------------------------------------------------------------- model
def _fixed_project(form: str):
  """`layers.project` fixed to one form for every call (the forms before issue 22:
  'carried', 'c_result'; 'c_f32' for every row count), for the comparison."""
  def project(x, w, spec, *, precision, carrier=False, out_dtype=None, **_):
    c = x.dtype   # the model's own form (a `form=` keyword) is replaced by the fixed one
    out_dtype = c if out_dtype is None else out_dtype
    if form == "carried" and c != F32:
      y = jnp.einsum(spec, x.astype(F32), w, precision=precision,
                     preferred_element_type=F32)
      return y.astype(out_dtype)
    if form == "c_f32" and c != F32:
      return jnp.einsum(spec, x, w.astype(c), precision=precision,
                        preferred_element_type=F32).astype(out_dtype)
    preferred = F32 if out_dtype == F32 else None   # 'c_result', and f32
    return jnp.einsum(spec, x, w.astype(c), precision=precision,
                      preferred_element_type=preferred)
  return project


@contextlib.contextmanager
def projection_form(form: str):
  """While tracing inside this block the model's dense projections use `form`
  ('current': `layers.project` as it is; 'carried', 'c_result', 'c_f32': fixed)."""
  if form in ("current", "f32"):
    yield
    return
  fixed = _fixed_project(form)
  saved = layers.project, model_lib.project
  layers.project = model_lib.project = fixed
  try:
    yield
  finally:
    layers.project, model_lib.project = saved


# (name, projection form, weights as held: 'float32' as loaded, 'carried' rounded to
# values of c held in float32, 'stored' in c (`decoding.compute_params`))
MODEL_FORMS = {
    "fp32": ("f32", "float32"),
    "carried": ("carried", "carried"),
    "c_result/stored": ("c_result", "stored"),
    "c_f32/stored": ("c_f32", "stored"),
    "c_f32/carried": ("c_f32", "carried"),
    "current/carried": ("current", "carried"),
    "current/stored": ("current", "stored"),
}
_FLAGS = dict(presets.bindings(presets.preset_path("fp32_attention")), kernel="auto")


def _model_inputs(name, params):
  form, held = MODEL_FORMS[name]
  if name == "fp32":
    return params, variant("fp32", kernel="auto")
  precision = Precision(**_FLAGS)
  if held == "stored":
    return decoding.compute_params(params, precision), precision
  rounded = jax.tree_util.tree_map(lambda x: x, params)
  rounded = decoding._map_matrices(rounded, lambda x: x.astype(BF16).astype(F32))
  return rounded, dataclasses.replace(precision,
                                      carrier_weights=form in ("carried", "current"))


def _decode_loop(params, state, token_B, *, config, precision, steps):
  def body(_, carry):
    state, token_B = carry
    state = decoding.decode_step(params, state, token_B, config=config, precision=precision)
    return state, jnp.argmax(state.last_BxV, axis=-1).astype(jnp.int32)

  return jax.lax.fori_loop(0, steps, body, (state, token_B))


def model(config, params, *, forms=tuple(MODEL_FORMS), prefill_tokens=1000,
          decode_batches=(1, 8), decode_cache=256, steps=8, rounds=3, seed=0, log=print):
  """Seconds per prefill and per decode step for each form, interleaved."""
  rng = np.random.default_rng(seed)
  prompt_1xP = jnp.asarray(rng.integers(0, config.vocab_size, (1, prefill_tokens)),
                           jnp.int32)
  lengths_1 = jnp.full((1,), prefill_tokens, jnp.int32)
  calls, compile_s = {}, {}
  for name in forms:
    with projection_form(MODEL_FORMS[name][0]):
      p, prec = _model_inputs(name, params)
      log(f"compiling {name} ...", flush=True)
      t0 = time.perf_counter()
      pre = jax.jit(functools.partial(decoding.prefill, config=config, precision=prec,
                                      cache_length=prefill_tokens)).lower(
                                          p, prompt_1xP, lengths_1).compile()
      calls[f"prefill/{name}"] = _timer(lambda pre=pre, p=p: pre(p, prompt_1xP, lengths_1))
      for B in decode_batches:
        S = decode_cache + steps
        state = decoding.DecodeState(init_cache(config, B, S, prec.compute_dtype),
                                     jnp.zeros((B, config.vocab_size), F32),
                                     jnp.full((B,), decode_cache, jnp.int32))
        token_B = jnp.zeros((B,), jnp.int32)
        dec = jax.jit(functools.partial(_decode_loop, config=config, precision=prec,
                                        steps=steps)).lower(p, state, token_B).compile()
        calls[f"decode_B{B}/{name}"] = _timer(
            lambda dec=dec, p=p, state=state, token_B=token_B: dec(p, state, token_B),
            per=steps)
      compile_s[name] = time.perf_counter() - t0
  log("timing ...", flush=True)
  times = round_robin(calls, rounds)
  out = []
  for key, ts in times.items():
    case, name = key.split("/", 1)
    out.append(dict(case=case, form=name, min_s=min(ts), median_s=statistics.median(ts),
                    times_s=ts, compile_s=compile_s[name]))
  return out


# ----------------------------------------------------------------------------- timing
def _timer(call, per=1):
  def timed():
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    return (time.perf_counter() - t0) / per
  return timed


def add_ratios(rows, key, base):
  """row['vs_<base>'] = min time over the min time of the `base` form of the same key."""
  ref = {tuple(r[k] for k in key): r["min_s"] for r in rows if r["form"] == base}
  for r in rows:
    b = ref.get(tuple(r[k] for k in key))
    if b:
      r[f"vs_{base}"] = r["min_s"] / b
  return rows


def run(*, model_name="smollm2-135m", config=None, params=None, parts=("micro", "model"),
        micro_rounds=5, model_rounds=3, prefill_tokens=1000, steps=8, decode_cache=256,
        model_forms=tuple(MODEL_FORMS), micro_rows=(1000, 8, 1), micro_shapes=SHAPES,
        layers_per_call=8, log=print) -> dict:
  t0 = time.perf_counter()
  result = {"config": dict(model=model_name, xla_flags=os.environ.get("XLA_FLAGS", ""),
                           setting=xla_env.in_force(), jax=jax.__version__,
                           cpu_count=os.cpu_count(), load_before=os.getloadavg())}
  if "micro" in parts:
    log("micro-benchmark of the projection forms ...", flush=True)
    result["micro"] = add_ratios(micro(rows=micro_rows, shapes=micro_shapes,
                                       layers_per_call=layers_per_call,
                                       rounds=micro_rounds),
                                 ("shape", "M"), "carried")
  if "model" in parts:
    if config is None:
      from attnprec import checkpoints
      ckpt = checkpoints.load(model_name)
      config, params = ckpt.config, ckpt.params
    result["model"] = add_ratios(model(config, params, forms=model_forms,
                                       prefill_tokens=prefill_tokens, steps=steps,
                                       decode_cache=decode_cache, rounds=model_rounds,
                                       log=log), ("case",), "carried")
  result["config"]["load_after"] = os.getloadavg()
  result["wall_s"] = time.perf_counter() - t0
  return result


def run_settings(settings: Sequence[str], argv_child: Sequence[str], log=print) -> dict:
  """`run` once per XLA:CPU setting, each in a fresh subprocess (XLA_FLAGS is read when
  jax starts); {setting: result}."""
  out = {}
  for setting in settings:
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_env.flags_for(setting, env.get("XLA_FLAGS", ""))
    log(f"--- XLA:CPU setting {setting}: XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
    cmd = [sys.executable, "-m", "attnprec.bench.projections", *argv_child]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
      raise RuntimeError(f"setting {setting} failed:\n{proc.stderr[-3000:]}")
    out[setting] = json.loads(proc.stdout.strip().splitlines()[-1])
  return out


# ----------------------------------------------------------------------------- output
def to_markdown(result: dict) -> str:
  cfg = result["config"]
  lines = [f"XLA setting: {cfg['setting']}; XLA_FLAGS `{cfg['xla_flags']}`; load average "
           f"before {cfg['load_before'][0]:.2f}, after {cfg['load_after'][0]:.2f} "
           f"({cfg['cpu_count']} cores); wall {result['wall_s']:.0f} s. Ratios: min time "
           f"over the min time of `carried` measured in the same rounds.", ""]
  if result.get("micro"):
    lines += ["| shape | M | form | GFLOP/s (min) | ms (min) | ms (median) | vs carried |",
              "|---|---:|---|---:|---:|---:|---:|"]
    for r in result["micro"]:
      lines.append(f"| {r['shape']} {r['K']}x{r['N']} x{r['layers']} | {r['M']} | "
                   f"{r['form']} | {r['gflops']:.0f} | {r['min_s'] * 1e3:.2f} | "
                   f"{r['median_s'] * 1e3:.2f} | {r.get('vs_carried', float('nan')):.2f} |")
    lines.append("")
  if result.get("model"):
    lines += ["| case | form (projection/weights) | ms (min) | ms (median) | vs carried |"
              " compile s |", "|---|---|---:|---:|---:|---:|"]
    for r in result["model"]:
      lines.append(f"| {r['case']} | {r['form']} | {r['min_s'] * 1e3:.1f} | "
                   f"{r['median_s'] * 1e3:.1f} | {r.get('vs_carried', float('nan')):.2f} | "
                   f"{r['compile_s']:.0f} |")
  return "\n".join(lines) + "\n"


def _main(argv):
  import argparse
  ap = argparse.ArgumentParser()
  ap.add_argument("--parts", default="micro,model")
  ap.add_argument("--micro_rounds", type=int, default=5)
  ap.add_argument("--model_rounds", type=int, default=3)
  ap.add_argument("--model_forms", default=",".join(MODEL_FORMS))
  ap.add_argument("--micro_rows", default="1000,8,1")
  ap.add_argument("--steps", type=int, default=8)
  a = ap.parse_args(argv)
  result = run(parts=tuple(a.parts.split(",")), micro_rounds=a.micro_rounds,
               model_rounds=a.model_rounds, model_forms=tuple(a.model_forms.split(",")),
               micro_rows=tuple(int(x) for x in a.micro_rows.split(",")), steps=a.steps,
               log=lambda *x, **k: print(*x, file=sys.stderr, **k))
  print(json.dumps(result, default=float))


if __name__ == "__main__":
  _main(sys.argv[1:])


# ----------------------------------------------------------------------------- numerics
def logits_parity(config, params, tokens_T, *, prompt=32, new_tokens=64,
                  precision=Precision(**_FLAGS)) -> dict:
  """Logits and greedy tokens of the current `layers.project` against the forms it
  replaced, on one token sequence: the full forward over all of `tokens_T` (float32
  params cast at each use: before, a c x c dot with a c result) and `decoding.generate`
  from its first `prompt` tokens (before: float32 dots on the float32-carried weights).
  {'forward_max_abs', 'generate_max_abs', 'tokens_equal', ...}."""
  apply = model_lib.transformed(config).apply
  x_1xT = jnp.asarray(tokens_T, jnp.int32)[None]

  def forward(form):
    jax.clear_caches()
    with projection_form(form):
      return np.asarray(jax.jit(lambda p, t: apply(p, t, precision=precision).logits)(
          params, x_1xT))

  def generate(form):
    jax.clear_caches()
    with projection_form(form):
      out = decoding.generate(params, x_1xT[:, :prompt], jnp.array([prompt], jnp.int32),
                              jax.random.PRNGKey(0), config=config, precision=precision,
                              max_new_tokens=new_tokens)
      return np.asarray(out[0]), np.asarray(out[1])

  before_f, after_f = forward("c_result"), forward("current")
  (tok_b, log_b), (tok_a, log_a) = generate("carried"), generate("current")
  scale = float(np.max(np.abs(before_f)))
  return {"tokens": len(tokens_T), "prompt": prompt, "new_tokens": new_tokens,
          "forward_max_abs": float(np.max(np.abs(after_f - before_f))),
          "forward_logit_max": scale,
          "forward_argmax_agree": float(np.mean(before_f.argmax(-1) == after_f.argmax(-1))),
          "forward_bitwise_equal": bool(np.array_equal(before_f, after_f)),
          "generate_max_abs": float(np.max(np.abs(log_a - log_b))),
          "generate_bitwise_equal": bool(np.array_equal(log_a, log_b)),
          "tokens_equal": bool(np.array_equal(tok_a, tok_b)),
          "first_token_difference": int(np.argmax(tok_a[0] != tok_b[0]))
          if not np.array_equal(tok_a, tok_b) else None}

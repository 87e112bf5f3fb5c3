"""`--suite=tpu_model`: a whole model of Qwen2.5-0.5B's shape (random weights, 24 layers
scanned) on an accelerator (a TPU): prefill against the bf16 matmul peak, a decode step
against its HBM floor, a train step against the peak, per precision preset, in
interleaved rounds.

Presets (`bench.model.PRESETS`, kernel 'auto': the platform's choice per phase, named in
each row): `bf16` (the flags off), `bf16_flags` (both flags), `bf16_flags_offset` (both
flags and the key offset 'bias'), `bf16_flags_kv_int8` (both flags, an int8 cache with
per-token scales; decode only: a prefill into it is the same program plus the
quantization, and 'auto''s long kernel refuses a quantized cache).

Phases and method (each program jitted once; `rounds` rounds, in each every preset of a
case once, in order; medians):
  prefill  B x P tokens (`--cases`, default 8x1024, 1x8192) through `decoding.prefill`
           into a cache of P positions, with the serving weights as `generate` runs them
           (`decoding.for_serving`: bf16-stored on a TPU). MFU: the forward's matmul FLOPs
           (`matmul_flops`: every layer matrix per token, causal attention's two products
           over the visible half, the unembedding of each sequence's last position) over
           the time and the bf16 matmul peak measured in the same run
           (`bench.model.matmul_peak` at 4096^3).
  decode   B sequences at cache length S (`--decode_cases`, default 1, 8 and 32 at 1k, 8k,
           32k that fit): `--steps` greedy `decoding.decode_step`s in one jitted
           `fori_loop` with the state donated (as `generate` runs them; `args_gb` /
           `temp_gb` what the compiled program holds), from a cache of
           S positions at position S - steps (the cache zero-filled: a TPU's time does not
           depend on the values; every key up to the position is attended). Floor: the
           bytes a step must read, the serving weights (the tied embedding table once,
           for the unembedding) and the whole cache as stored (codes and scales;
           `cache.cache_bytes`), over the HBM read bandwidth measured in the same run
           (`tpu_decode.hbm_read_bandwidth`); `over_floor` = step time / floor.
  train    B x T tokens (`--train_cases`, default 1x4096): `train.make_update` (AdamW,
           float32 master weights), presets bf16 and bf16_flags (`TRAIN_PRESETS`: the
           flags' cost), with `train.remat='block'` and `train.loss_chunk=1024`,
           what fits the 16 GB chip (results/tpu-device-check/device_check-train.json).
           MFU: 3x the forward's matmul FLOPs with the unembedding at every token.
The flags' cost per phase is bf16_flags over bf16 in the same rounds. Every program's
output is checked finite before it is timed (a broken program's time is an error row).
A decode case whose cache and weights would not fit `memory.SHARE` of the device's memory
is refused before anything runs, with its estimate; a program the compiler finds too big
is recorded as that row's error. Results: <out>/tpu_model.json (rewritten after every
case; a rerun into the same --out measures only the cases it lacks,
`tpu_attention.previous`), tpu_model.md.
"""
import dataclasses
import functools
import json
import os
import statistics
import time
from typing import Dict, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import cache as cache_lib
from attnprec import decoding, kernels, layout, memory, runs, train
from attnprec.bench import model as model_bench
from attnprec.bench import tpu_attention, tpu_decode
from attnprec.config import ModelConfig
from attnprec.errors import NonFiniteError, UserError

# Qwen2.5-0.5B's architecture (random weights: no checkpoint travels to a device), its 24
# layers scanned.
QWEN05 = dict(vocab_size=151936, d_model=896, num_layers=24, num_heads=14, num_kv_heads=2,
              head_dim=64, mlp_hidden=4864, max_seq_len=32768, rope_base=1e6,
              tie_embeddings=True, qkv_bias=True, scan_layers=True)
PRESETS = ("bf16", "bf16_flags", "bf16_flags_offset", "bf16_flags_kv_int8")
DECODE_ONLY = ("bf16_flags_kv_int8",)
PREFILL_CASES: Tuple[Tuple[int, int], ...] = ((8, 1024), (1, 8192))
DECODE_CASES: Tuple[Tuple[int, int], ...] = tuple(
    (B, S) for B in (1, 8, 32) for S in (1024, 8192, 32768))
TRAIN_CASES: Tuple[Tuple[int, int], ...] = ((1, 4096),)
TRAIN_PRESETS = ("bf16", "bf16_flags")
STEPS = 16
# The model suite's presets whose Precision is bf16_flags' and whose weight form that
# suite reads from the name (`bench.model.CAST_AT_USE`, `CARRIED_PREFILL`): not ours.
NAMED_FORMS = model_bench.CAST_AT_USE + model_bench.CARRIED_PREFILL
VALID_PRESETS = tuple(p for p in model_bench.PRESETS if p not in NAMED_FORMS)
TRAIN_REMAT, TRAIN_LOSS_CHUNK = "block", 1024
PEAK_SHAPE = (4096, 4096, 4096)


def qwen05_config(**overrides) -> ModelConfig:
  return ModelConfig(**dict(QWEN05, **overrides))


def matmul_flops(config: ModelConfig, params, B: int, T: int, unembed_rows: int) -> float:
  """A forward's matmul FLOPs over B x T tokens: every layer matrix per token (a layer
  matrix is 2-D, or 3-D stacked [L, ...] in the scanned layout), causal attention's two
  [T, T] products over the visible half (the useful work: a kernel that computes the
  hidden half too is not credited with it), and the unembedding for `unembed_rows` rows
  (a prefill's B last positions; a train step's B x T)."""
  dense = sum(x.size for module, group in params.items() for x in group.values()
              if "embed" not in module
              and x.ndim == (3 if module.startswith(layout.STACKED + "/") else 2))
  attn = 2 * T * T * config.num_heads * config.head_dim * config.num_layers
  return 2.0 * B * T * dense + 2.0 * unembed_rows * config.d_model * config.vocab_size \
      + B * attn


def train_flops(config: ModelConfig, params, B: int, T: int) -> float:
  """A train step's: 3x (forward + 2 backward) the forward's, logits at every token."""
  return 3.0 * matmul_flops(config, params, B, T, B * T)


def decode_bytes(config: ModelConfig, weights: int, B: int, S: int, precision) -> int:
  """What a decode step must read: the weights and the whole cache as stored."""
  return weights + cache_lib.cache_bytes(config, B, S, precision.compute_dtype,
                                         precision.cache_storage)


def check_fits(config: ModelConfig, decode_cases, presets) -> None:
  """A UserError naming the largest decode case and its estimate (the float32 params the
  run holds, their bf16 serving copy, and the largest cache of the presets asked for)
  when it would need more than `memory.SHARE` of the device's memory: refused before
  anything runs."""
  total = tpu_decode.device_bytes()
  if total is None or not decode_cases:
    return
  weights = (4 + 2) * param_count(config)
  precs = [model_bench.PRESETS[p] for p in presets]
  need, B, S = max((max(decode_bytes(config, weights, B, S, p) for p in precs), B, S)
                   for B, S in decode_cases)
  if need > memory.SHARE * total:
    raise UserError(
        f"The tpu_model decode case {B}x{S} needs about {need / 2 ** 30:.1f} GiB of device "
        f"memory (the float32 params, their bf16 serving copy and a cache of {S} positions "
        f"for {B} sequences), more "
        f"than {memory.SHARE:.0%} of the device's {total / 2 ** 30:.1f} GiB. Drop it from "
        f"--decode_cases (the default grid keeps only the cases that fit).")


@functools.lru_cache(maxsize=8)
def param_count(config: ModelConfig) -> int:
  """The model's parameters, from the shapes alone (traced once per config)."""
  return sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(
      jax.eval_shape(lambda: init_params(config))))


def fitting(config: ModelConfig, cases, presets) -> Tuple[Tuple[int, int], ...]:
  """The cases of `cases` that `check_fits` accepts alone."""
  out = []
  for case in cases:
    try:
      check_fits(config, (case,), presets)
      out.append(case)
    except UserError:
      pass
  return tuple(out)


def init_params(config: ModelConfig):
  """Random weights for `config` (seed 0)."""
  from attnprec import model as model_lib
  return model_lib.init_params(config, jax.random.PRNGKey(0))


def _error(e: Exception) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _finite(what: str, x) -> None:
  if not np.isfinite(np.asarray(x)).all():
    raise FloatingPointError(f"non-finite values in the {what}; not timed")


def _time(call) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(call())
  return time.perf_counter() - t0


class _Serving:
  """(params, precision) as served for a preset (`bench.model.serving_params`: the
  weights made once per compute dtype and weight form, shared by the presets)."""

  def __init__(self, params):
    self.params, self._made = params, {}

  def __call__(self, precision):
    return model_bench.serving_params(self._made, self.params, precision)[:2]


def _interleave(live: Dict[str, callable], rounds: int, rows: dict) -> Dict[str, float]:
  """Medians of `rounds` interleaved calls of each of `live`; a row whose call fails (out
  of memory, say) gets the error in `rows` and drops out, the others go on."""
  samples = {n: [] for n in live}
  for _ in range(rounds):
    for name, call in list(live.items()):
      try:
        samples[name].append(call())
      except Exception as e:  # noqa: BLE001 -- recorded; the other rows still run
        rows[name] = {"error": _error(e)}
        del live[name], samples[name]
  return {n: statistics.median(ts) for n, ts in samples.items()}


def prefill_case(config, serving, B: int, P: int, presets, *, rounds: int, peak: float,
                 platform: str) -> dict:
  rows, live = {}, {}
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (B, P)),
                       jnp.int32)
  lengths = jnp.full((B,), P, jnp.int32)
  for name in presets:
    if name in DECODE_ONLY:
      continue
    try:
      params, prec = serving(model_bench.PRESETS[name])
      params = decoding.prefill_params(params, prec, B * P)
      fn = jax.jit(functools.partial(decoding.prefill, config=config, precision=prec,
                                     cache_length=P))
      t0 = time.perf_counter()
      compiled = fn.lower(params, prompt, lengths).compile()
      row = rows[name] = {"compile_s": round(time.perf_counter() - t0, 1),
                          "precision": prec.describe(platform),
                          "kernel": kernels.resolve(prec.kernel, P, P, platform, prec)}
      _finite("prefill's logits", compiled(params, prompt, lengths).last_BxV)
      live[name] = functools.partial(_time, functools.partial(compiled, params, prompt,
                                                              lengths))
    except Exception as e:  # noqa: BLE001 -- recorded; the other rows still run
      rows[name] = {"error": _error(e)}
  flops = matmul_flops(config, serving.params, B, P, B)
  for name, t in _interleave(live, rounds, rows).items():
    rows[name].update(median_ms=1e3 * t, tokens_per_s=B * P / t, mfu=flops / t / peak)
  return {"phase": "prefill", "B": B, "P": P, "flops": flops, "rows": rows}


def decode_case(config, serving, B: int, S: int, presets, *, rounds: int, steps: int,
                bandwidth: float, platform: str) -> dict:
  rows, live = {}, {}
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (B,)),
                       jnp.int32)
  for name in presets:
    try:
      params, prec = serving(model_bench.PRESETS[name])

      def fresh(prec=prec):
        return decoding.DecodeState(
            cache_lib.init_cache(config, B, S, prec.compute_dtype, prec.cache_storage),
            jnp.zeros((B, config.vocab_size), jnp.float32),
            jnp.full((B,), S - steps, jnp.int32))

      make = jax.jit(fresh)
      loop = jax.jit(functools.partial(model_bench._decode_loop, config=config,
                                       precision=prec, steps=steps), donate_argnums=(1,))
      t0 = time.perf_counter()
      compiled = loop.lower(params, jax.eval_shape(fresh), tokens).compile()
      weights = model_bench.weight_bytes(params)
      need = decode_bytes(config, weights, B, S, prec)
      row = rows[name] = {
          "compile_s": round(time.perf_counter() - t0, 1), "precision": prec.describe(platform),
          "kernel": kernels.resolve(prec.kernel, 1, S, platform, prec),
          "weight_gb": weights / 1e9, "cache_gb": (need - weights) / 1e9,
          "floor_ms": 1e3 * need / bandwidth}
      # what the compiled program holds: arguments above the weights and the cache's
      # logical bytes mean a padded layout (a head dim under 128 lanes, minor)
      m = compiled.memory_analysis()
      if m is not None:
        row.update(args_gb=m.argument_size_in_bytes / 1e9, temp_gb=m.temp_size_in_bytes / 1e9)
      state, _ = compiled(params, make(), tokens)
      _finite("decode steps' logits", state.last_BxV)
      del state

      def one(compiled=compiled, params=params, make=make):
        state = jax.block_until_ready(make())     # donated below: a fresh one, untimed
        return _time(lambda: compiled(params, state, tokens)) / steps

      live[name] = one
      del row
    except Exception as e:  # noqa: BLE001 -- recorded; the other rows still run
      rows[name] = {"error": _error(e)}
  for name, t in _interleave(live, rounds, rows).items():
    r = rows[name]
    r.update(step_ms=1e3 * t, over_floor=1e3 * t / r["floor_ms"])
  return {"phase": "decode", "B": B, "S": S, "steps": steps, "rows": rows}


def train_case(config, params, B: int, T: int, presets, *, rounds: int, peak: float,
               platform: str) -> dict:
  rows, live = {}, {}
  optimizer = train.make_optimizer(total_steps=10)
  state = train.TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32),
                           jax.random.PRNGKey(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (B, T + 1)),
                       jnp.int32)
  mask = jnp.ones((B, T + 1), jnp.float32)
  for name in presets:
    if name not in TRAIN_PRESETS:
      continue
    try:
      prec = model_bench.PRESETS[name]
      fn = jax.jit(train.make_update(config, prec, optimizer, remat=TRAIN_REMAT,
                                     loss_chunk=TRAIN_LOSS_CHUNK))
      t0 = time.perf_counter()
      compiled = fn.lower(state, tokens, mask).compile()
      m = compiled.memory_analysis()
      rows[name] = {"compile_s": round(time.perf_counter() - t0, 1),
                    "precision": prec.describe(platform),
                    "kernel": kernels.resolve(prec.kernel, T, T, platform, prec),
                    "remat": TRAIN_REMAT, "loss_chunk": TRAIN_LOSS_CHUNK,
                    "temp_gb": getattr(m, "temp_size_in_bytes", 0) / 1e9}
      model_bench.check_train_step(f"the {name} {B}x{T} train step",
                                   compiled(state, tokens, mask)[1])
      live[name] = functools.partial(_time, functools.partial(compiled, state, tokens, mask))
    except Exception as e:  # noqa: BLE001 -- recorded; the other rows still run
      rows[name] = {"error": _error(e)}
  flops = train_flops(config, params, B, T)
  for name, t in _interleave(live, rounds, rows).items():
    rows[name].update(median_ms=1e3 * t, tokens_per_s=B * T / t, mfu=flops / t / peak)
  return {"phase": "train", "B": B, "T": T, "flops": flops, "rows": rows}


def flags_cost(case: dict) -> float:
  """bf16_flags' time over bf16's in one case (None where either is missing)."""
  key = "step_ms" if case["phase"] == "decode" else "median_ms"
  a, b = (case["rows"].get(p, {}).get(key) for p in ("bf16_flags", "bf16"))
  return None if a is None or b is None else a / b


def run(out_dir: str, *, presets: Sequence[str] = PRESETS,
        prefill_cases=PREFILL_CASES, decode_cases=None, train_cases=TRAIN_CASES,
        rounds: int = 3, steps: int = STEPS, config: ModelConfig = None,
        progress=print) -> dict:
  """Runs the suite (decode_cases None: `DECODE_CASES` that fit the device); writes
  <out_dir>/tpu_model.json after every case and tpu_model.md at the end."""
  config = config or qwen05_config()
  unknown = [p for p in presets if p not in VALID_PRESETS]
  if unknown:
    raise UserError(f"tpu_model presets {unknown!r}: choose from "
                    f"{', '.join(VALID_PRESETS)} (the model suite's weight-form presets, "
                    f"{', '.join(NAMED_FORMS)}, differ from bf16_flags by their name alone, "
                    f"which only that suite reads).")
  long = [f"{B}x{T}" for B, T in tuple(prefill_cases) + tuple(train_cases)
          if T > config.max_seq_len]
  if long:
    raise UserError(f"--cases / --train_cases {', '.join(long)}: more tokens than the "
                    f"model's max_seq_len ({config.max_seq_len}).")
  empty = [f"{flag} (its presets: {', '.join(among)})" for flag, cases, among in (
      ("--cases", prefill_cases, [p for p in VALID_PRESETS if p not in DECODE_ONLY]),
      ("--train_cases", train_cases, TRAIN_PRESETS))
      if cases and not set(presets) & set(among)]
  if empty:
    raise UserError(f"--model_presets={','.join(presets)} leaves no row to time in "
                    f"{' and '.join(empty)}; add one of those presets, or drop the cases.")
  if decode_cases is None:
    decode_cases = fitting(config, DECODE_CASES, presets)
  check_fits(config, decode_cases, presets)
  too_long = [f"{B}x{S}" for B, S in decode_cases if S > config.max_seq_len or S <= steps]
  if too_long:
    raise UserError(f"--decode_cases {', '.join(too_long)}: a cache length must exceed the "
                    f"{steps} decode steps and be at most the model's max_seq_len "
                    f"({config.max_seq_len}).")
  settings = {"presets": list(presets), "rounds": rounds, "steps": steps,
              "config": json.loads(json.dumps(dataclasses.asdict(config), default=str))}
  result = tpu_attention.previous(os.path.join(out_dir, "tpu_model.json"), settings)
  platform = jax.default_backend()
  result.update(backend=platform, device=str(jax.devices()[0].device_kind))
  peak = model_bench.matmul_peak(PEAK_SHAPE)["bf16"]
  bw = tpu_decode.hbm_read_bandwidth()
  for what, value in (("bf16 matmul peak (FLOP/s)", peak),
                      ("HBM read bandwidth (bytes/s)", bw["best"])):
    if not (np.isfinite(value) and value > 0):   # every MFU and floor divides by it
      raise NonFiniteError(f"The measured {what} is {value!r}: every MFU or floor of this "
                           f"run divides by it, so nothing is timed or written. Run it again "
                           f"on an idle device.")
  result.update(bf16_peak_tflops=peak / 1e12,
                read_gbps={k: v / 1e9 for k, v in bw.items()})
  params = init_params(config)            # after the probes: a broken one stops it first
  serving = _Serving(params)
  todo = ([(f"prefill {B}x{P}", ("prefill", B, P)) for B, P in prefill_cases] +
          [(f"decode {B}x{S}", ("decode", B, S)) for B, S in decode_cases] +
          [(f"train {B}x{T}", ("train", B, T)) for B, T in train_cases])
  for key, (phase, B, n) in tpu_attention.pending(todo, result, progress):
    if phase == "prefill":
      case = prefill_case(config, serving, B, n, presets, rounds=rounds, peak=peak,
                          platform=platform)
    elif phase == "decode":
      case = decode_case(config, serving, B, n, presets, rounds=rounds, steps=steps,
                         bandwidth=bw["best"], platform=platform)
    else:
      case = train_case(config, params, B, n, presets, rounds=rounds, peak=peak,
                        platform=platform)
    case.update(bf16_peak_tflops=peak / 1e12, read_gbps=bw["best"] / 1e9)
    case["flags_over_no_flags"] = flags_cost(case)
    result["cases"][key] = case
    for name, r in case["rows"].items():
      progress(f"    {name:20s} " + (_summary(case["phase"], r) if "error" not in r
                                    else r["error"]))
    runs.write_json(out_dir, "tpu_model.json", result, provenance=True)
  runs.atomic_write(os.path.join(out_dir, "tpu_model.md"), to_markdown(result))
  return result


def _summary(phase: str, r: dict) -> str:
  if phase == "decode":
    return (f"{r['step_ms']:8.3f} ms/step  floor {r['floor_ms']:.3f} ms  "
            f"x{r['over_floor']:.2f}  [{r['kernel']}]")
  return (f"{r['median_ms']:9.2f} ms  {r['tokens_per_s']:9.0f} tok/s  MFU "
          f"{r['mfu']:.2f}  [{r['kernel']}]")


def to_markdown(result: dict) -> str:
  bw = result.get("read_gbps", {})
  lines = [f"Whole model of Qwen2.5-0.5B's shape (random weights, scanned) on "
           f"{result.get('device')}: bf16 matmul peak measured "
           f"{result.get('bf16_peak_tflops', float('nan')):.0f} TFLOP/s, HBM read "
           f"bandwidth {bw.get('best', float('nan')):.0f} GB/s", "",
           "| case | preset | kernel | time | tokens/s | MFU | floor (ms) | over floor | "
           "flags / no flags |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for key, case in result["cases"].items():
    cost = case.get("flags_over_no_flags")
    for name, r in case["rows"].items():
      if "error" in r:
        lines.append(f"| {key} | {name} | | {r['error']} | | | | | |")
        continue
      flag = f"{cost:.2f}x" if cost is not None and name == "bf16_flags" else ""
      if case["phase"] == "decode":
        lines.append(f"| {key} | {name} | {r['kernel']} | {r['step_ms']:.3f} ms/step | "
                     f"{case['B'] / r['step_ms'] * 1e3:.0f} | | {r['floor_ms']:.3f} | "
                     f"{r['over_floor']:.2f}x | {flag} |")
      else:
        lines.append(f"| {key} | {name} | {r['kernel']} | {r['median_ms']:.1f} ms | "
                     f"{r['tokens_per_s']:.0f} | {r['mfu']:.2f} | | | {flag} |")
  return "\n".join(lines) + "\n"

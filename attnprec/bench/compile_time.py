"""Compile time and program size against depth, unrolled vs scanned layers
(`make bench ARGS=--suite=compile`).

The decoder's blocks run unrolled (one copy of the block per layer in the program) or,
with `model.scan_layers`, as one `lax.scan` over stacked params (one copy in a loop).
This suite measures what that changes as the depth grows: for each depth, each program
(the prefill, one decode step, the train step) and each layout, the time to trace and
lower it (`jit(...).lower`), to compile it (`lowered.compile()`), the size of the lowered
StableHLO text and its op count, and the size and instruction count of the compiled HLO.

Nothing runs: params, optimizer state and cache are shapes (`jax.eval_shape`), so the
cost is compiling alone. The persistent compilation cache is switched off for the run
(a hit would time a file read), and every measurement builds a fresh `jax.jit`, so no
in-memory cache is hit either. Layouts alternate within a depth and program (unrolled,
scanned, unrolled, ... over `rounds`): drift on a shared machine hits both alike; compare
ratios within one run. Times are the minimum over the rounds.

Shapes: L layers, D width, B batch, P prompt length, S cache length, T train tokens.
"""
import dataclasses
import functools
import re
import time
from typing import Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp

from attnprec import decoding, train
from attnprec import model as model_lib
from attnprec.cache import init_cache
from attnprec.config import ModelConfig
from attnprec.presets import variant

DEPTHS = (2, 8, 32, 80)
MAX_DEPTH = 1024   # deeper than any model the project serves (80 layers) by far
QUICK_DEPTHS = (2, 8)
PROGRAMS = ("prefill", "decode", "train")
LAYOUTS = ("unrolled", "scanned")
# A small model whose depth is the variable: d=256, 4 heads (and 4 kv heads) of 64.
BASE = ModelConfig(vocab_size=1024, d_model=256, num_layers=2, num_heads=4, num_kv_heads=4,
                   head_dim=64, mlp_hidden=1024, max_seq_len=256)
PRECISION = variant("fp32_attention")      # bf16 compute, both attention flags on
B, P, S, T = 1, 32, 64, 32
_OP = re.compile(r"^\s*(?:%[\w#:.]+(?:, %[\w#:.]+)* = )?\"?([a-z_]+\.[a-z_.]+)", re.M)
_HLO_INSTR = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = ", re.M)


def config_at(depth: int, layout: str) -> ModelConfig:
  return dataclasses.replace(BASE, num_layers=depth, scan_layers=layout == "scanned")


def program_and_args(program: str, config: ModelConfig):
  """(a fresh `jax.jit` of `program` for `config`, its abstract arguments)."""
  params = jax.eval_shape(lambda: model_lib.init_params(config, jax.random.PRNGKey(0)))
  lengths_B = jax.ShapeDtypeStruct((B,), jnp.int32)
  if program == "prefill":
    fn = jax.jit(functools.partial(decoding.prefill, config=config, precision=PRECISION,
                                   cache_length=S))
    return fn, (params, jax.ShapeDtypeStruct((B, P), jnp.int32), lengths_B)
  if program == "decode":
    cache = jax.eval_shape(lambda: init_cache(config, B, S, PRECISION.compute_dtype))
    state = decoding.DecodeState(cache, jax.ShapeDtypeStruct((B, config.vocab_size),
                                                             jnp.float32), lengths_B)
    fn = jax.jit(functools.partial(decoding.decode_step, config=config,
                                   precision=PRECISION))
    return fn, (params, state, lengths_B)
  optimizer = train.make_optimizer(total_steps=10)
  state = jax.eval_shape(lambda: train.init_state(config, optimizer, 0))
  fn = jax.jit(train.make_update(config, PRECISION, optimizer))
  return fn, (state, jax.ShapeDtypeStruct((2, T), jnp.int32),
              jax.ShapeDtypeStruct((2, T), jnp.float32))


def measure(program: str, config: ModelConfig) -> dict:
  """One lowering (tracing included) and compile of `program`: seconds and sizes."""
  fn, args = program_and_args(program, config)
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  stablehlo = lowered.as_text()
  hlo = compiled.as_text() or ""
  return {"lower_s": t1 - t0, "compile_s": t2 - t1,
          "stablehlo_bytes": len(stablehlo), "stablehlo_ops": len(_OP.findall(stablehlo)),
          "hlo_bytes": len(hlo), "hlo_instructions": len(_HLO_INSTR.findall(hlo))}


def run(*, depths: Sequence[int] = DEPTHS, programs: Sequence[str] = PROGRAMS,
        rounds: int = 1, log: Callable[[str], None] = print,
        on_row: Optional[Callable[[dict], None]] = None) -> dict:
  """Every (depth, program, layout) measured `rounds` times, layouts alternating; the
  minimum time of each, sizes (the same every round) once. `on_row(result so far)`
  after each (depth, program)."""
  cache_was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  rows = []
  result = {"config": dataclasses.asdict(BASE), "precision": PRECISION.describe(),
            "shapes": {"B": B, "P": P, "S": S, "train_T": T}, "rounds": rounds,
            "backend": jax.default_backend(), "rows": rows}
  started = time.perf_counter()
  try:
    for program in programs:   # untimed warm-up: jax's first-use costs
      measure(program, config_at(min(depths), "unrolled"))
    for depth in depths:
      for program in programs:
        runs: Dict[str, list] = {k: [] for k in LAYOUTS}
        for _ in range(rounds):
          for layout in LAYOUTS:
            runs[layout].append(measure(program, config_at(depth, layout)))
        for layout in LAYOUTS:
          best = dict(runs[layout][0])
          for k in ("lower_s", "compile_s"):
            best[k] = min(r[k] for r in runs[layout])
          rows.append(dict(best, depth=depth, program=program, layout=layout))
          log(f"  L={depth:3d} {program:8s} {layout:9s} lower {best['lower_s']:6.2f} s  "
              f"compile {best['compile_s']:6.2f} s  StableHLO {best['stablehlo_bytes']:>9,} B "
              f"({best['stablehlo_ops']:,} ops)  HLO {best['hlo_bytes']:>9,} B "
              f"[{time.perf_counter() - started:.0f} s]")
        if on_row:
          on_row(result)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache_was)
  result["wall_s"] = time.perf_counter() - started
  return result


def _row(result, depth, program, layout) -> Optional[dict]:
  for r in result["rows"]:
    if (r["depth"], r["program"], r["layout"]) == (depth, program, layout):
      return r
  return None


def _reference_depth(depths) -> int:
  return 8 if 8 in depths[:-1] else depths[0]


def ratios(result: dict) -> Dict[str, Dict[str, float]]:
  """{program: {layout: lower + compile time at the deepest depth / at depth 8 (else
  the shallowest)}}: how compile time grows with depth."""
  depths = sorted({r["depth"] for r in result["rows"]})
  if len(depths) < 2:
    return {}
  ref = _reference_depth(depths)
  out = {}
  for program in dict.fromkeys(r["program"] for r in result["rows"]):
    out[program] = {}
    for layout in LAYOUTS:
      a, b = _row(result, depths[-1], program, layout), _row(result, ref, program, layout)
      if a and b:
        out[program][layout] = (a["lower_s"] + a["compile_s"]) / (b["lower_s"] + b["compile_s"])
  return out


def to_markdown(result: dict) -> str:
  lines = [f"Compile time and program size against depth ({result['backend']}, "
           f"{result['precision']}; d={result['config']['d_model']}, "
           f"{result['config']['num_heads']} heads; B={B}, prompt {P}, cache {S}, "
           f"train 2x{T}; times: min of {result['rounds']} round(s)).", "",
           "| program | L | layout | lower s | compile s | StableHLO KB | StableHLO ops | "
           "HLO KB | HLO instr. |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
  for r in result["rows"]:
    lines.append(f"| {r['program']} | {r['depth']} | {r['layout']} | {r['lower_s']:.2f} | "
                 f"{r['compile_s']:.2f} | {r['stablehlo_bytes'] / 1e3:,.0f} | "
                 f"{r['stablehlo_ops']:,} | {r['hlo_bytes'] / 1e3:,.0f} | "
                 f"{r['hlo_instructions']:,} |")
  depths = sorted({r["depth"] for r in result["rows"]})
  rs = ratios(result)
  if rs:
    ref = _reference_depth(depths)
    lines += ["", f"Lower + compile time at L={depths[-1]} over L={ref}:"]
    lines += [f"- {p}: " + ", ".join(f"{k} {v:.2f}x" for k, v in by.items())
              for p, by in rs.items()]
  return "\n".join(lines) + "\n"

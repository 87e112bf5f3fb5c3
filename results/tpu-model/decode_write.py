"""A decode step's cache write, as one scatter or as B update slices
(`cache.DECODE_WRITES` forces one; since this run a TPU writes values as slices and int8
codes as the scatter, `platforms.Platform.decode_write`), side by side in one run: the
whole model of `bench --suite=tpu_model` (Qwen2.5-0.5B's shape, scanned, 'auto', weights
as served), its decode loop timed in
interleaved rounds per form, and the compiled program of each kept (gzipped) to read
what the step does with its stacked cache (copies, transposes, layouts).

  python3 results/tpu-model/decode_write.py OUT_DIR [PRESET:BxS ...]

Default cases: bf16_flags at 8x8192, 8x32768, 1x8192 and bf16_flags_kv_int8 at 1x32768.
Writes OUT_DIR/decode_write.json (with provenance; rewritten after every case),
decode-<form>-<preset>-<B>x<S>.hlo.txt.gz, and prints a line per row. After the timed
rounds, one more call of each form runs under `jax.profiler`: the device's op times, summed
by op name (`jax.profiler.ProfileData`), go into the row as `ops` (the 30 longest), so
where a step's time goes is read from the chip, not guessed from the program."""
import functools
import gzip
import json
import os
import statistics
import sys
import time

from attnprec.xla_env import disable_excess_precision

disable_excess_precision()   # before jax is imported, as every runner (attnprec/xla_env.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from attnprec import cache as cache_lib  # noqa: E402
from attnprec import decoding, runs  # noqa: E402
from attnprec.bench import model as model_bench  # noqa: E402
from attnprec.bench import tpu_decode, tpu_model  # noqa: E402
from attnprec.bench.device_profile import device_ops  # noqa: E402

FORMS = ("slices", "scatter")
STEPS, ROUNDS = 16, 5


def programs(config, serving, name, B, S):
  params, prec = serving(model_bench.PRESETS[name])

  def fresh():
    return decoding.DecodeState(
        cache_lib.init_cache(config, B, S, prec.compute_dtype, prec.cache_storage),
        jnp.zeros((B, config.vocab_size), jnp.float32), jnp.full((B,), S - STEPS, jnp.int32))

  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (B,)),
                       jnp.int32)
  out = {}
  for form in FORMS:
    cache_lib.DECODE_WRITES = form         # read while tracing: each form its own program
    try:
      loop = jax.jit(functools.partial(model_bench._decode_loop, config=config,
                                       precision=prec, steps=STEPS), donate_argnums=(1,))
      compiled = loop.lower(params, jax.eval_shape(fresh), tokens).compile()
    finally:
      cache_lib.DECODE_WRITES = None
    out[form] = (compiled, params, tokens, jax.jit(fresh), prec)
  return out


def parse_case(item: str):
  """(preset, B, S) from 'PRESET:BxS'; a malformed item or an unknown preset exits 2,
  naming it and the valid ones, before anything is compiled."""
  name, _, case = item.partition(":")
  sizes = case.split("x")
  if name not in model_bench.PRESETS or len(sizes) != 2 or \
      not all(x.isdigit() and int(x) > 0 for x in sizes):
    print(f"decode_write.py: {item!r} is not PRESET:BxS with B and S positive integers and "
          f"PRESET one of {', '.join(sorted(model_bench.PRESETS))} (e.g. "
          f"bf16_flags:8x32768).", file=sys.stderr)
    sys.exit(2)
  return name, int(sizes[0]), int(sizes[1])


def main(out_dir, wanted):
  for item in wanted:                 # every case checked before anything is compiled
    parse_case(item)
  os.makedirs(out_dir, exist_ok=True)
  config = tpu_model.qwen05_config()
  serving = tpu_model._Serving(tpu_model.init_params(config))
  bw = tpu_decode.hbm_read_bandwidth()["best"]
  result = {"steps": STEPS, "rounds": ROUNDS, "read_gbps": bw / 1e9,
            "device": str(jax.devices()[0].device_kind), "cases": {}}
  for item in wanted:
    name, B, S = parse_case(item)
    rows = {}
    built = programs(config, serving, name, B, S)
    for form, (compiled, params, tokens, make, prec) in built.items():
      path = os.path.join(out_dir, f"decode-{form}-{name}-{B}x{S}.hlo.txt.gz")
      with gzip.open(path + ".tmp", "wt") as f:    # renamed whole: a kill leaves no half file
        f.write(compiled.as_text())
      os.replace(path + ".tmp", path)
      m = compiled.memory_analysis()
      weights = model_bench.weight_bytes(params)
      need = tpu_model.decode_bytes(config, weights, B, S, prec)
      state, _ = compiled(params, make(), tokens)
      finite = bool(np.isfinite(np.asarray(state.last_BxV)).all())
      del state
      rows[form] = {"floor_ms": 1e3 * need / bw, "finite": finite,
                    "args_gb": m.argument_size_in_bytes / 1e9 if m else None,
                    "temp_gb": m.temp_size_in_bytes / 1e9 if m else None, "samples": []}
    for _ in range(ROUNDS):
      for form, (compiled, params, tokens, make, _) in built.items():
        if not rows[form]["finite"]:
          continue                        # a broken program's time would read like any other
        state = jax.block_until_ready(make())
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, state, tokens))
        rows[form]["samples"].append((time.perf_counter() - t0) / STEPS)
    for form, (compiled, params, tokens, make, _) in built.items():
      if rows[form]["finite"]:
        state = jax.block_until_ready(make())
        rows[form]["ops"] = device_ops(
            lambda: jax.block_until_ready(compiled(params, state, tokens)))
    for form, r in rows.items():
      if r["samples"]:
        r["step_ms"] = 1e3 * statistics.median(r["samples"])
        r["over_floor"] = r["step_ms"] / r["floor_ms"]
      print(f"{item:28s} {form:8s} {r.get('step_ms', float('nan')):8.3f} ms/step  "
            f"x{r.get('over_floor', float('nan')):.2f} floor  args {r['args_gb']} GB  "
            f"temp {r['temp_gb']} GB  finite {r['finite']}", flush=True)
      for op, (us, n) in list(r.get("ops", {}).items())[:8]:
        print(f"    {op:40s} {us / STEPS:10.1f} us/step  x{n}", flush=True)
    result["cases"][item] = rows
    runs.write_json(out_dir, "decode_write.json", result, provenance=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:] or ["bf16_flags:8x8192", "bf16_flags:8x32768",
                                     "bf16_flags:1x8192", "bf16_flags_kv_int8:1x32768"])

"""Device check: `python runners/device_check.py [--out=DIR]` (`make device-check`).

On a TPU it checks what can only be checked there:
  audit    the compiled audit on this TPU (the tiny recall architecture under
           fp32_attention, highest, blockwise and pallas; the bf16 program held to
           fp32_attention's contract must FAIL): every attention dot read back from what
           the TPU compiled, the Pallas kernel's Mosaic bodies;
  kernels  prefill attention at Qwen2-7B's shape (B=1, S=2048, N=28, K=4, H=128, bf16,
           causal): dot_product (bf16 and both flags), blockwise, pallas, flash (both flags) and
           jax's splash attention (K/V repeated to N heads): median time, max |error| and
           relative L2 against the float64 reference;
  flags    the cost of the flags per phase (bf16 vs bf16 + both flags: train step,
           prefill, decode step; `bench.model.flag_cost`) on SmolLM2-135M's shape with
           random weights, its 30 layers scanned (no checkpoint travels to the TPU);
  train    Qwen2.5-0.5B's shape (random weights, scanned) train step at 1 x 4096 and
           8 x 2048, the dense, blockwise and flash kernels, per `train.remat` (none, attention,
           block) and `train.loss_chunk` (0, 1024): compiled memory, whether it
           fits, step time and MFU over the measured bf16 matmul peak;
  decode   its decode step as served (bf16 + both flags, 'auto') at batch 1 / cache 4k
           and batch 8 / cache 1k against its HBM floor (weights + cache bytes over the
           measured read bandwidth).
`--parts` runs a subset (each part fits one call on a borrowed device). `--tables=DIR`
prints the docs' TPU tables rendered from DIR's files (`attnprec.bench.device_tables`;
docs/performance.md quotes them to the character), on any machine.

On a machine with an NVIDIA GPU it checks what can only be checked there:
  audit    the precision audit for 'cuda' on the compiled program (the tiny recall
           architecture under fp32_attention and highest): what XLA:GPU made of every dot;
  kernels  prefill attention at B=1, S=2048, N=K=8, H=64 (bf16, causal): the dense
           'dot_product' kernel, the 'pallas' kernel if the registry has one (looked up
           by name now; said when absent) and jax.nn.dot_product_attention(
           implementation='cudnn'): median time and max |error| against the float64
           reference (`contract.reference_attention_np`);
  flags    the cost of the flags per phase (bf16 vs bf16 + both flags: train step,
           prefill, decode step) on SmolLM2-135M (`bench.model.flag_cost`), if its
           checkpoint can be loaded here.
Results go to <out>/device_check.json and device_check.md (atomic writes); a part that
fails is recorded with its error and the others still run.

On a machine without an accelerator it exits 0 after one line saying so, and writes
nothing.
Exit codes: 0 done (also: no GPU), 2 bad input, 3 the cuda audit found a mismatch, 1 a
crash (attnprec.cli).
"""
import json
import os
import statistics
import sys
import time

from attnprec import startup

startup.begin("device_check", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from attnprec import cli, platforms, runs  # noqa: E402
from attnprec.errors import UserError  # noqa: E402

EXAMPLES = ["python runners/device_check.py --out=runs/device_check"]
SHAPE = dict(B=1, S=2048, N=8, K=8, H=64)


def here() -> str:
  """The `platforms` name of this machine's backend ('cpu', 'cuda', ...; '' if none)."""
  return platforms.local_platform(jax.default_backend(), getattr(
      jax.devices()[0].client, "platform_version", "")) or jax.default_backend()


def _median_s(fn, *args, reps: int = 20) -> float:
  jax.block_until_ready(fn(*args))        # compile and warm up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def audit_part(platform: str = "cuda") -> dict:
  from attnprec import audit
  from attnprec.config import ModelConfig
  from attnprec.presets import variant
  config = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_hidden=32, max_seq_len=64)
  safe = variant("fp32_attention")
  presets = [("fp32_attention", safe), ("highest", variant("highest"))]
  if platform == "tpu":
    presets += [("blockwise", variant("fp32_attention", kernel="blockwise")),
                ("pallas", variant("fp32_attention", kernel="pallas"))]
  out = {}
  for name, p in presets:
    train = safe if p.kernel == "pallas" else p
    r = audit.run_audit(config, train, p, platform=platform, compile=True)
    out[name] = {"ok": r["ok"], "compiled_checked": audit.not_compiled(r) is None,
                 "problems": r["problems"][:20],
                 "compiled": audit.compiled_table(r), "verdict": audit.verdict(r)}
    if any("mosaic" in r["phases"][ph] for ph in audit.PHASES):
      out[name]["mosaic"] = audit.mosaic_table(r)
  if platform == "tpu":
    # the bf16 program's compiled text held to fp32_attention's contract: must FAIL
    bf16 = variant("bf16")
    traced = audit.trace_programs(config, bf16, bf16, platform=platform)
    texts = {ph: t.lower().compile().as_text() for ph, (_, t) in traced.items()}
    r = audit.run_audit(config, safe, safe, platform=platform, compiled_texts=texts)
    out["bf16 program held to fp32_attention (must FAIL)"] = {
        "ok": not r["ok"], "verdict": audit.verdict(r)[:600]}
  return out


def kernels_part() -> dict:
  from attnprec import contract, kernels
  from attnprec.presets import variant
  B, S, N, K, H = (SHAPE[x] for x in "BSNKH")
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((B, S, n, H)).astype(np.float32) for n in (N, K, K))
  want = contract.reference_attention_np(q, k, v, mask=np.tril(np.ones((S, S), bool)))
  qkv = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  fns = {}
  for name in ("dot_product", "pallas"):
    if name not in kernels.NAMES:
      continue
    prec = variant("fp32_attention", kernel=name)
    fns[name] = jax.jit(lambda q, k, v, prec=prec: kernels.attend(
        prec, q, k, v, mask=contract.CausalMask(pos, pos)))
  fns["jax_nn_cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn"))
  out = {"shape": SHAPE, "dtype": "bfloat16", "reference": "float64 NumPy",
         "pallas": "in the registry" if "pallas" in kernels.NAMES else
         f"absent: attnprec.kernels has {', '.join(kernels.NAMES)}",
         "cudnn": "q, k, v in bf16: the probabilities enter its wv dot in bf16 "
                  "(attnprec/kernels/jax_nn.py)", "rows": {}}
  out.update(rows=timed_rows(fns, qkv, want, base="dot_product"), time_vs_base="dot_product")
  return out


def timed_rows(fns: dict, qkv: tuple, want, *, base: str) -> dict:
  """{name: median_ms, max_abs_error, rel_l2 (against `want`), time_vs_<base>} per
  function, or {error} for one that failed: a non-finite output is an error
  (`checkpoints.finite.require_finite`), never timed or compared as if it were one."""
  from attnprec.checkpoints.finite import require_finite
  rows = {}
  for name, fn in fns.items():
    try:
      got = np.asarray(jnp.asarray(fn(*qkv), jnp.float32), np.float64)
      require_finite(f"the output of {name}", got)
      t = _median_s(fn, *qkv)
      rows[name] = {"median_ms": 1e3 * t, "max_abs_error": float(np.max(np.abs(got - want))),
                    "rel_l2": float(np.linalg.norm(got - want) / np.linalg.norm(want))}
    except Exception as e:  # noqa: BLE001 -- recorded, the other kernels still run
      rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  reference = rows.get(base, {}).get("median_ms")
  for row in rows.values():
    if reference and "median_ms" in row:
      row["time_vs_base"] = row["median_ms"] / reference
  return rows


TPU_SHAPE = dict(B=1, S=2048, N=28, K=4, H=128)


def tpu_kernels_part() -> dict:
  """Qwen2-7B's attention shape on the TPU: attnprec's kernels and jax's splash."""
  from attnprec import contract, kernels
  from attnprec.presets import variant
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)
  B, S, N, K, H = (TPU_SHAPE[x] for x in "BSNKH")
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((B, S, n, H)).astype(np.float32) for n in (N, K, K))
  qkv = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  exact = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in qkv]
  want = contract.reference_attention_np(*exact, mask=np.tril(np.ones((S, S), bool)))
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  fns = {}
  for label, kernel, flags in (("dot_product bf16", "dot_product", False),
                               ("dot_product both flags", "dot_product", True),
                               ("blockwise both flags", "blockwise", True),
                               ("pallas both flags", "pallas", True),
                               ("flash both flags", "flash", True)):
    prec = variant("fp32_attention" if flags else "bf16", kernel=kernel)
    fns[label] = jax.jit(lambda q, k, v, prec=prec: kernels.attend(
        prec, q, k, v, mask=contract.CausalMask(pos, pos)))
  kernel = splash.make_splash_mha(masks.MultiHeadMask([masks.CausalMask((S, S))] * N),
                                  head_shards=1, q_seq_shards=1)

  def splash_fn(q, k, v):      # [B, S, N, H] -> splash's [N, S, H], K/V repeated to N
    g = N // K
    qs = jnp.transpose(q[0], (1, 0, 2)) * jnp.asarray(H ** -0.5, q.dtype)
    ks, vs = (jnp.repeat(jnp.transpose(x[0], (1, 0, 2)), g, axis=0) for x in (k, v))
    return jnp.transpose(kernel(qs, ks, vs), (1, 0, 2))[None]
  fns["jax splash (flags-on semantics)"] = jax.jit(splash_fn)
  out = {"shape": TPU_SHAPE, "dtype": "bfloat16", "reference": "float64 NumPy on the bf16 "
         "inputs", "rows": {}}
  base = "jax splash (flags-on semantics)"
  out.update(rows=timed_rows(fns, qkv, want, base=base), time_vs_base=base)
  return out


def tpu_flags_part() -> dict:
  """The flags' cost per phase on SmolLM2-135M's shape, random weights, layers scanned."""
  from attnprec.bench import model as model_bench
  from attnprec.config import ModelConfig
  from attnprec.model import init_params
  config = ModelConfig(vocab_size=49152, d_model=576, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, mlp_hidden=1536, max_seq_len=4096,
                       rope_base=100000.0, tie_embeddings=True, scan_layers=True)
  params = init_params(config, jax.random.PRNGKey(0))
  result = model_bench.flag_cost(config, params, (8, 1024), 1024, 3, lambda *a, **k: None,
                                 np.random.default_rng(0))
  return {"model": "SmolLM2-135M's shape, random weights, scan_layers",
          "case": "batch 8, 1024-token prefill and decode steps, 1024-token train step",
          **{k: result[k] for k in ("flags_over_no_flags", "median_s")}}


# Qwen2.5-0.5B's architecture, random weights, 24 layers scanned (`bench.tpu_model.QWEN05`):
# the whole-model parts on a TPU.
TRAIN_CASES = ((1, 4096), (8, 2048))
# (kernel, train.remat, train.loss_chunk) per row: what each buys, one at a time
TRAIN_ROWS = (("flash", "none", 1024), ("flash", "block", 1024),
              ("dot_product", "none", 0), ("dot_product", "attention", 0),
              ("dot_product", "block", 0), ("blockwise", "block", 0),
              ("dot_product", "attention", 1024), ("dot_product", "block", 1024),
              ("blockwise", "block", 1024))
DECODE_CASES = ((1, 4096), (8, 1024))


def _qwen05():
  from attnprec.bench import tpu_model
  config = tpu_model.qwen05_config()
  return config, tpu_model.init_params(config)


def tpu_train_part() -> dict:
  """Qwen2.5-0.5B's train step (bf16 + both flags, AdamW) per `TRAIN_ROWS`: kernel (the
  dense one, or blockwise, which keeps no [T, S] logits), `train.remat` and
  `train.loss_chunk`: whether it fits (compiled memory), its time and MFU over the
  measured bf16 matmul peak."""
  import dataclasses as dc
  from attnprec import train
  from attnprec.bench import model as model_bench
  from attnprec.bench import tpu_model
  from attnprec.presets import variant
  config, params = _qwen05()
  peak = model_bench.matmul_peak((4096, 4096, 4096))["bf16"]
  optimizer = train.make_optimizer(total_steps=10)
  state = train.TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32),
                           jax.random.PRNGKey(0))
  capacity = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  out = {"model": "Qwen2.5-0.5B's shape, random weights, scan_layers",
         "precision": variant("fp32_attention").describe(), "bf16_peak_tflops": peak / 1e12,
         "device_bytes": capacity, "cases": {}}
  for B, T in TRAIN_CASES:
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (B, T + 1)),
                         jnp.int32)
    mask = jnp.ones((B, T + 1), jnp.float32)
    for kernel, remat, chunk in TRAIN_ROWS:
      prec = variant("fp32_attention", kernel=kernel)
      key = f"{B}x{T} {kernel} remat={remat} loss_chunk={chunk}"
      row = out["cases"][key] = {}
      try:
        t0 = time.perf_counter()
        fn = jax.jit(train.make_update(config, prec, optimizer, remat=remat,
                                       loss_chunk=chunk))
        compiled = fn.lower(state, tokens, mask).compile()
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        m = compiled.memory_analysis()
        row["temp_gb"] = m.temp_size_in_bytes / 1e9
        row["args_gb"] = m.argument_size_in_bytes / 1e9
        model_bench.check_train_step(f"the {key} train step",
                                     compiled(state, tokens, mask)[1])
        t = _median_s(compiled, state, tokens, mask, reps=5)
        row["step_ms"] = 1e3 * t
        row["mfu"] = tpu_model.train_flops(config, params, B, T) / t / peak
      except Exception as e:  # noqa: BLE001 -- recorded: a step that does not fit says so
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
  return out


def tpu_decode_part() -> dict:
  """Qwen2.5-0.5B's decode step as served (bf16 + both flags, 'auto'), against its HBM
  floor: the weights' and the cache's bytes over the measured read bandwidth."""
  from attnprec.bench import model as model_bench
  config, params = _qwen05()
  bandwidth = model_bench.read_bandwidth(1024)
  prec = model_bench.PRESETS["bf16_flags"]
  out = {"model": "Qwen2.5-0.5B's shape, random weights, scan_layers",
         "read_gbps": bandwidth / 1e9, "cases": {}}
  steps, carried = 16, {}
  for B, P in DECODE_CASES:
    key = f"{B}x{P}"
    try:
      prompt = np.random.default_rng(0).integers(0, config.vocab_size, (B, P)).astype(np.int32)
      case = model_bench._AttnprecCase(config, params, prec, prompt, steps, carried=carried)
      step = statistics.median(case.decode() for _ in range(5)) / steps
      weights = model_bench.weight_bytes(case.params)
      cache = 2 * config.num_layers * B * (P + steps) * config.num_kv_heads * \
          config.head_dim * 2
      floor = (weights + cache) / bandwidth
      out["cases"][key] = {"weights": case.weights, "precision": case.precision.describe(),
                           "step_ms": 1e3 * step, "floor_ms": 1e3 * floor,
                           "over_floor": step / floor, "weight_gb": weights / 1e9,
                           "cache_gb": cache / 1e9}
    except Exception as e:  # noqa: BLE001 -- recorded, the next case still runs
      out["cases"][key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  return out


def flags_part() -> dict:
  from attnprec import checkpoints
  from attnprec.bench import model as model_bench
  ckpt = checkpoints.load("smollm2-135m")
  result = model_bench.flag_cost(ckpt.config, ckpt.params, (1, 1000), 256, 3,
                                 lambda *a, **k: None, np.random.default_rng(0))
  return {"model": "smollm2-135m", "case": "batch 1, 1000-token prefill, 256-token "
          "train step", **{k: result[k] for k in ("flags_over_no_flags", "median_s")}}


def to_markdown(result: dict) -> str:
  lines = [f"# Device check: {result['device']}", "", f"jax {result['jax']}", "",
           "" if result.get("complete") else "**Incomplete: the run stopped before its "
           "last part; the parts below are those it finished.**", ""]
  for name, part in result["parts"].items():
    lines += [f"## {name}", "", "```", json.dumps(part, indent=1, default=str), "```", ""]
  return "\n".join(lines)


PARTS = ("audit", "kernels", "flags", "train", "decode")


def check(out_dir: str, wanted=PARTS) -> int:
  platform = here()
  # --out is checked on every machine: a bad one is bad input even where nothing runs
  runs.check_output_dir(out_dir, flag="--out")
  runs.check_owner(out_dir, ("device_check",), "the device check", flag="--out")
  if platform not in ("cuda", "tpu"):
    print(f"device-check: no GPU or TPU on this machine (jax backend "
          f"{jax.default_backend()!r}); nothing to check, nothing written.")
    return cli.EXIT_OK
  result = {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
            "jax": jax.__version__, "platform": platform, "provenance": runs.provenance(),
            "parts_run": list(wanted), "complete": False, "parts": {}}
  parts = (("audit", f"audit ({platform}, compiled)", lambda: audit_part(platform)),
           ("kernels", "kernels", tpu_kernels_part if platform == "tpu" else kernels_part),
           ("flags", "flag cost per phase",
            tpu_flags_part if platform == "tpu" else flags_part),
           ("train", "train step per remat (Qwen2.5-0.5B's shape)", tpu_train_part),
           ("decode", "decode step against its HBM floor (Qwen2.5-0.5B's shape)",
            tpu_decode_part))
  parts = [(name, part) for key, name, part in parts if key in wanted]
  # recorded as the device check's, so that no other runner writes beside its results
  runs.claim(out_dir, "device_check", flag="--out", replaceable=False)
  for name, part in parts:
    print(f"device-check: {name} ...", flush=True)
    t0 = time.perf_counter()
    try:
      result["parts"][name] = part()
    except Exception as e:  # noqa: BLE001 -- recorded; the next part still runs
      result["parts"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    result["parts"][name]["seconds"] = round(time.perf_counter() - t0, 1)
    # written after each part: a run stopped midway keeps what it measured
    runs.atomic_write(os.path.join(out_dir, "device_check.json"),
                      json.dumps(result, indent=1, default=str) + "\n")
    runs.atomic_write(os.path.join(out_dir, "device_check.md"), to_markdown(result))
  result["complete"] = True        # every part asked for ran (a stopped run's says False)
  runs.atomic_write(os.path.join(out_dir, "device_check.json"),
                    json.dumps(result, indent=1, default=str) + "\n")
  runs.atomic_write(os.path.join(out_dir, "device_check.md"), to_markdown(result))
  print(to_markdown(result))
  audited = result["parts"].get(f"audit ({platform}, compiled)")
  if audited is None:              # not asked for: nothing to fail on
    return cli.EXIT_OK
  ok = all(v.get("ok", False) for v in audited.values() if isinstance(v, dict)) \
      if "error" not in audited else False
  return cli.EXIT_OK if ok else cli.EXIT_MISMATCH


def main(argv) -> int:
  parser = cli.ArgumentParser(prog="device_check", doc=__doc__, examples=EXAMPLES,
                              sections=["It reads no gin files: the options below are its "
                                        "configuration."])
  parser.add_argument("--out", default=None, metavar="DIR",
                      help="where results are written (on a GPU or TPU machine; default "
                           "runs/device_check)")
  parser.add_argument("--tables", default=None, metavar="DIR",
                      help="print the docs' TPU tables rendered from DIR's device-check "
                           "files (attnprec.bench.device_tables) and exit; needs no device")
  parser.add_argument("--parts", default=None, metavar="LIST",
                      help="which parts to run, comma-separated, in the order above "
                           f"(default: all of {', '.join(PARTS)})")
  outcome = {}

  def body():
    args = parser.parse_args(argv)
    if args.tables is not None:
      unread = [f for f in ("out", "parts") if getattr(args, f) is not None]
      if unread:
        raise UserError(f"--tables={args.tables!r} renders tables from files already "
                        f"written and runs nothing, so {', '.join('--' + f for f in unread)} "
                        f"would not be read; drop {'them' if len(unread) > 1 else 'it'}, or "
                        f"drop --tables to run the device check.")
      from attnprec.bench import device_tables
      rendered = device_tables.tables(args.tables)
      if not rendered:
        raise UserError(f"--tables={args.tables!r}: no device-check file there (looked "
                        f"for {', '.join(device_tables.FILES.values())}).")
      for name, table in rendered.items():
        print(f"{name}:\n{table}\n")
      outcome["rc"] = cli.EXIT_OK
      return
    parts = ",".join(PARTS) if args.parts is None else args.parts
    wanted = [p.strip() for p in parts.split(",") if p.strip()]
    bad = [p for p in wanted if p not in PARTS]
    if bad or not wanted:
      what = ("unknown part(s) " + ", ".join(map(repr, bad))) if bad else "no part named"
      raise UserError(f"--parts={parts!r}: {what}; the parts are "
                      f"{', '.join(PARTS)} (comma-separated, any subset).")
    outcome["rc"] = check(args.out or "runs/device_check",
                          tuple(p for p in PARTS if p in wanted))

  rc = cli.run("device_check", body)
  return outcome.get("rc", rc) if rc == cli.EXIT_OK else rc


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

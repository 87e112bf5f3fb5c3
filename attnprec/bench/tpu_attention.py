"""`--suite=tpu_attention`: attention alone on an accelerator (a TPU), every kernel x the
flags, beside jax's splash attention, in interleaved rounds.

Cases: a causal prefill of S tokens (B = 1, T = S) and its training pass (forward +
backward, `jax.grad` of a fixed projection of the output w.r.t. q, k, v) at the
attention shapes of Qwen2-7B (28 query heads over 4 kv heads, head dim 128) and
Qwen2.5-0.5B (14 over 2, head dim 64), inputs bf16. Rows: each attnprec kernel under
flags off (`bf16`), both flags (`fp32_attention`) and both + einsum_precision 'highest';
the 'flash' kernel also at each block pair of `--blocks`; jax's splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`, GQA native: its K/V heads not
repeated; q scaled by H^-0.5 in bf16 before it, as it applies no scale; float32 logits and
statistics, float32 probabilities into a DEFAULT PV dot: flags-on semantics) at each block
size of `--splash_blocks` (default: the q / kv pairs of `--blocks`; its backward blocks
the same), the anchor every row
is divided by ('/ splash' = time / the fastest splash row of the case).

Inputs (`inputs=`): 'projection' (the default) gives every row q as [1, S, N * H] and
k, v as [1, S, K * H], the arrays a model's projections produce; 'heads' gives
[1, S, N|K, H] arrays (the form of the sweeps before it; their layout on the chip puts
the heads outside the sequence, and a kernel that reads [S, N * H] pays XLA copies for
it). Each row views them as [1, S, N|K, H] and gives its output in their form ([1, S, N * H],
what an output projection reads, for projection inputs); splash's rows move them to its [heads, S, H]
and scale q inside the timed call, what a model calling it pays. Each splash block pair
also runs 'native' ('splash 512x512 native'): its inputs moved and q scaled once before
timing, so the row times the kernel alone. '/ splash' divides by the fastest splash row
of either kind (the stricter anchor); '/ splash, same inputs' by the fastest fed the
bench's inputs.

Method: every row jitted and compiled first (and its output checked finite, and against
the float64 reference at S <= `ERROR_MAX_S`); then `rounds` rounds, each row once per
round in order, each sample the time of `reps` calls (one block at the end); medians.
TFLOP/s counts causal attention's visible half: forward 2 products of 2 S^2/2 H N
FLOPs; forward + backward 7 (the backward recomputes QK^T and runs dP, dV, dQ, dK),
every kernel counted the same. The peak is a bf16 x bf16 -> f32 matmul measured in the
same run (`model.matmul_peak` at 8192^3). Results: <out>/tpu_attention.json (rewritten
after every case: an interrupted run keeps what it measured; a rerun into the same --out
measures only the cases it lacks, after `previous` has checked the file is this code's,
with these settings and finite figures), tpu_attention.md. A flash row's forward and
backward blocks are both the row's Q x KV (Q also the rows of a call read where the
caller holds it: `flash.Blocks.direct_q`).
"""
import math
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import contract, kernels, readback, runs
from attnprec.errors import UserError
from attnprec.kernels import flash
from attnprec.presets import variant

SHAPES: Dict[str, Tuple[int, int, int]] = {"qwen2-7b": (28, 4, 128),
                                          "qwen2.5-0.5b": (14, 2, 64)}
DEFAULT_SEQ_LENS = (1024, 2048, 8192, 32768)
DEFAULT_TRAIN_SEQ_LENS = (2048, 8192)
KERNELS = ("dot_product", "blockwise", "flash")
FLAG_ROWS = {"bf16": ("bf16", {}), "both": ("fp32_attention", {}),
             "both+highest": ("fp32_attention", {"einsum_precision": "highest"})}
DEFAULT_BLOCKS = ((512, 512), (1024, 512), (1024, 1024), (2048, 512))
ERROR_MAX_S = 2048
# The dense kernel's [N, S, S] logits: lengths past this are not run with it (32k: 57 GB)
DENSE_MAX_S = 8192
SPLASH = "splash"
NATIVE = "native"
INPUT_FORMS = ("projection", "heads")
PEAK_SHAPE = (8192, 8192, 8192)


def causal_flops(S: int, N: int, H: int, train: bool) -> float:
  return (7 if train else 2) * 2.0 * S * S / 2 * H * N


def _splash(N: int, K: int, H: int, S: int, blocks: Tuple[int, int], native: bool = False):
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)
  bq, bk = (min(b, S) for b in blocks)
  sizes = splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                            block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq,
                            block_kv_dq=bk)
  kernel = splash.make_splash_mha(masks.MultiHeadMask([masks.CausalMask((S, S))] * N),
                                  head_shards=1, q_seq_shards=1, block_sizes=sizes)

  if native:            # inputs already splash's (`_to_splash`), q already scaled
    return kernel

  def call(q, k, v):    # the bench's inputs -> splash's [heads, S, H]
    qs, ks, vs = _to_splash(H, (q, k, v))
    return _like(q, jnp.transpose(kernel(qs, ks, vs), (1, 0, 2))[None])
  return call


def _to_splash(H: int, qkv):
  """The bench's q, k, v as splash's [heads, S, H], q scaled by H^-0.5 (bf16)."""
  q, k, v = (_heads(x, H)[0] for x in qkv)
  qs = jnp.transpose(q, (1, 0, 2)) * jnp.asarray(H ** -0.5, q.dtype)
  return (qs,) + tuple(jnp.transpose(x, (1, 0, 2)) for x in (k, v))


def _like(q, out_1xSxNxH):
  """A row's output in its inputs' form: [1, S, N * H] (what a model's output projection
  reads) for projection inputs, else [1, S, N, H]."""
  return out_1xSxNxH.reshape(q.shape) if q.ndim == 3 else out_1xSxNxH


def _heads(x, H: int):
  """[1, S, n * H] (projection inputs) or [1, S, n, H] as [1, S, n, H]."""
  return x if x.ndim == 4 else x.reshape(x.shape[0], x.shape[1], -1, H)


def _attnprec(kernel: str, flags_row: str, S: int, H: int, blocks=None):
  preset, extra = FLAG_ROWS[flags_row]
  prec = variant(preset, kernel=kernel, **extra)
  pos = jnp.arange(S, dtype=jnp.int32)[None]
  if kernel == "flash":
    b = flash.DEFAULT_BLOCKS
    if blocks:
      b = flash.Blocks(q=blocks[0], k=blocks[1], q_bwd=blocks[0], k_bwd=blocks[1],
                       chunk=blocks[2] if len(blocks) > 2 else math.gcd(b.chunk, blocks[1]),
                       direct_q=blocks[0])
    return lambda q, k, v: _like(q, flash.flash_attention(
        _heads(q, H), _heads(k, H), _heads(v, H), causal=True, q_positions_BxT=pos,
        k_positions_BxS=pos, flags=prec.attention, blocks=b))
  # the keys are the queries' own tokens from position 0 (what 'splash' needs to know)
  mask = contract.CausalMask(pos, pos, own_positions=True)
  return lambda q, k, v: _like(q, kernels.attend(prec, _heads(q, H), _heads(k, H),
                                                 _heads(v, H), mask=mask))


def _raw_splash(name: str) -> bool:
  """Whether a row is jax's splash called directly ('splash 1024x1024'), not the
  'splash' kernel under the contract ('splash both')."""
  return name.startswith(SPLASH + " ") and name.split(" ")[1][:1].isdigit()


def _train(f, H):
  """The gradient of sum(out * cos(h)) (h: the head-dim index) w.r.t. q, k, v: the same
  loss for an output [.., N, H], [.., N * H] (projection inputs) or splash's [N, S, H]."""
  def loss(q, k, v):
    out = f(q, k, v).astype(jnp.float32)
    w = jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32) % H)
    return jnp.sum(out * w)
  return jax.grad(loss, argnums=(0, 1, 2))


def rows_for(shape: str, S: int, train: bool, kernel_names: Sequence[str],
             flag_rows: Sequence[str], blocks: Sequence[Tuple[int, int]],
             splash_blocks: Optional[Sequence[Tuple[int, int]]] = None
             ) -> Dict[str, Callable]:
  """Each row's jitted call of the bench's inputs (`_inputs`); a 'native' splash row's
  call takes `prepare(name, H, inputs)` instead."""
  N, K, H = SHAPES[shape]
  rows = {}
  for kernel in kernel_names:
    if kernel == "dot_product" and S > DENSE_MAX_S:
      continue
    for fr in flag_rows:
      if kernel == "flash":
        for bl in blocks:
          rows[f"flash {fr} {'x'.join(map(str, bl))}"] = _attnprec(kernel, fr, S, H, bl)
      else:
        rows[f"{kernel} {fr}"] = _attnprec(kernel, fr, S, H)
  for bl in dict.fromkeys(tuple(b[:2]) for b in (splash_blocks or blocks)):
    rows[f"{SPLASH} {bl[0]}x{bl[1]}"] = _splash(N, K, H, S, bl)
    rows[f"{SPLASH} {bl[0]}x{bl[1]} {NATIVE}"] = _splash(N, K, H, S, bl, native=True)
  return {name: jax.jit(_train(f, H) if train else f) for name, f in rows.items()}


def _native(name: str) -> bool:
  return _raw_splash(name) and name.endswith(" " + NATIVE)


def prepare(name: str, H: int, qkv):
  """A row's inputs: a native splash row's moved to splash's form (outside its timed
  call), any other row's as they are."""
  return jax.block_until_ready(_to_splash(H, qkv)) if _native(name) else qkv


def _as_output(name: str, out, S: int, H: int):
  """A row's forward output as [1, S, N, H] (a native splash row's is [N, S, H], a
  projection-input row's [1, S, N * H])."""
  if _native(name):
    return jnp.transpose(out, (1, 0, 2))[None]
  return out.reshape(1, S, -1, H)


def _inputs(shape: str, S: int, seed: int = 0, form: str = "projection"):
  """q, k, v bf16: [1, S, n * H] ('projection') or [1, S, n, H] ('heads'); the same
  numbers either way."""
  if form not in INPUT_FORMS:
    raise UserError(f"tpu_attention inputs={form!r} is not one of {INPUT_FORMS}.")
  N, K, H = SHAPES[shape]
  rng = np.random.default_rng(seed)
  arrays = [rng.standard_normal((1, S, n, H)) for n in (N, K, K)]
  return tuple(jnp.asarray(a if form == "heads" else a.reshape(1, S, -1), jnp.bfloat16)
               for a in arrays)


def _reference(qkv, S, H):
  exact = [np.asarray(jnp.asarray(_heads(x, H), jnp.float32), np.float64) for x in qkv]
  return contract.reference_attention_np(*exact, mask=np.tril(np.ones((S, S), bool)))


def _reps(S: int) -> int:
  return max(1, 8192 // S) if S < 8192 else 1


def run_case(shape: str, S: int, train: bool, *, kernel_names, flag_rows, blocks,
             rounds: int, splash_blocks=None, inputs: str = "projection",
             progress=print) -> dict:
  N, K, H = SHAPES[shape]
  qkv = _inputs(shape, S, form=inputs)
  fns = rows_for(shape, S, train, kernel_names, flag_rows, blocks, splash_blocks)
  want = _reference(qkv, S, H) if (S <= ERROR_MAX_S and not train) else None
  rows: Dict[str, dict] = {}
  live, args = {}, {}
  for name, fn in fns.items():
    try:
      args[name] = prepare(name, H, qkv)
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(*args[name]))
      compile_s = time.perf_counter() - t0
      leaves = [np.asarray(jnp.asarray(x, jnp.float32), np.float64)
                for x in jax.tree_util.tree_leaves(out)]
      if not all(np.isfinite(x).all() for x in leaves):
        raise FloatingPointError("a non-finite output")
      row = {"compile_s": compile_s}
      if want is not None:
        got = np.asarray(jnp.asarray(_as_output(name, out, S, H), jnp.float32), np.float64)
        row.update(rel_l2=float(np.linalg.norm(got - want) / np.linalg.norm(want)),
                   max_abs_error=float(np.abs(got - want).max()))
      rows[name] = row
      live[name] = fn
    except Exception as e:  # noqa: BLE001 -- recorded; the other rows still run
      rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
      progress(f"  {name}: {rows[name]['error']}")
  reps = _reps(S)
  samples: Dict[str, List[float]] = {n: [] for n in live}
  for _ in range(rounds):
    for name, fn in live.items():
      xs = args[name]
      t0 = time.perf_counter()
      for _ in range(reps):
        out = fn(*xs)
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - t0) / reps)
  flops = causal_flops(S, N, H, train)
  for name, ts in samples.items():
    med = statistics.median(ts)
    rows[name].update(median_ms=1e3 * med, tflops=flops / med / 1e12)
  splash_ms = [r["median_ms"] for n, r in rows.items() if _raw_splash(n)
               and "median_ms" in r]
  same_ms = [r["median_ms"] for n, r in rows.items() if _raw_splash(n)
             and not _native(n) and "median_ms" in r]
  base = min(splash_ms) if splash_ms else None
  same = min(same_ms) if same_ms else None
  for r in rows.values():
    if base and "median_ms" in r:
      r["vs_splash"] = r["median_ms"] / base
    if same and "median_ms" in r:
      r["vs_splash_same_inputs"] = r["median_ms"] / same
  return {"shape": shape, "S": S, "mode": "train" if train else "prefill",
          "N": N, "K": K, "H": H, "inputs": inputs, "rounds": rounds, "reps": reps,
          "rows": rows}


def run(out_dir: str, *, shapes: Sequence[str] = tuple(SHAPES),
        seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
        train_seq_lens: Sequence[int] = DEFAULT_TRAIN_SEQ_LENS,
        kernel_names: Sequence[str] = KERNELS, flag_rows: Sequence[str] = tuple(FLAG_ROWS),
        blocks: Sequence[Tuple[int, int]] = DEFAULT_BLOCKS,
        splash_blocks: Optional[Sequence[Tuple[int, int]]] = None, rounds: int = 5,
        inputs: str = "projection", progress=print) -> dict:
  from attnprec.bench.model import matmul_peak
  if inputs not in INPUT_FORMS:
    raise UserError(f"tpu_attention inputs={inputs!r} is not one of {INPUT_FORMS}: "
                    f"'projection' gives q, k, v as [1, S, heads * H], 'heads' as "
                    f"[1, S, heads, H].")
  settings = {"kernels": list(kernel_names), "flag_rows": list(flag_rows),
              "blocks": [list(b) for b in blocks], "rounds": rounds, "inputs": inputs}
  if splash_blocks:
    settings["splash_blocks"] = [list(b) for b in splash_blocks]
  result = previous(os.path.join(out_dir, "tpu_attention.json"), settings)
  result["backend"] = jax.default_backend()
  result["device"] = str(jax.devices()[0].device_kind)
  result["peak_bf16_tflops"] = matmul_peak(PEAK_SHAPE)["bf16"] / 1e12
  todo = [(f"{sh} {'train' if train else 'prefill'} S={S}", (sh, S, train))
          for train, lens in ((False, seq_lens), (True, train_seq_lens))
          for sh in shapes for S in lens]
  for key, (sh, S, train) in pending(todo, result, progress):
    case = run_case(sh, S, train, kernel_names=kernel_names, flag_rows=flag_rows,
                    blocks=blocks, rounds=rounds, splash_blocks=splash_blocks,
                    inputs=inputs, progress=progress)
    case["peak_bf16_tflops"] = result["peak_bf16_tflops"]   # the peak of its own run
    for r in case["rows"].values():
      if "tflops" in r:
        r["of_peak"] = r["tflops"] / result["peak_bf16_tflops"]
    result["cases"][key] = case
    for name, r in case["rows"].items():
      progress(f"    {name:32s} " + (f"{r['median_ms']:9.3f} ms  {r['tflops']:6.1f} TF/s"
                                    f"  /splash {r.get('vs_splash', float('nan')):5.2f}"
                                    f" (same inputs "
                                    f"{r.get('vs_splash_same_inputs', float('nan')):5.2f})"
                                    f"  relL2 {r.get('rel_l2', float('nan')):.1e}"
                                    if "median_ms" in r else r.get("error", "")))
    runs.write_json(out_dir, "tpu_attention.json", result, provenance=True)
  runs.atomic_write(os.path.join(out_dir, "tpu_attention.md"), to_markdown(result))
  return result


def pending(todo, result: dict, progress):
  """The (key, case) pairs of `todo` a run still has to measure, each announced as
  '[i/n] key'; those `result` holds (a resumed run's) announced as already measured."""
  for i, (key, case) in enumerate(todo):
    if key in result["cases"]:
      progress(f"[{i + 1}/{len(todo)}] {key}: already measured")
      continue
    progress(f"[{i + 1}/{len(todo)}] {key}")
    yield key, case


def previous(path: str, settings: dict) -> dict:
  """The results a rerun into the same --out resumes from (the cases it measured are
  not measured again), checked: a file that is not this suite's JSON, holds a figure that
  is not a finite number, was written by other code (`provenance.source`) or with other
  settings (kernels, flag rows, blocks, rounds: its cases would not have the rows asked
  for) is a UserError naming it, never resumed as if it were this run's."""
  fresh = {"settings": settings, "cases": {}}
  if not os.path.exists(path):
    return fresh
  try:
    with open(path, encoding="utf-8") as f:
      obj, why = readback.loads(f.read())
  except UnicodeDecodeError as e:
    obj, why = None, f"not UTF-8 text (line {readback.line_of(e)})"
  if why is None and not (isinstance(obj, dict) and isinstance(obj.get("cases"), dict)):
    why = "not an object with 'cases'"
  if why is None:
    bad = _non_finite(obj["cases"], "cases")
    source = (obj.get("provenance") or {}).get("source")
    if bad:
      why = f"{bad} is not a finite number"
    elif source != runs.code_identity()["source"]:
      why = (f"written by other code (source {source!r}, this code "
             f"{runs.code_identity()['source']!r})")
    elif obj.get("settings") != settings:
      why = f"measured with other settings ({obj.get('settings')!r}, asked: {settings!r})"
  if why:
    raise UserError(f"{path} cannot be resumed: {why}. A rerun into the same --out measures "
                    f"only the cases that file lacks, so they must be this code's and these "
                    f"settings'. Choose another --out, or move the file away.")
  return obj


def _non_finite(x, where: str):
  """The path of the first number in x that is not finite (or a bool where a number
  is), else None."""
  if isinstance(x, dict):
    for k, v in x.items():
      bad = _non_finite(v, f"{where}[{k!r}]")
      if bad:
        return bad
  elif isinstance(x, list):
    for i, v in enumerate(x):
      bad = _non_finite(v, f"{where}[{i}]")
      if bad:
        return bad
  elif isinstance(x, float) and not math.isfinite(x):
    return where
  return None


def to_markdown(result: dict) -> str:
  lines = [f"TPU attention ({result.get('device')}; bf16 matmul peak measured "
           f"{result.get('peak_bf16_tflops', float('nan')):.0f} TFLOP/s)", ""]
  for key, case in result["cases"].items():
    lines += [f"### {key} (N={case['N']}, K={case['K']}, H={case['H']}; inputs "
              f"{case.get('inputs', 'heads')})", "",
              "| row | median (ms) | TFLOP/s | of peak | / splash | / splash, same inputs "
              "| rel L2 vs float64 |", "|---|---|---|---|---|---|---|"]
    for name, r in case["rows"].items():
      if "median_ms" not in r:
        lines.append(f"| {name} | {r.get('error', '')} | | | | | |")
        continue
      err = f"{r['rel_l2']:.1e}" if "rel_l2" in r else ""
      same = (f"{r['vs_splash_same_inputs']:.2f}" if "vs_splash_same_inputs" in r else "")
      lines.append(f"| {name} | {r['median_ms']:.3f} | {r['tflops']:.1f} | "
                   f"{r.get('of_peak', float('nan')):.2f} | {r.get('vs_splash', float('nan')):.2f} | {same} | {err} |")
    lines.append("")
  return "\n".join(lines) + "\n"


def flags_table(result: dict) -> str:
  """Markdown: per case, every row's median, its ratio to splash (and to splash fed the
  same inputs, where the run has 'native' rows), the flags' cost within
  its kernel (the row's time over the same kernel's bf16 row) and its error: the table
  docs/performance.md quotes (a test holds it to results/tpu-flash/flags.json)."""
  same_col = any("vs_splash_same_inputs" in r for case in result["cases"].values()
                 for r in case["rows"].values())
  lines = ["| case | row | median (ms) | / splash | "
           + ("/ splash, same inputs | " if same_col else "")
           + "/ same kernel, flags off | TFLOP/s | rel. L2 vs float64 |",
           "|---|---|---:|---:|" + ("---:|" if same_col else "") + "---:|---:|---:|"]
  for key, case in result["cases"].items():
    rows = case["rows"]
    for name, r in rows.items():
      if "median_ms" not in r:
        continue
      kernel, _, rest = name.partition(" ")
      flag, _, blocks = rest.partition(" ")
      off = rows.get(" ".join(x for x in (kernel, "bf16", blocks) if x), {})
      cost = (f"{r['median_ms'] / off['median_ms']:.2f}x"
              if kernel != SPLASH and "median_ms" in off else "")
      err = f"{r['rel_l2']:.1e}" if "rel_l2" in r else ""
      vs = f"{r['vs_splash']:.2f}x" if "vs_splash" in r else "no splash row"
      same = (f"{r['vs_splash_same_inputs']:.2f}x | " if "vs_splash_same_inputs" in r
              else " | ") if same_col else ""
      lines.append(f"| {key} | {name} | {r['median_ms']:.2f} | {vs} | {same}"
                   f"{cost} | {r['tflops']:.0f} | {err} |")
  return "\n".join(lines) + "\n"

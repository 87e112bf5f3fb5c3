"""`--suite=tpu_decode`: one decode step's attention alone on an accelerator (a TPU),
each kernel beside the measured HBM bandwidth, in interleaved rounds.

Cases: batch B x cache length S at an attention shape of `tpu_attention.SHAPES`
(default Qwen2.5-0.5B's: 14 query heads over 2 kv heads, head dim 64), one new query per
sequence at position S - 1 (every key visible: the step reads the whole cache). The
cache lies as the model keeps it ([B, K, S, H], `attnprec.cache`) and enters each kernel
as its [B, S, K, H] view, as in a decode step. Rows (both flags unless named):
  dot_product, blockwise                   the XLA kernels
  flash dk=<n>                             the flash kernel's decode geometry, key blocks
                                           of n (`flash.Blocks.decode_k`)
  flash bf16 dk=<n>                        the same with the flags off (their cost)
  dot_product int8, flash int8 dk=<n>      an int8 cache with per-token key and value
                                           scales (codes and scales read by the kernel)
  flash stacked [int8] dk=<n>              the same given the whole stack of caches and
                                           the layer (`flash_attention(layer=)`): the
                                           layer's cache read in place, not sliced out
Method: every row jitted, run once and checked against float64 (NumPy: the bf16 values,
or the int8 codes times their scales); then timed as a decode loop runs it: one jitted
`fori_loop` of `STEPS` steps, each writing a new key and value row into the carried
cache (in place, as the model's decode loop does) and attending over it, so nothing
is hoisted out of the loop (a layout change the kernel needs included) and a call's
dispatch is spread over the steps; `rounds` rounds, each row once per round in order;
medians of the loop's time / STEPS. Bytes: the keys and values (and scales) one step
must read, B x K x S x (2 H x itemsize [+ 8]). The loop runs over a stack of L
caches (L layers, at least 1 GiB in all: `layers_for`), step i attending over layer
i mod L, so no step finds its cache in on-chip memory (a TPU's compiler keeps a small
loop-carried array in VMEM across iterations: a single 34 MB cache read at "1057 GB/s"),
as in a model whose layers' caches together far exceed it; 'of HBM' divides the row's bytes/s by
the read bandwidth measured in the same run (the largest of three probes over 1 GiB:
a bf16 reduction along rows, along columns, and a float32 matrix-vector product;
`hbm_read_bandwidth`). Results:
<out>/tpu_decode.json (rewritten after every case; a rerun into the same --out measures
only the cases it lacks, as `tpu_attention.previous` checks), tpu_decode.md.
"""
import os
import statistics
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import contract, kernels, kvquant, memory, runs
from attnprec.errors import UserError
from attnprec.bench import tpu_attention
from attnprec.kernels import flash
from attnprec.presets import variant

DEFAULT_SHAPES = ("qwen2.5-0.5b",)
DEFAULT_BATCHES = (1, 8)
DEFAULT_SEQ_LENS = (8192, 32768)
DEFAULT_DECODE_BLOCKS = (1024, 2048, 4096, 8192)
INT8 = contract.CacheStorage("int8", "int8", "token", "token")
GIB = 2 ** 30


STEPS = 64


def hbm_read_bandwidth(reps: int = 5) -> Dict[str, float]:
  """Bytes/s read by bf16 sums (float32 results) along the rows and along the columns
  of 1 GiB, and by a float32 matrix-vector product over 1 GiB, medians of `reps`;
  'best' the largest (each probe reads every byte once and writes next to nothing)."""
  from attnprec.bench.model import read_bandwidth
  x = jnp.ones((GIB // 2 // 4096, 4096), jnp.bfloat16)
  out = {}
  for name, axis in (("bf16_sum_rows", 0), ("bf16_sum_columns", 1)):
    f = jax.jit(lambda a, axis=axis: jnp.sum(a, axis=axis, dtype=jnp.float32))
    jax.block_until_ready(f(x))
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(f(x))
      times.append(time.perf_counter() - t0)
    out[name] = x.nbytes / statistics.median(times)
  del x
  out["f32_matvec"] = read_bandwidth(1024, reps)
  out["best"] = max(out.values())
  return out


def layers_for(cache_bytes: int) -> int:
  """Caches in the loop's stack: at least 1 GiB in all, at least 2."""
  return max(2, -(-GIB // cache_bytes))


def decode_loop(f, stacked: bool = False):
  """A jitted loop of decode steps over f(q, k, v, k_scale, v_scale, pos) and a stack of
  L caches [L, B, K, S, H] (scales [L, B, K, S]): step i writes a new key / value row
  (from its q) at the last position of layer i mod L's cache, in the carried stack, and
  attends over that cache (the layer sliced out of the stack; with `stacked`, f is given
  the whole stack and the layer); returns the sum of the outputs (every step's used)."""
  def run(qs_RxBx1xNxH, k_L, v_L, ks_L, vs_L, pos):
    L, K, S = k_L.shape[0], k_L.shape[2], k_L.shape[3]
    take = lambda x, l: jax.lax.dynamic_index_in_dim(x, l, 0, keepdims=False)  # noqa: E731

    def step(i, carry):
      k_L, v_L, acc = carry
      q, layer = qs_RxBx1xNxH[i], i % L
      row_1xBxKx1xH = jnp.swapaxes(q[:, :, :K], 1, 2)[None]
      at = (layer, 0, 0, S - 1, 0)
      k_L = jax.lax.dynamic_update_slice(k_L, row_1xBxKx1xH.astype(k_L.dtype), at)
      v_L = jax.lax.dynamic_update_slice(v_L, row_1xBxKx1xH.astype(v_L.dtype), at)
      out = (f(q, k_L, v_L, ks_L, vs_L, pos, layer) if stacked else
             f(q, take(k_L, layer), take(v_L, layer), take(ks_L, layer), take(vs_L, layer),
               pos))
      return k_L, v_L, acc + out.astype(jnp.float32)

    return jax.lax.fori_loop(0, qs_RxBx1xNxH.shape[0], step,
                             (k_L, v_L, jnp.zeros(qs_RxBx1xNxH.shape[1:], jnp.float32)))[2]
  return jax.jit(run)


def case_bytes(shape: str, B: int, S: int) -> int:
  """The device memory a case holds at once: its bf16 stack of caches and its int8 one
  (codes and per-token scales), each at least 1 GiB (`layers_for`)."""
  _, K, H = tpu_attention.SHAPES[shape]
  bf16 = B * K * S * 2 * H * 2
  L = layers_for(bf16)
  return L * (bf16 + B * K * S * (2 * H + 2 * 4))


def device_bytes() -> Optional[int]:
  """The memory of the device the suite runs on (its allocator's limit), else the
  machine's (XLA:CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("bytes_limit") or memory.physical_bytes()


def check_fits(shapes: Sequence[str], batches: Sequence[int],
               seq_lens: Sequence[int]) -> None:
  """A UserError naming the largest case and its estimate (`case_bytes`) when it would
  need more than `memory.SHARE` of the device's memory: refused before anything runs."""
  total = device_bytes()
  need, sh, B, S = max((case_bytes(sh, B, S), sh, B, S)
                       for sh in shapes for B in batches for S in seq_lens)
  if total is not None and need > memory.SHARE * total:
    raise UserError(
        f"The tpu_decode case {sh} B={B} S={S} needs about {need / 2 ** 30:.1f} GiB of "
        f"device memory (its stacks of bf16 and int8 caches, each at least 1 GiB), more "
        f"than {memory.SHARE:.0%} of the device's {total / 2 ** 30:.1f} GiB. Lower "
        f"--decode_batches or --decode_seq_lens.")


def _stack(x, L: int, seed: int):
  """L caches like x: x itself, then random ones of its shape and dtype (on the device)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), L - 1)
  if jnp.issubdtype(x.dtype, jnp.integer):
    rest = jax.vmap(lambda kk: jax.random.randint(kk, x.shape, -127, 128).astype(x.dtype))(
        keys)
  else:
    rest = jax.vmap(lambda kk: (jax.random.uniform(kk, x.shape, jnp.float32) + 0.5
                                ).astype(x.dtype) if x.ndim == 3 else
                    jax.random.normal(kk, x.shape, x.dtype))(keys)
  return jnp.concatenate([x[None], rest])


def _inputs(shape: str, B: int, S: int, seed: int = 0):
  N, K, H = tpu_attention.SHAPES[shape]
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((B, K, S, H)), jnp.bfloat16) for _ in "kv")
  pos = jnp.full((B, 1), S - 1, jnp.int32)
  return q, k, v, pos


def _quantized(k_BxKxSxH, v_BxKxSxH):
  """int8 codes [B, K, S, H] and per-token scales [B, K, S] of k and v."""
  out = []
  for x in (k_BxKxSxH, v_BxKxSxH):
    codes, scale = kvquant.quantize_token(jnp.swapaxes(x, 1, 2), "int8")  # [B, S, K, *]
    out += [jnp.swapaxes(codes, 1, 2), jnp.swapaxes(scale, 1, 2)]
  return out


def rows_for(S: int, blocks: Sequence[int]) -> Dict[str, Tuple[Callable, bool, bool]]:
  """name -> (f(q, k, v, k_scale, v_scale, pos[, layer]) over the [B, K, S, H] cache, or
  with stacked over the [L, B, K, S, H] stack and its layer `layer`; int8; stacked)."""
  both = variant("fp32_attention")
  kpos = lambda B: jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))  # noqa: E731
  view = lambda x: jnp.swapaxes(x, -3, -2)   # noqa: E731 -- the model's [(L,) B, S, K, H]

  def xla(kernel, storage=contract.COMPUTE_CACHE):
    prec = variant("fp32_attention", kernel=kernel, **(dict(
        kv_cache_k_dtype="int8", kv_cache_v_dtype="int8", kv_cache_k_scale="token",
        kv_cache_v_scale="token") if storage.quantized else {}))

    def f(q, k, v, ks, vs, pos):
      scales = contract.KVScales(k_token_BxKxS=ks, v_token_BxKxS=vs) \
          if storage.quantized else None
      return kernels.attend(prec, q, view(k), view(v),
                            mask=contract.CausalMask(pos, kpos(q.shape[0])),
                            kv_scales=scales)
    return f

  def fl(decode_k, flags=both.attention, storage=contract.COMPUTE_CACHE):
    bl = flash.Blocks(decode_k=decode_k, chunk=min(flash.DEFAULT_BLOCKS.chunk, decode_k))

    def f(q, k, v, ks, vs, pos, layer=None):
      scales = contract.KVScales(k_token_BxKxS=ks, v_token_BxKxS=vs) \
          if storage.quantized else None
      return flash.flash_attention(q, view(k), view(v), causal=True, q_positions_BxT=pos,
                                   k_positions_BxS=kpos(q.shape[0]), flags=flags,
                                   kv_cache=storage, kv_scales=scales, blocks=bl,
                                   layer=layer)
    return f

  rows = {"dot_product": (xla("dot_product"), False, False),
          "blockwise": (xla("blockwise"), False, False)}
  for n in blocks:
    rows[f"flash dk={n}"] = (fl(n), False, False)
  mid, last = blocks[len(blocks) // 2], blocks[-1]
  rows[f"flash bf16 dk={mid}"] = (fl(mid, variant("bf16").attention), False, False)
  rows[f"flash stacked dk={last}"] = (fl(last), False, True)
  rows["dot_product int8"] = (xla("dot_product", INT8), True, False)
  for n in blocks[len(blocks) // 2:]:
    rows[f"flash int8 dk={n}"] = (fl(n, storage=INT8), True, False)
  rows[f"flash stacked int8 dk={last}"] = (fl(last, storage=INT8), True, True)
  return rows


def _reference(q, k, v, scale_k=None, scale_v=None):
  """float64 attention of one query per sequence over the whole cache [B, K, S, H]
  (values times their per-token scales where given)."""
  f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # noqa: E731
  k64, v64 = f64(k), f64(v)
  if scale_k is not None:
    k64, v64 = k64 * f64(scale_k)[..., None], v64 * f64(scale_v)[..., None]
  B, K, S, H = k64.shape
  N = q.shape[2]
  q64 = f64(q)[:, 0].reshape(B, K, N // K, H)
  logits = np.einsum("bkgh,bksh->bkgs", q64, k64) * H ** -0.5
  p = np.exp(logits - logits.max(-1, keepdims=True))
  out = np.einsum("bkgs,bksh->bkgh", p / p.sum(-1, keepdims=True), v64)
  return out.reshape(B, 1, N, H)


def run_case(shape: str, B: int, S: int, *, blocks, rounds: int, bandwidth: float,
             progress=print) -> dict:
  N, K, H = tpu_attention.SHAPES[shape]
  q, k, v, pos = _inputs(shape, B, S)
  kc, ks, vc, vs = _quantized(k, v)
  want = {False: _reference(q, k, v), True: _reference(q, kc, vc, ks, vs)}
  fns = rows_for(S, blocks)
  qs = jnp.asarray(np.random.default_rng(1).standard_normal((STEPS,) + q.shape),
                   jnp.bfloat16)
  L = layers_for(k.nbytes + v.nbytes)
  stacks = {False: tuple(_stack(x, L, i) for i, x in enumerate((k, v, ks, vs))),
            True: tuple(_stack(x, L, 4 + i) for i, x in enumerate((kc, vc, ks, vs)))}
  rows, live = {}, {}
  for name, (fn, q8, stacked) in fns.items():
    args = (q, kc, vc, ks, vs, pos) if q8 else (q, k, v, ks, vs, pos)
    if stacked:      # checked as a stack of one, layer 0
      args = (q,) + tuple(x[None] for x in args[1:5]) + (pos, 0)
    try:
      t0 = time.perf_counter()
      out = np.asarray(jnp.asarray(jax.block_until_ready(jax.jit(fn)(*args)),
                                   jnp.float32), np.float64)
      loop, loop_args = decode_loop(fn, stacked), (qs,) + stacks[q8] + (pos,)
      if not np.isfinite(np.asarray(loop(*loop_args))).all():   # what is timed is checked
        raise FloatingPointError("a non-finite output in the timed decode loop")
      row = {"compile_s": time.perf_counter() - t0,
             "bytes": B * K * S * (2 * H * (1 if q8 else 2) + (8 if q8 else 0))}
      if not np.isfinite(out).all():
        raise FloatingPointError("a non-finite output")
      ref = want[q8]
      row["rel_l2"] = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
      rows[name], live[name] = row, (loop, loop_args)
    except Exception as e:  # noqa: BLE001 -- recorded; the other rows still run
      rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
      progress(f"  {name}: {rows[name]['error']}")
  samples = {n: [] for n in live}
  for _ in range(rounds):
    for name, (loop, args) in live.items():
      t0 = time.perf_counter()
      jax.block_until_ready(loop(*args))
      samples[name].append((time.perf_counter() - t0) / STEPS)
  for name, ts in samples.items():
    med = statistics.median(ts)
    r = rows[name]
    r.update(median_us=1e6 * med, gbps=r["bytes"] / med / 1e9,
             of_hbm=r["bytes"] / med / bandwidth)
  return {"shape": shape, "B": B, "S": S, "N": N, "K": K, "H": H, "rounds": rounds,
          "steps": STEPS, "layers": L, "rows": rows}


def run(out_dir: str, *, shapes: Sequence[str] = DEFAULT_SHAPES,
        batches: Sequence[int] = DEFAULT_BATCHES, seq_lens: Sequence[int] = DEFAULT_SEQ_LENS,
        blocks: Sequence[int] = DEFAULT_DECODE_BLOCKS, rounds: int = 5,
        progress=print) -> dict:
  check_fits(shapes, batches, seq_lens)
  settings = {"blocks": list(blocks), "rounds": rounds}
  result = tpu_attention.previous(os.path.join(out_dir, "tpu_decode.json"), settings)
  result["backend"] = jax.default_backend()
  result["device"] = str(jax.devices()[0].device_kind)
  bw = hbm_read_bandwidth()
  result["read_gbps"] = {k: v / 1e9 for k, v in bw.items()}
  todo = [(f"{sh} decode B={B} S={S}", (sh, B, S))
          for sh in shapes for S in seq_lens for B in batches]
  for key, (sh, B, S) in tpu_attention.pending(todo, result, progress):
    case = run_case(sh, B, S, blocks=blocks, rounds=rounds, bandwidth=bw["best"],
                    progress=progress)
    case["read_gbps"] = bw["best"] / 1e9      # the bandwidth of its own run
    result["cases"][key] = case
    for name, r in case["rows"].items():
      progress(f"    {name:22s} " + (f"{r['median_us']:9.1f} us  {r['gbps']:6.0f} GB/s  "
                                    f"of HBM {r['of_hbm']:.2f}  relL2 {r['rel_l2']:.1e}"
                                    if "median_us" in r else r.get("error", "")))
    runs.write_json(out_dir, "tpu_decode.json", result, provenance=True)
  runs.atomic_write(os.path.join(out_dir, "tpu_decode.md"), to_markdown(result))
  return result


def int8_ratio(rows: dict, name: str) -> Optional[float]:
  """An int8 row's time over its kernel's bf16-cache row ('flash int8 dk=n' over
  'flash dk=n'), None where either is missing."""
  base = rows.get(name.replace(" int8", ""), {}) if " int8" in name else {}
  if "median_us" in base and "median_us" in rows.get(name, {}):
    return rows[name]["median_us"] / base["median_us"]
  return None


def to_markdown(result: dict) -> str:
  bw = result.get("read_gbps", {})
  lines = [f"TPU decode attention ({result.get('device')}; HBM read bandwidth measured "
           f"{bw.get('best', float('nan')):.0f} GB/s, the largest of: bf16 sum along "
           f"rows {bw.get('bf16_sum_rows', float('nan')):.0f}, along columns "
           f"{bw.get('bf16_sum_columns', float('nan')):.0f}, f32 matvec "
           f"{bw.get('f32_matvec', float('nan')):.0f}; each row timed as a loop of "
           f"{STEPS} decode steps writing the cache, over a stack of caches of 1 GiB or "
           f"more)", "",
           "| case | row | median (us) | GB/s | of HBM | int8 / same kernel's bf16 cache | "
           "rel L2 vs float64 |", "|---|---|---:|---:|---:|---:|---:|"]
  for key, case in result["cases"].items():
    for name, r in case["rows"].items():
      if "median_us" not in r:
        lines.append(f"| {key} | {name} | {r.get('error', '')} | | | | |")
        continue
      x = int8_ratio(case["rows"], name)
      ratio = "" if x is None else f"{x:.2f}x"
      lines.append(f"| {key} | {name} | {r['median_us']:.1f} | {r['gbps']:.0f} | "
                   f"{r['of_hbm']:.2f} | {ratio} | {r['rel_l2']:.1e} |")
  return "\n".join(lines) + "\n"

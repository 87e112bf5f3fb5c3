"""Attention forward benchmark: every kernel x precision preset, plus torch SDPA.

Shapes: B batch, N heads (K = N kv heads unless `kv_heads`), H head dim, T = S (causal
prefill over S tokens).

Method
  * Each configuration is one jitted `attend(Precision(...), q, k, v, mask=CausalMask)`,
    i.e. exactly the call the model makes. Compiled first, then one untimed warm-up call.
  * Repetitions are round-robin: every round times each configuration once, so machine
    drift hits all of them alike. Medians over the rounds.
  * Useful FLOPs = 4 * B * N * T * S * H / 2: causal attention has T * S / 2 visible
    (query, key) pairs and every kernel is credited with those only, whether it skips the
    hidden half (blockwise) or computes and discards it (dot_product, jax_nn, torch).
    So GFLOP/s ratios between kernels are exactly inverse time ratios.
  * `matmul_gflops`: a plain fp32 2048^3 matmul measured in the same run (the ceiling);
    `frac_of_matmul` = the configuration's GFLOP/s over it. Measured again at the end
    (`matmul_gflops_end`): a large difference means the machine was not quiet.
  * `vs_dot_product_bf16` = time / time of dot_product with the 'bf16' preset at the same
    S (< 1 is faster); `safe_vs_bf16` = a kernel's 'fp32_attention' time over its own
    'bf16' time (the price of the safe flags).
  * Memory: `memory_analysis()` of the compiled prefill (nothing is run), temp bytes plus
    arguments and outputs, up to S=32768; a configuration whose footprint exceeds the
    machine's available memory is reported `fits: False` and is never executed.
  * Decode: one query (T = 1) at position S - 1 and S / 4 over a cache of S keys, per
    kernel and preset (blockwise reads only the blocks up to the position).
  * Peer: `torch.nn.functional.scaled_dot_product_attention(is_causal=True)` on the same
    shapes (torch imported lazily; 'bf16' = bf16 tensors, 'fp32' = fp32 tensors; its CPU
    kernel keeps float32 softmax statistics in both).
"""
import os
import statistics
import time
from typing import Dict, Iterable, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import kernels as kernel_lib
from attnprec import memory
from attnprec import plotting, presets
from attnprec.contract import CausalMask
from attnprec.errors import UserError
from attnprec.precision import Precision

# The attention flags' settings, as the gin presets (gin/precision/) bind them.
PRESETS: Dict[str, dict] = {
    name: presets.bindings(presets.preset_path(name))
    for name in ("bf16", "fp32_qk", "fp32_logits", "fp32_attention", "fp32")}
# Every registered kernel but the Pallas ones by default: on CPU Pallas runs in its
# interpreter (a correctness path, not a speed one); `--kernels=pallas` still benches it.
KERNELS = tuple(k for k in kernel_lib.NAMES if k not in ("pallas", "flash", "splash"))
TORCH_PRESETS = ("bf16", "fp32")
DEFAULT_SEQ_LENS = (1024, 4096, 16384)
DEFAULT_MEMORY_SEQ_LENS = (4096, 16384, 32768)
DEFAULT_MEMORY_PRESETS = ("fp32_attention", "fp32")
DEFAULT_DECODE_SEQ_LENS = (16384,)
DEFAULT_DECODE_PRESETS = ("bf16", "fp32_attention", "fp32")


def useful_flops(B, N, T, S, H, *, causal=True) -> float:
  """4*B*N*T*S*H (qk and wv dots), halved for causal (see module docstring)."""
  return 4.0 * B * N * T * S * H / (2.0 if causal else 1.0)


def supported(kernel: str, preset: str) -> Optional[str]:
  """None if `kernel` honours `preset`, else why not (the kernel's refusal message, which
  `Precision` raises when it is constructed)."""
  try:
    Precision(kernel=kernel, **PRESETS[preset])
  except UserError as e:
    return str(e)
  return None


def available_memory_bytes() -> int:
  """MemAvailable from /proc/meminfo (Linux), else a large number."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 1 << 62


def _inputs(B, S, N, K, H, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, S, N, H), np.float32)
  k = rng.standard_normal((B, S, K, H), np.float32)
  v = rng.standard_normal((B, S, K, H), np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _attention_fn(kernel: str, preset: str):
  prec = Precision(kernel=kernel, **PRESETS[preset])

  def fn(q, k, v):
    B, S = q.shape[0], q.shape[1]
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    # the keys are the queries' own tokens from position 0 (what 'splash' needs to know)
    return kernel_lib.attend(prec, q, k, v, mask=CausalMask(pos, pos, own_positions=True))

  return jax.jit(fn)


_COMPILED: Dict[tuple, object] = {}


def _decode_fn(kernel: str, preset: str):
  """One decode step: a single query at position `q_pos_Bx1` over a cache of S keys."""
  prec = Precision(kernel=kernel, **PRESETS[preset])

  def fn(q_Bx1xNxH, k, v, q_pos_Bx1):
    B, S = k.shape[0], k.shape[1]
    k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    return kernel_lib.attend(prec, q_Bx1xNxH, k, v, mask=CausalMask(q_pos_Bx1, k_pos))

  return jax.jit(fn)


def _compile(kernel, preset, B, S, N, K, H):
  """Compiled prefill of one configuration (cached: timing and memory share it)."""
  key = (kernel, preset, B, S, N, K, H)
  if key not in _COMPILED:
    _COMPILED[key] = _compile_uncached(kernel, preset, B, S, N, K, H)
  return _COMPILED[key]


def _compiled_or_reason(kernel, preset, B, S, N, K, H):
  """(compiled prefill, None), or (None, the first clause of the kernel's refusal) where
  it refuses this shape at trace (say, splash's query scale)."""
  try:
    return _compile(kernel, preset, B, S, N, K, H), None
  except UserError as e:
    return None, str(e).split(":")[0]


def _compile_uncached(kernel, preset, B, S, N, K, H):
  dtype = jnp.dtype(PRESETS[preset]["dtype"])
  shapes = [jax.ShapeDtypeStruct((B, S, n, H), dtype) for n in (N, K, K)]
  return _attention_fn(kernel, preset).lower(*shapes).compile()


def footprint_bytes(compiled) -> Dict[str, int]:
  m = compiled.memory_analysis()
  out = dict(temp=int(m.temp_size_in_bytes), arguments=int(m.argument_size_in_bytes),
             output=int(m.output_size_in_bytes))
  out["total"] = out["temp"] + out["arguments"] + out["output"]
  return out


def matmul_gflops(n: int = 2048, reps: int = 5) -> float:
  """GFLOP/s of a plain fp32 n^3 matmul (median of `reps`)."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(a, a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2.0 * n ** 3 / statistics.median(times) / 1e9


def _torch_fn(preset, B, S, N, K, H):
  import torch  # lazy: bench-only dependency
  torch.manual_seed(0)
  dtype = torch.bfloat16 if preset == "bf16" else torch.float32
  q = torch.randn(B, N, S, H, dtype=dtype)
  k = torch.randn(B, K, S, H, dtype=dtype)
  v = torch.randn(B, K, S, H, dtype=dtype)
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def fn():
    with torch.no_grad():
      return sdpa(q, k, v, is_causal=True, enable_gqa=K != N)

  return fn


def _check_lengths_fit(B, N, K, H, **lengths) -> None:
  """Before anything is compiled: every length's float32 q, k and v (the least any row
  of it holds; the kernels' own footprints are measured per row and reported as
  `does_not_fit`) must fit the machine (`memory.check_fits`), else a UserError naming
  the option and its estimate (a length past what XLA can shape aborted the process)."""
  for option, values in lengths.items():
    for S in values:
      memory.check_fits(f"--{option}={S} (B={B}, {N} query / {K} kv heads of {H})",
                        4 * B * S * (N + 2 * K) * H, holding="its q, k and v in float32, "
                        "before any kernel's own memory")


def run_attention_bench(*, seq_lens: Sequence[int] = DEFAULT_SEQ_LENS, batch: int = 1,
                        heads: int = 8, kv_heads: Optional[int] = None, head_dim: int = 64,
                        kernels: Iterable[str] = KERNELS,
                        presets: Iterable[str] = tuple(PRESETS),
                        reps: Optional[Dict[int, int]] = None,
                        include_torch: bool = True,
                        memory_seq_lens: Sequence[int] = DEFAULT_MEMORY_SEQ_LENS,
                        memory_presets: Sequence[str] = DEFAULT_MEMORY_PRESETS,
                        decode_seq_lens: Sequence[int] = DEFAULT_DECODE_SEQ_LENS,
                        decode_presets: Sequence[str] = DEFAULT_DECODE_PRESETS,
                        decode_reps: int = 10,
                        memory_fraction: float = 0.6, matmul_size: int = 2048,
                        progress: bool = True) -> dict:
  """Times attention forward; returns plain dicts (see module docstring for fields).

  reps: timed rounds per S; default 7 below 4096, 5 at 4096, 3 above (S=16384 costs
    seconds per call and the whole default run must stay under ~10 minutes on 2 cores).
  memory_fraction: a configuration runs only if its compiled footprint is below this
    fraction of the available memory (0.6: leave room for whatever else runs; dense
    kernels need 24 GiB at S=16384 and are reported `does_not_fit` on a 23 GiB machine).
  """
  from tqdm.auto import tqdm
  kernels, presets = list(kernels), list(presets)
  memory_presets, decode_presets = list(memory_presets), list(decode_presets)
  for name in presets + memory_presets + decode_presets:
    if name not in PRESETS:
      raise UserError(f"Unknown preset {name!r}; valid: {list(PRESETS)}.")
  for name in kernels:
    kernel_lib.get(name)                  # an unknown kernel is a UserError naming the valid
  B, N, H = batch, heads, head_dim
  K = kv_heads or heads
  _check_lengths_fit(B, N, K, H, seq_lens=seq_lens, memory_seq_lens=memory_seq_lens,
                     decode_seq_lens=decode_seq_lens)
  t_start = time.perf_counter()
  result = dict(config=dict(batch=B, heads=N, kv_heads=K, head_dim=H, causal=True,
                            seq_lens=list(seq_lens), presets={p: PRESETS[p] for p in presets},
                            memory_presets=memory_presets, decode_presets=decode_presets,
                            matmul_size=matmul_size,
                            flop_convention="4*B*N*T*S*H/2 (causal: visible pairs only)",
                            xla_flags=os.environ.get("XLA_FLAGS", ""),
                            jax=jax.__version__, devices=str(jax.devices()),
                            cpu_count=os.cpu_count()),
                rows=[], memory=[])
  result["matmul_gflops"] = matmul_gflops(matmul_size)
  torch_version = None
  if include_torch:
    try:
      import torch
      torch_version = torch.__version__
      result["config"]["torch"] = torch_version
      result["config"]["torch_threads"] = torch.get_num_threads()
    except ImportError:
      result["config"]["torch"] = "not installed"
  avail = available_memory_bytes()

  for S in seq_lens:
    n_reps = (reps or {}).get(S, 7 if S < 4096 else 5 if S == 4096 else 3)
    configs: List[dict] = []
    labels = [(k, p) for k in kernels for p in presets]
    bar = tqdm(labels, desc=f"compile S={S}", disable=not progress, leave=False)
    for kernel, preset in bar:
      row = dict(kernel=kernel, preset=preset, S=S, T=S)
      why = supported(kernel, preset)
      if why:
        row.update(status="unsupported", reason=why.split(";")[0])
        result["rows"].append(row)
        continue
      compiled, refused = _compiled_or_reason(kernel, preset, B, S, N, K, H)
      if refused:
        row.update(status="unsupported", reason=refused)
        result["rows"].append(row)
        continue
      fp = footprint_bytes(compiled)
      row["footprint_bytes"] = fp["total"]
      if fp["total"] > memory_fraction * avail:
        row.update(status="does_not_fit", reason=f"needs {fp['total'] / 2**30:.1f} GiB, "
                   f"{avail / 2**30:.1f} GiB available")
        result["rows"].append(row)
        continue
      dtype = jnp.dtype(PRESETS[preset]["dtype"])
      args = _inputs(B, S, N, K, H, dtype)
      call = (lambda c=compiled, a=args: c(*a).block_until_ready())
      configs.append(dict(row=row, call=call))
    if include_torch and torch_version:
      for preset in TORCH_PRESETS:
        if preset in presets:
          configs.append(dict(row=dict(kernel="torch_sdpa", preset=preset, S=S, T=S),
                              call=_torch_fn(preset, B, S, N, K, H)))
    for cfg in tqdm(configs, desc=f"warm-up S={S}", disable=not progress, leave=False):
      cfg["call"]()
      cfg["times"] = []
    for _ in tqdm(range(n_reps), desc=f"rounds S={S}", disable=not progress, leave=False):
      for cfg in configs:
        t0 = time.perf_counter()
        cfg["call"]()
        cfg["times"].append(time.perf_counter() - t0)
    for cfg in configs:
      row = cfg["row"]
      median = statistics.median(cfg["times"])
      gflops = useful_flops(B, N, S, S, H) / median / 1e9
      row.update(status="ok", reps=len(cfg["times"]), median_s=median,
                 times_s=cfg["times"], gflops=gflops,
                 frac_of_matmul=gflops / result["matmul_gflops"])
      result["rows"].append(row)
    _add_ratios(result["rows"], S)
  order = {k: i for i, k in enumerate(list(kernels) + ["torch_sdpa"])}
  porder = {p: i for i, p in enumerate(PRESETS)}
  result["rows"].sort(key=lambda r: (r["S"], order[r["kernel"]], porder[r["preset"]]))

  for S in memory_seq_lens:
    for kernel in kernels:
      for preset in memory_presets:
        entry = dict(kernel=kernel, preset=preset, S=S)
        compiled, refused = ((None, "unsupported") if supported(kernel, preset) else
                             _compiled_or_reason(kernel, preset, B, S, N, K, H))
        if refused:
          entry.update(status="unsupported")
        else:
          fp = footprint_bytes(compiled)
          entry.update(status="ok", **{f"{k}_bytes": v for k, v in fp.items()},
                       fits=fp["total"] <= memory_fraction * avail)
        result["memory"].append(entry)
  result["decode"] = _decode_rows(decode_seq_lens, decode_presets, kernels, B, N, K, H,
                                  decode_reps, progress)
  result["available_memory_bytes"] = avail
  result["matmul_gflops_end"] = matmul_gflops(matmul_size)  # drift check: compare with the start
  result["wall_s"] = time.perf_counter() - t_start
  return result


def _decode_rows(seq_lens, presets, kernels, B, N, K, H, reps, progress) -> List[dict]:
  """Decode-step medians at positions S - 1 (full cache) and S / 4, round-robin."""
  from tqdm.auto import tqdm
  configs, refused = [], []
  for S in seq_lens:
    for kernel in kernels:
      for preset in presets:
        if supported(kernel, preset):
          continue
        dtype = jnp.dtype(PRESETS[preset]["dtype"])
        q = _inputs(B, 1, N, K, H, dtype)[0]
        _, k, v = _inputs(B, S, N, K, H, dtype)
        fn = _decode_fn(kernel, preset)
        for pos in (S - 1, S // 4):
          q_pos = jnp.full((B, 1), pos, jnp.int32)
          call = (lambda f=fn, a=(q, k, v, q_pos): f(*a).block_until_ready())
          row = dict(kernel=kernel, preset=preset, S=S, position=pos)
          try:
            call()  # compile + warm-up
          except UserError as e:   # a kernel without a decode step (splash): said, not run
            refused.append(dict(row, status="refused", reason=str(e).split(":")[0]))
            break
          configs.append(dict(row=row, call=call, times=[]))
  for _ in tqdm(range(reps), desc="decode rounds", disable=not progress, leave=False):
    for cfg in configs:
      t0 = time.perf_counter()
      cfg["call"]()
      cfg["times"].append(time.perf_counter() - t0)
  rows = list(refused)
  for cfg in configs:
    rows.append(dict(cfg["row"], median_s=statistics.median(cfg["times"]), reps=reps))
  return rows


def _add_ratios(rows: List[dict], S: int) -> None:
  timed = {(r["kernel"], r["preset"]): r for r in rows
           if r["S"] == S and r.get("status") == "ok"}
  base = timed.get(("dot_product", "bf16"))
  for (kernel, preset), r in timed.items():
    if base is not None:
      r["vs_dot_product_bf16"] = r["median_s"] / base["median_s"]
    own_bf16 = timed.get((kernel, "bf16"))
    safe = timed.get((kernel, "fp32_attention"))
    if preset == "fp32_attention" and own_bf16 is not None:
      r["safe_vs_bf16"] = r["median_s"] / own_bf16["median_s"]
    if preset == "bf16" and safe is not None:
      r["safe_vs_bf16"] = safe["median_s"] / r["median_s"]


def to_markdown(result: dict) -> str:
  """The timing rows and the memory table as markdown."""
  lines = [f"B={result['config']['batch']} N={result['config']['heads']} "
           f"H={result['config']['head_dim']}, causal; fp32 {result['config']['matmul_size']}^3 "
           f"matmul: "
           f"{result['matmul_gflops']:.0f} GFLOP/s (end of run: "
           f"{result.get('matmul_gflops_end', float('nan')):.0f}); FLOPs: "
           f"{result['config']['flop_convention']}", "",
           "| S | kernel | preset | median ms | GFLOP/s | of matmul | vs dot_product bf16 "
           "| fp32_attention / bf16 |", "|---|---|---|---|---|---|---|---|"]
  for r in result["rows"]:
    if r.get("status") != "ok":
      lines.append(f"| {r['S']} | {r['kernel']} | {r['preset']} | {r['status']} "
                   f"| | | | |")
      continue
    vs = r.get("vs_dot_product_bf16")
    safe = r.get("safe_vs_bf16")
    lines.append(f"| {r['S']} | {r['kernel']} | {r['preset']} | {r['median_s'] * 1e3:.1f} "
                 f"| {r['gflops']:.1f} | {r['frac_of_matmul']:.1%} "
                 f"| {'' if vs is None else f'{vs:.2f}'} "
                 f"| {'' if safe is None else f'{safe:.2f}'} |")
  if result.get("decode"):
    lines += ["", "Decode step (T = 1) over a cache of S keys, query at `position`", "",
              "| S | position | kernel | preset | median ms |", "|---|---|---|---|---|"]
    for d in result["decode"]:
      lines.append(f"| {d['S']} | {d['position']} | {d['kernel']} | {d['preset']} "
                   + (f"| {d['median_s'] * 1e3:.2f} |" if "median_s" in d else
                      f"| refused: {d['reason']} |"))
  lines += ["", "Prefill footprint (compiled memory_analysis: temp + arguments + output)", "",
            "| S | kernel | preset | temp GiB | total GiB | fits |", "|---|---|---|---|---|---|"]
  for m in result["memory"]:
    if m["status"] != "ok":
      lines.append(f"| {m['S']} | {m['kernel']} | {m['preset']} | {m['status']} | | |")
      continue
    lines.append(f"| {m['S']} | {m['kernel']} | {m['preset']} "
                 f"| {m['temp_bytes'] / 2**30:.2f} | {m['total_bytes'] / 2**30:.2f} "
                 f"| {'yes' if m['fits'] else 'NO'} |")
  return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
  """Median time vs S per kernel: 'bf16' and 'fp32_attention' panels (torch: its fp32
  run in the second panel, as it has no bf16-with-f32-probabilities mode)."""
  plt = plotting.pyplot()
  kernels = list(dict.fromkeys(r["kernel"] for r in result["rows"]))
  colors = {k: f"C{i}" for i, k in enumerate(kernels)}
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, panel in zip(axes, ("bf16", "fp32_attention")):
    for kernel in kernels:
      preset = "fp32" if kernel == "torch_sdpa" and panel != "bf16" else panel
      pts = sorted((r["S"], r["median_s"]) for r in result["rows"]
                   if r["kernel"] == kernel and r["preset"] == preset
                   and r.get("status") == "ok")
      if pts:
        ax.plot(*zip(*pts), marker="o", color=colors[kernel],
                label=kernel + (f" ({preset})" if preset != panel else ""))
    ax.set(xscale="log", yscale="log", xlabel="S (causal prefill, T = S)",
           title=f"preset {panel}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  axes[0].set_ylabel("median seconds (lower is better)")
  plotting.save_figure(fig, path)

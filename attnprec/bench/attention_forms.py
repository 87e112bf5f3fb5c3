"""`--suite=attention_forms`: the blockwise kernel's block sizes side by side, at the
attention shapes of the shipped models, against torch SDPA bf16 in the same rounds.

Shapes: B = 1, causal prefill of S tokens (T = S), H = 64, N query heads over K kv heads
as the models have them (SmolLM2-135M 9 / 3, Qwen2.5-Coder-0.5B 14 / 2). Inputs bf16,
both attention flags on (`fp32_attention`: the float32 QK product and float32 softmax,
the contract's safe setting); the block sizes change no stage of the contract (only
which keys each online-softmax step sees), so every form here honours it, and each
form's output is checked against the default blocks' (max abs difference, reported).

Method: each form is one jitted `blockwise_attention` call, compiled first; rounds are
interleaved, every form and torch once per round, each timed call preceded by one
untimed call (the ordering bias measured in docs/performance.md); medians.
`vs_default` = time / the default blocks' time; `vs_torch` = time / torch SDPA bf16's
(`enable_gqa`, float32 softmax statistics in its CPU flash kernel); neither where that
baseline's output is not finite (a broken run's time is no baseline). torch's output is
checked and compared with the default blocks' like a form's.

The contract floor (one row per shape and length, not timed): the time the contract's two
dots alone would take at the matmul rates XLA:CPU reaches on this machine, measured in the
same run (`model.matmul_peak` at the shapes of FLOOR_SHAPES, the fastest of them, and the
faster of a measurement before and after the rounds; XLA:CPU's rate depends on the shape
by up to 2x): the QK dot's FLOPs over visible pairs at the rate of its operands (bf16 x
bf16 -> float32 with the float32 QK product), the PV dot's at the float32 rate (the
float32 probabilities into it, MaxText's semantics, and values cast to float32),
everything else free. No kernel that honours the contract with XLA:CPU's dots runs faster;
a peer below it runs something the contract does not (torch SDPA bf16's PV dot takes bf16
probabilities, at the bf16 rate).
"""
import os
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import contract, cpu_features
from attnprec.bench.model import matmul_peak
from attnprec.presets import variant
from attnprec.errors import UserError
from attnprec.kernels.blockwise import BlockSizes, blockwise_attention

SHAPES: Dict[str, Tuple[int, int]] = {"smollm2-135m": (9, 3), "qwen2.5-coder-0.5b": (14, 2)}
HEAD_DIM = 64
DEFAULT_SEQ_LENS = (4096,)
# (q_block, kv_block): the default first, then larger and smaller tiles
DEFAULT_BLOCKS = ((BlockSizes().q_block, BlockSizes().kv_block), (512, 512), (256, 256),
                  (256, 512), (1024, 512), (128, 1024), (1024, 1024))
FLAGS = contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
# what a bf16 model with both flags runs (the QK dot's form follows this CPU: float32
# casts where it has no bf16 dots, `Precision.float32_qk_operands`)
PRECISION = variant("fp32_attention", kernel="blockwise")
FLOOR = "contract floor"
# (m, k, n) dots the floor's rates are measured at: the projections' peak shape, a square
# one and a long one; the fastest rate of each dtype counts
FLOOR_SHAPES = ((1000, 576, 1536), (2048, 2048, 2048), (4096, 1024, 1024))
_RATE_KEYS = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.bfloat16): "bf16"}


def contract_floor_s(S: int, N: int, rates: Dict[str, float], *, H: int = HEAD_DIM,
                     flags: contract.AttentionFlags = FLAGS, compute=jnp.bfloat16) -> float:
  """Seconds the contract's QK and PV dots of a causal prefill of S tokens (N query heads,
  head dim H) take at `rates` ({"f32": FLOP/s, "bf16": FLOP/s of bf16 x bf16 -> f32}),
  each dot at the rate of its operand dtype in the contract table (a float32 QK product
  at the faster of its c and float32 rates); 2 H FLOPs per visible (query head, query,
  key) triple and dot."""
  stages = contract.stage_dtypes(compute, flags)
  flops = 2.0 * H * N * S * (S + 1) / 2
  qk_rate = rates[_RATE_KEYS[jnp.dtype(stages["qkv"])]]
  if stages["logits"] == jnp.float32:
    # a float32 QK product may also take its c operands cast to float32 (the float32
    # QK form, `Precision.float32_qk_operands`): the faster rate of the two bounds it
    qk_rate = max(qk_rate, rates["f32"])
  return flops / qk_rate + flops / rates[_RATE_KEYS[jnp.dtype(stages["probs"])]]


def _inputs(S: int, N: int, K: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal((1, S, n, HEAD_DIM)), jnp.bfloat16)
               for n in (N, K, K))


def _torch_call(q, k, v):
  import torch  # lazy: bench-only dependency
  tq, tk, tv = (torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)
                .transpose(1, 2).contiguous() for x in (q, k, v))
  sdpa = torch.nn.functional.scaled_dot_product_attention

  def call():
    with torch.no_grad():
      return sdpa(tq, tk, tv, is_causal=True, enable_gqa=tk.shape[1] != tq.shape[1])
  return call


def run(*, seq_lens: Sequence[int] = DEFAULT_SEQ_LENS, shapes: Sequence[str] = tuple(SHAPES),
        blocks: Sequence[Tuple[int, int]] = DEFAULT_BLOCKS, rounds: int = 5,
        include_torch: bool = True, log=print, on_row=None) -> dict:
  """Times every block size per (shape, S); returns plain dicts (rows, config)."""
  for name in shapes:
    if name not in SHAPES:
      raise UserError(f"Unknown attention shape {name!r}; valid: {list(SHAPES)}.")
  if not isinstance(rounds, int) or rounds < 1:
    raise UserError(f"rounds must be an integer >= 1, got {rounds!r}.")
  if not seq_lens or any(not isinstance(S, int) or S < 1 for S in seq_lens):
    raise UserError(f"Sequence lengths must be integers >= 1, got {list(seq_lens)}.")
  blocks = [tuple(b) for b in blocks]
  if not blocks or any(len(b) != 2 or min(b) < 1 for b in blocks):
    raise UserError(f"Block sizes must be Q/KV pairs of positive integers, got {blocks}.")
  torch_version = None
  if include_torch:
    try:
      import torch
      torch_version = torch.__version__
    except ImportError:
      torch_version = None
  result = dict(config=dict(seq_lens=list(seq_lens), shapes={s: SHAPES[s] for s in shapes},
                            head_dim=HEAD_DIM, blocks=[list(b) for b in blocks],
                            rounds=rounds, flags=FLAGS.describe(),
                            cpu=cpu_features.describe(),
                            cpu_count=os.cpu_count(), jax=jax.__version__,
                            torch=torch_version or "not run",
                            xla_flags=os.environ.get("XLA_FLAGS", ""),
                            qk_float32_operands=PRECISION.float32_qk_operands()), rows=[])
  t_start = time.perf_counter()
  rates = _best_rates()
  result["config"]["matmul_rates_start"] = dict(rates)
  for shape in shapes:
    N, K = SHAPES[shape]
    for S in seq_lens:
      q, k, v = _inputs(S, N, K)
      calls: Dict[str, object] = {}
      outs = {}
      qk32 = PRECISION.float32_qk_operands(num_queries=S)
      for qb, kb in blocks:
        fn = jax.jit(lambda q, k, v, qb=qb, kb=kb, qk32=qk32: blockwise_attention(
            q, k, v, causal=True, flags=FLAGS, q_block=qb, kv_block=kb,
            float32_qk_operands=qk32))
        compiled = fn.lower(q, k, v).compile()
        label = f"q{qb}/kv{kb}"
        outs[label] = np.asarray(compiled(q, k, v), np.float32)
        calls[label] = lambda c=compiled: c(q, k, v).block_until_ready()
      if torch_version:
        calls["torch_sdpa_bf16"] = _torch_call(q, k, v)
        # [B, N, S, H] -> [B, S, N, H], checked and compared like the forms
        outs["torch_sdpa_bf16"] = np.swapaxes(
            calls["torch_sdpa_bf16"]().float().numpy(), 1, 2)
      log(f"{shape} S={S}: {len(calls)} forms compiled; {rounds} interleaved rounds")
      times: Dict[str, List[float]] = {n: [] for n in calls}
      for _ in range(rounds):
        for name, call in calls.items():
          call()                                   # untimed: the ordering bias
          t0 = time.perf_counter()
          call()
          times[name].append(time.perf_counter() - t0)
      default = f"q{blocks[0][0]}/kv{blocks[0][1]}"
      med = {n: statistics.median(ts) for n, ts in times.items()}
      ref = outs[default]
      # a broken default's time is no baseline: no ratio to it (None, printed '-')
      default_s = med[default] if np.isfinite(ref).all() else None
      torch_s = (med["torch_sdpa_bf16"] if "torch_sdpa_bf16" in med
                 and np.isfinite(outs["torch_sdpa_bf16"]).all() else None)
      for name, ts in times.items():
        row = dict(shape=shape, N=N, K=K, S=S, form=name, median_s=med[name],
                   min_s=min(ts), samples_s=ts,
                   vs_default=None if default_s is None else med[name] / default_s,
                   vs_torch=None if torch_s is None else med[name] / torch_s)
        if name in outs:
          # a form whose output is not finite has no time worth comparing: marked, and
          # its difference from the default is not computed from NaN / Inf
          row["finite"] = bool(np.isfinite(outs[name]).all())
          if row["finite"] and np.isfinite(ref).all():
            row["max_abs_vs_default"] = float(np.max(np.abs(outs[name] - ref)))
        result["rows"].append(row)
      result["rows"].append(_floor_row(shape, N, K, S, rates, default_s, torch_s))
      if on_row:
        on_row(result)
  result["rounds_done"] = True
  end = _best_rates()
  result["config"]["matmul_rates_end"] = dict(end)
  # the floors are held to the faster of the two measurements: a lower bound stays one
  best = {key: max(rates[key], end[key]) for key in rates}
  result["config"]["matmul_rates"] = best
  result["rows"] = [r if r["form"] != FLOOR else _floor_row(
      r["shape"], r["N"], r["K"], r["S"], best, r["default_s"], r["torch_s"])
      for r in result["rows"]]
  result["wall_s"] = time.perf_counter() - t_start
  return result


def _best_rates() -> Dict[str, float]:
  """The fastest FLOP/s of each dot dtype over FLOOR_SHAPES (`matmul_peak`)."""
  best: Dict[str, float] = {}
  for shape in FLOOR_SHAPES:
    for key, rate in matmul_peak(shape).items():
      best[key] = max(best.get(key, 0.0), rate)
  return best


def _floor_row(shape, N, K, S, rates, default_s, torch_s) -> dict:
  """The contract floor's row (not timed) beside the timed forms of (shape, S)."""
  floor = contract_floor_s(S, N, rates)
  return dict(shape=shape, N=N, K=K, S=S, form=FLOOR, median_s=floor,
              vs_default=None if default_s is None else floor / default_s,
              default_s=default_s, torch_s=torch_s,
              vs_torch=None if torch_s is None else floor / torch_s)


def to_markdown(result: dict) -> str:
  cfg = result["config"]
  lines = [f"CPU bf16 features: {cfg['cpu']}, {cfg['cpu_count']} cores; jax {cfg['jax']}, "
           f"torch {cfg['torch']}; blockwise, bf16 inputs, {cfg['flags']}; causal, B = 1, "
           f"H = {cfg['head_dim']}; {cfg['rounds']} interleaved rounds, medians."
           + ("" if not cfg.get("qk_float32_operands") else " The QK dot on float32 "
              "casts of q and k (this CPU has no bf16 dots).")
           + ("" if "wall_s" in result else
              " The rounds finished; the matmul rates after them were not measured (the "
              "floor uses the rates before)." if result.get("rounds_done") else
              " PARTIAL: the run stopped before its last (shape, length); the rows below "
              "are the ones it finished.")
           + _rates_line(cfg), "",
           "| shape (N / K) | S | form | ms | vs default blocks | vs torch SDPA bf16 | "
           "max abs vs default |", "|---|---:|---|---:|---:|---:|---:|"]
  for r in result["rows"]:
    torch_ratio = f"{r['vs_torch']:.2f}" if r["vs_torch"] is not None else "-"
    diff = f"{r['max_abs_vs_default']:.1e}" if "max_abs_vs_default" in r else "-"
    if r.get("finite") is False:
      diff = "**non-finite output**"
    lines.append(f"| {r['shape']} ({r['N']} / {r['K']}) | {r['S']} | {r['form']} | "
                 f"{1000 * r['median_s']:.1f} | "
                 + ("-" if r["vs_default"] is None else f"{r['vs_default']:.2f}")
                 + f" | {torch_ratio} | "
                 f"{diff} |")
  return "\n".join(lines) + "\n"


def _rates_line(cfg: dict) -> str:
  rates = cfg.get("matmul_rates") or cfg.get("matmul_rates_start")
  if not rates:
    return ""
  return (f" Contract floor: the QK dot at {rates['bf16'] / 1e9:.0f} GFLOP/s (bf16 x bf16 "
          f"-> f32), the PV dot at {rates['f32'] / 1e9:.0f} (f32), the matmul rates "
          "measured in this run; nothing else counted.")

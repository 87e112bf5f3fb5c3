"""Attention benchmark: `python runners/bench.py [--seq_lens=1024,4096] [--out=bench]`.

Writes <out>/results.json, <out>/results.md and <out>/results.png. See
`attnprec.bench.attention` for the method (round-robin medians, FLOP convention).
Every option and --out are checked before anything is compiled. Exit codes: 0 done,
2 bad input (one paragraph, no traceback), 1 a crash (attnprec.cli).
"""
import argparse
import os
import sys

from attnprec.xla_env import disable_excess_precision

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, runs  # noqa: E402
from attnprec.bench import attention as bench  # noqa: E402
from attnprec.errors import UserError  # noqa: E402


def _ints(text):
  try:
    values = tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a comma-separated list of positive integers, e.g. 1024,4096")
  if any(v < 1 for v in values):
    raise argparse.ArgumentTypeError(f"{text!r}: every sequence length must be >= 1")
  return values


def _names(flag: str, text: str, valid) -> list:
  names = [n.strip() for n in text.split(",") if n.strip()]
  bad = [n for n in names if n not in valid]
  if bad or not names:
    raise UserError(f"Invalid {flag}={text!r}" + (f" (unknown: {', '.join(bad)})" if bad
                                                 else " (empty)")
                    + f"; valid: a comma-separated list of {', '.join(valid)}.")
  return names


def main(argv) -> int:
  def body():
    parser = cli.ArgumentParser(prog="bench", description=__doc__, allow_abbrev=False)
    parser.add_argument("--seq_lens", type=_ints, default=bench.DEFAULT_SEQ_LENS)
    parser.add_argument("--memory_seq_lens", type=_ints,
                        default=bench.DEFAULT_MEMORY_SEQ_LENS)
    parser.add_argument("--decode_seq_lens", type=_ints,
                        default=bench.DEFAULT_DECODE_SEQ_LENS)
    parser.add_argument("--kernels", default=",".join(bench.KERNELS))
    parser.add_argument("--presets", default=",".join(bench.PRESETS))
    parser.add_argument("--no_torch", action="store_true")
    parser.add_argument("--out", default="bench")
    args = parser.parse_args(argv)
    if not args.seq_lens:
      raise UserError("--seq_lens is empty; give at least one length, e.g. 1024,4096.")
    kernels = _names("--kernels", args.kernels, bench.KERNELS)
    presets = _names("--presets", args.presets, list(bench.PRESETS))
    runs.check_output_dir(args.out, flag="--out")   # before minutes of benchmarking
    result = bench.run_attention_bench(
        seq_lens=args.seq_lens, memory_seq_lens=args.memory_seq_lens,
        decode_seq_lens=args.decode_seq_lens, kernels=kernels, presets=presets,
        include_torch=not args.no_torch)
    runs.write_json(args.out, "results.json", result)
    table = bench.to_markdown(result)
    runs.atomic_write(os.path.join(args.out, "results.md"), table)
    bench.plot(result, os.path.join(args.out, "results.png"))
    print(table)
    print(f"wall time {result['wall_s']:.0f} s; wrote {args.out}/results.json, results.md, "
          f"results.png")

  return cli.run("bench", body, output_dir=_out_flag(argv))


def _out_flag(argv) -> str:
  out = "bench"
  for i, a in enumerate(argv):
    if a.startswith("--out="):
      out = a.split("=", 1)[1]
    elif a == "--out" and i + 1 < len(argv):
      out = argv[i + 1]
  return out


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""Attention benchmark: `python runners/bench.py [--seq_lens=1024,4096] [--out=bench]`.

Writes <out>/results.json, <out>/results.md and <out>/results.png. See
`attnprec.bench.attention` for the method (round-robin medians, FLOP convention).
"""
import argparse
import json
import os
import sys

from attnprec.xla_env import disable_excess_precision

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec.bench import attention as bench  # noqa: E402


def _ints(text):
  return tuple(int(x) for x in text.split(",") if x)


def main(argv):
  parser = argparse.ArgumentParser(prog="bench", description=__doc__)
  parser.add_argument("--seq_lens", type=_ints, default=bench.DEFAULT_SEQ_LENS)
  parser.add_argument("--memory_seq_lens", type=_ints, default=bench.DEFAULT_MEMORY_SEQ_LENS)
  parser.add_argument("--decode_seq_lens", type=_ints, default=bench.DEFAULT_DECODE_SEQ_LENS)
  parser.add_argument("--kernels", default=",".join(bench.KERNELS))
  parser.add_argument("--presets", default=",".join(bench.PRESETS))
  parser.add_argument("--no_torch", action="store_true")
  parser.add_argument("--out", default="bench")
  args = parser.parse_args(argv)
  result = bench.run_attention_bench(
      seq_lens=args.seq_lens, memory_seq_lens=args.memory_seq_lens,
      decode_seq_lens=args.decode_seq_lens,
      kernels=args.kernels.split(","), presets=args.presets.split(","),
      include_torch=not args.no_torch)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(result, f, indent=1)
  table = bench.to_markdown(result)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(table)
  bench.plot(result, os.path.join(args.out, "results.png"))
  print(table)
  print(f"wall time {result['wall_s']:.0f} s; wrote {args.out}/results.json, results.md, "
        f"results.png")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

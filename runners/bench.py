"""Benchmarks: `python runners/bench.py [--suite=model|attention|all] [--quick] [--out=bench]`.

`model` (the default, `make bench`; `--cases=1x32,8x1000`, `--model_presets=fp32,bf16_flags`,
`--steps`, `--rounds`, `--no_torch`): decode tokens/s and prefill time of a real model under
the fp32 and bf16 + flags presets beside transformers, the bandwidth roofline, the cost of
the flags per phase, compile times (`attnprec.bench.model`). Writes <out>/model.json,
model.md, model.png. `--quick`: batch 1 and 8 at a 32-token prompt, 8 steps, 2 rounds.

`attention`: every attention kernel x precision preset alone, plus torch SDPA
(`attnprec.bench.attention`). Writes <out>/results.json, results.md, results.png.
"""
import argparse
import os
import sys

from attnprec.xla_env import disable_excess_precision

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import compilation, runs  # noqa: E402
from attnprec.bench import attention as bench  # noqa: E402
from attnprec.bench import model as model_bench  # noqa: E402
from attnprec.errors import UserError  # noqa: E402

SUITES = ("model", "attention", "all")


def _ints(text):
  return tuple(int(x) for x in text.split(",") if x)


def _cases(text):
  """'1x32,8x1000' -> ((1, 32), (8, 1000))."""
  out = []
  for part in text.split(","):
    try:
      B, P = part.lower().split("x")
      out.append((int(B), int(P)))
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"bad case {part!r}: expected BATCHxPROMPT, e.g. 1x32,8x1000") from None
  return tuple(out)


def _write(out, name, text, mode="w"):
  runs.atomic_write(os.path.join(out, name), text, mode)


def _write_model(out, result):
  runs.write_json(out, "model.json", result)
  _write(out, "model.md", model_bench.to_markdown(result))


def run_model(args):
  quick = args.quick
  result = model_bench.run_model_bench(
      on_case=lambda partial: _write_model(args.out, partial),
      model=args.model,
      cases=args.cases or (model_bench.QUICK_CASES if quick else model_bench.DEFAULT_CASES),
      presets=args.model_presets.split(","),
      steps=args.steps or (8 if quick else 32), rounds=args.rounds or (2 if quick else 3),
      include_torch=not args.no_torch, flag_phases=not quick,
      flag_case=(1, 1000))
  _write_model(args.out, result)
  table = model_bench.to_markdown(result)
  tmp = os.path.join(args.out, ".model.tmp.png")
  model_bench.plot(result, tmp)
  os.replace(tmp, os.path.join(args.out, "model.png"))
  print(table)
  print(f"wrote {args.out}/model.json, model.md, model.png")


def run_attention(args):
  result = bench.run_attention_bench(
      seq_lens=args.seq_lens, memory_seq_lens=args.memory_seq_lens,
      decode_seq_lens=args.decode_seq_lens,
      kernels=args.kernels.split(","), presets=args.presets.split(","),
      include_torch=not args.no_torch)
  runs.write_json(args.out, "results.json", result)
  table = bench.to_markdown(result)
  _write(args.out, "results.md", table)
  tmp = os.path.join(args.out, ".results.tmp.png")
  bench.plot(result, tmp)
  os.replace(tmp, os.path.join(args.out, "results.png"))
  print(table)
  print(f"wall time {result['wall_s']:.0f} s; wrote {args.out}/results.json, results.md, "
        f"results.png")


def main(argv):
  parser = argparse.ArgumentParser(prog="bench", description=__doc__)
  parser.add_argument("--suite", choices=SUITES, default="model")
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--model", default="smollm2-135m")
  parser.add_argument("--cases", type=_cases, default=None)
  parser.add_argument("--model_presets", default="fp32,bf16_flags",
                      help=f"comma-separated, from {','.join(model_bench.PRESETS)}")
  parser.add_argument("--steps", type=int, default=0)
  parser.add_argument("--rounds", type=int, default=0)
  parser.add_argument("--seq_lens", type=_ints, default=bench.DEFAULT_SEQ_LENS)
  parser.add_argument("--memory_seq_lens", type=_ints, default=bench.DEFAULT_MEMORY_SEQ_LENS)
  parser.add_argument("--decode_seq_lens", type=_ints, default=bench.DEFAULT_DECODE_SEQ_LENS)
  parser.add_argument("--kernels", default=",".join(bench.KERNELS))
  parser.add_argument("--presets", default=",".join(bench.PRESETS))
  parser.add_argument("--no_torch", action="store_true")
  parser.add_argument("--out", default="bench")
  args = parser.parse_args(argv)
  try:
    compilation.enable()
    runs.ensure_dir(args.out)
    if args.suite in ("model", "all"):
      run_model(args)
    if args.suite in ("attention", "all"):
      run_attention(args)
  except UserError as e:
    print(f"bench: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""Benchmarks: `python runners/bench.py [--suite=model|attention|attention_forms|projections|
profile|compile|all] [--quick] [--out=bench]`.

`model` (the default, `make bench`; `--cases=1x32,8x1000`, `--model_presets=fp32,bf16_flags`,
`--steps`, `--rounds`, `--no_torch`, `--no_flag_phases`, `--torch_dtypes`): decode
tokens/s and prefill time of a real model under the fp32 and bf16 + flags presets beside
transformers, the bandwidth roofline, the cost of the flags per phase (skipped by
`--no_flag_phases`: its float32 train step needs ~16 bytes per parameter), compile times
(`attnprec.bench.model`). Writes <out>/model.json, model.md, model.png. `--quick`: batch 1 and 8 at a 32-token prompt, 8 steps, 2 rounds.

`attention`: every attention kernel x precision preset alone, plus torch SDPA
(`attnprec.bench.attention`). Writes <out>/results.json, results.md, results.png.

`projections`: the dense-projection forms side by side (`attnprec.bench.projections`):
SmolLM2-shaped projections and the whole model's prefill (1000 tokens) and decode step
(batch 1 and 8) per form; `--projection_parts=micro,model`; `--xla_settings=default,
onednn,xnnpack` repeats it once per XLA:CPU setting, each in its own process (XLA_FLAGS
is process-wide). Writes <out>/projections.json, projections.md.

`profile`: where a prefill's time goes, per stage (projections, the attention kernel's
QK dot, softmax and PV dot, RoPE, norms, MLP activation, copies and converts), from
XLA:CPU's own per-thunk trace of the compiled prefill (`attnprec.bench.profile`);
`--model=smollm2-135m,qwen2.5-coder-0.5b` (comma-separated), `--cases` (default 1x1000,
1x4000), `--model_presets`, `--rounds` (traced calls, default 3), `--phases=prefill,decode`
(decode: one decode step after the case's prompt; default prefill). Writes
<out>/profile.json, profile.md, profile.png.

`attention_forms`: the blockwise kernel's block sizes side by side at the shipped models'
attention shapes (`--model=smollm2-135m,qwen2.5-coder-0.5b`), bf16 with both flags,
against torch SDPA bf16 in the same rounds and the contract's floor (both dots at the
matmul rates measured in the run; `attnprec.bench.attention_forms`);
`--seq_lens` (default 4096), `--blocks=512/256,512/512` (Q/KV; the first is the baseline),
`--rounds` (default 5), `--no_torch`. Writes <out>/attention_forms.json, attention_forms.md.

`compile`: compile time and program size against depth, unrolled vs scanned layers
(`model.scan_layers`; `attnprec.bench.compile_time`): the prefill, a decode step and the
train step of a small model at `--depths=2,8,32,80` (`--quick`: 2,8), each compiled
`--rounds` times (default 1), layouts interleaved. Writes <out>/compile.json, compile.md.

`tpu_decode` (on a TPU; refused elsewhere): one decode step's attention alone against
the measured HBM read bandwidth, every kernel, the flash kernel's decode key blocks
(`--decode_blocks`, default 1024,2048,4096,8192), flags off and an int8 cache beside
(`attnprec.bench.tpu_decode`); `--decode_batches` (default 1,8), `--decode_seq_lens`
(cache lengths, default 8192,32768), `--model` (attention shapes, default qwen2.5-0.5b),
`--rounds` (default 5). Writes <out>/tpu_decode.json, tpu_decode.md.

`tpu_model` (on a TPU; refused elsewhere): a whole model of Qwen2.5-0.5B's shape (random
weights, scanned): prefill MFU (`--cases`, default 8x1024,1x8192), a decode step against
its HBM floor (`--decode_cases`, default batch 1, 8, 32 at caches of 1k, 8k, 32k that
fit), a train step's MFU (`--train_cases`, default 1x4096), per preset
(`--model_presets`, default bf16,bf16_flags,bf16_flags_offset,bf16_flags_kv_int8) and
the flags' cost per phase (`attnprec.bench.tpu_model`); `--steps` (decode steps per
timed loop, default 16), `--rounds` (default 3). Writes <out>/tpu_model.json,
tpu_model.md.

An option the chosen suite does not read (`--cases` with `--suite=attention`, say) is
refused, not ignored.

It reads no gin files: the options below are its configuration. Every option and --out
are checked before anything is loaded or compiled. Exit codes: 0 done, 2 bad input (one
paragraph, no traceback), 1 a crash, 130 / 143 interrupted (attnprec.cli).
"""
import argparse
import os
import sys

from attnprec import startup

startup.begin("bench", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec import xla_env  # noqa: E402
from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, compilation, runs  # noqa: E402
from attnprec import kernels as kernel_names  # noqa: E402
from attnprec.bench import attention as bench  # noqa: E402
from attnprec.bench import attention_forms as forms_bench  # noqa: E402
from attnprec.bench import cases as bench_cases  # noqa: E402
from attnprec.bench import compile_time as compile_bench  # noqa: E402
from attnprec.bench import model as model_bench  # noqa: E402
from attnprec.bench import profile as profile_bench  # noqa: E402
from attnprec.bench import projections as projection_bench  # noqa: E402
from attnprec.bench import tpu_attention as tpu_bench  # noqa: E402
from attnprec.bench import tpu_decode as tpu_decode_bench  # noqa: E402
from attnprec.bench import tpu_model as tpu_model_bench  # noqa: E402
from attnprec.checks import INT_MAX  # noqa: E402
from attnprec.errors import UserError  # noqa: E402

DEFAULT_MODEL = "smollm2-135m"   # the model and profile suites' model when --model is not given
SUITES = ("model", "attention", "attention_forms", "projections", "profile", "compile",
          "tpu_attention", "tpu_decode", "tpu_model", "all")
# The options each suite reads (--suite and --out: every suite). One a suite does not
# read is refused, never ignored.
_MODEL_OPTIONS = ("quick", "model", "cases", "model_presets", "steps", "rounds", "no_torch",
                  "no_flag_phases", "torch_dtypes")
_ATTENTION_OPTIONS = ("seq_lens", "memory_seq_lens", "decode_seq_lens", "kernels", "presets",
                      "no_torch")
READS = {"model": _MODEL_OPTIONS, "attention": _ATTENTION_OPTIONS,
         "projections": ("projection_parts", "xla_settings", "rounds"),
         "profile": ("model", "cases", "model_presets", "rounds", "phases"),
         "attention_forms": ("model", "seq_lens", "blocks", "rounds", "no_torch"),
         "compile": ("quick", "depths", "rounds"),
         "tpu_attention": ("model", "seq_lens", "train_seq_lens", "kernels", "flag_rows",
                           "blocks", "splash_blocks", "rounds", "inputs"),
         "tpu_decode": ("model", "decode_seq_lens", "decode_batches", "decode_blocks",
                        "rounds"),
         "tpu_model": ("cases", "decode_cases", "train_cases", "model_presets", "steps",
                       "rounds"),
         "all": tuple(dict.fromkeys(_MODEL_OPTIONS + _ATTENTION_OPTIONS))}


def _ints(text):
  try:
    values = tuple(int(x) for x in text.split(","))     # an empty item is no integer
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a comma-separated list of positive integers, e.g. 1024,4096 "
        f"(every item an integer: an empty one, as in 1024,,4096, is not)")
  if any(v < 1 or v > INT_MAX for v in values):
    raise argparse.ArgumentTypeError(f"{text!r}: every value must be an integer from 1 to "
                                     f"{INT_MAX}")
  twice = bench_cases.repeated(values)
  if twice:
    raise argparse.ArgumentTypeError(
        f"{text!r}: {', '.join(map(str, twice))} given more than once; each is measured "
        f"once, so give each once")
  return values


def _cases(text):
  """'1x32,8x1000' -> ((1, 32), (8, 1000)); 'long': the 4k / 8k cases."""
  try:
    return bench_cases.parse_cases(text)
  except UserError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _blocks(text):
  """'512/256,512/512' -> ((512, 256), (512, 512))."""
  try:
    pairs = tuple(tuple(int(x) for x in item.split("/")) for item in text.split(",")
                  if item.strip())
  except ValueError:
    pairs = ()
  if not pairs or any(len(p) not in (2, 3) or min(p) < 1 for p in pairs):
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a list of Q/KV block pairs of positive integers, e.g. "
        f"512/256,512/512 (tpu_attention: Q/KV or Q/KV/CHUNK)")
  return pairs


def _count(text):
  try:
    value = int(text)
  except ValueError:
    value = -1
  if not 0 <= value <= INT_MAX:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer from 0 to {INT_MAX} "
                                     f"(0: the default)")
  return value


def _names(flag: str, text: str, valid) -> list:
  names = [n.strip() for n in text.split(",")]
  if len(names) > 1 and not all(names):
    raise UserError(f"Invalid {flag}={text!r}: an empty item; valid: a comma-separated "
                    f"list of {', '.join(valid)}.")
  names = [n for n in names if n]
  bad = [n for n in names if n not in valid]
  if bad or not names:
    raise UserError(f"Invalid {flag}={text!r}" + (f" (unknown: {', '.join(bad)})" if bad
                                                 else " (empty)")
                    + f"; valid: a comma-separated list of {', '.join(valid)}.")
  twice = bench_cases.repeated(names)
  if twice:
    raise UserError(f"Invalid {flag}={text!r}: {', '.join(twice)} named more than once; "
                    f"each runs once, so name each once.")
  return names


def _write(out, name, text, mode="w"):
  runs.atomic_write(os.path.join(out, name), text, mode)


def _write_model(out, result):
  runs.write_json(out, "model.json", result, provenance=True)
  _write(out, "model.md", model_bench.to_markdown(result))


def run_model(args):
  quick = args.quick
  result = model_bench.run_model_bench(
      on_case=lambda partial: _write_model(args.out, partial),
      model=args.model or DEFAULT_MODEL,
      cases=args.cases or (model_bench.QUICK_CASES if quick else model_bench.DEFAULT_CASES),
      presets=args.model_presets,
      steps=args.steps or (8 if quick else 32), rounds=args.rounds or (2 if quick else 3),
      include_torch=not args.no_torch, flag_phases=not (quick or args.no_flag_phases),
      torch_dtypes=args.torch_dtypes,
      flag_case=(1, 1000))
  _write_model(args.out, result)
  table = model_bench.to_markdown(result)
  model_bench.plot(result, os.path.join(args.out, "model.png"))
  print(table)
  print(f"wrote {args.out}/model.json, model.md, model.png")


def run_attention(args):
  result = bench.run_attention_bench(
      seq_lens=args.seq_lens or bench.DEFAULT_SEQ_LENS,
      memory_seq_lens=args.memory_seq_lens,
      decode_seq_lens=args.decode_seq_lens or bench.DEFAULT_DECODE_SEQ_LENS,
      kernels=args.kernels or bench.KERNELS, presets=args.presets,
      memory_presets=args.presets if args.presets_given else bench.DEFAULT_MEMORY_PRESETS,
      decode_presets=args.presets if args.presets_given else bench.DEFAULT_DECODE_PRESETS,
      include_torch=not args.no_torch)
  runs.write_json(args.out, "results.json", result, provenance=True)
  table = bench.to_markdown(result)
  _write(args.out, "results.md", table)
  bench.plot(result, os.path.join(args.out, "results.png"))
  print(table)
  print(f"wall time {result['wall_s']:.0f} s; wrote {args.out}/results.json, results.md, "
        f"results.png")


def run_projections(args):
  parts = args.projection_parts
  child = [f"--parts={','.join(parts)}", f"--micro_rounds={args.rounds or 5}",
           f"--model_rounds={args.rounds or 3}"]
  if args.xla_settings:
    results = projection_bench.run_settings(args.xla_settings, child)
  else:
    results = {xla_env.in_force(): projection_bench.run(
        parts=tuple(parts), micro_rounds=args.rounds or 5, model_rounds=args.rounds or 3)}
  runs.write_json(args.out, "projections.json", results, provenance=True)
  text = "\n".join(f"## XLA:CPU setting: {k}\n\n{projection_bench.to_markdown(r)}"
                   for k, r in results.items())
  _write(args.out, "projections.md", text)
  print(text)
  print(f"wrote {args.out}/projections.json, projections.md")


def run_profile(args):
  def write(result):
    runs.write_json(args.out, "profile.json", result, provenance=True)
    _write(args.out, "profile.md", profile_bench.to_markdown(result))

  result = profile_bench.run_profile(
      models=[m.strip() for m in (args.model or DEFAULT_MODEL).split(",") if m.strip()],
      cases=args.cases or ((1, 1000), (1, 4000)), presets=args.model_presets,
      rounds=args.rounds or 3, phases=args.phases, on_row=write)
  write(result)
  profile_bench.plot(result, os.path.join(args.out, "profile.png"))
  print(profile_bench.to_markdown(result))
  print(f"wrote {args.out}/profile.json, profile.md, profile.png")


def run_attention_forms(args):
  def write(result):
    runs.write_json(args.out, "attention_forms.json", result, provenance=True)
    _write(args.out, "attention_forms.md", forms_bench.to_markdown(result))

  shapes = ([m.strip() for m in args.model.split(",") if m.strip()] if args.model
            else list(forms_bench.SHAPES))
  result = forms_bench.run(seq_lens=args.seq_lens or forms_bench.DEFAULT_SEQ_LENS,
                           shapes=shapes,
                           blocks=args.blocks or forms_bench.DEFAULT_BLOCKS,
                           rounds=args.rounds or 5, include_torch=not args.no_torch,
                           log=lambda m: print(m, flush=True), on_row=write)
  write(result)
  print(forms_bench.to_markdown(result))
  print(f"wall time {result['wall_s']:.0f} s; wrote {args.out}/attention_forms.json, "
        f"attention_forms.md")


def run_tpu_attention(args):
  shapes = ([m.strip() for m in args.model.split(",") if m.strip()] if args.model
            else list(tpu_bench.SHAPES))
  result = tpu_bench.run(
      args.out, shapes=shapes, seq_lens=args.seq_lens or tpu_bench.DEFAULT_SEQ_LENS,
      train_seq_lens=args.train_seq_lens or tpu_bench.DEFAULT_TRAIN_SEQ_LENS,
      kernel_names=args.kernels or tpu_bench.KERNELS, flag_rows=args.flag_rows,
      blocks=args.blocks or tpu_bench.DEFAULT_BLOCKS, splash_blocks=args.splash_blocks,
      rounds=args.rounds or 5, inputs=args.inputs or "projection",
      progress=lambda m: print(m, flush=True))
  print(tpu_bench.to_markdown(result))
  print(f"wrote {args.out}/tpu_attention.json, tpu_attention.md")


def run_tpu_decode(args):
  shapes = ([m.strip() for m in args.model.split(",") if m.strip()] if args.model
            else list(tpu_decode_bench.DEFAULT_SHAPES))
  result = tpu_decode_bench.run(
      args.out, shapes=shapes, batches=args.decode_batches or tpu_decode_bench.DEFAULT_BATCHES,
      seq_lens=args.decode_seq_lens or tpu_decode_bench.DEFAULT_SEQ_LENS,
      blocks=args.decode_blocks or tpu_decode_bench.DEFAULT_DECODE_BLOCKS,
      rounds=args.rounds or 5, progress=lambda m: print(m, flush=True))
  print(tpu_decode_bench.to_markdown(result))
  print(f"wrote {args.out}/tpu_decode.json, tpu_decode.md")


def run_tpu_model(args):
  result = tpu_model_bench.run(
      args.out, presets=args.model_presets,
      prefill_cases=args.cases or tpu_model_bench.PREFILL_CASES,
      decode_cases=args.decode_cases,
      train_cases=args.train_cases or tpu_model_bench.TRAIN_CASES,
      rounds=args.rounds or 3, steps=args.steps or tpu_model_bench.STEPS,
      progress=lambda m: print(m, flush=True))
  print(tpu_model_bench.to_markdown(result))
  print(f"wrote {args.out}/tpu_model.json, tpu_model.md")


def run_compile(args):
  depths = args.depths or (compile_bench.QUICK_DEPTHS if args.quick else compile_bench.DEPTHS)
  print(f"compile suite: depths {','.join(map(str, depths))}, programs "
        f"{','.join(compile_bench.PROGRAMS)}, {args.rounds or 1} round(s)", flush=True)
  result = compile_bench.run(
      depths=depths, rounds=args.rounds or 1, log=lambda m: print(m, flush=True),
      on_row=lambda partial: runs.write_json(args.out, "compile.json", partial, provenance=True))
  runs.write_json(args.out, "compile.json", result, provenance=True)
  table = compile_bench.to_markdown(result)
  _write(args.out, "compile.md", table)
  print(table)
  print(f"wall time {result['wall_s']:.0f} s; wrote {args.out}/compile.json, compile.md")


def _check_tpu_suite(args, what: str, instead: str) -> None:
  """A TPU suite's checks before anything runs: a TPU backend, and --model naming
  attention shapes it knows (`tpu_attention.SHAPES`)."""
  import jax
  if jax.default_backend() != "tpu":
    raise UserError(f"--suite={args.suite} {what}; this machine's backend is "
                    f"{jax.default_backend()!r}. Run it on a TPU (docs/tpu.md); on CPU use "
                    f"{instead}.")
  unknown = [m for m in (args.model or "").split(",") if m.strip()
             and m.strip() not in tpu_bench.SHAPES]
  if unknown:
    raise UserError(f"--model={args.model!r}: the {args.suite} suite knows the attention "
                    f"shapes of {', '.join(tpu_bench.SHAPES)}, not "
                    f"{', '.join(map(repr, unknown))}.")


def _parse(argv):
  parser = cli.ArgumentParser(prog="bench", doc=__doc__, examples=EXAMPLES)
  add = parser.add_argument
  add("--suite", choices=SUITES, default="model", help="what to benchmark")
  add("--quick", action="store_true", help="a short run (see above)")
  add("--model", default=None, help=f"model suite: the model to decode (default "
      f"{DEFAULT_MODEL}); profile: comma-separated; attention_forms: whose attention shapes "
      "(default both shipped: smollm2-135m,qwen2.5-coder-0.5b)")
  add("--cases", type=_cases, default=None,
      help="model suite: BATCHxPROMPT cases, e.g. 1x32,8x1000 (None: the suite's own)")
  add("--model_presets", default=None,
      help=f"model suite: comma-separated, from {','.join(model_bench.PRESETS)} (default "
      f"fp32,bf16_flags); tpu_model: default {','.join(tpu_model_bench.PRESETS)}")
  add("--decode_cases", type=_cases, default=None,
      help="tpu_model suite: BATCHxCACHE decode cases, e.g. 1x8192,8x32768 (default: "
      "batch 1, 8, 32 at caches of 1024, 8192, 32768, those that fit the device)")
  add("--train_cases", type=_cases, default=None,
      help=f"tpu_model suite: BATCHxTOKENS train cases (default "
      f"{','.join(f'{b}x{t}' for b, t in tpu_model_bench.TRAIN_CASES)})")
  add("--steps", type=_count, default=0, help="model suite: decode steps (0: 32, quick 8); "
      f"tpu_model: decode steps per timed loop (0: {tpu_model_bench.STEPS})")
  add("--rounds", type=_count, default=0, help="model suite: timing rounds (0: 3, quick 2); "
      "other suites: their rounds (0: the suite's default, named above)")
  add("--seq_lens", type=_ints, default=None,
      help=f"attention suite: sequence lengths (default "
      f"{','.join(map(str, bench.DEFAULT_SEQ_LENS))}); attention_forms: default "
      f"{','.join(map(str, forms_bench.DEFAULT_SEQ_LENS))}")
  add("--memory_seq_lens", type=_ints, default=bench.DEFAULT_MEMORY_SEQ_LENS,
      help="attention suite: lengths whose peak memory is measured")
  add("--decode_seq_lens", type=_ints, default=None,
      help=f"attention suite: cache lengths of the single-token decode step (default "
      f"{','.join(map(str, bench.DEFAULT_DECODE_SEQ_LENS))}); tpu_decode: default "
      f"{','.join(map(str, tpu_decode_bench.DEFAULT_SEQ_LENS))}")
  add("--decode_batches", type=_ints, default=None,
      help=f"tpu_decode suite: batch sizes (default "
      f"{','.join(map(str, tpu_decode_bench.DEFAULT_BATCHES))})")
  add("--decode_blocks", type=_ints, default=None,
      help=f"tpu_decode suite: the flash kernel's decode key blocks (default "
      f"{','.join(map(str, tpu_decode_bench.DEFAULT_DECODE_BLOCKS))})")
  add("--kernels", default=None, help=f"attention suite: kernels (default "
      f"{','.join(bench.KERNELS)}); tpu_attention: default {','.join(tpu_bench.KERNELS)}")
  add("--splash_blocks", type=_blocks, default=None,
      help="tpu_attention suite: jax's splash attention's Q/KV blocks (default: the Q/KV "
      "pairs of --blocks), e.g. 512/512,1024/1024")
  add("--inputs", choices=tpu_bench.INPUT_FORMS, default=None,
      help="tpu_attention suite: q, k, v as a model's projections give them, [1, S, "
      "heads * H] ('projection', the default), or [1, S, heads, H] ('heads')")
  add("--train_seq_lens", type=_ints, default=None,
      help=f"tpu_attention suite: lengths of the forward + backward cases (default "
      f"{','.join(map(str, tpu_bench.DEFAULT_TRAIN_SEQ_LENS))})")
  add("--flag_rows", default=",".join(tpu_bench.FLAG_ROWS),
      help=f"tpu_attention suite: the flag settings, from {','.join(tpu_bench.FLAG_ROWS)}")
  add("--presets", default=",".join(bench.PRESETS),
      help="attention suite: precision presets, for every section (not given: all for the "
           f"forward sweep, {','.join(bench.DEFAULT_MEMORY_PRESETS)} for memory, "
           f"{','.join(bench.DEFAULT_DECODE_PRESETS)} for decode)")
  add("--no_torch", action="store_true", help="skip the transformers / torch baselines")
  add("--no_flag_phases", action="store_true",
      help="model suite: skip the cost of the flags per phase (its train step holds the "
      "weights, gradients and optimizer state in float32: ~16 bytes per parameter)")
  add("--torch_dtypes", default="float32",
      help="model suite: transformers in these dtypes (float32, bfloat16)")
  add("--projection_parts", default="micro,model",
      help="projections suite: micro (projection shapes), model (prefill, decode steps)")
  add("--xla_settings", default="",
      help=f"projections suite: one process per XLA:CPU setting, from "
      f"{','.join(xla_env.SETTINGS)} ('': this process's setting only)")
  add("--blocks", type=_blocks, default=None,
      help="attention_forms suite: Q/KV block pairs, e.g. 512/256,512/512 (the first is "
      "the baseline)")
  add("--phases", default="prefill",
      help=f"profile suite: the programs profiled, from {','.join(profile_bench.PHASES)} "
      "(decode: one decode step over the case's prompt)")
  add("--depths", type=_ints, default=None,
      help="compile suite: layer counts (None: 2,8,32,80; quick 2,8)")
  add("--out", default="bench", metavar="DIR", help="where results are written")
  args = parser.parse_args(argv)
  if args.model_presets is None:
    args.model_presets = (",".join(tpu_model_bench.PRESETS) if args.suite == "tpu_model"
                          else "fp32,bf16_flags")
  args.model_presets = _names("--model_presets", args.model_presets,
                              list(tpu_model_bench.VALID_PRESETS if args.suite == "tpu_model"
                                   else model_bench.PRESETS))
  args.kernels = _names("--kernels", args.kernels, list(kernel_names.NAMES)) \
      if args.kernels is not None else None
  args.flag_rows = _names("--flag_rows", args.flag_rows, list(tpu_bench.FLAG_ROWS))
  args.phases = _names("--phases", args.phases, list(profile_bench.PHASES))
  args.torch_dtypes = _names("--torch_dtypes", args.torch_dtypes,
                             list(model_bench.TORCH_DTYPES))
  args.presets = _names("--presets", args.presets, list(bench.PRESETS))
  args.projection_parts = _names("--projection_parts", args.projection_parts,
                                 ["micro", "model"])
  args.xla_settings = _names("--xla_settings", args.xla_settings, list(xla_env.SETTINGS)) \
      if args.xla_settings else []
  # after the names are checked: a bad name is reported as such, whatever the suite
  # which options the command line gave: parsing into a namespace that already holds a
  # marker for every option leaves the marker wherever an option was not given
  marker = object()
  given = vars(parser.parse_args(argv, argparse.Namespace(
      **{k: marker for k in vars(args)})))
  unread = [k for k, v in given.items()
            if v is not marker and k not in ("suite", "out") + READS[args.suite]]
  if unread:
    raise UserError(
        f"--suite={args.suite} does not read {', '.join('--' + k for k in unread)}; "
        f"the options it reads: {', '.join('--' + k for k in READS[args.suite])} "
        f"(and --suite, --out). Drop them, or choose the suite that reads them.")
  # --presets given: every section of the attention suite runs those presets (the
  # memory and decode sections run their own defaults otherwise)
  args.presets_given = given.get("presets", marker) is not marker
  if args.no_torch and given.get("torch_dtypes", marker) is not marker:
    raise UserError(f"--torch_dtypes={','.join(args.torch_dtypes)} names the dtypes of the "
                    f"torch baselines, which --no_torch skips: it would not be read. Drop "
                    f"one of the two.")
  if args.suite != "tpu_attention" and any(len(b) != 2 for b in args.blocks or ()):
    raise UserError(f"--blocks: a Q/KV/CHUNK triple is a tpu_attention block (the flash "
                    f"kernel's chunk); --suite={args.suite} takes Q/KV pairs, e.g. 512/512.")
  if args.suite == "attention_forms" and args.model:
    unknown = [m for m in args.model.split(",") if m.strip() not in forms_bench.SHAPES]
    if unknown:
      raise UserError(f"--model={args.model!r}: the attention_forms suite knows the "
                      f"attention shapes of {', '.join(forms_bench.SHAPES)}, not "
                      f"{', '.join(map(repr, unknown))}.")
  if args.suite == "tpu_decode":
    _check_tpu_suite(args, "times a decode step's attention on a TPU against its HBM "
                     "bandwidth (the flash kernel would run interpreted)",
                     "--suite=attention (its decode rows)")
    bad = [b for b in (args.decode_blocks or ()) if b <= 0 or b % 128]
    if bad:
      raise UserError(f"--decode_blocks={','.join(map(str, args.decode_blocks))}: the flash "
                      f"kernel's decode key blocks must be positive multiples of 128 (the "
                      f"lane width), not {', '.join(map(str, bad))}. Valid: e.g. "
                      f"1024,2048,4096,8192.")
  if args.suite == "tpu_model":
    _check_tpu_suite(args, "times a whole model's prefill, decode steps and train step on a "
                     "TPU against its matmul peak and HBM floor (the flash kernel would run "
                     "interpreted)", "--suite=model")
  if args.suite == "tpu_attention":
    if any(len(b) != 2 for b in args.splash_blocks or ()):
      raise UserError(f"--splash_blocks: splash takes Q/KV pairs (it has no chunk), e.g. "
                      f"512/512,1024/1024; got "
                      f"{','.join('/'.join(map(str, b)) for b in args.splash_blocks)}.")
    bad = [b for b in (args.blocks or ()) + (args.splash_blocks or ())
           if b[0] % 16 or any(x % 128 for x in b[1:])]
    if bad:
      raise UserError(f"--blocks={'/'.join(map(str, bad[0]))}: the tpu_attention suite's "
                      f"blocks are Q rows / KV keys (/ chunk keys) tiling a TPU: Q a multiple "
                      f"of 16, KV and chunk of 128; valid e.g. 512/512,1024/1024/256.")
    _check_tpu_suite(args, "benches attention on a TPU against jax's splash attention (a "
                     "Mosaic kernel)", "--suite=attention or --suite=attention_forms")
  if args.depths and max(args.depths) > compile_bench.MAX_DEPTH:
    raise UserError(f"--depths={','.join(map(str, args.depths))}: the compile suite builds a "
                    f"model of each depth (its parameters, and a program of that many "
                    f"layers unrolled); depths up to {compile_bench.MAX_DEPTH} are valid, "
                    f"e.g. 2,8,32,80.")
  if args.seq_lens is not None and not args.seq_lens:
    raise UserError("--seq_lens is empty; give at least one length, e.g. 1024,4096.")
  runs.check_output_dir(args.out, flag="--out")   # before minutes of benchmarking
  return args


EXAMPLES = [
    "python runners/bench.py --quick --out=bench_quick",
    "python runners/bench.py --suite=attention --seq_lens=1024,4096 "
    "--kernels=dot_product,blockwise",
    "python runners/bench.py --suite=projections --xla_settings=default,onednn,xnnpack",
    "python runners/bench.py --torch_dtypes=float32,bfloat16 --cases=long",
    "python runners/bench.py --suite=profile --model=smollm2-135m,qwen2.5-coder-0.5b "
    "--model_presets=bf16_flags",
    "python runners/bench.py --suite=compile --depths=2,8,32,80",
    "python runners/bench.py --suite=attention_forms --seq_lens=4096,16384 "
    "--blocks=512/256,512/512",
]


def _suites(args):
  """Runs the suite(s) --suite names ('all': the model and attention suites)."""
  runs_of = {"model": (run_model,), "attention": (run_attention,),
             "all": (run_model, run_attention), "projections": (run_projections,),
             "profile": (run_profile,), "compile": (run_compile,),
             "attention_forms": (run_attention_forms,),
             "tpu_attention": (run_tpu_attention,), "tpu_decode": (run_tpu_decode,),
             "tpu_model": (run_tpu_model,)}
  for run in runs_of[args.suite]:
    run(args)


def main(argv) -> int:
  def body():
    args = _parse(argv)
    print(xla_env.describe(), flush=True)   # what is in force (a user's XLA_FLAGS wins)
    compilation.enable()
    runs.check_owner(args.out, ("bench",), "the bench", flag="--out")
    # the bench's --out is its own: recorded as the bench's, so that no other runner
    # writes its results beside the bench's (a directory with files but no record is
    # refused: the bench would write over them)
    finish = runs.claim(args.out, "bench", flag="--out", replaceable=False)
    ok = False
    try:
      _suites(args)
      ok = True
    finally:
      if finish:
        finish(ok)

  # keep_partial: model.json is rewritten after every case, so an interrupted run keeps
  # the cases it measured
  return cli.run("bench", body, output_dir=_out_flag(argv), keep_partial=True)


def _out_flag(argv) -> str:
  """The --out a command line names (the last one), before full parsing."""
  out = "bench"
  for i, a in enumerate(argv):
    if a.startswith("--out="):
      out = a.split("=", 1)[1]
    elif a == "--out" and i + 1 < len(argv):
      out = argv[i + 1]
  return out


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

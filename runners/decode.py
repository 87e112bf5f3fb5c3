"""Decode: `python runners/decode.py --gin_file=gin/experiments/recall_bf16.gin [...]`.

Composes gin files (gin/runs/decode.gin first), enters the `decode` phase scope for the
precision (prefill and every decode step use it), and runs the configured decode job.
Exit codes: 0 done, 2 bad input (one paragraph, no traceback), 1 a crash (attnprec.cli).
"""
import sys

from attnprec import startup

startup.begin("decode", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, compilation, ginutils  # noqa: E402
from attnprec.jobs import decode_job  # noqa: E402
from attnprec.precision import phase_precision  # noqa: E402


def run(run_dir: str):
  compilation.enable()  # programs compiled by one run are loaded by the next
  with ginutils.phase("decode"):
    precision = ginutils.call(phase_precision)
  return ginutils.call(decode_job, precision=precision, run_dir=run_dir)


EXAMPLES = [
    "python runners/decode.py --gin_file=gin/experiments/recall_bf16.gin",
    "python runners/decode.py --gin_file=gin/experiments/recall.gin "
    "--gin.recall_eval.checkpoint=runs/recall --gin.decode/precision.float32_logits=True",
]


def main(argv) -> int:
  return cli.main(argv, prog="decode", doc=__doc__, examples=EXAMPLES,
                  default_files=["runs/decode.gin"], default_run_dir="runs/decode", body=run,
                  reads=("decode/precision", "decode"))


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

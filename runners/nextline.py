"""Next-line exact match: `python runners/nextline.py [--gin_file=gin/experiments/nextline_qwen2.gin]`.

A downstream task for a code model (`attnprec.study.nextline`): next-line exact match on
Python standard-library source under each precision preset and the fp32/HIGHEST
reference, with confidence intervals and the cost of each preset per phase. Writes
results.json, report.md and nextline.png into --run_dir. Exit code 2 on bad input.
"""
import sys

from attnprec import startup

startup.begin("nextline", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, ginutils  # noqa: E402
from attnprec.study.nextline import nextline  # noqa: E402


EXAMPLES = [
    "python runners/nextline.py --gin_file=gin/experiments/nextline_qwen2.gin",
    "python runners/nextline.py --gin_file=gin/experiments/nextline_qwen2.gin "
    "--run_dir=runs/nextline_small",
]


def main(argv) -> int:
  return cli.main(argv, prog="nextline", doc=__doc__, examples=EXAMPLES,
                  default_files=["runs/nextline.gin"],
                  default_run_dir="runs/nextline", reads=("nextline",),
                  body=lambda run_dir: ginutils.call(nextline, run_dir=run_dir))


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

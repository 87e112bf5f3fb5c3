"""Sizes: `python runners/sizes.py [--gin_file=...]`.

Puts two or more sizes of one model family side by side from what `make study` and
`make eval` wrote (attnprec.evals.sizes; nothing is recomputed): one table with a column
per size (logits KL, NLL, worst-layer decode attention error, HumanEval pass@1 and
retrieval accuracy by length with Wilson intervals and paired tests against the
reference) and a plot of the decode attention error by layer depth. Writes sizes.md,
sizes.json and sizes_error_by_layer.png into --run_dir. Runs whose settings differ are
refused (exit 2).
"""
import sys

from attnprec import startup

startup.begin("sizes", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec import cli, ginutils  # noqa: E402
from attnprec.evals.sizes import sizes_job  # noqa: E402

EXAMPLES = [
    "python runners/sizes.py",
    "python runners/sizes.py "
    "--gin.sizes.humaneval=\"()\" --run_dir=runs/sizes_study_only",
]


def main(argv) -> int:
  return cli.main(argv, prog="sizes", doc=__doc__, examples=EXAMPLES,
                  default_files=["runs/sizes.gin"],
                  default_run_dir="runs/sizes", reads=("sizes",),
                  body=lambda run_dir: ginutils.call(sizes_job, run_dir=run_dir))


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

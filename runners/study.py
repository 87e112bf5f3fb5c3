"""Study: `python runners/study.py [--gin_file=gin/experiments/study_recall.gin] [...]`.

Sweeps precision configurations (default: every preset in gin/precision/) for one model
against an fp32/HIGHEST reference and writes report.md, results.json and PNG plots into
--run_dir. Runs with XLA_FLAGS=--xla_allow_excess_precision=false (set here, before jax
is imported). It reads no precision.* binding (the presets are the configurations): one
is refused. Exit codes: 0 done, 2 bad input, 1 a crash (attnprec.cli).
"""
import sys

from attnprec import startup

startup.begin("study", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, ginutils  # noqa: E402
from attnprec.study.sweep import study  # noqa: E402


EXAMPLES = [
    "python runners/study.py --gin_file=gin/experiments/study_recall.gin",
    "python runners/study.py --gin_file=gin/experiments/study_smollm2.gin "
    "--run_dir=runs/study_smollm2",
]


def main(argv) -> int:
  return cli.main(argv, prog="study", doc=__doc__, examples=EXAMPLES,
                  default_files=["runs/study.gin"],
                  default_run_dir="runs/study", reads=("study",),
                  body=lambda run_dir: ginutils.call(study, run_dir=run_dir))


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

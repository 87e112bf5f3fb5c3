"""LR sweep: `python runners/sweep.py [--gin_file=...] [--gin.lr_sweep.steps=500]`.

Does attention precision matter in training? Trains byte-level models of each size in
`lr_sweep.sizes` under each precision setting in `lr_sweep.settings` at every learning rate
in `lr_sweep.lrs` and seed in `lr_sweep.seeds` (`attnprec.lrsweep`), group by group into
--run_dir (a rerun resumes), then writes report.md, report.json and two plots: LR
sensitivity with paired bootstrap intervals, and the attention logit growth. Exit code 2
on bad input (an empty or non-positive LR grid, an unknown size or setting, a size that
does not fit the device).
"""
import sys

from attnprec import startup

startup.begin("sweep", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, ginutils  # noqa: E402
from attnprec.lrsweep.job import lr_sweep_job  # noqa: E402


EXAMPLES = [
    "python runners/sweep.py --run_dir=runs/lr_sweep           # the plan of gin/runs/sweep.gin",
    "python runners/sweep.py --gin.lr_sweep.max_groups=2   # two groups this time; rerun resumes",
]


def main(argv) -> int:
  return cli.main(argv, prog="sweep", doc=__doc__, examples=EXAMPLES,
                  default_files=["runs/sweep.gin"], default_run_dir="runs/lr_sweep",
                  reads=("lr_sweep",), keep_partial=True,
                  body=lambda run_dir: ginutils.call(lr_sweep_job, run_dir=run_dir))


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

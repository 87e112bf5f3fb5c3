"""Train a model: `python runners/train.py --gin_file=gin/experiments/recall.gin [...]`.

Composes gin files (gin/runs/train.gin first), enters the `train` phase scope for the
precision, and runs the configured train job into --run_dir.
"""
import sys

from attnprec import cli, ginutils
from attnprec.config import model_config
from attnprec.jobs import train_recall
from attnprec.precision import phase_precision


def run(run_dir: str):
  config = ginutils.call(model_config)
  with ginutils.phase("train"):
    precision = ginutils.call(phase_precision)
  return ginutils.call(train_recall, config=config, precision=precision, run_dir=run_dir)


if __name__ == "__main__":
  sys.exit(cli.main(sys.argv[1:], prog="train", default_files=["runs/train.gin"],
                    default_run_dir="runs/recall", body=run))

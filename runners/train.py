"""Train a model: `python runners/train.py --gin_file=gin/experiments/recall.gin [...]`.

Composes gin files (gin/runs/train.gin first), initializes multi-host JAX when
`distributed.coordinator_address` is bound, enters the `train` phase scope for the
precision, and runs the configured train job (`train_job.job`, default @train_recall)
into --run_dir. An existing --run_dir resumes from its newest checkpoint; a run directory
another training is writing to is refused. SIGINT (Ctrl-C) or SIGTERM: the step in flight
finishes, a checkpoint of that step is saved, and it exits 130 / 143 with one line saying
where; training again resumes from it bit for bit. Exit codes: 0 done, 2 bad input (or a
full disk), 1 a crash, 130 / 143 interrupted.
"""
import sys

from attnprec import startup

startup.begin("train", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, ginutils, sharding  # noqa: E402
from attnprec.config import model_config  # noqa: E402
from attnprec.jobs import train_job  # noqa: E402
from attnprec.precision import phase_precision  # noqa: E402


def run(run_dir: str):
  ginutils.call(sharding.initialize_distributed)  # before anything touches a device
  config = ginutils.call(model_config)
  with ginutils.phase("train"):
    precision = ginutils.call(phase_precision)
  return ginutils.call(train_job, config=config, precision=precision, run_dir=run_dir)


EXAMPLES = [
    "python runners/train.py --gin_file=gin/experiments/recall.gin --run_dir=runs/recall",
    "python runners/train.py --gin_file=gin/experiments/recall.gin --gin.train.steps=300 "
    "--run_dir=runs/short   # run again to resume",
]


def main(argv) -> int:
  return cli.main(argv, prog="train", doc=__doc__, examples=EXAMPLES,
                  default_files=["runs/train.gin"], default_run_dir="runs/recall", body=run,
                  reads=("distributed", "model", "train/precision", "train_job"),
                  keep_partial=True)


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

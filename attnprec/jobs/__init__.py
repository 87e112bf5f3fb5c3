"""Jobs the runners launch: each is a gin configurable taking plain data."""
from attnprec.jobs.generate_text import generate_text  # noqa: F401
from attnprec.jobs.recall_eval import recall_eval  # noqa: F401
from attnprec.jobs.train_recall import train_recall  # noqa: F401
from attnprec.jobs.train_text import train_text  # noqa: F401

import gin

from attnprec import checks
from attnprec.errors import UserError

# The jobs each runner's `*.job` may name, by a gin reference (the one way a job is
# chosen: `decode.job = @generate_text`, `train_job.job = @train_text`, `eval.job =
# @retrieval`); their names in messages come from the jobs themselves.
DECODE_JOBS = checks.declare_jobs("decode.job", (recall_eval, generate_text))
TRAIN_JOBS = checks.declare_jobs("train_job.job", (train_recall, train_text))


def _check_job(binding: str, job, jobs) -> None:
  problem = checks.one_of_jobs(*jobs)(job)
  if problem:
    raise UserError(f"Invalid {binding} = {checks.show(job)}: {problem}.")


@gin.configurable("decode", denylist=["precision", "run_dir"])
def decode_job(*, precision, run_dir: str, job=gin.REQUIRED):
  """Runs the decode job that `decode.job` names (e.g. @recall_eval) with the decode
  phase's precision."""
  if not callable(job) and not isinstance(job, str):
    names = " or ".join(f"@{checks.rules_of(j).name}" for j in DECODE_JOBS)
    raise UserError(f"decode.job is not set, so there is nothing to decode: pass an "
                    f"experiment file (--gin_file=gin/experiments/recall.gin, or `make decode "
                    f"GIN=...`) or bind decode.job to {names} (gin/experiments/recall.gin, "
                    f"gin/experiments/smollm2.gin).")
  _check_job("decode.job", job, DECODE_JOBS)
  return job(precision=precision, run_dir=run_dir)


@gin.configurable("train_job", denylist=["config", "precision", "run_dir"])
def train_job(*, config, precision, run_dir: str, job=train_recall):
  """Runs the train job that `train_job.job` names (@train_recall by default, or
  @train_text) with the train phase's precision."""
  _check_job("train_job.job", job, TRAIN_JOBS)
  return job(config=config, precision=precision, run_dir=run_dir)

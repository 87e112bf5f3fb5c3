"""Jobs the runners launch: each is a gin configurable taking plain data."""
from attnprec.jobs.generate_text import generate_text  # noqa: F401
from attnprec.jobs.recall_eval import recall_eval  # noqa: F401
from attnprec.jobs.train_recall import train_recall  # noqa: F401
from attnprec.jobs.train_text import train_text  # noqa: F401

import gin

from attnprec.errors import UserError

DECODE_JOBS = "@recall_eval (gin/experiments/recall.gin) or @generate_text " \
              "(gin/experiments/smollm2.gin)"


@gin.configurable("decode", denylist=["precision", "run_dir"])
def decode_job(*, precision, run_dir: str, job=gin.REQUIRED):
  """Runs the decode job that `decode.job` names (e.g. @recall_eval) with the decode
  phase's precision."""
  if not callable(job):
    raise UserError(f"decode.job is not set, so there is nothing to decode: pass an "
                    f"experiment file (--gin_file=gin/experiments/recall.gin, or `make decode "
                    f"GIN=...`) or bind decode.job to {DECODE_JOBS}.")
  return job(precision=precision, run_dir=run_dir)


@gin.configurable("train_job", denylist=["config", "precision", "run_dir"])
def train_job(*, config, precision, run_dir: str, job=train_recall):
  """Runs the train job that `train_job.job` names (@train_recall by default, or
  @train_text) with the train phase's precision."""
  if not callable(job):
    raise UserError(f"train_job.job must be @train_recall or @train_text, got {job!r}.")
  return job(config=config, precision=precision, run_dir=run_dir)

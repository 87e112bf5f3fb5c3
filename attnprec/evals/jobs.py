"""`make eval`: the task evaluation `eval.job` names, each a gin configurable.

    eval.job = @humaneval      # humaneval.* (attnprec.evals.humaneval_eval)
    eval.job = @retrieval      # retrieval.* (attnprec.evals.retrieval_eval)

A job is chosen the way every runner chooses one (`decode.job = @generate_text`,
`train_job.job = @train_text`): a gin reference. Each task decodes the same presets of
gin/precision/ (the reference first), writes one record per item as it finishes
(`attnprec.evals.records`, a rerun resumes) and scores them with one statistics module
(`attnprec.stats`, `attnprec.evals.report`).
"""
import gin

from attnprec import checks
from attnprec.evals.humaneval_eval import humaneval_eval
from attnprec.evals.retrieval_eval import retrieval_eval

JOBS = checks.declare_jobs("eval.job", (humaneval_eval, retrieval_eval))


@gin.configurable("eval", denylist=["run_dir"])
@checks.validated("eval", job=checks.one_of_jobs(*JOBS))
def eval_job(*, run_dir: str, job=humaneval_eval):
  """Runs the task evaluation `eval.job` names into run_dir."""
  return job(run_dir=run_dir)

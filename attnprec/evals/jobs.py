"""`make eval`: the task evaluations by name (`eval.task`), each a gin configurable.

    eval.task = 'humaneval'      # humaneval.* (attnprec.evals.humaneval_eval)
    eval.task = 'retrieval'      # retrieval.* (attnprec.evals.retrieval_eval)

Each task decodes the same presets of gin/precision/ (the reference first), writes one
record per item as it finishes (`attnprec.evals.records`, a rerun resumes) and scores
them with one statistics module (`attnprec.stats`, `attnprec.evals.report`).
"""
import gin

from attnprec import checks
from attnprec.errors import UserError
from attnprec.evals.humaneval_eval import humaneval_eval
from attnprec.evals.retrieval_eval import retrieval_eval

TASKS = {"humaneval": humaneval_eval, "retrieval": retrieval_eval}


@gin.configurable("eval", denylist=["run_dir"])
@checks.validated("eval", task=checks.string)
def eval_job(*, run_dir: str, task: str = "humaneval"):
  """Runs the task evaluation `eval.task` names into run_dir."""
  if task not in TASKS:
    raise UserError(f"Unknown eval.task {task!r:.200}; valid tasks: "
                    f"{', '.join(repr(t) for t in TASKS)}.")
  return TASKS[task](run_dir=run_dir)

"""Task evaluations: `python runners/eval.py [--gin_file=gin/experiments/eval_humaneval.gin]`.

Runs a task (eval.job: @humaneval, or @retrieval: long-context UUID key-value
retrieval scored teacher-forced, gin/experiments/eval_retrieval.gin) under each precision
preset of the decode phase (the fp32/HIGHEST reference first) and writes, into --run_dir,
one record per item as it finishes (items.jsonl: a rerun resumes where a killed one
stopped), then results.json, results.md and a plot: accuracy with Wilson 95% intervals
per preset, the paired tables with exact McNemar p-values against the reference and
against bf16 (per prompt length for retrieval), token identity with the reference and
tokens/s (HumanEval). Model-written code runs only in the sandbox
(attnprec.evals.sandbox). Exit codes: 0 done, 2 bad input (or logits that were not
finite), 1 a crash, 130/143 interrupted (the records written so far are kept).
"""
import sys

from attnprec import startup

startup.begin("eval", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, compilation, ginutils  # noqa: E402
from attnprec.evals.jobs import eval_job  # noqa: E402

EXAMPLES = [
    "python runners/eval.py --gin_file=gin/experiments/eval_humaneval.gin",
    "python runners/eval.py --gin_file=gin/experiments/eval_humaneval.gin "
    "--gin.humaneval.problems=16 --gin.humaneval.presets=\"('bf16',)\" --run_dir=runs/he16",
    "python runners/eval.py --gin_file=gin/experiments/eval_retrieval.gin "
    "--gin.retrieval.lengths=\"(1024,)\" --gin.retrieval.contexts=1 "
    "--gin.retrieval.questions=8 --run_dir=runs/ret_smoke",
]


def run(run_dir: str):
  compilation.enable()  # programs compiled by one run are loaded by the next
  return ginutils.call(eval_job, run_dir=run_dir)


def main(argv) -> int:
  return cli.main(argv, prog="eval", doc=__doc__, examples=EXAMPLES,
                  default_files=["runs/eval.gin"], default_run_dir="runs/eval",
                  reads=("eval",), keep_partial=True, body=run)


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

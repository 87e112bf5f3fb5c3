"""Inspect: `python runners/inspect_model.py --gin.inspect.fn=package.module:function [...]`.

Lowers the function on its example inputs, finds every attention in the program by its
structure and reports the precision each really runs in; with a Precision stated (a
gin/precision/ file), checks it against the contract. Exit code 0: nothing flagged, 3: a
mismatch or a down-cast before a softmax (as the audit), 2: bad input, 1: a crash
(attnprec.cli). Writes inspect.json and
inspect.md into --run_dir. --platform=tpu / cuda: lowered for that backend on this machine,
its dots read under that platform's precision semantics (attnprec/platforms.py).
"""
import sys

from attnprec import startup

startup.begin("inspect", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

# (Not runners/inspect.py: a script's directory comes first on sys.path, and a file named
# inspect.py there would shadow the standard library's `inspect` for every runner.)
from attnprec import cli, ginutils  # noqa: E402
from attnprec.inspect.job import inspect_job  # noqa: E402


EXAMPLES = [
    "python runners/inspect_model.py --gin.inspect.fn=attnprec.inspect.examples:maxtext_attention "
    "--gin.inspect.inputs=attnprec.inspect.examples:maxtext_inputs",
    "python runners/inspect_model.py --gin.inspect.fn=mypkg.model:attention "
    "--gin.inspect.shapes='bf16[2,8,64]' --gin_file=gin/precision/bf16.gin",
    "python runners/inspect_model.py --gin.inspect.fn=attnprec.inspect.examples:maxtext_attention "
    "--gin.inspect.inputs=attnprec.inspect.examples:maxtext_inputs --platform=tpu",
]


def add_options(parser):
  parser.add_argument("--platform", default="cpu", metavar="NAME",
                      help="lower for this platform: cpu, tpu or cuda (attnprec/platforms.py)")


def main(argv) -> int:
  outcome = {}

  def run(run_dir: str, platform: str):
    outcome["ok"] = ginutils.call(inspect_job, run_dir=run_dir, platform=platform).ok

  rc = cli.main(argv, prog="inspect", doc=__doc__, examples=EXAMPLES,
                default_files=["runs/inspect.gin"], default_run_dir="runs/inspect", body=run,
                reads=("inspect", "decode/precision", "train/precision"),
                options=add_options)
  # no outcome: --help, or a failure (rc != 0)
  return cli.EXIT_MISMATCH if rc == 0 and not outcome.get("ok", True) else rc


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

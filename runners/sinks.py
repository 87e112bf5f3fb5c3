"""Sinks: `python runners/sinks.py [--gin_file=...] [--gin.sinks.length=512]`.

Why the first token matters for bf16 attention (`attnprec.study.sinks`): per layer, the
attention logit magnitudes (the sink's, the shared offset, q . b_k), the kernel's own
error under each preset with and without centred keys, the q/k/v bias norms, and which
layer's attention error reaches the output. Writes sinks.json, report.md and PNG plots
into --run_dir. Exit code 2 on bad input.
"""
import sys

from attnprec import startup

startup.begin("sinks", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, ginutils  # noqa: E402
from attnprec.study.sinks import sinks_job  # noqa: E402


EXAMPLES = [
    "python runners/sinks.py",
    "python runners/sinks.py --gin.sinks.length=512 --run_dir=runs/sinks_512",
]


def main(argv) -> int:
  return cli.main(argv, prog="sinks", doc=__doc__, examples=EXAMPLES,
                  default_files=["runs/sinks.gin"],
                  default_run_dir="runs/sinks", reads=("sinks",),
                  body=lambda run_dir: ginutils.call(sinks_job, run_dir=run_dir))


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

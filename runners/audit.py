"""Audit: `python runners/audit.py --gin_file=gin/precision/bf16.gin [...]`.

Lowers and compiles the train step under the train phase's precision and the prefill and
single-token decode step under the decode phase's, lists every dot and checks the
attention and dense dots against the precision contract, in the lowered program and in
what the backend compiled (`--gin.audit.compile=False`: the lowered program only). Exit
code 0: PASS, 3: a mismatch, 2: bad input, 1: a crash (attnprec.cli). Writes audit.json
and audit.md into --run_dir.

--platform=tpu / cuda lowers the programs for that backend on this machine and reads every
dot under its precision semantics (attnprec/platforms.py); the compiled checks need the
backend itself and are skipped, with a sentence saying so. Default: cpu.
"""
import sys

from attnprec import startup

startup.begin("audit", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

from attnprec import cli, ginutils, platforms  # noqa: E402
from attnprec.audit import audit_job  # noqa: E402
from attnprec.precision import phase_precision  # noqa: E402


EXAMPLES = [
    "python runners/audit.py --gin_file=gin/precision/bf16.gin; echo $?   # 0 PASS, 3 MISMATCH",
    "python runners/audit.py --gin_file=gin/experiments/audit_qwen2.gin --run_dir=runs/audit_qwen2",
    "python runners/audit.py --gin_file=gin/precision/highest.gin --platform=cuda",
]


def add_options(parser):
  parser.add_argument("--platform", default="cpu", metavar="NAME",
                      help="lower for this platform: cpu, tpu or cuda (attnprec/platforms.py)")


def main(argv) -> int:
  outcome = {}

  def run(run_dir: str, platform: str):
    platforms.check(platform)   # before anything runs
    with ginutils.phase("train"):
      train_precision = ginutils.call(phase_precision)
    with ginutils.phase("decode"):
      decode_precision = ginutils.call(phase_precision)
    for p in (train_precision, decode_precision):
      platforms.check_precision(platform, p)
    result = ginutils.call(audit_job, train_precision=train_precision,
                           decode_precision=decode_precision, run_dir=run_dir,
                           platform=platform)
    outcome["ok"] = result["ok"]

  rc = cli.main(argv, prog="audit", doc=__doc__, examples=EXAMPLES,
                default_files=["runs/audit.gin"], default_run_dir="runs/audit", body=run,
                reads=("train/precision", "decode/precision", "audit"), options=add_options)
  # no outcome: --help, or a failure (rc != 0)
  return cli.EXIT_MISMATCH if rc == 0 and not outcome.get("ok", True) else rc


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

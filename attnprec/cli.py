"""What the thin runners share: flags -> gin -> checks -> a job, and one error path.

Exit codes of every runner (`runners/*.py`):
  0  success (audit: PASS)
  1  a crash: a bug in attnprec, with its traceback
  2  bad input: one paragraph on stderr naming the bad value and the valid ones
  3  audit only: the compiled programs do not follow the precision contract (MISMATCH)
  130 interrupted (Ctrl-C)
"""
import argparse
import os
import sys
from typing import Callable, Optional, Sequence

from attnprec import ginutils, runs
from attnprec.errors import UserError

EXIT_OK, EXIT_CRASH, EXIT_USER_ERROR, EXIT_MISMATCH, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose errors are UserErrors (one paragraph, exit 2 through `run`), never a
  SystemExit from inside a library call."""

  def error(self, message):
    raise UserError(f"{message}. Usage: {self.format_usage().strip()[len('usage: '):]}")


def run(prog: str, body: Callable[[], object], *, output_dir: Optional[str] = None) -> int:
  """Runs body() with the one error path every runner shares: a UserError is printed as
  `prog: error: <paragraph>` with exit code 2 and no traceback; Ctrl-C gives 130. If
  `output_dir` did not exist before and the run fails, it is removed again when it holds
  no file, so a failed load leaves no empty run directory behind."""
  existed = output_dir is None or os.path.lexists(output_dir)
  try:
    body()
    return EXIT_OK
  except UserError as e:
    _print_error(prog, e)
    rc = EXIT_USER_ERROR
  except KeyboardInterrupt:
    print(f"{prog}: interrupted", file=sys.stderr)
    rc = EXIT_INTERRUPTED
  except SystemExit as e:   # argparse --help
    return e.code if isinstance(e.code, int) else EXIT_OK
  except BaseException:
    if not existed:
      runs.remove_if_empty(output_dir)
    raise
  if not existed:
    runs.remove_if_empty(output_dir)
  return rc


def _print_error(prog: str, e: UserError) -> None:
  # gin appends "In call to configurable ..." lines to errors raised inside
  # configurables; the user's paragraph is what comes before them.
  message = str(e).split("\n  In call to configurable")[0]
  message = " ".join(message.split())
  print(f"{prog}: error: {message}", file=sys.stderr)


def main(argv: Sequence[str], *, prog: str, default_files: Sequence[str],
         default_run_dir: str, body: Callable[[str], object],
         reads: Optional[Sequence[str]] = None) -> int:
  """Parses `--gin_file/--gin_bindings/--gin.X=V` and `--run_dir`, checks the whole
  configuration and the run directory, then runs body(run_dir) (see `run`).

  `reads`: the configurables the runner calls itself (`phase/precision` for the phase
  precision it reads); gin's config and the command line's bindings are checked against
  them (`ginutils.check_config`, `ginutils.check_command_line`). None: only the config.
  """
  def parse_then_body():
    files, bindings, rest = ginutils.split_flags(argv)
    parser = ArgumentParser(prog=prog, description=__doc__, allow_abbrev=False)
    parser.add_argument("--run_dir", default=default_run_dir,
                        help="where outputs are written (default: %(default)s)")
    args, unknown = parser.parse_known_args(rest)
    if unknown:
      raise UserError(f"Unknown argument(s) {unknown}; valid: --gin_file=PATH, "
                      f"--gin_bindings='NAME=VALUE', --gin.NAME=VALUE, --run_dir=DIR.")
    ginutils.parse(list(default_files) + files, bindings, reads=reads, prog=prog)
    runs.check_output_dir(args.run_dir, flag="--run_dir")
    body(args.run_dir)

  run_dir = _run_dir_flag(argv, default_run_dir)
  return run(prog, parse_then_body, output_dir=run_dir)


def _run_dir_flag(argv: Sequence[str], default: str) -> str:
  """The --run_dir a command line names (the last one), before full parsing."""
  run_dir = default
  args = list(argv)
  for i, a in enumerate(args):
    if a.startswith("--run_dir="):
      run_dir = a.split("=", 1)[1]
    elif a == "--run_dir" and i + 1 < len(args):
      run_dir = args[i + 1]
  return run_dir


def repo_root() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

"""What the thin runners share: flags -> gin -> a job, with user errors as exit code 2."""
import argparse
import os
import sys
from typing import Callable, Sequence

from attnprec import ginutils
from attnprec.errors import UserError


def main(argv: Sequence[str], *, prog: str, default_files: Sequence[str],
         default_run_dir: str, body: Callable[[str], object]) -> int:
  """Parses `--gin_file/--gin_bindings/--gin.X=V` and `--run_dir`, then runs body(run_dir).

  Every UserError (bad flag, bad gin value, missing file, ...) is printed as one paragraph
  on stderr with exit code 2 and no traceback.
  """
  try:
    files, bindings, rest = ginutils.split_flags(argv)
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("--run_dir", default=default_run_dir,
                        help="where outputs are written (default: %(default)s)")
    args, unknown = parser.parse_known_args(rest)
    if unknown:
      raise UserError(f"Unknown argument(s) {unknown}; valid: --gin_file=PATH, "
                      f"--gin_bindings='NAME=VALUE', --gin.NAME=VALUE, --run_dir=DIR.")
    ginutils.parse(list(default_files) + files, bindings)
    body(args.run_dir)
    return 0
  except UserError as e:
    # gin appends "In call to configurable ..." lines to errors raised inside
    # configurables; the user's paragraph is what comes before them.
    message = str(e).split("\n  In call to configurable")[0]
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{prog}: interrupted", file=sys.stderr)
    return 130


def repo_root() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

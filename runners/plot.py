"""Plot a run's curves: `python runners/plot.py --run_dir=runs/recall` (or `make plot RUN=...`).

Reads run_dir/metrics.jsonl and writes run_dir/metrics.png (train and held-out eval loss
and accuracy). Errors (no such run, no metrics yet) exit with code 2.
"""
import argparse
import sys

from attnprec.errors import UserError
from attnprec.plotting import plot_run


def main(argv) -> int:
  parser = argparse.ArgumentParser(prog="plot", description=__doc__)
  parser.add_argument("--run_dir", default="runs/recall", help="default: %(default)s")
  args = parser.parse_args(argv)
  try:
    print(f"wrote {plot_run(args.run_dir)}")
    return 0
  except UserError as e:
    print(f"plot: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""Plot a run's curves: `python runners/plot.py --run_dir=runs/recall` (or `make plot RUN=...`).

Reads run_dir/metrics.jsonl and writes run_dir/metrics.png (train and held-out eval loss
and accuracy). It reads no gin files: --run_dir is its only option. Exit codes: 0 done,
2 bad input (no such run, no metrics yet, a run directory that cannot be written), 1 a
crash (attnprec.cli).
"""
import sys

from attnprec import startup

startup.begin("plot", __name__)  # Ctrl-C from here on: one line, exit 130

from attnprec import cli, runs  # noqa: E402
from attnprec.plotting import plot_run  # noqa: E402


EXAMPLES = [
    "python runners/plot.py --run_dir=runs/recall   # writes runs/recall/metrics.png",
    "make plot RUN=runs/text",
]


def main(argv) -> int:
  def body():
    parser = cli.ArgumentParser(prog="plot", doc=__doc__, examples=EXAMPLES)
    parser.add_argument("--run_dir", default="runs/recall", metavar="DIR",
                        help="the train run directory to plot")
    args = parser.parse_args(argv)
    runs.check_output_dir(args.run_dir)
    print(f"wrote {plot_run(args.run_dir)}")

  return cli.run("plot", body)


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))

"""Plots: the one way the project makes and writes a figure, and the training curves.

`pyplot()` gives matplotlib's pyplot on the Agg backend (no display needed);
`save_figure(fig, path)` lays the figure out, writes the PNG atomically (a temporary file,
then a rename: a killed run never leaves half a PNG) and closes it. Every plot in the
project (train curves, study, sinks, next-line, benches) goes through these two.

Training curves, run_dir/metrics.jsonl -> run_dir/metrics.png. Left: train loss (every
logged step) and held-out eval loss (every eval). Right: train and eval token accuracy.
Written at the end of every training run and by `make plot RUN=...`.
"""
import os
from typing import Dict, List

from attnprec import runs
from attnprec.errors import UserError

PLOT_FILE = "metrics.png"


def pyplot():
  """matplotlib.pyplot on the Agg backend."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def save_figure(fig, path: str, dpi: int = 120) -> str:
  """tight_layout, an atomic PNG write to `path`, close; returns `path`."""
  import matplotlib.pyplot as plt
  try:
    fig.tight_layout()
    runs.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi), mode="wb")
  finally:
    plt.close(fig)
  return path


def read_metrics(run_dir: str) -> List[Dict]:
  """The records of run_dir/metrics.jsonl (`runs.read_metrics`: each line checked; a
  last line cut short by a kill is skipped)."""
  path = os.path.join(run_dir, "metrics.jsonl")
  runs.check_owner(run_dir, ("train",), "plot (a train run's metrics.png)")
  if os.path.lexists(path) and not os.path.isfile(path):
    raise UserError(f"{path} is not a regular file; plot reads a train run's metrics "
                    f"from it. Remove it, or pass another run directory.")
  if not os.path.isfile(path):
    raise UserError(f"{run_dir!r} has no metrics.jsonl; train into it first "
                    f"(make train ARGS=--run_dir={run_dir}).")
  records, _ = runs.read_metrics(path)      # every line checked
  if not records:
    raise UserError(f"{path} holds no metrics yet (fewer steps than train.log_every?).")
  if not any("loss" in r or "eval_loss" in r for r in records):
    raise UserError(f"{path} holds no 'loss' in any of its {len(records)} records: not a "
                    f"training's metrics (a training logs its loss every train.log_every "
                    f"steps), so the plot would be empty.")
  return records


def _series(records, key):
  pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
  return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(run_dir: str) -> str:
  """Writes run_dir/metrics.png atomically and returns its path."""
  plt = pyplot()
  records = read_metrics(run_dir)
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
  for ax, key, label in ((ax_loss, "loss", "loss (nats/token)"),
                         (ax_acc, "accuracy", "token accuracy")):
    for prefix, style, name in (("", "-", "train"), ("eval_", "o-", "held-out eval")):
      steps, values = _series(records, prefix + key)
      if steps:
        ax.plot(steps, values, style, label=name, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend()
  losses = [v for k in ("loss", "eval_loss") for v in _series(records, k)[1] if v and v > 0]
  if losses and max(losses) / min(losses) > 10:
    ax_loss.set_yscale("log")   # decades only: long runs span several
  fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
  return save_figure(fig, os.path.join(run_dir, PLOT_FILE), dpi=100)

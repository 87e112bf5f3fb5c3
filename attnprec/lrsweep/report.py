"""The LR sweep's report: LR sensitivity with bootstrap intervals, plots, report.md.

LR sensitivity (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
training instabilities", arXiv 2309.14322) of one setting, size and seed over the grid of
learning rates eta_1..eta_n:

    sensitivity = mean_i min(l(eta_i), l_0) - min_i l(eta_i)

with l the final held-out loss, l_0 the loss at initialization, and a diverged run (a
non-finite step) counted as l_0. Per setting and size it is averaged over seeds.

Intervals: a paired bootstrap (B = 2000, seed 0) that resamples the held-out sequences
(the same draw for every run: each loss is a mean over them) and the seeds (the same draw
for both settings of a difference: runs of one seed share init and batches). The 95%
interval is the 2.5 / 97.5 percentiles. A difference between two settings is claimed
only where its interval excludes zero and both settings ran the same MIN_SEEDS or more
seeds; otherwise it is reported as no difference (or, from one seed, not claimed: its
interval holds the held-out sequences' noise, not the seeds').

A run is *unstable* when it diverged or its final loss exceeds its curve's best by more
than UNSTABLE_FRACTION of (l_0 - best): the logit growth curves are drawn at the highest
stable and the first unstable learning rate of the seed-mean curve.

Order of claims (the issue's rule): the qk-norm result is checked first. Only if qk-norm
lowers the sensitivity at some size (interval below zero) are the flags' differences
stated as findings; otherwise the report says so and stops there.
"""
import math
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from attnprec import plotting, readback, runs
from attnprec.errors import UserError

UNSTABLE_FRACTION = 0.1
MIN_SEEDS = 2          # a difference is claimed only from at least this many paired seeds
BOOTSTRAP = 2000
COMPARISONS = (("qk_norm", "bf16"), ("both", "bf16"), ("fp32", "bf16"), ("both", "fp32"),
               ("qk_norm_both", "qk_norm"), ("qk_norm_both", "both"))


def _bad(path: str, what: str) -> UserError:
  return UserError(f"{path} is not an LR sweep result we read: {what}. Delete it (its group "
                   f"trains again) or restore it.")


def read_result(path: str) -> dict:
  """result.json of a group, its schema checked (a tampered or truncated file is named)."""
  try:
    with open(path, "rb") as f:
      raw = f.read().decode("utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise _bad(path, f"cannot be read as UTF-8 text ({e})") from None
  obj, why = readback.loads(raw)
  if why:
    raise _bad(path, why)
  if not isinstance(obj, dict):
    raise _bad(path, "not a JSON object")
  for key in ("size", "setting", "spec", "members", "diverged_at", "eval", "provenance",
              "timing"):
    if key not in obj:
      raise _bad(path, f"no {key!r}")
  timing = obj["timing"]
  if not isinstance(timing, dict) or not (
      timing.get("tokens_per_s") is None
      or (readback.is_finite_number(timing["tokens_per_s"]) and timing["tokens_per_s"] > 0)):
    raise _bad(path, "'timing' is not an object with a positive tokens_per_s (or null)")
  members = obj["members"]
  if not isinstance(members, list) or not members or not all(
      isinstance(m, dict) and readback.is_int(m.get("seed"))
      and readback.is_finite_number(m.get("lr")) and m["lr"] > 0 for m in members):
    raise _bad(path, "'members' is not a list of {seed, lr}")
  spec = obj["spec"]
  if not isinstance(spec, dict):
    raise _bad(path, "'spec' is not an object")
  want = [[spec.get("seed"), lr] for lr in spec.get("lrs", [])]
  if not readback.is_int(spec.get("seed")) or [[m["seed"], m["lr"]] for m in members] != want:
    raise _bad(path, "its members are not its spec's seed x learning rates")
  M = len(members)
  dv = obj["diverged_at"]
  if not isinstance(dv, list) or len(dv) != M or not all(
      d is None or (readback.is_int(d) and 1 <= d <= spec.get("steps", 0)) for d in dv):
    raise _bad(path, "'diverged_at' is not one step or null per member")
  # A member that did not diverge has finite figures (a diverged one keeps its last
  # finite parameters, so its figures are finite too; only they may be NaN or inf).
  def number_ok(x, m):
    return readback.is_finite_number(x) or (readback.is_number(x) and dv[m] is not None)

  ev = obj["eval"]
  if not isinstance(ev, list) or len(ev) < 2:
    raise _bad(path, "fewer than two evaluations")
  last = -1
  for e in ev:
    if not isinstance(e, dict) or not readback.is_int(e.get("step")) or e["step"] <= last:
      raise _bad(path, "evaluation steps are not increasing integers")
    last = e["step"]
    for key in ("loss", "lse"):
      if not isinstance(e.get(key), list) or len(e[key]) != M or not all(
          number_ok(x, m) for m, x in enumerate(e[key])):
        raise _bad(path, f"evaluation at step {e['step']}: {key!r} is not {M} finite "
                         f"numbers")
    ml = e.get("max_logit")
    if not isinstance(ml, list) or len(ml) != M or not all(
        isinstance(r, list) and r and all(number_ok(x, m) for x in r)
        for m, r in enumerate(ml)):
      raise _bad(path, f"evaluation at step {e['step']}: 'max_logit' is not {M} lists of "
                       f"finite numbers")
  if not all(readback.is_finite_number(x) for x in ev[0]["loss"]):
    raise _bad(path, "a loss at step 0 (before any training) is not finite")
  if ev[0]["step"] != 0 or ev[-1]["step"] != spec.get("steps"):
    raise _bad(path, "its evaluations do not start at step 0 and end at its last step")
  for e in (ev[0], ev[-1]):
    sl = e.get("seq_loss")
    if not isinstance(sl, list) or len(sl) != M or not all(
        isinstance(r, list) and len(r) == spec.get("eval_batch") and all(
            number_ok(x, m) for x in r) for m, r in enumerate(sl)):
      raise _bad(path, f"evaluation at step {e['step']}: 'seq_loss' is not {M} x "
                       f"{spec.get('eval_batch')} finite numbers")
    for m in range(M):
      mean = float(np.mean(sl[m]))
      if not (math.isnan(mean) and math.isnan(e["loss"][m])) and \
          abs(mean - e["loss"][m]) > 1e-4 * max(1.0, abs(mean)):
        raise _bad(path, f"evaluation at step {e['step']}: member {m}'s loss "
                         f"{e['loss'][m]} is not the mean of its sequences' losses ({mean})")
  return obj


def sensitivity(final_N, init_N, diverged_N) -> float:
  """LR sensitivity of one curve (module docstring); arrays over the LR grid. NaN when no
  run of the curve learned (every one diverged or ended at or above l_0): its sensitivity
  would read 0, a perfectly flat curve, from runs that all failed."""
  final = np.where(np.asarray(diverged_N) | ~np.isfinite(final_N), init_N, final_N)
  capped = np.minimum(final, init_N)
  if not np.any(capped < init_N):
    return float("nan")
  return float(np.mean(capped) - np.min(capped))


class Curves:
  """One (size, setting) over its seeds: per-sequence init / final losses [S, N, E]."""

  def __init__(self, seed_results: Sequence[dict]):
    seed_results = sorted(seed_results, key=lambda r: r["spec"]["seed"])
    self.seeds = [r["spec"]["seed"] for r in seed_results]
    self.lrs = list(seed_results[0]["spec"]["lrs"])
    if any(list(r["spec"]["lrs"]) != self.lrs for r in seed_results):
      raise UserError("The seeds' groups of one setting have different learning rates.")
    self.init = np.asarray([r["eval"][0]["seq_loss"] for r in seed_results], np.float64)
    self.final = np.asarray([r["eval"][-1]["seq_loss"] for r in seed_results], np.float64)
    self.diverged = np.asarray([[d is not None for d in r["diverged_at"]]
                                for r in seed_results])
    self.steps = [e["step"] for e in seed_results[0]["eval"]]
    # [S, N, evals, layers]
    self.max_logit = np.asarray([[e["max_logit"] for e in r["eval"]] for r in seed_results],
                                np.float64).transpose(0, 2, 1, 3)
    self.lse = np.asarray([[e["lse"] for e in r["eval"]] for r in seed_results],
                          np.float64).transpose(0, 2, 1)

  def subset(self, seeds: Sequence[int]) -> "Curves":
    """The same curves restricted to `seeds` (a comparison uses the seeds both have)."""
    out = object.__new__(Curves)
    idx = [self.seeds.index(s) for s in seeds]
    out.__dict__.update(self.__dict__)
    out.seeds = list(seeds)
    for name in ("init", "final", "diverged", "max_logit", "lse"):
      setattr(out, name, getattr(self, name)[idx])
    return out

  def sens(self, seeds_idx=None, seq_idx=None) -> np.ndarray:
    """Per drawn seed: the sensitivity over the drawn sequences."""
    seeds_idx = range(len(self.seeds)) if seeds_idx is None else seeds_idx
    out = []
    for s in seeds_idx:
      fin = self.final[s] if seq_idx is None else self.final[s][:, seq_idx]
      ini = self.init[s] if seq_idx is None else self.init[s][:, seq_idx]
      out.append(sensitivity(fin.mean(-1), ini.mean(-1), self.diverged[s]))
    return np.asarray(out)

  def final_mean(self) -> np.ndarray:
    """[S, N] final loss, diverged -> l_0, capped at l_0."""
    fin, ini = self.final.mean(-1), self.init.mean(-1)
    return np.minimum(np.where(self.diverged | ~np.isfinite(fin), ini, fin), ini)

  def unstable(self) -> np.ndarray:
    """[N] on the seed-mean curve (module docstring)."""
    fm = self.final_mean().mean(0)
    l0 = self.init.mean(-1).mean(0)
    best = fm.min()
    return self.diverged.any(0) | (fm > best + UNSTABLE_FRACTION * (l0 - best))


def bootstrap(curves_a: Curves, curves_b: Optional[Curves], *, draws: int = BOOTSTRAP,
              seed: int = 0):
  """(point, lo, hi): mean over seeds of sens(a) [- sens(b)], with its 95% interval."""
  rng = np.random.default_rng(seed)
  S, E = len(curves_a.seeds), curves_a.final.shape[-1]

  def stat(si=None, qi=None):
    v = curves_a.sens(si, qi)
    if curves_b is not None:
      v = v - curves_b.sens(si, qi)
    return float(np.mean(v))

  point = stat()
  if not np.isfinite(point):     # a curve where no run learned: nothing to state
    return None, None, None
  values = [stat(rng.integers(0, S, S), rng.integers(0, E, E)) for _ in range(draws)]
  lo, hi = np.percentile(values, [2.5, 97.5])
  if not (np.isfinite(lo) and np.isfinite(hi)):
    return None, None, None
  return point, float(lo), float(hi)


def load_results(run_dir: str, plan) -> Dict[str, Dict[str, List[dict]]]:
  """{size: {setting: [result of each finished seed]}} of the plan's groups in run_dir."""
  out: Dict[str, Dict[str, List[dict]]] = {}
  for size, setting, seed in plan.groups():
    path = os.path.join(run_dir, size, setting, f"seed{seed}", "result.json")
    if os.path.exists(path):
      out.setdefault(size, {}).setdefault(setting, []).append(read_result(path))
  return out


def analyze(results: Dict[str, Dict[str, dict]], *, draws: int = BOOTSTRAP) -> dict:
  sizes = {}
  for size, per in results.items():
    curves = {name: Curves(r) for name, r in per.items()}
    entry = {"settings": {}, "differences": []}
    for name, c in curves.items():
      point, lo, hi = bootstrap(c, None, draws=draws)
      unstable = c.unstable()
      stable_lrs = [lr for lr, u in zip(c.lrs, unstable) if not u]
      entry["settings"][name] = {
          "lrs": c.lrs, "seeds": c.seeds,
          "final_loss": c.final_mean().mean(0).tolist(),
          "final_loss_per_seed": c.final_mean().tolist(),
          "init_loss": float(c.init.mean()),
          "diverged": c.diverged.sum(0).tolist(),
          "unstable": unstable.tolist(),
          "best_loss": float(c.final_mean().mean(0).min()),
          "best_lr": c.lrs[int(np.argmin(c.final_mean().mean(0)))],
          "highest_stable_lr": max(stable_lrs) if stable_lrs else None,
          "sensitivity": point, "interval": [lo, hi],
          "sensitivity_per_seed": [None if not np.isfinite(v) else v
                                   for v in c.sens().tolist()],
          "max_logit": np.nanmax(c.max_logit, axis=(2, 3)).mean(0).tolist(),
          "final_lse": c.lse[:, :, -1].mean(0).tolist(),
          "tokens_per_s": per[name][0]["timing"].get("tokens_per_s"),
          "precision_line": per[name][0].get("precision_line"),
      }
    for a, b in COMPARISONS:
      common = [s for s in curves[a].seeds if s in curves[b].seeds] \
          if a in curves and b in curves else []
      if common and curves[a].lrs == curves[b].lrs:
        point, lo, hi = bootstrap(curves[a].subset(common), curves[b].subset(common),
                                  draws=draws)
        entry["differences"].append({
            "a": a, "b": b, "difference": point, "interval": [lo, hi],
            "verdict": ("not claimed: no run of a curve learned" if point is None else
                        "not claimed: one seed" if len(common) < MIN_SEEDS else
                        "lower" if hi < 0 else "higher" if lo > 0 else "no difference"),
            "seeds": common})
    sizes[size] = entry
  qk = [(s, d) for s, e in sizes.items() for d in e["differences"]
        if (d["a"], d["b"]) == ("qk_norm", "bf16")]
  reproduced = any(d["verdict"] == "lower" for _, d in qk)
  return {"sizes": sizes, "qk_norm_reproduced": reproduced if qk else None,
          "bootstrap": {"draws": draws, "level": 0.95,
                        "resamples": "held-out sequences and seeds (paired)"},
          "unstable_fraction": UNSTABLE_FRACTION}


def _fmt(x, spec=".3f"):
  return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def markdown(analysis: dict, plan) -> str:
  lines = ["# LR sensitivity: attention precision in training", "",
           f"Byte-level models on CPython 3.11's standard-library sources "
           f"(`attnprec.lrsweep.corpus`); {plan.steps} steps of {plan.batch} x "
           f"{plan.seq_len} tokens, warm-up {plan.warmup}, cosine to {plan.end_lr:g}; "
           f"AdamW b1={plan.b1} b2={plan.b2} eps={plan.eps:g}, clip {plan.clip_norm}, "
           f"independent weight decay {plan.weight_decay:g}; z-loss {plan.z_loss:g}; "
           f"kernel {plan.kernel}; "
           f"seeds as listed per setting; remat {plan.remat}; held-out loss on "
           f"{plan.eval_batch} sequences.", ""]
  rep = analysis["qk_norm_reproduced"]
  if rep is None:
    lines += ["**qk-norm check:** not run (the plan lacks 'bf16' or 'qk_norm'); no claim "
              "about the flags is made.", ""]
  elif rep:
    lines += ["**qk-norm check: reproduced.** qk-norm lowers LR sensitivity (95% interval "
              "below zero) at least at one size, as in the paper; the flags' differences "
              "below are findings.", ""]
  else:
    lines += ["**qk-norm check: not reproduced.** qk-norm does not lower LR sensitivity "
              "with an interval below zero at any size here, so this sweep does not "
              "reproduce the paper's result, and no claim about the flags is made from "
              "it (the differences below are shown, not claimed).", ""]
  for size, entry in analysis["sizes"].items():
    lrs = next(iter(entry["settings"].values()))["lrs"]
    lines += [f"## {size}", "",
              "Final held-out loss (nats per byte; mean over seeds; a diverged run "
              "counts as l_0, marked *):", "",
              "| setting | seeds | " + " | ".join(f"{lr:g}" for lr in lrs) +
              " | sensitivity [95%] | max attn logit at top LR | tokens/s |",
              "|---|---|" + "---:|" * (len(lrs) + 3)]
    for name, s in entry["settings"].items():
      cells = [_fmt(v) + ("*" if d else "") for v, d in zip(s["final_loss"], s["diverged"])]
      lo, hi = s["interval"]
      sens = ("– (no run learned)" if s["sensitivity"] is None else
              f"{s['sensitivity']:.3f} [{lo:.3f}, {hi:.3f}]")
      lines.append(f"| {name} | {','.join(map(str, s['seeds']))} | " + " | ".join(cells) +
                   f" | {sens} | "
                   f"{_fmt(s['max_logit'][-1], '.3g')} | {s['tokens_per_s']} |")
    lines += ["", "Largest attention logit over training (mean over seeds):", "",
              "| setting | " + " | ".join(f"{lr:g}" for lr in lrs) + " |",
              "|---|" + "---:|" * len(lrs)]
    for name, s in entry["settings"].items():
      lines.append(f"| {name} | " + " | ".join(_fmt(v, ".3g") for v in s["max_logit"]) + " |")
    lines += ["", "Output logit drift: mean log Z of the output logits at the end (mean over "
              "seeds; z-loss pulls it toward 0):", "",
              "| setting | " + " | ".join(f"{lr:g}" for lr in lrs) + " |",
              "|---|" + "---:|" * len(lrs)]
    for name, s in entry["settings"].items():
      lines.append(f"| {name} | " + " | ".join(_fmt(v, ".2f") for v in s["final_lse"]) + " |")
    if entry["differences"]:
      lines += ["", "Differences in LR sensitivity (a - b; paired bootstrap):", "",
                "| a | b | difference | 95% interval | verdict |", "|---|---|---:|---|---|"]
      for d in entry["differences"]:
        lo, hi = d["interval"]
        shown = ("– | –" if d["difference"] is None else
                 f"{d['difference']:+.3f} | [{lo:+.3f}, {hi:+.3f}]")
        lines.append(f"| {d['a']} | {d['b']} | {shown} | {d['verdict']} |")
    lines.append("")
  return "\n".join(lines)


def plot(analysis: dict, results, run_dir: str) -> List[str]:
  plt = plotting.pyplot()
  paths = []
  sizes = list(analysis["sizes"])
  fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
  for ax, size in zip(axes[0], sizes):
    for name, s in analysis["sizes"][size]["settings"].items():
      line, = ax.plot(s["lrs"], s["final_loss"], marker="o", label=name)
      for lr, v, d in zip(s["lrs"], s["final_loss"], s["diverged"]):
        if d:
          ax.plot([lr], [v], marker="x", color=line.get_color(), markersize=10)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("final held-out loss (nats/byte)")
    ax.set_title(f"{size}")
    ax.legend(fontsize=8)
  paths.append(plotting.save_figure(fig, os.path.join(run_dir, "lr_sensitivity.png")))
  fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
  for ax, size in zip(axes[0], sizes):
    for k, (name, r) in enumerate(results[size].items()):
      color = f"C{k}"
      c = Curves(r)
      unstable = c.unstable()
      stable = [i for i, u in enumerate(unstable) if not u]
      first_bad = next((i for i, u in enumerate(unstable)
                        if u and stable and i > max(stable)), None)
      for i, style in ((max(stable) if stable else None, "-"), (first_bad, "--")):
        if i is None:
          continue
        growth = np.nanmax(c.max_logit[:, i], axis=-1).mean(0)
        ax.plot(c.steps, growth, style, color=color,
                label=f"{name} lr={c.lrs[i]:g} ({'stable' if style == '-' else 'unstable'})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("largest attention logit")
    ax.set_title(f"{size}: logit growth")
    ax.legend(fontsize=6)
  paths.append(plotting.save_figure(fig, os.path.join(run_dir, "logit_growth.png")))
  return paths


def write_report(run_dir: str, plan, *, draws: int = BOOTSTRAP) -> dict:
  """report.json (provenance), report.md and the two plots from the finished groups."""
  results = load_results(run_dir, plan)
  if not results:
    raise UserError(f"{run_dir} holds no finished group of this plan; nothing to report.")
  analysis = analyze(results, draws=draws)
  text = markdown(analysis, plan)
  names = ("report.json", "report.md", "lr_sensitivity.png", "logit_growth.png")
  try:
    runs.write_json(run_dir, "report.json", analysis, provenance=True)
    runs.atomic_write(os.path.join(run_dir, "report.md"), text + "\n")
    plot(analysis, results, run_dir)
  except BaseException:
    # An interrupted or failed report leaves no part of itself: the set is whole or absent
    # (a rerun writes it from the finished groups).
    for name in names:
      path = os.path.join(run_dir, name)
      if os.path.exists(path):
        os.remove(path)
    raise
  print(text)
  return analysis

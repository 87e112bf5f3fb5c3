"""Scoring a task evaluation's records: one table per task, the same statistics for all.

Input: {preset: {item: record}} where a record holds `correct` (bool), `finite` (bool: its
logits were finite) and, for generation tasks, `tokens` (the decoded token ids). Items
whose logits were not finite are reported (counted per preset) and never scored or
compared. Per preset: accuracy with a Wilson 95% interval; against the reference and
against `baseline` (bf16, the seed's serving setup), over the items both have: the paired
table (both / only A / only B / neither), the exact McNemar p-value and the smallest
difference the sample could have detected (80% power, alpha 0.05, at the observed share
of discordant pairs); for generation, the share of items whose tokens are identical to
the reference's and the median index of the first differing token.
"""
import statistics
from typing import Dict, List, Optional, Sequence

from attnprec import stats

Records = Dict[str, Dict[str, dict]]


def _scored(recs: Dict[str, dict]) -> Dict[str, dict]:
  return {i: r for i, r in recs.items() if r.get("finite", True)}


def preset_row(name: str, recs: Dict[str, dict]) -> dict:
  scored = _scored(recs)
  k = sum(bool(r["correct"]) for r in scored.values())
  n = len(scored)
  lo, hi = stats.wilson(k, n)
  return {"preset": name, "items": len(recs), "non_finite": len(recs) - n, "correct": k,
          "accuracy": k / n if n else None, "wilson95": [lo, hi]}


def compare(a_name: str, a: Dict[str, dict], b_name: str, b: Dict[str, dict],
            tokens: bool) -> Optional[dict]:
  """A vs B on the items both scored (None when they share none)."""
  a, b = _scored(a), _scored(b)
  items = sorted(set(a) & set(b))
  if not items:
    return None
  t = stats.paired_table([bool(a[i]["correct"]) for i in items],
                         [bool(b[i]["correct"]) for i in items])
  out = {"a": a_name, "b": b_name, "items": t.n, "both": t.both, "only_a": t.only_a,
         "only_b": t.only_b, "neither": t.neither,
         "difference": (t.only_a - t.only_b) / t.n,
         "mcnemar_p": stats.mcnemar_exact(t.only_a, t.only_b),
         "min_detectable_difference": stats.min_detectable_difference(
             t.n, max(t.discordant, 1) / t.n),
         "best_case_detectable": best_case_detectable(t.n)}
  if tokens:
    firsts = [stats.first_divergence(a[i]["tokens"], b[i]["tokens"]) for i in items]
    differ = [f for f in firsts if f is not None]
    out["token_identical"] = (len(items) - len(differ)) / len(items)
    out["median_first_divergence"] = statistics.median(differ) if differ else None
    out["first_divergences"] = differ
  return out


def code_versions(records: Records) -> Dict[str, List[str]]:
  """{preset: the code versions its records were computed by} ('unrecorded' for records
  written before records named their code)."""
  return {p: sorted({str(r.get("code_version") or "unrecorded") for r in recs.values()})
          for p, recs in records.items()}


def mixed_code_note(versions: Dict[str, List[str]]) -> Optional[str]:
  """A sentence where the compared records were computed by more than one code version
  (a comparison that pairs results of different code says so), else None."""
  every = sorted({v for vs in versions.values() for v in vs})
  if len(every) <= 1:
    return None
  return ("The records compared here were computed by more than one version of the code ("
          + "; ".join(f"{p}: {', '.join(vs)}" for p, vs in versions.items())
          + "): a difference between presets may be one between code versions.")


def best_case_detectable(n: int, alpha: float = 0.05, power: float = 0.8) -> float:
  """The smallest difference d the exact McNemar test detects with `power` on n pairs in
  the most favourable case (every discordant pair in one direction: P(only A) = d, P(only
  B) = 0): no sample of n items could have shown a smaller difference, whatever the
  discordance (bisection on `stats.mcnemar_power`)."""
  lo, hi = 0.0, 1.0
  for _ in range(40):
    mid = (lo + hi) / 2
    lo, hi = (lo, mid) if stats.mcnemar_power(n, mid, 0.0, alpha) >= power else (mid, hi)
  return hi


def summarize(records: Records, *, reference: str, baseline: Optional[str],
              tokens: bool) -> dict:
  presets = list(records)
  rows = [preset_row(p, records[p]) for p in presets]
  pairs = []
  for p in presets:
    if p == reference:
      continue
    pairs.append((p, reference))
    if baseline and baseline in records and p != baseline:
      pairs.append((p, baseline))
  comparisons = [c for c in (compare(a, records[a], b, records[b], tokens) for a, b in pairs)
                 if c is not None]
  return {"reference": reference, "baseline": baseline, "presets": rows,
          "comparisons": comparisons}


def _pct(x) -> str:
  return "–" if x is None else f"{100 * x:.1f}"


def markdown(summary: dict, *, extra_columns: Sequence[str] = ()) -> str:
  """The per-preset table and the paired table, as Markdown."""
  head = "| preset | correct / scored | accuracy % (Wilson 95%) | non-finite |"
  head += "".join(f" {c} |" for c in extra_columns)
  lines = [head, "|---" * (4 + len(extra_columns)) + "|"]
  for r in summary["presets"]:
    lo, hi = r["wilson95"]
    scored = r["items"] - r["non_finite"]
    line = (f"| {r['preset']} | {r['correct']} / {scored} | {_pct(r['accuracy'])} "
            f"({_pct(lo)}–{_pct(hi)}) | {r['non_finite']} |")
    line += "".join(f" {r.get(c, '–')} |" for c in extra_columns)
    lines.append(line)
  comps = summary["comparisons"]
  if comps:
    tok = "token_identical" in comps[0]
    lines += ["", "| A vs B | items | both | only A | only B | neither | A − B (points) | "
              "exact McNemar p | detectable at 80% power (points): at this discordance "
              "(best case) |"
              + (" token-identical % | median first divergence |" if tok else ""),
              "|---" * (9 + (2 if tok else 0)) + "|"]
    for c in comps:
      mdd, best = c["min_detectable_difference"], c.get("best_case_detectable")
      shown = "none" if mdd is None else f"{100 * mdd:.1f}"
      shown += f" ({100 * best:.1f})" if best is not None else ""
      line = (f"| {c['a']} vs {c['b']} | {c['items']} | {c['both']} | {c['only_a']} | "
              f"{c['only_b']} | {c['neither']} | {100 * c['difference']:+.1f} | "
              f"{c['mcnemar_p']:.3g} | {shown} |")
      if tok:
        med = c["median_first_divergence"]
        line += f" {_pct(c['token_identical'])} | {'–' if med is None else f'{med:g}'} |"
      lines.append(line)
  return "\n".join(lines) + "\n"


def plot(summary: dict, path: str, *, title: str, divergence: bool) -> str:
  """Accuracy with Wilson bars per preset; beside it the first-divergence distribution
  (token index of the first token that differs from the reference's) when `divergence`."""
  from attnprec import plotting
  plt = plotting.pyplot()
  ncols = 2 if divergence else 1
  fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 3.8), squeeze=False)
  ax = axes[0, 0]
  rows = [r for r in summary["presets"] if r["accuracy"] is not None]
  xs = list(range(len(rows)))
  acc = [100 * r["accuracy"] for r in rows]
  err = [[100 * (r["accuracy"] - r["wilson95"][0]) for r in rows],
         [100 * (r["wilson95"][1] - r["accuracy"]) for r in rows]]
  ax.errorbar(xs, acc, yerr=err, fmt="o", capsize=4)
  full = max(r["items"] for r in rows)
  ax.set_xticks(xs, [r["preset"] + ("" if r["items"] == full else
                                    f"\n({r['items'] - r['non_finite']} of {full} items)")
                     for r in rows], rotation=20)
  ax.set_ylabel("accuracy % (Wilson 95%)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if divergence:
    ax = axes[0, 1]
    ref = summary["reference"]
    for c in summary["comparisons"]:
      if c["b"] == ref and c.get("first_divergences"):
        ax.hist(c["first_divergences"], bins=20, histtype="step", label=c["a"])
    ax.set_xlabel(f"index of the first token differing from {ref}'s")
    ax.set_ylabel("items")
    ax.set_title("where decodes depart from the reference")
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  return plotting.save_figure(fig, path)


def plot_series(summaries: Dict[object, dict], path: str, *, xlabel: str, title: str,
                log2: bool = False) -> str:
  """Accuracy vs a setting (e.g. prompt length): one line per preset through the
  summaries of each setting ({x: summarize(...)}), with Wilson 95% bars; log2: a base-2
  log x axis (lengths 1k, 2k, 4k, ...)."""
  from attnprec import plotting
  plt = plotting.pyplot()
  fig, ax = plt.subplots(figsize=(6.5, 4.0))
  xs = sorted(summaries)
  presets: List[str] = []
  for x in xs:
    presets += [r["preset"] for r in summaries[x]["presets"] if r["preset"] not in presets]
  for k, name in enumerate(presets):
    pts = [(x, r) for x in xs for r in summaries[x]["presets"]
           if r["preset"] == name and r["accuracy"] is not None]
    if not pts:
      continue
    # A small horizontal offset per preset keeps the interval bars apart.
    shift = 2 ** (0.03 * (k - (len(presets) - 1) / 2)) if log2 else 1.0
    px = [x * shift for x, _ in pts]
    acc = [100 * r["accuracy"] for _, r in pts]
    err = [[100 * (r["accuracy"] - r["wilson95"][0]) for _, r in pts],
           [100 * (r["wilson95"][1] - r["accuracy"]) for _, r in pts]]
    ax.errorbar(px, acc, yerr=err, fmt="o-", capsize=3, label=name)
  if log2:
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(xs) / 1.4, max(xs) * 1.4)
  ax.set_xticks(xs, [str(x) for x in xs])
  ax.set_ylim(0, 102)
  ax.set_xlabel(xlabel)
  ax.set_ylabel("accuracy % (Wilson 95%)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  return plotting.save_figure(fig, path)

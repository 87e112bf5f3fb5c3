"""Two (or more) sizes of one model family side by side: `python runners/sizes.py`.

Reads what `make study` and `make eval` already wrote (plain JSON, nothing recomputed):
per size, a study run directory (results.json), and optionally a HumanEval and a
retrieval run directory (results.json of each). Writes into run_dir:

  sizes.md   one table, a column per size: logits KL, decode logits KL, NLL/token and
             the worst layer's decode attention error per preset (study); pass@1 with its
             Wilson 95% interval and the paired test against the reference (HumanEval);
             accuracy per length with its interval and the paired test against the
             reference (retrieval); for the reference and `presets`. A cell a size has no result for says so
             ("not run"); an eval cell over fewer items than the run's full count names
             how many it holds. When the sizes' HumanEval runs hold different problems
             (one run on a prefix of the 164), the HumanEval rows are given a second
             time over the problems every size ran for every preset, recomputed from
             each run's items.jsonl with the evals' own statistics (`report.summarize`),
             so that the columns compare the same problems; a preset every size ran on
             more problems than that (with the reference) gets its rows once more over
             all of those.
  sizes_error_by_layer.png  decode attention error per layer and preset, one line per
             size, layers on a 0..1 depth axis (the sizes differ in depth).
  sizes.json the table's numbers.

Mixed settings are refused (a UserError naming the setting): the studies must share their
inputs (text, lengths, windows, steps) and the evals their task settings, apart from the
model and the batch size, or the columns would not measure the same thing.
"""
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import numpy as np

from attnprec import plotting, readback, runs
from attnprec.errors import UserError
from attnprec.evals import records, report

# Study settings that must agree (the batch is the number of windows: it must too).
STUDY_KEYS = ("batch", "decode_steps", "greedy_steps", "logit_positions", "seed", "lengths")
LEGEND = ("Study rows: at the longest context, against fp32/HIGHEST, per size its own "
          "reference. Eval cells: accuracy % (Wilson 95% interval); for a preset, then the "
          "paired test against the reference: items only the preset / only the reference "
          "got right, exact McNemar p; for HumanEval, the share of problems decoded token "
          "for token as the reference decodes them.")
EVAL_IGNORED = ("model", "presets", "lengths", "pooled", "by_position", "departure",
                "comparisons", "xla", "sandbox_protections")


def _read(run_dir: str, what: str) -> dict:
  """results.json of a study ('study') or an eval ('HumanEval run', 'retrieval run'),
  checked against what that runner writes (`_schema_problem`): a file edited, cut short,
  not UTF-8, of another runner, or holding a non-finite figure is a UserError naming the
  file and the field, never a traceback or a 'nan' cell."""
  path = os.path.join(run_dir, "results.json")
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    raise UserError(f"sizes: {what} {run_dir!r} has no results.json; run it first (or "
                    f"leave that size's entry empty: '').") from None
  except UnicodeDecodeError as e:
    raise UserError(f"sizes: {path} is not UTF-8 text (byte {e.start}): not the results "
                    f"file a {what} writes.") from None
  except OSError as e:
    raise UserError(f"sizes: cannot read {path} ({e}).") from None
  obj, why = readback.loads(text)
  why = why or _schema_problem(obj, what)
  if why:
    raise UserError(f"sizes: {path} is not the results file a {what} writes: {why}. It "
                    f"was edited, cut short or written by another runner; rerun that "
                    f"{what} (or point sizes at the directory it wrote).")
  return obj


def _finite(x, where: str, at_least: Optional[float] = None) -> Optional[str]:
  """None if x is a finite number (>= `at_least` when given), else what is wrong."""
  if not readback.is_finite_number(x):
    return f"{where} is {x!r}, not a finite number"
  if at_least is not None and x < at_least:
    return f"{where} is {x!r}, below {at_least:g} (it cannot be negative)"
  return None


# The top-level keys each runner writes into results.json (`study.sweep.run`,
# `humaneval_eval.write_report`, `retrieval_eval.write_report`, plus `runs.provenance`):
# a key outside them was not written by that runner.
RESULT_KEYS = {
    "study": frozenset({"model", "model_arg", "kind", "config", "query_scale_multiplier",
                        "logit_offset", "key_offset", "offset_stats", "backend", "xla_flags",
                        "settings", "text", "reference", "configs", "timing", "provenance"}),
    "HumanEval run": frozenset({"reference", "baseline", "presets", "comparisons", "task",
                                "model", "max_new_tokens", "xla", "sandbox_protections",
                                "code_versions", "mixed_code", "provenance"}),
    "retrieval run": frozenset({"task", "model", "first_token", "kernel", "reference",
                                "baseline", "alpha", "lengths", "pooled", "by_position",
                                "departure", "code_versions", "mixed_code", "provenance"}),
}


def _schema_problem(obj, what: str) -> Optional[str]:
  """What the table reads of a study's or an eval's results.json, checked: None if it is
  all there, with finite figures."""
  if not isinstance(obj, dict):
    return f"a JSON {type(obj).__name__}, not an object"
  why = _shape_problem(obj, what)
  unknown = sorted(set(obj) - RESULT_KEYS.get(what, set(obj)))
  if why or not unknown:
    return why
  return (f"it has the key {_short(unknown[0])}, which a {what} does not write (it "
          f"writes {', '.join(sorted(RESULT_KEYS[what]))})")


def _shape_problem(obj: dict, what: str) -> Optional[str]:
  if what == "study":
    if not isinstance(obj.get("settings"), dict):
      return "'settings' is missing or not an object"
    configs = obj.get("configs")
    if not isinstance(configs, list) or not configs:
      return "'configs' is missing or empty"
    for i, c in enumerate(configs):
      if not (isinstance(c, dict) and isinstance(c.get("name"), str)
              and isinstance(c.get("per_length"), list) and c["per_length"]
              and isinstance(c["per_length"][-1], dict)):
        return f"configs[{i}] has no name or no per_length rows"
      last = c["per_length"][-1]
      for key in ("logits_kl", "decode_logits_kl", "nll"):    # a KL and an NLL are >= 0
        why = _finite(last.get(key), f"configs[{i}] ({c['name']}).per_length[-1].{key}",
                      at_least=0.0)
        if why:
          return why
      layers = last.get("decode_attn_rel_l2")
      if not isinstance(layers, list) or not layers:
        return (f"configs[{i}] ({c['name']}).per_length[-1].decode_attn_rel_l2 is "
                f"{_short(layers)}, not a list of per-layer errors")
      for j, v in enumerate(layers):
        why = _finite(v, f"configs[{i}] ({c['name']}).per_length[-1].decode_attn_rel_l2[{j}]",
                      at_least=0.0)
        if why:
          return why
    ref = obj.get("reference")
    rows = ref.get("per_length") if isinstance(ref, dict) else None
    if not (isinstance(rows, list) and rows and isinstance(rows[-1], dict)):
      return "'reference' has no per_length rows"
    return _finite(rows[-1].get("nll"), "reference.per_length[-1].nll", at_least=0.0)
  if not isinstance(obj.get("reference"), str):
    return "'reference' (the reference preset's name) is missing"
  if what.startswith("retrieval"):
    lengths = obj.get("lengths")
    if not isinstance(lengths, dict) or not lengths:
      return "'lengths' is missing or empty (a retrieval run reports per length)"
    sections = list(lengths.items())
  else:
    if "lengths" in obj and "presets" not in obj:
      return "it reports per length: a retrieval run's results, not a HumanEval run's"
    sections = [("", obj)]
  for name, sec in sections:
    where = f"lengths[{name!r}]" if name else "the report"
    if not (isinstance(sec, dict) and isinstance(sec.get("presets"), list)
            and isinstance(sec.get("comparisons"), list)):
      return f"{where} has no 'presets' and 'comparisons' lists"
    for row in sec["presets"]:
      if not (isinstance(row, dict) and isinstance(row.get("preset"), str)
              and all(readback.is_int(row.get(k)) for k in ROW_COUNTS)):
        return f"{where}: a preset row without its name and counts ({', '.join(ROW_COUNTS)})"
  return None


def _short(x) -> str:
  text = repr(x)
  return text if len(text) <= 80 else text[:80] + "..."


def _same(kind: str, labels: Sequence[str], values: Sequence, key: str) -> None:
  if any(v != values[0] for v in values[1:]):
    shown = "; ".join(f"{l}: {v!r}" for l, v in zip(labels, values))
    raise UserError(f"sizes: the {kind} runs differ in {key} ({shown}); the columns would "
                    f"not measure the same thing. Rerun them with the same settings.")


def _distinct(labels: Sequence[str], dirs: Sequence[str], results: Sequence[dict],
              kind: str = "studies") -> None:
  """Two sizes may not be one run, nor (studies) two runs of one model: the columns would
  compare a model with itself. `kind`: the sizes setting (studies, humaneval,
  retrieval); an eval's model is the column's study's, whose model is checked here."""
  seen = {}
  for label, d, res in zip(labels, dirs, results):
    if res is None:                   # a size without this eval
      continue
    for key in (("directory", os.path.realpath(d)),
                ("model", res.get("model") if kind == "studies" else None)):
      if key[1] is None:
        continue
      if key in seen:
        other, other_dir = seen[key]
        what = (f"the same run directory ({d!r})" if key[0] == "directory" else
                f"{kind} runs of the same model ({key[1]!r}: {other_dir!r} and {d!r})")
        raise UserError(f"sizes: {other!r} and {label!r} are {what}; sizes.{kind} needs "
                        f"one run per size, each of its own model.")
      seen[key] = (label, d)


def _provenance(res: Optional[dict]) -> str:
  """The code a run's results name (`runs.provenance`): its source digest and commit, or
  that it recorded none (results written before they carried provenance)."""
  if res is None:
    return "not run"
  p = res.get("provenance")
  if not isinstance(p, dict):
    return "no provenance recorded"
  clean = "" if p.get("clean") else ", tree not clean"
  return f"code {p.get('source', '?')} (commit {p.get('commit', '?')}{clean})"


def _inputs_section(labels, kinds) -> Tuple[dict, str]:
  """{label: {kind: {dir, provenance}}} and the report's lines naming each input's code,
  and saying so where the columns pair results of different code or of none recorded."""
  inputs = {l: {} for l in labels}
  lines = ["Inputs (the code each results file names):", ""]
  codes = set()
  for kind, dirs, results in kinds:
    for label, d, res in zip(labels, dirs, results):
      if res is None:
        continue
      said = _provenance(res)
      inputs[label][kind] = {"dir": d, "provenance": res.get("provenance"), "code": said}
      codes.add(said)
      lines.append(f"- {label}, {kind}: `{d}`: {said}")
  if len(codes) > 1:
    lines += ["", "These results come from different code, or name none: a difference "
                  "between columns may be the code's as well as the size's."]
  elif codes == {"no provenance recorded"}:
    lines += ["", "None of these results names its code (written before results "
                  "carried provenance): whether the columns ran the same code is not "
                  "recorded."]
  return inputs, "\n".join(lines)


def _study_rows(study: dict) -> Dict[str, dict]:
  """{preset: {kl, decode_kl, nll, worst_decode, per_layer}} at the longest length,
  plus 'reference' with its NLL."""
  rows = {}
  for c in study["configs"]:
    pl = c["per_length"][-1]
    rows[c["name"]] = {"kl": pl["logits_kl"], "decode_kl": pl["decode_logits_kl"],
                       "nll": pl["nll"], "worst_decode": max(pl["decode_attn_rel_l2"]),
                       "per_layer": pl["decode_attn_rel_l2"]}
  rows["reference"] = {"nll": study["reference"]["per_length"][-1]["nll"]}
  return rows


def _fmt(x: Optional[float]) -> str:
  if x is None:
    return "–"
  if not np.isfinite(x):
    return "non-finite"
  return f"{x:.3g}" if abs(x) >= 0.01 or x == 0 else f"{x:.2e}"


def _p(p: float) -> str:
  return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def _acc_cell(row: Optional[dict], full: Optional[int]) -> str:
  if row is None or row.get("accuracy") is None:
    return "not run"
  lo, hi = row["wilson95"]
  cell = f"{100 * row['accuracy']:.1f} ({100 * lo:.1f}–{100 * hi:.1f})"
  if full is not None and row["items"] < full:
    cell += f", {row['items']} of {full} items"
  if row.get("non_finite"):
    cell += f", {row['non_finite']} non-finite (not scored)"
  return cell


def _cmp_cell(comparisons: List[dict], a: str, b: str) -> str:
  for c in comparisons:
    if c["a"] == a and c["b"] == b:
      cell = f"{c['only_a']} / {c['only_b']}, p = {_p(c['mcnemar_p'])}"
      if c.get("token_identical") is not None:       # generation tasks
        cell += f", {100 * c['token_identical']:.0f}% token-identical"
      return cell
  return "not run"


# What a HumanEval run's records header may differ in between sizes (the model and its
# file, and the batch size, which changes no answer).
RECORDS_IGNORED = ("model", "source", "batch")


# What a report row counts that its records must reproduce (`report.preset_row`).
ROW_COUNTS = ("items", "non_finite", "correct")


def _item_records(run_dir: str, result: dict) -> Tuple[dict, Dict[str, Dict[str, dict]]]:
  """(header, {preset: {item: record}}) of an eval's items.jsonl (read only:
  `records.parse`), checked against its results.json: every row it reports (per preset;
  for retrieval per preset and length) counts exactly the items, non-finite items and
  correct items its records hold, and no records lie outside a reported row. Otherwise
  the directory holds a run in progress (the report is rewritten only after each preset
  or length), records of another run, or an edited report, and the table would quote
  numbers its records do not support."""
  path = os.path.join(run_dir, "items.jsonl")
  try:
    header, recs, _, _ = records.parse(path)
  except OSError as e:
    raise UserError(f"sizes: cannot read {path} ({e}); the problems the sizes share are "
                    f"recomputed from it.") from None
  out: Dict[str, Dict[str, dict]] = {}
  for (preset, item), rec in recs.items():
    out.setdefault(preset, {})[item] = rec
  per_length = "presets" not in result          # retrieval: rows per length
  rows = ([(r["preset"], int(n), r) for n, s in result["lengths"].items()
           for r in s["presets"]] if per_length else
          [(r["preset"], None, r) for r in result["presets"]])
  held: Dict[tuple, Dict[str, dict]] = {}
  for (preset, item), rec in recs.items():
    key = (preset, rec.get("length") if per_length else None)
    held.setdefault(key, {})[item] = rec
  counts = lambda row: tuple(row[k] for k in ROW_COUNTS)
  reported = {(p, n): counts(r) for p, n, r in rows}
  recounted = {key: counts(report.preset_row(key[0], v)) for key, v in held.items()}
  if recounted != reported:
    bad = sorted((k for k in set(reported) | set(recounted)
                  if reported.get(k) != recounted.get(k)), key=str)
    where = "; ".join(
        f"{p}{f' at {n}' if n else ''}: records {recounted.get((p, n), 'none')}, "
        f"report {reported.get((p, n), 'none')}" for p, n in bad[:3])
    raise UserError(f"sizes: {path} does not match {run_dir}/results.json in "
                    f"{len(bad)} row(s) ({'/'.join(ROW_COUNTS)}; {where}): a run still "
                    f"in progress, records of another run or an edited report. Let the "
                    f"eval finish (or rerun it to rewrite its report), then run sizes "
                    f"again.")
  # The figures the table quotes (accuracy, its interval, the paired tests), not only
  # the counts, are the records': an edited accuracy of 3.0 would be quoted as 300%.
  sections = ([(int(n), sec) for n, sec in result["lengths"].items()] if per_length else
              [(None, result)])
  for n, sec in sections:
    at = f" at {n}" if n else ""
    for row in sec["presets"]:
      want = report.preset_row(row["preset"], held.get((row["preset"], n), {}))
      bad = [k for k in want if not _same_value(row.get(k), want[k])]
      if bad:
        raise UserError(f"sizes: {run_dir}/results.json reports {row['preset']}{at} with "
                        f"{bad[0]} = {_short(row.get(bad[0]))}, but its records "
                        f"({path}) give {_short(want[bad[0]])}: an edited report. Rerun "
                        f"the eval to rewrite it, then run sizes again.")
    for c in sec["comparisons"]:
      why = _comparison_problem(c)
      if why:
        raise UserError(f"sizes: {run_dir}/results.json reports a comparison{at} whose "
                        f"{why}: an edited report. Rerun the eval to rewrite it, then run "
                        f"sizes again.")
  return header, out


def _comparison_problem(c) -> Optional[str]:
  """None if a paired comparison is one a report writes: its four cells non-negative
  counts adding up to its items, its difference theirs, its p-value a probability."""
  if not isinstance(c, dict):
    return f"entry is {_short(c)}, not an object"
  cells = ("both", "only_a", "only_b", "neither")
  for k in ("items",) + cells:
    if not (readback.is_int(c.get(k)) and c[k] >= 0):
      return f"{k} is {_short(c.get(k))}, not a count"
  if sum(c[k] for k in cells) != c["items"]:
    return f"cells ({', '.join(f'{k} {c[k]}' for k in cells)}) do not add up to its items ({c['items']})"
  if c["items"] and c.get("difference") != (c["only_a"] - c["only_b"]) / c["items"]:
    return f"difference is {_short(c.get('difference'))}, not (only_a - only_b) / items"
  p = c.get("mcnemar_p")
  if not (readback.is_finite_number(p) and 0 <= p <= 1):
    return f"mcnemar_p is {_short(p)}, not a probability"
  return None


def _same_value(a, b) -> bool:
  """Equal as the JSON a report writes: numbers to float64's last bit (nan == nan), lists
  element by element, anything else by ==."""
  if isinstance(a, list) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(map(_same_value, a, b))
  if readback.is_number(a) and readback.is_number(b):
    return a == b or (a != a and b != b)
  return type(a) is type(b) and a == b


def matched_summaries(dirs: Sequence[str], results: Sequence[Optional[dict]],
                      read: Sequence[Optional[dict]], presets: Sequence[str]):
  """(n, [summary or None per size]) over the items every size that ran holds for the
  reference and every preset (`read`: each size's {preset: {item: record}}, None where it
  did not run); None when the runs already hold the same items."""
  ran = [(d, r) for d, r in zip(dirs, results) if r is not None]
  if len(ran) < 2:
    return None
  ref = ran[0][1]["reference"]
  names = [ref] + [p for p in presets if p != ref]
  recs = {d: x for d, x in zip(dirs, read) if x is not None}
  # A preset a run does not hold shows "not run" in its column and does not shrink the
  # problems the others are compared on.
  held = [set(recs[d][p]) for d, _ in ran for p in names if recs[d].get(p)]
  common = set.intersection(*held) if held else set()
  if all(h == common for h in held):
    return None
  if not common:
    raise UserError(f"sizes: the HumanEval runs {[d for d, _ in ran]} share no problem "
                    f"that every one of {names} was run on; nothing can be compared.")
  out = []
  for d, r in zip(dirs, results):
    if r is None:
      out.append(None)
      continue
    sub = {p: {i: x for i, x in recs[d][p].items() if i in common}
           for p in names if recs[d].get(p)}
    if ref not in sub:
      raise UserError(f"sizes: the HumanEval run {d!r} holds no record of the reference "
                      f"preset {ref!r}; the paired tests need it.")
    out.append(report.summarize(sub, reference=ref, baseline=None, tokens=True))
  return len(common), out


def _eval_meta(res: dict) -> dict:
  return {k: v for k, v in res.items() if k not in EVAL_IGNORED}


@gin.configurable("sizes", denylist=["run_dir"])
def sizes_job(*, run_dir: str, labels: Sequence[str] = (), studies: Sequence[str] = (),
              humaneval: Sequence[str] = (), retrieval: Sequence[str] = (),
              presets: Sequence[str] = ("bf16", "fp32_logits", "fp32_qk"),
              humaneval_items: int = 164, retrieval_items: int = 200) -> dict:
  """labels[i] names size i; studies[i], humaneval[i], retrieval[i] are its run
  directories ('' = not run; humaneval / retrieval may be left empty altogether)."""
  labels = list(labels)
  for name, value in (("humaneval_items", humaneval_items),
                      ("retrieval_items", retrieval_items)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise UserError(f"sizes.{name} must be an integer >= 1 (the full item count of "
                      f"that eval), got {value!r}.")
  if not presets:
    raise UserError("sizes.presets is empty; name at least one preset, e.g. ('bf16',).")
  if len(labels) < 2:
    raise UserError(f"sizes.labels needs at least two sizes, got {tuple(labels)!r}.")
  for name, dirs, optional in (("studies", studies, False), ("humaneval", humaneval, True),
                               ("retrieval", retrieval, True)):
    if (dirs or not optional) and len(dirs) != len(labels):
      raise UserError(f"sizes.{name} has {len(dirs)} entries for {len(labels)} labels "
                      f"{tuple(labels)!r}; give one run directory per size ('' for none).")
  stud = [_read(d, "study") for d in studies]
  for key in STUDY_KEYS:
    _same("study", labels, [s["settings"].get(key) for s in stud], key)
  _same("study", labels, [s.get("text") for s in stud], "text")
  _distinct(labels, studies, stud)
  rows = [_study_rows(s) for s in stud]
  missing = [p for p in presets if any(p not in r for r in rows)]
  if missing:
    raise UserError(f"sizes.presets {tuple(missing)!r} are not in every study (they have "
                    f"{[sorted(r) for r in rows]}).")
  he = [(_read(d, "HumanEval run") if d else None) for d in humaneval] or [None] * len(labels)
  rt = [(_read(d, "retrieval run") if d else None) for d in retrieval] or [None] * len(labels)
  # Each eval's records (items.jsonl): its header holds settings results.json does not
  # (the prompt, the sandbox timeout, the items' seed).
  if humaneval:
    _distinct(labels, humaneval, he, "humaneval")
  if retrieval:
    _distinct(labels, retrieval, rt, "retrieval")
  he_read = [_item_records(d, r) if r is not None else None
             for d, r in zip(humaneval or [""] * len(labels), he)]
  rt_read = [_item_records(d, r) if r is not None else None
             for d, r in zip(retrieval or [""] * len(labels), rt)]
  for kind, res, read in (("HumanEval", he, he_read), ("retrieval", rt, rt_read)):
    done = [(l, r, x[0]) for l, r, x in zip(labels, res, read) if r is not None]
    if len(done) > 1:
      metas = [_eval_meta(r) for _, r, _ in done]
      for key in sorted(set().union(*metas)):
        _same(kind, [l for l, _, _ in done], [m.get(key) for m in metas], key)
      headers = [{k: v for k, v in h.items() if k not in RECORDS_IGNORED}
                 for _, _, h in done]
      for key in sorted(set().union(*headers)):
        _same(kind, [l for l, _, _ in done], [h.get(key) for h in headers], key)

  head = "| measure | preset | " + " | ".join(labels) + " |"
  lines = [head, "|---|---|" + "---:|" * len(labels)]

  def add(measure, preset, cells):
    lines.append(f"| {measure} | {preset} | " + " | ".join(cells) + " |")

  for key, measure in (("kl", "logits KL vs reference"),
                       ("decode_kl", "decode logits KL"),
                       ("worst_decode", "attn rel L2 decode, worst layer")):
    for p in presets:
      add(measure, p, [_fmt(r[p][key]) for r in rows])
  add("NLL/token", "reference", [f"{r['reference']['nll']:.4f}" for r in rows])
  for p in presets:
    add("NLL/token − reference", p,
        [f"{r[p]['nll'] - r['reference']['nll']:+.4f}" for r in rows])

  def eval_rows(kind, results, sections, full, names=tuple(presets)):
    ref = next((r["reference"] for r in results if r is not None), None)
    if ref is None:
      add(kind, "every preset", ["not run"] * len(labels))
      return
    for name in [ref] + [p for p in names if p != ref]:
      cells = []
      for res in results:
        sec = sections(res) if res is not None else None
        row = None if sec is None else next(
            (x for x in sec["presets"] if x["preset"] == name), None)
        cell = _acc_cell(row, full)
        if name != ref and cell != "not run":
          cell += "; " + _cmp_cell(sec["comparisons"], name, ref)
        cells.append(cell)
      add(kind, f"reference ({ref})" if name == ref else name, cells)

  eval_rows("HumanEval pass@1 %", he, lambda r: r, humaneval_items)
  he_recs = [x and x[1] for x in he_read]     # each size's {preset: {item: record}}
  matched = matched_summaries(humaneval, he, he_recs, presets) if humaneval else None
  if matched is not None:
    n, summaries = matched
    eval_rows(f"HumanEval pass@1 %, the {n} problems every size ran", summaries,
              lambda r: r, None)
  # A preset that both sizes ran on more problems than every preset shares (bf16 on 104
  # where fp32_qk holds 40) is also compared on all of those, beside the reference.
  wider = {}
  for p in (presets if matched is not None else ()):
    if not all(recs.get(p) for recs in he_recs if recs is not None):
      continue
    one = matched_summaries(humaneval, he, he_recs, [p])
    if one is not None and one[0] > matched[0]:
      wider[p] = one[0]
      eval_rows(f"HumanEval pass@1 %, the {one[0]} problems every size ran {p} on",
                one[1], lambda r: r, None, names=(p,))
  lengths = sorted({int(n) for r in rt if r is not None for n in r["lengths"]})
  for n in lengths:
    eval_rows(f"retrieval {n // 1024}k tokens, accuracy %", rt,
              lambda r, n=n: r["lengths"].get(str(n)), retrieval_items)
  if not lengths:
    add("retrieval accuracy %", "every preset", ["not run"] * len(labels))

  def stamped(results, read):   # an eval's provenance: its results.json's, or its records'
    return [None if r is None else
            {"provenance": r.get("provenance") or (x[0] or {}).get("provenance")}
            for r, x in zip(results, read)]

  inputs, inputs_text = _inputs_section(
      labels, (("study", studies, stud),
               ("HumanEval", humaneval or [""] * len(labels), stamped(he, he_read)),
               ("retrieval", retrieval or [""] * len(labels), stamped(rt, rt_read))))
  out = {"labels": labels, "studies": list(studies), "humaneval": list(humaneval),
         "inputs": inputs,
         "humaneval_matched_problems": matched[0] if matched else None,
         "humaneval_matched_by_preset": wider,
         "retrieval": list(retrieval), "study_rows": rows, "table": "\n".join(lines)}
  runs.ensure_dir(run_dir)
  png = plot_layers(labels, rows, presets, os.path.join(run_dir, "sizes_error_by_layer.png"))
  runs.write_json(run_dir, "sizes.json", out, provenance=True)
  text = (f"# {' vs '.join(labels)}\n\nStudies: {', '.join(studies)}; HumanEval: "
          f"{', '.join(d or 'not run' for d in humaneval) or 'not run'}; retrieval: "
          f"{', '.join(d or 'not run' for d in retrieval) or 'not run'}.\n\n"
          + out["table"] + "\n\n" + LEGEND + "\n\n" + inputs_text
          + f"\n\n![decode attention error by layer]({os.path.basename(png)})\n")
  runs.atomic_write(os.path.join(run_dir, "sizes.md"), text)
  print(text)
  print(f"wrote {run_dir}/sizes.md, sizes.json, {os.path.basename(png)}")
  return out


def plot_layers(labels, rows, presets, path: str) -> str:
  plt = plotting.pyplot()
  fig, ax = plt.subplots(figsize=(8, 4.5))
  styles = [("-", "o"), ("--", "x"), (":", "s"), ("-.", "^")]
  for (label, r), (ls, marker) in zip(zip(labels, rows), styles * 4):
    for k, p in enumerate(presets):
      errs = r[p]["per_layer"]
      ax.plot(np.linspace(0, 1, len(errs)), errs, ls, color=f"C{k}", marker=marker, ms=4,
              label=f"{p}, {label} ({len(errs)} layers)")
  ax.set_yscale("log")
  ax.set_xlabel("layer depth (0 = first layer, 1 = last)")
  ax.set_ylabel("decode attention rel. L2 error vs fp32/HIGHEST")
  ax.set_title("decode attention error by layer, per size and preset")
  ax.legend(fontsize=7, ncol=2)
  ax.grid(alpha=0.3)
  return plotting.save_figure(fig, path)

"""Every results table in the docs is its record.

Each case below names a table in README.md or docs/*.md (by the text before it and its
header line) and the results file it quotes, and builds the table that file holds: the
same rows in the same order, each cell either a string the doc must print to the
character (labels, a report's own cells, "–" / "not run") or the figures the cell must
show, in order. A figure is compared with a tolerance of half a unit in the last digit
the doc prints ("0.0139": 5e-5; "2.97e-03": 5e-6; "89.0%": 0.05; "12%": 0.5), so a
figure edited by hand, a record made again without the doc following, or a row added,
dropped or moved fails, naming the doc, the table and the cell.

Only JSON, JSONL, markdown and text files under results/ are read: nothing is run.

Held elsewhere, and not repeated here: README's headline table (tests/test_docs.py, the
sizes record), docs/performance.md's TPU tables (tests/test_docs.py, `device_tables`;
tests/test_flash.py, the flash kernel's flags table; tests/test_tpu_decode_bench.py, the
decode attention table), docs/precision.md's held-out table
(tests/test_docs.py), docs/training.md's sweep tables (tests/test_lrsweep.py) and
docs/contract.md's platform table (tests/test_platforms.py).

Every table of the docs is accounted for (`test_every_table_is_accounted_for`): a case
here, a test elsewhere, a reference table, a command's printed output, or one of the 15
results tables listed as not yet checked (`UNCHECKED`: their runs' files were written
under bench/ or runs/ and not committed).
"""
import functools
import json
import math
import os
import re

import pytest

from attnprec.stats import mcnemar_exact

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_READ = []   # every path read, so a case's named sources can be checked to be what it reads


def _text(path):
  _READ.append(path)
  return _file(path)


@functools.lru_cache(maxsize=None)
def _file(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return f.read()


def _json(path):
  _READ.append(path)
  return _parsed(path)


@functools.lru_cache(maxsize=None)
def _parsed(path):
  return json.loads(_file(path))


def _jsonl(path):
  _READ.append(path)
  return _parsed_lines(path)


@functools.lru_cache(maxsize=None)
def _parsed_lines(path):
  return [json.loads(line) for line in _file(path).splitlines() if line.strip()]


# --- markdown tables -----------------------------------------------------------------------

def _cells(line):
  """A table row's cells, stripped; a `|` inside backticks is text, not a border."""
  line = line.strip()
  assert line.startswith("|") and line.endswith("|"), line
  cells, cell, in_code = [], "", False
  for ch in line[1:-1]:
    if ch == "`":
      in_code = not in_code
    if ch == "|" and not in_code:
      cells.append(cell.strip())
      cell = ""
    else:
      cell += ch
  cells.append(cell.strip())
  return cells


def _md_table(text, header, after=None, where=""):
  """The rows (header and separator left out) of the first table whose header line
  starts with `header`, after the first occurrence of `after`; leading spaces allowed
  (a table indented under a list item)."""
  start = 0
  if after is not None:
    assert after in text, f"{where}: no {after!r}"
    start = text.index(after)
  lines = text[start:].split("\n")
  first = next((i for i, line in enumerate(lines) if line.strip().startswith(header)), None)
  assert first is not None, f"{where}: no table {header!r}" + (f" after {after!r}" if after else "")
  rows = []
  for line in lines[first + 2:]:
    if not line.strip().startswith("|"):
      break
    rows.append(_cells(line))
  return rows


def _report_rows(path, header, after=None):
  """A results markdown file's table as {first cell: cells}."""
  return {r[0]: r for r in _md_table(_text(path), header, after, path)}


# --- figures ---------------------------------------------------------------------------------

_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[−+-]?\d+)?")


def _numbers(cell):
  """[(value, half a unit of its last printed digit)] for every figure in a cell. A sign
  counts where it starts a word (`−0.5`, `(+1.8`), not between two figures (`0.93-0.95x`)."""
  out = []
  for m in _NUMBER.finditer(cell):
    literal = m.group(0).replace("−", "-")
    value = float(literal)
    before = cell[:m.start()]
    if before and before[-1] in "−-+" and (len(before) == 1 or not before[-2].isalnum()):
      value = -value if before[-1] in "−-" else value
    mantissa, _, exponent = literal.partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    out.append((value, 0.5 * 10.0 ** (int(exponent or 0) - decimals)))
  return out


class First:
  """Only the cell's first figures are the record's (the rest is prose, e.g. a range
  over runs the record does not hold)."""

  def __init__(self, *values):
    self.values = values


def _cell_problem(got, want):
  got = got.replace("**", "").strip()
  if isinstance(want, str):
    return None if got == want else f"{got!r}, the record: {want!r}"
  prefix = isinstance(want, First)
  values = list(want.values if prefix else want if isinstance(want, (list, tuple)) else [want])
  figures = _numbers(got)
  if prefix:
    figures = figures[:len(values)]
  if len(figures) != len(values):
    return f"{got!r} has {len(figures)} figures, the record {len(values)}: {values}"
  for (value, half), expected in zip(figures, values):
    if expected is None or not math.isfinite(expected) or \
        abs(value - expected) > half * (1 + 1e-6) + 1e-12:
      return f"{got!r}: the record has {expected!r} where it prints {value!r}"
  return None


def _table_problems(where, rows, expected):
  if len(rows) != len(expected):
    return [f"{where}: {len(rows)} rows, the record {len(expected)}: "
            f"{[r[0] for r in rows]} vs {[e[0] for e in expected]}"]
  problems = []
  for row, want in zip(rows, expected):
    if len(row) != len(want):
      problems.append(f"{where}: row {row[0]!r} has {len(row)} cells, the record {len(want)}")
      continue
    for col, (got, cell) in enumerate(zip(row, want)):
      problem = _cell_problem(got, cell)
      if problem:
        problems.append(f"{where}: row {row[0]!r}, column {col + 1}: {problem}")
  return problems


# --- statistics -------------------------------------------------------------------------------

def _pct(stat):
  return [100 * stat["accuracy"], 100 * stat["wilson95"][0], 100 * stat["wilson95"][1]]


# --- evals.md ----------------------------------------------------------------------------------

def _verbatim(path, header, after=None):
  """A report's table, every cell to the character."""
  def build():
    return [list(r) for r in _report_rows(path, header, after).values()]
  return build


def _retrieval_pairs_05b():
  res = _json("results/retrieval-qwen2.5-coder-0.5b/results.json")
  pairs = [("bf16", "highest"), ("fp32_qk", "highest"), ("fp32_qk", "bf16"),
           ("fp32_logits", "highest"), ("fp32_logits", "bf16")]
  rows = []
  for a, b in pairs:
    row = [f"{a} vs {b}"]
    for length in ("1024", "2048", "4096", "8192"):
      c = next(c for c in res["lengths"][length]["comparisons"] if (c["a"], c["b"]) == (a, b))
      row.append([c["only_a"], c["only_b"], c["mcnemar_p"]])
    rows.append(row)
  return rows


def _retrieval_bf16_vs_ref_15b():
  res = _json("results/retrieval-qwen2.5-coder-1.5b/results.json")
  rows = []
  for label, part in [("1024", res["lengths"]["1024"]), ("2048", res["lengths"]["2048"]),
                      ("4096", res["lengths"]["4096"]), ("8192", res["lengths"]["8192"]),
                      ("pooled 1k–8k", res["pooled"])]:
    c = next(c for c in part["comparisons"] if (c["a"], c["b"]) == ("bf16", "highest"))
    rows.append([label, c["items"], c["only_a"], c["only_b"], 100 * c["difference"],
                 c["mcnemar_p"]])
  return rows


def _verdicts(path, length):
  out = {}
  for item in _jsonl(path):
    if "preset" in item and item["length"] == length:
      out.setdefault(item["preset"], {})[item["item"]] = item["correct"]
  return out


def _retrieval_offset_15b():
  """At 4k; the pairs from the items' verdicts (the record keeps no offset vs fp32_qk)."""
  base = "results/retrieval-offset-qwen2.5-coder-1.5b/"
  stats = {p["preset"]: p for p in _json(base + "results.json")["lengths"]["4096"]["presets"]}
  verdicts = _verdicts(base + "items.jsonl", 4096)

  def pair(a, b):
    items = sorted(verdicts[a])
    assert sorted(verdicts[b]) == items and len(items) == stats[a]["items"]
    only_a = sum(verdicts[a][i] and not verdicts[b][i] for i in items)
    only_b = sum(verdicts[b][i] and not verdicts[a][i] for i in items)
    return [only_a, only_b, mcnemar_exact(only_a, only_b)]

  rows = []
  for label, name in [("reference (highest)", "highest"), ("bf16", "bf16"),
                      ("fp32_qk", "fp32_qk"), ("bf16 + key offset (bias)", "bf16_offset_bias")]:
    assert sum(verdicts[name].values()) == stats[name]["correct"], name
    rows.append([label, _pct(stats[name])] +
                ["–" if other == name else pair(name, other)
                 for other in ("highest", "bf16", "fp32_qk")])
  return rows


def _sizes_table():
  lines = _json("results/sizes-qwen2.5-coder/sizes.json")["table"].splitlines()
  return [_cells(line) for line in lines[2:]]


# --- precision.md: the key offset ---------------------------------------------------------------

def _study(path):
  res = _json(path)
  return {c["name"]: c["per_length"][-1] for c in res["configs"]}


def _key_offset_table():
  s05 = _study("results/study-offset-qwen2.5-coder-0.5b/results.json")
  s05.update({k: v for k, v in _study("results/study-offset-int8-qwen2.5-coder-0.5b/results.json")
              .items() if k.startswith("kv_int8_channel")})
  s15 = _study("results/study-offset-qwen2.5-coder-1.5b/results.json")
  retrieval = _json("results/retrieval-offset-qwen2.5-coder-1.5b/results.json")["lengths"]["4096"]
  stats = {p["preset"]: p for p in retrieval["presets"]}
  vs_ref = {c["a"]: c for c in retrieval["comparisons"] if c["b"] == "highest"}

  def retrieved(name):
    c = vs_ref[name]
    return [100 * stats[name]["accuracy"], c["only_a"], c["only_b"], c["mcnemar_p"]]

  rows = []
  for label, name, layer0, size15, task in [
      ("bf16 (both flags off)", "bf16", True, True, True),
      ("bf16 + `key_offset='zero'` (control)", "bf16_offset_zero", True, False, False),
      ("bf16 + `key_offset='bias'`", "bf16_offset_bias", True, True, True),
      ("bf16 + `key_offset='prefill_mean'`", "bf16_offset_mean", True, True, False),
      ("fp32_qk", "fp32_qk", True, True, True),
      ("fp32_qk + `key_offset='bias'`", "fp32_qk_offset_bias", True, False, False),
      ("int8 cache, per-token keys (kv_int8)", "kv_int8", True, False, False),
      ("kv_int8 + `key_offset='bias'`", "kv_int8_offset_bias", True, False, False),
      ("kv_int8 + `key_offset='prefill_mean'`", "kv_int8_offset_mean", True, False, False),
      ("int8 cache, per-channel key scales (kv_int8_channel)", "kv_int8_channel", False, False,
       False),
      ("kv_int8_channel + `key_offset='bias'`", "kv_int8_channel_offset_bias", False, False,
       False),
      ("kv_int8_channel + `key_offset='prefill_mean'`", "kv_int8_channel_offset_mean", False,
       False, False)]:
    r = s05[name]
    rows.append([label, r["logits_kl"], r["prefill_attn_rel_l2"][0] if layer0 else "-",
                 r["decode_logits_kl"], s15[name]["logits_kl"] if size15 else "not run",
                 retrieved(name) if task else "not run"])
  return rows


# --- study.md ------------------------------------------------------------------------------------

def _study_15b():
  # an older record: its provenance block predates the excess-precision assertion
  return _study_qwen("results/study-qwen2.5-coder-1.5b/results.json", provenance=False)


def _study_qwen(path, provenance=True):
  res = _excess_precision_off(_json(path), path) if provenance else _json(path)
  rows = []
  for c in res["configs"]:
    r = c["per_length"][-1]
    rows.append([c["name"], r["logits_kl"], r["decode_logits_kl"], r["nll"],
                 r["greedy"]["agreement"], [r["top1_agreement"], r["decode_top1_agreement"]],
                 max(r["decode_attn_rel_l2"]), c["time_ratio"]])
  nll = res["reference"]["per_length"][-1]["nll"]
  rows.append(["reference (fp32/HIGHEST)", "0", "0", nll, "1", "1, 1", "0", "–"])
  return rows


SINKS05 = "results/sinks-qwen2.5-coder-0.5b/sinks.json"


def _sinks_layers():
  """study.md's per-layer sink table: layers 0, 1, 2, 4, 8 as they are, 9-21 as the
  range of each column (the largest key bias as its maximum), with `<|endoftext|>` first."""
  res = _excess_precision_off(_json(SINKS05), SINKS05)
  v = res["variants"]["endoftext"]

  def cols(layer):
    p = v["profile"][layer]
    return [res["bias_norms"][layer]["max_abs_bk"], p["max_abs_logit"],
            p["median_row_mean"], p["median_sink_bias_logit"], v["local"]["bf16"][layer],
            v["local"]["fp32_logits"][layer], v["local"]["fp32_qk"][layer],
            v["local_centered"]["bf16"][layer]]

  rows = [[str(layer)] + cols(layer) for layer in (0, 1, 2, 4, 8)]
  rest = list(zip(*[cols(layer) for layer in range(9, 22)]))
  assert len(v["profile"]) == 24
  rows.append(["9–21", max(rest[0])] + [[min(c), max(c)] for c in rest[1:]])
  return rows


def _sinks_injected():
  """study.md's table of the final KL when one layer's attention runs under a preset."""
  res = _excess_precision_off(_json(SINKS05), SINKS05)
  rows = []
  for variant, label in (("endoftext", "`<|endoftext|>`"), ("none", "none")):
    for preset in ("bf16", "fp32_qk"):
      kl = res["injected"][variant][preset]
      rows.append([label, preset] + [kl[k] for k in ("all", "0", "1", "2", "4", "8", "16")])
  return rows


def _merged_study_rows(path, groups, columns):
  """A study table whose rows may name several configs that measured the same ('fp32_qk
  = fp32_attention'): each group's configs are asserted identical in every column, and
  its time cell is their time ratios' range ('0.72–0.85'). `columns`: functions of a
  config's longest-context entry; the record asserted made with excess precision off."""
  res = _excess_precision_off(_json(path), path)
  by = {c["name"]: c for c in res["configs"]}
  rows = []
  for label, names in groups:
    cells = [[f(by[n]["per_length"][-1]) for f in columns] for n in names]
    assert all(c == cells[0] for c in cells), f"{path}: {names} differ: {cells}"
    ratios = sorted(by[n]["time_ratio"] for n in names)
    rows.append([label] + cells[0] + [ratios if ratios[0] != ratios[-1] else ratios[0]])
  return rows


def _recall_tiny():
  worst = lambda key: lambda r: max(r[key])  # noqa: E731
  return _merged_study_rows(
      "results/study-recall-tiny/results.json",
      [("bf16", ["bf16"]), ("fp32_logits", ["fp32_logits"]),
       ("fp32_qk = fp32_attention", ["fp32_qk", "fp32_attention"]),
       ("fp32 = highest", ["fp32", "highest"])],
      [worst("prefill_attn_rel_l2"), worst("decode_attn_rel_l2"), lambda r: r["logits_kl"],
       lambda r: r["greedy"]["agreement"], lambda r: r["accuracy"]])


def _recall_offset():
  path = "results/study-recall-offset/results.json"
  res = _excess_precision_off(_json(path), path)
  rows = [["reference (fp32/HIGHEST)", [x["accuracy"] for x in res["reference"]["per_length"]],
           "1", "0", "0"]]
  for c in res["configs"]:
    r = c["per_length"][-1]
    rows.append([c["name"], [x["accuracy"] for x in c["per_length"]], r["greedy"]["agreement"],
                 r["decode_logits_kl"], max(r["decode_attn_rel_l2"])])
  return rows


def _passkey_offset(path):
  """The SmolLM2 offset study's table: the reference's passkey accuracy and NLL, then
  each config's at the longest context."""
  res = _excess_precision_off(_json(path), path)
  ref = res["reference"]["per_length"][-1]
  rows = [["reference (fp32/HIGHEST)", ref["accuracy"], "1", ref["nll"], "0", "1", "0"]]
  for c in res["configs"]:
    r = c["per_length"][-1]
    rows.append([c["name"], r["accuracy"], r["greedy"]["agreement"], r["nll"], r["logits_kl"],
                 r["top1_agreement"], max(r["decode_attn_rel_l2"])])
  return rows


def _projection_ranges():
  """docs/performance.md's projection table: per row count, each form's range of time
  over the float32-carried dot ('vs carried'), over the shapes of the record."""
  path = "results/bench-projections/projections.json"
  res = _excess_precision_off(_json(path), path)
  micro = res["default"]["micro"]
  rows = []
  for M, label in ((1000, "1000 (prefill)"), (8, "8"), (1, "1")):
    cells = [label]
    for form in ("c_f32", "c_result", "c_f32_castw"):
      v = [r["vs_carried"] for r in micro if r["M"] == M and r["form"] == form]
      assert len(v) == 5, (M, form, len(v))
      cells.append([min(v), max(v)])
    rows.append(cells)
  return rows


def _attention_suite():
  """docs/performance.md's attention-suite table: median ms per kernel and preset (or
  the row's status), and the fp32_attention / bf16 ratio per kernel."""
  path = "results/bench-attention/results.json"
  res = _excess_precision_off(_json(path), path)
  rows = {(r["S"], r["kernel"], r["preset"]): r for r in res["rows"]}

  def cell(S, kernel, preset):
    r = rows[(S, kernel, preset)]
    return 1e3 * r["median_s"] if r["status"] == "ok" else r["status"].replace("_", " ")

  def ratio(S, kernel):
    a, b = rows[(S, kernel, "fp32_attention")], rows[(S, kernel, "bf16")]
    return a["median_s"] / b["median_s"] if a["status"] == b["status"] == "ok" else None

  out = []
  for S in (1024, 4096, 16384):
    both = [ratio(S, "blockwise"), ratio(S, "dot_product")]
    out.append([str(S)] + [cell(S, k, p) for k, p in (
        ("dot_product", "bf16"), ("blockwise", "bf16"), ("blockwise", "fp32_attention"),
        ("jax_nn", "fp32_attention"), ("torch_sdpa", "bf16"), ("torch_sdpa", "fp32"))]
        + [[x for x in both if x is not None]])
  return out


def _peers_long():
  """docs/performance.md's table against the peers: decode ms/step and prefill s per
  configuration, then bf16 + flags' step over fp32's, prefill over the faster
  transformers', and share of the run's bf16 matmul peak."""
  path = "results/bench-peers-long/model.json"
  res = _excess_precision_off(_json(path), path)
  by = {(r["name"], r["batch"], r["prompt"]): r for r in res["rows"]}
  out = []
  for B, P in ((1, 1000), (8, 1000), (1, 4000)):
    cells = [f"{B}, {P}"] + [[1e3 * by[(n, B, P)]["step_s"], by[(n, B, P)]["prefill_s"]]
                             for n in ("fp32", "bf16_flags", "transformers", "transformers_bf16")]
    f = by[("bf16_flags", B, P)]
    out.append(cells + [f["step_vs_fp32"], f["prefill_vs_best_transformers"],
                        f["of_matmul_peak"]])
  return out


# --- performance.md: compile time against depth -------------------------------------------------# --- performance.md: compile time against depth -------------------------------------------------

def _compile_time():
  rows = {(r["program"], r["depth"], r["layout"]): r
          for r in _json("results/compile-time/compile.json")["rows"]}
  out = []
  for program in ("prefill", "decode", "train"):
    for depth in (2, 8, 32, 80):
      u, s = rows[(program, depth, "unrolled")], rows[(program, depth, "scanned")]
      out.append([program, str(depth), u["lower_s"] + u["compile_s"],
                  s["lower_s"] + s["compile_s"],
                  f"{u['stablehlo_bytes'] / 1e3:,.0f} / {s['stablehlo_bytes'] / 1e3:,.0f}",
                  f"{u['hlo_instructions']:,} / {s['hlo_instructions']:,}"])
  return out


# --- precision.md: the KV cache ----------------------------------------------------------------

def _excess_precision_off(record: dict, path: str) -> dict:
  """The record, made with XLA's excess precision off (`attnprec.xla_env`: every runner
  sets it; with XLA's default some bf16 roundings are dropped and a bf16 figure is not
  what the precision line says)."""
  flags = record["provenance"]["xla_flags"]
  assert "--xla_allow_excess_precision=false" in flags, f"{path}: made with {flags!r}"
  return record


def _kv_cache():
  out = []
  path = "results/kv-cache/kv_cache.json"
  for r in _excess_precision_off(_json(path), path)["rows"]:
    kl = ([r["kl_mean"]], [r["kl_max"]], [100 * r["argmax_agree"]]) if "kl_mean" in r \
        else ("–", "–", "–")
    out.append([r["cache"], r["compute"], r["nll"], *kl, r["bytes"] / 1e6])
  return out


def _kv_long():
  """The quantized caches' decode steps and prefills at 4000 tokens (a model bench run)."""
  path = "results/kv-long/model.json"
  rows = {(r["name"], r["batch"]): r for r in _excess_precision_off(_json(path), path)["rows"]}
  label = {"bf16_flags": "bf16", "bf16_flags_kv_int8": "int8, token scales",
           "bf16_flags_kv_fp8": "e4m3, token scales"}
  out = []
  for batch in (1, 8):
    base = rows[("bf16_flags", batch)]
    for name in label:
      r = rows[(name, batch)]
      vs = (lambda a, b: "–") if name == "bf16_flags" else (lambda a, b: a / b)
      out.append([f"{batch}, {r['prompt']}", label[name], r["kv_bytes"] / 2 ** 20,
                  1e3 * r["step_s"], vs(r["step_s"], base["step_s"]), r["of_roofline"],
                  r["prefill_s"], vs(r["prefill_s"], base["prefill_s"])])
  return out


# --- precision.md: the KV-cache study -----------------------------------------------------------

KV_STUDY_SMOLLM2 = "results/study-kv-smollm2-135m/report.md"
KV_STUDY_QWEN = "results/study-kv-qwen2.5-coder-0.5b/report.md"
KV_STUDY_GEMMA = "results/study-kv-gemma3-270m/report.md"
KV_STUDIES = (KV_STUDY_SMOLLM2, KV_STUDY_QWEN, KV_STUDY_GEMMA)
# The doc's columns a study report does not print: each config's flags and cache storage
# (its preset's gin), in the doc's order.
KV_STUDY_CONFIGS = [
    ("bf16", "off", "compute"), ("fp32_attention", "on", "compute"),
    ("kv_int8", "on", "int8, token scales"),
    ("kv_int8_channel", "on", "int8, key scales per channel"),
    ("kv_int8_flags_off", "off", "int8, token scales"),
    ("kv_fp8", "on", "e4m3, token scales"),
    ("kv_fp8_channel", "on", "e4m3, key scales per channel"),
]


def _kv_study(path, prompts=4):
  """A KV-cache study's report as docs/precision.md prints it: the report's own figures
  (attention error prefill / decode, logits KL, decode logits KL, NLL, greedy agreement
  and its first divergence's minimum, passkey accuracy as a count of `prompts`)."""
  record = path.replace("report.md", "results.json")
  _excess_precision_off(_json(record), record)
  rows = _report_rows(path, "| config | attn rel L2 prefill |")
  fig = lambda cell: [v for v, _ in _numbers(cell)]  # noqa: E731
  out = []
  for name, flags, cache in KV_STUDY_CONFIGS:
    r = rows[name]
    out.append([name, flags, cache, fig(r[1]) + fig(r[2]), fig(r[4]), fig(r[6]), fig(r[8]),
                fig(r[9]) + fig(r[10])[1:], f"{round(float(r[11]) * prompts)}/{prompts}"])
  ref = rows["reference (fp32/HIGHEST)"]
  out.append(["reference", "–", "compute (fp32)", [0.0], [0.0], [0.0], fig(ref[8]), [1.0],
              f"{round(float(ref[11]) * prompts)}/{prompts}"])
  return out


def _kv_studies_side_by_side():
  """The three KV-cache studies' logits KL with greedy agreement in brackets, a column per
  model (each its report's own figures)."""
  out = {name: [name, flags, cache] for name, flags, cache in KV_STUDY_CONFIGS}
  for path in KV_STUDIES:
    record = path.replace("report.md", "results.json")
    _excess_precision_off(_json(record), record)
    rows = _report_rows(path, "| config | attn rel L2 prefill |")
    for name in out:
      out[name].append([v for v, _ in _numbers(rows[name][4]) + _numbers(rows[name][9])])
  return list(out.values())


# --- performance.md: model benches --------------------------------------------------------------

def _bench(path):
  return {(r["name"], r["batch"], r["prompt"]): r for r in _json(path)["rows"]}


def _bench_by_column(path, doc_header, first="| batch, prompt"):
  """The doc's columns of a report's table (the one whose header starts with `first`),
  matched by name, every cell to the character."""
  text = _text(path)
  header = _cells(next(line for line in text.splitlines() if line.startswith(first)))
  want = _cells(doc_header)
  index = [header.index(name) for name in want]
  return [[row[i] for i in index] for row in _md_table(text, first, where=path)]


def _prefill_weights():
  rows = []
  for label, path in [("Qwen2.5-Coder-0.5B", "results/bench-prefill-weights-qwen2.5-coder-0.5b"),
                      ("SmolLM2-135M", "results/bench-prefill-weights-smollm2-135m")]:
    b = _bench(path + "/model.json")
    for prompt in (1000, 4000):
      stored = b[("bf16_flags", 1, prompt)]["prefill_s"]
      carried = b[("bf16_flags_carried_prefill", 1, prompt)]["prefill_s"]
      torch = b[("transformers_bf16", 1, prompt)]["prefill_s"]
      rows.append([f"{label}, 1 x {prompt}", stored, carried, stored / carried,
                   [stored / torch, torch]])
  return rows


def _prefill_profile():
  res = _json("results/profile-prefill/profile.json")
  runs = {(r["model"], r["prompt"], r["preset"]): r for r in res["rows"]}
  columns = [runs[(m, p, preset)] for m in ("smollm2-135m", "qwen2.5-coder-0.5b")
             for p in (1000, 4000) for preset in ("bf16_flags", "fp32")]
  # The doc's last share row is what the others leave, but for Qwen's 'other dots' (the
  # unembedding, under 1%), which the doc's table does not show.
  groups = [("projections q, k, v, o", ["projections q, k, v, o"]),
            ("MLP projections", ["MLP projections"]),
            ("attention QK dot", ["attention QK dot"]),
            ("attention PV dot", ["attention PV dot"]),
            ("attention softmax and mask", ["attention softmax and mask"]),
            ("attention loop (blockwise, not broken down)", ["attention loop (blockwise)"]),
            ("RoPE and biases", ["RoPE and biases", "key offset"]),
            ("MLP activation", ["MLP activation"]),
            ("norms, embedding, cache write, copies / converts, other",
             ["norms", "embedding", "cache write", "copies / converts", "other", "logits head"])]
  shown = {s for _, stages in groups for s in stages} | {"other dots"}
  for run in columns:
    assert set(run["stages"]) == shown, sorted(set(run["stages"]) ^ shown)
  rows = [[label] + [100 * sum(r["stages"][s] for s in stages) / r["thunks_ms"] for r in columns]
          for label, stages in groups]
  rows.append(["thunk time / wall per call"] +
              [[r["thunks_ms"] / 1e3, r["wall_ms"] / 1e3] for r in columns])
  return rows


def _prefill_forms():
  names = ["fp32", "bf16_flags", "bf16_flags_f32dot", "bf16", "bf16_f32dot", "transformers",
           "transformers_bf16"]
  rows = []
  for label, path in [("SmolLM2", "results/bench-forms-smollm2/model.json"),
                      ("Qwen2.5-Coder-0.5B", "results/bench-forms-qwen2.5-coder-0.5b/model.json")]:
    b = _bench(path)
    for prompt in (1000, 4000):
      fp32 = b[("fp32", 1, prompt)]["prefill_s"]
      rows.append([f"{label}, 1 x {prompt}", fp32] +
                  [[b[(n, 1, prompt)]["prefill_s"], b[(n, 1, prompt)]["prefill_s"] / fp32]
                   for n in names[1:]])
  return rows


def _mlp_activation():
  names = ["bf16_flags", "bf16_flags_f32act", "bf16", "bf16_f32act", "bf16_flags_f32dot",
           "bf16_flags_f32dot_f32act", "bf16_f32dot", "bf16_f32dot_f32act"]
  rows = []
  for label, path in [("SmolLM2", "results/bench-mlp-activation-smollm2-135m/model.json"),
                      ("Qwen2.5-Coder-0.5B",
                       "results/bench-mlp-activation-qwen2.5-coder-0.5b/model.json")]:
    b = _bench(path)
    fp32 = b[("fp32", 1, 1000)]["prefill_s"]
    rows.append([label, fp32] + [[b[(n, 1, 1000)]["prefill_s"], b[(n, 1, 1000)]["prefill_s"] / fp32]
                                 for n in names])
  return rows


def _carried_weights():
  """performance.md's carried-weights table: decode ms/step per preset (each against
  fp32's), the dense kernel's and `auto`'s prefill seconds."""
  path = "results/bench-carried-smollm2-135m/model.json"
  b = {(r["name"], r["batch"], r["prompt"]): r
       for r in _excess_precision_off(_json(path), path)["rows"]}
  rows = []
  for batch, prompt in ((1, 32), (1, 1000), (8, 32), (8, 1000)):
    step = lambda n: b[(n, batch, prompt)]["step_s"] * 1e3  # noqa: E731
    fp32 = step("fp32")
    rows.append([f"{batch}, {prompt}", fp32] +
                [[step(n), step(n) / fp32] for n in ("bf16_flags_cast", "bf16_flags",
                                                     "bf16_flags_dense")] +
                [b[(n, batch, prompt)]["prefill_s"] for n in ("bf16_flags_dense",
                                                              "bf16_flags")])
  return rows


def _key_offset_cost():
  b = _bench("results/bench-offset-qwen2.5-coder-0.5b/model.json")
  rows = []
  for batch, prompt in ((1, 1000), (8, 32)):
    for label, name in (("bf16 (off)", "bf16"), ("both on", "bf16_flags")):
      none, offset = b[(name, batch, prompt)], b[(name + "_offset", batch, prompt)]
      rows.append([f"{batch}, {prompt}", label] +
                  [[none[k] * s, offset[k] * s, offset[k] / none[k]]
                   for k, s in (("prefill_s", 1), ("step_s", 1e3))])
  return rows


def _decode_profile():
  res = _json("results/profile-decode/profile.json")
  runs = [next(r for r in res["rows"]
               if r["preset"] == p and (r["batch"], r["prompt"]) == (8, 4000))
          for p in ("bf16_flags", "bf16_flags_kv_int8")]
  groups = [("dense projections and logits head",
             ["projections q, k, v, o", "MLP projections", "logits head"]),
            ("attention QK dot", ["attention QK dot"]),
            ("attention PV dot", ["attention PV dot"]),
            ("attention softmax and mask (with the per-block reinterpret / code converts)",
             ["attention softmax and mask"]),
            ("attention loop (blockwise, not broken down)", ["attention loop (blockwise)"]),
            ("copies / converts", ["copies / converts"])]
  rows = [[label] + [sum(r["stages"][s] for s in stages) for r in runs] for label, stages in groups]
  rows.append(["all thunks"] + [r["thunks_ms"] for r in runs])
  rows.append(["wall time per step (traced)"] + [r["wall_ms"] for r in runs])
  return rows


# --- performance.md: the attention kernel's forms -------------------------------------------------

def _attention_forms(path, floor):
  rows = {(r["shape"], r["S"], r["form"]): r for r in _json(path)["rows"]}
  out = []
  for label, shape in (("SmolLM2", "smollm2-135m"), ("Qwen 0.5B", "qwen2.5-coder-0.5b")):
    for s in (4096, 16384):
      default = rows[(shape, s, "q512/kv256")]
      torch = rows[(shape, s, "torch_sdpa_bf16")]
      if floor:
        f = rows[(shape, s, "contract floor")]
        out.append([label, str(s), 1e3 * default["median_s"], 1e3 * torch["median_s"],
                    1e3 * f["median_s"], f["vs_torch"]])
      else:
        out.append([label, str(s), 1e3 * default["median_s"]] +
                   [rows[(shape, s, form)]["vs_default"] for form in
                    ("q512/kv512", "q256/kv256", "q256/kv512", "q1024/kv512", "q128/kv1024",
                     "q1024/kv1024")] + [[1e3 * torch["median_s"], torch["vs_default"]]])
  return out


def _dot_forms():
  path = "results/attention-dot-forms/dot_forms.txt"
  got = {}
  for m in re.finditer(r"^(QK|PV) (\w+)\s+([\d.]+) ms\s+([\d.]+)x cur\s+(\d+) GFLOP/s", _text(path),
                       re.M):
    got[(m.group(1), m.group(2))] = (float(m.group(3)), float(m.group(4)), int(m.group(5)))
  forms = [
      ("QK, bf16 x bf16 -> f32", "the kernel's: GQA groups folded into rows (G x Tq), (B, K) "
       "leading, keys as the cache lies", ("QK", "cur")),
      ("", "keys transposed (a `[B, K, H, S]` cache)", ("QK", "kT")),
      ("", "logits transposed (keys as rows)", ("QK", "outT")),
      ("", "G as a batch dim (one dot per query head)", ("QK", "perG")),
      ("", "q and k cast to float32 (the float32 QK form)", ("QK", "f32")),
      ("PV, f32 probabilities x f32 values", "the kernel's form", ("PV", "cur")),
      ("", "values transposed (a `[B, K, H, S]` cache)", ("PV", "vT")),
      ("", "output transposed", ("PV", "outT")),
      ("", "probabilities transposed", ("PV", "pT")),
      ("", "G as a batch dim", ("PV", "perG")),
      ("", "a column of ones appended to the values (the row sum out of the same dot)",
       ("PV", "ones65")),
      ("", "bf16 probabilities x bf16 values (not the contract's)", ("PV", "bf16p"))]
  rows = []
  for dot, form, key in forms:
    ms, ratio, gflops = got[key]
    rows.append([dot, form, [ratio, ms] if key[1] == "cur" else ratio, gflops])
  assert len(got) == len(rows)
  return rows


# --- performance.md: one-off scripts' outputs (text) ------------------------------------------

def _case(label):
  """'1 x 1000' -> '1x1000'."""
  return label.replace(" x ", "x")


def _prefill_forms_cpu():
  base = "results/cpu-without-avx512-bf16/"
  runs = []
  for name in ("prefill_2cores.txt", "prefill_2cores_b.txt", "prefill_13cores.txt"):
    runs.append({m.group(1): (float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"^1x1000 prefill (.+?)\s+([\d.]+) s\s+([\d.]+)x fp32$", _text(base + name), re.M)})

  def ratios(name):
    return [run[name][1] if name in run else "" for run in runs]

  return [["fp32"] + [run["fp32"][0] for run in runs],
          ["bf16 + flags, `auto` (float32 form here)"] +
          ratios("bf16 + flags, projection_form=auto"),
          ["bf16 + flags, `compute_dtype_dot` (bf16 dots forced)"] +
          ratios("bf16 + flags, compute_dtype_dot"),
          ["bf16 + flags, `float32_dot` (forced)"] + ratios("bf16 + flags, float32_dot"),
          ["bf16 + flags, `auto`, `mlp_activation = 'float32'`"] +
          ratios("bf16 + flags, mlp_activation=float32"),
          ["bf16, flags off, `auto`"] + ratios("bf16, flags off")]


def _qk_form_runs(name):
  """{(case, form): (prefill s, its ratio to fp32, decode ms, its ratio to fp32)}."""
  out = {}
  for m in re.finditer(r"^(\d+x\d+) (.+?)\s+prefill\s+(\S+) s \((\S+)x fp32\)\s+"
                       r"decode step\s+([\d.]+) ms \(([\d.]+)x fp32\)",
                       _text("results/cpu-without-avx512-bf16/" + name), re.M):
    out[(m.group(1), m.group(2))] = tuple(float(g) for g in m.groups()[2:])
  return out


def _qk_form_prefill():
  rows = []
  for label, name, case in [
      ("prefill 1 x 1000, 2 cores (5 rounds)", "qk_form_2cores.txt", "1x1000"),
      ("prefill 8 x 250, 2 cores (5 rounds; `auto` runs the dense kernel here)",
       "qk_form_2cores.txt", "8x250"),
      ("prefill 1 x 1000, 13 cores (3 rounds)", "qk_form_13cores.txt", "1x1000"),
      ("prefill 1 x 4000, 13 cores (3 rounds)", "qk_form_13cores.txt", "1x4000")]:
    run = _qk_form_runs(name)
    rows.append([label, run[(case, "fp32")][0], run[(case, "bf16 + flags, bf16 QK dot")][1],
                 run[(case, "bf16 + flags")][1]])
  return rows


def _qk_form_decode():
  run = _qk_form_runs("qk_decode_2cores.txt")
  rows = []
  for case in ("8 x 1000", "8 x 250", "1 x 1000", "1 x 250"):
    rows.append([case, run[(_case(case), "fp32")][2],
                 run[(_case(case), "bf16 + flags, bf16 QK dot")][3],
                 run[(_case(case), "bf16 + flags")][3]])
  return rows


def _mlp_activation_cpu():
  rows = []
  # (file, rounds, the default before: the 'compute' activation, the float32 activation)
  for name, rounds, before, now in [
      ("prefill_mlp_2cores.txt", 5, "bf16 + flags, projection_form=auto",
       "bf16 + flags, mlp_activation=float32"),
      ("prefill_auto_2cores.txt", 7, "bf16 + flags, mlp_activation=compute",
       "bf16 + flags, projection_form=auto")]:
    run = {(m.group(1), m.group(2)): (float(m.group(3)), float(m.group(4))) for m in re.finditer(
        r"^(\d+x\d+) prefill (.+?)\s+([\d.]+) s\s+([\d.]+)x fp32$",
        _text("results/cpu-without-avx512-bf16/" + name), re.M)}
    for case in ("1x1000", "8x250"):
      rows.append([f"{case.replace('x', ' x ')}, {rounds} rounds", run[(case, "fp32")][0],
                   run[(case, before)][1], run[(case, now)][1]])
  return rows


def _decode_layout():
  """decode_ab.txt holds two runs, in the doc's order (4001, then 4016 positions); the
  file does not print the cache length."""
  text = _text("results/decode-kv-layout/decode_ab.txt")
  blocks = text.split("built bf16_flags old")[1:]
  assert len(blocks) == 2
  rows = []
  for label, block in zip(("4001 (4000 + 1 step)", "4016 (4015 + 1 step)"), blocks):
    t = {(m.group(1), m.group(2)): float(m.group(3))
         for m in re.finditer(r"\('(\w+)', '(old|new)'\) ([\d.]+) ms", block)}
    r = {m.group(1): float(m.group(2))
         for m in re.finditer(r"^(\w+) new/old ([\d.]+)$", block, re.M)}
    int8_over_bf16 = float(re.search(r"int8/bf16 old [\d.]+ new ([\d.]+)", block).group(1))
    bf, i8 = "bf16_flags", "bf16_flags_kv_int8"
    rows.append([label, [t[(bf, "old")], t[(bf, "new")]], r[bf],
                 [t[(i8, "old")], t[(i8, "new")]], r[i8], int8_over_bf16])
  return rows


def _decode_bits():
  """bits_ab.txt: batch 8 at 4001 first, then batch 1 at 4001 (the `new_b1` kernel), then
  batch 1 at 1001 and 1016 (`P=1000 and P=1015`)."""
  text = _text("results/decode-kv-layout/bits_ab.txt")
  first, second = text.split("built bf16_flags:old")[1:3]
  second, short = second.split("--- B=1")

  def times(block):
    t = {m.group(1): float(m.group(2))
         for m in re.finditer(r"^(bf16_flags\S*:\w+)\s+([\d.]+) ms$", block, re.M)}
    r = {m.group(1): float(m.group(2))
         for m in re.finditer(r"^(bf16_flags\S*:\w+) vs old ([\d.]+)$", block, re.M)}
    return t, r

  (t8, r8), (t1, r1) = times(first), times(second)
  rows = [["8, 4001", [t8["bf16_flags:old"], t8["bf16_flags:new"]], r8["bf16_flags:new"],
           [t8["bf16_flags_kv_int8:old"], t8["bf16_flags_kv_int8:new"]],
           r8["bf16_flags_kv_int8:new"]]]
  for label, m in zip(("1, 1001", "1, 1016"), re.finditer(
      r"bf16_flags:old ([\d.]+) ms; bf16_flags:new_b1 ([\d.]+) ms; new_b1 vs old ([\d.]+)",
      short)):
    rows.append([label, [float(m.group(1)), float(m.group(2))], float(m.group(3)), "–", "–"])
  rows.append(["1, 4001", [t1["bf16_flags:old"], t1["bf16_flags:new_b1"]],
               r1["bf16_flags:new_b1"], "–", "–"])
  return rows


def _short_caches():
  runs = {}
  for m in re.finditer(r"^(\d+)x(\d+) \(cache (\d+)\): .*blockwise / dense: bf16 ([\d.]+), "
                       r"int8 ([\d.]+)$", _text("results/decode-short-cache/short_ab.txt"), re.M):
    b, p, cache, bf16, int8 = m.groups()
    runs.setdefault(f"{b} x {p} ({cache})", []).append((float(bf16), float(int8)))
  order = ["1 x 32 (33)", "1 x 64 (65)", "1 x 128 (129)", "1 x 200 (201)", "1 x 300 (301)",
           "1 x 500 (501)", "8 x 32 (33)", "8 x 64 (65)", "8 x 128 (129)", "8 x 200 (201)",
           "8 x 300 (301)", "8 x 400 (401)", "8 x 500 (501)"]
  assert sorted(order) == sorted(runs)
  return [[k, [r[0] for r in runs[k]], [r[1] for r in runs[k]]] for k in order]


def _short_prefill():
  prefill = {}
  for m in re.finditer(r"^(\d+x\d+) prefill \(cache \d+\): .*blockwise / dense ([\d.]+)$",
                       _text("results/decode-short-cache/prefill_short_ab.txt"), re.M):
    prefill.setdefault(m.group(1), []).append(float(m.group(2)))
  other = {}
  for m in re.finditer(r"^(\d+x\d+) \(cache \d+\) (prefill|decode)\s+(bf16|fp32)\s+.*"
                       r"blockwise / dense ([\d.]+)$",
                       _text("results/decode-short-cache/auto_ab.txt"), re.M):
    other[(m.group(1), m.group(2), m.group(3))] = float(m.group(4))
  rows = []
  for case in ("1 x 16", "1 x 32", "1 x 64", "1 x 128", "1 x 200", "8 x 16", "8 x 32", "8 x 64",
               "8 x 128", "8 x 200"):
    c = _case(case)
    rows.append([case, prefill[c]] + [other.get((c, phase, preset), "") for phase, preset in (
        ("prefill", "bf16"), ("prefill", "fp32"), ("decode", "bf16"), ("decode", "fp32"))])
  assert len(rows) == len(prefill)
  return rows


def _int8_qk_forms():
  t = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(
      r"^one (?:block alone|layer step): (.+?)\s+([\d.]+) ms",
      _text("results/decode-int8-forms/int8_qk_ab.txt"), re.M)}
  return [["one 512-key block's QK alone: dot on codes cast to bf16 / multiply-and-sum",
           [t["QK dot, codes cast to bf16"], t["QK multiply-and-sum, f32"]]],
          ["one block's PV alone: dot on codes cast to f32 / multiply-and-sum",
           [t["PV dot, codes cast to f32"], t["PV multiply-and-sum, f32"]]],
          ["one layer's step, int8 cache: kernel as it is / QK multiply-and-sum",
           [t["int8 cache, kernel as it is"], t["int8 cache, QK multiply-and-sum"]]],
          ["one layer's step, bf16 cache (uint16 bits)", t["bf16 cache (uint16 bits)"]]]


def _decode_blocks():
  t = {(m.group(1), m.group(2), int(m.group(3))): float(m.group(4)) for m in re.finditer(
      r"^(\d+x\d+) (bf16_flags\S*)\s+decode_kv_block\s+(\d+):\s+[\d.]+ ms\s+([\d.]+)x",
      _text("results/decode-kv-block/dkv_ab.txt"), re.M)}
  return [[case] + [[t[(_case(case), p, 1024)], t[(_case(case), p, 2048)]]
                    for p in ("bf16_flags", "bf16_flags_kv_int8")]
          for case in ("8 x 4000", "1 x 4000", "1 x 1000")]


def _decode_block_waste():
  rows = []
  for line in _text("results/decode-kv-block/waste.txt").splitlines():
    b, s, p = re.match(r"B=(\d+) S=(\d+) pos=(\d+):", line).groups()
    ratios = {}
    for m in re.finditer(r"(1024|2048): bf16 [\d.]+ \(([\d.]+)x\) int8 [\d.]+ \(([\d.]+)x\)",
                         line):
      ratios[(m.group(1), "bf16")] = float(m.group(2))
      ratios[(m.group(1), "int8")] = float(m.group(3))
    rows.append([f"{b}, {s}, {p}"] + [[ratios[("1024", k)], ratios[("2048", k)]]
                                     for k in ("bf16", "int8")])
  return rows


def _mask_free():
  got = {}
  for line in _text("results/attention-xla-cpu/maskfree_ab.txt").splitlines():
    m = re.match(r"^(.+?)\s+as is\s+([\d.]+) ms\s+mask-free branch\s+([\d.]+) ms\s+([\d.]+)x",
                 line)
    if m:
      got[m.group(1).strip()] = tuple(float(g) for g in m.groups()[1:])
  rows = []
  for label, key in [("SmolLM2, prefill 1000", "smollm2 prefill 1000"),
                     ("SmolLM2, prefill 4096", "smollm2 prefill 4096"),
                     ("Qwen 0.5B, prefill 1000", "qwen2.5-coder-0.5b prefill 1000"),
                     ("Qwen 0.5B, prefill 4096", "qwen2.5-coder-0.5b prefill 4096"),
                     ("SmolLM2, decode step 8 x 4001, bf16 arrays", "smollm2 decode 8x4001, bf16"),
                     ("SmolLM2, decode step 8 x 4001, int8 cache", "smollm2 decode 8x4001, int8")]:
    kernel, branch, ratio = got[key]
    rows.append([label, kernel, branch, First(ratio)])
  assert len(got) == len(rows)
  return rows


def _q_block_prefill():
  t = {(m.group(1), m.group(2), int(m.group(3))): float(m.group(4)) for m in re.finditer(
      r"^(\S+) (1x\d+) q_block\s+(\d+): prefill\s+[\d.]+ ms\s+([\d.]+)x",
      _text("results/attention-xla-cpu/qblock_prefill_ab.txt"), re.M)}
  return [[case] + [t[(m, _case(case), 256)] for m in ("smollm2-135m", "qwen2.5-coder-0.5b")]
          for case in ("1 x 1000", "1 x 2000", "1 x 4000")]


# --- the cases ------------------------------------------------------------------------------

E = "docs/evals.md"
P = "docs/precision.md"
S = "docs/study.md"
F = "docs/performance.md"
HE05 = "results/humaneval-qwen2.5-coder-0.5b/results.md"
HE15 = "results/humaneval-qwen2.5-coder-1.5b/results.md"
R05 = "results/retrieval-qwen2.5-coder-0.5b/"
R15 = "results/retrieval-qwen2.5-coder-1.5b/"
RO15 = "results/retrieval-offset-qwen2.5-coder-1.5b/"
CPU = "results/cpu-without-avx512-bf16/"
PAIRS = "| A vs B | items | both | only A |"
PRESETS = "| preset | correct / scored |"
LENGTHS = "| preset | 1024 | 2048 | 4096 | 8192 |"
NEXTLINE = ("| preset | exact match | Wilson 95% | vs reference (95% bootstrap) | lines only it "
            "/ only other (vs bf16) | token top-1 | NLL/token | agreement with reference | "
            "prefill s |")
BENCH_SMOL = ("| batch, prompt | config | weights | decode ms/step | tokens/s | vs fp32 step | "
              "vs transformers tok/s | of roofline | prefill s | prefill vs transformers | "
              "prefill vs best transformers | prefill of matmul peak | compile s (prefill + "
              "decode) |")
BENCH_15B = ("| batch, prompt | config | weights | decode ms/step | tokens/s | vs fp32 step | "
             "of roofline | prefill s | prefill of matmul peak | compile s (prefill + decode) |")

# (id, doc, text before the table, the table's header line (its start), the results files
# the table quotes, the table they hold)
CASES = [
    ("humaneval-0.5b-presets", E, "### HumanEval, Qwen2.5-Coder-0.5B", PRESETS, [HE05],
     _verbatim(HE05, PRESETS)),
    ("humaneval-0.5b-pairs", E, "### HumanEval, Qwen2.5-Coder-0.5B", PAIRS, [HE05],
     _verbatim(HE05, PAIRS)),
    ("retrieval-0.5b-lengths", E, "### Long-context retrieval, Qwen2.5-Coder-0.5B", LENGTHS,
     [R05 + "results.md"], _verbatim(R05 + "results.md", LENGTHS)),
    ("retrieval-0.5b-pairs", E, "### Long-context retrieval, Qwen2.5-Coder-0.5B",
     "| A vs B | 1024 | 2048 | 4096 | 8192 |", [R05 + "results.json"], _retrieval_pairs_05b),
    ("humaneval-1.5b-presets", E, "### HumanEval, Qwen2.5-Coder-1.5B", PRESETS, [HE15],
     _verbatim(HE15, PRESETS)),
    ("humaneval-1.5b-pairs", E, "### HumanEval, Qwen2.5-Coder-1.5B", PAIRS, [HE15],
     _verbatim(HE15, PAIRS)),
    ("retrieval-1.5b-lengths", E, "### Long-context retrieval, Qwen2.5-Coder-1.5B", LENGTHS,
     [R15 + "results.md"], _verbatim(R15 + "results.md", LENGTHS)),
    ("retrieval-1.5b-bf16-vs-reference", E, "### Long-context retrieval, Qwen2.5-Coder-1.5B",
     "| bf16 vs highest | items |", [R15 + "results.json"], _retrieval_bf16_vs_ref_15b),
    ("retrieval-1.5b-key-offset", E, "### The key offset: retrieval at 4k on the 1.5B",
     "| preset | accuracy % (Wilson 95%) |", [RO15 + "results.json", RO15 + "items.jsonl"],
     _retrieval_offset_15b),
    ("sizes", E, "## Two sizes side by side", "| measure | preset |",
     ["results/sizes-qwen2.5-coder/sizes.json"], _sizes_table),
    ("key-offset", P, "### What it buys", "| setting | 0.5B logits KL |",
     ["results/study-offset-qwen2.5-coder-0.5b/results.json",
      "results/study-offset-int8-qwen2.5-coder-0.5b/results.json",
      "results/study-offset-qwen2.5-coder-1.5b/results.json", RO15 + "results.json"],
     _key_offset_table),
    ("study-recall-tiny", S, "Default `make study`", "| config | attn rel L2 prefill |",
     ["results/study-recall-tiny/results.json"], _recall_tiny),
    ("study-recall-offset", S, "study_recall_offset.gin", "| config | recall acc. 8 / 24",
     ["results/study-recall-offset/results.json"], _recall_offset),
    ("study-0.5b", S, "## Evidence on a real Qwen2", "| preset | logits KL |",
     ["results/study-qwen2.5-coder-0.5b-4windows/results.json"],
     lambda: _study_qwen("results/study-qwen2.5-coder-0.5b-4windows/results.json")),
    ("study-offset-smollm2", S, "study_smollm2_offset.gin", "| config | passkey acc. |",
     ["results/study-offset-smollm2-135m/results.json"],
     lambda: _passkey_offset("results/study-offset-smollm2-135m/results.json")),
    ("nextline-0.5b", S, "make nextline ARGS=", NEXTLINE,
     ["results/nextline-qwen2.5-coder-0.5b/report.md"],
     lambda: _bench_by_column("results/nextline-qwen2.5-coder-0.5b/report.md", NEXTLINE,
                              first="| preset | exact match |")),
    ("sinks-0.5b-layers", S, "## Attention sinks and key biases", "| layer | max abs b_k |",
     [SINKS05], _sinks_layers),
    ("sinks-0.5b-injected", S, "*Which layer's error reaches the output*",
     "| first token | preset |", [SINKS05], _sinks_injected),
    ("study-1.5b", S, "## The second size: Qwen2.5-Coder-1.5B", "| preset | logits KL |",
     ["results/study-qwen2.5-coder-1.5b/results.json"], _study_15b),
    ("prefill-weights", F, "### The measurements behind the projection forms",
     "| model, prompt | prefill, stored |",
     ["results/bench-prefill-weights-qwen2.5-coder-0.5b/model.json",
      "results/bench-prefill-weights-smollm2-135m/model.json"], _prefill_weights),
    ("carried-weights", F, "What the float32-carried weights and the `auto` kernel do",
     "| batch, prompt | fp32 | bf16 + flags, cast at each use |",
     ["results/bench-carried-smollm2-135m/model.json"], _carried_weights),
    ("prefill-profile", F, "## Where a prefill's time goes", "| stage, share of thunk time |",
     ["results/profile-prefill/profile.json"], _prefill_profile),
    ("peers-long", F, "Against the peers, one interleaved run",
     "| batch, prompt | attnprec fp32 |", ["results/bench-peers-long/model.json"], _peers_long),
    ("attention-suite", F, "## Attention kernels alone", "| S | dot_product bf16 |",
     ["results/bench-attention/results.json"], _attention_suite),
    ("projections", F, "## bf16 projections at the hardware's rate", "| rows |",
     ["results/bench-projections/projections.json"], _projection_ranges),
    ("bench-smollm2", F, "`make bench` as it stands", BENCH_SMOL,
     ["results/bench-smollm2-135m/model.md"],
     lambda: _bench_by_column("results/bench-smollm2-135m/model.md", BENCH_SMOL)),
    ("bench-smollm2-flag-phases", F, "`make bench` as it stands", "| phase | bf16 s |",
     ["results/bench-smollm2-135m/model.md"],
     _verbatim("results/bench-smollm2-135m/model.md", "| phase | bf16 s |")),
    ("bench-1.5b", F, "## The 1.5B on a CPU without avx512_bf16", BENCH_15B,
     ["results/bench-qwen2.5-coder-1.5b/model.md"],
     lambda: _bench_by_column("results/bench-qwen2.5-coder-1.5b/model.md", BENCH_15B)),
    ("projection-forms", F, "## The projection form per CPU", "| model, prompt | fp32 |",
     ["results/bench-forms-smollm2/model.json",
      "results/bench-forms-qwen2.5-coder-0.5b/model.json"],
     _prefill_forms),
    ("prefill-without-bf16-dots", F, "## The projection form per CPU",
     "| prefill, 1 x 1000 | 2 cores (5 rounds) |",
     [CPU + "prefill_2cores.txt", CPU + "prefill_2cores_b.txt", CPU + "prefill_13cores.txt"],
     _prefill_forms_cpu),
    ("qk-form-prefill", F, "**The attention's QK dot in the float32 form.**",
     "| SmolLM2, random weights |", [CPU + "qk_form_2cores.txt", CPU + "qk_form_13cores.txt"],
     _qk_form_prefill),
    ("qk-form-decode", F, "**The attention's QK dot in the float32 form.**",
     "| decode step, SmolLM2 |", [CPU + "qk_decode_2cores.txt"], _qk_form_decode),
    ("mlp-activation", F, "### The MLP's activation in float32", "| model (1 x 1000) |",
     ["results/bench-mlp-activation-smollm2-135m/model.json",
      "results/bench-mlp-activation-qwen2.5-coder-0.5b/model.json"], _mlp_activation),
    ("mlp-activation-auto", F, "### The MLP's activation under `auto`", "| prefill, 2 cores |",
     [CPU + "prefill_mlp_2cores.txt", CPU + "prefill_auto_2cores.txt"], _mlp_activation_cpu),
    ("decode-layout", F, "### The decode step reads the cache as it lies",
     "| SmolLM2, batch 8, cache |", ["results/decode-kv-layout/decode_ab.txt"], _decode_layout),
    ("decode-16-bit-caches", F, "### 16-bit caches", "| batch, cache |",
     ["results/decode-kv-layout/bits_ab.txt"], _decode_bits),
    ("decode-profile", F, "### 16-bit caches", "| stage (SmolLM2, 8 x 4000, bf16 + flags) |",
     ["results/profile-decode/profile.json"], _decode_profile),
    ("short-caches-decode", F, "### Short caches", "| batch x prompt (cache) |",
     ["results/decode-short-cache/short_ab.txt"], _short_caches),
    ("short-caches-prefill", F, "### Short caches", "| batch x prompt | prefill, bf16 + flags |",
     ["results/decode-short-cache/prefill_short_ab.txt", "results/decode-short-cache/auto_ab.txt"],
     _short_prefill),
    ("int8-qk-forms", F, "### The int8 cache's QK product", "| form | time |",
     ["results/decode-int8-forms/int8_qk_ab.txt"], _int8_qk_forms),
    ("decode-block-size", F, "### The decode block size stays 512",
     "| batch x prompt | bf16 cache 1024 / 2048 |", ["results/decode-kv-block/dkv_ab.txt"],
     _decode_blocks),
    ("decode-block-position", F, "### The decode block size stays 512", "| batch, S, p |",
     ["results/decode-kv-block/waste.txt"], _decode_block_waste),
    ("key-offset-cost", F, "## The key offset's cost", "| batch, prompt | flags |",
     ["results/bench-offset-qwen2.5-coder-0.5b/model.json"], _key_offset_cost),
    ("attention-forms", F, "## The blockwise kernel's forms", "| shape | S | q512/kv256",
     ["results/attention-forms/attention_forms.json"],
     lambda: _attention_forms("results/attention-forms/attention_forms.json", floor=False)),
    ("dot-forms", F, "### The dots' forms, one block alone", "| dot | form |",
     ["results/attention-dot-forms/dot_forms.txt"], _dot_forms),
    ("contract-floor", F, "### The contract's floor", "| shape | S | kernel, default blocks |",
     ["results/attention-floor/attention_forms.json"],
     lambda: _attention_forms("results/attention-floor/attention_forms.json", floor=True)),
    *[(f"kv-study-{gin}", P, f"`make study GIN=gin/experiments/study_kv_{gin}.gin",
       "| config | flags | KV cache | attn", [path, path.replace("report.md", "results.json")],
       functools.partial(_kv_study, path))
      for gin, path in (("smollm2", KV_STUDY_SMOLLM2), ("qwen2", KV_STUDY_QWEN),
                        ("gemma3", KV_STUDY_GEMMA))],
    ("kv-studies-side-by-side", P, "The three models side by side (logits KL",
     "| config | flags | KV cache | SmolLM2-135M |",
     [p for path in KV_STUDIES for p in (path, path.replace("report.md", "results.json"))],
     _kv_studies_side_by_side),
    ("kv-cache", P, "SmolLM2-135M, 256 tokens of `json/decoder.py`", "| cache |",
     ["results/kv-cache/kv_cache.json"], _kv_cache),
    ("kv-long", F, "## A quantized KV cache: bytes and the decode step",
     "| batch, prompt | KV cache |", ["results/kv-long/model.json"], _kv_long),
    ("compile-time", F, "## Compile time against depth", "| program | L |",
     ["results/compile-time/compile.json"], _compile_time),
    ("mask-free-branch", F, "### Four more tries", "| case | kernel | with the branch |",
     ["results/attention-xla-cpu/maskfree_ab.txt"], _mask_free),
    ("q-block-prefill", F, "### Four more tries", "| prompt | SmolLM2 | Qwen 0.5B |",
     ["results/attention-xla-cpu/qblock_prefill_ab.txt"], _q_block_prefill),
]


@pytest.mark.parametrize("name,doc,after,header,sources,record", CASES,
                         ids=[c[0] for c in CASES])
def test_doc_table_is_its_record(name, doc, after, header, sources, record):
  """The table of `doc` whose header line starts `header` (the first after the text
  `after`), cell by cell, against the results files in `sources` (see each case above):
  labels and a report's own cells to the character, figures to half a unit in the last
  digit the doc prints. The case reads exactly its named sources."""
  where = f"{doc}, table {header!r} (the record: {', '.join(sources)})"
  rows = _md_table(_text(doc), header, after, where)
  del _READ[:]
  expected = record()
  assert sorted(set(_READ)) == sorted(sources), (name, sorted(set(_READ)))
  problems = _table_problems(where, rows, expected)
  assert not problems, "\n".join(problems)


def test_every_case_names_one_table():
  """No two cases hold the same table, and each names results files that exist: a case
  cannot silently read another table than the one it names."""
  seen = set()
  for name, doc, after, header, sources, _ in CASES:
    text = _file(doc)
    start = text.index(after)
    line_starts = [m.start() for m in re.finditer(r"(?m)^[ \t]*" + re.escape(header), text)]
    first = next(p for p in line_starts if p >= start)
    assert (doc, first) not in seen, name
    seen.add((doc, first))
    for path in sources:
      assert path.startswith("results/") and os.path.isfile(os.path.join(ROOT, path)), (name, path)
  assert len(seen) == len(CASES)


def test_the_number_reader():
  assert _numbers("−0.5") == [(-0.5, 0.05)]
  assert [v for v, _ in _numbers("0.93-0.95x")] == [0.93, 0.95]
  assert _numbers("2.97e-03")[0][0] == 2.97e-3 and math.isclose(_numbers("2.97e-03")[0][1], 5e-6)
  assert [v for v, _ in _numbers("87.5 (82.2–91.4) [175/200]")] == [87.5, 82.2, 91.4, 175, 200]
  assert [v for v, _ in _numbers("1.01x (as `'float32'`)")] == [1.01]
  assert [v for v, _ in _numbers("−7.4 … −2.6")] == [-7.4, -2.6]
  assert _cell_problem("0.0139", 0.013938) is None
  assert _cell_problem("0.0139", 0.01396) is not None
  assert _cell_problem("**95.0 (91.0–97.3)**", [95.0, 91.04, 97.26]) is None
  assert _cells("| `<|endoftext|>` | bf16 |  |") == ["`<|endoftext|>`", "bf16", ""]


# Every other table of README.md and docs/*.md, keyed by (doc, the start of its header
# line), with how many tables of that doc start so and what holds them. A table that is
# in none of these, nor a case above, fails `test_every_table_is_accounted_for`: a new
# results table comes with its record.
ELSEWHERE = {   # results tables checked against their records by another test
    ("README.md", "| measure | preset |"):
        (1, "tests/test_docs.py::test_the_readme_headline_table_is_the_sizes_record"),
    ("docs/contract.md", "| platform |"): (1, "tests/test_platforms.py"),
    **{("docs/performance.md", header): (1, "tests/test_docs.py::"
                                         "test_the_tpu_tables_are_the_device_check_records")
       for header in ("| kernel | median (ms) |", "| phase | kernel run |",
                      "| batch x cache | step |", "| tokens | kernel | remat |")},
    ("docs/performance.md", "| case | row | median (ms) |"): (2, "tests/test_flash.py"),
    ("docs/performance.md", "| case | preset | kernel |"): (1, "tests/test_tpu_model_bench.py"),
    ("docs/performance.md", "| case | row | median (us) |"):
        (1, "tests/test_tpu_decode_bench.py"),
    ("docs/precision.md", "| setting | 0.5B logits KL, held-out |"):
        (1, "tests/test_docs.py::test_the_heldout_table_is_the_study_records"),
    ("docs/training.md", "| setting |"): (6, "tests/test_lrsweep.py"),
    ("docs/training.md", "| a | b | difference |"): (2, "tests/test_lrsweep.py"),
    ("docs/tpu.md", "| kernel | QK matmul |"): (1, "tests/test_tpu_fixtures.py"),
    ("docs/checkpoints.md", "| model | test | tolerance |"):
        (1, "tests/test_docs.py::test_the_parity_table_states_the_tests_tolerances"),
}
REFERENCE = {   # not results: what a knob, stage, preset, command or exit code means
    ("README.md", "| page |"): 1, ("README.md", "| knob"): 1, ("README.md", "| preset |"): 1,
    ("docs/contract.md", "| knob |"): 1, ("docs/contract.md", "| stage | qk=F"): 1,
    ("docs/contract.md", "| stage | what it is |"): 1, ("docs/errors.md", "| code |"): 1,
    ("docs/precision.md", "| stage | qk=F"): 1,
    ("docs/precision.md", "| `precision.key_offset` |"): 1, ("docs/tpu.md", "| command |"): 1,
    # the CPU targets, each with a link to the section whose table holds its figure
    ("docs/performance.md", "| target | measured |"): 1,
}
PRINTED = {     # a command's output pasted as printed (the command is named above it)
    ("docs/audit.md", "| phase | dot |"): 2, ("docs/audit.md", "| phase | layers |"): 1,
    ("docs/audit.md", "| # | attention |"): 2, ("docs/study.md", "| pairs |"): 1,
}
# Results tables with no record checked yet: the runs behind them wrote their files under
# bench/ or runs/, which are not committed. Each stays listed until its run is made
# again into results/ and a case above reads it.
UNCHECKED = {
}


def _all_tables():
  """(doc, line number, header line) of every markdown table in README.md and docs/*.md."""
  import glob
  out = []
  for doc in ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in
                                    glob.glob(os.path.join(ROOT, "docs", "*.md"))):
    lines = _file(doc).split("\n")
    for i in range(len(lines) - 1):
      if (lines[i].lstrip().startswith("|") and "-" in lines[i + 1]
              and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1])):
        out.append((doc, i + 1, lines[i].strip()))
  return out


def test_every_table_is_accounted_for():
  """Every table of README.md and docs/*.md is a case above (checked against its record
  here), checked by the test `ELSEWHERE` names, a reference table, a command's printed
  output, or a results table listed as not yet checked (`UNCHECKED`), each list holding
  exactly as many tables as it says: a table added without its record fails, as does a
  listed one that is gone (the lists shrink as records arrive)."""
  cases = set()
  for name, doc, after, header, sources, _ in CASES:
    text = _file(doc)
    start = text.index(after)
    first = next(m.start() for m in re.finditer(r"(?m)^[ \t]*" + re.escape(header), text)
                 if m.start() >= start)
    cases.add((doc, text[:first].count("\n") + 1))
  kinds = {"ELSEWHERE": {k: n for k, (n, _) in ELSEWHERE.items()}, "REFERENCE": REFERENCE,
           "PRINTED": PRINTED, "UNCHECKED": UNCHECKED}
  seen = {(kind, key): 0 for kind, keys in kinds.items() for key in keys}
  strays = []
  for doc, line, header in _all_tables():
    if (doc, line) in cases:
      continue
    hits = [(kind, key) for kind, keys in kinds.items() for key in keys
            if key[0] == doc and header.startswith(key[1])]
    # the longest matching start wins ('| config | flags |' over '| config |')
    hits.sort(key=lambda h: -len(h[1][1]))
    if not hits:
      strays.append(f"{doc}:{line} {header[:80]}")
      continue
    seen[hits[0]] += 1
  assert not strays, ("tables not accounted for (add a case with their record, or list "
                      "them): " + "; ".join(strays))
  wrong = {f"{kind} {key}": (seen[(kind, key)], kinds[kind][key]) for kind, key in seen
           if seen[(kind, key)] != kinds[kind][key]}
  assert not wrong, f"(found, listed) per key: {wrong}"
  for _, where in ELSEWHERE.values():
    path, _, function = where.partition("::")
    assert os.path.isfile(os.path.join(ROOT, path)), where
    assert not function or f"def {function}(" in _file(path), where
  assert sum(UNCHECKED.values()) == 0

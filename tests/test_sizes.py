"""`attnprec.evals.sizes` (`make sizes`): sizes side by side from finished runs.

Read from the runs committed in results/ (real study and eval outputs, so the reader is
checked against the writers' actual schema): every number in the table is the one in
the source results.json; a size without an eval says "not run"; a partly run eval names
how many items it holds; studies or evals whose settings differ are refused naming the
setting; the runner exits 2 and writes nothing on bad input.
"""
import json
import os
import subprocess
import sys

import pytest

from attnprec.errors import UserError
from attnprec.evals import sizes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUDY = os.path.join(ROOT, "results", "study-qwen2.5-coder-1.5b")
STUDY05 = os.path.join(ROOT, "results", "study-qwen2.5-coder-0.5b")   # the same inputs
RETRIEVAL = os.path.join(ROOT, "results", "retrieval-qwen2.5-coder-0.5b")
HUMANEVAL = os.path.join(ROOT, "results", "humaneval-qwen2.5-coder-0.5b")


@pytest.fixture(autouse=True)
def _figure_drawn_once(request, monkeypatch):
  """The error-by-layer figure is drawn and checked (a PNG) in
  test_the_table_quotes_the_source_results; the other tests' claims are about the table
  and the refusals, so their jobs skip the drawing (about a second of matplotlib each)."""
  if request.node.name != "test_the_table_quotes_the_source_results":
    monkeypatch.setattr(sizes, "plot_layers", lambda labels, rows, presets, path: path)


def _copy(src, dst, edit=None, edit_header=None):
  """A copy of a run directory: results.json (edited by `edit`) and, for an eval, its
  items.jsonl (the header's meta edited by `edit_header`)."""
  os.makedirs(dst)
  with open(os.path.join(src, "results.json")) as f:
    res = json.load(f)
  if edit:
    edit(res)
  with open(os.path.join(dst, "results.json"), "w") as f:
    json.dump(res, f)
  items = os.path.join(src, "items.jsonl")
  if os.path.exists(items):
    with open(items) as f:
      lines = f.read().splitlines()
    header = json.loads(lines[0])
    if edit_header:
      edit_header(header["meta"])
    with open(os.path.join(dst, "items.jsonl"), "w") as f:
      f.write("\n".join([json.dumps(header)] + lines[1:]) + "\n")
  return str(dst)


def _retrieval_copy(dst, keep=lambda rec, k: True, edit=lambda rec, k: None):
  """A copy of the committed 0.5B retrieval run whose records are filtered by `keep` and
  edited in place by `edit` (both given the record and k, its place among its preset's
  records at its length), with each report row's counts recomputed from them (as the
  eval's own report would count them; its comparisons are left as they were)."""
  from attnprec.evals import report
  with open(os.path.join(RETRIEVAL, "items.jsonl")) as f:
    lines = f.read().splitlines()
  recs, seen = [], {}
  for line in lines[1:]:
    r = json.loads(line)
    k = seen[r["preset"], r["length"]] = seen.get((r["preset"], r["length"]), -1) + 1
    if keep(r, k):
      edit(r, k)
      recs.append(r)
  os.makedirs(dst)
  with open(os.path.join(dst, "items.jsonl"), "w") as f:
    f.write("\n".join([lines[0]] + [json.dumps(r) for r in recs]) + "\n")
  with open(os.path.join(RETRIEVAL, "results.json")) as f:
    res = json.load(f)
  for n, s in res["lengths"].items():
    for row in s["presets"]:
      held = {r["item"]: r for r in recs
              if r["preset"] == row["preset"] and r["length"] == int(n)}
      row.update(report.preset_row(row["preset"], held))
  with open(os.path.join(dst, "results.json"), "w") as f:
    json.dump(res, f)
  return str(dst)


def _table_rows(out):
  return {tuple(c.strip() for c in line.strip("|").split("|")[:2]):
          [c.strip() for c in line.strip("|").split("|")[2:]]
          for line in out["table"].splitlines()[2:]}


def test_the_table_quotes_the_source_results(tmp_path):
  out = sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                        studies=(STUDY05, STUDY), humaneval=(HUMANEVAL, ""),
                        retrieval=("", RETRIEVAL))
  rows = _table_rows(out)
  want_kl, want_worst = [], []
  for d in (STUDY05, STUDY):
    with open(os.path.join(d, "results.json")) as f:
      study = json.load(f)
    bf16 = next(c for c in study["configs"] if c["name"] == "bf16")["per_length"][-1]
    want_kl.append(sizes._fmt(bf16['logits_kl']))
    want_worst.append(sizes._fmt(max(bf16['decode_attn_rel_l2'])))
  assert rows[("logits KL vs reference", "bf16")] == want_kl
  assert rows[("attn rel L2 decode, worst layer", "bf16")] == want_worst
  # each input's code is named (these committed runs predate provenance: said so)
  assert out["inputs"]["A"]["study"]["code"] == "no provenance recorded"
  with open(tmp_path / "run" / "sizes.md") as f:
    md = f.read()
  assert f"- A, study: `{STUDY05}`: no provenance recorded" in md
  with open(os.path.join(RETRIEVAL, "results.json")) as f:
    ret = json.load(f)["lengths"]["1024"]
  row = next(r for r in ret["presets"] if r["preset"] == "bf16")
  cmp = next(c for c in ret["comparisons"] if c["a"] == "bf16" and c["b"] == "highest")
  cell = rows[("retrieval 1k tokens, accuracy %", "bf16")]
  assert cell[0] == "not run"
  assert cell[1].startswith(f"{100 * row['accuracy']:.1f} (")
  assert f"{cmp['only_a']} / {cmp['only_b']}, p = " in cell[1]
  he = rows[("HumanEval pass@1 %", "reference (highest)")]
  assert he[0].startswith("53.0 (45.4–60.5)") and he[1] == "not run"
  for name in ("sizes.md", "sizes.json", "sizes_error_by_layer.png"):
    assert (tmp_path / "run" / name).exists()
  with open(tmp_path / "run" / "sizes_error_by_layer.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_partly_run_eval_says_how_many_items_it_holds(tmp_path):
  # 120 of the 200 items at 1k for every preset (records and report alike).
  part = _retrieval_copy(tmp_path / "part",
                         keep=lambda r, k: r["length"] != 1024 or k < 120)
  out = sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                        studies=(STUDY05, STUDY), retrieval=(RETRIEVAL, part))
  cell = _table_rows(out)[("retrieval 1k tokens, accuracy %", "fp32_qk")]
  assert "of 200" not in cell[0] and "120 of 200 items" in cell[1]


@pytest.mark.parametrize("kind,edit,needle", [
    ("study", lambda r: r["settings"].update(batch=4), "batch"),
    ("study", lambda r: r["text"].update(sha256="0" * 16), "text"),
    ("retrieval", lambda r: r.update(kernel="dot_product"), "kernel"),
])
def test_runs_of_different_settings_are_refused(tmp_path, kind, edit, needle):
  src = STUDY if kind == "study" else RETRIEVAL
  other = _copy(src, tmp_path / "other", edit)
  kw = (dict(studies=(STUDY, other)) if kind == "study"
        else dict(studies=(STUDY05, STUDY), retrieval=(RETRIEVAL, other)))
  with pytest.raises(UserError, match=needle):
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"), **kw)
  assert not (tmp_path / "run").exists()


def test_bad_arguments(tmp_path):
  with pytest.raises(UserError, match="at least two"):
    sizes.sizes_job(run_dir=str(tmp_path), labels=("A",), studies=(STUDY,))
  with pytest.raises(UserError, match="1 entries for 2 labels"):
    sizes.sizes_job(run_dir=str(tmp_path), labels=("A", "B"), studies=(STUDY,))
  with pytest.raises(UserError, match="not in every study"):
    sizes.sizes_job(run_dir=str(tmp_path), labels=("A", "B"), studies=(STUDY05, STUDY),
                    presets=("fp32_attention",))


def test_runner_exit_2_on_a_missing_run_and_nothing_written(tmp_path):
  run = tmp_path / "run"
  proc = subprocess.run(
      [sys.executable, "runners/sizes.py",
       f"--gin.sizes.studies=('{STUDY}', '{tmp_path / 'missing'}')", f"--run_dir={run}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=ROOT))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "has no results.json" in proc.stderr and "Traceback" not in proc.stderr
  assert not run.exists()


def test_out_of_range_counts_and_non_finite_items_are_not_passed_as_numbers(tmp_path):
  for bad in (0, -5, True, 1.5):
    with pytest.raises(UserError, match="retrieval_items"):
      sizes.sizes_job(run_dir=str(tmp_path / "r"), labels=("A", "B"),
                      studies=(STUDY05, STUDY), retrieval_items=bad)
  with pytest.raises(UserError, match="presets is empty"):
    sizes.sizes_job(run_dir=str(tmp_path / "r"), labels=("A", "B"),
                    studies=(STUDY05, STUDY), presets=())

  def nan_items(rec, k):    # 3 items per preset at 1k whose logits were not finite
    if rec["length"] == 1024 and k < 3:
      rec["finite"] = rec["correct"] = False   # as the eval writes one: never correct
  bad = _retrieval_copy(tmp_path / "nan", edit=nan_items)
  out = sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                        studies=(STUDY05, STUDY), retrieval=(RETRIEVAL, bad))
  cell = _table_rows(out)[("retrieval 1k tokens, accuracy %", "bf16")]
  assert "non-finite" not in cell[0] and "3 non-finite (not scored)" in cell[1]
  assert sizes._fmt(float("nan")) == "non-finite"


def _he_records():
  with open(os.path.join(HUMANEVAL, "items.jsonl")) as f:
    return [json.loads(line) for line in f.read().splitlines()[1:]]


def _partial_humaneval(part, keep):
  """A copy of the committed HumanEval run holding only keep[preset]'s problems. Its
  report names the presets and counts the records it holds (as the eval's own report
  would); its comparisons are left as they were (the shared rows are recomputed)."""
  with open(os.path.join(HUMANEVAL, "items.jsonl")) as f:
    lines = f.read().splitlines()
  os.makedirs(part)
  with open(part / "items.jsonl", "w") as f:
    f.write(lines[0] + "\n")
    for line in lines[1:]:
      r = json.loads(line)
      if r["item"] in keep.get(r["preset"], ()):
        f.write(line + "\n")
  with open(os.path.join(HUMANEVAL, "results.json")) as f:
    res = json.load(f)
  from attnprec.evals import report
  held = {}
  for line in lines[1:]:
    r = json.loads(line)
    if r["item"] in keep.get(r["preset"], ()):
      held.setdefault(r["preset"], {})[r["item"]] = r
  res["presets"] = [dict(r, **report.preset_row(r["preset"], held[r["preset"]]))
                    for r in res["presets"] if r["preset"] in keep]
  with open(part / "results.json", "w") as f:
    json.dump(res, f)
  return part


def test_humaneval_runs_on_different_problems_are_also_compared_on_the_shared_ones(tmp_path):
  """A run on a prefix of the problems (as the 1.5B's): the HumanEval rows are repeated
  over the problems both sizes ran, recomputed from items.jsonl; the expected cells are
  counted here directly from the records, not through attnprec.evals.report."""
  recs = _he_records()
  keep = sorted({r["item"] for r in recs})[:24]
  part = _partial_humaneval(tmp_path / "part", {"highest": keep, "bf16": keep})
  out = sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                        studies=(STUDY05, STUDY), humaneval=(HUMANEVAL, str(part)),
                        presets=("bf16", "fp32_qk"))
  assert out["humaneval_matched_problems"] == 24
  rows = _table_rows(out)
  measure = "HumanEval pass@1 %, the 24 problems every size ran"
  for preset, row in (("highest", "reference (highest)"), ("bf16", "bf16")):
    k = sum(r["correct"] for r in recs if r["preset"] == preset and r["item"] in keep)
    assert [c.split(" (")[0] for c in rows[(measure, row)]] == [f"{100 * k / 24:.1f}"] * 2
  only = {p: {r["item"]: r["correct"] for r in recs if r["preset"] == p and r["item"] in keep}
          for p in ("highest", "bf16")}
  a = sum(only["bf16"][i] and not only["highest"][i] for i in keep)
  b = sum(only["highest"][i] and not only["bf16"][i] for i in keep)
  assert all(f"; {a} / {b}, p = " in c for c in rows[(measure, "bf16")])
  toks = {p: {r["item"]: r["tokens"] for r in recs if r["preset"] == p and r["item"] in keep}
          for p in ("highest", "bf16")}
  identical = sum(toks["bf16"][i] == toks["highest"][i] for i in keep)
  assert all(c.endswith(f", {100 * identical / 24:.0f}% token-identical")
             for c in rows[(measure, "bf16")])
  # fp32_qk is in A's records, not in B's: B says so; A's column is over the same 24.
  assert rows[(measure, "fp32_qk")][1] == "not run"
  assert rows[(measure, "fp32_qk")][0] != "not run"
  # Runs over the same problems get no second set of rows (a copy: one run for two
  # sizes is refused).
  with pytest.raises(UserError, match="the same run directory"):
    sizes.sizes_job(run_dir=str(tmp_path / "run2"), labels=("A", "B"),
                    studies=(STUDY05, STUDY), humaneval=(HUMANEVAL, HUMANEVAL))
  same = sizes.sizes_job(run_dir=str(tmp_path / "run2"), labels=("A", "B"),
                         studies=(STUDY05, STUDY),
                         humaneval=(HUMANEVAL, _copy(HUMANEVAL, tmp_path / "full")))
  assert same["humaneval_matched_problems"] is None
  assert not any("every size ran" in m for m, _ in _table_rows(same))


def test_a_preset_run_on_more_problems_is_also_compared_on_all_of_them(tmp_path):
  """B holds the reference and bf16 on 24 problems, fp32_qk on 8 (as the 1.5B's run):
  the rows over every preset's 8 stay, and bf16 gets its own rows over the 24; the
  expected cells are counted here directly from the records."""
  recs = _he_records()
  items = sorted({r["item"] for r in recs})
  part = _partial_humaneval(tmp_path / "part", {"highest": items[:24], "bf16": items[:24],
                                                "fp32_qk": items[:8]})
  out = sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                        studies=(STUDY05, STUDY), humaneval=(HUMANEVAL, str(part)),
                        presets=("bf16", "fp32_qk"))
  assert out["humaneval_matched_problems"] == 8
  assert out["humaneval_matched_by_preset"] == {"bf16": 24}
  rows = _table_rows(out)
  wide = "HumanEval pass@1 %, the 24 problems every size ran bf16 on"
  assert (wide, "fp32_qk") not in rows
  for preset, row in (("highest", "reference (highest)"), ("bf16", "bf16")):
    k = sum(r["correct"] for r in recs if r["preset"] == preset and r["item"] in items[:24])
    assert [c.split(" (")[0] for c in rows[(wide, row)]] == [f"{100 * k / 24:.1f}"] * 2
  k = sum(r["correct"] for r in recs if r["preset"] == "fp32_qk" and r["item"] in items[:8])
  narrow = "HumanEval pass@1 %, the 8 problems every size ran"
  assert [c.split(" (")[0] for c in rows[(narrow, "fp32_qk")]] == [f"{100 * k / 8:.1f}"] * 2


@pytest.mark.parametrize("src,key", [(HUMANEVAL, "prompt"), (HUMANEVAL, "timeout_s"),
                                     (RETRIEVAL, "seed")])
def test_runs_whose_records_differ_in_a_setting_results_json_lacks_are_refused(
    tmp_path, src, key):
  """The prompt, the sandbox timeout and the items' seed are in the records' header
  only (not in results.json): runs differing there are refused too."""
  other = _copy(src, tmp_path / "other",
                edit_header=lambda m: m.update({key: "something else"}))
  kind = "humaneval" if src == HUMANEVAL else "retrieval"
  with pytest.raises(UserError, match=f"differ in {key}"):
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                    studies=(STUDY05, STUDY), **{kind: (src, other)})
  assert not (tmp_path / "run").exists()
  # The model, its file and the batch size may differ (that is the comparison).
  same = _copy(src, tmp_path / "same", edit_header=lambda m: m.update(
      model="another", source="another file", batch=3))
  sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                  studies=(STUDY05, STUDY), **{kind: (src, same)})


@pytest.mark.parametrize("edit,says", [
    (lambda res: res["presets"][1].update(accuracy=3.0), "with accuracy = 3.0"),
    (lambda res: res["presets"][1].update(wilson95=[5, -2]), "with wilson95 = [5, -2]"),
    (lambda res: res["comparisons"][0].update(mcnemar_p=7.5),
     "mcnemar_p is 7.5, not a probability"),
    (lambda res: res["comparisons"][0].update(only_a=-3), "only_a is -3, not a count"),
    (lambda res: res["comparisons"][0].update(only_b="x"), "only_b is 'x', not a count"),
])
def test_a_report_s_figures_its_records_do_not_give_are_refused(tmp_path, edit, says):
  """Not only the counts: every figure of a row the table quotes (accuracy, its
  interval) is recomputed from the records, and a paired comparison must be one a report
  writes (counts adding up, a p-value in [0, 1]); an edited one is refused, naming it."""
  other = _copy(HUMANEVAL, tmp_path / "other", edit)
  with pytest.raises(UserError, match="an edited report") as e:
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                    studies=(STUDY05, STUDY), humaneval=(HUMANEVAL, other))
  assert says in str(e.value)
  assert not (tmp_path / "run").exists()


def test_records_that_do_not_match_the_report_are_refused(tmp_path):
  """results.json reporting other counts than items.jsonl holds (a run in progress: the
  report is rewritten only after each preset) is refused, not half-quoted."""
  def fewer(res):
    res["presets"][1]["items"] = 40
  other = _copy(HUMANEVAL, tmp_path / "other", fewer)
  with pytest.raises(UserError, match="run still in progress"):
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                    studies=(STUDY05, STUDY), humaneval=(HUMANEVAL, other))
  assert not (tmp_path / "run").exists()


def test_retrieval_records_that_do_not_match_the_report_are_refused(tmp_path):
  """A retrieval report whose counts its records do not reproduce is refused, naming the
  row: records marked non-finite after the report was written (the report would pass
  them as scored), and records of a length the report does not hold yet (a run stopped
  partway through 8k, its report last written after 4k)."""
  edited = _retrieval_copy(tmp_path / "edited")
  with open(os.path.join(edited, "items.jsonl")) as f:
    lines = f.read().splitlines()
  recs = [json.loads(line) for line in lines[1:]]
  at_2k = [r for r in recs if r["preset"] == "bf16" and r["length"] == 2048]
  for r in at_2k[:2]:
    r["finite"] = r["correct"] = False   # as the eval writes one: never correct
  with open(os.path.join(edited, "items.jsonl"), "w") as f:
    f.write("\n".join([lines[0]] + [json.dumps(r) for r in recs]) + "\n")
  with pytest.raises(UserError, match="run still in progress") as e:
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                    studies=(STUDY05, STUDY), retrieval=(RETRIEVAL, edited))
  assert "bf16 at 2048" in str(e.value) and "(200, 2, " in str(e.value)
  def stopped(res):
    del res["lengths"]["8192"]
  early = _copy(RETRIEVAL, tmp_path / "early", stopped)
  with pytest.raises(UserError, match="report none"):
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                    studies=(STUDY05, STUDY), retrieval=(RETRIEVAL, early))
  assert not (tmp_path / "run").exists()


def test_records_without_a_header_are_refused_naming_the_file(tmp_path):
  """An eval directory whose items.jsonl has no header line (not written by `make eval`)
  is refused naming that file, and nothing is written."""
  other = _copy(HUMANEVAL, tmp_path / "other")
  items = os.path.join(other, "items.jsonl")
  with open(items) as f:
    lines = f.read().splitlines()
  with open(items, "w") as f:
    f.write("\n".join(lines[1:]) + "\n")
  with pytest.raises(UserError, match="no header line") as e:
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                    studies=(STUDY05, STUDY), humaneval=(HUMANEVAL, other))
  assert items in str(e.value) and "--run_dir" not in str(e.value)
  assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("edit,says", [
    (lambda res: res.clear() or res.update(x=[1, 2]), "'settings' is missing"),
    (lambda res: res["configs"][0]["per_length"][-1].update(nll=float("nan")),
     "per_length[-1].nll is nan, not a finite number"),
    (lambda res: res["configs"][0]["per_length"][-1].update(decode_attn_rel_l2=[]),
     "decode_attn_rel_l2 is [], not a list of per-layer errors"),
    (lambda res: res["configs"][0]["per_length"][-1].update(logits_kl=-0.5),
     "per_length[-1].logits_kl is -0.5, below 0 (it cannot be negative)"),
    (lambda res: res["reference"]["per_length"][-1].update(nll=-3.0),
     "reference.per_length[-1].nll is -3.0, below 0"),
    (lambda res: res.update(bogus=1), "it has the key 'bogus', which a study does not write"),
])
def test_a_study_results_file_edited_or_cut_is_refused_naming_the_field(tmp_path, edit,
                                                                      says):
  bad = _copy(STUDY, tmp_path / "study", edit=edit)
  with pytest.raises(UserError, match="is not the results file a study writes") as e:
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"), studies=(STUDY, bad))
  assert says in str(e.value) and bad in str(e.value)
  assert not (tmp_path / "run").exists()


def test_a_results_file_that_is_a_list_or_not_utf8_or_another_runners_is_refused(tmp_path):
  bad = tmp_path / "list"
  bad.mkdir()
  (bad / "results.json").write_text("[1, 2, 3]")
  with pytest.raises(UserError, match="a JSON list, not an object"):
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                    studies=(STUDY, str(bad)))
  (bad / "results.json").write_bytes(b'{"a": 1}\xff\xfe')
  with pytest.raises(UserError, match="is not UTF-8 text"):
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                    studies=(STUDY, str(bad)))
  with pytest.raises(UserError, match="a retrieval run's results, not a HumanEval run's"):
    sizes.sizes_job(run_dir=str(tmp_path / "run"), labels=("A", "B"),
                    studies=(STUDY05, STUDY), humaneval=(HUMANEVAL, RETRIEVAL))


def test_one_study_for_two_sizes_is_refused_and_inputs_of_different_code_are_said(tmp_path):
  """The same run directory, or two studies of one model, for two sizes: refused (the
  columns would compare a model with itself). Inputs naming different code: the report
  says so, and sizes.json records each input's provenance."""
  with pytest.raises(UserError, match="the same run directory"):
    sizes.sizes_job(run_dir=str(tmp_path / "r1"), labels=("A", "B"), studies=(STUDY, STUDY))
  copy = _copy(STUDY, tmp_path / "copy")
  with pytest.raises(UserError, match="studies runs of the same model"):
    sizes.sizes_job(run_dir=str(tmp_path / "r2"), labels=("A", "B"), studies=(STUDY, copy))
  assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
  prov = {"source": "0123456789abcdef", "commit": "abc1234", "clean": True}
  stamped = _copy(STUDY, tmp_path / "stamped", edit=lambda r: r.update(provenance=prov))
  out = sizes.sizes_job(run_dir=str(tmp_path / "r3"), labels=("A", "B"),
                        studies=(STUDY05, stamped))
  assert out["inputs"]["B"]["study"]["provenance"] == prov
  with open(tmp_path / "r3" / "sizes.md") as f:
    md = f.read()
  assert "B, study: `" + stamped + "`: code 0123456789abcdef (commit abc1234)" in md
  assert "These results come from different code, or name none" in md

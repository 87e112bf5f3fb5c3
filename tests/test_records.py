"""What a resumed evaluation reads back is checked, never taken at its word
(`attnprec.evals.records`): every record against its task's schema, one record per
(preset, item), UTF-8 text; each failure a UserError naming the file, the line and the
field. Fed the edits a person or another program makes to a records file."""
import json

import pytest

from attnprec.errors import UserError
from attnprec.evals import records

META = {"task": "humaneval", "model": "m"}
GOOD = {"preset": "bf16", "item": "HumanEval/0", "correct": True, "finite": True,
        "tokens": [1, 2], "kind": "passed"}


def _write(path, *recs, header=True):
  lines = ([json.dumps({"meta": META})] if header else []) + [
      r if isinstance(r, str) else json.dumps(r) for r in recs]
  path.write_text("".join(line + "\n" for line in lines))


def test_good_records_resume_and_a_line_cut_short_is_dropped(tmp_path):
  path = tmp_path / "items.jsonl"
  _write(path, GOOD, dict(GOOD, item="HumanEval/1"))
  with open(path, "a") as f:
    f.write('{"preset": "bf16", "item": "Huma')                  # a kill mid-write
  log = records.ItemLog(str(path), META)
  assert set(log.records()) == {("bf16", "HumanEval/0"), ("bf16", "HumanEval/1")}
  assert path.read_text().endswith("\n")


@pytest.mark.parametrize("edit,says", [
    (dict(GOOD, correct="false"), "field 'correct' is 'false' (str), not a bool"),
    ('{"preset": "bf16", "item": "HumanEval/0", "correct": NaN, "finite": true, '
     '"tokens": [], "kind": "x"}', "field 'correct' is nan (float), not a bool"),
    ({k: v for k, v in GOOD.items() if k != "finite"}, "field 'finite' is missing"),
    (dict(GOOD, correct=1), "field 'correct' is 1 (int), not a bool"),
    ("[1, 2, 3]", "it is a JSON list, not an object"),
    ('{"preset": "bf16", "item"', "not a JSON record"),
    ('{"preset": "bf16", "item": "H/2", "correct": ' + "1" * 5000 + '}',
     "not a JSON record we read"),
    ('{"a": ' * 50000 + "1" + "}" * 50000, "JSON nested too deep"),
    (dict(GOOD, item="HumanEval/\ud800"), "field 'item' holds '\\ud800'"),
    (dict(GOOD, finite=False), "'correct' is true while 'finite' is false"),
    (dict(GOOD, verdict="pass"), "field 'verdict' is not one a humaneval record has"),
    (json.dumps(GOOD)[:-1] + ', "correct": false}', "the key 'correct' is given twice"),
])
def test_an_edited_record_is_an_error_naming_the_line_and_field(tmp_path, edit, says):
  path = tmp_path / "items.jsonl"
  _write(path, dict(GOOD, item="HumanEval/1"), edit)
  with pytest.raises(UserError, match="line 3") as e:
    records.ItemLog(str(path), META)
  assert says in str(e.value) and str(path) in str(e.value)


def test_two_different_records_of_one_item_conflict(tmp_path):
  path = tmp_path / "items.jsonl"
  _write(path, GOOD, dict(GOOD, correct=False))
  with pytest.raises(UserError, match=r"line 3: a second, different record of preset "
                                      r"'bf16', item 'HumanEval/0' \(the first is line 2\)"):
    records.ItemLog(str(path), META)
  _write(path, GOOD, GOOD)                    # the same record twice: one record
  assert len(records.ItemLog(str(path), META).records()) == 1


def test_a_file_that_is_not_utf8_is_an_error(tmp_path):
  path = tmp_path / "items.jsonl"
  path.write_bytes(json.dumps({"meta": META}).encode() + b"\n\xff\xfe\n")
  with pytest.raises(UserError, match=r"is not UTF-8 text \(line 2, byte"):
    records.ItemLog(str(path), META)


def test_the_retrieval_schema_holds_its_own_fields(tmp_path):
  meta = {"task": "retrieval"}
  path = tmp_path / "items.jsonl"
  rec = {"preset": "a", "item": "L1-c0-q0", "correct": True, "finite": True,
         "length": 1024, "tokens": 1000, "close_ok": True}
  path.write_text(json.dumps({"meta": meta}) + "\n" + json.dumps(dict(rec, length="1k"))
                  + "\n")
  with pytest.raises(UserError, match="field 'length' is '1k' \\(str\\), not a int"):
    records.ItemLog(str(path), meta)


def test_a_retrieval_verdict_its_own_tokens_contradict_is_refused(tmp_path):
  """A verdict edited by hand: 'correct' must be what the record's argmax and gold token
  ids say (`retrieval.judge`)."""
  meta = {"task": "retrieval"}
  rec = {"preset": "a", "item": "L1024/c0/q0", "correct": False, "finite": True,
         "length": 1024, "tokens": 1000, "close_ok": True, "argmax": [5, 7], "gold": [5, 8]}
  path = tmp_path / "items.jsonl"
  path.write_text(json.dumps({"meta": meta}) + "\n" + json.dumps(rec) + "\n")
  assert len(records.ItemLog(str(path), meta).records()) == 1
  path.write_text(json.dumps({"meta": meta}) + "\n" + json.dumps(dict(rec, correct=True))
                  + "\n")
  with pytest.raises(UserError, match="line 2: 'correct' is True while its argmax tokens "
                                      "differ from the gold tokens"):
    records.ItemLog(str(path), meta)


@pytest.mark.parametrize("edit,says", [
    (dict(length=4096), "field 'length' is 4096 while its item id 'L512/c0/q1' says 512"),
    (dict(tokens=-5), "field 'tokens' is -5, not a prompt of 1 to 512 tokens"),
    (dict(tokens=600), "field 'tokens' is 600, not a prompt of 1 to 512 tokens"),
    (dict(pairs=-1), "field 'pairs' is -1, not a count"),
    (dict(relative=float("nan")), "field 'relative' is nan, not a position in [0, 1]"),
    (dict(seconds=float("inf")), "field 'seconds' is inf, not a time in seconds"),
    (dict(margin=float("inf")), "field 'margin' is inf while 'finite' is true"),
    (dict(item="L512-c0-q1"), "not an item id L<length>/c<i>/q<j>"),
    (dict(correct_by_hand=True), "field 'correct_by_hand' is not one a retrieval record has"),
])
def test_a_retrieval_record_whose_fields_are_impossible_is_refused(tmp_path, edit, says):
  """A record's fields agree with its item id and are possible: an edited length, a
  negative count, a NaN position or time is refused naming the line and the field, never
  counted (a doubled time would be quoted)."""
  meta = {"task": "retrieval"}
  rec = {"preset": "a", "item": "L512/c0/q1", "correct": True, "finite": True,
         "length": 512, "context": 0, "question": 1, "tokens": 480, "pairs": 6,
         "relative": 0.5, "seconds": 2.0, "margin": 1.5, "close_ok": True,
         "argmax": [5], "gold": [5]}
  path = tmp_path / "items.jsonl"
  path.write_text(json.dumps({"meta": meta}) + "\n" + json.dumps(rec) + "\n")
  assert len(records.ItemLog(str(path), meta).records()) == 1
  path.write_text(json.dumps({"meta": meta}) + "\n" + json.dumps(dict(rec, **edit)) + "\n")
  with pytest.raises(UserError, match="line 2") as e:
    records.ItemLog(str(path), meta)
  assert says in str(e.value)


def test_integers_past_int32_and_text_that_is_not_utf8_are_refused_by_rule():
  """One mechanism for every configurable (`attnprec.checks`): integer rules stop at
  int32 unless they say otherwise, string rules take valid text only."""
  from attnprec import checks
  assert checks.at_least(1)(2 ** 31 - 1) is None
  assert "<= 2147483647 (int32)" in checks.at_least(1)(2 ** 31)
  assert "<= 2147483647" in checks.integer(min=0)(10 ** 30)
  assert checks.string("a prompt") is None
  assert "lone surrogate '\\ud800' at character 2" in checks.string("ab\ud800c")


@pytest.mark.parametrize("content,says", [
    ('[{"step": 1}]\n', "line 1: a JSON list, not an object"),
    ('{"step": 1, "loss": 2.0}\n{"step": "2"}\n', "line 2: its 'step' is '2'"),
    ('{"step": 1}\nnot json\n', "line 2: not JSON"),
    ('{"step": 1}\n{"step": 1}\n', "line 2: its 'step' is 1, not above the line before's 1"),
    ('{"step": 2}\n{"step": -5}\n', "line 2: its 'step' is -5, not above"),
    ('{"step": 1, "loss": "abc"}\n', "line 1: its 'loss' is 'abc', not a number"),
    ('{"step": 1, "loss": NaN, "skipped_steps": 0}\n', "while the run skipped no step"),
    ('{"step": 1, "loss": ' + "9" * 5000 + '}\n', "line 1: not JSON we read"),
    ('{"step": 1, "loss": "x", "loss": 2.0}\n', "the key 'loss' is given twice"),
    ('{"step": 1, "loss": 2.0, "accuracy": -5}\n', "its 'accuracy' is -5, not a fraction"),
    ('{"step": 1, "loss": 2.0, "eval_accuracy": 7}\n', "its 'eval_accuracy' is 7, not a"),
    ('{"step": 1, "loss": -1.0}\n', "its 'loss' is -1.0, not a loss"),
    ('{"step": 9007199254740993, "loss": 2}\n', "past the most steps a training runs"),
    ('{"step": 1, "loss": 2.0, "bogus": 1}\n', "line 1: its 'bogus' is not a figure a "
                                                "training logs"),
])
def test_a_metrics_file_that_is_not_a_trainings_is_an_error(tmp_path, content, says):
  from attnprec import plotting, runs
  (tmp_path / "metrics.jsonl").write_text(content)
  with pytest.raises(UserError, match=says):
    runs.MetricsWriter(str(tmp_path)).rewind(5)
  with pytest.raises(UserError, match=says):
    plotting.read_metrics(str(tmp_path))


def test_a_skipped_steps_non_finite_loss_is_read():
  from attnprec import runs
  import tempfile
  with tempfile.TemporaryDirectory() as d:
    with open(f"{d}/metrics.jsonl", "w") as f:
      f.write('{"step": 1, "loss": NaN, "skipped_steps": 1}\n')
    assert len(runs.read_metrics(f"{d}/metrics.jsonl")[0]) == 1


def test_metrics_rewind_keeps_earlier_steps_and_drops_a_cut_line(tmp_path):
  from attnprec import runs
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "loss": 3.0}\n{"step": 5, "loss": 2.0}\n{"step": 9')
  runs.MetricsWriter(str(tmp_path)).rewind(4)
  assert path.read_text() == '{"step": 1, "loss": 3.0}\n'


def test_a_comparison_of_records_from_different_code_says_so():
  from attnprec.evals import report
  same = {"a": {"1": {"code_version": "abc"}}, "b": {"1": {"code_version": "abc"}}}
  assert report.mixed_code_note(report.code_versions(same)) is None
  mixed = {"a": {"1": {"code_version": "abc"}}, "b": {"1": {}, "2": {"code_version": "def"}}}
  note = report.mixed_code_note(report.code_versions(mixed))
  assert "more than one version of the code" in note and "b: def, unrecorded" in note


def test_a_header_value_of_another_type_is_refused(tmp_path):
  """`"seed": 0.0` where the run has the integer 0 (an edited header) is not the same
  setting: refused naming the key and both types."""
  path = tmp_path / "items.jsonl"
  records.ItemLog(str(path), {"seed": 0, "task": "retrieval"})
  path.write_text(path.read_text().replace('"seed": 0', '"seed": 0.0'))
  with pytest.raises(UserError, match=r"seed = 0.0 \(float\), but this run has seed = 0 "
                                      r"\(int\)"):
    records.ItemLog(str(path), {"seed": 0, "task": "retrieval"})
  path.write_text('{"meta": {"seed": 0, "task": "retrieval"}, "note": 1}\n')
  with pytest.raises(UserError, match=r"items.jsonl, line 1: the header holds \['note'\] "
                                      r"beside 'meta'"):
    records.ItemLog(str(path), {"seed": 0, "task": "retrieval"})


def test_a_key_given_twice_in_a_file_a_run_reads_back_is_refused(tmp_path):
  """json keeps the last of two equal keys: an edited model.json would run another model,
  a run record naming two runners would be read as the second. Every reader refuses it
  (`readback.unique_keys`), naming the file and the key."""
  from attnprec import runs
  from attnprec.checkpoints import trained
  run = tmp_path / "run"
  run.mkdir()
  (run / runs.OWNER_FILE).write_text('{"runner": "study", "runner": "decode"}')
  with pytest.raises(UserError, match=r"run\.json.*the key 'runner' is given twice"):
    runs.owner(str(run))
  for record in ('{"runner": "nosuch"}', '{"runner": "DECODE"}',
                 '{"runner": "decode", "extra": 1}'):
    (run / runs.OWNER_FILE).write_text(record)
    with pytest.raises(UserError, match=r"must name the runner .* NAME one of audit, bench"):
      runs.owner(str(run))
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "model.json").write_text('{"rope_base": 10000.0, "rope_base": 500.0}')
  (ckpt / "params.npz").write_bytes(b"PK")       # read after model.json
  with pytest.raises(UserError, match=r"model\.json.*the key 'rope_base' is given twice"):
    trained.load_run(str(ckpt))


def test_metrics_without_any_loss_are_not_plotted(tmp_path):
  """Records a training did not write (no loss in any): refused, not an empty plot."""
  from attnprec import plotting
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "grad_norm": 3}\n')
  with pytest.raises(UserError, match="holds no 'loss' in any of its 2 records"):
    plotting.plot_run(str(tmp_path))
  assert not (tmp_path / "metrics.png").exists()


def test_a_train_run_file_that_is_not_a_regular_file_is_named_as_such(tmp_path):
  """params.npz replaced by a directory: said as it is (it was "has no params.npz ...
  interrupted?")."""
  from attnprec.checkpoints import trained
  (tmp_path / "model.json").write_text("{}")
  (tmp_path / "params.npz").mkdir()
  with pytest.raises(UserError, match=r"params\.npz' is not a regular file"):
    trained.load_run(str(tmp_path))

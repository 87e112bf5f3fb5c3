"""One per-item results file for every task evaluation: written as items finish, resumed.

    log = ItemLog(os.path.join(run_dir, "items.jsonl"), meta={"task": "humaneval", ...})
    done = log.records()                 # {(preset, item_id): record} of earlier runs
    for ...:
      log.write({"preset": "bf16", "item": "HumanEval/0", "passed": True, ...})

Each record is one JSON line, appended with a flush and an fsync as soon as its item
finishes, so a killed run loses at most the items in flight and a rerun skips what is
already there. A line cut short by a kill (no newline at the end, or not valid JSON) is
dropped when the file is opened, and the file is rewritten atomically without it, so the
next append never glues a record onto half a line.

The first line is a header `{"meta": {...}}`: what the records were computed with (the
task, the model, its settings). A rerun whose settings differ refuses to mix its records
with the old ones (a `UserError` naming the first setting that differs) instead of
reporting a table half of which came from another configuration.
"""
import json
import os
from typing import Any, Dict, Iterable, Optional, Tuple

from attnprec import readback, runs
from attnprec.errors import UserError

Key = Tuple[str, str]


def _same(a, b) -> bool:
  """Equal as JSON values, type included: 0.0 is not the integer 0, true is not 1."""
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(map(_same, a, b))
  return type(a) is type(b) and a == b


class ItemLog:
  """Append-only JSONL of per-item records keyed by (preset, item)."""

  def __init__(self, path: str, meta: Dict[str, Any]):
    self.path = path
    self.meta = json.loads(json.dumps(meta, default=runs._jsonable))   # plain data
    self._records: Dict[Key, Dict[str, Any]] = {}
    if os.path.isfile(path):
      self._load()
    else:
      runs.atomic_write(path, json.dumps({"meta": self.meta}) + "\n")

  def _load(self) -> None:
    header, self._records, repaired, text = parse(self.path)
    self._check_meta(header)
    if repaired != text:
      runs.atomic_write(self.path, repaired)

  def _check_meta(self, old: Dict[str, Any]) -> None:
    now = json.loads(json.dumps(self.meta, default=str))
    for key in sorted(set(old) | set(now)):
      if not _same(old.get(key), now.get(key)):
        raise UserError(
            f"{self.path} holds results computed with {key} = {_short(old.get(key))} "
            f"({type(old.get(key)).__name__}), but this run has {key} = "
            f"{_short(now.get(key))} ({type(now.get(key)).__name__}); results of different "
            f"settings are never mixed. Use another --run_dir, or delete the file to start "
            f"over.")

  def records(self) -> Dict[Key, Dict[str, Any]]:
    return dict(self._records)

  def has(self, preset: str, item: str) -> bool:
    return (preset, str(item)) in self._records

  def write(self, record: Dict[str, Any]) -> None:
    """Appends one finished item (durably: flush + fsync)."""
    if "preset" not in record or "item" not in record:
      raise ValueError("a record needs 'preset' and 'item'")
    line = json.dumps(record, default=runs._jsonable)
    try:
      with open(self.path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())
    except OSError as e:
      raise UserError(f"Cannot write results to {self.path}: {e.strerror}. The records "
                      f"written before this one are intact; free space or choose another "
                      f"--run_dir, then run again to resume.") from None
    self._records[(record["preset"], str(record["item"]))] = record

  def of_preset(self, preset: str, items: Optional[Iterable[str]] = None):
    """{item: record} of one preset (restricted to `items` when given)."""
    want = None if items is None else {str(i) for i in items}
    return {i: r for (p, i), r in self._records.items()
            if p == preset and (want is None or i in want)}


# What a record must hold, per task (the header's 'task'): field -> its type. Every
# record is checked when the file is read (`check_record`): a field missing or of
# another type (a verdict edited to the string "false", or to NaN) is an error naming
# the file, the line and the field, never a count.
COMMON = {"preset": str, "item": str, "correct": bool, "finite": bool}
SCHEMAS = {
    "humaneval": dict(COMMON, tokens=list, kind=str),
    "retrieval": dict(COMMON, length=int, tokens=int, close_ok=bool),
}
# Every field a record of the task may hold (what `humaneval_eval` / `retrieval_eval`
# write): a field outside it is not one this program wrote (an edit, another tool's
# record), and is refused like a missing one.
FIELDS = {
    "humaneval": frozenset(SCHEMAS["humaneval"]) | {
        "answer", "stopped", "batch_steps", "batch_seconds", "batch_rows",
        "compile_seconds", "detail", "code", "fence_closed", "exec_seconds", "batch_id",
        "code_version"},
    "retrieval": frozenset(SCHEMAS["retrieval"]) | {
        "context", "question", "index", "pairs", "relative", "where", "closed", "argmax",
        "gold", "argmax_close", "margin", "first_wrong", "seconds", "batch_seconds",
        "batch_rows", "prefill_seconds", "compile_seconds", "code_version", "precision"},
}


def check_record(record, task: Optional[str]) -> Optional[str]:
  """None if `record` is a record of `task` (`SCHEMAS`), else what is wrong with it."""
  if not isinstance(record, dict):
    return f"it is a JSON {type(record).__name__}, not an object"
  schema = SCHEMAS.get(task, {"preset": str, "item": str})
  for field, kind in schema.items():
    if field not in record:
      return f"field {field!r} is missing (a {task} record has " \
             f"{', '.join(repr(f) for f in schema)})"
    value = record[field]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is str and field == "item" and isinstance(value, int):
      ok = True                                  # item ids may be written as numbers
    if not ok:
      return (f"field {field!r} is {value!r} ({type(value).__name__}), not a "
              f"{kind.__name__}")
    if isinstance(value, str) and readback.text_problem(value):
      return f"field {field!r} {readback.text_problem(value)}"
  unknown = sorted(set(record) - FIELDS[task]) if task in FIELDS else []
  if unknown:
    return (f"field {_short(unknown[0])} is not one a {task} record has (it has "
            f"{', '.join(repr(f) for f in sorted(FIELDS[task]))})")
  return _verdict_problem(record, task)


def _verdict_problem(record: dict, task: Optional[str]) -> Optional[str]:
  """A verdict the record's own evidence contradicts: a retrieval record is correct
  exactly when its logits were finite and its argmax tokens are the gold tokens
  (`retrieval.judge`); a non-finite record is never correct."""
  if record.get("finite") is False and record.get("correct") is True:
    return "'correct' is true while 'finite' is false (a non-finite item is never correct)"
  if task == "retrieval" and "argmax" in record and "gold" in record:
    argmax, gold = record["argmax"], record["gold"]
    if not (isinstance(argmax, list) and isinstance(gold, list)
            and all(readback.is_int(x) for x in argmax + gold)):
      return "'argmax' and 'gold' are not lists of token ids"
    if record.get("finite") and record.get("correct") != (argmax == gold):
      return (f"'correct' is {record['correct']} while its argmax tokens "
              f"{'equal' if argmax == gold else 'differ from'} the gold tokens "
              f"(the verdict was edited)")
  if task == "retrieval":
    return _retrieval_fields_problem(record)
  return None


def _retrieval_fields_problem(record: dict) -> Optional[str]:
  """A retrieval record's own fields agree with its item id (`L<length>/c<context>/
  q<question>`) and are possible: a prompt of 1 to `length` tokens, counts >= 0, a
  relative position in [0, 1], times finite and >= 0, and (finite logits) a finite
  margin. An edited length, a negative count or a NaN time would be counted and quoted."""
  parts = str(record["item"]).split("/")
  if not (len(parts) == 3 and [p[:1] for p in parts] == ["L", "c", "q"]
          and all(p[1:].isdigit() for p in parts)):
    return f"field 'item' is {_short(record['item'])}, not an item id L<length>/c<i>/q<j>"
  ids = dict(zip(("length", "context", "question"), (int(p[1:]) for p in parts)))
  for field, value in ids.items():
    if field in record and record[field] != value:
      return (f"field {field!r} is {_short(record[field])} while its item id "
              f"{record['item']!r} says {value}")
  if not 1 <= record["tokens"] <= ids["length"]:
    return (f"field 'tokens' is {record['tokens']}, not a prompt of 1 to {ids['length']} "
            f"tokens (its length)")
  for field in ("pairs", "index", "batch_rows"):
    if field in record and not (readback.is_int(record[field]) and record[field] >= 0):
      return f"field {field!r} is {_short(record[field])}, not a count"
  if "relative" in record and not (readback.is_finite_number(record["relative"])
                                   and 0 <= record["relative"] <= 1):
    return f"field 'relative' is {_short(record['relative'])}, not a position in [0, 1]"
  for field in ("seconds", "batch_seconds", "prefill_seconds", "compile_seconds"):
    if field in record and not (readback.is_finite_number(record[field])
                                and record[field] >= 0):
      return f"field {field!r} is {_short(record[field])}, not a time in seconds"
  if record["finite"] and "margin" in record and not readback.is_finite_number(
      record["margin"]):
    return (f"field 'margin' is {_short(record['margin'])} while 'finite' is true (finite "
            f"logits give a finite margin)")
  return None


def parse(path: str):
  """(meta, {(preset, item): record}, the file's text without a last line cut short by a
  kill, its text) of a results file, read only, every record checked (`check_record`).
  A file without a header line, a complete line that is not a record of the header's
  task, two different records of one (preset, item), or a file that is not UTF-8 text is
  a UserError naming the file, the line and what is wrong."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise UserError(f"{path} is not UTF-8 text (line {readback.line_of(e)}, "
                    f"byte {e.start}: {e.reason}): not a "
                    f"results file an eval wrote. Move it away, or use another "
                    f"--run_dir.") from None
  # The last piece is "" after a final newline, or a line cut short by a kill.
  complete = text.split("\n")[:-1]
  good, header, recs, lines = [], None, {}, {}

  def bad(number: int, why: str) -> UserError:
    return UserError(f"{path}, line {number}: {why}. The file was edited or written by "
                     f"other code, so its records are not counted: fix or remove that "
                     f"line, or move the file away to start over.")

  for number, line in enumerate(complete, start=1):
    if not line.strip():
      continue
    obj, why = readback.loads(line)
    if why:
      raise bad(number, why.replace("not JSON", "not a JSON record", 1))
    if header is None:
      if not (isinstance(obj, dict) and isinstance(obj.get("meta"), dict)):
        break
      if set(obj) != {"meta"}:
        raise bad(number, f"the header holds {sorted(set(obj) - {'meta'})} beside 'meta' "
                          f"(a header is {{\"meta\": {{...}}}} and nothing else)")
      header = obj["meta"]
      good.append(line)
      continue
    why = check_record(obj, header.get("task"))
    if why:
      raise bad(number, why)
    key = (obj["preset"], str(obj["item"]))
    if key in recs and recs[key] != obj:
      raise bad(number, f"a second, different record of preset {key[0]!r}, item "
                        f"{key[1]!r} (the first is line {lines[key]})")
    recs[key], lines[key] = obj, number
    good.append(line)
  if header is None:
    raise UserError(f"{path} is not a results file of an evaluation (no header line): "
                    f"not written by `make eval`. Move it away, or use the run directory "
                    f"an eval wrote.")
  return header, recs, "".join(line + "\n" for line in good), text


def _short(value, limit: int = 120) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."

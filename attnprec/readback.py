"""Reading back what a run wrote: one place for the parsing every reader shares.

A file a run wrote (metrics.jsonl, an eval's records, results.json, a checkpoint's meta)
may have been edited, truncated or replaced since. Its readers check it against the
schema of its kind and raise a `UserError` naming the file, the line and the field; the
pieces here are what they have in common: JSON that cannot crash the parser (a number of
5,000 digits, nesting 50,000 deep), numbers that are numbers (not bools, not strings),
and text that is text (no lone surrogates).
"""
import json
import math
from typing import Any, Optional, Tuple

from attnprec.errors import UserError


def unique_keys(pairs) -> dict:
  """json's `object_pairs_hook` for every file a run reads back: a key given twice in one
  object is a ValueError naming it (json keeps the last one silently, so an edited
  `"rope_base": 10000.0, "rope_base": 500.0` would run with 500)."""
  out = {}
  for key, value in pairs:
    if key in out:
      raise ValueError(f"the key {key!r} is given twice in one object")
    out[key] = value
  return out


def loads(text: str) -> Tuple[Any, Optional[str]]:
  """(the JSON value, None), or (None, why it is not JSON we read): malformed JSON, a key
  given twice in one object (`unique_keys`), an integer past Python's conversion limit,
  nesting deeper than the parser's recursion."""
  try:
    return json.loads(text, object_pairs_hook=unique_keys), None
  except json.JSONDecodeError as e:
    return None, f"not JSON ({e.msg})"
  except ValueError as e:           # e.g. an integer of more than 4300 digits
    return None, f"not JSON we read ({str(e).split(';')[0][:120]})"
  except RecursionError:
    return None, "JSON nested too deep to read"


def line_of(e: UnicodeDecodeError) -> int:
  """The 1-based line of a file's bytes on which a UTF-8 decode error sits."""
  return e.object[:e.start].count(b"\n") + 1


def is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def is_finite_number(x) -> bool:
  return is_number(x) and math.isfinite(x)


def text_problem(s: str) -> Optional[str]:
  """None if `s` is text that can be written as UTF-8, else what is wrong (a lone
  surrogate, which JSON's \\ud800 escape can carry)."""
  try:
    s.encode("utf-8")
  except UnicodeEncodeError as e:
    return f"holds {s[e.start:e.end]!r} at character {e.start}, which is not text"
  return None


def check_text_file(path: str, what: str) -> None:
  """A UserError naming `path` and the byte if it is not UTF-8 text (a config file)."""
  try:
    with open(path, "rb") as f:
      f.read().decode("utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{what} {path!r} is not UTF-8 text (byte {e.start}: {e.reason}); "
                    f"save it as UTF-8.") from None
  except OSError as e:
    raise UserError(f"{what} {path!r} cannot be read ({e.strerror}).") from None

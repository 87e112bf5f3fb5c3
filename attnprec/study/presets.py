"""Precision presets: the files in gin/precision/, read into `Precision` values.

A preset file holds only `precision.<field> = <literal>` lines (and comments); the study
reads them directly (not through gin's global config) so a sweep can hold many at once.
Fields a file leaves out take `Precision`'s defaults. A name is a file stem in
gin/precision/ ('bf16') or a path to such a file.
"""
import ast
import dataclasses
import glob
import os
import re
from typing import List, Tuple

from attnprec.errors import UserError
from attnprec.paths import REPO_GIN_DIR
from attnprec.precision import NOT_BINDABLE, Precision

PRESET_DIR = os.path.join(REPO_GIN_DIR, "precision")
_LINE = re.compile(r"^precision\.(\w+)\s*=\s*(.+?)\s*$")


def available() -> List[str]:
  return sorted(os.path.splitext(os.path.basename(p))[0]
                for p in glob.glob(os.path.join(PRESET_DIR, "*.gin")))


def preset_path(name: str) -> str:
  if isinstance(name, str) and name.endswith(".gin") and os.path.isfile(name):
    return name
  path = os.path.join(PRESET_DIR, f"{name}.gin")
  if not isinstance(name, str) or not os.path.isfile(path):
    raise UserError(f"Unknown precision preset {name!r}; valid presets: "
                    f"{', '.join(available())} (files in gin/precision/), or the path of a "
                    f"gin file with precision.* lines.")
  return path


def load_preset(name: str) -> Tuple[str, Precision]:
  """(short name, Precision) for a preset name or file path."""
  path = preset_path(name)
  fields = {f.name for f in dataclasses.fields(Precision)} - set(NOT_BINDABLE)
  values = {}
  with open(path) as f:
    for number, raw in enumerate(f, 1):
      line = raw.split("#", 1)[0].strip()
      if not line:
        continue
      m = _LINE.match(line)
      if not m or m.group(1) not in fields:
        raise UserError(f"{path}:{number}: a precision preset may hold only "
                        f"'precision.<field> = <value>' lines with fields "
                        f"{sorted(fields)}; got {line!r}.")
      try:
        values[m.group(1)] = ast.literal_eval(m.group(2))
      except (ValueError, SyntaxError):
        raise UserError(f"{path}:{number}: {m.group(2)!r} is not a literal value.") from None
  short = os.path.splitext(os.path.basename(path))[0]
  return short, Precision(**values)


def load_sweep(names, extra=()) -> List[Tuple[str, Precision]]:
  """The sweep's configurations: `names` (None = every preset) plus `extra`, in order,
  without duplicate names."""
  names = list(available() if names is None else names) + list(extra or ())
  if not names:
    raise UserError("The sweep is empty: study.presets and study.extra_presets list no "
                    f"configuration. Valid presets: {', '.join(available())}.")
  out, seen = [], set()
  for n in names:
    short, prec = load_preset(n)
    if short not in seen:
      seen.add(short)
      out.append((short, prec))
  return out

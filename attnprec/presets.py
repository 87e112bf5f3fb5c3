"""Precision presets: the gin files in gin/precision/, read into `Precision` values.

A preset is a gin file of `precision.<field> = <literal>` bindings (and comments): the
same file `--gin_file=gin/precision/bf16.gin` binds for a runner. The study and the
evals read it with gin's own parser (`gin.config_parser`), not into gin's global config,
so a sweep can hold many at once: one road from a preset file to a `Precision`, with
gin's syntax. Fields a file leaves out take `Precision`'s defaults. A name is a file stem
in gin/precision/ ('bf16') or a path to such a file. The benches' named configurations
are `variant`s of these files (one registry: a precision is written once, in its file).
"""
import dataclasses
import glob
import os
import tokenize
from typing import List, Tuple

import gin
from gin import config_parser

from attnprec import readback
from attnprec.errors import UserError
from attnprec.paths import REPO_GIN_DIR
from attnprec.precision import NOT_BINDABLE, Precision

PRESET_DIR = os.path.join(REPO_GIN_DIR, "precision")


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


def _fields() -> List[str]:
  return sorted({f.name for f in dataclasses.fields(Precision)} - set(NOT_BINDABLE))


def _is_literal(value) -> bool:
  """No reference, macro or constant anywhere in `value` (gin's parser returns those as
  its own objects; literals as Python values)."""
  if isinstance(value, (list, tuple, set)):
    return all(_is_literal(v) for v in value)
  if isinstance(value, dict):
    return all(_is_literal(k) and _is_literal(v) for k, v in value.items())
  return not type(value).__module__.startswith("gin")


def bindings(path: str) -> dict:
  """{field: value} of a preset file, parsed by gin's parser: only unscoped
  `precision.<field> = <literal>` bindings (an include, import, scope, reference or macro
  would make a preset mean something outside itself), each field once."""
  fields = _fields()
  readback.check_text_file(path, "Preset file")
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  values, lines_of = {}, {}
  with open(path, encoding="utf-8") as f:   # gin's parser reads it (naming it in errors)
    parser = config_parser.ConfigParser(f, gin.config.ParserDelegate(skip_unknown=True))
    try:
      for st in parser:
        number = st.location.line_num
        if not (isinstance(st, config_parser.BindingStatement) and not st.scope
                and st.selector == "precision" and st.arg_name in fields
                and _is_literal(st.value)):
          line = lines[number - 1].strip() if 0 < number <= len(lines) else ""
          raise UserError(f"{path}:{number}: a precision preset may hold only "
                          f"'precision.<field> = <value>' lines with fields "
                          f"{fields}; got {line!r}.")
        if st.arg_name in values:
          first = lines_of[st.arg_name]
          raise UserError(f"{path}:{number}: binds precision.{st.arg_name} a second time "
                          f"(line {first} binds it too); gin would keep the last and "
                          f"silently drop line {first}. Bind each field once.")
        values[st.arg_name], lines_of[st.arg_name] = st.value, number
    except (SyntaxError, tokenize.TokenError) as e:
      number = getattr(e, "lineno", None) or e.args[1][0]
      line = lines[number - 1].strip() if 0 < number <= len(lines) else ""
      raise UserError(f"{path}:{number}: a precision preset may hold only "
                      f"'precision.<field> = <literal>' lines; {line!r} does not parse "
                      f"as one.") from None
  return values


def load_preset(name: str) -> Tuple[str, Precision]:
  """(short name, Precision) for a preset name or file path."""
  path = preset_path(name)
  short = os.path.splitext(os.path.basename(path))[0]
  return short, Precision(**bindings(path))


def variant(name: str, **overrides) -> Precision:
  """The preset `name` with fields it leaves unbound set (the kernel, the projection form,
  the key offset, ...): how the benches name a variation of a gin preset, so each
  precision is written once, in its file. Setting a field the file binds is refused: a
  variant of 'bf16' cannot quietly be another precision."""
  path = preset_path(name)
  bound = bindings(path)
  clash = sorted(set(overrides) & set(bound))
  if clash:
    raise UserError(f"A variant of precision preset {name!r} sets "
                    f"{', '.join(f'{k}={overrides[k]!r}' for k in clash)}, which {path} "
                    f"binds ({', '.join(f'{k}={bound[k]!r}' for k in clash)}). A variant "
                    f"may set only fields its preset leaves unbound: "
                    f"{', '.join(f for f in _fields() if f not in bound)}; for another "
                    f"precision, start from another preset ({', '.join(available())}).")
  return Precision(**bound, **overrides)


def load_sweep(names, extra=()) -> List[Tuple[str, Precision]]:
  """The sweep's configurations: `names` (None = every preset) plus `extra`, in order; a
  name given twice is refused (one of them would not be read)."""
  names = list(available() if names is None else names) + list(extra or ())
  if not names:
    raise UserError("The sweep is empty: study.presets and study.extra_presets list no "
                    f"configuration. Valid presets: {', '.join(available())}.")
  out, seen = [], {}
  for n in names:
    short, prec = load_preset(n)
    if short in seen and seen[short] != prec:
      first = seen[short].describe()
      raise UserError(f"Two configurations of the sweep are named {short!r} ({first} and "
                      f"{prec.describe()}, from {n!r}): one would be dropped. Rename the "
                      f"preset file (its name is the row's name).")
    if short in seen:
      raise UserError(f"The sweep names the configuration {short!r} twice (from {n!r}): "
                      f"one row would be dropped, and the setting as given would not be "
                      f"read. List each preset once; valid presets: "
                      f"{', '.join(available())}.")
    seen[short] = prec
    out.append((short, prec))
  return out

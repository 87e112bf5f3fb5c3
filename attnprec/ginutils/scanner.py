"""The pre-parse scanner: the gin files (following their includes) and the bindings are
read once here, before gin parses them, so that what gin reports as a RecursionError or a
tokenizer traceback is a UserError naming the file and line: an include cycle, an
unterminated bracket or string. `scan` also returns every binding statement as written,
with where it was written, for the checks' messages (`config_checks`).

It reads with gin's own parser (`gin.config_parser`), so a statement means here what it
means to gin; only the include search path is gin-private (`_gin.search_path`).
"""
import io
import os
import tokenize
from typing import List, NamedTuple, Optional, Sequence, Tuple

import gin
from gin import config_parser

from attnprec.errors import UserError
from attnprec.ginutils import _gin
from attnprec.paths import REPO_GIN_DIR


class Binding(NamedTuple):
  """A binding statement as written: where (file, line) and what."""
  where: str       # 'recall.gin, line 3' or "the command-line binding 'x = 1'"
  scope: str
  selector: str
  arg_name: str    # '' for a macro definition
  text: str        # the line as written


def scan(files: Sequence[str], bindings: Sequence[str]) -> List[Binding]:
  """Reads the gin files (following includes as gin does) and then the bindings, before
  gin parses them, raising a UserError with the file and line for an include cycle and an
  unterminated bracket or string. Returns every binding statement in the order gin
  applies them (to name where a binding was written). Other errors are left to gin."""
  out: List[Binding] = []
  for path in files:
    _scan_file(path, [], out)
  lines = []   # (binding index) per line of the joined bindings, as gin joins them
  for i, b in enumerate(bindings):
    lines += [i] * (b.count("\n") + 1)

  def where(line: int) -> str:
    text = bindings[lines[min(line, len(lines)) - 1]] if lines else ""
    return f"the command-line binding {text.strip()!r}"

  _scan_text("\n".join(bindings), None, where, [], out)
  return out


def _scan_file(path: str, stack: List[Tuple[str, str]], out: List[Binding]) -> None:
  """stack: (real path, 'file.gin, line N') of the files including this one."""
  real = os.path.realpath(path)
  seen = [p for p, _ in stack]
  if real in seen:
    chain = stack[seen.index(real):]
    steps = [f"{_short_path(p)} includes {_short_path(nxt)} ({where})"
             for (p, where), nxt in zip(chain, [q for q, _ in chain[1:]] + [real])]
    raise UserError(f"Gin include cycle: {'; '.join(steps)}. A file cannot include itself, "
                    f"directly or through others; remove one of these include lines.")
  try:
    with open(real) as f:
      text = f.read()
  except (OSError, UnicodeDecodeError):
    return   # gin names the unreadable file
  _scan_text(text, real, lambda line: f"{_short_path(real)}, line {line}", stack, out)


def _scan_text(text: str, path: Optional[str], where, stack, out: List[Binding]) -> None:
  named = io.StringIO(text)
  named.name = path
  parser = config_parser.ConfigParser(named, gin.config.ParserDelegate(skip_unknown=True))
  lines = text.splitlines()
  try:
    for st in parser:
      line = st.location.line_num
      if isinstance(st, config_parser.IncludeStatement):
        included = _resolve_include(st.filename)
        if included and path is not None:
          _scan_file(included, stack + [(path, where(line))], out)
      elif isinstance(st, config_parser.BindingStatement):
        out.append(Binding(where(line), st.scope, st.selector, st.arg_name,
                            lines[line - 1].strip() if 0 < line <= len(lines) else ""))
  except UserError:
    raise
  except tokenize.TokenError as e:
    raise UserError(_unterminated(text, e, where)) from None
  except SyntaxError as e:
    opened = _unclosed_bracket(text, upto=e.lineno or 0)
    if opened and opened[1] < (e.lineno or 0):
      raise UserError(
          f"Invalid gin configuration in {where(opened[1])}: unterminated expression: the "
          f"{opened[0]!r} opened there is not closed before line {e.lineno} "
          f"({(e.text or '').strip()!r}). Close it, e.g. train.seed = (1, 2).") from None
  except Exception:  # noqa: BLE001 -- anything else: gin's own parse reports it
    return


def _resolve_include(name: str) -> Optional[str]:
  """The file an `include` names, searched as gin searches it."""
  prefixes = _gin.search_path() if not os.path.isabs(name) else [""]
  for prefix in prefixes:
    candidate = os.path.join(prefix, name)
    if os.path.isfile(candidate):
      return candidate
  return None


def _short_path(path: str) -> str:
  root = os.path.dirname(REPO_GIN_DIR)
  return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


def _unclosed_bracket(text: str, upto: int = 0) -> Optional[Tuple[str, int]]:
  """(bracket, line) of the innermost bracket still open where tokenizing `text` stops
  (its end, a tokenizer error, or line `upto`), or None."""
  stack = []
  try:
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
      if upto and tok.start[0] >= upto:
        break
      if tok.type == tokenize.OP and tok.string in "([{":
        stack.append((tok.string, tok.start[0]))
      elif tok.type == tokenize.OP and tok.string in ")]}" and stack:
        stack.pop()
  except (tokenize.TokenError, SyntaxError):
    pass
  return stack[-1] if stack else None


def _unterminated(text: str, e: tokenize.TokenError, where) -> str:
  what, (line, _) = e.args[0], e.args[1]
  if "string" in what:
    return (f"Invalid gin configuration in {where(line)}: unterminated string: the "
            f"triple-quoted string that starts there is never closed.")
  opened = _unclosed_bracket(text)
  if opened:
    return (f"Invalid gin configuration in {where(opened[1])}: unterminated expression: "
            f"the {opened[0]!r} opened there is never closed (the input ends first). "
            f"Close it, e.g. train.seed = (1, 2).")
  return (f"Invalid gin configuration in {where(max(line - 1, 1))}: unterminated "
          f"expression ({what}).")

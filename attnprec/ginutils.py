"""gin plumbing for the runners: flags -> config, phase scopes, friendly errors.

Flags (repeatable, T5X-style):
  --gin_file=PATH          a gin file (relative paths also resolve against the repo's gin/)
  --gin_bindings='A.b=1'   a raw binding
  --gin.A.b=VALUE          rewritten into the binding `A.b = VALUE`; a VALUE that is not a
                           gin/Python literal (e.g. runs/recall) is taken as a string.

Before gin parses them, the files (following their includes) and the bindings are read
once here (`_scan`), so that what gin reports as a RecursionError or a tokenizer
traceback is a UserError naming the file and line: an include cycle, an unterminated
bracket or string. After parsing, bindings whose references or macros form a cycle
(`x = %x`, `a.b = @a()`) are refused the same way (`check_reference_cycles`).
"""
import ast
import contextlib
import inspect
import io
import os
import re
import tokenize
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import gin
import jax

from attnprec import checks
from attnprec.errors import UserError
from attnprec.paths import REPO_GIN_DIR

PHASES = ("train", "decode")
# The configurables the runners call inside a phase scope (`ginutils.phase`): the only
# ones a scoped binding (`decode/precision.dtype = ...`) can reach.
PHASE_CONFIGURABLES = ("precision", "blockwise")

_registered = False


def register_constants() -> None:
  """`jax.lax.Precision.HIGHEST` etc. as gin constants (registered by hand: gin's
  constants_from_enum registers wrong names for this enum)."""
  global _registered
  if _registered:
    return
  for p in jax.lax.Precision:
    gin.constant(f"jax.lax.Precision.{p.name}", p.name.lower())
  _registered = True


def _import_configurables() -> None:
  """Import every module that defines configurables, so gin files can bind them (the
  list is `attnprec.configurables`, the top of the import graph)."""
  import attnprec.configurables  # noqa: F401


def split_flags(argv: Sequence[str]) -> Tuple[List[str], List[str], List[str]]:
  """argv -> (gin files, bindings, remaining args). Accepts --x=v and --x v forms."""
  files, bindings, rest = [], [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg.startswith("--gin."):
      name_value = arg[len("--gin."):]
      if "=" not in name_value:
        raise UserError(f"Flag {arg!r} needs a value: --gin.NAME=VALUE, e.g. "
                        f"--gin.decode/precision.float32_logits=True.")
      name, value = name_value.split("=", 1)
      bindings.append(f"{name} = {_as_gin_value(value)}")
    elif arg in ("--gin_file", "--gin_bindings") or arg.startswith(("--gin_file=",
                                                                       "--gin_bindings=")):
      if "=" in arg:
        flag, value = arg.split("=", 1)
      else:
        if i + 1 >= len(args):
          raise UserError(f"Flag {arg} needs a value.")
        flag, value = arg, args[i + 1]
        i += 1
      for v in filter(None, value.split() if flag == "--gin_file" else [value]):
        (files if flag == "--gin_file" else bindings).append(v)
    else:
      rest.append(arg)
    i += 1
  return files, bindings, rest


def _as_gin_value(value: str) -> str:
  value = value.strip()
  if value.startswith(("@", "%", "'", '"', "(", "[", "{")) or value in ("None",):
    return value
  try:
    ast.literal_eval(value)
    return value
  except (ValueError, SyntaxError):
    return repr(value)


def resolve_file(path: str) -> str:
  for candidate in (path, os.path.join(REPO_GIN_DIR, path),
                    os.path.join(REPO_GIN_DIR, os.path.relpath(path, "gin"))
                    if path.startswith("gin" + os.sep) else None):
    if candidate and os.path.isfile(candidate):
      return os.path.abspath(candidate)
  available = sorted(os.path.relpath(os.path.join(d, f), os.path.dirname(REPO_GIN_DIR))
                     for d, _, fs in os.walk(REPO_GIN_DIR) for f in fs if f.endswith(".gin"))
  raise UserError(f"Gin file {path!r} not found. Available gin files: {', '.join(available)}.")


# Configurables a configurable calls itself (not through a `@reference` in a binding), by
# gin name: with the references in the bindings, what a runner's roots reach.
CALLS = {
    "train_job": ("train_recall",),                   # its default job
    "train_recall": ("train",), "train_text": ("train",),
    "train": ("optimizer", "mesh", "fault_injection"),
    "audit": ("model", "optimizer"),
    "precision": ("blockwise",),                      # the blockwise kernel's block sizes
}


def parse(files: Sequence[str], bindings: Sequence[str],
          phases: Optional[Sequence[str]] = PHASES,
          reads: Optional[Sequence[str]] = None, prog: str = "this runner") -> None:
  """Parses gin files then bindings, turning gin's errors into one-paragraph UserErrors,
  then checks the whole configuration (`check_config`) before anything runs.

  reads: the configurables the runner calls itself, `phase/name` for one called in a
  phase scope (`train/precision`); then a binding given on the command line must be one
  the runner reads (`check_command_line`), and `phases` are taken from `reads`.
  """
  if reads is not None:
    phases = tuple(r.split("/")[0] for r in reads if "/" in r)
  _import_configurables()
  register_constants()
  prefixes = gin.config._LOCATION_PREFIXES  # noqa: SLF001
  if REPO_GIN_DIR not in prefixes:
    # First, so `include 'models/x.gin'` resolves against gin/ from any directory.
    prefixes.insert(0, REPO_GIN_DIR)
  resolved = [resolve_file(f) for f in files]
  statements = _scan(resolved, bindings)
  try:
    gin.parse_config_files_and_bindings(resolved, list(bindings), finalize_config=False)
  except (ValueError, SyntaxError, KeyError, IOError, tokenize.TokenError) as e:
    raise UserError(_clean_gin_error(e)) from None
  except RecursionError:
    raise UserError("Invalid gin configuration: parsing the gin files recursed without end "
                    "(an include cycle?). Check the include lines of "
                    f"{', '.join(map(repr, files))}.") from None
  check_reference_cycles(statements)
  check_config(phases)
  check_kernel_settings(phases)
  if reads is not None:
    check_command_line(bindings, reads, prog)


class _Binding(NamedTuple):
  """A binding statement as written: where (file, line) and what."""
  where: str       # 'recall.gin, line 3' or "the command-line binding 'x = 1'"
  scope: str
  selector: str
  arg_name: str    # '' for a macro definition
  text: str        # the line as written


def _scan(files: Sequence[str], bindings: Sequence[str]) -> List[_Binding]:
  """Reads the gin files (following includes as gin does) and then the bindings, before
  gin parses them, raising a UserError with the file and line for an include cycle and an
  unterminated bracket or string. Returns every binding statement in the order gin
  applies them (to name where a binding was written). Other errors are left to gin."""
  out: List[_Binding] = []
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


def _scan_file(path: str, stack: List[Tuple[str, str]], out: List[_Binding]) -> None:
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


def _scan_text(text: str, path: Optional[str], where, stack, out: List[_Binding]) -> None:
  from gin import config_parser
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
        out.append(_Binding(where(line), st.scope, st.selector, st.arg_name,
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
  prefixes = gin.config._LOCATION_PREFIXES if not os.path.isabs(name) else [""]  # noqa: SLF001
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


def check_reference_cycles(statements: Sequence[_Binding] = ()) -> None:
  """Refuses bindings that would recurse without end when called: a macro defined by
  itself (`x = %x`, or `x = %y` and `y = %x`) or a configurable whose binding calls it
  again (`optimizer.learning_rate = @optimizer()`), through any chain of `%macro` and
  `@name()` references. Names each binding of the cycle and where it was written."""
  config = gin.config._CONFIG  # noqa: SLF001
  state, path = {}, []

  def edges(node):
    scope, selector = node
    bound = {}   # arg -> (config key, value), most specific scope last (gin's rule)
    parts = list(scope)
    for i in range(len(parts) + 1):
      key = ("/".join(parts[:i]), selector)
      for arg, value in config.get(key, {}).items():
        bound[arg] = (key, value)
    for arg, (key, value) in bound.items():
      for v in _walk(value):
        if isinstance(v, gin.config.ConfigurableReference) and v.evaluate:
          nxt = (tuple(v.scopes) if v.scopes else scope, v.configurable.selector)
          yield (key, arg, v), nxt

  def visit(node):
    state[node] = "open"
    for edge, nxt in edges(node):
      path.append((node, edge))
      if state.get(nxt) == "open":
        start = next(i for i, (n, _) in enumerate(path) if n == nxt)
        raise _cycle_error([e for _, e in path[start:]], statements)
      if nxt not in state:
        visit(nxt)
      path.pop()
    state[node] = "done"

  for scope, selector in list(config):
    node = (tuple(scope.split("/")) if scope else (), selector)
    if node not in state:
      visit(node)


def _cycle_error(edges, statements: Sequence[_Binding]) -> UserError:
  shown = []
  for key, arg, ref in edges:
    name, place = _binding_site(key, arg, statements)
    shown.append(f"{name} = {ref!r}" + (f" ({place})" if place else ""))
  return UserError(
      f"Invalid gin configuration: these bindings reference themselves in a cycle and "
      f"would recurse without end: {' -> '.join(shown)}. Give one of them a value.")


def _binding_site(key, arg: str, statements: Sequence[_Binding]) -> Tuple[str, str]:
  """(the binding's name as written, 'file, line N' of its last definition)."""
  scope, selector = key
  registry = gin.config._REGISTRY  # noqa: SLF001
  if selector == "gin.macro":
    name = scope
    match = [s for s in statements if not s.arg_name
             and "/".join(filter(None, (s.scope, s.selector))) == scope]
  else:
    configurable = registry.get_match(selector)
    name = f"{scope + '/' if scope else ''}{configurable.name}.{arg}"
    match = [s for s in statements if s.arg_name == arg and s.scope == scope
             and getattr(registry.get_match(s.selector), "selector", None) == selector]
  return name, (match[-1].where if match else "")


def check_kernel_settings(phases: Optional[Sequence[str]]) -> None:
  """A `blockwise.*` binding (block sizes) is read only when the phase it applies to can
  run the blockwise kernel ('blockwise', or 'auto' for long prefills and decode steps
  over long caches); with another kernel it would be silently ignored, so it is an error
  naming the kernel each phase runs. A scoped binding applies to its phase, an unscoped
  one to every phase the runner reads."""
  if not phases:
    return
  from attnprec import kernels as kernel_lib
  from attnprec.precision import phase_precision
  registry = gin.config._REGISTRY  # noqa: SLF001
  kernels = {}
  for (scope, selector), values in gin.config._CONFIG.items():  # noqa: SLF001
    if selector.startswith("gin.") or registry.get_match(selector).name != "blockwise":
      continue
    applies = [scope] if scope else list(phases)
    for p in applies:
      if p not in kernels:
        with gin.config_scope(p):
          kernels[p] = phase_precision().kernel
    if not any(kernel_lib.runs_blockwise(kernels[p]) for p in applies):
      name = f"{scope + '/' if scope else ''}blockwise.{next(iter(values), '')}"
      runs = ", ".join(f"{p}: {kernels[p]!r}" for p in applies)
      raise UserError(
          f"{name} is set, but the kernel there does not read it ({runs}), so the block "
          f"size would be ignored; set precision.kernel = 'blockwise' or 'auto' (or "
          f"{applies[0]}/precision.kernel) or remove the blockwise.* binding.")


def reached(reads: Sequence[str]) -> set:
  """Gin names of the configurables a runner with roots `reads` calls: the roots, what
  they call (CALLS) and what the bindings of reached configurables reference."""
  registry = gin.config._REGISTRY  # noqa: SLF001
  names = {r.split("/")[-1] for r in reads}
  refs = {}
  for (_, selector), values in gin.config._CONFIG.items():  # noqa: SLF001
    if selector.startswith("gin."):
      continue
    name = registry.get_match(selector).name
    for v in _walk(list(values.values())):
      if isinstance(v, gin.config.ConfigurableReference):
        refs.setdefault(name, set()).add(v.configurable.name)
  todo = list(names)
  while todo:
    name = todo.pop()
    for nxt in set(CALLS.get(name, ())) | refs.get(name, set()):
      if nxt not in names:
        names.add(nxt)
        todo.append(nxt)
  return names


def check_command_line(bindings: Sequence[str], reads: Sequence[str], prog: str) -> None:
  """A binding typed on the command line must be read by this runner: `train.steps`
  given to `decode`, or `decode/precision.dtype` given to `train`, would be silently
  ignored. (Gin files may hold bindings for other runners: experiment files are shared.)"""
  from gin import config_parser
  registry = gin.config._REGISTRY  # noqa: SLF001
  names = reached(reads)
  phases = sorted({r.split("/")[0] for r in reads if "/" in r})
  for text in bindings:
    parser = config_parser.ConfigParser(text, gin.config.ParserDelegate(skip_unknown=True))
    for statement in parser:
      if not isinstance(statement, config_parser.BindingStatement) or \
          not statement.arg_name:
        continue   # an import, include or macro definition
      configurable = registry.get_match(statement.selector)
      if configurable is None or configurable.selector.startswith("gin."):
        continue
      name = configurable.name
      key = (f"{statement.scope}/" if statement.scope else "") + \
          f"{name}.{statement.arg_name}"
      if name not in names:
        raise UserError(
            f"{key} is set on the command line but {prog} does not read {name}.*, so it "
            f"would be ignored; {prog} reads {', '.join(sorted(names))}. Is it meant for "
            f"another runner?")
      if name in PHASE_CONFIGURABLES and statement.scope and statement.scope not in phases:
        raise UserError(
            f"{key} is set on the command line but {prog} reads {name}.* only in "
            f"{' and '.join(phases) or 'no'} phase, so it would be ignored; use "
            f"{', '.join(p + '/' + name for p in phases) or 'another runner'} (or no scope).")


def _is_gin_value(value) -> bool:
  """A reference, macro or constant (`@x`, `%x`): resolved by gin when it is called."""
  return type(value).__module__.startswith("gin")


def _walk(value) -> Iterator:
  yield value
  if isinstance(value, (list, tuple)):
    for v in value:
      yield from _walk(v)
  elif isinstance(value, dict):
    for v in value.values():
      yield from _walk(v)


def _scope_error(scope: str, where: str) -> UserError:
  return UserError(
      f"Unknown scope {scope!r} in {where}; valid scopes are: {', '.join(PHASES)} (a "
      f"binding without a scope applies to every phase), e.g. "
      f"decode/precision.float32_logits = True.")


def check_config(phases: Optional[Sequence[str]] = PHASES) -> None:
  """Checks every binding gin parsed, before any runner does work:

  * a scope (`decode/` in `decode/precision.dtype`, or in a reference `@decode/x`) is
    one of PHASES; a scoped binding names a configurable that is really called in that
    scope (PHASE_CONFIGURABLES, or one referenced with that scope), else it would be
    silently ignored;
  * `phases` are the phases whose precision this runner reads; with none (the study
    sweeps its own presets), any `precision.*` binding is an error;
  * every literal value satisfies its configurable's argument rules
    (`attnprec.checks`): types, ranges, choices.
  """
  config = gin.config._CONFIG  # noqa: SLF001  {(scope, complete selector): {arg: value}}
  registry = gin.config._REGISTRY  # noqa: SLF001
  scoped_refs = set()
  for (scope, selector), values in config.items():
    for value in _walk(list(values.values())):
      if (isinstance(value, gin.config.ConfigurableReference)
          and not value.configurable.selector.startswith("gin.")):   # not %macro/%constant
        where = f"the reference @{value.scoped_selector} ({_binding_name(scope, selector)})"
        for s in value.scopes:
          if s not in PHASES:
            raise _scope_error(s, where)
        if value.scopes:
          scoped_refs.add(("/".join(value.scopes), value.configurable.name))
  for (scope, selector), values in config.items():
    if selector.startswith("gin."):
      continue   # a macro definition: its "scope" is the macro's name
    configurable = registry.get_match(selector)
    name = configurable.name
    first = f"{scope + '/' if scope else ''}{name}.{next(iter(values), '')}"
    if scope:
      for s in scope.split("/"):
        if s not in PHASES:
          raise _scope_error(s, first)
      if name not in PHASE_CONFIGURABLES and (scope, name) not in scoped_refs:
        raise UserError(
            f"Scoped binding {first} would be ignored: only "
            f"{' and '.join(c + '.*' for c in PHASE_CONFIGURABLES)} are read per phase "
            f"({', '.join(PHASES)}). Write {name}.{next(iter(values), '')} without a scope.")
    if name in PHASE_CONFIGURABLES and phases is not None and not phases:
      raise UserError(
          f"{first} is set, but this runner does not read {name}.*: it runs the presets "
          f"its job names (files in gin/precision/ or paths, with their defaults for the "
          f"rest): study.presets / study.extra_presets for make study, "
          f"humaneval.presets / retrieval.presets (and retrieval.kernel) for make eval. "
          f"Remove the {name}.* bindings (and included gin/precision/ files), or name a "
          f"preset file there.")
    literal = {k: v for k, v in values.items() if not any(_is_gin_value(x) for x in _walk(v))}
    checks.rules_of(configurable.wrapped, name).check(literal,
                                                      where=_binding_name(scope, selector))


def _binding_name(scope: str, selector: str) -> str:
  name = gin.config._REGISTRY.get_match(selector).name  # noqa: SLF001
  return f"{scope}/{name}" if scope else name


def _clean_gin_error(e: BaseException) -> str:
  if isinstance(e, tokenize.TokenError):
    return f"Invalid gin configuration: unterminated expression or string ({e.args[0]})."
  text = " ".join(str(e).split())
  # ast.literal_eval's message names an object address, not what was written.
  text = re.sub(r"malformed node or string on line \d+: <ast\.\w+ object at 0x[0-9a-f]+>",
                "not a literal value:", text)
  if isinstance(e, KeyError):
    text = text.strip("'\"")
  m = re.search(r"No configurable matching '([^']+)'", text)
  if m:
    text += (f" Known configurables: {', '.join(sorted(_configurable_names()))}.")
  m = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", text)
  if m:
    params = _parameter_names(m.group(1))
    if params:
      text += f" Valid parameters of {m.group(1)}: {', '.join(params)}."
  return f"Invalid gin configuration: {text}"


def _parameter_names(selector: str) -> List[str]:
  import inspect
  configurable = gin.config._REGISTRY.get_match(selector)  # noqa: SLF001
  if configurable is None:
    return []
  try:
    params = inspect.signature(configurable.wrapped).parameters
  except (TypeError, ValueError):
    return []
  deny = set(configurable.denylist or ())
  return [p for p in params if p not in deny and p != "self"]


def _configurable_names():
  registry = gin.config._REGISTRY  # noqa: SLF001
  return {registry.minimal_selector(selector) for selector, _ in registry.items()
          if not selector.startswith(("gin.", "jax.lax"))}


# Configurables --help does not list: test-only fault injection.
HIDDEN_IN_HELP = ("fault_injection",)


def clear() -> None:
  gin.clear_config()


def configurable_values(reads: Sequence[str]) -> List[Tuple[str, str]]:
  """[(NAME, value)] for every parameter of every configurable a runner with roots
  `reads` reaches (`reached`), as gin would call it now: the bound value (a reference or
  macro as written, a macro followed by its value) or the code's default. Phase
  configurables (`precision`, `blockwise`) are listed per phase the runner reads."""
  registry = gin.config._REGISTRY  # noqa: SLF001
  phases = sorted({r.split("/")[0] for r in reads if "/" in r})
  out = []
  for name in sorted(reached(reads)):
    configurable = registry.get_match(name)
    if configurable is None or name in HIDDEN_IN_HELP:
      continue
    scopes = phases if name in PHASE_CONFIGURABLES and phases else [""]
    for scope in scopes:
      bound = _merged_bindings(scope, configurable.selector)
      for param, default in _parameters(configurable):
        value = bound.get(param, default)
        out.append((f"{scope + '/' if scope else ''}{name}.{param}", _show(value)))
  return out


def _merged_bindings(scope: str, selector: str) -> dict:
  parts = scope.split("/") if scope else []
  merged = {}
  for i in range(len(parts) + 1):
    merged.update(gin.config._CONFIG.get(("/".join(parts[:i]), selector), {}))  # noqa: SLF001
  return merged


def _parameters(configurable) -> List[Tuple[str, object]]:
  """(name, default) of the parameters gin can bind; the default is gin.REQUIRED when
  the code has none."""
  try:
    params = inspect.signature(configurable.wrapped).parameters.values()
  except (TypeError, ValueError):
    return []
  deny = set(configurable.denylist or ())
  return [(p.name, gin.REQUIRED if p.default is inspect.Parameter.empty else p.default)
          for p in params if p.name not in deny and p.name != "self"
          and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _show(value, limit: int = 100) -> str:
  """A value as gin syntax: literals by repr, `@ref()` and `%macro` as written (a macro
  with the value it stands for), `required` for a parameter nothing sets."""
  if value is gin.REQUIRED:
    return "(required)"
  if isinstance(value, gin.config.ConfigurableReference):
    text = repr(value)
    if text == "%gin.REQUIRED":
      return "(required)"
    if value.configurable.selector == "gin.macro" and value.evaluate:
      macro = gin.config._CONFIG.get(("/".join(value.scopes), "gin.macro"), {})  # noqa: SLF001
      if "value" in macro:
        text += f" (= {_show(macro['value'], limit)})"
    return text
  if callable(value) and hasattr(value, "__qualname__"):
    for _, c in gin.config._REGISTRY.items():  # noqa: SLF001  a configurable: as gin writes it
      if value in (c.wrapped, getattr(c.wrapped, "__wrapped__", None)) or \
          getattr(value, "__wrapped__", None) is c.wrapped:
        return f"@{c.name}"
    return f"{value.__module__}.{value.__qualname__}"
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def phase(name: str):
  """Enter a gin scope for one phase (`train` or `decode`), so `decode/precision.x = ...`
  applies to inference only. Raises a UserError for an unknown phase."""
  if name not in PHASES:
    raise UserError(f"Unknown phase {name!r}; valid phases: {', '.join(PHASES)}.")
  with gin.config_scope(name):
    yield


def call(fn, *args, **kwargs):
  """Calls a gin configurable, turning gin's wrapped errors into UserErrors."""
  try:
    return fn(*args, **kwargs)
  except RecursionError:
    raise UserError("Invalid gin configuration: calling the configured job recursed "
                    "without end; a binding probably refers to itself through a reference "
                    "(@name() or %macro) that check_reference_cycles could not see.") from None
  except TypeError as e:
    if "missing" in str(e) or "unexpected keyword" in str(e):
      raise UserError(f"Configuration incomplete or wrong: {e}") from None
    raise

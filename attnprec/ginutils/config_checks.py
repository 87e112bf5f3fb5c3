"""The configuration's checks, run right after gin parses and before a runner does work:
scopes and what they reach (`check_config`), every literal against its configurable's
argument rules (`attnprec.checks`), bindings that reference themselves in a cycle
(`check_reference_cycles`), block sizes no kernel would read (`check_kernel_settings`)
and command-line bindings the runner would ignore (`check_command_line`).

The bindings are read through `_gin` (gin has no public way to list them all).
"""
from typing import Iterator, Optional, Sequence, Tuple

import gin
from gin import config_parser

from attnprec import checks
from attnprec.errors import UserError
from attnprec.ginutils import _gin
from attnprec.ginutils.calls import reached
from attnprec.ginutils.listing import parameters
from attnprec.ginutils.scanner import Binding
from attnprec.ginutils.scopes import PHASE_CONFIGURABLES, PHASE_UNREAD, PHASES


def check_reference_cycles(statements: Sequence[Binding] = ()) -> None:
  """Refuses bindings that would recurse without end when called: a macro defined by
  itself (`x = %x`, or `x = %y` and `y = %x`) or a configurable whose binding calls it
  again (`optimizer.learning_rate = @optimizer()`), through any chain of `%macro` and
  `@name()` references. Names each binding of the cycle and where it was written."""
  config = _gin.bound()
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


def _cycle_error(edges, statements: Sequence[Binding]) -> UserError:
  shown = []
  for key, arg, ref in edges:
    name, place = _binding_site(key, arg, statements)
    shown.append(f"{name} = {ref!r}" + (f" ({place})" if place else ""))
  return UserError(
      f"Invalid gin configuration: these bindings reference themselves in a cycle and "
      f"would recurse without end: {' -> '.join(shown)}. Give one of them a value.")


def _binding_site(key, arg: str, statements: Sequence[Binding]) -> Tuple[str, str]:
  """(the binding's name as written, 'file, line N' of its last definition)."""
  scope, selector = key
  if selector == "gin.macro":
    name = scope
    match = [s for s in statements if not s.arg_name
             and "/".join(filter(None, (s.scope, s.selector))) == scope]
  else:
    configurable = _gin.lookup(selector)
    name = f"{scope + '/' if scope else ''}{configurable.name}.{arg}"
    match = [s for s in statements if s.arg_name == arg and s.scope == scope
             and getattr(_gin.lookup(s.selector), "selector", None) == selector]
  return name, (match[-1].where if match else "")


def check_kernel_settings(phases: Optional[Sequence[str]]) -> None:
  """A `blockwise.*` binding (block sizes) is read only when the phase it applies to can run
  the blockwise kernel ('blockwise', or 'auto' for every decode step and for long
  prefills); with another kernel it would be silently ignored, so it is an error naming
  the kernel each phase runs. (Under 'auto' a prefill's q_block / kv_block are read only
  when it is long enough for blockwise: the run's kernel line says which kernel ran.) A
  scoped binding applies to its phase, an unscoped one to every phase the runner reads."""
  if not phases:
    return
  from attnprec import kernels as kernel_lib
  from attnprec.precision import phase_precision
  kernels = {}
  for (scope, selector), values in _gin.bound().items():
    if selector.startswith("gin.") or _gin.lookup(selector).name != "blockwise":
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


def check_command_line(bindings: Sequence[str], reads: Sequence[str], prog: str) -> None:
  """A binding typed on the command line must be read by this runner: `train.steps`
  given to `decode`, or `decode/precision.dtype` given to `train`, would be silently
  ignored. (Gin files may hold bindings for other runners: experiment files are shared.)"""
  names = reached(reads)
  phases = sorted({r.split("/")[0] for r in reads if "/" in r})
  for text in bindings:
    parser = config_parser.ConfigParser(text, gin.config.ParserDelegate(skip_unknown=True))
    for statement in parser:
      if not isinstance(statement, config_parser.BindingStatement) or \
          not statement.arg_name:
        continue   # an import, include or macro definition
      configurable = _gin.lookup(statement.selector)
      if configurable is None or configurable.selector.startswith("gin."):
        continue
      name = configurable.name
      key = (f"{statement.scope}/" if statement.scope else "") + \
          f"{name}.{statement.arg_name}"
      if name not in names and f"{name}.{statement.arg_name}" not in names:
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
  config = _gin.bound()   # {(scope, complete selector): {arg: value}}
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
    configurable = _gin.lookup(selector)
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
      unread = sorted(set(values) & set(PHASE_UNREAD.get((scope, name), ())))
      if unread:
        raise UserError(
            f"{', '.join(f'{scope}/{name}.{u}' for u in unread)} is set, but the {scope} "
            f"phase never reads it (the train step keeps no KV cache and runs no "
            f"single-token decode step), so it would be ignored. Set it for the decode "
            f"phase (decode/{name}.{unread[0]}), or remove the binding.")
    if name in PHASE_CONFIGURABLES and phases is not None and not phases:
      raise UserError(
          f"{first} is set, but this runner does not read {name}.*: it runs the presets "
          f"its job names (files in gin/precision/ or paths, with their defaults for the "
          f"rest): {preset_parameters()}. "
          f"Remove the {name}.* bindings (and included gin/precision/ files), or name a "
          f"preset file there.")
    literal = {k: v for k, v in values.items() if not any(_is_gin_value(x) for x in _walk(v))}
    checks.rules_of(configurable.wrapped, name).check(literal,
                                                      where=_binding_name(scope, selector))


def _binding_name(scope: str, selector: str) -> str:
  name = _gin.lookup(selector).name
  return f"{scope}/{name}" if scope else name


def preset_parameters() -> str:
  """'humaneval.presets, ..., retrieval.presets (and retrieval.kernel), study.presets /
  study.extra_presets': the parameters that name precision presets, read from every
  registered configurable that takes `presets` (and the `kernel` one replaces theirs
  with), so the list follows the code."""
  out = []
  for selector, c in sorted(_gin.registered(), key=lambda sc: sc[1].name):
    if selector.startswith("gin."):
      continue
    params = [p for p, _ in parameters(c)]
    if "presets" not in params:
      continue
    named = [f"{c.name}.{p}" for p in params if p == "presets"] + \
        [f"{c.name}.{p}" for p in params if p.endswith("_presets")]
    text = " / ".join(named)
    if "kernel" in params:
      text += f" (and {c.name}.kernel)"
    out.append(text)
  return ", ".join(out)

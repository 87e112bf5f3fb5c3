"""Which configurables a runner reaches: its roots, what they call, what bindings reference.

Nothing here is written by hand: what a configurable calls itself is read from its code
(`calls`), so it cannot drift from it:

  * a configurable its function's code loads (a global, a module's attribute, a name
    imported inside it), directly or through the project's plain functions it calls
    (`audit` -> `model_config_for` -> `model_config`), read from the bytecode;
  * a parameter default that is a configurable or an instance of a configurable class
    (`train_job.job = train_recall`; `Precision.block_sizes = BlockSizes()`, so
    `precision` reaches `blockwise`).

With the references written in the bindings (`eval.job = @retrieval`), that is what
`reached(reads)` follows: the configurables whose bindings a runner can read, for
`check_command_line` and `--help`. A plain function that reads single bindings names them
in its `gin_reads` attribute (`config.bound_scan_layers`: 'model.scan_layers'); those
come back as 'configurable.parameter' entries, not the whole configurable.
"""
import dis
import inspect
import sys
import types
from typing import Dict, FrozenSet, Iterator, Sequence

import gin

from attnprec.ginutils import _gin


def _unwrap(obj):
  try:
    return inspect.unwrap(obj)
  except ValueError:
    return obj


def _names_by_object() -> Dict[int, str]:
  """id(what gin returned) -> gin name, for every registered configurable: the object
  whose call reads the bindings (a configurable function's wrapper; a configurable
  class, or an external one's wrapper, not the class it wraps)."""
  return {id(c.wrapper): c.name for selector, c in _gin.registered()
          if not selector.startswith("gin.")}


def _classes() -> Dict[int, str]:
  """id(class) -> gin name, for configurable classes (instances are parts of them)."""
  return {id(c.wrapped): c.name for selector, c in _gin.registered()
          if not selector.startswith("gin.") and isinstance(c.wrapped, type)}


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
  yield code
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      yield from _code_objects(const)


def _loaded(fn) -> Iterator[object]:
  """Every global, module attribute (`train_lib.train`) and imported name
  (`from attnprec.config import model_config`) a function's code loads, inner functions
  included, read from its bytecode."""
  glob = getattr(fn, "__globals__", {})
  for code in _code_objects(fn.__code__):
    local, cur, module = {}, None, None
    for ins in dis.get_instructions(code):
      op, arg = ins.opname, ins.argval
      if op == "IMPORT_NAME":
        module = sys.modules.get(arg)
        cur = sys.modules.get(arg.split(".")[0])   # `import a.b` binds a
        continue
      if op == "IMPORT_FROM":
        cur = getattr(module, arg, None)
      elif op in ("LOAD_GLOBAL", "LOAD_NAME"):
        cur = glob.get(arg)
      elif op in ("LOAD_FAST", "LOAD_DEREF"):
        cur = local.get(arg)
      elif op in ("LOAD_ATTR", "LOAD_METHOD"):
        cur = getattr(cur, arg, None) if isinstance(cur, types.ModuleType) else None
      elif op in ("STORE_FAST", "STORE_DEREF"):
        local[arg] = cur
        cur = None
        continue
      else:
        cur = None
        continue
      if cur is not None and not isinstance(cur, types.ModuleType):
        yield cur


def _called(fn, seen: set, home: str = "") -> set:
  """Configurables a function loads, directly or through the plain functions of its own
  package (attnprec, or the one defining it) it loads, followed once each."""
  fn = _unwrap(fn)
  home = home or getattr(fn, "__module__", "").split(".")[0]
  if id(fn) in seen or not isinstance(fn, types.FunctionType):
    return set()
  seen.add(id(fn))
  names = _names_by_object()
  out = set()
  for obj in _loaded(fn):
    if id(obj) in names:
      out.add(names[id(obj)])
    elif isinstance(getattr(obj, "gin_reads", None), tuple):
      # a plain function that reads single bindings (`config.bound_scan_layers`):
      # 'configurable.parameter' entries, not the whole configurable
      out |= set(obj.gin_reads)
    elif isinstance(obj, types.FunctionType) and \
        getattr(obj, "__module__", "").split(".")[0] in ("attnprec", home):
      out |= _called(obj, seen, home)
  return out


def _defaults(obj, bound=()) -> set:
  """Configurables among a function's or class's parameter defaults: a configurable
  (`job=train_recall`) or an instance of a configurable class (`BlockSizes()`). A
  parameter in `bound` (set in gin: `eval.job = @retrieval`) does not use its default."""
  try:
    params = inspect.signature(obj).parameters.values()
  except (TypeError, ValueError):
    return set()
  names, classes = _names_by_object(), _classes()
  out = set()
  for p in params:
    if p.default is inspect.Parameter.empty or p.name in bound:
      continue
    found = names.get(id(p.default)) or classes.get(id(type(p.default)))
    if found:
      out.add(found)
  return out


def calls(name: str) -> FrozenSet[str]:
  """Gin names of the configurables the configurable `name` calls itself (not through a
  reference in a binding), read from its code and parameter defaults."""
  c = _gin.lookup(name)
  if c is None:
    return frozenset()
  fn = _unwrap(c.wrapped)
  from attnprec import checks
  bound = set(checks.bound_args(c.name))     # a bound parameter's default is not called
  found = _defaults(fn, bound) | (set() if isinstance(fn, type) else _called(fn, set()))
  return frozenset(found - {c.name})


def referenced() -> Dict[str, set]:
  """{configurable name: names its bindings reference (@x, @x())}, over every scope."""
  refs = {}
  for (_, selector), values in _gin.bound().items():
    if selector.startswith("gin."):
      continue
    name = _gin.lookup(selector).name
    for v in gin.config.iterate_references(list(values.values())):
      refs.setdefault(name, set()).add(v.configurable.name)
  return refs


def reached(reads: Sequence[str]) -> set:
  """Gin names of the configurables a runner with roots `reads` calls: the roots, what
  they call (`calls`) and what the bindings of reached configurables reference."""
  names = {r.split("/")[-1] for r in reads}
  refs = referenced()
  todo = list(names)
  while todo:
    name = todo.pop()
    for nxt in set(calls(name)) | refs.get(name, set()):
      if nxt not in names:
        names.add(nxt)
        if "." not in nxt:     # 'model.scan_layers': one parameter, nothing to follow
          todo.append(nxt)
  return names

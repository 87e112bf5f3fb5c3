"""gin plumbing for the runners: flags -> config, phase scopes, friendly errors.

Flags (repeatable, T5X-style):
  --gin_file=PATH          a gin file (relative paths also resolve against the repo's gin/)
  --gin_bindings='A.b=1'   a raw binding
  --gin.A.b=VALUE          rewritten into the binding `A.b = VALUE`; a VALUE that is not a
                           gin/Python literal (e.g. runs/recall) is taken as a string.
"""
import ast
import contextlib
import os
import re
from typing import Iterator, List, Optional, Sequence, Tuple

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
  try:
    gin.parse_config_files_and_bindings(resolved, list(bindings), finalize_config=False)
  except (ValueError, SyntaxError, KeyError, IOError) as e:
    raise UserError(_clean_gin_error(e)) from None
  check_config(phases)
  check_kernel_settings(phases)
  if reads is not None:
    check_command_line(bindings, reads, prog)


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
          f"{first} is set, but this runner does not read {name}.*: a study sweeps the "
          f"presets named by study.presets and study.extra_presets (files in "
          f"gin/precision/ or paths, with their defaults for the rest). Remove the "
          f"{name}.* bindings (and included gin/precision/ files), or name the preset "
          f"in study.extra_presets.")
    literal = {k: v for k, v in values.items() if not any(_is_gin_value(x) for x in _walk(v))}
    checks.rules_of(configurable.wrapped, name).check(literal,
                                                      where=_binding_name(scope, selector))


def _binding_name(scope: str, selector: str) -> str:
  name = gin.config._REGISTRY.get_match(selector).name  # noqa: SLF001
  return f"{scope}/{name}" if scope else name


def _clean_gin_error(e: BaseException) -> str:
  text = " ".join(str(e).split())
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
  except TypeError as e:
    if "missing" in str(e) or "unexpected keyword" in str(e):
      raise UserError(f"Configuration incomplete or wrong: {e}") from None
    raise

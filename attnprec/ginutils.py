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
from typing import List, Sequence, Tuple

import gin
import jax

from attnprec.errors import UserError
from attnprec.paths import REPO_GIN_DIR

PHASES = ("train", "decode")

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


def parse(files: Sequence[str], bindings: Sequence[str]) -> None:
  """Parses gin files then bindings, turning gin's errors into one-paragraph UserErrors."""
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


def _clean_gin_error(e: BaseException) -> str:
  text = " ".join(str(e).split())
  if isinstance(e, KeyError):
    text = text.strip("'\"")
  m = re.search(r"No configurable matching '([^']+)'", text)
  if m:
    text += (f" Known configurables: {', '.join(sorted(_configurable_names()))}.")
  return f"Invalid gin configuration: {text}"


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

"""gin plumbing for the runners: flags -> config, phase scopes, friendly errors.

One idea per module:
  flags.py          --gin_file / --gin_bindings / --gin.NAME=VALUE -> files and bindings
  scanner.py        the files (with their includes) and bindings read before gin parses
                    them: include cycles, unterminated brackets and strings, where each
                    binding was written
  config_checks.py  the configuration's checks after parsing
  calls.py          what a runner reaches, derived from the code and the bindings
  listing.py        the configurables and their values for --help
  scopes.py         the phase scopes (`decode/precision.x`)
  _gin.py           the only reads of gin's private state (no public API for them)
This module parses (`parse`): flags' files and bindings -> gin -> checks, turning gin's
errors into one-paragraph UserErrors, and calls configured jobs (`call`).
"""
import inspect
import os
import re
import tokenize
from typing import List, Optional, Sequence

import gin
import jax

from attnprec import checks
from attnprec.errors import UserError
from attnprec.ginutils import _gin
from attnprec.ginutils.calls import reached  # noqa: F401
from attnprec.ginutils.config_checks import (check_command_line, check_config,  # noqa: F401
                                             check_kernel_settings,
                                             check_reference_cycles)
from attnprec.ginutils.flags import resolve_file, split_flags  # noqa: F401
from attnprec.ginutils.listing import HIDDEN_IN_HELP, configurable_values  # noqa: F401
from attnprec.ginutils.scanner import scan
from attnprec.ginutils.scopes import PHASE_CONFIGURABLES, PHASES, phase  # noqa: F401
from attnprec.paths import REPO_GIN_DIR

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


def parse(files: Sequence[str], bindings: Sequence[str],
          phases: Optional[Sequence[str]] = PHASES,
          reads: Optional[Sequence[str]] = None, prog: str = "this runner",
          defaults: int = 0) -> None:
  """Parses gin files then bindings, turning gin's errors into one-paragraph UserErrors,
  then checks the whole configuration (`check_config`) before anything runs.

  reads: the configurables the runner calls itself, `phase/name` for one called in a
  phase scope (`train/precision`); then a binding given on the command line must be one
  the runner reads (`check_command_line`), and `phases` are taken from `reads`.
  defaults: how many of `files` (the first) are the runner's own default files: what
  only they bind is the runner's default, not the user's setting
  (`checks.bound_args(name, by_user=True)`).
  """
  checks.note_runner_defaults(())
  if reads is not None:
    phases = tuple(r.split("/")[0] for r in reads if "/" in r)
  _import_configurables()
  register_constants()
  # First, so `include 'models/x.gin'` resolves against gin/ from any directory (see
  # `_gin.search_first` for why not gin.add_config_file_search_path).
  _gin.search_first(REPO_GIN_DIR)
  resolved = [resolve_file(f) for f in files]
  _check_files(files, resolved)
  statements = scan(resolved, bindings)
  try:
    gin.parse_config_files_and_bindings(resolved, list(bindings), finalize_config=False)
  except (ValueError, SyntaxError, KeyError, IOError, tokenize.TokenError) as e:
    raise UserError(_clean_gin_error(e)) from None
  except RecursionError:
    raise UserError("Invalid gin configuration: parsing the gin files recursed without end "
                    "(an include cycle?). Check the include lines of "
                    f"{', '.join(map(repr, files))}.") from None
  check_reference_cycles(statements)
  _note_runner_defaults(statements, len(scan(resolved[:defaults], [])) if defaults else 0)
  check_config(phases)
  check_kernel_settings(phases)
  if reads is not None:
    check_command_line(bindings, reads, prog)


def _note_runner_defaults(statements, count: int) -> None:
  """The (configurable, arg) pairs bound by the first `count` statements (the runner's
  default files and their includes) and by none after them (the user's files and
  command line)."""
  def keys(part):
    out = set()
    for b in part:
      configurable = _gin.lookup(b.selector) if b.arg_name else None
      if configurable is not None:
        out.add((configurable.name, b.arg_name))
    return out
  checks.note_runner_defaults(keys(statements[:count]) - keys(statements[count:]))


def _check_files(files: Sequence[str], resolved: Sequence[str]) -> None:
  """One precision preset per run, each file once: a second gin/precision/ file would
  silently override the fields both bind and merge the rest into a precision neither
  names."""
  seen = {}
  for given, path in zip(files, resolved):
    real = os.path.realpath(path)
    if real in seen:
      raise UserError(f"The gin file {given!r} is given twice (also as {seen[real]!r}, "
                      f"which the runner may read by default): read again, it would "
                      f"re-apply its bindings over the files in between. Give each gin "
                      f"file once.")
    seen[real] = given
  preset_dir = os.path.realpath(os.path.join(REPO_GIN_DIR, "precision"))
  presets = [g for g, p in zip(files, resolved)
             if os.path.dirname(os.path.realpath(p)) == preset_dir]
  if len(presets) > 1:
    raise UserError(f"Two precision presets are given ({', '.join(map(repr, presets))}): "
                    f"the later would silently override the fields both bind and the run "
                    f"would get a mix of the two. Give one gin/precision/ file, and set "
                    f"a phase's difference with --gin_bindings (e.g. "
                    f"decode/precision.float32_logits=True).")


def _clean_gin_error(e: BaseException) -> str:
  if isinstance(e, tokenize.TokenError):
    return f"Invalid gin configuration: unterminated expression or string ({e.args[0]})."
  text = " ".join(str(e).split())
  # ast.literal_eval's message names an object address, not what was written.
  text = re.sub(r"malformed node or string on line \d+: <ast\.\w+ object at 0x[0-9a-f]+>",
                "not a literal value:", text)
  if isinstance(e, KeyError):
    text = text.strip("'\"")
  m = re.search(r"No configurable matching (?:reference )?'@?([^']+)'", text)
  job = re.search(r"\b(\w+\.job)\s*=\s*@", text)
  if m and job and checks.job_names(job.group(1)):
    text += f" Valid jobs for {job.group(1)}: {checks.job_names(job.group(1))}."
  elif m:
    text += (f" Known configurables: {', '.join(sorted(_configurable_names()))}.")
  m = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", text)
  if m:
    params = _parameter_names(m.group(1))
    if params:
      text += f" Valid parameters of {m.group(1)}: {', '.join(params)}."
  return f"Invalid gin configuration: {text}"


def _parameter_names(selector: str) -> List[str]:
  configurable = _gin.lookup(selector)
  if configurable is None:
    return []
  try:
    params = inspect.signature(configurable.wrapped).parameters
  except (TypeError, ValueError):
    return []
  deny = set(configurable.denylist or ())
  return [p for p in params if p not in deny and p != "self"]


def _configurable_names():
  return {_gin.minimal_selector(selector) for selector, _ in _gin.registered()
          if not selector.startswith(("gin.", "jax.lax"))}


def clear() -> None:
  gin.clear_config()
  checks.note_runner_defaults(())


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

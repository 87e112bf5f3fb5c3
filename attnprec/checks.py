"""Argument rules for every configurable: declared once, checked at configuration time.

A rule is a function `value -> None` (fine) or `str` (what a valid value looks like).
`@validated("train", steps=at_least(1), ...)` declares the rules of a function or a
(frozen) dataclass and checks them on every call / construction, defaults included.
`attnprec.ginutils` reads the same rules (`rules_of`) and checks every value bound in gin
right after parsing, before a runner loads a model or compiles anything, so
`train.checkpoint_every = 0` fails in a second, not after the first step.

Messages name the binding and what is valid:
  `Invalid train.checkpoint_every = 0: must be an integer >= 1.`
"""
import collections.abc
import dataclasses
import functools
import inspect
import math
import numbers
import typing
from typing import Any, Callable, Dict, Optional, Sequence

from attnprec.errors import UserError, shorten

Rule = Callable[[Any], Optional[str]]


# ----------------------------------------------------------------------------- rules
def _is_int(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool)


# The largest integer any setting may take unless its rule says otherwise: every
# integer the project reads sizes an array, indexes one or seeds a generator, and JAX's
# integer arrays (and the positions, lengths and ids in them) are int32. Past it a value
# would end in an OverflowError deep in numpy or XLA, not in a message.
INT_MAX = 2 ** 31 - 1


def integer(min: Optional[int] = None, max: Optional[int] = None) -> Rule:
  """An int (not a bool) in [min, max]; max defaults to INT_MAX (int32)."""
  max = INT_MAX if max is None else max
  what = ("an integer" + (f" >= {min}" if min is not None else "")
          + f" and <= {max}" + (" (int32)" if max == INT_MAX else ""))

  def rule(v):
    if not _is_int(v) or (min is not None and v < min) or (max is not None and v > max):
      return f"must be {what}"
  return rule


def at_least(n: int) -> Rule:
  return integer(min=n)


def number(*, gt=None, ge=None, lt=None, le=None) -> Rule:
  """A finite real number (int or float, not a bool) within the given bounds."""
  parts = [f"> {gt}" if gt is not None else "", f">= {ge}" if ge is not None else "",
           f"< {lt}" if lt is not None else "", f"<= {le}" if le is not None else ""]
  bounds = " and ".join(p for p in parts if p)
  what = "a finite number" + (f" {bounds}" if bounds else "")

  def rule(v):
    if not _is_real(v) or not math.isfinite(v):
      return f"must be {what}"
    if ((gt is not None and not v > gt) or (ge is not None and not v >= ge)
        or (lt is not None and not v < lt) or (le is not None and not v <= le)):
      return f"must be {what}"
  return rule


def boolean(v) -> Optional[str]:
  if not isinstance(v, bool):
    return "must be True or False"


def string(v) -> Optional[str]:
  """A non-empty string of valid text: it encodes as UTF-8 (no lone surrogate, which a
  tokenizer, a JSON record or a log line cannot hold)."""
  if not isinstance(v, str) or not v:
    return "must be a non-empty string"
  return text(v)


def text(v) -> Optional[str]:
  """A string that encodes as UTF-8 (empty allowed)."""
  if not isinstance(v, str):
    return "must be a string"
  try:
    v.encode("utf-8")
  except UnicodeEncodeError as e:
    return (f"must be valid text: it holds a lone surrogate {v[e.start]!r} at character "
            f"{e.start}, which UTF-8 cannot encode")


def regular_file(v) -> Optional[str]:
  """The path of an existing regular file (not a directory, a FIFO or a device: reading
  one of those can block forever or never end)."""
  import os
  import stat
  problem = string(v)
  if problem:
    return problem
  try:
    mode = os.stat(v).st_mode
  except OSError as e:
    return f"must name a readable file ({e.strerror})"
  if not stat.S_ISREG(mode):
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device or socket")
    return f"must name a regular file, not {kind}"
  return None


def one_of(*choices) -> Rule:
  listed = ", ".join(repr(c) for c in choices)

  def rule(v):
    if not any(type(v) is type(c) and v == c for c in choices):
      return f"valid values are: {listed}"
  return rule


# "<configurable>.job" -> the jobs it may name (`declare_jobs`): an unknown reference
# there is answered with these, not with every configurable.
JOB_CHOICES: Dict[str, tuple] = {}


def declare_jobs(binding: str, jobs) -> tuple:
  """Records the jobs `binding` (e.g. 'decode.job') may name; returns them."""
  JOB_CHOICES[binding] = tuple(jobs)
  return JOB_CHOICES[binding]


def job_names(binding: str) -> Optional[str]:
  """'@recall_eval, @generate_text' for a declared job binding, else None."""
  jobs = JOB_CHOICES.get(binding)
  return ", ".join(f"@{rules_of(j).name}" for j in jobs) if jobs else None


def one_of_jobs(*jobs) -> Rule:
  """One of these configurables, named in gin by a reference without `()`
  (`eval.job = @retrieval`): the one way a runner's job is chosen. The valid names are
  read from the jobs' own rules (`validated`'s name), so the message follows the code."""

  def rule(v):
    if not any(v is j or getattr(v, "__wrapped__", None) is j for j in jobs):
      names = ", ".join(f"@{rules_of(j).name}" for j in jobs)
      return f"valid jobs are: {names} (a gin reference, without '()')"
  return rule


def optional(inner: Rule) -> Rule:
  """None, or a value `inner` accepts."""

  def rule(v):
    if v is None:
      return None
    problem = inner(v)
    return problem and f"{problem}, or None"
  return rule


def sequence_of(inner: Rule, *, nonempty: bool = True, distinct: bool = False) -> Rule:
  """A tuple or list whose every item `inner` accepts; `distinct`: each item once (a list
  of things each measured once: a value given twice would measure it twice and report
  two rows of one setting; True and 1 count as one)."""

  def rule(v):
    if not isinstance(v, (tuple, list)) or (nonempty and not v):
      return f"must be a {'non-empty ' if nonempty else ''}tuple (or list) of values"
    for item in v:
      problem = inner(item)
      if problem:
        return f"every item {problem} (got {shorten(item)})"
    if distinct:
      seen = []
      for item in v:
        if any(item == s and type(item) is type(s) for s in seen):
          return f"must name each value once (got {shorten(item)} twice)"
        seen.append(item)
  return rule


def parsed_by(parse: Callable[[Any], Any], valid: Sequence) -> Rule:
  """A value `parse` accepts (it raises a UserError otherwise); `valid` lists the values
  named in the message."""
  listed = ", ".join(repr(v) for v in valid)

  def rule(v):
    try:
      parse(v)
    except UserError:
      return f"valid values are: {listed}"
  return rule


def instance_of(types, what: str) -> Rule:
  def rule(v):
    if not isinstance(v, types):
      return f"must be {what}"
  return rule


def is_callable(what: str) -> Rule:
  def rule(v):
    if not callable(v):
      return f"must be {what}"
  return rule


def check_argument(function: str, arg: str, value, rule: Rule) -> None:
  """For the Python API: raises `Invalid argument <arg>=<value> of <function>: <what is
  valid>.` (the value shortened) when `rule` refuses `value`."""
  problem = rule(value)
  if problem:
    raise UserError(f"Invalid argument {arg}={shorten(value)} of {function}: {problem}.")


# ----------------------------------------------------------------------------- types
def type_rule(annotation) -> Optional[Rule]:
  """A rule checking only the type an annotation promises (int, float, bool, str,
  Optional[...] and Sequence[...] of those); None for anything else."""
  if annotation is bool:
    return boolean
  if annotation is int:
    return integer()
  if annotation is float:
    return number()
  if annotation is str:
    return lambda v: None if isinstance(v, str) else "must be a string"
  origin, args = typing.get_origin(annotation), typing.get_args(annotation)
  if origin is typing.Union and len(args) == 2 and type(None) in args:
    inner = type_rule(next(a for a in args if a is not type(None)))
    return optional(inner) if inner else None
  if origin in (tuple, list, collections.abc.Sequence):
    items = [a for a in args if a is not Ellipsis]
    inner = type_rule(items[0]) if len(set(items)) == 1 else None
    if inner is not None:
      return sequence_of(inner, nonempty=False)
  return None


def _annotations(obj) -> Dict[str, Any]:
  try:
    return typing.get_type_hints(obj)
  except Exception:  # noqa: BLE001  (unresolvable forward references: no type rules)
    return {}


# ----------------------------------------------------------------------------- declare
@dataclasses.dataclass(frozen=True)
class Rules:
  """The rules of one configurable: `name` as users write it, and a rule per argument."""
  name: str
  rules: Dict[str, Rule]

  def check(self, values: Dict[str, Any], where: Optional[str] = None) -> None:
    """Raises a UserError naming the first argument in `values` that breaks its rule."""
    for arg, value in values.items():
      rule = self.rules.get(arg)
      problem = rule(value) if rule else None
      if problem:
        raise UserError(f"Invalid {where or self.name}.{arg} = {show(value)}: {problem}.")


def show(value) -> str:
  """A value as a message shows it: a configurable by its gin reference (`@recall_eval`),
  anything else by its shortened repr."""
  spec = getattr(value, "__checks__", None) if callable(value) else None
  return f"@{spec.name}" if isinstance(spec, Rules) else shorten(value)


def validated(name: str, **rules: Rule):
  """Declares argument rules on a function or a dataclass and checks them on every call
  (functions) or construction (dataclasses, before their own `__post_init__`; a call
  with an unknown or missing argument is a UserError listing the fields).

  Arguments without an explicit rule get one from their type annotation (see
  `type_rule`) when it is a plain type.
  """

  def decorate(obj):
    hints = _annotations(obj)
    full = {k: r for k, r in ((k, type_rule(t)) for k, t in hints.items()) if r}
    full.update(rules)
    spec = Rules(name, full)
    if inspect.isclass(obj):
      original = getattr(obj, "__post_init__", None)

      def check(self):
        spec.check({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

      if original is not None:
        # The dataclass's __init__ calls __post_init__: check there, before the class's own.
        def __post_init__(self):
          check(self)
          original(self)
        obj.__post_init__ = __post_init__
      init = obj.__init__
      init_signature = inspect.signature(init)

      @functools.wraps(init)
      def __init__(self, *args, **kwargs):
        try:
          init_signature.bind(self, *args, **kwargs)
        except TypeError as e:
          fields = ", ".join(f.name for f in dataclasses.fields(obj)) or "none"
          raise UserError(f"{obj.__name__}(...) cannot take these arguments ({e}); its arguments "
                          f"are (by keyword): {fields}.") from None
        init(self, *args, **kwargs)
        if original is None:
          # A dataclass defined without __post_init__ never calls one added later.
          check(self)
      obj.__init__ = __init__
      obj.__checks__ = spec
      return obj
    signature = inspect.signature(obj)

    @functools.wraps(obj)
    def wrapper(*args, **kwargs):
      try:
        bound = signature.bind(*args, **kwargs)
      except TypeError:
        return obj(*args, **kwargs)   # let Python (or gin) name the wrong call
      bound.apply_defaults()
      spec.check({k: v for k, v in bound.arguments.items() if k in spec.rules})
      return obj(*args, **kwargs)
    wrapper.__checks__ = spec
    return wrapper

  return decorate


def rules_of(obj, name: str = "") -> Rules:
  """The `Rules` declared on a function or class; for one that declares none, the type
  rules its annotations give (so every configurable's arguments are type-checked)."""
  declared = getattr(obj, "__checks__", None)
  if declared is not None:
    return declared
  hints = _annotations(obj)
  return Rules(name or getattr(obj, "__name__", "?"),
               {k: r for k, r in ((k, type_rule(t)) for k, t in hints.items()) if r})


# (configurable name, arg) bound only by the runner's own default gin files (and what they
# include) in the last `ginutils.parse`: the runner's defaults, not the user's settings.
_RUNNER_DEFAULTS: set = set()


def note_runner_defaults(keys) -> None:
  """Called by `ginutils.parse`: the (name, arg) pairs only the runner's default files
  bound (each parse replaces the last's)."""
  _RUNNER_DEFAULTS.clear()
  _RUNNER_DEFAULTS.update(keys)


def bound_args(name: str, by_user: bool = False) -> Dict[str, Any]:
  """{arg: value} of every gin binding of the configurable named `name` (any scope): what
  the gin files and the command line set for it, as opposed to its defaults. A job asks
  it to refuse a setting it would not read (one it sets itself, or one that only another
  of its settings makes it read). by_user: leave out what only the runner's own default
  gin files bound (`note_runner_defaults`): a user cannot drop those."""
  from gin import config as gin_config
  out: Dict[str, Any] = {}
  for (_, selector), values in gin_config._CONFIG.items():  # noqa: SLF001
    if selector.startswith("gin."):
      continue
    configurable = gin_config._REGISTRY.get_match(selector)  # noqa: SLF001
    if configurable is not None and configurable.name == name:
      out.update(values)
  if by_user:
    out = {k: v for k, v in out.items() if (name, k) not in _RUNNER_DEFAULTS}
  return out

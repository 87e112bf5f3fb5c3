"""The configurables part of a runner's `--help`: every parameter a runner reaches, with
the value gin would call it with now."""
import inspect
from typing import List, Sequence, Tuple

import gin

from attnprec.ginutils import _gin
from attnprec.ginutils.calls import reached
from attnprec.ginutils.scopes import PHASE_CONFIGURABLES

# Configurables --help does not list: test-only fault injection.
HIDDEN_IN_HELP = ("fault_injection",)


def configurable_values(reads: Sequence[str]) -> List[Tuple[str, str]]:
  """[(NAME, value)] for every parameter of every configurable a runner with roots
  `reads` reaches (`reached`), as gin would call it now: the bound value (a reference or
  macro as written, a macro followed by its value) or the code's default. Phase
  configurables (`precision`, `blockwise`) are listed per phase the runner reads."""
  phases = sorted({r.split("/")[0] for r in reads if "/" in r})
  out = []
  for name in sorted(reached(reads)):
    if "." in name:        # one parameter of a configurable ('model.scan_layers')
      conf, param = name.rsplit(".", 1)
      configurable = _gin.lookup(conf)
      if configurable is not None and conf not in reached_whole(reads):
        default = dict(parameters(configurable)).get(param, gin.REQUIRED)
        bound = gin.get_bindings(configurable.selector, resolve_references=False)
        out.append((name, _show(bound.get(param, default))))
      continue
    configurable = _gin.lookup(name)
    if configurable is None or name in HIDDEN_IN_HELP:
      continue
    scopes = phases if name in PHASE_CONFIGURABLES and phases else [""]
    for scope in scopes:
      bound = gin.get_bindings(f"{scope + '/' if scope else ''}{configurable.selector}",
                               resolve_references=False)
      for param, default in parameters(configurable):
        value = bound.get(param, default)
        out.append((f"{scope + '/' if scope else ''}{name}.{param}", _show(value)))
  return out


def parameters(configurable) -> List[Tuple[str, object]]:
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
      macro = _gin.bound().get(("/".join(value.scopes), "gin.macro"), {})
      if "value" in macro:
        text += f" (= {_show(macro['value'], limit)})"
    return text
  if callable(value) and hasattr(value, "__qualname__"):
    for _, c in _gin.registered():   # a configurable: as gin writes it
      if value in (c.wrapped, getattr(c.wrapped, "__wrapped__", None)) or \
          getattr(value, "__wrapped__", None) is c.wrapped:
        return f"@{c.name}"
    return f"{value.__module__}.{value.__qualname__}"
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def reached_whole(reads: Sequence[str]) -> set:
  """The configurables a runner reaches whole (not one parameter of)."""
  return {n for n in reached(reads) if "." not in n}

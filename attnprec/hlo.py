"""Reading dots out of a lowered program: the proof of what precision actually runs.

`dots(lowered)` lists every `stablehlo.dot_general` of a `jax.jit(...).lower(...)` result
with its operand and result element types, its precision config (and dot algorithm, if
any) and where it sits, from the debug locations Haiku's module names and the kernels'
named scopes leave in the program (e.g. `decoder/layer_0/attn/attn_qk/...`).
"""
import dataclasses
import re
from typing import Dict, List, Optional

from attnprec.attention import QK_SCOPE, WV_SCOPE

_DOT = re.compile(
    r"stablehlo\.dot_general (?P<lhs>%[\w#.]+), (?P<rhs>%[\w#.]+),(?P<attrs>.*?) : "
    r"\((?P<lt>tensor<[^>]*>), (?P<rt>tensor<[^>]*>)\) -> (?P<ot>tensor<[^>]*>)"
    r"(?: loc\((?P<loc>#loc\d*)\))?")
_LOC = re.compile(r'^(?P<id>#loc\d*) = loc\((?P<body>.*)\)\s*$')
_PRECISION = re.compile(r"precision = \[(\w+), (\w+)\]")
_ALGORITHM = re.compile(r"algorithm = <([^>]*)>")
_LAYER = re.compile(r"layer_(\d+)")


@dataclasses.dataclass(frozen=True)
class Dot:
  lhs_type: str            # element type of the left operand, e.g. 'bf16'
  rhs_type: str
  result_type: str
  precision: str           # e.g. 'HIGHEST' (both operands; 'DEFAULT,HIGHEST' if they differ)
  algorithm: Optional[str]  # dot algorithm attributes, if a preset was used
  name: str                # debug location name (module path / scope), '' if unknown
  lhs_shape: str
  rhs_shape: str
  result_shape: str

  @property
  def role(self) -> str:
    """'qk' / 'wv' for the attention dots, 'dense' for projections, 'other' otherwise."""
    if f"/{QK_SCOPE}/" in self.name:
      return "qk"
    if f"/{WV_SCOPE}/" in self.name:
      return "wv"
    return "dense" if "decoder/" in self.name else "other"

  @property
  def backward(self) -> bool:
    """True for dots that belong to the gradient (transposed) computation."""
    return "transpose(" in self.name

  @property
  def layer(self) -> Optional[int]:
    m = _LAYER.search(self.name)
    return int(m.group(1)) if m else None


def _tensor(t: str):
  """'tensor<1x4x8xbf16>' -> ('1x4x8', 'bf16')."""
  body = t[len("tensor<"):-1]
  parts = body.split("x")
  return "x".join(parts[:-1]), parts[-1]


def _locations(text: str) -> Dict[str, str]:
  """#locN -> the first quoted name reachable from it (following nested references)."""
  raw = {}
  for line in text.splitlines():
    m = _LOC.match(line)
    if m:
      raw[m.group("id")] = m.group("body")
  resolved: Dict[str, str] = {}

  def name_of(loc_id: str, depth: int = 0) -> str:
    if loc_id in resolved or depth > 50:
      return resolved.get(loc_id, "")
    body = raw.get(loc_id, "")
    quoted = re.match(r'"([^"]*)"', body)
    if quoted and "/" in quoted.group(1):
      name = quoted.group(1)
    else:
      refs = re.findall(r"#loc\d*", body)
      name = next((n for n in (name_of(r, depth + 1) for r in refs) if n), "")
    resolved[loc_id] = name
    return name

  for loc_id in raw:
    name_of(loc_id)
  return resolved


def dots_from_text(text: str) -> List[Dot]:
  locs = _locations(text)
  out = []
  for m in _DOT.finditer(text):
    attrs = m.group("attrs")
    p = _PRECISION.search(attrs)
    precision = "DEFAULT" if not p else (p.group(1) if p.group(1) == p.group(2)
                                         else f"{p.group(1)},{p.group(2)}")
    alg = _ALGORITHM.search(attrs)
    (ls, lt), (rs, rt), (os_, ot) = (_tensor(m.group(g)) for g in ("lt", "rt", "ot"))
    out.append(Dot(lt, rt, ot, precision, alg.group(1) if alg else None,
                   locs.get(m.group("loc") or "", ""), ls, rs, os_))
  return out


def dots(lowered) -> List[Dot]:
  """Every dot of a `jax.jit(f).lower(...)` result, from its StableHLO with debug info."""
  return dots_from_text(lowered.as_text(debug_info=True))


def attention_dots(lowered, *, forward_only: bool = True) -> List[Dot]:
  return [d for d in dots(lowered) if d.role in ("qk", "wv")
          and not (forward_only and d.backward)]

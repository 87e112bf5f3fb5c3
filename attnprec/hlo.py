"""Reading dots out of a lowered program: the proof of what precision actually runs.

`dots(lowered)` lists every `stablehlo.dot_general` of a `jax.jit(...).lower(...)` result
with its operand and result element types, its precision config (and dot algorithm, if
any) and where it sits, from the debug locations Haiku's module names and the kernels'
named scopes leave in the program (e.g. `decoder/layer_0/attn/attn_qk/...`).

Two additions for the audit (`attnprec.audit`):
* each `Dot` also records the element type an operand had before an upcast that feeds the
  dot directly (through transposes/reshapes only), and the type its result is converted
  to right after, so a dot whose types were widened by a dot-algorithm preset (e.g.
  BF16_BF16_F32_X3 makes JAX upcast bf16 operands and convert the f32 result back) still
  shows the contract's stage types; `site(name)` classifies a location name as qk / wv /
  dense / other, also for kernels whose dots sit outside the named scopes;
* `compiled_summary(text)` reads what XLA turned the program into
  (`lowered.compile().as_text()`): every dot with its operand/result types and the
  convert ops by (from, to) type.
"""
import dataclasses
import re
from typing import Dict, List, Optional

from attnprec.contract import QK_SCOPE, WV_SCOPE

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
  lhs_source_type: Optional[str] = None  # type before a direct upcast into the lhs, if any
  rhs_source_type: Optional[str] = None
  converted_to: Optional[str] = None     # type of a convert applied directly to the result

  @property
  def site(self) -> str:
    """'qk' / 'wv' / 'dense' / 'other' (see `site`); covers every kernel."""
    return site(self.name)

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


_FUNC = re.compile(r"^\s*func\.func ")
_OP = re.compile(r"^\s*(?P<res>%[\w#.]+) = stablehlo\.(?P<op>[\w.]+) (?P<arg>%[\w#.]+)"
                 r"[^:]*: \((?P<in>tensor<[^>]*>)\) -> (?P<out>tensor<[^>]*>)")
_PASS_THROUGH = ("transpose", "reshape", "broadcast_in_dim")


def _functions(text: str) -> List[str]:
  """The module split at `func.func` headers (SSA names are local to a function)."""
  chunks, current = [], []
  for line in text.splitlines():
    if _FUNC.match(line) and current:
      chunks.append("\n".join(current))
      current = []
    current.append(line)
  chunks.append("\n".join(current))
  return chunks


def dots_from_text(text: str) -> List[Dot]:
  locs = _locations(text)
  out = []
  for body in _functions(text):
    defs, users = {}, {}
    for line in body.splitlines():
      m = _OP.match(line)
      if m:
        entry = (m.group("op"), m.group("arg"), _tensor(m.group("in"))[1],
                 _tensor(m.group("out"))[1], m.group("res"))
        defs[m.group("res")] = entry
        users.setdefault(m.group("arg"), []).append(entry)

    def source_type(name: str) -> Optional[str]:
      for _ in range(8):
        op, arg, in_type, _, _ = defs.get(name, (None,) * 5)
        if op == "convert":
          return in_type
        if op not in _PASS_THROUGH:
          return None
        name = arg
      return None

    def converted_to(name: str) -> Optional[str]:
      for _ in range(8):
        following = users.get(name, [])
        if len(following) != 1:
          return None
        op, _, _, out_type, res = following[0]
        if op == "convert":
          return out_type
        if op not in _PASS_THROUGH:
          return None
        name = res
      return None

    for line in body.splitlines():
      m = _DOT.search(line)
      if not m:
        continue
      res = re.match(r"^\s*(%[\w#.]+) = ", line)
      attrs = m.group("attrs")
      p = _PRECISION.search(attrs)
      precision = "DEFAULT" if not p else (p.group(1) if p.group(1) == p.group(2)
                                           else f"{p.group(1)},{p.group(2)}")
      alg = _ALGORITHM.search(attrs)
      (ls, lt), (rs, rt), (os_, ot) = (_tensor(m.group(g)) for g in ("lt", "rt", "ot"))
      out.append(Dot(lt, rt, ot, precision, alg.group(1) if alg else None,
                     locs.get(m.group("loc") or "", ""), ls, rs, os_,
                     source_type(m.group("lhs")), source_type(m.group("rhs")),
                     converted_to(res.group(1)) if res else None))
  return out


def dots(lowered) -> List[Dot]:
  """Every dot of a `jax.jit(f).lower(...)` result, from its StableHLO with debug info."""
  return dots_from_text(lowered.as_text(debug_info=True))


def attention_dots(lowered, *, forward_only: bool = True) -> List[Dot]:
  return [d for d in dots(lowered) if d.role in ("qk", "wv")
          and not (forward_only and d.backward)]


# ----------------------------------------------------------------------------- sites
# The dot_product kernel wraps its two dots in the named scopes. The blockwise kernel's dots
# live in a loop body shared by all layers (no module path, no scope) and jax.nn's inside
# jax itself, so they are recognised by the einsum equation their location carries, in the
# project's axis letters (T queries, S keys, H head dim): QK^T contracts H and yields
# T and S ('BTKGH,BSKH->BKGTS'); the wv dot contracts S and yields T and H.
_EQUATION = re.compile(r"(?:^|/|\()([A-Z]+),([A-Z]+)->([A-Z]+)[)/]")
_DENSE = re.compile(r"(?:^|/|\()decoder\)*/(?:layer_\d+/(?:attn/[qkvo]|mlp/\w+)/|BTD,DV->BTV/)")


def equation_site(name: str) -> Optional[str]:
  """'qk' / 'wv' from an attention einsum equation in a location name, else None."""
  m = _EQUATION.search(name)
  if not m:
    return None
  x, y, z = m.groups()
  if "H" in x and "H" in y and "H" not in z and {"T", "S"} <= set(z):
    return "qk"
  if "S" in x and "S" in y and "S" not in z and {"T", "H"} <= set(z):
    return "wv"
  return None


def site(name: str) -> str:
  """Where a dot sits, from its location name (lowered) or op_name (compiled):
  'qk' / 'wv' (attention), 'dense' (q/k/v/o, MLP, unembedding), 'other'."""
  if f"/{QK_SCOPE}/" in name:
    return "qk"
  if f"/{WV_SCOPE}/" in name:
    return "wv"
  by_equation = equation_site(name)
  if by_equation:
    return by_equation
  return "dense" if _DENSE.search(name) else "other"


# ----------------------------------------------------------------------------- compiled
_HLO_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<type>\w+)\[[^\]]*\](?:\{[^}]*\})? "
    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$")
_HLO_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class CompiledDot:
  lhs_type: str
  rhs_type: str
  result_type: str
  name: str                # metadata op_name ('' if XLA dropped it)
  batched: bool = False    # has batch dimensions (the attention dots of this model)

  @property
  def site(self) -> str:
    return site(self.name)

  @property
  def layer(self) -> Optional[int]:
    m = _LAYER.search(self.name)
    return int(m.group(1)) if m else None

  @property
  def types(self) -> str:
    return f"{self.lhs_type}x{self.rhs_type}->{self.result_type}"


def compiled_summary(text: str) -> dict:
  """What the backend compiled: {'dots': [CompiledDot], 'converts': {'bf16->f32': n},
  'fusions': n} from `lowered.compile().as_text()` (HLO text)."""
  types, instrs = {}, []
  for line in text.splitlines():
    m = _HLO_INSTR.match(line)
    if m:
      types[m.group("name")] = m.group("type")
      instrs.append(m)
  dots, converts, fusions = [], {}, 0
  for m in instrs:
    operands = _HLO_OPERAND.findall(m.group("args"))
    if m.group("op") == "dot" and len(operands) >= 2:
      name = _OP_NAME.search(m.group("rest"))
      dots.append(CompiledDot(types.get(operands[0], "?"), types.get(operands[1], "?"),
                              m.group("type"), name.group(1) if name else "",
                              "lhs_batch_dims" in m.group("rest")))
    elif m.group("op") == "convert" and operands:
      key = f"{types.get(operands[0], '?')}->{m.group('type')}"
      converts[key] = converts.get(key, 0) + 1
    elif m.group("op") == "fusion":
      fusions += 1
  return {"dots": dots, "converts": dict(sorted(converts.items())), "fusions": fusions}

"""What the backend compiled: dots and converts of `lowered.compile().as_text()`.

The lowered program (StableHLO, the program's own statement of its types) is read by
`attnprec.inspect` through the MLIR bindings. The compiled program is XLA's HLO after its
passes (fusions, layout, the backend's rewrites: XLA:CPU computes bf16 dots as f32 dots on
converted operands); jax hands it out as HLO text, so this module reads that text:
`compiled_summary(text)` lists every dot with its operand/result types, op_name
metadata and what the backend made of it (`via`: a plain XLA dot, a dot inside a
fusion of some kind, e.g. XLA:CPU's `__ynn_fusion` library fusions, or a custom-call to a
matmul library such as oneDNN), and counts the convert ops by (from, to) type.
`site(name)` classifies an op_name (qk / wv / dense / other) by the kernels' named scopes
and einsum equations, as far as XLA kept them. The audit asserts on this summary
(`attnprec.inspect.report.check_compiled`): a dot's result type is its accumulation type,
so a compiled dot narrower than the contract's float32 accumulation is a FAIL.
"""
import dataclasses
import re
from typing import Dict, Optional

from attnprec.contract import QK_SCOPE, WV_SCOPE

_LAYER = re.compile(r"layer_(\d+)")


# ----------------------------------------------------------------------------- sites
# In op_name metadata the dot_product kernel's dots carry its named scopes. The blockwise
# kernel's dots sit in loop bodies whose op_names are relative ('cond/branch_1_fun/...')
# and jax.nn's inside jax itself, so they are recognised by the einsum equation their name
# carries, in the project's axis letters (T queries, S keys, H head dim): QK^T contracts H
# and yields T and S ('BTKGH,BSKH->BKGTS'); the wv dot contracts S and yields T and H.
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
  """Where a compiled dot sits, from its op_name:
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
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<type>\w+)\[(?P<dims>[^\]]*)\](?:\{[^}]*\})? "
    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$")
_HLO_OPERAND = re.compile(r"%([\w.\-]+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# '%fused_computation.3 (param_0: bf16[16,64], ...) -> f32[16,128] {' / 'ENTRY %main ...'
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_FUSION_KIND = re.compile(r'"kind":"([^"]+)"')      # backend_config's fusion kind
_FUSION_KIND_HLO = re.compile(r"kind=(k\w+)")      # else HLO's own (kLoop, kCustom, ...)
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# custom-call targets that are a matrix product (oneDNN, XNNPACK, Eigen, BLAS, ...)
_MATMUL_TARGET = re.compile(r"matmul|gemm|\bdot\b|_dot|dot_", re.IGNORECASE)


_NARROW = ("bf16", "f16")
# Ops that move or replicate values without changing them: followed when tracing where a
# dot's operands come from and where its result goes.
_PASS_THROUGH = ("bitcast", "copy", "transpose", "reshape", "broadcast", "slice",
                 "dynamic-slice")


@dataclasses.dataclass(frozen=True)
class CompiledDot:
  lhs_type: str
  rhs_type: str
  result_type: str         # the dot's accumulation / result type
  name: str                # metadata op_name ('' if XLA dropped it)
  batched: bool = False    # has batch dimensions (the attention dots of this model)
  via: str = "dot"         # 'dot', 'dot in <kind> fusion', 'custom-call <target>'
  # the 16-bit type each operand was converted up from (through moves and fusions), if any
  lhs_from: Optional[str] = None
  rhs_from: Optional[str] = None
  rounded_to: Optional[str] = None   # 16-bit type the result is converted to right after
  contracting: tuple = ()            # sizes of the lhs contracting dimensions
  # where the op_name is gone: 'qk' / 'wv' told apart by structure (`compiled_summary`'s
  # head_dim: a batched dot contracting exactly the head dim is a qk product), else None
  inferred_site: Optional[str] = None

  @property
  def backward(self) -> bool:
    """A dot of a gradient computation (JAX names them 'transpose(jvp(...))')."""
    return "transpose(" in self.name

  @property
  def site(self) -> str:
    named = site(self.name)
    return self.inferred_site if named == "other" and self.inferred_site else named

  @property
  def layer(self) -> Optional[int]:
    m = _LAYER.search(self.name)
    return int(m.group(1)) if m else None

  @property
  def types(self) -> str:
    return f"{self.lhs_type}x{self.rhs_type}->{self.result_type}"

  @property
  def described(self) -> str:
    """'f32<-bf16 x bf16 -> f32->bf16' (the audit's notation)."""
    lhs = self.lhs_type + (f"<-{self.lhs_from}" if self.lhs_from else "")
    rhs = self.rhs_type + (f"<-{self.rhs_from}" if self.rhs_from else "")
    return f"{lhs} x {rhs} -> {self.result_type}" + (
        f"->{self.rounded_to}" if self.rounded_to else "")


@dataclasses.dataclass
class _Instr:
  name: str
  type: str
  op: str
  operands: list
  rest: str
  computation: str
  root: bool
  dims: tuple = ()


class _Program:
  """The compiled HLO text as instructions, with who uses what and which fusion calls
  which computation (enough to follow a value through fusions)."""

  def __init__(self, text: str):
    self.instrs: Dict[str, _Instr] = {}
    self.roots: Dict[str, str] = {}
    self.params: Dict[tuple, str] = {}         # (computation, index) -> parameter name
    computation = ""
    for line in text.splitlines():
      c = _COMPUTATION.match(line)
      if c and " = " not in line:
        computation = c.group("name")
        continue
      m = _HLO_INSTR.match(line)
      if not m:
        continue
      i = _Instr(m.group("name"), m.group("type"), m.group("op"),
                 _HLO_OPERAND.findall(m.group("args")), m.group("rest"), computation,
                 line.lstrip().startswith("ROOT "),
                 tuple(int(x) for x in m.group("dims").split(",") if x.strip().isdigit()))
      self.instrs[i.name] = i
      if i.root:
        self.roots[computation] = i.name
      if i.op == "parameter":
        self.params[(computation, int(m.group("args") or 0))] = i.name
    self.callers: Dict[str, _Instr] = {}       # fused computation -> its fusion
    self.kind_of: Dict[str, str] = {}
    self.users: Dict[str, list] = {}
    for i in self.instrs.values():
      for k, o in enumerate(i.operands):
        self.users.setdefault(o, []).append((i, k))
      if i.op == "fusion":
        called = _CALLS.search(i.rest)
        kind = _FUSION_KIND.search(i.rest) or _FUSION_KIND_HLO.search(i.rest)
        if called:
          self.callers[called.group(1)] = i
          self.kind_of[called.group(1)] = kind.group(1) if kind else "?"

  def upcast_from(self, name: str, depth: int = 8) -> Optional[str]:
    """The 16-bit type the value `name` was converted up from, following moves, fusion
    roots and fusion parameters back to where it was made; None if it was made wide."""
    i = self.instrs.get(name)
    if i is None or depth == 0:
      return None
    if i.op == "convert" and i.operands:
      src = self.instrs.get(i.operands[0])
      if src is not None and src.type in _NARROW and i.type not in _NARROW:
        return src.type
      return None
    if i.op in _PASS_THROUGH and i.operands:
      return self.upcast_from(i.operands[0], depth - 1)
    if i.op == "fusion":
      called = _CALLS.search(i.rest)
      root = self.roots.get(called.group(1)) if called else None
      return self.upcast_from(root, depth - 1) if root else None
    if i.op == "parameter" and i.computation in self.callers:
      index = int(next((p for (c, p), n in self.params.items()
                        if c == i.computation and n == name), -1))
      caller = self.callers[i.computation]
      if 0 <= index < len(caller.operands):
        return self.upcast_from(caller.operands[index], depth - 1)
    return None

  def rounded_to(self, name: str, depth: int = 6) -> Optional[str]:
    """The 16-bit type the value `name` is converted down to by what uses it (through
    moves, into fusions and out of a fusion whose root it is), else None."""
    if depth == 0:
      return None
    i = self.instrs[name]
    targets = []
    if i.root and i.computation in self.callers:      # leaves the fusion as its result
      targets.append(self.callers[i.computation].name)
    for user, k in self.users.get(name, []):
      if user.op == "convert" and user.type in _NARROW:
        return user.type
      if user.op in _PASS_THROUGH:
        targets.append(user.name)
      elif user.op == "fusion":
        called = _CALLS.search(user.rest)
        param = self.params.get((called.group(1), k)) if called else None
        if param:
          targets.append(param)
    for t in targets:
      found = self.rounded_to(t, depth - 1)
      if found:
        return found
    return None


def compiled_summary(text: str, head_dim: Optional[int] = None,
                     key_lengths: tuple = ()) -> dict:
  """What the backend compiled: {'dots': [CompiledDot], 'converts': {'bf16->f32': n},
  'fusions': n} from `lowered.compile().as_text()` (HLO text). Dots inside fused
  computations are listed with the kind of the fusion that calls them; a custom-call to a
  matmul library counts as a dot (its result type is what the library returns). Each
  dot's operands are traced back to any 16-bit value they were converted up from, and
  its result forward to any conversion down to 16 bits right after it.

  XLA may drop a dot's op_name when it rewrites it (e.g. squeezing a kv-head axis of
  size 1). With `head_dim` (and the key lengths S the program attends over), such a
  batched dot of a forward program is attributed by structure: contracting exactly the
  head dim -> 'qk', contracting a key length -> 'wv' (left 'other' where head_dim is
  itself a key length)."""
  prog = _Program(text)
  dots, converts, fusions = [], {}, 0
  for i in prog.instrs.values():
    target = _TARGET.search(i.rest) if i.op == "custom-call" else None
    if (i.op == "dot" or (target and _MATMUL_TARGET.search(target.group(1)))) and \
        len(i.operands) >= 2:
      name = _OP_NAME.search(i.rest)
      via = ("custom-call " + target.group(1) if target else
             f"dot in {prog.kind_of[i.computation]} fusion" if i.computation in prog.kind_of
             else "dot")
      types = [prog.instrs[o].type if o in prog.instrs else "?" for o in i.operands[:2]]
      lhs = prog.instrs.get(i.operands[0])
      axes = _CONTRACTING.search(i.rest)
      contracting = tuple(lhs.dims[int(a)] for a in axes.group(1).split(",") if a) \
          if axes and lhs is not None and lhs.dims else ()
      batched = "lhs_batch_dims" in i.rest
      inferred = None
      if batched and head_dim and head_dim not in key_lengths and len(contracting) == 1:
        inferred = ("qk" if contracting[0] == head_dim else
                    "wv" if contracting[0] in key_lengths else None)
      dots.append(CompiledDot(types[0], types[1], i.type, name.group(1) if name else "",
                              batched, via, prog.upcast_from(i.operands[0]),
                              prog.upcast_from(i.operands[1]), prog.rounded_to(i.name),
                              contracting, inferred))
    elif i.op == "convert" and i.operands:
      src = prog.instrs.get(i.operands[0])
      key = f"{src.type if src else '?'}->{i.type}"
      converts[key] = converts.get(key, 0) + 1
    elif i.op == "fusion":
      fusions += 1
  return {"dots": dots, "converts": dict(sorted(converts.items())), "fusions": fusions}

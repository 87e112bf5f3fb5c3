"""What the backend compiled: dots and converts of `lowered.compile().as_text()`.

The lowered program (StableHLO, the program's own statement of its types) is read by
`attnprec.inspect.finder` through the MLIR bindings. The compiled program is XLA's HLO after its
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
import collections
import dataclasses
import re
from typing import Dict, Optional

from attnprec.contract import QK_SCOPE, WV_SCOPE
from attnprec.inspect.finder import is_code

LAYER = re.compile(r"layer_(\d+)")   # a Haiku layer module's name in an op_name


# ----------------------------------------------------------------------------- sites
# In op_name metadata the dot_product kernel's dots carry its named scopes. The blockwise
# kernel's dots sit in loop bodies whose op_names are relative ('cond/branch_1_fun/...')
# and jax.nn's inside jax itself, so they are recognised by the einsum equation their name
# carries, in the project's axis letters (T queries, S keys, H head dim): QK^T contracts H
# and yields T and S ('BTKGH,BSKH->BKGTS'); the wv dot contracts S and yields T and H.
_EQUATION = re.compile(r"(?:^|/|\()([A-Z]+),([A-Z]+)->([A-Z]+)[)/]")
# (a scanned model's blocks, model.scan_layers: decoder/while/body/closed_call/layer/...)
_DENSE = re.compile(r"(?:^|/|\()decoder\)*/(?:(?:layer_\d+|while/body/(?:\w+/)*layer)/"
                    r"(?:attn/[qkvo]|mlp/\w+)/|BTD,DV->BTV/)")


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
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<type>\w+)\[(?P<dims>[^\]]*)\]"
    r"(?:\{(?P<layout>[^}]*)\})? (?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$")
# an instruction of a tuple type (a while loop, a conditional, a multi-output fusion; the
# TPU's layouts hold parentheses: '(f32[2,8]{1,0:T(2,128)S(1)}, ...)')
_HLO_TUPLE_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = \((?:[^()]|\([^()]*\))*\) "
    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$")
_INDEX = re.compile(r"\bindex=(\d+)")
_LOOP_PARTS = re.compile(r"\b(?:body|condition|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_HLO_OPERAND = re.compile(r"%([\w.\-]+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
OP_NAME = re.compile(r'op_name="([^"]*)"')    # an HLO instruction's op_name (also mosaic.py)
# '%fused_computation.3 (param_0: bf16[16,64], ...) -> f32[16,128] {' / 'ENTRY %main ...'
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_DIMENSIONS = re.compile(r"dimensions=\{([\d,]*)\}")
_FUSION_KIND = re.compile(r'"kind":"([^"]+)"')      # backend_config's fusion kind
_FUSION_KIND_HLO = re.compile(r"kind=(k\w+)")      # else HLO's own (kLoop, kCustom, ...)
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# A dot as the TPU compiler writes it: a `convolution` whose dim_labels name the lhs's
# contracting ('f') and the rhs's ('i') dimensions, and whose precision is printed only
# when it is not DEFAULT (`operand_precision={highest,highest}`) or as a dot algorithm.
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW_SIZE = re.compile(r"window=\{size=([\dx]+)")
_GROUPS = re.compile(r"(?:feature|batch)_group_count=(\d+)")
_OPERAND_PRECISION = re.compile(r"operand_precision=\{([\w,]*)\}")
_ALGORITHM = re.compile(r"\balgorithm=(\w+)")
_PRECISION_ORDER = ("default", "high", "highest")
# custom-call targets that are a matrix product (oneDNN, XNNPACK, Eigen, BLAS, ...)
_MATMUL_TARGET = re.compile(r"matmul|gemm|\bdot\b|_dot|dot_", re.IGNORECASE)


_NARROW = ("bf16", "f16")
# Ops that move or replicate values without changing them: followed when tracing where a
# dot's operands come from and where its result goes.
_PASS_THROUGH = ("bitcast", "copy", "transpose", "reshape", "broadcast", "slice",
                 "dynamic-slice")


# Ops whose value is another's across a boundary (or a convert of it): followed, with
# the moves, when reading where an operand comes from.
_BOUNDARIES = ("convert", "fusion", "parameter", "get-tuple-element")
# Elementwise ops a (de)quantization is made of: followed when looking for codes.
_ARITHMETIC = ("multiply", "divide", "negate", "clamp", "round-nearest-even",
               "round-nearest-afz", "maximum", "minimum", "floor", "select")


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
  # a quantized KV cache: the converts from or to a code type (`is_code`: s8, f8e4m3fn,
  # ...) on each operand's way back, the nearest first ('s8->bf16'), and whether the
  # nearest reaches the dot through moves, converts and fusion boundaries only
  lhs_codes: tuple = ()
  rhs_codes: tuple = ()
  lhs_codes_direct: bool = True
  rhs_codes_direct: bool = True
  # ((type, along, rounded), ...): the multiplies by a broadcast non-constant value on each
  # operand's way back (along: varying along the axis it contracts: a value scale on the
  # probabilities, a per-channel key scale on q) and right after the dot (along: varying
  # along the keys' axis: a per-token key scale on the logits; rounded: the 16-bit type
  # the scale was converted up from on its way, or '')
  lhs_scaled: tuple = ()
  rhs_scaled: tuple = ()
  scaled_after: tuple = ()
  # How the dot multiplies, as the compiled program states it: 'default', 'high',
  # 'highest' (XLA's operand_precision; absent: DEFAULT) or 'algorithm NAME'.
  precision: str = "default"
  # Where its result goes: ((op_name, precision), ...) of the dots that read it (through
  # moves and fusion boundaries), and whether nothing else does (a result that only
  # dots read may be stored in the type those dots multiply in: `platforms`).
  feeds: tuple = ()
  feeds_only_dots: bool = False

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
    m = LAYER.search(self.name)
    return int(m.group(1)) if m else None

  @property
  def types(self) -> str:
    return f"{self.lhs_type}x{self.rhs_type}->{self.result_type}"

  @property
  def described(self) -> str:
    """'f32<-bf16 x bf16 -> f32->bf16' (the audit's notation); codes an operand is made
    from: 'bf16<-s8'; a cache scale: '(x f32)' on an operand, '-> f32 (x f32)' after."""
    def operand(t, up, codes, scaled):
      code = codes[0].split("->")[0] if codes else None
      return t + (f"<-{up}" if up else "") + (f"<-{code}" if code else "") + _times(scaled)
    lhs = operand(self.lhs_type, self.lhs_from, self.lhs_codes, self.lhs_scaled)
    rhs = operand(self.rhs_type, self.rhs_from, self.rhs_codes, self.rhs_scaled)
    return f"{lhs} x {rhs} -> {self.result_type}" + (
        f"->{self.rounded_to}" if self.rounded_to else "") + _times(self.scaled_after)


def _times(scaled: tuple) -> str:
  """' (x f32)' for the scalings along the tracked axis (a cache scale's: ' (x f32<-bf16)'
  where the scale was rounded to bf16 on its way), else ''."""
  types = sorted({t + (f"<-{up}" if up else "") for t, along, up in scaled if along})
  return f" (x {'/'.join(types)})" if types else ""


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
  layout: Optional[tuple] = None     # minor-to-major, when the text gives one


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
      t = None if m else _HLO_TUPLE_INSTR.match(line)
      if t:
        i = _Instr(t.group("name"), "tuple", t.group("op"),
                   _HLO_OPERAND.findall(t.group("args")), t.group("rest"), computation,
                   line.lstrip().startswith("ROOT "))
      elif m:
        i = _Instr(m.group("name"), m.group("type"), m.group("op"),
                   _HLO_OPERAND.findall(m.group("args")), m.group("rest"), computation,
                   line.lstrip().startswith("ROOT "),
                   tuple(int(x) for x in m.group("dims").split(",") if x.strip().isdigit()),
                   _layout(m.group("layout")))
      else:
        continue
      self.instrs[i.name] = i
      if i.root:
        self.roots[computation] = i.name
      if i.op == "parameter" and m:
        self.params[(computation, int(m.group("args") or 0))] = i.name
    self.callers: Dict[str, _Instr] = {}       # fused computation -> its fusion
    self.kind_of: Dict[str, str] = {}
    self.users: Dict[str, list] = {}
    # while body / condition, conditional branch -> (the instruction, its tuple operand)
    self.loop_of: Dict[str, tuple] = {}
    for i in self.instrs.values():
      for k, o in enumerate(i.operands):
        self.users.setdefault(o, []).append((i, k))
      if i.op == "while":
        for c in _LOOP_PARTS.findall(i.rest):
          self.loop_of[c] = (i, 0)
      elif i.op == "conditional":
        named = _LOOP_PARTS.findall(i.rest)      # true_computation, false_computation
        listed = _BRANCHES.search(i.rest)
        branches = ([b.strip().lstrip("%") for b in listed.group(1).split(",")]
                    if listed else named)
        for j, c in enumerate(branches):
          self.loop_of[c] = (i, j + 1)
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

  def _tuple_element(self, t: Optional[_Instr], k: int, depth: int = 8) -> list:
    """The values element k of the tuple value t can be: a tuple's operand, a while
    loop's initial or carried element, a fused computation's root element, a loop body's
    or branch's parameter element."""
    if t is None or depth == 0:
      return []
    if t.op == "tuple":
      return [t.operands[k]] if k < len(t.operands) else []
    if t.op in ("while", "fusion"):
      called = (_LOOP_PARTS.findall(t.rest) if t.op == "while" else
                [c.group(1) for c in [_CALLS.search(t.rest)] if c])
      roots = [self.instrs.get(self.roots.get(c, "")) for c in called]
      out = [v for r in roots for v in self._tuple_element(r, k, depth - 1)]
      if t.op == "while" and t.operands:
        out += self._tuple_element(self.instrs.get(t.operands[0]), k, depth - 1)
      return out
    if t.op == "parameter" and t.computation in self.loop_of:
      owner, j = self.loop_of[t.computation]
      if owner.op == "while":
        return self._tuple_element(owner, k, depth - 1)
      return self._tuple_element(self.instrs.get(owner.operands[j]), k, depth - 1) \
          if j < len(owner.operands) else []
    if t.op == "get-tuple-element":
      return [v for src in self._sources(t)
              for v in self._tuple_element(self.instrs.get(src), k, depth - 1)]
    return []

  def _sources(self, i: _Instr) -> list:
    """The values an instruction reads, a fusion's root, a fused parameter's argument
    and a tuple element's sources standing in for fusion, loop and branch boundaries."""
    if i.op == "get-tuple-element" and i.operands:
      index = _INDEX.search(i.rest)
      return self._tuple_element(self.instrs.get(i.operands[0]),
                                 int(index.group(1))) if index else []
    if i.op == "fusion":
      called = _CALLS.search(i.rest)
      root = self.roots.get(called.group(1)) if called else None
      return [root] if root else []
    if i.op == "parameter" and i.computation in self.callers:
      index = next((p for (c, p), n in self.params.items()
                    if c == i.computation and n == i.name), -1)
      caller = self.callers[i.computation]
      return [caller.operands[index]] if 0 <= index < len(caller.operands) else []
    return i.operands

  def code_casts(self, name: str, limit: int = 400) -> tuple:
    """((converts from or to a code type, nearest first: 's8->bf16'), direct) on the way
    back from the value `name` through moves, converts, fusion boundaries and elementwise
    arithmetic; direct: the nearest reached through moves, converts and boundaries only."""
    casts, direct = [], None
    queue, seen = collections.deque([(name, True)]), set()
    while queue and len(seen) < limit:
      n, moved_only = queue.popleft()
      i = self.instrs.get(n)
      if i is None or n in seen:
        continue
      seen.add(n)
      if i.op == "convert" and i.operands:
        src = self.instrs.get(i.operands[0])
        if src is not None and (is_code(src.type) or is_code(i.type)):
          casts.append(f"{src.type}->{i.type}")
          direct = moved_only if direct is None else direct
      moves = i.op in _PASS_THROUGH or i.op in _BOUNDARIES
      if moves or i.op in _ARITHMETIC:
        queue.extend((o, moved_only and moves) for o in self._sources(i))
    return tuple(casts), bool(direct) if casts else True

  def _broadcast_dims(self, name: str, dims: tuple) -> Optional[tuple]:
    """(the dims it varies along, the 16-bit type it was converted up from or '') of the
    multiply's operand `name` (of shape `dims`), if it is a broadcast of a value no
    constant makes (through same-shape moves and fusion boundaries); None otherwise (a
    constant, or a full array)."""
    i = self.instrs.get(name)
    for _ in range(8):
      if i is None or i.dims != dims:
        return None
      if i.op == "broadcast":
        if not i.operands or self._constant(i.operands[0]):
          return None
        return (tuple(int(x) for x in _dimensions(i.rest)),
                self.upcast_from(i.operands[0]) or "")
      if i.op not in ("copy", "bitcast") and i.op not in _BOUNDARIES:
        return None
      src = self._sources(i)
      i = self.instrs.get(src[0]) if src else None
    return None

  def _constant(self, name: str, depth: int = 8) -> bool:
    i = self.instrs.get(name)
    if i is None or depth == 0:
      return False
    if i.op in ("constant", "iota"):
      return True
    if i.op in _PASS_THROUGH or i.op in _BOUNDARIES:
      src = self._sources(i)
      return bool(src) and all(self._constant(o, depth - 1) for o in src)
    return False

  def _axis_back(self, i: _Instr, axis: Optional[int]) -> list:
    """[(source, its axis)] for the values i is moved from (axis None: not tracked)."""
    src = self._sources(i)
    if axis is None or i.op in _BOUNDARIES or i.op == "copy":
      return [(o, axis) for o in src]
    if i.op == "transpose":
      perm = _dimensions(i.rest)
      return [(src[0], perm[axis] if axis < len(perm) else None)]
    if i.op in ("bitcast", "reshape") and src and src[0] in self.instrs:
      return [(src[0], _moved_axis(i.op, i, self.instrs[src[0]], axis))]
    return [(o, None) for o in src]

  def _axis_forward(self, user: _Instr, k: int, axis: Optional[int]) -> Optional[int]:
    if axis is None or user.op in ("fusion", "convert", "copy"):
      return axis
    if user.op == "transpose":
      perm = _dimensions(user.rest)
      return perm.index(axis) if axis in perm else None
    if user.op in ("bitcast", "reshape"):
      return _moved_axis(user.op, self.instrs[user.operands[k]], user, axis)
    return None

  def scaled_before(self, name: str, axis: Optional[int], limit: int = 200) -> tuple:
    """((type, along, rounded), ...): the multiplies by a broadcast non-constant value on
    the way back from the operand `name` (through moves, converts, fusion boundaries and
    other multiplies); along: whether the broadcast varies along `axis` of the operand
    (its contracted one: the keys for the probabilities, the head dim for q); rounded:
    the 16-bit type the broadcast value was converted up from, or ''."""
    found, stack, seen = [], [(name, axis)], set()
    while stack and len(seen) < limit:
      n, ax = stack.pop()
      i = self.instrs.get(n)
      if i is None or (n, ax) in seen:
        continue
      seen.add((n, ax))
      if i.op == "multiply":
        for o in i.operands:
          scale = self._broadcast_dims(o, i.dims)
          if scale is not None:
            found.append((i.type, ax is not None and ax in scale[0], scale[1]))
          elif not self._constant(o):
            stack.append((o, ax))
      elif i.op in _PASS_THROUGH or i.op in _BOUNDARIES:
        stack.extend(self._axis_back(i, ax))
    return tuple(sorted(set(found)))

  def scaled_after(self, name: str, axis: Optional[int], depth: int = 8) -> tuple:
    """((type, along, rounded), ...): the multiplies by a broadcast non-constant value the
    result `name` goes through right after it is made (through moves, fusion boundaries
    and constant multiplies); along: whether it varies along `axis` of the result."""
    if depth == 0 or name not in self.instrs:
      return ()
    i = self.instrs[name]
    found, targets = set(), []
    if i.root and i.computation in self.callers:
      targets.append((self.callers[i.computation].name, axis))
    for user, k in self.users.get(name, []):
      if user.op == "multiply" and len(user.operands) == 2:
        scale = self._broadcast_dims(user.operands[1 - k], user.dims)
        if scale is not None:
          found.add((user.type, axis is not None and axis in scale[0], scale[1]))
        elif self._constant(user.operands[1 - k]):
          targets.append((user.name, axis))
      elif user.op in ("bitcast", "copy", "transpose", "reshape", "convert"):
        targets.append((user.name, self._axis_forward(user, k, axis)))
      elif user.op == "fusion":
        called = _CALLS.search(user.rest)
        param = self.params.get((called.group(1), k)) if called else None
        if param:
          targets.append((param, axis))
    for t, ax in targets:
      found.update(self.scaled_after(t, ax, depth - 1))
    return tuple(sorted(found))

  def readers(self, name: str, limit: int = 200) -> tuple:
    """(the dots that read the value `name`, whether nothing but dots does), following
    it through moves, fusion boundaries (into a fused parameter, out of a fusion whose
    root it is or a tuple it roots) and tuple elements."""
    dots, only, seen = [], True, set()
    stack = [name]
    while stack and len(seen) < limit:
      n = stack.pop()
      if n in seen or n not in self.instrs:
        continue
      seen.add(n)
      i = self.instrs[n]
      if i.root and i.computation in self.callers:
        stack.append(self.callers[i.computation].name)
      for user, k in self.users.get(n, []):
        if _is_dot(user):
          dots.append(user)
        elif user.op in _PASS_THROUGH or user.op in ("get-tuple-element",):
          stack.append(user.name)
        elif user.op == "tuple" and user.root and user.computation in self.callers:
          caller = self.callers[user.computation]
          stack += [u.name for u, _ in self.users.get(caller.name, [])
                    if u.op == "get-tuple-element" and _INDEX.search(u.rest)
                    and int(_INDEX.search(u.rest).group(1)) == k]
        elif user.op == "fusion":
          called = _CALLS.search(user.rest)
          param = self.params.get((called.group(1), k)) if called else None
          if param:
            stack.append(param)
          else:
            only = False
        else:
          only = False
    return tuple(dots), only and bool(dots)

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


def _precision(rest: str) -> str:
  """The compiled dot's precision: 'default' (XLA prints none), the highest of its
  operand_precision pair, or 'algorithm NAME'."""
  algorithm = _ALGORITHM.search(rest)
  if algorithm:
    return f"algorithm {algorithm.group(1)}"
  m = _OPERAND_PRECISION.search(rest)
  if not m:
    return "default"
  names = [x.strip().lower() for x in m.group(1).split(",") if x.strip()]
  return max(names, key=lambda x: _PRECISION_ORDER.index(x)
             if x in _PRECISION_ORDER else -1) if names else "default"


def _dot_shape(i: _Instr, prog: "_Program") -> tuple:
  """(contracting sizes, batched) of a dot or of a convolution that is one: a
  convolution's lhs contracting dim is its 'f' label; it is batched when its window
  spans more than one element or it groups features or batches (how the TPU compiler
  writes a batched dot_general)."""
  lhs = prog.instrs.get(i.operands[0]) if i.operands else None
  if i.op == "convolution":
    labels = _DIM_LABELS.search(i.rest)
    window = _WINDOW_SIZE.search(i.rest)
    groups = [int(g) for g in _GROUPS.findall(i.rest)]
    batched = bool(window and any(int(x) > 1 for x in window.group(1).split("x"))) or \
        any(g > 1 for g in groups)
    if not labels or lhs is None or len(labels.group(1)) != len(lhs.dims):
      return (), batched
    return tuple(lhs.dims[k] for k, c in enumerate(labels.group(1)) if c == "f"), batched
  axes = _CONTRACTING.search(i.rest)
  contracting = tuple(lhs.dims[int(a)] for a in axes.group(1).split(",") if a) \
      if axes and lhs is not None and lhs.dims else ()
  return contracting, "lhs_batch_dims" in i.rest


def _is_dot(i: _Instr) -> bool:
  target = _TARGET.search(i.rest) if i.op == "custom-call" else None
  return (i.op in ("dot", "convolution") or bool(
      target and _MATMUL_TARGET.search(target.group(1)))) and len(i.operands) >= 2


def _layout(text: Optional[str]) -> Optional[tuple]:
  """'3,2,1,0' -> (3, 2, 1, 0); None where there is none (or tiling follows it)."""
  if not text or not all(x.strip().isdigit() for x in text.split(",")):
    return None
  return tuple(int(x) for x in text.split(","))


def _dimensions(rest: str) -> list:
  m = _DIMENSIONS.search(rest)
  return [int(x) for x in m.group(1).split(",") if x] if m else []


def _reshaped_axis(axis: int, src: tuple, dst: tuple, src_layout: Optional[tuple] = None,
                   dst_layout: Optional[tuple] = None) -> Optional[int]:
  """The axis of dst that holds exactly axis `axis` of src (the same span of elements in
  memory order) when a value of shape src is reshaped, or bitcast with these layouts
  (minor-to-major; None: row-major), to shape dst; None if none does."""
  def spans(shape, layout):
    order = layout if layout is not None else tuple(range(len(shape)))[::-1]
    out, inner = {}, 1
    for d in order:
      out[d] = (inner, inner * shape[d])
      inner *= shape[d]
    return out
  if axis >= len(src) or src[axis] == 1:
    return None
  want = spans(src, src_layout)[axis]
  return next((j for j, sp in spans(dst, dst_layout).items() if sp == want and dst[j] != 1),
              None)


def _moved_axis(op: str, src: _Instr, dst: _Instr, axis: int) -> Optional[int]:
  """`_reshaped_axis` from instruction src's value to dst's, related by `op`: a reshape
  (logical: row-major) or a bitcast (physical: by their layouts)."""
  if op == "reshape":
    return _reshaped_axis(axis, src.dims, dst.dims)
  return _reshaped_axis(axis, src.dims, dst.dims, src.layout, dst.layout)


def _op_name(i: _Instr) -> str:
  m = OP_NAME.search(i.rest)
  return m.group(1) if m else ""


def _dot_dims(rest: str, key: str) -> tuple:
  m = re.search(key + r"=\{([\d,]*)\}", rest)
  return tuple(int(x) for x in m.group(1).split(",") if x) if m else ()


def _key_axis(i: _Instr, prog: "_Program", codes: tuple) -> Optional[int]:
  """The result axis of a dot that the operand holding codes (keys) contributes, when it
  has exactly one free dim (a qk product's key axis), else None."""
  coded = [k for k in (0, 1) if codes[k]]
  if len(coded) != 1:
    return None
  side = ("lhs", "rhs")[coded[0]]
  operand = prog.instrs.get(i.operands[coded[0]])
  if operand is None:
    return None
  batch = _dot_dims(i.rest, f"{side}_batch_dims")
  free = [d for d in range(len(operand.dims))
          if d not in batch and d not in _dot_dims(i.rest, f"{side}_contracting_dims")]
  if len(free) != 1:
    return None
  lhs = prog.instrs.get(i.operands[0])
  lhs_free = 0 if lhs is None else len(lhs.dims) - len(_dot_dims(i.rest, "lhs_batch_dims")) \
      - len(_dot_dims(i.rest, "lhs_contracting_dims"))
  return len(batch) + (0 if side == "lhs" else lhs_free)


def _contracted_axis(i: _Instr, side: str) -> Optional[int]:
  dims = _dot_dims(i.rest, f"{side}_contracting_dims")
  return dims[0] if len(dims) == 1 else None


def _cache_reads(dot: CompiledDot, i: _Instr, prog: _Program) -> CompiledDot:
  """An attention dot with what a quantized KV cache leaves on it: the codes its
  operands are converted from and the scale multiplies on its operands and result."""
  (lhs_codes, lhs_direct), (rhs_codes, rhs_direct) = (
      prog.code_casts(o) for o in i.operands[:2])
  return dataclasses.replace(
      dot, lhs_codes=lhs_codes, rhs_codes=rhs_codes, lhs_codes_direct=lhs_direct,
      rhs_codes_direct=rhs_direct,
      lhs_scaled=prog.scaled_before(i.operands[0], _contracted_axis(i, "lhs")),
      rhs_scaled=prog.scaled_before(i.operands[1], _contracted_axis(i, "rhs")),
      scaled_after=prog.scaled_after(i.name, _key_axis(i, prog, (lhs_codes, rhs_codes))))


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
  itself a key length).

  Attention dots (qk / wv) also get what a quantized KV cache leaves on them
  (`_cache_reads`): the converts from a code type on each operand's way back (through
  moves, fusion, loop and branch boundaries and elementwise arithmetic) and the
  multiplies by a broadcast cache scale on the operands and the result, told apart from
  the softmax's normalisation by the axis they vary along."""
  prog = _Program(text)
  dots, converts, fusions = [], {}, 0
  for i in prog.instrs.values():
    target = _TARGET.search(i.rest) if i.op == "custom-call" else None
    if _is_dot(i):
      name = OP_NAME.search(i.rest)
      via = ("custom-call " + target.group(1) if target else
             f"{i.op} in {prog.kind_of[i.computation]} fusion"
             if i.computation in prog.kind_of else i.op)
      types = [prog.instrs[o].type if o in prog.instrs else "?" for o in i.operands[:2]]
      contracting, batched = _dot_shape(i, prog)
      readers, only_dots = prog.readers(i.name)
      feeds = tuple((_op_name(r), _precision(r.rest)) for r in readers)
      inferred = None
      if batched and head_dim and head_dim not in key_lengths and len(contracting) == 1:
        inferred = ("qk" if contracting[0] == head_dim else
                    "wv" if contracting[0] in key_lengths else None)
      dot = CompiledDot(types[0], types[1], i.type, name.group(1) if name else "",
                        batched, via, prog.upcast_from(i.operands[0]),
                        prog.upcast_from(i.operands[1]), prog.rounded_to(i.name),
                        contracting, inferred, precision=_precision(i.rest),
                        feeds=feeds, feeds_only_dots=only_dots)
      dots.append(_cache_reads(dot, i, prog) if dot.site in ("qk", "wv") else dot)
    elif i.op == "convert" and i.operands:
      src = prog.instrs.get(i.operands[0])
      key = f"{src.type if src else '?'}->{i.type}"
      converts[key] = converts.get(key, 0) + 1
    elif i.op == "fusion":
      fusions += 1
  return {"dots": dots, "converts": dict(sorted(converts.items())), "fusions": fusions}

"""Finds every attention in a lowered program by its structure, not by its names.

An attention is three things in the dataflow graph (`attnprec.inspect.mlir_graph`):

  qk dot     a `dot_general` whose result flows (through any op but another dot:
             converts, broadcasts, reshapes, transposes, scaling, soft-cap tanh, masks
             by select or bias, reductions, loop carries) into
  softmax    an `exponential` of (x - m) where m comes from a max-reduction of x
             (`stablehlo.reduce` with a `maximum` body; the blockwise kernel's running
             max `maximum(m_old, reduce_max(x))` is found the same way), whose result
             is summed by an add-reduction and normalised by that sum: `exp / sum` or
             `exp * (1 / sum)` (jax.nn.softmax, its custom_jvp form,
             jax.nn.dot_product_attention's xla path, Haiku's MultiHeadAttention), or,
             online (flash / blockwise: the unnormalised exp enters the dot and the sum
             is carried through the loop), by a divide of what that dot accumulated;
             an exp without the max (an unstabilised softmax) is accepted and marked;
  wv dot     a `dot_general` that reads the probabilities through converts, reshapes,
             transposes, broadcasts and slices (and scalings by values no dot made:
             dropout, masks), and contracts the axis the
             softmax summed over (a dot that contracts another axis of the
             probabilities is the gradient dv = p^T dout).

Loops (`while` from scan / fori_loop), conditionals (`case` from lax.cond) and private
functions (`func.call`) are resolved by the graph, so the blockwise kernel's online
softmax inside scan bodies is found like a dense one. The log-softmax of a loss is not an
attention: nothing divides by its sum.

Gradient (backward) dots of an attention are the other dots that read the same q, k, v
or probabilities (followed back through data movement: converts, reshapes, transposes,
slices, dynamic_update_slice stacks, loop carries): dk reads q, dq reads k, dp reads v,
dv reads p. Every other dot is a dense dot.

A quantized KV cache leaves two more things in the program, read here as well:
  codes      converts from or to an 8-bit (or narrower) type (`is_code`: int8, float8, ...)
             on a dot operand's way to the dot (`DotSite.lhs_codes` / `rhs_codes`,
             `CodeCasts`): keys / values read from their codes, or a quantized q;
  scalings   multiplies by a value broadcast from a smaller array that no constant makes
             (`Scaling`): on the path from the qk dot to the softmax (a per-key scale of
             the logits), between the probabilities and the wv dot (a per-key scale of
             the probabilities; the finder follows the probabilities through it), and on
             the qk dot's operands (a per-channel scale of q). Which axes a scale varies
             along is read by following them to the softmax's axis or the qk contraction.
"""
import collections
import dataclasses
import math
import re
from typing import Dict, List, Optional, Set, Tuple

from attnprec.inspect.mlir_graph import Graph, Node, Value, dot_info, int_list
from attnprec.inspect import offset_check

DOT = "stablehlo.dot_general"
EXP = "stablehlo.exponential"
REDUCE = "stablehlo.reduce"
CONVERT = "stablehlo.convert"
# Ops a value passes through unchanged but for its layout / type / loop plumbing.
LAYOUT = {CONVERT, "stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim",
          "mhlo.copy", "stablehlo.copy", "loop_carry", "merge", "stablehlo.slice",
          "stablehlo.dynamic_slice", "stablehlo.optimization_barrier"}
# ... and data movement that can also join values (residual stacks, KV caches, masks).
MOVEMENT = LAYOUT | {"stablehlo.dynamic_update_slice", "stablehlo.concatenate",
                     "stablehlo.pad", "stablehlo.select", "stablehlo.gather"}
BITS = {"f64": 64, "f32": 32, "bf16": 16, "f16": 16, "f8E4M3FN": 8, "f8E5M2": 8}


# ----------------------------------------------------------------------------- plain data
@dataclasses.dataclass
class CodeCasts:
  """The converts from or to a code type (`is_code`) on a dot operand's way back from the
  dot, through data movement and elementwise arithmetic (no dot, no reduction)."""
  casts: List[str]         # 'i8->bf16', the one nearest the dot first
  direct: bool             # the nearest reaches the dot through layout ops and converts only


@dataclasses.dataclass
class Scaling:
  """A multiply by a value broadcast from a smaller array that no constant makes: how a
  quantized cache's scales are applied (`contract.cache_stage_dtypes`)."""
  dtype: str               # the dtype the multiply runs in
  scale: str               # the scale's dtype where it was made, before any convert
  shape: List[int]         # the scale's shape before it was broadcast
  along: str               # 'keys' (varies along the softmax axis), 'channels' (along the
                           # qk dot's contraction), 'elementwise' (not broadcast), 'other'
  casts: List[str] = dataclasses.field(default_factory=list)  # on the scale's way: 'f32->bf16'


@dataclasses.dataclass
class DotSite:
  """One dot_general, as the contract sees it."""
  name: str                # op name path from the locations ('' if none)
  source: str              # file:line of the user code that made it
  lhs: str                 # operand element types ('bf16', ...)
  rhs: str
  result: str
  precision: str           # 'DEFAULT' / 'HIGHEST' / ... ('A,B' if the operands differ)
  algorithm: Optional[str]  # dot algorithm attributes, when a preset was used
  preferred: str           # the result type asked for (preferred_element_type)
  lhs_shape: List[int]
  rhs_shape: List[int]
  result_shape: List[int]
  lhs_source: Optional[str] = None  # the type an operand was upcast from right before
  rhs_source: Optional[str] = None
  converted_to: Optional[str] = None  # the type the result is converted to right after
  role: str = "dense"      # qk / wv / dq / dk / dp / dv / 'qk (recomputed)' / dense
  backward: bool = False
  reads: List[str] = dataclasses.field(default_factory=list)  # the program arguments its
  # operands are made of (through data movement), by their pytree path in the location,
  # e.g. "params['decoder/layer_0/attn/q']['w']": which parameter a dense dot applies
  lhs_codes: Optional[CodeCasts] = None  # code converts on each operand's way (None: none)
  rhs_codes: Optional[CodeCasts] = None

  @property
  def precision_text(self) -> str:
    return f"algorithm <{self.algorithm}>" if self.algorithm else self.precision


@dataclasses.dataclass
class Attention:
  """One attention found in the program (plain data; `report` renders and checks it)."""
  label: str               # common name path of its two dots ('' if none)
  layer: Optional[int]     # from a 'layer_N' name component, if any
  qk: DotSite
  wv: DotSite
  softmax: Dict[str, str]  # {'max': dtype, 'exp': dtype, 'sum': dtype}
  stabilised: bool         # exp(x - max x), not exp(x)
  online: bool             # normalised after the wv dot (blockwise / flash)
  loop: bool               # inside a while loop (scan / fori_loop)
  downcasts: List[str]     # narrowing converts between the qk dot and the exp: 'f32->bf16'
  upcasts: List[str]
  probs_casts: List[str]   # converts (and dropout / mask scalings) between the
                           # probabilities and the wv dot
  soft_cap: bool
  mask: List[str]          # 'select' and/or 'bias'
  logits_scale: bool       # a multiply/divide by a constant between qk and softmax
  backward: List[DotSite] = dataclasses.field(default_factory=list)
  probs_operand: int = 0   # which wv operand (0 lhs, 1 rhs) holds the probabilities
  logits_scales: List[Scaling] = dataclasses.field(default_factory=list)  # qk -> softmax
  probs_scales: List[Scaling] = dataclasses.field(default_factory=list)   # probs -> wv
  q_scales: List[Scaling] = dataclasses.field(default_factory=list)  # on the qk operands
  # The keys' way from the projection to the qk dot: the key offset's row
  # (`attnprec.inspect.offset_check.key_path`).
  key_path: Dict[str, object] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Findings:
  attentions: List[Attention]
  dense: List[DotSite]


# ----------------------------------------------------------------------------- helpers
def _producer(v: Value) -> Optional[Node]:
  return v.producer


def _reducer_kind(node: Node) -> Optional[str]:
  if node.kind != REDUCE:
    return None
  body = set(node.reducer)
  if "stablehlo.maximum" in body:
    return "max"
  if "stablehlo.add" in body:
    return "add"
  return None


def _forward_cone(start: Value) -> Set[int]:
  """Ids of the nodes reachable from `start` without passing through another dot."""
  seen: Set[int] = set()
  stack = [start]
  while stack:
    v = stack.pop()
    for user, _ in v.users:
      if user.id in seen:
        continue
      seen.add(user.id)
      if user.kind != DOT:
        stack.extend(user.outputs)
  return seen


def _back(v: Value, through, limit: int = 100000) -> List[Node]:
  """Producers walked back from v through ops for which through(node) is True."""
  out, seen, stack = [], set(), [v]
  while stack and len(seen) < limit:
    x = stack.pop()
    n = x.producer
    if n is None or n.id in seen:
      continue
    seen.add(n.id)
    out.append(n)
    if through(n):
      stack.extend(n.inputs)
  return out


def _through_layout(v: Value) -> Value:
  """v walked back through single-input layout ops (reshape, transpose, broadcast...)."""
  for _ in range(32):
    n = v.producer
    if n is None or n.kind not in LAYOUT - {CONVERT, "loop_carry", "merge"} \
        or not n.inputs:
      return v
    v = n.inputs[0]
  return v


def _narrowing(src: str, dst: str) -> bool:
  return src in BITS and dst in BITS and BITS[dst] < BITS[src]


def _widening(src: str, dst: str) -> bool:
  return src in BITS and dst in BITS and BITS[dst] > BITS[src]


def _is_constant(v: Value) -> bool:
  for _ in range(16):
    n = v.producer
    if n is None:
      return False
    if n.kind == "stablehlo.constant":
      return True
    if n.kind not in LAYOUT or not n.inputs:
      return False
    v = n.inputs[0]
  return False


def _dot_site(node: Node) -> DotSite:
  info = dot_info(node)
  lhs, rhs = node.inputs[0], node.inputs[1]
  out = node.outputs[0]

  def source(v: Value) -> Optional[str]:
    # the type of an operand before a convert that feeds the dot through layout ops only
    for _ in range(16):
      n = v.producer
      if n is None:
        return None
      if n.kind == CONVERT:
        return n.inputs[0].dtype
      if n.kind not in LAYOUT or not n.inputs:
        return None
      v = n.inputs[0]
    return None

  def converted_to(v: Value) -> Optional[str]:
    for _ in range(16):
      if len(v.users) != 1:
        return None
      n = v.users[0][0]
      if n.kind == CONVERT:
        return n.outputs[0].dtype
      if n.kind not in LAYOUT - {"loop_carry", "merge"}:
        return None
      v = n.outputs[0]
    return None

  ls, rs = source(lhs), source(rhs)
  reads = sorted({n.name for v in (lhs, rhs) for n in _back(v, lambda n: n.kind in MOVEMENT,
                                                            limit=200)
                  if n.kind == "argument" and n.name})
  return DotSite(reads=reads, name=node.name, source=node.source, lhs=lhs.dtype, rhs=rhs.dtype,
                 result=out.dtype, precision=info["precision"], algorithm=info["algorithm"],
                 preferred=out.dtype, lhs_shape=list(lhs.shape), rhs_shape=list(rhs.shape),
                 result_shape=list(out.shape),
                 lhs_source=ls if ls != lhs.dtype else None,
                 rhs_source=rs if rs != rhs.dtype else None,
                 converted_to=converted_to(out))


def _reshape_axis(axis: int, src: Tuple[int, ...], dst: Tuple[int, ...]) -> Optional[int]:
  """The result axis of a reshape that holds exactly operand axis `axis`, if one does."""
  def spans(shape):
    out, acc = [], 1
    for d in shape:
      out.append((acc, acc * d))
      acc *= d
    return out
  # spans of the row-major strides from the innermost axis
  s_spans = spans(tuple(reversed(src)))
  d_spans = spans(tuple(reversed(dst)))
  want = s_spans[len(src) - 1 - axis]
  for j, sp in enumerate(d_spans):
    if sp == want:
      return len(dst) - 1 - j
  return None


def _track(node: Node, index: int, axis: Optional[int]) -> Optional[int]:
  """Where `axis` of input `index` of a layout/elementwise node ends up in its output."""
  if axis is None:
    return None
  if node.kind == "stablehlo.transpose":
    perm = int_list(node, "permutation")
    return perm.index(axis) if perm is not None and axis in perm else None
  if node.kind == "stablehlo.broadcast_in_dim":
    dims = int_list(node, "broadcast_dimensions")
    return dims[axis] if dims is not None and axis < len(dims) else None
  if node.kind == "stablehlo.reshape":
    return _reshape_axis(axis, node.inputs[0].shape, node.outputs[0].shape)
  if node.inputs[index].shape == node.outputs[0].shape:
    return axis
  return None


def _consumers(start: Value, axis: Optional[int], kinds):
  """Dots reached from `start` through `kinds` ops, data-free scalings (dropout, masks)
  and per-key scalings (`_per_key_scaling`): (dot, operand index, tracked axis, converts
  on the way, per-key Scalings on the way)."""
  out, seen = [], set()
  stack = [(start, axis, [], [])]
  while stack:
    v, ax, casts, scales = stack.pop()
    for user, idx in v.users:
      key = (user.id, idx)
      if key in seen:
        continue
      seen.add(key)
      if user.kind == DOT:
        out.append((user, idx, ax, casts, scales))
        continue
      per_key = _per_key_scaling(user, idx, ax)
      if per_key is not None:
        stack.append((user.outputs[0], _track(user, idx, ax), casts, scales + [per_key]))
      elif user.kind in kinds or (user.kind in SCALINGS and all(
          _data_free(o) for j, o in enumerate(user.inputs) if j != idx)):
        c = casts + ([f"{v.dtype}->{user.outputs[0].dtype}"] if user.kind == CONVERT
                     and v.dtype != user.outputs[0].dtype else [])
        if user.kind in SCALINGS and user.kind not in kinds:
          c = c + [f"{user.kind.split('.')[-1]} (dropout / mask)"]
        nxt = _track(user, idx, ax) if user.kind not in ("loop_carry", "merge") else ax
        if user.kind == "stablehlo.select" and idx == 0:
          continue
        stack.extend((o, nxt, c, scales) for o in user.outputs[:1])
  return out


SCALINGS = ("stablehlo.multiply", "stablehlo.divide", "stablehlo.select")


def _data_free(v: Value, limit: int = 4000) -> bool:
  """True if v is computed without any dot (a dropout mask from random bits, a constant,
  a mask from positions): what may scale the probabilities on their way to the wv dot.
  (The softmax's gradient also multiplies the probabilities, by values made by dots.)"""
  seen, stack = set(), [v]
  while stack:
    x = stack.pop()
    n = x.producer
    if n is None or n.id in seen:
      continue
    seen.add(n.id)
    if n.kind == DOT or len(seen) > limit:
      return False
    stack.extend(n.inputs)
  return True


def _contracts(dot: Node, index: int, axis: Optional[int]) -> Optional[bool]:
  info = dot_info(dot)
  contract = info["lhs_contract"] if index == 0 else info["rhs_contract"]
  return None if axis is None else axis in contract


def _layer(name: str) -> Optional[int]:
  for part in name.split("/"):
    if part.startswith("layer_") and part[len("layer_"):].isdigit():
      return int(part[len("layer_"):])
  return None


def _label(a: str, b: str) -> str:
  """The common name path of two dots, without jit(...) / transformation wrappers and
  the primitive itself."""
  pa, pb = a.split("/"), b.split("/")
  common = []
  for x, y in zip(pa[:-1], pb[:-1]):
    if x != y:
      break
    common.append(x)
  keep = [unwrap(p) for p in common
          if not (p.startswith("jit(") or p in ("while", "body", "cond", "closed_call")
                  or p.startswith("branch_") or "->" in p)]
  return "/".join(keep)


TRANSFORMS = ("jvp", "transpose", "vmap", "remat", "checkpoint", "pjit", "custom_jvp_call",
              "custom_vjp_call", "linearize")


def unwrap(part: str) -> str:
  """'transpose(jvp(decoder))' -> 'decoder' (jax's transformation wrappers)."""
  while True:
    head, sep, rest = part.partition("(")
    if not (sep and head in TRANSFORMS and rest.endswith(")")):
      return part
    part = rest[:-1]


# ----------------------------------------------------------------------------- cache reads
MULTIPLY = "stablehlo.multiply"
# Elementwise arithmetic a quantization (or a dequantization) is made of: followed, with
# data movement, when looking for the codes an operand was made from.
ARITHMETIC = {MULTIPLY, "stablehlo.divide", "stablehlo.negate", "stablehlo.clamp",
              "stablehlo.round_nearest_even", "stablehlo.round_nearest_afz",
              "stablehlo.maximum", "stablehlo.minimum", "stablehlo.floor"}
# Integer and small-float element types, as MLIR writes them (i8, ui8, si8, f8E4M3FN)
# and as XLA's HLO text does (s8, u8, f8e4m3fn): `is_code` reads both.
_INT_TYPE = re.compile(r"(?:u?i|si|[su])(\d+)$")
_SMALL_FLOAT = re.compile(r"f[468]e", re.IGNORECASE)
_SLICES = ("stablehlo.pad", "stablehlo.slice", "stablehlo.dynamic_slice",
           "stablehlo.dynamic_update_slice")


def is_code(dtype: str) -> bool:
  """An element type values are quantized to: an integer of 2-8 bits ('i8', 'ui8', 'i4';
  in HLO text 's8', 'u8', 's4') or a float of 8 bits or fewer ('f8E4M3FN', 'f8E5M2',
  'f4E2M1FN', ...; in HLO text 'f8e4m3fn', ...). The one test for both programs: the
  lowered one (MLIR) and the compiled one (`attnprec.inspect.compiled`)."""
  m = _INT_TYPE.match(dtype)
  if m:
    return 2 <= int(m.group(1)) <= 8
  return _SMALL_FLOAT.match(dtype) is not None


def _data_inputs(n: Node, index: int = 0) -> List[Value]:
  """The inputs of a data-movement or arithmetic node that its output `index` is made of
  (not a select's predicate, slice indices or a pad value)."""
  if n.kind == "stablehlo.optimization_barrier":   # (remat) output i is input i
    return [n.inputs[index]]
  if n.kind == "stablehlo.select":
    return n.inputs[1:]
  if n.kind in ("stablehlo.dynamic_slice", "stablehlo.gather", "stablehlo.pad"):
    return n.inputs[:1]
  if n.kind == "stablehlo.dynamic_update_slice":
    return n.inputs[:2]
  return n.inputs


def _code_casts(v: Value, limit: int = 400) -> Optional[CodeCasts]:
  """The code converts on the way back from a dot operand v (breadth first: the nearest
  first), through data movement and elementwise arithmetic; None if there are none."""
  casts, direct = [], None
  queue, seen = collections.deque([(v, True)]), set()
  while queue and len(seen) < limit:
    x, layout_only = queue.popleft()
    n = x.producer
    if n is None or n.id in seen:
      continue
    seen.add(n.id)
    if n.kind == CONVERT:
      a, b = n.inputs[0].dtype, n.outputs[0].dtype
      if is_code(a) or is_code(b):
        casts.append(f"{a}->{b}")
        direct = layout_only if direct is None else direct
    if n.kind in MOVEMENT or n.kind in ARITHMETIC:
      through = layout_only and n.kind in LAYOUT
      queue.extend((i, through) for i in _data_inputs(n, x.index))
  return CodeCasts(casts, bool(direct)) if casts else None


def _broadcast_origin(v: Value) -> Tuple[Value, Set[int], List[str], bool]:
  """(origin, axes, casts, broadcast): v walked back through broadcast_in_dim, converts,
  transposes and reshapes that only add or drop size-1 axes to the array it was made
  from; axes: the axes of v that origin varies along; casts: the converts on the way
  ('f32->bf16', from origin on); broadcast: whether v has axes origin does not fill."""
  axes = {i: i for i in range(len(v.shape))}     # axis of x -> axis of v
  casts, x = [], v
  for _ in range(32):
    n = x.producer
    if n is None or not n.inputs:
      break
    src = n.inputs[0]
    if n.kind == "stablehlo.broadcast_in_dim":
      dims = int_list(n, "broadcast_dimensions") or []
      axes = {j: axes[d] for j, d in enumerate(dims)
              if d in axes and src.shape[j] == x.shape[d]}
    elif n.kind == "stablehlo.transpose":
      perm = int_list(n, "permutation") or []
      axes = {perm[i]: a for i, a in axes.items()}
    elif n.kind == "stablehlo.reshape" and _non_unit(src.shape) == _non_unit(x.shape):
      pairs = zip([j for j, d in enumerate(src.shape) if d != 1],
                  [i for i, d in enumerate(x.shape) if d != 1])
      axes = {j: axes[i] for j, i in pairs if i in axes}
    elif n.kind == CONVERT:
      casts.insert(0, f"{src.dtype}->{x.dtype}")
    else:
      break
    x = src
  varying = {a for j, a in axes.items() if x.shape[j] != 1 or v.shape[a] == 1}
  return x, varying, casts, len(varying) < len(v.shape)


def _non_unit(shape) -> Tuple[int, ...]:
  return tuple(d for d in shape if d != 1)


def _track_moved(node: Node, index: int, axis: Optional[int]) -> Optional[int]:
  """`_track`, and through pads and slices (which keep every axis where it is)."""
  if axis is not None and node.kind in _SLICES and \
      len(node.inputs[index].shape) == len(node.outputs[0].shape):
    return axis
  if node.kind in ("loop_carry", "merge"):
    return axis
  return _track(node, index, axis)


def _follow_axis(start: Value, axis: int, target: Node, through,
                 limit: int = 4000) -> Optional[Tuple[int, int]]:
  """(operand index, axis) at which `axis` of `start` reaches node `target`, following
  the users for which through(node) is True; None if it does not get there."""
  stack, seen = [(start, axis)], set()
  while stack and len(seen) < limit:
    v, ax = stack.pop()
    for user, idx in v.users:
      if user.id == target.id:
        return idx, ax
      if (user.id, idx) in seen or not through(user):
        continue
      seen.add((user.id, idx))
      nxt = _track_moved(user, idx, ax)
      if nxt is not None:
        outs = ([user.outputs[idx]] if user.kind == "stablehlo.optimization_barrier"
                else user.outputs[:1])
        stack.extend((o, nxt) for o in outs)
  return None


def _scale_input(v: Value):
  """`_broadcast_origin(v)` for a multiply's input that no constant makes, else None."""
  return None if _is_constant(v) else _broadcast_origin(v)


def _scaling(mult: Node, info, along: str) -> Scaling:
  origin, _, casts, broadcast = info
  return Scaling(dtype=mult.outputs[0].dtype, scale=origin.dtype, shape=list(origin.shape),
                 along=along if broadcast else "elementwise", casts=casts)


def _per_key_scaling(node: Node, index: int, axis: Optional[int]) -> Optional[Scaling]:
  """The Scaling of multiply `node` whose input `index` is the probabilities (softmax
  axis `axis`) by a value broadcast along other axes that varies along the softmax axis
  (a per-key value scale), else None."""
  if node.kind != MULTIPLY or axis is None or len(node.inputs) != 2:
    return None
  info = _scale_input(node.inputs[1 - index])
  if info is None or not info[3] or axis not in info[1]:
    return None
  return _scaling(node, info, "keys")


def _logits_scales(path: Dict[int, Node], cone: Set[int], exp: Node,
                   axis: Optional[int]) -> List[Scaling]:
  """Scalings between the qk dot and the exp: multiplies by a non-constant value made
  outside the logits' cone; 'keys' where it varies along the softmax axis."""
  out = []
  on_path = lambda m: m.id in path  # noqa: E731
  for n in sorted(path.values(), key=lambda n: n.id):
    if n.kind != MULTIPLY:
      continue
    for v in n.inputs:
      if v.producer is not None and v.producer.id in cone:
        continue                                   # the logits themselves
      info = _scale_input(v)
      if info is None:
        continue
      keys = axis is not None and any(
          _follow_axis(n.outputs[0], a, exp, on_path) == (0, axis) for a in info[1])
      out.append(_scaling(n, info, "keys" if keys else "other"))
  return out


def _q_scales(d1: Node) -> List[Scaling]:
  """Scalings on the qk dot's operands (walked back through data movement and
  multiplies): 'channels' where the scale varies along an axis the dot contracts."""
  out = []
  moves = lambda m: m.kind in MOVEMENT or m.kind in ARITHMETIC  # noqa: E731
  for operand in d1.inputs[:2]:
    stack, seen = [operand], set()
    while stack and len(seen) < 200:
      v = stack.pop()
      n = v.producer
      if n is None or n.id in seen:
        continue
      seen.add(n.id)
      if n.kind in MOVEMENT:
        stack.extend(_data_inputs(n, v.index))
        continue
      if n.kind != MULTIPLY:
        continue
      for w in n.inputs:
        info = _scale_input(w)
        if info is None or not info[3]:
          stack.append(w)
          continue
        hits = [_follow_axis(n.outputs[0], a, d1, moves) for a in info[1]]
        along = any(h is not None and _contracts(d1, *h) for h in hits)
        out.append(_scaling(n, info, "channels" if along else "other"))
  return out


# ----------------------------------------------------------------------------- the finder
def _softmax_at(g: Graph, exp: Node, cone: Set[int]) -> Optional[dict]:
  """The softmax an exp (inside a qk dot's cone) belongs to, or None."""
  arg = exp.inputs[0]
  # the max: exp(x - m), m from a max-reduction of the logits
  sub = _through_layout(arg).producer
  max_node, stabilised = None, False
  if sub is not None and sub.kind == "stablehlo.subtract" and sub.id in cone:
    for n in _back(sub.inputs[1], lambda n: n.kind != DOT and n.id in cone, limit=400):
      if _reducer_kind(n) == "max" and n.inputs and n.id in cone:
        max_node, stabilised = n, True
        break
    lse = _log_sum_exp(sub.inputs[1], cone)
    if lse is not None:
      # exp(x - logsumexp(x)), e.g. jnp.exp(jax.nn.log_softmax(x)): already normalised
      inner_exp, total = lse
      if max_node is None:
        for n in _back(inner_exp.inputs[0], lambda n: n.kind != DOT and n.id in cone,
                       limit=400):
          if _reducer_kind(n) == "max" and n.id in cone:
            max_node, stabilised = n, True
            break
      dims = int_list(total, "dimensions") or []
      axis = dims[0] if len(dims) == 1 and total.inputs[0].shape == exp.outputs[0].shape \
          else None
      return dict(max=max_node, sums=[total], axis=axis, stabilised=stabilised,
                  probs=[exp.outputs[0]], sum_cone=set())
  # the sum: an add-reduction of the exp (through converts / layout)
  sums = []
  stack, seen = [exp.outputs[0]], set()
  while stack:
    v = stack.pop()
    for user, idx in v.users:
      if user.id in seen:
        continue
      seen.add(user.id)
      if _reducer_kind(user) == "add" and idx == 0:
        sums.append(user)
      elif user.kind in (CONVERT, "stablehlo.reshape", "mhlo.copy", "stablehlo.copy"):
        stack.extend(user.outputs)
  if not sums:
    return None
  total = sums[0]
  dims = int_list(total, "dimensions") or []
  axis = dims[0] if len(dims) == 1 and total.inputs[0].shape == exp.outputs[0].shape \
      else None
  sum_ids = {s.id for s in sums}
  sum_cone = set()
  for s in sums:
    sum_cone |= _forward_cone(s.outputs[0])
  sum_cone |= sum_ids
  # direct normalisation: exp / sum or exp * (1 / sum)
  exp_cone = {exp.id}
  stack = [exp.outputs[0]]
  while stack:
    v = stack.pop()
    for user, _ in v.users:
      if user.id in exp_cone:
        continue
      exp_cone.add(user.id)
      if user.kind in LAYOUT - {"loop_carry", "merge"}:
        stack.extend(user.outputs)
  def is_sum(v: Value) -> bool:
    # the sum itself, through layout ops and a safe-division select / maximum
    for n in _back(v, lambda n: n.kind in LAYOUT or n.kind in (
        "stablehlo.select", "stablehlo.maximum"), limit=64):
      if n.id in sum_ids:
        return True
    return False

  def is_reciprocal_of_sum(v: Value) -> bool:
    n = _through_layout(v).producer
    if n is None:
      return False
    if n.kind == "stablehlo.divide":
      return _is_constant(n.inputs[0]) and is_sum(n.inputs[1])
    if n.kind == "stablehlo.power":
      return is_sum(n.inputs[0]) and _is_constant(n.inputs[1])
    return False

  probs = []
  for i in sorted(exp_cone):
    n = g.nodes[i]
    if n.kind not in ("stablehlo.divide", "stablehlo.multiply"):
      continue
    a, b = n.inputs
    fed_a = a.producer is not None and a.producer.id in exp_cone
    fed_b = b.producer is not None and b.producer.id in exp_cone
    if n.kind == "stablehlo.divide" and fed_a and is_sum(b):
      probs.append(n.outputs[0])
    elif n.kind == "stablehlo.multiply" and (fed_a and is_reciprocal_of_sum(b) or
                                             fed_b and is_reciprocal_of_sum(a)):
      probs.append(n.outputs[0])
  return dict(max=max_node, sums=sums, axis=axis, stabilised=stabilised,
              probs=probs, sum_cone=sum_cone)


def _is_logits_of(d1: Node, exp: Node, cone: Set[int]) -> bool:
  """Whether the exp's argument is made of the dot d1's result element for element:
  reached back through the cone, not through a reduction, a scatter or a broadcast
  to more elements (as a cache scale computed from a projection's output reaches it)."""
  def through(n: Node) -> bool:
    if n.kind in (REDUCE, "stablehlo.scatter", "stablehlo.reduce_window"):
      return False
    if n.kind == "stablehlo.broadcast_in_dim" and \
        math.prod(n.inputs[0].shape) < math.prod(n.outputs[0].shape):
      return False
    return n.id in cone
  return any(n.id == d1.id for n in _back(exp.inputs[0], through, limit=20000))


def _log_sum_exp(v: Value, cone: Set[int]) -> Optional[Tuple[Node, Node]]:
  """(inner exp, add-reduction) if v is log(sum(exp(...))) (+ a max), through layout."""
  for n in _back(v, lambda n: n.kind in LAYOUT or n.kind == "stablehlo.add", limit=64):
    if n.kind != "stablehlo.log":
      continue
    total = _through_layout(n.inputs[0]).producer
    if total is None or _reducer_kind(total) != "add":
      continue
    inner = _through_layout(total.inputs[0]).producer
    if inner is not None and inner.kind == EXP and inner.id in cone:
      return inner, total
  return None


def find(g: Graph) -> Findings:
  dots = g.ops(DOT)
  attentions: List[Attention] = []
  used: Dict[int, str] = {}
  # Only dots that an exp depends on (through anything but another dot) can be a qk dot:
  # walking back from the exps is cheap, a forward cone from every dense dot is not.
  candidates = {n.id for e in g.ops(EXP)
                for n in _back(e.inputs[0], lambda n: n.kind != DOT) if n.kind == DOT}
  for d1 in dots:
    if d1.id not in candidates:
      continue
    cone = _forward_cone(d1.outputs[0])
    for exp in (g.nodes[i] for i in sorted(cone)):
      if exp.kind != EXP:
        continue
      sm = _softmax_at(g, exp, cone)
      if sm is None or not _is_logits_of(d1, exp, cone):
        continue
      found = None
      # direct: the normalised probabilities enter a dot contracting the softmax axis
      for p in sm["probs"]:
        for d2, idx, ax, casts, scales in _consumers(p, sm["axis"], LAYOUT):
          if d2.id != d1.id and _contracts(d2, idx, ax) is not False:
            found = (d2, idx, casts, scales, p, False)
            break
        if found:
          break
      if not found:
        # online: the unnormalised exp enters the dot, its sum divides what it accumulated
        for d2, idx, ax, casts, scales in _consumers(exp.outputs[0], sm["axis"], LAYOUT):
          if d2.id == d1.id or _contracts(d2, idx, ax) is False:
            continue
          acc = _forward_cone(d2.outputs[0])
          if any(g.nodes[i].kind == "stablehlo.divide" and i in sm["sum_cone"]
                 for i in acc):
            found = (d2, idx, casts, scales, exp.outputs[0], True)
            break
      if not found:
        continue
      d2, idx, casts, scales, probs, online = found
      att = _attention(g, d1, exp, sm, d2, idx, casts, probs, online, cone)
      att.probs_scales = scales
      attentions.append(att)
      used[d1.id], used[d2.id] = "qk", "wv"
      break   # one softmax per qk dot
  _backward(g, attentions, used)
  dense = []
  for d in dots:
    if d.id not in used:
      site = _dot_site(d)
      site.backward = "transpose(" in d.name
      dense.append(site)
  return Findings(attentions, dense)


def _attention(g, d1, exp, sm, d2, idx, casts, probs, online, cone) -> Attention:
  # the nodes on the paths from the qk dot to the exp
  path = {n.id: n for n in _back(exp.inputs[0], lambda n: n.id in cone and n.kind != DOT)
          if n.id in cone}
  downcasts, upcasts, mask, soft_cap, scale = [], [], [], False, False
  cone = cone | {d1.id}
  for n in path.values():
    if n.kind == CONVERT:
      a, b = n.inputs[0].dtype, n.outputs[0].dtype
      if _narrowing(a, b):
        downcasts.append(f"{a}->{b}")
      elif _widening(a, b):
        upcasts.append(f"{a}->{b}")
    elif n.kind == "stablehlo.tanh":
      soft_cap = True
    elif n.kind == "stablehlo.select" and "select" not in mask:
      mask.append("select")
    elif n.kind in ("stablehlo.multiply", "stablehlo.divide"):
      outside = [v for v in n.inputs if v.producer is None or v.producer.id not in cone]
      if outside and all(_is_constant(v) for v in outside):
        scale = True
    elif n.kind == "stablehlo.add":
      outside = [v for v in n.inputs if v.producer is None or v.producer.id not in cone]
      if outside and not all(_is_constant(v) for v in outside) and "bias" not in mask:
        mask.append("bias")
  qk, wv = _dot_site(d1), _dot_site(d2)
  qk.role, wv.role = "qk", "wv"
  for site, node in ((qk, d1), (wv, d2)):
    site.lhs_codes, site.rhs_codes = (_code_casts(x) for x in node.inputs[:2])
  softmax = {"exp": exp.outputs[0].dtype, "sum": sm["sums"][0].outputs[0].dtype}
  if sm["max"] is not None:
    softmax = {"max": sm["max"].outputs[0].dtype, **softmax}
  loop = any(n.kind == "loop_carry" for n in path.values()) or "while" in d1.name.split("/")
  att = Attention(label=_label(d1.name, d2.name), layer=_layer(d1.name), qk=qk, wv=wv,
                  softmax=softmax, stabilised=sm["stabilised"], online=online, loop=loop,
                  downcasts=sorted(set(downcasts)), upcasts=sorted(set(upcasts)),
                  probs_casts=list(dict.fromkeys(casts)), soft_cap=soft_cap, mask=mask,
                  logits_scale=scale, probs_operand=idx,
                  logits_scales=_logits_scales(path, cone, exp, sm["axis"]),
                  q_scales=_q_scales(d1), key_path=offset_check.key_path(d1))
  att._nodes = (d1, d2, probs, idx)   # for the backward search (not serialised)
  return att


def _roots(v: Value, cache: dict) -> Set[int]:
  """Ids of the values v is made of, followed back through data movement only."""
  key = id(v)
  if key in cache:
    return cache[key]
  out, seen, stack = set(), set(), [v]
  while stack:
    x = stack.pop()
    if id(x) in seen:
      continue
    seen.add(id(x))
    n = x.producer
    if n is None or n.kind not in MOVEMENT:
      out.add(id(x))
      continue
    stack.extend(_data_inputs(n, x.index))
  cache[key] = out
  return out


def _backward(g: Graph, attentions: List[Attention], used: Dict[int, str]) -> None:
  cache: dict = {}
  keys = []
  for a in attentions:
    d1, d2, probs, idx = a._nodes
    v = d2.inputs[1 - idx]
    keys.append([("dk", _roots(d1.inputs[0], cache)), ("dq", _roots(d1.inputs[1], cache)),
                 ("dp", _roots(v, cache)),
                 ("dv", _roots(probs, cache) | _roots(d2.inputs[idx], cache))])
  for d in g.ops(DOT):
    if d.id in used:
      continue
    r0, r1 = _roots(d.inputs[0], cache), _roots(d.inputs[1], cache)
    for a, ks in zip(attentions, keys):
      roles = {name for name, r in ks if r & r0 or r & r1}
      role = next((name for name, _ in ks if name in roles), None)
      if {"dk", "dq"} <= roles:
        role = "qk (recomputed)"            # jax.checkpoint recomputes the forward
        # ... and its softmax: the gradient dv reads the recomputed probabilities
        cone = _forward_cone(d.outputs[0])
        for e in (g.nodes[i] for i in sorted(cone) if g.nodes[i].kind == EXP):
          sm = _softmax_at(g, e, cone)
          for p in (sm or {}).get("probs", []):
            ks[3] = ("dv", ks[3][1] | _roots(p, cache))
      elif {"dp", "dv"} <= roles:
        role = "wv (recomputed)"
      if role:
        site = _dot_site(d)
        site.role, site.backward = role, True
        a.backward.append(site)
        used[d.id] = role
        break
  for a in attentions:
    del a._nodes

"""The key offset's contract row, read from a lowered program (`contract.KEY_OFFSETS`).

For one attention's qk dot, `key_path` follows each operand back through what moves,
stores or quantizes keys (layout ops, converts, the cache's scatter / update slice and bit
casts, a quantizer's divide / round / clamp, loops) to the arithmetic that made it. The
operand that reaches a subtraction in the offset's named scope (`contract.KEY_OFFSET_SCOPE`)
is the keys. Then:

  offset    every arithmetic source of the keys is such a subtraction (no key reaches the
            dot without the offset: e.g. a decode step's new key)
  dtype     each subtraction runs in float32 (its result and both operands)
  before    walking back from each subtraction's operands (the keys, and c) to the key
            projection's dot: the narrowing converts met; the contract allows none (the
            keys are rounded once, after the subtraction)

`scoped_subtractions` lists every subtraction in that scope in a program: with
key_offset = 'none' there must be none (`offset_problems`).
"""
from typing import Dict, List, Optional, Set

from attnprec.contract import KEY_OFFSET_SCOPE
from attnprec.inspect.mlir_graph import Graph, Node, Value

DOT = "stablehlo.dot_general"
SUBTRACT = "stablehlo.subtract"
CONVERT = "stablehlo.convert"
# What a key passes through between its rounding and the qk dot: layout, converts, the
# cache (scatter / update slice into a buffer, bit casts), a quantizer, loop plumbing.
_CARRY = {CONVERT, "stablehlo.reshape", "stablehlo.transpose", "stablehlo.broadcast_in_dim",
          "mhlo.copy", "stablehlo.copy", "loop_carry", "merge", "stablehlo.slice",
          "stablehlo.dynamic_slice", "stablehlo.optimization_barrier",
          "stablehlo.bitcast_convert", "stablehlo.scatter", "stablehlo.dynamic_update_slice",
          "stablehlo.concatenate", "stablehlo.pad", "stablehlo.select", "stablehlo.gather",
          "stablehlo.round_nearest_even", "stablehlo.clamp", "stablehlo.divide",
          "stablehlo.multiply", "stablehlo.maximum", "stablehlo.minimum"}
_SIDE = {"stablehlo.constant", "stablehlo.iota", "argument"}
_BITS = {"f64": 64, "f32": 32, "bf16": 16, "f16": 16}


def _carried(n: Node, index: int) -> List[Value]:
  """The inputs of a carrying node that hold key data (not indices, scales or bounds)."""
  k = n.kind
  if k in ("stablehlo.dynamic_slice", "stablehlo.gather", "stablehlo.pad"):
    return n.inputs[:1]
  if k == "stablehlo.dynamic_update_slice":
    return n.inputs[:2]
  if k == "stablehlo.scatter":           # operand and updates (not the indices)
    half = (len(n.inputs) - 1) // 2
    return n.inputs[:half] + n.inputs[half + 1:]
  if k == "stablehlo.select":
    return n.inputs[1:]
  if k == "stablehlo.clamp":
    return n.inputs[1:2]
  if k in ("stablehlo.divide", "stablehlo.multiply", "stablehlo.maximum",
           "stablehlo.minimum"):   # a quantizer's x / scale and its clip
    return [v for v in n.inputs if _full(v, n)]
  if k == "stablehlo.optimization_barrier":
    return [n.inputs[index]]
  return n.inputs


def _full(v: Value, n: Node) -> bool:
  """Whether v is data of n's shape, not a smaller value (a scale) broadcast to it."""
  p = v.producer
  if tuple(v.shape) != tuple(n.outputs[0].shape):
    return False
  return p is None or p.kind != "stablehlo.broadcast_in_dim" or \
      tuple(p.inputs[0].shape) == tuple(v.shape)


def _in_scope(n: Node) -> bool:
  return KEY_OFFSET_SCOPE in n.name.split("/")


def _sources(v: Value, limit: int = 20000) -> List[Node]:
  """The non-carrying nodes v is made of (constants and program arguments left out)."""
  out, seen, stack = [], set(), [v]
  while stack and len(seen) < limit:
    x = stack.pop()
    n = x.producer
    if n is None or n.id in seen:
      continue
    seen.add(n.id)
    if n.kind in _SIDE:
      continue
    carried = _carried(n, x.index) if n.kind in _CARRY else []
    if carried:
      stack.extend(carried)
    else:
      out.append(n)
  return out


def _narrowing_before(v: Value, limit: int = 20000) -> List[str]:
  """Narrowing float converts ('f32->bf16') on every path from v back to a dot."""
  found, seen, stack = [], set(), [v]
  while stack and len(seen) < limit:
    x = stack.pop()
    n = x.producer
    if n is None or n.id in seen or n.kind == DOT:
      continue
    seen.add(n.id)
    if n.kind == CONVERT:
      a, b = n.inputs[0].dtype, n.outputs[0].dtype
      if a in _BITS and b in _BITS and _BITS[b] < _BITS[a]:
        found.append(f"{a}->{b}")
    stack.extend(n.inputs)
  return sorted(set(found))


def key_path(d1: Node) -> Dict[str, object]:
  """What the qk dot `d1`'s keys went through (plain data, see the module docstring):
  {'offset': whether an operand reaches a scoped subtraction, 'unoffset': sources of the
  keys that are not one, 'dtypes': the subtractions' dtypes, 'rounded_before': narrowing
  converts between the projection and a subtraction}."""
  for operand in d1.inputs[:2]:
    srcs = _sources(operand)
    subs = [n for n in srcs if n.kind == SUBTRACT and _in_scope(n)]
    if not subs:
      continue
    others = sorted({n.kind.replace("stablehlo.", "") for n in srcs
                     if not (n.kind == SUBTRACT and _in_scope(n))})
    dtypes = sorted({"/".join([*(v.dtype for v in n.inputs), n.outputs[0].dtype])
                     for n in subs})
    before: Set[str] = set()
    for n in subs:
      for v in n.inputs:
        before.update(_narrowing_before(v))
    return {"offset": True, "unoffset": others, "dtypes": dtypes,
            "rounded_before": sorted(before)}
  return {"offset": False, "unoffset": [], "dtypes": [], "rounded_before": []}


def scoped_subtractions(g: Graph) -> int:
  """How many subtractions the program has in the key offset's scope."""
  return sum(1 for n in g.ops(SUBTRACT) if _in_scope(n))


def offset_problems(path: Optional[Dict[str, object]], key_offset: str) -> List[str]:
  """The contract's offset row for one attention: problems (empty if it holds)."""
  path = path or {"offset": False}
  if key_offset == "none":
    return (["keys pass a key-offset subtraction, but key_offset = 'none'"]
            if path["offset"] else [])
  problems = []
  if not path["offset"]:
    return [f"key_offset = {key_offset!r}, but no key reaches the qk dot through a "
            f"key-offset subtraction"]
  if path["unoffset"]:
    problems.append(f"keys also reach the qk dot without the offset (from "
                    f"{', '.join(path['unoffset'])})")
  bad = [d for d in path["dtypes"] if d != "f32/f32/f32"]
  if bad:
    problems.append(f"the offset is subtracted in {', '.join(bad)} (operands/result), "
                    f"the contract requires f32")
  if path["rounded_before"]:
    problems.append(f"the keys are rounded ({', '.join(path['rounded_before'])}) before "
                    f"the offset is subtracted; the contract subtracts it first and rounds "
                    f"once")
  return problems

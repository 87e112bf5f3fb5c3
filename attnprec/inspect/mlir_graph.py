"""A lowered program as a dataflow graph, read through the MLIR Python bindings.

`Graph(module)` walks the typed StableHLO module of `jax.jit(f).lower(...)`
(`lowered.compiler_ir('stablehlo')`) with the MLIR bindings that ship with jaxlib and builds
one flat dataflow graph of `Node`s (operations) and `Value`s (SSA values), in which the
structure that would hide a flow is resolved:

  * `func.call`: every call site gets its own copy of the callee (the call is inlined
    virtually, so a private function such as `_where` or a scan body `closed_call`, called
    from two layers, never joins their data): the callee's arguments are the call's
    operands, its results the values the callee returns.
  * `stablehlo.while`: each loop-carried value is a `loop_carry` node whose inputs are the
    initial value and the value the body returns (a cycle in the graph); the condition and
    body block arguments and the loop's results are that node's output.
  * `stablehlo.case` / `stablehlo.if`: each result is a `merge` of what the branches
    return; the branches read values of the enclosing function directly, as in MLIR.
  * Ops whose regions are reducers (`stablehlo.reduce`, `reduce_window`, `scatter`,
    `sort`, ...) stay single nodes; `Node.reducer` names the body's operations.

Every node carries the op's name (the outermost `NameLoc` of its MLIR Location, prefixed
by the call sites it was inlined through, e.g.
`jit(prefill)/decoder/layer_0/attn/while/body/closed_call/cond/branch_1_fun/.../dot_general`)
and its source position (the first `FileLineColLoc` of the location): what jax.named_scope,
Haiku / Flax module names and the user's own code leave in the program.
"""
from typing import Dict, List, Optional, Tuple

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo

MAX_CALL_DEPTH = 64


class Value:
  """One SSA value (in one inlined copy): element type, shape, producer and users."""
  __slots__ = ("dtype", "shape", "producer", "index", "users")

  def __init__(self, type_: ir.Type, producer: Optional["Node"], index: int):
    self.dtype, self.shape = tensor_type(type_)
    self.producer = producer
    self.index = index
    self.users: List[Tuple["Node", int]] = []

  def __repr__(self):
    return f"Value({self.dtype}{list(self.shape)} from {self.producer and self.producer.kind})"


class Node:
  """One operation (in one inlined copy), or a `loop_carry` / `merge` / `argument`."""
  __slots__ = ("kind", "op", "inputs", "outputs", "name", "source", "reducer", "id")

  def __init__(self, kind: str, op, name: str, source: str):
    self.kind = kind               # 'stablehlo.exponential', 'loop_carry', ...
    self.op = op                   # the ir.Operation (None for the pseudo nodes)
    self.inputs: List[Value] = []
    self.outputs: List[Value] = []
    self.name = name               # op name path from the locations ('' if none)
    self.source = source           # 'file.py:12' of the innermost frame ('' if none)
    self.reducer: Tuple[str, ...] = ()  # ops of a reducer body (reduce, scatter, ...)
    self.id = -1

  def add_input(self, v: Value) -> None:
    v.users.append((self, len(self.inputs)))
    self.inputs.append(v)

  def attr(self, name: str):
    return self.op.attributes[name] if self.op is not None and name in self.op.attributes \
        else None

  def __repr__(self):
    return f"Node({self.kind}, {self.name!r})"


def tensor_type(t: ir.Type) -> Tuple[str, Tuple[int, ...]]:
  """('bf16', (2, 8)) for tensor<2x8xbf16>; (str(t), ()) for tokens and tuples."""
  if t.typeid == ir.RankedTensorType.static_typeid:
    rt = ir.RankedTensorType(t)
    return str(rt.element_type), tuple(rt.shape)
  return str(t), ()


# ----------------------------------------------------------------------------- locations
def location_parts(loc: ir.Location) -> Tuple[str, str]:
  """(op name, 'file:line') of an MLIR Location: the outermost NameLoc's name (what jax
  puts there: the name stack plus the primitive) and the first FileLineColLoc."""
  name = ""
  if loc.typeid == ir.NameLoc.static_typeid:
    name = ir.NameLoc(loc).name_str
  files: List[str] = []
  _files(loc, files, 0)
  return name, files[0] if files else ""


def _files(loc: ir.Location, out: List[str], depth: int) -> None:
  if depth > 64 or out:
    return
  tid = loc.typeid
  if tid == ir.FileLineColLoc.static_typeid:
    f = ir.FileLineColLoc(loc)
    out.append(f"{f.filename}:{f.start_line}")
  elif tid == ir.NameLoc.static_typeid:
    _files(ir.NameLoc(loc).child_loc, out, depth + 1)
  elif tid == ir.CallSiteLoc.static_typeid:
    c = ir.CallSiteLoc(loc)
    _files(c.callee, out, depth + 1)
    _files(c.caller, out, depth + 1)
  elif tid == ir.FusedLoc.static_typeid:
    for sub in ir.FusedLoc(loc).locations:
      _files(sub, out, depth + 1)


def _join(prefix: str, name: str) -> str:
  """The name of an op inlined from a call named `prefix`. Names inside a jitted function
  repeat its `jit(f)` component, those inside a scan or cond body are relative."""
  if not (prefix and name):
    return prefix or name
  last = prefix.rsplit("/", 1)[-1]
  if name == last or name.startswith(last + "/"):
    name = name[len(last) + 1:]
  return f"{prefix}/{name}" if name else prefix


# ----------------------------------------------------------------------------- graph
class Graph:
  """The dataflow graph of one lowered module (see the module docstring)."""

  def __init__(self, module: ir.Module):
    self.module = module           # keeps the MLIR objects alive
    self.nodes: List[Node] = []
    self.funcs: Dict[str, ir.Operation] = {}
    main = None
    with module.context:
      for op in module.body.operations:
        if op.operation.name != "func.func":
          continue
        sym = ir.StringAttr(op.attributes["sym_name"]).value
        self.funcs[sym] = op
        vis = op.attributes["sym_visibility"] if "sym_visibility" in op.attributes else None
        if main is None and (sym == "main" or (vis is not None and
                                               ir.StringAttr(vis).value == "public")):
          main = op
      if main is None:
        raise ValueError("the module has no public function")
      self.inputs: List[Value] = []
      block = main.regions[0].blocks[0]
      for i, arg in enumerate(block.arguments):
        node = self._node("argument", None, *location_parts(arg.location))
        v = Value(arg.type, node, 0)
        node.outputs.append(v)
        self.inputs.append(v)
      self.outputs = self._function(main, self.inputs, "", 0)

  # --------------------------------------------------------------------- building
  def _node(self, kind: str, op, name: str, source: str) -> Node:
    n = Node(kind, op, name, source)
    n.id = len(self.nodes)
    self.nodes.append(n)
    return n

  def _function(self, func, args: List[Value], prefix: str, depth: int) -> List[Value]:
    if depth > MAX_CALL_DEPTH:
      raise ValueError(f"calls nested deeper than {MAX_CALL_DEPTH}")
    block = func.regions[0].blocks[0]
    env: Dict[ir.Value, Value] = {a: v for a, v in zip(block.arguments, args)}
    return self._block(block, env, prefix, depth)

  def _block(self, block, env, prefix: str, depth: int) -> List[Value]:
    """Adds the block's operations; returns the values its terminator yields."""
    for op in block.operations:
      op = op.operation
      kind = op.name
      if kind in ("func.return", "stablehlo.return"):
        return [env[x] for x in op.operands]
      name, source = location_parts(op.location)
      full = _join(prefix, name)
      if kind == "func.call":
        callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
        results = self._function(self.funcs[callee], [env[x] for x in op.operands],
                                 full, depth + 1)
        for r, v in zip(op.results, results):
          env[r] = v
      elif kind == "stablehlo.while":
        self._while(op, env, full, source, prefix, depth)
      elif kind in ("stablehlo.case", "stablehlo.if"):
        branches = [self._block(region.blocks[0], env, prefix, depth)
                    for region in op.regions]
        for i, r in enumerate(op.results):
          node = self._node("merge", op, full, source)
          for b in branches:
            node.add_input(b[i])
          out = Value(r.type, node, 0)
          node.outputs.append(out)
          env[r] = out
      else:
        node = self._node(kind, op, full, source)
        for x in op.operands:
          node.add_input(env[x])
        for i, r in enumerate(op.results):
          out = Value(r.type, node, i)
          node.outputs.append(out)
          env[r] = out
        if len(op.regions):
          node.reducer = tuple(o.operation.name for region in op.regions
                               for b in region.blocks for o in b.operations
                               if o.operation.name not in ("stablehlo.return",))
    return []

  def _while(self, op, env, full: str, source: str, prefix: str, depth: int) -> None:
    carries = []
    for i, x in enumerate(op.operands):
      node = self._node("loop_carry", op, full, source)
      node.add_input(env[x])
      v = Value(x.type, node, 0)
      node.outputs.append(v)
      carries.append((node, v))
    cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
    for block in (cond, body):
      for a, (_, v) in zip(block.arguments, carries):
        env[a] = v
    self._block(cond, env, prefix, depth)
    returned = self._block(body, env, prefix, depth)
    for (node, _), v in zip(carries, returned):
      node.add_input(v)
    for r, (_, v) in zip(op.results, carries):
      env[r] = v

  # --------------------------------------------------------------------- queries
  def ops(self, kind: str) -> List[Node]:
    return [n for n in self.nodes if n.kind == kind]


# ----------------------------------------------------------------------------- op attributes
def int_list(node: Node, name: str) -> Optional[List[int]]:
  a = node.attr(name)
  return None if a is None else list(ir.DenseI64ArrayAttr(a))


def dot_info(node: Node) -> dict:
  """Precision config, dot algorithm and dimension numbers of a stablehlo.dot_general."""
  with node.op.context:
    ov = node.op.opview
    pc = ov.precision_config
    precision = [stablehlo.PrecisionAttr(p).value for p in pc] if pc is not None else []
    alg = ov.algorithm
    algorithm = None
    if alg is not None:
      a = stablehlo.DotAlgorithm(alg)
      algorithm = (f"lhs_precision_type = {a.lhs_precision_type}, "
                   f"rhs_precision_type = {a.rhs_precision_type}, "
                   f"accumulation_type = {a.accumulation_type}, "
                   f"lhs_component_count = {a.lhs_component_count}, "
                   f"rhs_component_count = {a.rhs_component_count}, "
                   f"num_primitive_operations = {a.num_primitive_operations}, "
                   f"allow_imprecise_accumulation = "
                   f"{str(a.allow_imprecise_accumulation).lower()}")
    dn = stablehlo.DotDimensionNumbers(ov.dot_dimension_numbers)
    dims = dict(lhs_batch=list(dn.lhs_batching_dimensions),
                rhs_batch=list(dn.rhs_batching_dimensions),
                lhs_contract=list(dn.lhs_contracting_dimensions),
                rhs_contract=list(dn.rhs_contracting_dimensions))
  if not precision or len(set(precision)) == 1:
    prec = precision[0] if precision else "DEFAULT"
  else:
    prec = ",".join(precision)
  return dict(precision=prec, algorithm=algorithm, **dims)

"""What a Pallas TPU kernel computes: the Mosaic body inside a `tpu_custom_call`, read back.

Lowered for TPU (on a TPU, or from any machine with `lowering_platforms=('tpu',)`), a
Pallas kernel is one custom call whose backend_config holds its body: a Mosaic MLIR module,
serialized as bytecode and base64 ("custom_call_config": {"body": ...}). The same string
is in the lowered StableHLO and in the TPU's optimized HLO. `custom_calls(text)` finds
every such call in either; `read_body(b64)` opens one through jax's own MLIR bindings
(the `tpu` dialect, and the `mosaic-serde` pass that undoes the serialization) and lists
what decides its precision:

  matmuls  every `tpu.matmul`: operand, accumulator and result element types, its
           precision (`contract_precision<fp32>`: HIGHEST; none: DEFAULT), the 16-bit
           type an f32 operand was extended from (`arith.extf`), the f32 type a 16-bit
           operand was truncated from (`arith.truncf`: rounded probabilities), and a
           truncation right after it;
  softmax  the element types of every `math.exp` (or `math.exp2`: a base-2 softmax, as
           the flash kernel's with both flags), of the running max (`maximumf`
           reductions) and of the running sum (`add` reductions of exp values).

Roles come from the structure, as the lowered-program finder's do: a matmul whose result
reaches an exp (through anything but another matmul) is the QK product; one with an
operand that an exp reaches is the PV product, that operand the probabilities. A body
with no such pair is reported as unread (`MosaicBody.attention` False), never as
checked. `summary(body, platform)` says what each product keeps on the TPU
(`attnprec.platforms`: f32 operands at DEFAULT multiply in one bf16 pass), and
`check_body(body, precision)` holds it to the contract table.

Nothing here runs a kernel: it reads bytes. It needs jaxlib's `tpu` dialect, which the
jaxlib wheels of every platform carry.
"""
import base64
import collections
import dataclasses
import re
from typing import List, Optional

from attnprec.inspect.compiled import OP_NAME

_INSTRUCTION = re.compile(r"\n(?=\s*(?:ROOT\s+)?%[\w.\-]+ = )")
# the body in HLO text ("body":"...") or in StableHLO's escaped string (\22body\22: \22...)
_BODY = re.compile(r'(?:"|\\22)body(?:"|\\22):\s*(?:"|\\22)([A-Za-z0-9+/=]+)')
_KERNEL_NAME = re.compile(r'(?:"|\\22)name(?:"|\\22):\s*(?:"|\\22)([\w.\-]+)')
_ELEMENT = re.compile(r"x([a-z]+\d*(?:E\dM\d\w*)?)>$")
_PRECISION = re.compile(r"contract_precision<(\w+)>")
_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}

EXPS = ("math.exp", "math.exp2")   # the softmax's exps (exp2: base 2)


@dataclasses.dataclass(frozen=True)
class Call:
  """One tpu_custom_call: where it is (its op_name, '' in StableHLO), its body."""
  name: str
  kernel: str
  body: str          # base64 of the serialized Mosaic module


@dataclasses.dataclass(frozen=True)
class Matmul:
  lhs: str
  rhs: str
  result: str
  precision: str                      # 'default' or 'highest' (contract_precision<fp32>)
  lhs_from: Optional[str] = None      # 16-bit type an f32 operand was extended from
  rhs_from: Optional[str] = None
  lhs_rounded: Optional[str] = None   # f32 type a 16-bit operand was truncated from
  rhs_rounded: Optional[str] = None
  rounded_to: Optional[str] = None    # a truncation of the result right after it
  role: str = "other"                 # 'qk', 'pv', 'other'
  probs_side: Optional[str] = None    # 'lhs' / 'rhs': the probabilities of a PV matmul

  @property
  def described(self) -> str:
    def side(t, up, down):
      return t + (f"<-{up}" if up else "") + (f"<-{down}" if down else "")
    return (f"{side(self.lhs, self.lhs_from, self.lhs_rounded)} x "
            f"{side(self.rhs, self.rhs_from, self.rhs_rounded)} -> {self.result}"
            + (f"->{self.rounded_to}" if self.rounded_to else "")
            + ("" if self.precision == "default" else f", {self.precision}"))


@dataclasses.dataclass(frozen=True)
class MosaicBody:
  kernel: str
  matmuls: tuple
  exp: tuple         # element types of the exps
  max: tuple         # element types of the running max's reductions / maximums
  sum: tuple         # element types of the sums of exp values

  @property
  def qk(self) -> List[Matmul]:
    return [m for m in self.matmuls if m.role == "qk"]

  @property
  def pv(self) -> List[Matmul]:
    return [m for m in self.matmuls if m.role == "pv"]

  @property
  def attention(self) -> bool:
    """Whether the body holds an attention: a QK and a PV product and an exp."""
    return bool(self.qk and self.pv and self.exp)


def custom_calls(text: str) -> List[Call]:
  """Every tpu_custom_call with a Mosaic body in HLO text (optimized or not) or in
  StableHLO text (a lowered program's `as_text()`)."""
  calls = []
  # one chunk per instruction: an attribute may hold newlines (kernel_metadata)
  for line in _INSTRUCTION.split(text):
    if "tpu_custom_call" not in line:
      continue
    body = _BODY.search(line)
    if not body:
      continue
    name = OP_NAME.search(line)
    kernel = _KERNEL_NAME.search(line[body.end():]) or _KERNEL_NAME.search(line)
    calls.append(Call(name.group(1) if name else "", kernel.group(1) if kernel else "",
                      body.group(1)))
  return calls


def _element(t) -> str:
  """'bf16' / 'f32' / 'i32' from an MLIR vector or scalar type."""
  s = str(t)
  m = _ELEMENT.search(s)
  return m.group(1) if m else s


def _ops(block):
  for op in block.operations:
    yield op
    for region in op.regions:
      for b in region.blocks:
        yield from _ops(b)


def _owner(value):
  """The op that made a value, None for a block argument."""
  owner = value.owner
  return owner if hasattr(owner, "operands") and hasattr(owner, "results") else None


def _name(op) -> str:
  """The op's dialect name ('tpu.matmul'); an OpView's `.name` can be a symbol's name."""
  return op.operation.name if hasattr(op, "operation") else op.name


def _reaches_exp_forward(value, limit: int = 400) -> bool:
  queue, seen = collections.deque([value]), 0
  while queue and seen < limit:
    v = queue.popleft()
    seen += 1
    for use in v.uses:
      op = use.owner
      n = _name(op)
      if n in EXPS:
        return True
      if n == "tpu.matmul":
        continue
      queue.extend(op.results)
  return False


def _from_exp(value, limit: int = 200) -> bool:
  queue, seen = collections.deque([value]), 0
  while queue and seen < limit:
    v = queue.popleft()
    seen += 1
    op = _owner(v)
    if op is None:
      continue
    n = _name(op)
    if n in EXPS:
      return True
    if n in ("tpu.matmul", "vector.load", "tpu.load"):
      continue
    queue.extend(op.operands)
  return False


def _converted(value, op_name: str) -> Optional[str]:
  """The source element type of a conversion `op_name` right before `value`."""
  op = _owner(value)
  if op is not None and _name(op) in (op_name, op_name.replace("arith.", "tpu.")):
    return _element(op.operands[0].type)
  return None


def read_body(b64: str, kernel: str = "") -> MosaicBody:
  """The Mosaic module in a tpu_custom_call's body, opened and read (module docstring)."""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib import tpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.passmanager import PassManager
  ctx = jax_mlir.make_ir_context()
  tpu.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True
  with ctx:
    module = ir.Module.parse(base64.b64decode(b64))
    PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
    funcs = [op for op in module.body.operations if _name(op) == "func.func"]
    names = [str(f.attributes["sym_name"]).strip('"') for f in funcs]
    main = [f for f, n in zip(funcs, names) if not n.startswith("transform_")]
    matmuls, exps, maxes, sums = [], [], [], []
    for func in main:
      for block in func.regions[0].blocks:
        for op in _ops(block):
          n = _name(op)
          if n == "tpu.matmul":
            lhs, rhs = op.operands[0], op.operands[1]
            result = op.results[0]
            precision = _PRECISION.search(str(op.attributes["precision"])) \
                if "precision" in op.attributes else None
            rounded = next((_element(u.owner.results[0].type) for u in result.uses
                            if _name(u.owner) in ("arith.truncf", "tpu.truncf")), None)
            role, probs = "other", None
            if _reaches_exp_forward(result):
              role = "qk"
            elif _from_exp(lhs) or _from_exp(rhs):
              role, probs = "pv", "lhs" if _from_exp(lhs) else "rhs"
            matmuls.append(Matmul(
                _element(lhs.type), _element(rhs.type), _element(result.type),
                "highest" if precision and precision.group(1) == "fp32" else "default",
                _converted(lhs, "arith.extf"), _converted(rhs, "arith.extf"),
                _converted(lhs, "arith.truncf"), _converted(rhs, "arith.truncf"),
                rounded, role, probs))
          elif n in EXPS:
            exps.append(_element(op.operands[0].type))
          elif n == "vector.multi_reduction":
            kind = str(op.attributes["kind"])
            if "maximumf" in kind:
              maxes.append(_element(op.operands[0].type))
            elif "add" in kind and _from_exp(op.operands[0]):
              sums.append(_element(op.operands[0].type))
    name = kernel or (names[0] if names else "")
    return MosaicBody(name, tuple(matmuls), tuple(exps), tuple(maxes), tuple(sums))


def read_calls(text: str) -> List[tuple]:
  """[(Call, MosaicBody or the error that stopped reading it)] for every call in text.
  Bodies that are byte-identical are opened once."""
  out, cache = [], {}
  for call in custom_calls(text):
    if call.body not in cache:
      try:
        cache[call.body] = read_body(call.body, call.kernel)
      except Exception as e:   # an unreadable body is reported as unread, never as read
        cache[call.body] = e
    out.append((call, cache[call.body]))
  return out


# ----------------------------------------------------------------------------- meaning
def summary(body: MosaicBody, platform: str = "tpu") -> dict:
  """What the body computes, in the audit's words: the QK result (and any rounding of
  it), the softmax's exp / max / sum dtypes, the probabilities' dtype into the PV matmul,
  and what each product keeps on `platform` (`attnprec.platforms`)."""
  from attnprec import platforms
  row = platforms.check(platform)

  def products(m: Matmul) -> str:
    values = [m.lhs_from or m.lhs, m.rhs_from or m.rhs]
    if "f32" not in (m.lhs, m.rhs):
      return platforms.describe_products("f32", *values)
    return platforms.describe_products(row.arithmetic(m.precision.upper()), *values)

  def probs(m: Matmul) -> str:
    t = m.lhs if m.probs_side == "lhs" else m.rhs
    rounded = m.lhs_rounded if m.probs_side == "lhs" else m.rhs_rounded
    if rounded:
      return f"{t} (rounded from {rounded})"
    if t == "f32" and row.operand_rounding.get(m.precision.upper()):
      return (f"f32, which the matmul at {m.precision.upper()} takes as "
              f"{row.operand_rounding[m.precision.upper()]} on {platform}")
    return t

  return {
      "kernel": body.kernel, "attention": body.attention,
      "qk": [m.described for m in body.qk], "qk_products": [products(m) for m in body.qk],
      "pv": [m.described for m in body.pv], "pv_products": [products(m) for m in body.pv],
      "probabilities": [probs(m) for m in body.pv],
      "exp": sorted(set(body.exp)), "max": sorted(set(body.max)),
      "sum": sorted(set(body.sum)),
      "other_matmuls": [m.described for m in body.matmuls if m.role == "other"]}


def check_body(body: MosaicBody, precision, platform: str = "tpu") -> List[str]:
  """The body against the contract table for `precision` (a `Precision`): the QK result
  in the logits dtype (an f32 result rounded right after it counts as that dtype: what a
  16-bit result is in Mosaic), the exps in the softmax dtype, the probabilities enter the
  PV matmul in the probs dtype (not rounded from it), the sums in float32, and each
  matmul's precision: 'highest' needs contract_precision<fp32> on f32 operands; a body
  with no attention in it is unread. [] where it honours the contract."""
  from attnprec import platforms
  from attnprec.contract import stage_dtypes
  if not body.attention:
    return [f"Mosaic body {body.kernel or '?'}: no attention found in it (a QK matmul "
            f"whose result reaches an exp and a PV matmul reading it): unread, not checked"]
  import jax.numpy as jnp
  e = {k: _SHORT.get(jnp.dtype(v).name, jnp.dtype(v).name) for k, v in
       stage_dtypes(precision.compute_dtype, precision.attention).items()}
  problems = []
  for m in body.qk:
    got = m.rounded_to or m.result
    if got != e["logits"]:
      problems.append(f"Mosaic QK matmul [{m.described}] gives {got} logits; the contract "
                      f"requires {e['logits']} (float32_qk_product="
                      f"{precision.float32_qk_product})")
  for t in sorted(set(body.exp)):
    if t != e["softmax"]:
      problems.append(f"Mosaic exp in {t}; the contract's softmax dtype is {e['softmax']} "
                      f"(float32_logits={precision.float32_logits})")
  for t in sorted(set(body.sum)):
    if t != "f32":
      problems.append(f"Mosaic softmax sum in {t}; the contract keeps it in f32")
  for m in body.pv:
    t = m.lhs if m.probs_side == "lhs" else m.rhs
    rounded = m.lhs_rounded if m.probs_side == "lhs" else m.rhs_rounded
    if t != e["probs"] or (rounded and rounded != e["probs"]):
      problems.append(f"Mosaic PV matmul [{m.described}] takes the probabilities as "
                      f"{t}{f' rounded from {rounded}' if rounded else ''}; the contract "
                      f"requires {e['probs']}")
  asked = str(precision.einsum_precision).upper()
  if asked in platforms.LAX_PRECISIONS:
    for m in body.qk + body.pv:
      if asked == "HIGHEST" and "f32" in (m.lhs, m.rhs) and m.precision != "highest":
        problems.append(f"Mosaic matmul [{m.described}] at DEFAULT: einsum_precision="
                        f"'highest' asks for contract_precision<fp32>")
      if m.precision == "highest" and "f32" not in (m.lhs, m.rhs):
        problems.append(f"Mosaic matmul [{m.described}] asks for fp32 precision on 16-bit "
                        f"operands, which Mosaic refuses ('Bad lhs type')")
  return problems

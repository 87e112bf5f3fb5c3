"""What the backend compiled: dots and converts of `lowered.compile().as_text()`.

The lowered program (StableHLO, the program's own statement of its types) is read by
`attnprec.inspect` through the MLIR bindings. The compiled program is XLA's HLO after its
passes (fusions, layout, the backend's rewrites: XLA:CPU computes bf16 dots as f32 dots on
converted operands); jax hands it out as HLO text, so this module reads that text:
`compiled_summary(text)` lists every dot with its operand/result types and op_name
metadata, and counts the convert ops by (from, to) type. `site(name)` classifies an
op_name (qk / wv / dense / other) by the kernels' named scopes and einsum equations, as
far as XLA kept them. The audit shows this summary; it asserts nothing on it.
"""
import dataclasses
import re
from typing import Optional

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

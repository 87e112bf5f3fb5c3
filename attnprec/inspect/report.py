"""Verdicts and rendering: the attentions found, checked against a stated `Precision`.

The contract is attnprec's own table (`attnprec.contract.stage_dtypes`, the one every
kernel asserts with chex), for the compute dtype c = `Precision.dtype` and the two flags:

  qk dot   operands c x c (or f32 x f32 upcast from c, allowed when float32_qk_product
           or a dot-algorithm preset widens the dot), result = the table's logits dtype;
  softmax  the exp runs in the table's softmax dtype; nothing narrows the logits between
           the qk dot and the exp ("a flag only ever upcasts");
  wv dot   the probabilities enter as the table's probs dtype, v as c or the probs dtype
           (either operand order), result the probs dtype or f32;
  both     the phase's einsum_precision: `precision = [P, P]` for a jax.lax.Precision
           name, or the dot algorithm the preset lowers to; the gradient dots too;
  dense    operands c x c, result c or f32, matmul_precision (f32 x f32 -> f32 when the
           weights are float32-carried values of c: `Precision.carrier_weights`).

A dot-algorithm preset may widen a dot's types (JAX upcasts bf16 operands for
BF16_BF16_F32_X3 and converts the f32 result back): the check then reads the contract's
types through those converts ("f32<-bf16", "f32->bf16").

`Report.with_compiled(lowered)` / `check_compiled(text, precision)` also check what the
backend compiled every dot into (`check_compiled_dot`): its result type is its
accumulation type, and a narrower one than the contract's float32 is a FAIL.
"""
import dataclasses
import functools
import json
import os
from typing import Dict, List, Optional

import jax
import jax.numpy as jnp

from attnprec import platforms, runs
from attnprec.contract import stage_dtypes
from attnprec.errors import UserError
from attnprec.inspect.finder import DOT, Attention, DotSite, Findings, is_code, unwrap
from attnprec.inspect.mlir_graph import Graph, dot_info
from attnprec.precision import ALGORITHM_PRESETS, Precision, parse_precision

SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64",
         "int8": "i8", "float8_e4m3fn": "f8E4M3FN", "float8_e5m2": "f8E5M2"}


def short(dtype) -> str:
  """The StableHLO name of a dtype ('f32', 'bf16', 'i8', 'f8E4M3FN')."""
  return SHORT[jnp.dtype(dtype).name]


# ----------------------------------------------------------------------------- contract
def expected_stages(precision: Precision) -> Dict[str, str]:
  """The contract table's stage dtypes for this Precision, short names ('f32')."""
  table = stage_dtypes(precision.compute_dtype, precision.attention)
  return {k: short(v) for k, v in table.items()}


@functools.lru_cache(maxsize=None)
def algorithm_text(preset_name: str) -> str:
  """The dot algorithm a preset lowers to (read from a plain f32 dot lowered with it)."""
  preset = ALGORITHM_PRESETS[preset_name]
  x = jax.ShapeDtypeStruct((2, 2), jnp.float32)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, precision=preset))
  try:
    lowered = dot.lower(x, x)
  except ValueError:
    # XLA:CPU's lowering refuses presets other platforms accept (`platforms`); the
    # attribute a preset lowers to is the same for every platform (test_platforms.py).
    lowered = dot.trace(x, x).lower(lowering_platforms=("cuda",))
  g = Graph(lowered.compiler_ir("stablehlo"))
  found = [dot_info(n)["algorithm"] for n in g.ops(DOT)]
  if not found or found[0] is None:
    raise UserError(f"The dot algorithm preset {preset_name!r} does not lower to a dot "
                    f"algorithm on backend {jax.default_backend()!r}.")
  return found[0]


def precision_expectation(name: str) -> str:
  """'HIGHEST' for a jax.lax.Precision, 'algorithm <NAME>' for a preset."""
  p = parse_precision(name)
  return p.name if isinstance(p, jax.lax.Precision) else f"algorithm {p.name}"


def is_preset(name: str) -> bool:
  return not isinstance(parse_precision(name), jax.lax.Precision)


def precision_problems(dot: DotSite, name: str) -> List[str]:
  p = parse_precision(name)
  if isinstance(p, jax.lax.Precision):
    if dot.algorithm is not None or dot.precision != p.name:
      got = f"algorithm <{dot.algorithm}>" if dot.algorithm else dot.precision
      return [f"precision {got}, expected {p.name}"]
    return []
  want = algorithm_text(p.name)
  if dot.algorithm != want:
    return [f"algorithm <{dot.algorithm}>, expected <{want}> ({p.name})"]
  return []


# ----------------------------------------------------------------------------- platforms
def _values(operand: str, source: Optional[str]) -> str:
  return upcast_from(operand, source) or operand


def _fields(algorithm: str) -> Dict[str, str]:
  return dict(f.split(" = ") for f in algorithm.split(", ") if " = " in f)


def dot_arithmetic(dot: DotSite, platform: str, precision: Optional[str] = None) -> str:
  """How `dot` multiplies on `platform` ('tf32', 'bf16', 'bf16_6x', 'f32', ...; the
  `platforms` table): as lowered (precision None) or had it been lowered with the
  precision name given (a lax Precision or a preset)."""
  row = platforms.check(platform)
  # Operands holding float16 values (float16, or float32 upcast from it) have their own
  # row on some platforms (TPU: one bf16 pass at DEFAULT).
  values = (_values(dot.lhs, dot.lhs_source), _values(dot.rhs, dot.rhs_source))
  f16 = "f16" in values and all(platforms.VALUE_BITS.get(v, 24) <= 11 for v in values)
  if precision is None:
    if dot.algorithm:
      arithmetic = platforms.algorithm_arithmetic(_fields(dot.algorithm))
      return row.f16_arithmetic(algorithm=arithmetic) if f16 else arithmetic
    names = [n.strip() for n in dot.precision.split(",")]
  else:
    p = parse_precision(precision)
    if not isinstance(p, jax.lax.Precision):
      arithmetic = platforms.preset_arithmetic(p.name)
      return row.f16_arithmetic(algorithm=arithmetic) if f16 else arithmetic
    names = [p.name]
  if f16:
    return min((row.f16_arithmetic(n) for n in names), key=platforms.ARITHMETIC_BITS.get)
  types = (dot.lhs, dot.rhs)
  if "f64" in types:
    return "f64"
  if "f32" not in types:
    return dot.lhs if dot.lhs in platforms.ARITHMETIC_BITS else "f32"   # 16-bit operands
  return min((row.arithmetic(n) for n in names), key=platforms.ARITHMETIC_BITS.get)


def products_text(dot: DotSite, platform: str) -> str:
  """What the dot's products keep on `platform`, as lowered: 'TF32', 'exact (bf16 x bf16
  values)', 'one bf16 pass', ..."""
  return platforms.describe_products(dot_arithmetic(dot, platform),
                                     _values(dot.lhs, dot.lhs_source),
                                     _values(dot.rhs, dot.rhs_source))


def narrows(dot: DotSite, platform: str) -> bool:
  """Whether the dot's products, as lowered, keep fewer significand bits on `platform` than
  its widest operand's values hold (f32 values in one bf16 pass or TF32, f16 values in
  one bf16 pass): what a precision of 'default' may ask for there, which the audit says."""
  lhs, rhs = _values(dot.lhs, dot.lhs_source), _values(dot.rhs, dot.rhs_source)
  widest = max(platforms.VALUE_BITS.get(v, 24) for v in (lhs, rhs))
  return platforms.product_bits(dot_arithmetic(dot, platform), lhs, rhs) < widest


def platform_problems(dot: DotSite, asked: str, platform: str,
                      knob: str = "einsum_precision") -> List[str]:
  """The dot read under `platform`'s semantics: a FAIL where its products, as lowered,
  keep fewer bits than the precision asked for promises there (an f32 x f32 dot at
  DEFAULT where 'highest' was asked: TF32 on cuda, one bf16 pass on tpu). Operands that
  hold bf16 values lose nothing to either; float16 values do on tpu
  (`platforms.Platform.f16_products`)."""
  lhs, rhs = _values(dot.lhs, dot.lhs_source), _values(dot.rhs, dot.rhs_source)
  got, want = dot_arithmetic(dot, platform), dot_arithmetic(dot, platform, asked)
  if platforms.product_bits(got, lhs, rhs) >= platforms.product_bits(want, lhs, rhs):
    return []
  return [f"on {platform} this {dot.lhs} x {dot.rhs} dot "
          f"({short_precision(dot.precision_text)}) multiplies in "
          f"{platforms.describe_products(got, lhs, rhs)}, but {knob}={asked!r} promises "
          f"{platforms.describe_products(want, lhs, rhs)} there"]


def upcast_from(operand: str, source: Optional[str]) -> Optional[str]:
  """The narrower type an f32 operand was upcast from right before the dot, if any."""
  return source if operand == "f32" and source in ("bf16", "f16") else None


def effective(dot: DotSite, widened_ok: bool):
  """(lhs, rhs, result) as the contract sees them: through an upcast into the operands,
  and (only where a dot-algorithm preset widened the dot) through a downcast of the
  result."""
  lhs = upcast_from(dot.lhs, dot.lhs_source) or dot.lhs
  rhs = upcast_from(dot.rhs, dot.rhs_source) or dot.rhs
  result = dot.result
  if widened_ok and dot.converted_to in ("bf16", "f16") and result == "f32":
    result = dot.converted_to
  return lhs, rhs, result


def check_qk(dot: DotSite, precision: Precision, *, types: bool = True) -> List[str]:
  problems = precision_problems(dot, precision.einsum_precision)
  if not types:
    return problems
  e = expected_stages(precision)
  preset = is_preset(precision.einsum_precision)
  lhs, rhs, result = effective(dot, widened_ok=preset)
  c = e["qkv"]
  allowed = {(c, c)}
  if precision.float32_qk_product or preset:
    allowed.add(("f32", "f32"))   # q and k upcast first (allowed by the contract)
  if (lhs, rhs) not in allowed and (dot.lhs, dot.rhs) not in allowed:
    problems.append(f"qk operands {lhs} x {rhs}, expected {c} x {c}")
  if result != e["logits"]:
    problems.append(f"QK^T logits are {result}, expected {e['logits']} "
                    f"(float32_qk_product={precision.float32_qk_product})")
  return problems


def check_wv(dot: DotSite, precision: Precision, *, types: bool = True) -> List[str]:
  problems = precision_problems(dot, precision.einsum_precision)
  if not types:
    return problems
  e = expected_stages(precision)
  preset = is_preset(precision.einsum_precision)
  lhs, rhs, result = effective(dot, widened_ok=preset)
  c, P = e["qkv"], e["probs"]
  # jnp.einsum may put either operand first: find the probabilities among the two.
  if not any(p == P and v in (c, P) for p, v in ((lhs, rhs), (rhs, lhs))):
    problems.append(f"wv operands {lhs} x {rhs}: the probabilities must enter as {P} "
                    f"and v as {c} or {P} (float32_logits={precision.float32_logits}, "
                    f"float32_qk_product={precision.float32_qk_product})")
  if result not in (P, "f32") and dot.result not in (P, "f32"):
    problems.append(f"wv result {result}, expected {P if P == 'f32' else P + ' or f32'}")
  return problems


def check_softmax(att: Attention, precision: Precision) -> List[str]:
  e = expected_stages(precision)
  problems = []
  if att.softmax["exp"] != e["softmax"]:
    problems.append(f"softmax runs in {att.softmax['exp']}, expected {e['softmax']} "
                    f"(float32_logits={precision.float32_logits})")
  allowed = set()
  if is_preset(precision.einsum_precision) and att.qk.converted_to == e["logits"]:
    allowed.add(f"{att.qk.result}->{att.qk.converted_to}")  # the preset's own convert
  bad = [d for d in att.downcasts if d not in allowed]
  if bad:
    problems.append(f"logits cast down ({', '.join(bad)}) between the QK^T product and "
                    f"the softmax")
  return problems


def check_dense(dot: DotSite, precision: Precision, *, types: bool = True) -> List[str]:
  problems = precision_problems(dot, precision.matmul_precision)
  if not types:
    return problems
  c = short(precision.compute_dtype)
  lhs, rhs, result = effective(dot, widened_ok=is_preset(precision.matmul_precision))
  # float32-carried weights (`decoding.for_serving`): f32 x f32 dots on values of c.
  # The activations must arrive upcast from c right before the dot.
  carried = (precision.carrier_weights and (dot.lhs, dot.rhs, dot.result) == ("f32",) * 3
             and c in (dot.lhs_source, dot.rhs_source))
  if (lhs, rhs) != (c, c) and (dot.lhs, dot.rhs) != (c, c) and not carried:
    problems.append(f"dense operands {lhs} x {rhs}, expected {c} x {c}")
  if result not in (c, "f32") and dot.result not in (c, "f32"):
    problems.append(f"dense result {result}, expected {c} or f32")
  return problems


def check_attention(att: Attention, precision: Precision) -> Dict[str, List[str]]:
  """{'qk': [...], 'softmax': [...], 'wv': [...], 'backward': [...]}: [] where it honours
  the contract."""
  return {"qk": check_qk(att.qk, precision), "softmax": check_softmax(att, precision),
          "wv": check_wv(att.wv, precision),
          "backward": [f"{b.role}: {p}" for b in att.backward
                       for p in precision_problems(b, precision.einsum_precision)]}


# ----------------------------------------------------------------------------- report
@dataclasses.dataclass
class Report:
  """What `attention_report` returns: plain data (`to_dict()` is JSON-able)."""
  function: str
  findings: Findings
  expect: Optional[Precision] = None
  # `with_compiled(lowered)`: what the backend compiled, checked (`check_compiled`)
  compiled: Optional[dict] = None
  # the platform the program was lowered for (`attnprec.platforms`): other than 'cpu',
  # every dot is also read under its precision semantics (`platform_problems`)
  platform: str = platforms.DEFAULT_PLATFORM

  def with_compiled(self, lowered_or_text) -> "Report":
    """Also reads what the backend compiled (`lowered.compile().as_text()`, or that text)
    and, with a stated Precision, checks every compiled dot (`check_compiled_dot`); its
    problems join `problems()`. Returns self."""
    text = lowered_or_text if isinstance(lowered_or_text, str) else \
        lowered_or_text.compile().as_text()
    if self.expect is not None:
      self.compiled = check_compiled(text, self.expect)
    else:
      from attnprec.inspect import compiled
      self.compiled = {"dots": [(d, []) for d in compiled.compiled_summary(text)["dots"]],
                       "problems": [], "ok": True}
    return self

  @property
  def attentions(self) -> List[Attention]:
    return self.findings.attentions

  @property
  def dense(self) -> List[DotSite]:
    return self.findings.dense

  def problems(self) -> List[str]:
    if self.expect is None:
      return [f"attention {_where(a)}: logits cast down ({', '.join(a.downcasts)}) "
              f"between the QK^T product and the softmax"
              for a in self.attentions if a.downcasts]
    out = [] if self.attentions else [
        "no attention found, so the Precision cannot be checked: no dot -> softmax -> dot "
        "pattern in the program (an attention inside a custom_call is invisible)"]
    for a in self.attentions:
      for stage, ps in check_attention(a, self.expect).items():
        out += [f"attention {_where(a)} {stage}: {p}" for p in ps]
    for d in self.dense:
      out += [f"dense {_dense_name(d)}: {p}"
              for p in check_dense(d, self.expect, types=not d.backward)]
    if self.platform != "cpu":
      e, m = self.expect.einsum_precision, self.expect.matmul_precision
      for a in self.attentions:
        out += [f"attention {_where(a)} {d.role}: {p}" for d in [a.qk, a.wv, *a.backward]
                for p in platform_problems(d, e, self.platform)]
      out += [f"dense {_dense_name(d)}: {p}" for d in self.dense
              for p in platform_problems(d, m, self.platform, "matmul_precision")]
    if self.compiled is not None:
      out += self.compiled["problems"]
    return out

  @property
  def ok(self) -> bool:
    return not self.problems()

  def to_dict(self) -> dict:
    atts = []
    for a in self.attentions:
      d = dataclasses.asdict(a)
      if self.expect is not None:
        d["problems"] = check_attention(a, self.expect)
      atts.append(d)
    dense = []
    for x in self.dense:
      d = dataclasses.asdict(x)
      if self.expect is not None:
        d["problems"] = check_dense(x, self.expect, types=not x.backward)
      dense.append(d)
    return {"function": self.function, "backend": jax.default_backend(),
            "platform": self.platform,
            "expect": None if self.expect is None else dataclasses.asdict(self.expect),
            "expected_stages": None if self.expect is None else
            expected_stages(self.expect),
            "attentions": atts, "dense": dense,
            "compiled": None if self.compiled is None else [
                dict(dataclasses.asdict(d), site=d.site, layer=d.layer, problems=ps)
                for d, ps in self.compiled["dots"]],
            "problems": self.problems(), "ok": self.ok}

  # ------------------------------------------------------------------- rendering
  def verdict(self) -> str:
    n = len(self.attentions)
    if not n:
      return "NO ATTENTION FOUND: no dot -> softmax -> dot pattern in the program."
    ps = self.problems()
    if self.expect is None:
      if ps:
        return f"FLAGGED: {'; '.join(ps)}"
      return (f"{n} attention(s) found; no down-cast between a QK^T product and its "
              f"softmax. State a Precision (expect=...) for a verdict.")
    if not ps:
      return (f"PASS: {n} attention(s) and {len(self.dense)} dense dot(s) match the "
              f"contract for {self._expected_line()}.")
    shown = "; ".join(ps[:6])
    more = f" (+{len(ps) - 6} more)" if len(ps) > 6 else ""
    return f"FAIL: {len(ps)} mismatch(es): {shown}{more}"

  def attention_table(self) -> str:
    lines = ["| # | attention | qk dot | softmax | wv dot | precision | down-cast qk->softmax"
             " | mask / soft-cap | grad dots | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for i, a in enumerate(self.attentions):
      checks = check_attention(a, self.expect) if self.expect is not None else None
      verdict = "-" if checks is None else (
          "ok" if not any(checks.values()) else "MISMATCH (" + ", ".join(
              stage for stage, ps in checks.items() if ps) + ")")
      sm = "/".join(f"{k} {v}" for k, v in a.softmax.items())
      if a.online:
        sm += " (online)"
      if not a.stabilised:
        sm += " (no max)"
      extras = ", ".join(a.mask + (["soft-cap"] if a.soft_cap else [])
                         + (["scale on logits"] if a.logits_scale else [])) or "-"
      precs = {a.qk.precision_text, a.wv.precision_text}
      grads = ", ".join(f"{b.role} {dot_types(b)}" for b in a.backward) or "-"
      lines.append(
          f"| {i} | {_where(a)} | {dot_types(a.qk)} | {sm} | {dot_types(a.wv)}"
          f"{' (probs ' + ', '.join(a.probs_casts) + ')' if a.probs_casts else ''} | "
          f"{' / '.join(short_precision(p) for p in sorted(precs))} | "
          f"{'**' + ', '.join(a.downcasts) + '**' if a.downcasts else 'none'} | {extras} "
          f"| {grads} | {verdict} |")
    return "\n".join(lines)

  def dense_table(self) -> str:
    lines = ["| dots | name | lhs | rhs | result | precision | verdict |",
             "|---:|---|---|---|---|---|---|"]
    groups: Dict[tuple, List[DotSite]] = {}
    for d in self.dense:
      ok = "-" if self.expect is None else (
          "ok" if not check_dense(d, self.expect, types=not d.backward) else "MISMATCH")
      key = (_dense_name(d), typed(d.lhs, d.lhs_source), typed(d.rhs, d.rhs_source),
             result_text(d), short_precision(d.precision_text), ok)
      groups.setdefault(key, []).append(d)
    for (name, lhs, rhs, res, prec, ok), ds in groups.items():
      lines.append(f"| {len(ds)} | {name} | {lhs} | {rhs} | {res} | {prec} | {ok} |")
    return "\n".join(lines)

  def _expected_line(self) -> str:
    """The expected Precision's line, its 'auto' forms resolved for the platform the
    program was lowered for."""
    return self.expect.describe(platforms.TABLE[self.platform].backend)

  def to_markdown(self) -> str:
    lowered = "" if self.platform == "cpu" else f"Lowered for {self.platform}. "
    head = [f"# Attention precision: `{self.function}`", "",
            f"Backend: {jax.default_backend()}. {lowered}Expected: "
            f"{self._expected_line() if self.expect else '(no Precision stated)'}.", ""]
    if self.expect is not None:
      e = expected_stages(self.expect)
      head += [f"Contract for this Precision: qk {e['qkv']} x {e['qkv']} -> {e['logits']}, "
               f"softmax {e['softmax']}, probabilities into wv {e['probs']}, einsum "
               f"{precision_expectation(self.expect.einsum_precision)}, dense "
               f"{precision_expectation(self.expect.matmul_precision)}.", ""]
    problems = [f"- {p}" for p in self.problems()] if self.expect is not None else []
    return "\n".join(head + [f"**{self.verdict()}**", ""] + problems + ["", "## Attentions", "",
                             "Types are lhs x rhs -> result; `f32<-bf16`: an operand "
                             "upcast right before the dot; `f32->bf16`: a result cast "
                             "right after it.", "", self.attention_table(), "",
                             "## Dense dots", "", self.dense_table(), ""]
                     + ([] if self.compiled is None else
                        ["## What the backend compiled", "", self.compiled_table(), ""]))

  def compiled_table(self) -> str:
    lines = ["| dots | site | compiled as | lhs x rhs -> accumulation | verdict |",
             "|---:|---|---|---|---|"]
    groups: Dict[tuple, int] = {}
    for d, ps in (self.compiled or {}).get("dots", []):
      verdict = "MISMATCH" if ps else ("listed" if d.backward or self.expect is None
                                       else "ok")
      key = (d.site + (" (grad)" if d.backward else ""), d.via, d.described, verdict)
      groups[key] = groups.get(key, 0) + 1
    for (site, via, types, verdict), n in groups.items():
      lines.append(f"| {n} | {site} | {via} | {types} | {verdict} |")
    return "\n".join(lines)

  def write(self, run_dir: str) -> List[str]:
    """inspect.json and inspect.md into run_dir (atomic writes)."""
    runs.ensure_dir(run_dir)
    paths = [os.path.join(run_dir, "inspect.json"), os.path.join(run_dir, "inspect.md")]
    runs.atomic_write(paths[0], json.dumps(self.to_dict(), indent=1, default=str) + "\n")
    runs.atomic_write(paths[1], self.to_markdown())
    return paths


def typed(t: str, src: Optional[str]) -> str:
  """'f32<-bf16' for an operand upcast right before the dot, 'bf16<-i8' for one converted
  from codes (a quantized KV cache's), else the type."""
  up = upcast_from(t, src) or (src if src is not None and is_code(src) else None)
  return f"{t}<-{up}" if up else t


def result_text(d: DotSite) -> str:
  return d.result + (f"->{d.converted_to}" if d.converted_to and d.converted_to != d.result
                     else "")


def dot_types(d: DotSite) -> str:
  return f"{typed(d.lhs, d.lhs_source)} x {typed(d.rhs, d.rhs_source)} -> {result_text(d)}"


def short_precision(p: str) -> str:
  """'algorithm <lhs_precision_type = bf16, ..., num_primitive_operations = 3, ...>' ->
  'alg bf16,bf16->f32 x3'."""
  if not p.startswith("algorithm"):
    return p
  fields = dict(f.split(" = ") for f in p[len("algorithm <"):-1].split(", ") if " = " in f)
  return (f"alg {fields.get('lhs_precision_type')},{fields.get('rhs_precision_type')}"
          f"->{fields.get('accumulation_type')} x{fields.get('num_primitive_operations')}")


def _where(a: Attention) -> str:
  return a.label or short_source(a.qk.source) or "(unnamed)"


def short_source(source: str) -> str:
  """'file:line' relative to the working directory when it lies below it."""
  path, _, line = source.rpartition(":")
  if not path:
    return source
  rel = os.path.relpath(path)
  return f"{rel if not rel.startswith('..') else os.path.basename(path)}:{line}"


def _dense_name(d: DotSite) -> str:
  parts = [unwrap(p) for p in d.name.split("/")[:-1]
           if not p.startswith("jit(") and "->" not in p]
  name = "/".join(parts) or (d.reads[0] if d.reads else "") or short_source(d.source) \
      or "(unnamed)"
  return name + (" (grad)" if d.backward else "")


# ----------------------------------------------------------------------------- compiled
_WIDTH = {"f64": 64, "f32": 32, "bf16": 16, "f16": 16}


def _narrower(t: str, than: str) -> bool:
  return t in _WIDTH and than in _WIDTH and _WIDTH[t] < _WIDTH[than]


def check_compiled_dot(dot, precision: Precision) -> List[str]:
  """What the backend compiled a dot into (`inspect.compiled.CompiledDot`: an XLA dot, a dot
  inside a library fusion, a matmul custom-call) against the contract: its result type is
  its accumulation type, so

    qk     with float32 logits: accumulates in f32 and is not rounded to 16 bits after;
    wv     with float32 probabilities: accumulates in f32, and the probabilities do not
           enter as 16-bit values (not both operands 16-bit or converted up from 16 bits);
    dense  accumulates in f32 (`layers.project`), unless a dot-algorithm preset states
           its own types (then only the lowered check applies);
    other  a forward dot the audit cannot attribute may not accumulate below f32;
    all    no operand is narrower than the compute dtype.

  Gradient dots are listed only (the contract table is about the forward computation).
  Returns the problems ([] where it honours the contract)."""
  if dot.backward:
    return []
  problems = []
  e = expected_stages(precision)
  c = e["qkv"]
  lhs, rhs = dot.lhs_from or dot.lhs_type, dot.rhs_from or dot.rhs_type
  for side, t in (("lhs", lhs), ("rhs", rhs)):
    if _narrower(t, c):
      problems.append(f"compiled {dot.site} dot's {side} is {t}, narrower than the compute "
                      f"dtype {c}")
  acc = dot.result_type
  if dot.site == "qk" and e["logits"] == "f32":
    if _narrower(acc, "f32"):
      problems.append(f"compiled qk dot accumulates in {acc}; the contract requires f32 "
                      f"logits (float32_qk_product={precision.float32_qk_product})")
    elif dot.rounded_to:
      problems.append(f"compiled qk dot's f32 logits are rounded to {dot.rounded_to} right "
                      f"after it; the contract requires f32 logits")
  elif dot.site == "wv" and e["probs"] == "f32":
    if _narrower(acc, "f32"):
      problems.append(f"compiled wv dot accumulates in {acc}; the contract requires f32")
    if all(t in ("bf16", "f16") for t in (lhs, rhs)):
      problems.append(f"compiled wv dot takes {lhs} x {rhs}: the f32 probabilities enter "
                      f"narrowed (float32_logits={precision.float32_logits})")
  elif dot.site == "dense" and not is_preset(precision.matmul_precision):
    if _narrower(acc, "f32"):
      problems.append(f"compiled dense dot accumulates in {acc}, expected f32 "
                      f"(layers.project)")
  elif dot.site == "other" and _narrower(acc, "f32"):
    problems.append(f"a compiled dot the audit cannot attribute ({dot.name or 'no op_name'})"
                    f" accumulates in {acc}")
  return problems


def check_compiled(text: str, precision: Precision, *, head_dim: Optional[int] = None,
                   key_lengths: tuple = ()) -> dict:
  """The compiled program (`lowered.compile().as_text()`) checked dot by dot:
  {'dots': [(CompiledDot, problems)], 'problems': [...], 'ok': bool}. head_dim and
  key_lengths attribute attention dots whose op_name XLA dropped (`compiled.compiled_summary`;
  pass them for forward programs only)."""
  from attnprec.inspect import compiled
  summary = compiled.compiled_summary(text, head_dim, key_lengths)
  checked = [(d, check_compiled_dot(d, precision)) for d in summary["dots"]]
  problems = [f"compiled {d.site} dot{'' if d.layer is None else f' (layer {d.layer})'} "
              f"[{d.via}, {d.described}]: {p}" for d, ps in checked for p in ps]
  return {"dots": checked, "summary": summary, "problems": problems, "ok": not problems}

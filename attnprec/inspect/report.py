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
import re
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
  # the program's kernel custom calls (`attnprec.inspect.kernel_calls`): Mosaic bodies
  # read back (`attnprec.inspect.mosaic`), or unread with the reason
  kernels: list = dataclasses.field(default_factory=list)

  @property
  def kernel_attentions(self) -> list:
    """The kernel calls whose body holds an attention (a QK and a PV matmul)."""
    return [k for k in self.kernels if "body" in k and k["body"].attention]

  @property
  def unread_kernels(self) -> list:
    """Kernel calls that no reader opened, or whose body holds no attention found."""
    return [k for k in self.kernels if "unread" in k or not k["body"].attention]

  def kernel_problems(self) -> List[str]:
    from attnprec.inspect import mosaic
    out = [f"kernel {k['kernel'] or k['call']}: unread ({k['unread']})"
           for k in self.kernels if "unread" in k]
    if self.expect is not None:
      out += [f"kernel {k['kernel']}: {p}" for k in self.kernels if "body" in k
              for p in mosaic.check_body(k["body"], self.expect)]
    return out

  def kernel_table(self) -> str:
    """Markdown: each kernel call's body as read (Mosaic), or why it is unread."""
    from attnprec.inspect import mosaic
    lines = ["| kernel | QK matmul (products) | exp / max / sum | PV matmul (products) | "
             "probabilities into PV | verdict |", "|---|---|---|---|---|---|"]
    for k in self.kernels:
      if "unread" in k:
        lines.append(f"| {k['kernel'] or k['call']} | unread: {k['unread']} | | | | UNREAD |")
        continue
      s = mosaic.summary(k["body"], self.platform if self.platform != "cpu" else "tpu")
      ps = mosaic.check_body(k["body"], self.expect) if self.expect is not None else []
      verdict = ("MISMATCH" if ps else "ok") if self.expect is not None else (
          "read" if s["attention"] else "UNREAD (no attention found in it)")
      pair = lambda a, b: "; ".join(f"{x} ({y})" for x, y in zip(s[a], s[b])) or "-"  # noqa: E731
      lines.append(f"| {k['kernel']} | {pair('qk', 'qk_products')} | "
                   f"{'/'.join(s['exp']) or '-'} / {'/'.join(s['max']) or '-'} / "
                   f"{'/'.join(s['sum']) or '-'} | {pair('pv', 'pv_products')} | "
                   f"{'; '.join(s['probabilities']) or '-'} | {verdict} |")
    return "\n".join(lines)

  def with_compiled(self, lowered_or_text) -> "Report":
    """Also reads what the backend compiled (`lowered.compile().as_text()`, or that text)
    and, with a stated Precision, checks every compiled dot (`check_compiled_dot`); its
    problems join `problems()`. Returns self."""
    text = lowered_or_text if isinstance(lowered_or_text, str) else \
        compiled_text(lowered_or_text)
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
              for a in self.attentions if a.downcasts] + self.kernel_problems()
    out = [] if self.attentions or self.kernel_attentions else [
        "no attention found, so the Precision cannot be checked: no dot -> softmax -> dot "
        "pattern in the program" + (" and no kernel body read holds one"
                                    if self.kernels else "")]
    out += self.kernel_problems()
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
    n = len(self.attentions) + len(self.kernel_attentions)
    unread = self.unread_kernels
    if unread and not self.kernel_attentions and not self.attentions:
      names = ", ".join(sorted({k["kernel"] or k["call"] for k in unread}))
      return (f"UNREAD: the program's attention may sit in {len(unread)} kernel call(s) "
              f"this reader cannot open or finds no attention in ({names}); nothing "
              f"about its precision is known.")
    if not n:
      return "NO ATTENTION FOUND: no dot -> softmax -> dot pattern in the program."
    ps = self.problems()
    if self.expect is None:
      if ps:
        return f"FLAGGED: {'; '.join(ps)}"
      return (f"{n} attention(s) found; no down-cast between a QK^T product and its "
              f"softmax. State a Precision (expect=...) for a verdict.")
    if not ps:
      kernels = (f" ({len(self.kernel_attentions)} in Mosaic kernel bodies)"
                 if self.kernel_attentions else "")
      return (f"PASS: {n} attention(s){kernels} and {len(self.dense)} dense dot(s) match "
              f"the contract for {self._expected_line()}.")
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
                     + ([] if not self.kernels else
                        ["## Kernel bodies (custom calls)", "",
                         "A Pallas TPU kernel's Mosaic body, read from its tpu_custom_call "
                         "(`attnprec.inspect.mosaic`): each matmul's types (`f32<-bf16`: "
                         "extended from bf16; `->bf16`: truncated right after) and what its "
                         "products keep on the TPU (f32 operands at DEFAULT: one bf16 "
                         "pass), the softmax's exp / max / sum dtypes.", "",
                         self.kernel_table(), ""])
                     + ([] if self.compiled is None else
                        ["## What the backend compiled", "", self.compiled_table(), ""]))

  def compiled_table(self) -> str:
    lines = ["| dots | site | compiled as | lhs x rhs -> result | verdict |",
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


_MODULE = re.compile(r"/(attn/[qkvo]|mlp/\w+)/")


def compiled_module(name: str) -> str:
  """The model module a compiled dot's op_name names ('attn/o', 'mlp/down', 'unembed',
  'attn_qk', ...), else the last scope before the op."""
  m = _MODULE.search(name)
  if m:
    return m.group(1)
  if "BTD,DV->BTV" in name:
    return "unembed"
  for scope in ("attn_qk", "attn_wv"):
    if f"/{scope}/" in name:
      return scope
  parts = [p for p in name.split("/") if p]
  return parts[-2] if len(parts) >= 2 else (name or "?")


def _stored_ok(dot, stored: str, platform: str) -> bool:
  """A result stored as `stored` that only dots read, each of which takes its f32
  operands as `stored` on `platform` (one bf16 pass at DEFAULT on tpu): nothing lost."""
  return dot.feeds_only_dots and platforms.stored_for_one_pass(
      platform, [p for _, p in dot.feeds], stored)


def _operand_ok(dot, t: str, platform: str) -> bool:
  """An operand stored as `t` where the dot itself takes f32 operands as `t` there."""
  return platforms.stored_for_one_pass(platform, [dot.precision], t)


def platform_rewrites(dot, precision: Precision, platform: str = "cpu") -> List[str]:
  """The narrowings of a compiled dot that `platform`'s arithmetic permits, in words
  (`platforms.Platform.operand_rounding`): an operand stored narrower than the compute
  dtype where the dot multiplies its f32 operands in that type anyway, a result stored
  narrower than the contract's type where only such dots read it. [] where none."""
  if platform == "cpu" or dot.backward:
    return []
  row = platforms.check(platform)
  notes = []
  c = expected_stages(precision)["qkv"]
  for side, t in (("lhs", dot.lhs_from or dot.lhs_type), ("rhs", dot.rhs_from or dot.rhs_type)):
    if _narrower(t, c) and _operand_ok(dot, t, platform):
      notes.append(f"{side} stored as {t}: at {dot.precision.upper()} {row.name} multiplies "
                   f"f32 operands in {platforms.ARITHMETIC_TEXT[row.arithmetic(dot.precision)]}")
  want = _result_wanted(dot, precision, platform)
  if want and _narrower(dot.result_type, want) and _stored_ok(dot, dot.result_type, platform):
    readers = ", ".join(sorted({f"{compiled_module(n)} ({p.upper()})" for n, p in dot.feeds}))
    notes.append(f"result stored as {dot.result_type}, not {want}: read only by {readers}, "
                 f"which {row.name} multiplies in "
                 f"{platforms.ARITHMETIC_TEXT[row.arithmetic(dot.feeds[0][1])]}")
  return notes


def _result_wanted(dot, precision: Precision, platform: str) -> Optional[str]:
  """The narrowest result type the contract allows this compiled dot (None: no rule).
  Where the result type is the accumulation type (cpu, cuda) the attention dots and the
  dense projections must accumulate in f32; where it is the stored type (tpu: the MXU
  sums in f32 whatever the HLO says) the qk dot must store the table's logits dtype and
  the wv dot the attention's output dtype c (its f32 sum rounded once to c)."""
  e = expected_stages(precision)
  storage = platforms.check(platform).dot_result == "storage"
  if dot.site == "qk":
    return e["logits"] if e["logits"] == "f32" or storage else None
  if dot.site == "wv":
    return (e["output"] if storage else "f32") if e["probs"] == "f32" else None
  if dot.site == "dense" and not is_preset(precision.matmul_precision):
    return e["qkv"] if storage else "f32"
  if dot.site == "other":
    return "f32" if not storage else None
  return None


def _asked(dot, precision: Precision) -> str:
  return precision.matmul_precision if dot.site == "dense" else precision.einsum_precision


def compiled_precision_problems(dot, precision: Precision, platform: str = "cpu") -> List[str]:
  """A compiled dot whose stated precision ('default', 'highest', an algorithm) keeps
  fewer bits on `platform` than the phase's einsum_precision (attention) or
  matmul_precision (dense) promises there, for operands whose values hold more: a FAIL
  naming both (the float32 model at DEFAULT held to 'highest' on tpu: one bf16 pass)."""
  if dot.site not in ("qk", "wv", "dense"):
    return []
  row = platforms.check(platform)
  lhs, rhs = dot.lhs_from or dot.lhs_type, dot.rhs_from or dot.rhs_type
  if "f32" not in (dot.lhs_type, dot.rhs_type):
    return []          # 16-bit operands: every precision takes their values exactly

  def arithmetic(name: str) -> str:
    if name.startswith("algorithm "):
      return platforms.algorithm_arithmetic(_algorithm_fields(name.split(" ", 1)[1]))
    p = parse_precision(name)
    if not isinstance(p, jax.lax.Precision):
      return platforms.preset_arithmetic(p.name)
    return row.arithmetic(p.name)

  asked = _asked(dot, precision)
  got, want = arithmetic(dot.precision), arithmetic(asked)
  if platforms.product_bits(got, lhs, rhs) >= platforms.product_bits(want, lhs, rhs):
    return []
  knob = "matmul_precision" if dot.site == "dense" else "einsum_precision"
  return [f"compiled at {dot.precision.upper()}: {platforms.describe_products(got, lhs, rhs)} "
          f"on {platform}, but {knob}={asked!r} promises "
          f"{platforms.describe_products(want, lhs, rhs)} there"]


def _algorithm_fields(name: str) -> Dict[str, str]:
  """XLA's algorithm names ('dot_bf16_bf16_f32_x3', 'dot_tf32_tf32_f32') as the fields
  `platforms.algorithm_arithmetic` reads."""
  parts = name.lower().removeprefix("dot_").split("_")
  passes = parts[-1][1:] if parts[-1].startswith("x") else "1"
  return {"lhs_precision_type": parts[0], "num_primitive_operations": passes}


def check_compiled_dot(dot, precision: Precision, platform: str = "cpu") -> List[str]:
  """What the backend compiled a dot into (`inspect.compiled.CompiledDot`: an XLA dot, a dot
  inside a library fusion, a matmul custom-call, a TPU `convolution`) against the
  contract, read under `platform`'s meaning of a dot's result type
  (`platforms.Platform.dot_result`; `_result_wanted`):

    qk     with float32 logits: keeps f32 (accumulated and stored), not rounded to 16
           bits after; on tpu also: stores bf16 logits no narrower than the table's;
    wv     with float32 probabilities: accumulates in f32 (tpu: stores at least the
           output dtype c), and the probabilities do not enter as 16-bit values (not
           both operands 16-bit or converted up from 16 bits);
    dense  accumulates in f32 (tpu: stores at least c) unless a dot-algorithm preset
           states its own types (then only the lowered check applies);
    other  a forward dot the audit cannot attribute may not accumulate below f32;
    all    no operand is narrower than the compute dtype; the dot's precision keeps as
           many bits on `platform` as the phase's einsum / matmul precision promises.

  A narrowing the platform's arithmetic makes anyway is not a problem but a rewrite
  (`platform_rewrites`: on tpu at DEFAULT, a value stored as bf16 for a dot that takes
  its f32 operands in one bf16 pass). Gradient dots are checked for precision only.
  Returns the problems ([] where it honours the contract)."""
  if dot.backward:
    return compiled_precision_problems(dot, precision, platform)
  problems = []
  e = expected_stages(precision)
  c = e["qkv"]
  lhs, rhs = dot.lhs_from or dot.lhs_type, dot.rhs_from or dot.rhs_type
  for side, t in (("lhs", lhs), ("rhs", rhs)):
    if _narrower(t, c) and not _operand_ok(dot, t, platform):
      problems.append(f"compiled {dot.site} dot's {side} is {t}, narrower than the compute "
                      f"dtype {c}")
  acc = dot.result_type
  want = _result_wanted(dot, precision, platform)
  storage = platforms.check(platform).dot_result == "storage"
  verb = "stores its result as" if storage else "accumulates in"
  narrowed = want is not None and _narrower(acc, want) and not _stored_ok(dot, acc, platform)
  if dot.site == "qk" and e["logits"] == "f32":
    if narrowed:
      problems.append(f"compiled qk dot {verb} {acc}; the contract requires f32 "
                      f"logits (float32_qk_product={precision.float32_qk_product})")
    elif dot.rounded_to:
      problems.append(f"compiled qk dot's f32 logits are rounded to {dot.rounded_to} right "
                      f"after it; the contract requires f32 logits")
  elif dot.site == "qk" and narrowed:
    problems.append(f"compiled qk dot {verb} {acc}, narrower than the logits dtype {want}")
  elif dot.site == "wv" and e["probs"] == "f32":
    if narrowed:
      problems.append(f"compiled wv dot {verb} {acc}; the contract requires {want}")
    if all(t in ("bf16", "f16") for t in (lhs, rhs)) and not (
        _operand_ok(dot, lhs, platform) and _operand_ok(dot, rhs, platform)):
      problems.append(f"compiled wv dot takes {lhs} x {rhs}: the f32 probabilities enter "
                      f"narrowed (float32_logits={precision.float32_logits})")
  elif dot.site == "dense" and narrowed:
    problems.append(f"compiled dense dot {verb} {acc}, expected {want} (layers.project)")
  elif dot.site == "other" and narrowed:
    problems.append(f"a compiled dot the audit cannot attribute ({dot.name or 'no op_name'})"
                    f" accumulates in {acc}")
  return problems + compiled_precision_problems(dot, precision, platform)


def local_platform() -> Optional[str]:
  """The `platforms` name of the backend this process runs on (None: no row, ROCm)."""
  return platforms.local_platform(jax.default_backend(),
                                  getattr(jax.devices()[0].client, "platform_version", ""))


def compiled_text(lowered) -> str:
  """What this backend compiles `lowered` into: the optimized HLO text
  (`lowered.compile().as_text()`), compiled with the platform's
  `Platform.text_compile_options` (options that change the machine code, not that text).
  The program compiled here is only read, never run."""
  platform = local_platform()
  options = dict(platforms.TABLE[platform].text_compile_options) if platform else {}
  return lowered.compile(compiler_options=options or None).as_text()


def check_compiled(text: str, precision: Precision, *, head_dim: Optional[int] = None,
                   key_lengths: tuple = (), platform: str = "cpu") -> dict:
  """The compiled program (`lowered.compile().as_text()`) checked dot by dot:
  {'dots': [(CompiledDot, problems)], 'problems': [...], 'ok': bool}. head_dim and
  key_lengths attribute attention dots whose op_name XLA dropped (`compiled.compiled_summary`;
  pass them for forward programs only)."""
  from attnprec.inspect import compiled
  summary = compiled.compiled_summary(text, head_dim, key_lengths)
  checked = [(d, check_compiled_dot(d, precision, platform)) for d in summary["dots"]]
  problems = [f"compiled {d.site} dot{'' if d.layer is None else f' (layer {d.layer})'} "
              f"[{d.via}, {d.described}]: {p}" for d, ps in checked for p in ps]
  return {"dots": checked, "summary": summary, "problems": problems, "ok": not problems}

"""The contract's KV-cache rows, checked in the lowered and in the compiled program.

For attention over a quantized KV cache (`attnprec.contract.cache_stage_dtypes`: int8 or
float8 codes with float32 scales) the contract fixes, and this module reads back from
what `attnprec.inspect.finder` found (codes and scalings, read by structure):

  codes   the keys' codes enter the qk dot, the values' codes the wv dot, converted
          straight (converts and layout ops only, no arithmetic) from the code dtype the
          cache stores to the rows' operand dtype ('k_into_qk', 'v_into_wv');
  q, p    never quantized: no convert to or from a code type on q's or the
          probabilities' way to their dot, and q in the rows' 'q_into_qk';
  scales  float32 where they are made; a per-token key scale multiplies the logits,
          varying along the keys' axis, in the logits dtype; a per-channel key scale
          multiplies q, varying along the head dim the qk dot contracts, in f32 with
          float32_qk_product (else in c); a value scale multiplies the probabilities,
          varying along the keys' axis, in the probs dtype: each once, none elsewhere.

A program without a cache (the train step) or with an unscaled one is held to the same
rows with no codes and no scales: a code on an attention dot's operand, or a scaling of
its logits, q or probabilities, is a mismatch there too.

In the compiled program (`attnprec.inspect.compiled.CompiledDot`) the backend may widen what the
program states (XLA:CPU computes bf16 dots and elementwise ops in f32, rounding after
each), so there: the codes are converted to the operand dtype or to f32, no other
operand comes from a code type, neither q nor the probabilities enter narrower than
their rows, and each of the contract's scale multiplies is found (a multiply by a
broadcast that varies along the keys' axis of the logits / probabilities, or along the
head dim of q) and is not narrower than its row's dtype.
"""
from typing import Dict, List, Optional

from attnprec.inspect.compiled import CompiledDot
from attnprec.contract import COMPUTE_CACHE, SCALED_KV_DTYPES, cache_stage_dtypes, stage_dtypes
from attnprec.inspect.finder import BITS, Attention, Scaling, is_code
from attnprec.inspect.report import is_preset, short
from attnprec.precision import Precision

# code dtype -> (its name in StableHLO, in HLO)
CODE_NAMES = {"int8": ("i8", "s8"), "float8_e4m3fn": ("f8E4M3FN", "f8e4m3fn"),
              "float8_e5m2": ("f8E5M2", "f8e5m2")}
# (Attention field, what it scales, setting, granularity, the axis it varies along,
#  the row of its dtype, its name)
SCALE_SITES = (
    ("logits_scales", "logits", "k_scale", "token", "keys", "k_scale_in",
     "per-token key scale"),
    ("q_scales", "q", "k_scale", "channel", "channels", "k_scale_in",
     "per-channel key scale"),
    ("probs_scales", "probabilities", "v_scale", "token", "keys", "v_scale_in",
     "value scale"))


# ----------------------------------------------------------------------------- contract
def expected_cache(precision: Precision, cache: bool = True) -> Dict[str, object]:
  """The cache rows a phase's program must show, in short type names: with `cache`
  False (a program that runs no KV cache, the train step) those of no cache at all."""
  storage = precision.cache_storage if cache else COMPUTE_CACHE
  rows = cache_stage_dtypes(precision.compute_dtype, storage, precision.attention)
  base = stage_dtypes(precision.compute_dtype, precision.attention)
  names = lambda d: CODE_NAMES[d] if d in SCALED_KV_DTYPES else (None, None)  # noqa: E731
  (k, k_hlo), (v, v_hlo) = names(storage.k_dtype), names(storage.v_dtype)
  maybe = lambda d: None if d is None else short(d)  # noqa: E731
  return {"storage": storage.describe() if cache else "no KV cache",
          "quantized": storage.quantized, "k_code": k, "v_code": v, "k_code_hlo": k_hlo,
          "v_code_hlo": v_hlo, "k_scale": rows["k_scale"], "v_scale": rows["v_scale"],
          "scale_dtype": short(rows["scale_dtype"]), "k_scale_in": maybe(rows["k_scale_in"]),
          "v_scale_in": maybe(rows["v_scale_in"]), "q_into_qk": short(rows["q_into_qk"]),
          "k_into_qk": short(rows["k_into_qk"]), "v_into_wv": short(rows["v_into_wv"]),
          "probs": short(base["probs"]), "widened_ok": is_preset(precision.einsum_precision)}


def contract_text(e: dict) -> str:
  """The cache rows in one line, as the audit's table shows them."""
  if not e["quantized"]:
    return f"no codes, no scales ({e['storage']})"
  return (f"k: {_side_text(e, 'k')}; v: {_side_text(e, 'v')}; q {e['q_into_qk']}, "
          f"probabilities {e['probs']}, never quantized")


def _side_text(e: dict, side: str) -> str:
  """'i8 -> bf16 into qk, f32 per token on the logits in f32' (or 'unquantized')."""
  code, scale = e[f"{side}_code"], e[f"{side}_scale"]
  if code is None:
    return "unquantized"
  dot, into = ("qk", e["k_into_qk"]) if side == "k" else ("wv", e["v_into_wv"])
  where = ("the probabilities" if side == "v" else
           "the logits" if scale == "token" else "q")
  return (f"{code} -> {into} into {dot}, {e['scale_dtype']} per {scale} on {where} in "
          f"{e[f'{side}_scale_in']}")


# ----------------------------------------------------------------------------- lowered
def _operands(dot) -> list:
  """[(type, source, CodeCasts or None)] of a DotSite's two operands."""
  return [(dot.lhs, dot.lhs_source, dot.lhs_codes), (dot.rhs, dot.rhs_source, dot.rhs_codes)]


def _coded(operand) -> bool:
  t, _, codes = operand
  return codes is not None or is_code(t)


def _codes_text(operand) -> str:
  t, _, codes = operand
  return ", ".join(codes.casts) if codes is not None else f"{t} itself"


def _code_entry(operand, code: str, into: str, what: str, widened_ok: bool) -> List[str]:
  """How the operand holding the keys' / values' codes enters its dot, against the rows:
  from `code`, converted straight to `into` (then to f32 only where a dot-algorithm
  preset widens the dot)."""
  t, src, codes = operand
  if codes is None:
    return [f"the {what} enter as {t} codes themselves; the contract casts them to {into}"]
  first = codes.casts[0]
  came, went = first.split("->")
  problems = []
  if came != code:
    problems.append(f"the {what} enter from {came} codes; the cache stores {code}")
  widened = widened_ok and t == "f32" and src == into
  if went != into:
    problems.append(f"the {what}' codes are cast to {went} ({first}); the contract's "
                    f"operand dtype is {into}")
  elif t != into and not widened:
    problems.append(f"the {what}' codes enter as {t} ({first}, then converted); the "
                    f"contract's operand dtype is {into}")
  if not codes.direct:
    problems.append(f"the {what}' codes reach the dot through arithmetic after {first}: "
                    f"dequantized before the dot instead of cast exactly to {into}")
  return problems


def check_qk_codes(att: Attention, e: dict) -> List[str]:
  """The keys' codes (and no other) into the qk dot, and q's type."""
  ops = _operands(att.qk)
  coded = [i for i, o in enumerate(ops) if _coded(o)]
  code = e["k_code"]
  if code is None:
    return [f"qk dot: an operand comes from codes ({_codes_text(ops[i])}) but the keys are "
            f"not stored quantized ({e['storage']}): q is never quantized" for i in coded]
  if not coded:
    return [f"qk dot: no operand comes from the keys' {code} codes ({e['storage']}): "
            f"they are dequantized, or read from elsewhere, before the dot"]
  problems = []
  if len(coded) == 2:
    problems.append(f"qk dot: both operands come from codes ({_codes_text(ops[0])}; "
                    f"{_codes_text(ops[1])}): q is quantized; the contract never "
                    f"quantizes q")
  keys = next((i for i in coded if ops[i][2] is not None and
               ops[i][2].casts[0].startswith(code + "->")), coded[0])
  problems += [f"qk dot: {p}" for p in _code_entry(ops[keys], code, e["k_into_qk"],
                                                    "keys", e["widened_ok"])]
  q_type, q_src, _ = ops[1 - keys]
  q_ok = q_type == e["q_into_qk"] or (e["widened_ok"] and q_type == "f32"
                                      and q_src == e["q_into_qk"])
  if not q_ok:
    problems.append(f"qk dot: q enters as {q_type}; the contract's cache rows say "
                    f"{e['q_into_qk']}")
  return problems


def check_wv_codes(att: Attention, e: dict) -> List[str]:
  """The values' codes (and no other) into the wv dot; the probabilities never coded."""
  ops = _operands(att.wv)
  probs, values = ops[att.probs_operand], ops[1 - att.probs_operand]
  problems = []
  if _coded(probs):
    problems.append(f"wv dot: the probabilities come from codes ({_codes_text(probs)}): "
                    f"they are quantized; the contract never quantizes them")
  code = e["v_code"]
  if code is None:
    if _coded(values):
      problems.append(f"wv dot: v comes from codes ({_codes_text(values)}) but the values "
                      f"are not stored quantized ({e['storage']})")
    return problems
  if not _coded(values):
    return problems + [f"wv dot: v does not come from the values' {code} codes "
                       f"({e['storage']}): they are dequantized, or read from elsewhere, "
                       f"before the dot"]
  return problems + [f"wv dot: {p}" for p in _code_entry(values, code, e["v_into_wv"],
                                                         "values", e["widened_ok"])]


def scaling_text(s: Scaling, where: str) -> str:
  """'f32[2, 2, 16] per key, on the logits in f32'."""
  along = {"keys": "per key", "channels": "per channel",
           "elementwise": "elementwise"}.get(s.along, "along other axes")
  rounded = f" ({', '.join(s.casts)})" if s.casts else ""
  return f"{s.scale}{list(s.shape)} {along}, on {where} in {s.dtype}{rounded}"


def _scale_problems(s: Scaling, name: str, where: str, dtype: str,
                    scale_dtype: str) -> List[str]:
  problems = []
  if s.dtype != dtype:
    problems.append(f"the {name} multiplies {where} in {s.dtype}; the contract applies "
                    f"it in {dtype}")
  if s.scale != scale_dtype:
    problems.append(f"the {name} is made in {s.scale}; the contract's scales are "
                    f"{scale_dtype}")
  rounded = [c for c in s.casts if BITS.get(c.split("->")[1], 0) < BITS.get(dtype, 0)]
  if rounded:
    problems.append(f"the {name} is rounded on its way to {where} ({', '.join(rounded)}), "
                    f"below the contract's {dtype}")
  return problems


def check_scales(att: Attention, e: dict) -> List[str]:
  """Each of the contract's scales once, where and in the dtype the rows say; none
  where they have none."""
  problems = []
  for field, where, setting, granularity, along, dtype_row, name in SCALE_SITES:
    found = getattr(att, field)
    wanted = e[setting] == granularity
    matching = [i for i, s in enumerate(found) if wanted and s.along == along]
    problems += [f"a scale multiplies {_the(where)} ({scaling_text(s, _the(where))}) where "
                 f"the contract has none ({e['storage']})"
                 for i, s in enumerate(found) if i not in matching]
    if wanted and not matching:
      problems.append(f"no {name} multiplies {_the(where)}: the contract applies a "
                      f"{e['scale_dtype']} scale varying along the {along} there, in "
                      f"{e[dtype_row]}")
    if len(matching) > 1:
      problems.append(f"the {name} multiplies {_the(where)} {len(matching)} times")
    for i in matching:
      problems += _scale_problems(found[i], name, _the(where), e[dtype_row],
                                  e["scale_dtype"])
  return problems


def _the(where: str) -> str:
  return where if where == "q" else f"the {where}"


def check_cache(att: Attention, e: dict) -> List[str]:
  """Every cache row for one attention of the lowered program ([] where it honours
  them); `e` from `expected_cache`."""
  return check_qk_codes(att, e) + check_wv_codes(att, e) + check_scales(att, e)


def cache_row(att: Attention) -> Dict[str, str]:
  """What the program shows of the cache rows for one attention, as text."""
  def stored(dot, skip: Optional[int] = None) -> str:
    ops = _operands(dot)
    codes = [o[2].casts[0].split("->")[0] if o[2] is not None else o[0]
             for i, o in enumerate(ops) if i != skip and _coded(o)]
    return "/".join(codes) or "no codes"
  scales = lambda pairs: "; ".join(  # noqa: E731
      scaling_text(s, where) for field, where in pairs for s in getattr(att, field)) or "none"
  return {"k": stored(att.qk),
          "k_scale": scales((("logits_scales", "the logits"), ("q_scales", "q"))),
          "v": stored(att.wv, skip=att.probs_operand),
          "v_scale": scales((("probs_scales", "the probabilities"),))}


# ----------------------------------------------------------------------------- compiled
_WIDTH = {"f64": 64, "f32": 32, "bf16": 16, "f16": 16}


def _narrower(t: str, than: str) -> bool:
  return t in _WIDTH and than in _WIDTH and _WIDTH[t] < _WIDTH[than]


def check_compiled_cache(dot: CompiledDot, e: dict) -> List[str]:
  """The cache rows for one compiled attention dot (`attnprec.inspect.compiled.CompiledDot`); the
  other dots and the gradient dots have none ([])."""
  if dot.backward or dot.site not in ("qk", "wv"):
    return []
  qk = dot.site == "qk"
  code = e["k_code_hlo"] if qk else e["v_code_hlo"]
  what, other = ("keys", "q is") if qk else ("values", "the probabilities are")
  ops = [(dot.lhs_type, dot.lhs_from, dot.lhs_codes, dot.lhs_codes_direct, dot.lhs_scaled),
         (dot.rhs_type, dot.rhs_from, dot.rhs_codes, dot.rhs_codes_direct, dot.rhs_scaled)]
  coded = [i for i, o in enumerate(ops) if o[2] or is_code(o[0])]
  codes = lambda o: ", ".join(o[2]) or f"{o[0]} itself"  # noqa: E731
  if code is None:
    return [f"an operand comes from codes ({codes(ops[i])}) but the {what} are not "
            f"stored quantized ({e['storage']}): {other} never quantized"
            for i in coded]
  if not coded:
    return [f"no operand comes from the {what}' {code} codes ({e['storage']})"]
  problems = []
  if len(coded) == 2:
    problems.append(f"both operands come from codes ({codes(ops[0])}; {codes(ops[1])}): "
                    f"{other} quantized; the contract never quantizes "
                    f"{'q' if qk else 'the probabilities'}")
  keys = next((i for i in coded if ops[i][2] and ops[i][2][0].startswith(code + "->")),
              coded[0])
  problems += _compiled_entry(ops[keys], code, e, what, qk)
  if len(coded) == 1:
    problems += _compiled_other(dot, ops[1 - keys], e, qk)
  return problems


def _compiled_entry(operand, code: str, e: dict, what: str, qk: bool) -> List[str]:
  """How the keys' / values' codes enter the compiled dot: from `code`, converted to the
  rows' operand dtype (or to f32, as XLA:CPU computes bf16 dots), with no arithmetic."""
  t, _, casts, direct, _ = operand
  into = e["k_into_qk"] if qk else e["v_into_wv"]
  if not casts:
    return [f"the {what} enter as {t} codes themselves; the contract casts them to {into}"]
  came, went = casts[0].split("->")
  problems = []
  if came != code:
    problems.append(f"the {what} enter from {came} codes; the cache stores {code}")
  if went not in (into, "f32"):
    problems.append(f"the {what}' codes are converted to {went} ({casts[0]}); the "
                    f"contract's operand dtype is {into} (or the backend's f32)")
  if not direct:
    problems.append(f"the {what}' codes reach the dot through arithmetic after "
                    f"{casts[0]}: dequantized before it")
  return problems


def _compiled_other(dot: CompiledDot, operand, e: dict, qk: bool) -> List[str]:
  """The operand that is not the codes (q, or the probabilities): not narrower than its
  row, and multiplied by each of the contract's scales there, neither in a narrower
  dtype than the row's nor by a scale rounded below it on its way."""
  t, up, _, _, scaled = operand
  want = e["q_into_qk"] if qk else e["probs"]
  problems = []
  if _narrower(up or t, want):
    problems.append(f"{'q enters' if qk else 'the probabilities enter'} as {t}"
                    f"{'<-' + up if up else ''}, narrower than the contract's {want}")
  sites = ([("k_scale", "token", dot.scaled_after, "the logits", "per-token key scale",
             "keys"), ("k_scale", "channel", scaled, "q", "per-channel key scale",
                       "head dim")] if qk else
           [("v_scale", "token", scaled, "the probabilities", "value scale", "keys")])
  for setting, granularity, found, where, name, axis in sites:
    if e[setting] != granularity:
      continue
    row = e[f"{setting}_in"]
    along = [(ty, rounded) for ty, on_axis, rounded in found if on_axis]
    if not along:
      problems.append(f"no multiply by the {name} (a broadcast varying along the {axis}) "
                      f"on {where}; the contract applies it there in {row}")
    problems += [f"the {name} multiplies {where} in {ty}, narrower than the contract's "
                 f"{row}" for ty, _ in along if _narrower(ty, row)]
    problems += [f"the {name} is rounded to {r} before it multiplies {where}; the "
                 f"contract applies the {e['scale_dtype']} scale in {row}" for _, r in along
                 if r and _narrower(r, row)]
  return problems

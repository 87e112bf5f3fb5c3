"""The audit of a Pallas kernel's body, read from the jaxpr (`contract.stage_dtypes`).

Lowered for TPU or GPU, a Pallas kernel is one custom call (`tpu_custom_call` holding
Mosaic, or a Triton call) whose inside the lowered-program reader (`attnprec.inspect`)
cannot see. Its body is still plain JAX in the program's jaxpr: the `params['jaxpr']` of
each `pallas_call` equation. `kernel_bodies` finds every one (through jit, cond,
platform_dependent, loops, custom_jvp) and `read_body` lists, from the body and the
loops and calls inside it:

  dots     every dot_general: operand dtypes, preferred_element_type (the accumulation /
           result type), precision (a jax.lax.Precision pair or an algorithm preset), and
           the contract scope it sits in (`contract.QK_SCOPE` / `WV_SCOPE`)
  softmax  the float dtypes of its exp or exp2 (a base-2 softmax: the flash kernel's with
           both flags; the [Tq, Sk] block exp, exp(logits - m), and the
           [Tq, 1] rescaling exp of the statistics), its max (of the logits) and its sum
           (the running sum l)

`check_body` holds them to the table row of the phase's flags: the qk dot's operands c
and its preferred type the logits dtype; the block exp and the max in the softmax dtype;
the wv dot's operands the probs dtype, its result float32 (the documented f32
accumulator, as blockwise); the statistics exp and the sum float32; both dots the phase's
einsum precision; exactly one dot in each scope and none outside. A problem names the
stage. What the backend's compiler (Mosaic, Triton) makes of the body is not in the
jaxpr: that the declared types are what the TPU's MXU or the GPU's tensor cores run is
taken from the lowering, not proven here.
"""
import dataclasses
from typing import List

import jax
import jax.numpy as jnp

from attnprec import contract

_FLOAT = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class BodyDot:
  scope: str              # 'qk', 'wv' or '' (outside both scopes)
  lhs: str                # operand dtype names
  rhs: str
  result: str             # preferred_element_type (its output dtype): the accumulation
  precision: str          # 'DEFAULT', 'HIGHEST', a preset name, or 'None'
  rounded_to: str = ""    # the dtype its result is converted to right after, if any

  @property
  def effective(self) -> str:
    """The dtype of the dot's values as the next stage sees them."""
    return self.rounded_to or self.result


@dataclasses.dataclass
class KernelBody:
  name: str                                   # the pallas_call's name
  dots: List[BodyDot] = dataclasses.field(default_factory=list)
  block_exps: List[str] = dataclasses.field(default_factory=list)   # [Tq, Sk] exps
  stat_exps: List[str] = dataclasses.field(default_factory=list)    # [Tq, 1] exps
  maxes: List[str] = dataclasses.field(default_factory=list)        # float reduce_max
  sums: List[str] = dataclasses.field(default_factory=list)         # float reduce_sum

  def row(self) -> dict:
    return {"kernel": self.name,
            "dots": [dataclasses.asdict(d) for d in self.dots],
            "softmax": {"exp": sorted(set(self.block_exps)), "max": sorted(set(self.maxes)),
                        "stats exp": sorted(set(self.stat_exps)),
                        "sum": sorted(set(self.sums))}}


def _subjaxprs(eqn):
  for param in eqn.params.values():
    for sub in (param if isinstance(param, (tuple, list)) else (param,)):
      if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
        yield sub.jaxpr
      elif hasattr(sub, "eqns"):
        yield sub


def kernel_bodies(jaxpr) -> list:
  """Every `pallas_call` equation of a (closed) jaxpr, at any depth."""
  found = []

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call":
        found.append(eqn)
        continue
      for sub in _subjaxprs(eqn):
        walk(sub)

  walk(getattr(jaxpr, "jaxpr", jaxpr))
  return found


def _precision_text(p) -> str:
  if p is None:
    return "None"
  if isinstance(p, tuple):
    names = {getattr(x, "name", str(x)) for x in p}
    return names.pop() if len(names) == 1 else "/".join(sorted(names))
  return getattr(p, "name", str(p))


def read_body(eqn) -> KernelBody:
  """The dots and softmax dtypes of one `pallas_call` equation's kernel body."""
  name = eqn.params.get("name") or eqn.params.get("name_and_src_info") or "pallas_call"
  body = KernelBody(name=str(name))

  def scope_of(stack: str) -> str:
    parts = stack.split("/")
    return ("qk" if contract.QK_SCOPE in parts else
            "wv" if contract.WV_SCOPE in parts else
            "grad" if contract.GRAD_SCOPE in parts else "")

  def walk(j, stack: str) -> dict:
    """Walks jaxpr j; returns {var: index of the dot it is the result of}."""
    origin = {}
    for e in j.eqns:
      here = "/".join(x for x in (stack, str(e.source_info.name_stack)) if x)
      name = e.primitive.name
      out = e.outvars[0].aval if e.outvars else None
      dtype = jnp.dtype(out.dtype).name if out is not None and hasattr(out, "dtype") else ""
      if name == "dot_general":
        origin[e.outvars[0]] = len(body.dots)
        body.dots.append(BodyDot(
            scope=scope_of(here), lhs=jnp.dtype(e.invars[0].aval.dtype).name,
            rhs=jnp.dtype(e.invars[1].aval.dtype).name,
            result=jnp.dtype(e.params.get("preferred_element_type") or out.dtype).name,
            precision=_precision_text(e.params.get("precision"))))
      elif name == "convert_element_type" and e.invars[0] in origin:
        i = origin[e.invars[0]]
        if jnp.dtype(out.dtype).itemsize < jnp.dtype(body.dots[i].result).itemsize:
          body.dots[i] = dataclasses.replace(body.dots[i], rounded_to=dtype)
        origin[e.outvars[0]] = i
      elif name in ("exp", "exp2") and dtype in _FLOAT:   # exp2: a base-2 softmax
        (body.stat_exps if out.shape and out.shape[-1] == 1 else body.block_exps).append(dtype)
      elif name == "reduce_max" and dtype in _FLOAT:
        body.maxes.append(dtype)
      elif name == "reduce_sum" and dtype in _FLOAT:
        body.sums.append(dtype)
      subs = list(_subjaxprs(e))
      for sub in subs:
        inner = walk(sub, here)
        if len(subs) == 1 and len(sub.outvars) == len(e.outvars):   # a call: jit / pjit
          for outer, v in zip(e.outvars, sub.outvars):
            if not hasattr(v, "val") and v in inner:
              origin[outer] = inner[v]
    return origin

  walk(eqn.params["jaxpr"], "")
  return body


# jax's splash attention (kernel 'splash') runs its dots in no named scope; they are
# attributed by their place in its bodies, as read from its source (jax 0.10.2,
# splash_attention_kernel.py): the forward's first dot is qk (q . k), its second wv
# (probabilities . v); each backward body's first dot recomputes qk, the others are
# gradient dots (dq: dp, dq; dk/dv: dv, dp, dk and, fused, dq). Its dots take no
# precision argument: JAX's default matmul precision (DEFAULT unless
# jax_default_matmul_precision says otherwise). A body of another shape is a problem
# (a splash whose source changed), not attributed by guess.
SPLASH_PREFIX = "splash_mha_"
_SPLASH_DOTS = {"fwd": (2, 2), "dq": (3, 3), "dkv": (4, 5)}


def _splash_attribution(body: KernelBody) -> List[str]:
  """Scopes for a splash body's dots, in place; the problems of a body it cannot read."""
  part = next((p for p in _SPLASH_DOTS if body.name[len(SPLASH_PREFIX):].startswith(p)),
              None)
  n = len(body.dots)
  if part is None or not _SPLASH_DOTS[part][0] <= n <= _SPLASH_DOTS[part][1]:
    lo, hi = _SPLASH_DOTS.get(part, (0, 0))
    return [f"splash body {body.name}: {n} dots, expected {lo}-{hi} (its dots are "
            f"attributed by place, as read from jax 0.10.2's splash source)"]
  default = jax.config.jax_default_matmul_precision
  none_is = "DEFAULT" if default is None else str(default).upper()
  scopes = ["qk", "wv"] if part == "fwd" else ["qk"] + ["grad"] * (n - 1)
  body.dots[:] = [dataclasses.replace(d, scope=s, precision=none_is if d.precision == "None"
                                      else d.precision) for d, s in zip(body.dots, scopes)]
  return []


def check_body(body: KernelBody, compute_dtype, flags: contract.AttentionFlags) -> List[str]:
  """The body against the table row of `flags` (compute dtype c); [] if it matches.
  Each problem names the stage."""
  want = {k: jnp.dtype(v).name for k, v in contract.stage_dtypes(compute_dtype, flags).items()}
  precision = flags.einsum.name
  f32 = "float32"
  problems = []
  splash = body.name.startswith(SPLASH_PREFIX)
  if splash:
    problems = _splash_attribution(body)
    if problems:
      return problems
  if any(d.scope == "grad" for d in body.dots):
    return _check_backward_body(body, compute_dtype, flags)
  for scope in ("qk", "wv"):
    n = sum(d.scope == scope for d in body.dots)
    if n < 1:   # one per branch of a body (the flash kernel: masked and unmasked blocks)
      problems.append(f"{scope} dot: {n} in the {scope} scope, expected at least 1")
  # Under 'highest' both dots take float32 operands (the kernel's one form for Mosaic's
  # contract_precision<fp32>, which refuses 16-bit operands): c values held exactly.
  widened = {(f32, f32)} if precision == "HIGHEST" else set()
  for d in body.dots:
    if d.scope == "qk":
      if (d.lhs, d.rhs) != (want["qkv"], want["qkv"]) and (d.lhs, d.rhs) not in widened:
        problems.append(f"qk operands (stage 'qkv'): {d.lhs} x {d.rhs}, expected "
                        f"{want['qkv']} x {want['qkv']}")
      # c logits may be an f32 accumulation rounded once to c (Mosaic accumulates in 32
      # bits only); f32 logits must be an f32 accumulation, never rounded.
      if d.effective != want["logits"] or d.result not in (want["logits"], f32):
        got = d.result + (f" rounded to {d.rounded_to}" if d.rounded_to else "")
        problems.append(f"qk accumulation (stage 'logits'): preferred_element_type "
                        f"{got}, expected {want['logits']}")
    elif d.scope == "wv":
      if (d.lhs, d.rhs) != (want["probs"], want["probs"]) and (d.lhs, d.rhs) not in widened:
        problems.append(f"wv operands (stage 'probs'): {d.lhs} x {d.rhs}, expected "
                        f"{want['probs']} x {want['probs']}")
      if d.result != f32:
        problems.append(f"wv accumulation: preferred_element_type {d.result}, expected "
                        f"float32 (the kernel's documented f32 accumulator)")
    else:
      problems.append(f"a dot outside the qk / wv scopes: {d.lhs} x {d.rhs} -> {d.result}")
      continue
    if d.precision != precision:
      problems.append(f"{d.scope} precision (einsum_precision): {d.precision}, expected "
                      f"{precision}")
  for what, got, expected in (("exp (stage 'softmax')", body.block_exps, want["softmax"]),
                              ("max (stage 'softmax')", body.maxes, want["softmax"]),
                              ("statistics exp", body.stat_exps, f32),
                              ("sum (the running sum)", body.sums, f32)):
    # splash keeps its statistics 128 lanes wide: their exps are read with the block's
    # (float32 either way: it runs only with both flags)
    if not got and not (splash and what == "statistics exp"):
      problems.append(f"softmax {what}: none found")
    bad = sorted({g for g in got if g != expected})
    if bad:
      problems.append(f"softmax {what}: {'/'.join(bad)}, expected {expected}")
  return problems


def _check_backward_body(body: KernelBody, compute_dtype,
                         flags: contract.AttentionFlags) -> List[str]:
  """A hand-written backward body (dots in `contract.GRAD_SCOPE`) against
  `contract.backward_stage_dtypes`: its one qk dot recomputes the forward's logits (the
  table's operands and logits type), no wv dot; every backward dot takes c operands (P
  and dS rounded to c; float32 under 'highest') and accumulates float32; P's exp is
  float32."""
  want = {k: jnp.dtype(v).name for k, v in
          contract.backward_stage_dtypes(compute_dtype, flags).items()}
  c = jnp.dtype(compute_dtype).name
  precision = flags.einsum.name
  widened = {("float32", "float32")} if precision == "HIGHEST" else set()
  problems = []
  counts = {scope: sum(d.scope == scope for d in body.dots) for scope in ("qk", "wv", "")}
  if counts["qk"] < 1 or counts["qk"] > sum(d.scope == "grad" for d in body.dots):
    problems.append(f"backward qk dot: {counts['qk']} in the qk scope, expected 1 per "
                    f"branch (the logits recomputed)")
  if counts["wv"] or counts[""]:
    problems.append(f"backward body: {counts['wv']} wv and {counts['']} unscoped dots, "
                    f"expected none")
  for d in body.dots:
    if d.scope == "qk":
      if (d.lhs, d.rhs) != (c, c) and (d.lhs, d.rhs) not in widened:
        problems.append(f"backward qk operands (stage 'qkv'): {d.lhs} x {d.rhs}, "
                        f"expected {c} x {c}")
      if d.effective != want["logits"]:
        problems.append(f"backward qk accumulation (stage 'logits'): {d.effective}, "
                        f"expected {want['logits']} (the forward's logits)")
    elif d.scope == "grad":
      if (d.lhs, d.rhs) != (want["grad_operand"],) * 2 and (d.lhs, d.rhs) not in widened:
        problems.append(f"backward dot operands (stage 'grad_operand'): {d.lhs} x {d.rhs}, "
                        f"expected {want['grad_operand']} x {want['grad_operand']}")
      if d.result != want["grad_result"]:
        problems.append(f"backward dot accumulation (stage 'grad_result'): {d.result}, "
                        f"expected {want['grad_result']}")
    if d.scope in ("qk", "grad") and d.precision != precision:
      problems.append(f"backward {d.scope} precision (einsum_precision): {d.precision}, "
                      f"expected {precision}")
  bad = sorted({e for e in body.block_exps if e != want["p"]})
  if not body.block_exps:
    problems.append("backward P: no exp found")
  elif bad:
    problems.append(f"backward P (stage 'p'): exp in {'/'.join(bad)}, expected {want['p']}")
  return problems


def check_program(jaxpr, compute_dtype, flags: contract.AttentionFlags) -> dict:
  """Every Pallas kernel body of a program's jaxpr, checked: {'bodies': rows (each with
  its 'problems'), 'problems', 'ok'}. A program with no Pallas body is a problem (the
  caller asks only for programs that run the 'pallas' kernel)."""
  rows, problems = [], []
  for eqn in kernel_bodies(jaxpr):
    body = read_body(eqn)
    ps = check_body(body, compute_dtype, flags)
    rows.append(dict(body.row(), problems=ps, ok=not ps))
    problems += [f"pallas body: {p}" for p in ps]
  if not rows:
    problems.append("no Pallas kernel body found in the program")
  return {"bodies": rows, "problems": problems, "ok": not problems}


def check_function(fn, *args, compute_dtype, flags: contract.AttentionFlags) -> dict:
  """`check_program` on `jax.make_jaxpr(fn)(*args)`."""
  return check_program(jax.make_jaxpr(fn)(*args), compute_dtype, flags)

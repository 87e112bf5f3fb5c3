"""The audit: the precision contract, proven from the programs that actually run.

For one model and the two phases' `Precision`s (train for the train step, decode for the
prefill and the single-token decode step), `run_audit` lowers the three programs and
reads each with `attnprec.inspect` (the one reader of lowered programs: typed StableHLO
through the MLIR bindings, attentions found by their structure, not by names). Every
attention is checked against the contract table (`attnprec.contract.stage_dtypes`, by
`attnprec.inspect.report`):

  qk dot   operands c x c (or f32 x f32 upcast from c when float32_qk_product), result =
           the table's logits dtype; the softmax (its exp) in the table's softmax dtype,
           and no down-cast of the logits between the two;
  wv dot   probabilities operand = the table's probs dtype, v operand c or probs dtype
           (either operand order: jnp.einsum may swap them),
           result probs dtype or f32 (an f32 accumulator is allowed; the output is cast
           to c after the dot);
  both     the phase's einsum_precision: `precision = [P, P]` for a jax.lax.Precision,
           or the dot algorithm a preset lowers to (read from a plain dot lowered with it);
  layers   every layer has one attention (layer numbers from the Haiku module names in
           the program's locations; the blockwise kernel's loop bodies are attributed
           through the calls and loops they are inlined from); with model.scan_layers
           exactly one, in the scan's body, shown as layers '0-L-1 (scanned)'.

Dense dots (q/k/v/o, MLP, unembedding) are checked the same way against the phase's
compute dtype and `matmul_precision` (the unembedding returns f32). A dot-algorithm preset
may widen a dot's types (JAX upcasts bf16 operands for BF16_BF16_F32_X3 and converts the
f32 result back); the audit then reads the contract's types through those converts and
says so ("f32<-bf16"). The gradient dots of the train step (dq, dk, dp, dv: found as the
dots that read an attention's q, k, v or probabilities) are listed and checked for
precision only: the contract table is about the forward computation.

It also compiles each program and checks what this backend turned every dot into
(`lowered.compile().as_text()`, read by `attnprec.inspect.compiled`, checked by
`attnprec.inspect.report.check_compiled_dot`): an XLA dot, a dot inside a library fusion
(XLA:CPU's `__ynn_fusion`), or a matmul custom-call (oneDNN), with its operand types
(traced back through converts: 'f32<-bf16') and its result type, which is its
accumulation type (and any rounding of the result right after it: '->bf16'). A compiled
attention dot that accumulates below f32, or rounds its f32 logits to 16 bits, where the
contract requires float32; f32 probabilities that enter the wv dot narrowed; a dense dot
that accumulates below f32 (`layers.project`); or an operand narrower than the compute
dtype: a FAIL, like a mismatch in the lowered program. XLA:CPU computes bf16 x bf16 ->
bf16 dots as f32 dots followed by a rounding, which the contract allows where it asks
for bf16.

The KV cache's contract rows (`attnprec.inspect.cache_check`, for the prefill and the
decode step; the train step runs no cache and is held to none) are read back from both
programs too: the dtype the keys' and values' codes are stored in and enter the qk / wv
dot as (converted straight to the rows' operand dtype, no arithmetic between), each
scale's dtype, shape and the axis it varies along, where it multiplies (the logits per
key, q per channel, the probabilities per key) and in which dtype; a quantized q or
quantized probabilities (a convert to or from an 8-bit type on their way to the dot),
a scale in the wrong dtype or place, a missing or extra scale, or codes entering a dot
in another type: a FAIL.

Platforms (`platform`: 'cpu', the default, 'tpu', 'cuda'; the table in
`attnprec.platforms`): the three programs are lowered for that platform on this machine
(`jit(f).trace(...).lower(lowering_platforms=...)`) and every check above runs on them;
for 'tpu' and 'cuda' each attention and dense dot is also read under that platform's
precision semantics (`report.platform_problems`: an f32 x f32 dot at DEFAULT where
'highest' was asked multiplies in TF32 on cuda, in one bf16 pass on tpu: a FAIL naming
the phase, layer and dot), and a precision the platform does not accept is refused
before anything is lowered. What the backend compiles can only be read on that backend:
for a platform other than the one this process runs on the compiled checks are skipped,
and the report says so (`NOT_COMPILED`).

Shapes: B batch, P prompt length, S cache length (P + new tokens).
"""
import collections
import dataclasses
import functools
import json
import os
from typing import Dict, List, Optional

import gin
import jax
import jax.numpy as jnp

from attnprec import (checks, decoding, kernels, keyoffset, layout, platforms, runs, train,
                      xla_env)
from attnprec.inspect import compiled as compiled_program
from attnprec.cache import init_cache
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.inspect import DotSite, cache_check, inspect_lowered, offset_check
from attnprec.inspect import mosaic, pallas_check
from attnprec.kernels import blockwise
from attnprec.kernels import flash as flash_kernel
from attnprec.kernels import pallas as pallas_kernel
from attnprec.kernels import splash as splash_kernel

# The kernels whose attention is a Pallas call: lowered for TPU / GPU one custom call per
# layer (per pass), read from the jaxpr's kernel bodies and, on tpu, the Mosaic bodies.
PALLAS_KERNELS = (pallas_kernel.NAME, flash_kernel.NAME, splash_kernel.NAME)
from attnprec.inspect import report as contract_check
from attnprec.model import init_params
from attnprec.precision import Precision, target_backend

PHASES = ("train", "prefill", "decode")
_PHASE_NAMES = {"train": "train step", "prefill": "prefill", "decode": "decode step"}
short = contract_check.short
algorithm_text = contract_check.algorithm_text
precision_expectation = contract_check.precision_expectation
expected_attention = contract_check.expected_stages


# ----------------------------------------------------------------------------- contract
def check_dense_dot(dot: DotSite, precision: Precision,
                    platform: str = platforms.DEFAULT_PLATFORM) -> List[str]:
  """The dense check of `attnprec.inspect`, plus: the unembedding returns f32 logits (and
  so do the key projection under a key offset and the MLP's gate and up projections where
  the MLP's activation runs in float32 on `platform`: `Precision.mlp_form`), every other
  projection the compute dtype (an f32 result rounded to it right after the dot counts:
  one rounding of a float32 accumulation)."""
  problems = contract_check.check_dense(dot, precision)
  c = short(precision.compute_dtype)
  _, _, result = contract_check.effective(
      dot, widened_ok=contract_check.is_preset(precision.matmul_precision))
  module = _module(dot)
  unembed = module == "unembed"
  # With a key offset the key projection's f32 accumulation stays f32 until the offset
  # is subtracted (the offset row; `offset_check` proves the one rounding after it).
  # With the float32 MLP activation the gate and up projections' f32 accumulations feed the
  # float32 activation (one rounding, of the product, into the down projection).
  wide = (unembed or (module == "attn/k" and precision.key_offset != "none")
          or (module in ("mlp/gate", "mlp/up")
              and precision.mlp_form(platforms.check(platform).backend) == "float32"))
  want = "f32" if wide else c
  # The f32 accumulator rounded once to c right after the dot: `layers.project`'s
  # c x c -> f32 form, and the float32 dot on float32-carried weights.
  rounded_once = dot.result == "f32" and dot.converted_to == want
  if (result != want and dot.result != want and not rounded_once
      and not any("result" in p for p in problems)):
    problems.append(f"{'logits' if unembed else 'dense'} result {result}, expected {want}")
  elif want == "f32" and dot.converted_to not in (None, "f32") and \
      not any("result" in p for p in problems):
    # an f32 result that must stay f32, rounded right after the dot
    problems.append(f"{'logits' if unembed else 'dense'} result rounded to "
                    f"{dot.converted_to} after the dot, expected {want}")
  return problems


# ----------------------------------------------------------------------------- lowering
NOT_COMPILED = ("Not checked without the {platform} backend: the compiled, optimized "
                "program (XLA's own rewrites on {platform}: fusions, the library call or "
                "kernel each dot becomes, the passes or TF32 it picks) exists only where "
                "that backend runs, so the compiled checks are skipped and only the "
                "lowered StableHLO is checked, under {platform}'s precision semantics "
                "(`make device-check` runs them on a GPU).")


local_platform = contract_check.local_platform


def _lower(traced, platform: str):
  """`traced.lower()` for the local platform (as before), else lowered for `platform` on
  this machine."""
  if platform == local_platform():
    return traced.lower()
  return traced.lower(lowering_platforms=(platform,))


def lower_programs(config: ModelConfig, train_precision: Precision,
                   decode_precision: Precision, *, batch: int = 2, prompt_len: int = 8,
                   new_tokens: int = 8, platform: str = platforms.DEFAULT_PLATFORM
                   ) -> Dict[str, tuple]:
  """{phase: (precision, lowered)} for the train step, the prefill and one decode step
  (`trace_programs`, lowered for `platform`)."""
  return {ph: (prec, _lower(traced, platform)) for ph, (prec, traced) in trace_programs(
      config, train_precision, decode_precision, batch=batch, prompt_len=prompt_len,
      new_tokens=new_tokens, platform=platform).items()}


def trace_programs(config: ModelConfig, train_precision: Precision,
                   decode_precision: Precision, *, batch: int = 2, prompt_len: int = 8,
                   new_tokens: int = 8, platform: str = platforms.DEFAULT_PLATFORM
                   ) -> Dict[str, tuple]:
  """{phase: (precision, traced)} for the train step, the prefill and one decode step
  (`jax.jit(f).trace(...)`: its `.jaxpr` holds Pallas kernel bodies; `_lower` lowers it
  for `platform`).

  Parameters, optimizer state and cache are abstract (shapes only): the dots of a program
  depend on the architecture and the precision, not on the weights' values.
  `decoding.prefill` / `decoding.decode_step` are looked up at call time (so a test can
  substitute a broken variant). `platform`: lowered for it (`attnprec.platforms`); a
  precision it cannot honour is a UserError naming it, before anything is lowered.
  """
  platforms.check(platform)
  for p in (train_precision, decode_precision):
    platforms.check_precision(platform, p)
  cache_length = prompt_len + new_tokens
  if batch < 1 or prompt_len < 1 or new_tokens < 1:
    raise UserError(f"audit sizes must be positive: batch={batch}, prompt_len={prompt_len},"
                    f" new_tokens={new_tokens}.")
  if cache_length > config.max_seq_len:
    raise UserError(f"The audit's context (prompt_len {prompt_len} + new_tokens "
                    f"{new_tokens} = {cache_length}) exceeds the model's max_seq_len "
                    f"{config.max_seq_len}; lower audit.prompt_len / audit.new_tokens.")
  keyoffset.check(config, train_precision.key_offset, phase="train")
  train.check_kernel(train_precision)
  # traced for the target's backend: 'auto' settings resolve for it, not this machine
  target = None if platform == local_platform() else platforms.TABLE[platform].backend
  with target_backend(target):
    tokens_BxP = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    lengths_B = jax.ShapeDtypeStruct((batch,), jnp.int32)
    params = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))
    optimizer = train.make_optimizer(total_steps=10)
    state = jax.eval_shape(lambda: train.init_state(config, optimizer, 0))
    update = jax.jit(train.make_update(config, train_precision, optimizer))
    out = {"train": (train_precision, update.trace(
        state, tokens_BxP, jax.ShapeDtypeStruct((batch, prompt_len), jnp.float32)))}
    # The decode programs as `generate` runs them (`decoding.for_serving`: on XLA:CPU with
    # bf16 compute the dense dots run on float32-carried weights). Under kernel 'auto' the
    # short prefill runs dot_product and the decode step blockwise, so both kernels are
    # seen.
    # the weights as `generate` holds them while serving (`decoding.for_serving`:
    # float32-carried on XLA:CPU, stored in the compute dtype on a TPU or GPU)
    served = jax.eval_shape(lambda p: decoding.for_serving(p, decode_precision, target)[0],
                            params)
    decode_precision = decoding.serving_precision(decode_precision, target)
    prefill = jax.jit(functools.partial(decoding.prefill, config=config,
                                        precision=decode_precision,
                                        cache_length=cache_length))
    # the prefill on the weights `generate` gives it (`decoding.prefill_params`)
    prefill_params = jax.eval_shape(lambda p: decoding.prefill_params(
        p, decode_precision, batch * prompt_len), served)
    out["prefill"] = (decode_precision, prefill.trace(prefill_params, tokens_BxP, lengths_B))
    # stored as the decode phase's cache setting says, as `decoding.prefill` stores it
    cache = jax.eval_shape(lambda: init_cache(config, batch, cache_length,
                                              decode_precision.compute_dtype,
                                              decode_precision.cache_storage))
    dstate = decoding.DecodeState(cache, jax.ShapeDtypeStruct((batch, config.vocab_size),
                                                              jnp.float32), lengths_B)
    step = jax.jit(functools.partial(decoding.decode_step, config=config,
                                     precision=decode_precision))
    out["decode"] = (decode_precision, step.trace(served, dstate, lengths_B))
  return out


# ----------------------------------------------------------------------------- audit
def _row(phase: str, site: str, layer, dot: DotSite, problems: List[str], checked: str,
         softmax: Optional[dict] = None, label: str = "") -> dict:
  return {"phase": phase, "site": site, "layer": layer, "backward": dot.backward,
          "module": _module(dot), "label": label, "source": dot.source,
          "lhs": contract_check.typed(dot.lhs, dot.lhs_source),
          "rhs": contract_check.typed(dot.rhs, dot.rhs_source),
          "result": contract_check.result_text(dot),
          "softmax": None if softmax is None else "/".join(
              f"{k} {v}" for k, v in softmax.items()),
          "precision": dot.precision_text,
          "shapes": f"{dot.lhs_shape} x {dot.rhs_shape} -> {dot.result_shape}",
          "checked": checked, "ok": not problems, "problems": problems}


def _module(dot: DotSite) -> str:
  """The model's dense module a dot applies ('attn/q', ..., 'unembed'), from the parameter
  it reads (its argument's pytree path, e.g. "params['decoder/layer_0/attn/q']['w']", or
  a scanned model's stacked one, "params['decoder/layers/layer/attn/q']['w']") and the
  parameter layout table; '' if it reads none. The tied unembedding reads the embedding
  table."""
  for arg in dot.reads:
    path = _param_path(arg)
    if path is None:
      continue
    module, name = path
    if module.startswith(layout.STACKED + "/"):       # a scanned model's stacked params
      module = "decoder/layer_0/" + module[len(layout.STACKED) + 1:]
    parts = module.split("/")[1:]                     # below 'decoder'
    if parts and parts[0].startswith("layer_"):
      parts = parts[1:]
    key = "/".join(parts + [name])
    if key not in layout.BY_KEY:
      continue
    if layout.param(key).dense:
      return layout.param(key).module_suffix
    if key == "embed/embeddings":
      return "unembed"                                # tied: the head is embeddings^T
  return ""


def _param_path(arg: str):
  """"state.params['decoder/layer_0/attn/q']['w']" -> ('decoder/layer_0/attn/q', 'w')."""
  keys = [k.strip("'\"") for k in arg.replace("]", "[").split("[")[1:] if k.strip("'\"")]
  return (keys[-2], keys[-1]) if len(keys) >= 2 else None


def _cache_row(phase: str, att, expected: dict) -> dict:
  """One attention's cache rows as the lowered program shows them, checked."""
  problems = cache_check.check_cache(att, expected)
  return dict(cache_check.cache_row(att), phase=phase, layer=att.layer,
              qk=contract_check.dot_types(att.qk), wv=contract_check.dot_types(att.wv),
              contract=cache_check.contract_text(expected), ok=not problems,
              problems=problems)


def _on_platform(rows: List[dict], dots: List[DotSite], platform: str, knob: str,
                 asked: str) -> None:
  """Adds to each row (one per dot, in order) what the dot's products keep on `platform`
  and the problems of reading it there against `knob` = `asked` (in place)."""
  for r, d in zip(rows, dots, strict=True):
    r["on_platform"] = contract_check.products_text(d, platform)
    r["narrowed"] = contract_check.narrows(d, platform)
    extra = contract_check.platform_problems(d, asked, platform, knob)
    r["problems"] = r["problems"] + extra
    r["ok"] = not r["problems"]


def audit_program(phase: str, lowered, precision: Precision, config: ModelConfig, *,
                  compile: bool = True, key_lengths: tuple = (),
                  platform: str = platforms.DEFAULT_PLATFORM,
                  compiled_text: Optional[str] = None) -> dict:
  """Checks one lowered program; returns a JSON-able dict with rows, problems, compiled.
  For a platform other than 'cpu' every dot is also read under its semantics; the
  compiled checks run only where `platform` is the backend this process runs on, or on
  `compiled_text`: what that backend compiled the same program into (a captured
  fixture: tests/fixtures/tpu)."""
  report = inspect_lowered(lowered, expect=precision, function=phase)
  rows, problems = [], []
  cache = cache_check.expected_cache(precision, cache=phase != "train")
  attentions = report.attentions
  if config.scan_layers:   # one block body in a lax.scan is every layer's attention
    scanned = f"0-{config.num_layers - 1} (scanned)"
    attentions = [dataclasses.replace(a, layer=scanned) for a in attentions]
  cache_rows = [_cache_row(phase, a, cache) for a in attentions]
  for a in attentions:
    checks = contract_check.check_attention(a, precision)
    # The key offset's row: subtracted in f32 before the keys' one rounding.
    offset = [f"key offset: {p}" for p in
              offset_check.offset_problems(a.key_path, precision.key_offset)]
    rows.append(_row(phase, "qk", a.layer, a.qk, checks["qk"] + checks["softmax"] + offset,
                     "types+precision", a.softmax, a.label))
    rows.append(_row(phase, "wv", a.layer, a.wv, checks["wv"], "types+precision",
                     a.softmax, a.label))
    for b in a.backward:
      rows.append(_row(phase, b.role, a.layer, b, contract_check.precision_problems(
          b, precision.einsum_precision), "precision", label=a.label))
  dense_rows = []
  # a library kernel's own dots (interpreted: plain HLO, in its call scope) are the
  # kernel's, read from its bodies (`_check_pallas_bodies`), not projections
  scope = (kernels.get(precision.kernel).call_scope
           if precision.kernel in kernels.NAMES else None)
  dense = [d for d in report.dense if not (scope and f"/{scope}/" in d.name)]
  for d in dense:
    p = check_dense_dot(d, precision, platform) if not d.backward else \
        contract_check.precision_problems(d, precision.matmul_precision)
    dense_rows.append(_row(phase, "dense", None, d, p,
                           "precision" if d.backward else "types+precision"))
  if platform != "cpu":
    att_dots = [x for a in report.attentions for x in [a.qk, a.wv] + list(a.backward)]
    _on_platform(rows, att_dots, platform, "einsum_precision", precision.einsum_precision)
    _on_platform(dense_rows, report.dense, platform, "matmul_precision",
                 precision.matmul_precision)
  layers = sorted(a.layer for a in attentions if isinstance(a.layer, int))
  attributed = len(layers) == len(attentions)
  # Lowered for TPU / GPU (from this machine or on it), the 'pallas' kernel is one custom
  # call per layer whose body the dot search cannot open: its attentions are checked
  # from the jaxpr and the Mosaic body instead (`_check_pallas_bodies`, which also
  # counts them). Interpreted (lowered for cpu) its body is plain HLO, read as any.
  # The flash kernel's body has two branches (blocks with and without the mask), so its
  # interpreted HLO holds two dot pairs per layer: it is counted from its bodies too.
  # jax's splash kernel likewise (its interpreted HLO has no attnprec op names).
  opaque = precision.kernel in (flash_kernel.NAME, splash_kernel.NAME) or (
      precision.kernel in PALLAS_KERNELS and platform != "cpu" and not attentions)
  if opaque:
    attributed = False
  elif config.scan_layers:
    attributed = len(attentions) == 1
    if not attributed:
      problems.append(f"{phase}: {len(attentions)} attentions found, expected 1 "
                      f"(model.scan_layers: one scanned body for layers {scanned})")
  elif attributed:
    for i in range(config.num_layers):
      if layers.count(i) != 1:
        problems.append(f"{phase}: layer {i} has {layers.count(i)} attentions, expected 1")
  elif not opaque and len(report.attentions) != config.num_layers:
    problems.append(f"{phase}: {len(report.attentions)} attentions found, expected "
                    f"{config.num_layers} (one per layer)")
  problems += [f"{phase} layer {r['layer']} {r['site']}: {q}" for r in rows
               for q in r["problems"]]
  problems += [f"{phase} dense {r['module'] or r['label'] or '?'}: {q}" for r in dense_rows
               for q in r["problems"]]
  problems += [f"{phase} layer {r['layer']} cache: {q}" for r in cache_rows
               for q in r["problems"]]
  out = {"phase": phase, "precision": dataclasses.asdict(precision),
         "expected": expected_attention(precision),
         "einsum_precision": precision_expectation(precision.einsum_precision),
         "matmul_precision": precision_expectation(precision.matmul_precision),
         "layers_attributed": attributed, "attention": rows, "dense": dense_rows,
         "cache_expected": cache, "cache": cache_rows, "problems": problems,
         "ok": not problems}
  if compile and platform != local_platform() and compiled_text is None:
    out["compiled_skipped"] = NOT_COMPILED.format(platform=platform)
  elif compile:
    # Forward programs: attention dots whose op_name XLA dropped are told apart by
    # structure (the head dim vs the key lengths they contract). The train step holds
    # gradient dots of the same shapes, so there they are only checked for accumulation.
    structure = {} if phase == "train" else dict(head_dim=config.head_dim,
                                                 key_lengths=key_lengths)
    text = (compiled_text if compiled_text is not None
            else contract_check.compiled_text(lowered))
    # every forward attention dot of the lowered program must be read back compiled
    # (a kernel in a custom call is read from its body instead: `_check_pallas_bodies`)
    expected = None if opaque else 2 * len(report.attentions)
    out["compiled"] = summarize_compiled(text, precision, cache=cache, platform=platform,
                                         expected_attention_dots=expected, **structure)
    problems += [f"{phase} {p}" for p in out["compiled"]["problems"]]
    out["problems"], out["ok"] = problems, not problems
  return out


def summarize_compiled(text: str, precision: Optional[Precision] = None, *,
                       cache: Optional[dict] = None, head_dim: Optional[int] = None,
                       key_lengths: tuple = (), platform: str = platforms.DEFAULT_PLATFORM,
                       expected_attention_dots: Optional[int] = None) -> dict:
  """The compiled program's dots grouped by (site, what the backend made of it, types,
  the platform's rewrites, verdict), its converts, and (with a `precision`) the problems
  of the compiled check read under `platform`'s semantics (`report.check_compiled_dot`),
  the cache rows' (`cache`, from `cache_check.expected_cache`) included.

  expected_attention_dots: the forward qk and wv dots the lowered program holds; reading
  fewer in the compiled program is a problem (a reader that finds nothing never passes)."""
  s = compiled_program.compiled_summary(text, head_dim, key_lengths)
  checked = contract_check.check_compiled(text, precision, head_dim=head_dim,
                                          key_lengths=key_lengths,
                                          platform=platform)["dots"] \
      if precision else [(d, []) for d in s["dots"]]
  if cache is not None:
    checked = [(d, ps + cache_check.check_compiled_cache(d, cache)) for d, ps in checked]

  def where(d):
    site = d.site + (" (grad)" if d.backward else "")
    if d.site == "other" and not d.name and d.batched:
      return "batched, op_name dropped: accumulation checked"
    if d.inferred_site and compiled_program.site(d.name) == "other":
      return f"{site} (op_name dropped; by shape)"
    return site

  rows = collections.OrderedDict()
  for d, ps in checked:
    rewrites = "; ".join(contract_check.platform_rewrites(d, precision, platform)) \
        if precision else ""
    precision_text = d.precision if d.precision != "default" else ""
    key = (where(d), d.via, d.described + (f", {precision_text}" if precision_text else ""),
           "MISMATCH" if ps else "listed" if d.backward else "ok", rewrites)
    row = rows.setdefault(key, {"site": key[0], "via": key[1], "types": key[2],
                                "verdict": key[3], "rewrite": key[4], "count": 0,
                                "layers": set(), "problems": []})
    row["count"] += 1
    row["layers"].add(d.layer)
    row["problems"] += [p for p in ps if p not in row["problems"]]
  table = [dict(r, layers=_layers(r["layers"])) for r in rows.values()]
  dots = collections.Counter(f"{where(d)}: {d.types}" for d in s["dots"])
  problems = [] if precision is None else [
      f"compiled {d.site} dot{'' if d.layer is None else f' layer {d.layer}'} "
      f"[{d.via}: {d.described}]: {p}" for d, ps in checked for p in ps]
  # Read: the forward qk / wv dots attributed by op_name or shape, and the batched dots
  # whose op_name XLA dropped (XLA:CPU's train step), which are checked for their
  # accumulation only and said to be so.
  attributed = sum(1 for d in s["dots"] if d.site in ("qk", "wv") and not d.backward)
  unnamed = sum(1 for d in s["dots"] if d.site == "other" and not d.name and d.batched)
  read = attributed + unnamed
  if expected_attention_dots is not None and read < expected_attention_dots:
    problems.append(
        f"compiled: {read} attention dots read where the lowered program has "
        f"{expected_attention_dots}: the reader does not understand what this backend "
        f"compiled, so it is unread, not checked")
  return {"dots": dict(sorted(dots.items())), "rows": table, "converts": s["converts"],
          "fusions": s["fusions"], "attention_dots_read": read,
          "attention_dots_attributed": attributed,
          "attention_dots_lowered": expected_attention_dots, "problems": problems,
          "ok": not problems}


def _compiled_phases(compile) -> tuple:
  """`run_audit`'s `compile` as the phases whose compiled program is read."""
  if isinstance(compile, bool):
    return PHASES if compile else ()
  phases = tuple(compile) if isinstance(compile, (list, tuple)) else None
  if phases is None or not set(phases) <= set(PHASES):
    raise UserError(f"audit compile={compile!r}: use True, False or a list of the phases "
                    f"to compile, from {list(PHASES)}.")
  return phases


def run_audit(config: ModelConfig, train_precision: Precision, decode_precision: Precision,
              *, batch: int = 2, prompt_len: int = 8, new_tokens: int = 8,
              compile=True, model_source: str = "model.* (gin)",
              platform: str = platforms.DEFAULT_PLATFORM,
              compiled_texts: Optional[Dict[str, str]] = None) -> dict:
  """Lowers (and compiles) the three programs and checks each (`audit_program`): a
  JSON-able dict whose 'ok' is the verdict. The train step runs no KV cache, so the
  train precision's cache setting applies to no program (`train` refuses one); the
  prefill and decode step are held to the decode precision's cache rows. `platform`:
  lowered for it and read under its semantics (module docstring). `compile`: True (every
  program), False, or the phases whose compiled program is read (the others are checked
  as lowered only)."""
  compiled_phases = _compiled_phases(compile)
  traced = trace_programs(config, train_precision, decode_precision, batch=batch,
                          prompt_len=prompt_len, new_tokens=new_tokens, platform=platform)
  programs = {ph: (prec, _lower(t, platform)) for ph, (prec, t) in traced.items()}
  # Every key length an attention dot of the programs can contract over: the prompt, the
  # cache, the blockwise kernel's key blocks (shorter where the cache is).
  cache_length = prompt_len + new_tokens
  blocks = decode_precision.block_sizes
  lengths = {prompt_len, cache_length}
  lengths |= {min(blocks.kv_block, n) for n in lengths}
  lengths.add(blockwise.decode_block_length(cache_length, blocks))
  # What the backend compiled each program into: given (a captured fixture), compiled
  # here where `platform` is this machine's backend, else not checked (NOT_COMPILED).
  texts = dict(compiled_texts or {})
  if platform == local_platform():
    for ph, (_, lowered) in programs.items():
      if ph in compiled_phases and ph not in texts:
        texts[ph] = contract_check.compiled_text(lowered)
  phases = {ph: audit_program(ph, lowered, prec, config, compile=ph in compiled_phases,
                              key_lengths=tuple(sorted(lengths)), platform=platform,
                              compiled_text=texts.get(ph))
            for ph, (prec, lowered) in programs.items()}
  for ph, (prec, t) in traced.items():
    if prec.kernel in PALLAS_KERNELS:
      calls = 1 if config.scan_layers else config.num_layers
      _check_pallas_bodies(phases[ph], t.jaxpr, prec, calls=calls)
      # The train phase's backward kernels (flash: dq, dk/dv) are checked from their
      # jaxpr bodies (`pallas_check`: the backward row of the contract); the Mosaic reader
      # knows the forward body's shape only, so it reads the forward phases.
      # (splash's Mosaic body is jax's, of another shape: read from its jaxpr only)
      if platform == "tpu" and ph != "train" and prec.kernel != splash_kernel.NAME:
        _check_mosaic_bodies(phases[ph], texts.get(ph), programs[ph][1], prec, calls=calls)
  problems = [p for ph in phases.values() for p in ph["problems"]]
  return {"model": model_source, "config": runs.config_dict(config),
          "sizes": {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens},
          "platform": platform, "backend": jax.default_backend(),
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "xla": xla_env.describe(), "phases": phases, "problems": problems,
          "ok": not problems}


def _check_pallas_bodies(phase: dict, jaxpr, precision: Precision, calls: int):
  """A 'pallas' phase: its kernel bodies, read from the jaxpr (the lowered program holds
  them as custom calls the dot search cannot open on TPU / GPU), checked against the
  table (`attnprec.inspect.pallas_check`); their problems join the phase's. `calls`: the
  kernel calls the program must make (one per layer, or one scanned); each call holds a
  body per platform branch."""
  checked = pallas_check.check_program(jaxpr, precision.compute_dtype, precision.attention)
  if checked["bodies"] and len(checked["bodies"]) < calls:
    checked["problems"] = checked["problems"] + [
        f"{len(checked['bodies'])} Pallas kernel bodies, expected at least {calls} (one "
        f"call per layer)"]
  phase["pallas"] = checked
  phase["problems"] = phase["problems"] + [f"{phase['phase']} {p}"
                                           for p in checked["problems"]]
  phase["ok"] = not phase["problems"]


def _check_mosaic_bodies(phase: dict, compiled_text: Optional[str], lowered,
                         precision: Precision, calls: int):
  """A 'pallas' phase on tpu: every tpu_custom_call's Mosaic body, read back from the
  compiled program (or, where it was not compiled here, from the program lowered for
  tpu) by `attnprec.inspect.mosaic` and checked against the table. In the compiled
  program there must be one call per layer (or one scanned); a call whose body cannot be
  opened, or holds no attention, is unread: a problem, never a pass."""
  source = "compiled" if compiled_text is not None else "lowered"
  read = mosaic.read_calls(compiled_text if compiled_text is not None else lowered.as_text())
  rows, problems = [], []
  for call, body in read:
    if isinstance(body, Exception):
      ps = [f"Mosaic body of {call.name or call.kernel or 'a tpu_custom_call'} could not "
            f"be opened ({type(body).__name__}: {str(body)[:200]}): unread, not checked"]
      rows.append({"call": call.name, "kernel": call.kernel, "summary": None,
                   "problems": ps, "ok": False})
    else:
      ps = mosaic.check_body(body, precision)
      rows.append({"call": call.name, "kernel": body.kernel, "layer": _layer_of(call.name),
                   "summary": mosaic.summary(body), "problems": ps, "ok": not ps})
    problems += ps
  if source == "compiled" and len(read) != calls:
    problems.append(f"{len(read)} Mosaic kernel calls in the compiled program, expected "
                    f"{calls} (one per layer)")
  elif not read:
    problems.append("no Mosaic kernel call in the program lowered for tpu: the 'pallas' "
                    "attention is unread")
  phase["mosaic"] = {"source": source, "calls": rows, "problems": problems}
  phase["problems"] = phase["problems"] + [f"{phase['phase']} {p}" for p in problems]
  phase["ok"] = not phase["problems"]


def _layer_of(name: str) -> Optional[int]:
  m = compiled_program.LAYER.search(name or "")
  return int(m.group(1)) if m else None


def mosaic_table(result: dict) -> str:
  """Markdown: the Mosaic bodies (tpu) per phase: the QK result, the softmax dtypes, the
  probabilities into the PV matmul and what its products keep on tpu, the verdict."""
  lines = ["| phase | read from | calls | layers | QK matmul | exp / max / sum | PV matmul "
           "| probabilities into PV | PV products on tpu | verdict |",
           "|---|---|---:|---|---|---|---|---|---|---|"]
  for ph in PHASES:
    m = result["phases"][ph].get("mosaic")
    if not m:
      continue
    groups = collections.OrderedDict()
    for c in m["calls"]:
      s = c["summary"] or {}
      key = ("; ".join(s.get("qk", [])) or "unread",
             " / ".join("/".join(s.get(k, [])) or "-" for k in ("exp", "max", "sum")),
             "; ".join(s.get("pv", [])) or "-", "; ".join(s.get("probabilities", [])) or "-",
             "; ".join(s.get("pv_products", [])) or "-", "ok" if c["ok"] else "MISMATCH")
      groups.setdefault(key, []).append(c)
    for key, cs in groups.items():
      lines.append(f"| {ph} | {m['source']} | {len(cs)} | "
                   f"{_layers(c.get('layer') for c in cs)} | " + " | ".join(key) + " |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- rendering
def _layers(layers) -> str:
  known = sorted({x for x in layers if x is not None}, key=str)
  if not known:
    return "?"
  if any(isinstance(x, str) for x in known):        # '0-L-1 (scanned)'
    return ",".join(map(str, known))
  known = sorted(known)
  if known == list(range(known[0], known[-1] + 1)) and len(known) > 2:
    return f"{known[0]}-{known[-1]}"
  return ",".join(map(str, known))


def _grouped(rows, keys):
  groups = collections.OrderedDict()
  for r in rows:
    groups.setdefault(tuple(r[k] for k in keys), []).append(r)
  return groups


def attention_table(result: dict) -> str:
  """Markdown: one line per (phase, dot, types, precision, verdict), layers grouped."""
  lines = ["| phase | dot | layers | lhs | rhs | result | softmax | precision | contract "
           "| checked | verdict |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for ph in PHASES:
    a = result["phases"][ph]
    e = a["expected"]
    for (site, bwd, lhs, rhs, res, sm, prec, checked, ok), rows in _grouped(
        a["attention"], ("site", "backward", "lhs", "rhs", "result", "softmax",
                         "precision", "checked", "ok")).items():
      P, c = e["probs"], e["qkv"]
      contract = (f"{c} x {c} -> {e['logits']}, softmax {e['softmax']}" if site == "qk"
                  else f"probs {P}, v {c if c == P else c + '/' + P} -> "
                  f"{P if P == 'f32' else P + '/f32'}")
      contract += f", {a['einsum_precision']}"
      offset = a["precision"].get("key_offset", "none")
      if site == "qk" and offset != "none":
        contract += f"; keys - c ({offset}) in f32, then one rounding"
      if bwd or checked == "precision":
        contract = f"precision {a['einsum_precision']}"
      lines.append(f"| {ph} | {site}{' (grad)' if bwd else ''} | "
                   f"{_layers(r['layer'] for r in rows)} | {lhs} | {rhs} | {res} | "
                   f"{sm if site == 'qk' and sm else ''} | "
                   f"{_short_precision(prec)} | {contract} | {checked} | "
                   f"{'ok' if ok else 'MISMATCH'} |")
  return "\n".join(lines)


def dense_table(result: dict) -> str:
  lines = ["| phase | dots | modules | lhs | rhs | result | precision | verdict |",
           "|---|---:|---|---|---|---|---|---|"]
  for ph in PHASES:
    a = result["phases"][ph]
    for (bwd, lhs, rhs, res, prec, ok), rows in _grouped(
        a["dense"], ("backward", "lhs", "rhs", "result", "precision", "ok")).items():
      modules = sorted({r["module"] for r in rows})
      lines.append(f"| {ph}{' (grad)' if bwd else ''} | {len(rows)} | {', '.join(modules)} "
                   f"| {lhs} | {rhs} | {res} | {_short_precision(prec)} | "
                   f"{'ok' if ok else 'MISMATCH'} |")
  return "\n".join(lines)


def platform_table(result: dict) -> str:
  """Markdown, for a platform other than 'cpu': every attention and dense dot as lowered
  for it, what its products keep there (`attnprec.platforms`) and the verdict."""
  plat = result["platform"]
  lines = [f"| phase | dot | layers / modules | lhs x rhs | precision | products on {plat} "
           f"| verdict |", "|---|---|---|---|---|---|---|"]
  for ph in PHASES:
    a = result["phases"][ph]
    for (site, bwd, lhs, rhs, prec, on, ok), rows in _grouped(
        a["attention"] + a["dense"], ("site", "backward", "lhs", "rhs", "precision",
                                      "on_platform", "ok")).items():
      where = _layers(r["layer"] for r in rows) if site != "dense" else \
          ", ".join(sorted({r["module"] or "?" for r in rows}))
      lines.append(f"| {ph} | {site}{' (grad)' if bwd else ''} | {where} | {lhs} x {rhs} "
                   f"| {_short_precision(prec)} | {on} | {'ok' if ok else 'MISMATCH'} |")
  return "\n".join(lines)


def not_compiled(result: dict) -> Optional[str]:
  """The sentence saying the compiled checks were skipped (another platform), or None."""
  return next((result["phases"][ph]["compiled_skipped"] for ph in PHASES
               if "compiled_skipped" in result["phases"][ph]), None)


def cache_table(result: dict) -> str:
  """Markdown: the KV cache's rows per (phase, what the program shows, verdict), layers
  grouped: the codes the keys / values are stored as and enter their dot from, each
  scale (dtype, shape, the axis it varies along, what it multiplies and in which dtype),
  the two attention dots' operand types, and the contract's rows."""
  lines = ["| phase | layers | k stored as | key scale | qk dot | v stored as | value scale "
           "| wv dot | contract | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
  keys = ("k", "k_scale", "qk", "v", "v_scale", "wv", "contract", "ok")
  for ph in PHASES:
    for (k, ks, qk, v, vs, wv, contract, ok), rows in _grouped(
        result["phases"][ph].get("cache", []), keys).items():
      lines.append(f"| {ph} | {_layers(r['layer'] for r in rows)} | {k} | {ks} | {qk} | "
                   f"{v} | {vs} | {wv} | {contract} | {'ok' if ok else 'MISMATCH'} |")
  return "\n".join(lines)


def pallas_table(result: dict) -> str:
  """Markdown: one line per (phase, Pallas kernel body): its dots and softmax dtypes."""
  rows = collections.Counter()
  for ph in PHASES:
    for b in result["phases"][ph].get("pallas", {}).get("bodies", []):
      dots = {d["scope"]: f"{d['lhs']} x {d['rhs']} -> {d['result']}"
              + (f"->{d['rounded_to']}" if d["rounded_to"] else "") + f", {d['precision']}"
              for d in b["dots"]}
      sm = b["softmax"]
      rows[(ph, dots.get("qk", "-"), dots.get("wv", "-"),
            f"{'/'.join(sm['exp'])} / {'/'.join(sm['max'])}",
            f"{'/'.join(sm['stats exp'])} / {'/'.join(sm['sum'])}",
            "ok" if b["ok"] else "MISMATCH")] += 1
  # One body per layer and per platform branch (interpreted, Mosaic, Triton).
  return "\n".join(["| phase | bodies | qk dot | wv dot | exp / max | stats exp / sum | "
                    "verdict |", "|---|---:|---|---|---|---|---|"] +
                   [f"| {r[0]} | {n} | " + " | ".join(r[1:]) + " |"
                    for r, n in rows.items()])


def quantized_cache(result: dict) -> bool:
  """Whether the prefill and decode step were audited over a quantized KV cache."""
  return result["phases"]["decode"].get("cache_expected", {}).get("quantized", False)


def compiled_table(result: dict) -> str:
  """Markdown: one line per (phase, site, what the backend made of the dot, types)."""
  rewrites = any(r.get("rewrite") for ph in PHASES
                 for r in result["phases"][ph].get("compiled", {}).get("rows", []))
  lines = ["| phase | dot | layers | count | compiled as | lhs x rhs -> result | "
           + ("the platform's rewrite | " if rewrites else "") + "verdict |",
           "|---|---|---|---:|---|---|---|" + ("---|" if rewrites else "")]
  for ph in PHASES:
    c = result["phases"][ph].get("compiled")
    if c is None:
      continue
    for r in c["rows"]:
      lines.append(f"| {ph} | {r['site']} | {r['layers']} | {r['count']} | {r['via']} | "
                   f"{r['types']} | " + (f"{r.get('rewrite') or '-'} | " if rewrites else "")
                   + f"{r['verdict']} |")
  def count(c):
    unnamed = c["attention_dots_read"] - c.get("attention_dots_attributed",
                                               c["attention_dots_read"])
    return (f"{c['attention_dots_read'] - unnamed}"
            + (f" (+{unnamed} batched dots whose op_name XLA dropped, accumulation "
               f"checked)" if unnamed else "")
            + f" for the lowered program's {c['attention_dots_lowered']}")
  counts = [f"{ph}: {count(c)}" for ph in PHASES
            for c in [result["phases"][ph].get("compiled")]
            if c and c.get("attention_dots_lowered") is not None]
  if counts:
    lines += ["", "Forward attention dots read back compiled: " + "; ".join(counts) + "."]
  return "\n".join(lines)


_short_precision = contract_check.short_precision


def verdict(result: dict) -> str:
  if result["ok"]:
    n = sum(len(result["phases"][ph]["attention"]) for ph in PHASES)
    compiled = sum(r["count"] for ph in PHASES
                   for r in result["phases"][ph].get("compiled", {}).get("rows", []))
    cache = (f", and their {quantized_cache_text(result)} cache's codes and scales "
             f"match its rows" if quantized_cache(result) else "")
    plat = result.get("platform", "cpu")
    on = f" on {plat} (lowered for it, read under its precision semantics)" \
        if plat != "cpu" else ""
    bodies = sum(len(result["phases"][ph].get("pallas", {}).get("bodies", []))
                 for ph in PHASES)
    if bodies:
      cache += f", and so do the {bodies} Pallas kernel bodies read from the jaxpr"
    calls = sum(len(result["phases"][ph].get("mosaic", {}).get("calls", []))
                for ph in PHASES)
    if calls:
      cache += f" and the {calls} Mosaic bodies of its tpu_custom_calls"
    read = [ph for ph in PHASES if "compiled" in result["phases"][ph]]
    into = ("them into" if len(read) == len(PHASES) else
            f"the {' and '.join(_PHASE_NAMES[ph] for ph in read)} into (the rest was read "
            f"as lowered only)")
    return (f"PASS: all {n} attention dots of the train step, prefill and decode step match "
            f"the contract for their phase's flags{on}{cache}"
            + (f"; so do the {compiled} dots this backend compiled {into}."
               if compiled else ".") + narrowed_text(result))
  shown = "; ".join(result["problems"][:6])
  more = f" (+{len(result['problems']) - 6} more)" if len(result["problems"]) > 6 else ""
  return f"FAIL: {len(result['problems'])} mismatch(es): {shown}{more}"


def narrowed_text(result: dict) -> str:
  """' On tpu, N of the M dots ...' where the platform's products keep fewer bits than the
  operands hold (f32 or f16 values at 'default': one bf16 pass on tpu, TF32 on cuda), as
  the precision asked for allows there; '' where none does."""
  rows = [r for ph in PHASES for r in result["phases"][ph]["attention"] +
          result["phases"][ph]["dense"] if "narrowed" in r]
  narrowed = [r for r in rows if r["narrowed"]]
  if not narrowed:
    return ""
  kinds = ", ".join(sorted({r["on_platform"] for r in narrowed}))
  return (f" On {result['platform']}, {len(narrowed)} of the {len(rows)} dots read multiply "
          f"in fewer bits than their operands hold ({kinds}): what the precision asked for "
          f"allows there (the table 'On {result['platform']}'); 'high' or 'highest' keeps more.")


def quantized_cache_text(result: dict) -> str:
  """'kv_cache=k:int8/token,v:int8/token' of the prefill / decode step."""
  return result["phases"]["decode"]["cache_expected"]["storage"]


def to_markdown(result: dict) -> str:
  ph = result["phases"]
  head = [f"# Precision audit: {result['model']}", "",
          f"Backend: {result['backend']}; XLA_FLAGS: `{result['xla_flags'] or '(none)'}`; "
          f"sizes: {result['sizes']}.", "", f"{result.get('xla', '')}.", "",
          f"- train step: `{_describe(ph['train']['precision'])}`",
          f"- prefill and decode step: `{_describe(ph['decode']['precision'])}`", "",
          f"**{verdict(result)}**", "",
          "## Attention dots (lowered StableHLO, checked against the contract table)", "",
          "`f32<-bf16`: an f32 operand upcast from bf16 right before the dot; "
          "`f32->bf16`: an f32 result converted to bf16 right after it. "
          "`(grad)`: dots of the gradient computation (checked for precision only). "
          "The attentions are found by their structure (`attnprec.inspect`): a dot whose "
          "result flows into a softmax whose result flows into a second dot; `(grad)` rows "
          "are the gradient dots that read their q, k, v or probabilities.", "",
          attention_table(result), "", "## Dense dots", "", dense_table(result), "",
          "## KV cache (lowered StableHLO, checked against the contract's cache rows)", "",
          "What each attention reads from the cache: the type its keys' and values' codes "
          "are stored as (`no codes`: an unquantized cache), each scale (its dtype and "
          "shape where it is made, the axis it varies along: per key, per channel, and "
          "what it multiplies, in which dtype), and the operand types of the qk and wv "
          "dots (`bf16<-i8`: codes converted straight to bf16). The train step runs no "
          "KV cache: it is held to no codes and no scales"
          + (" (its precision's cache setting applies to no program here)."
             if ph["train"]["precision"]["kv_cache_k_dtype"] != "compute"
             or ph["train"]["precision"]["kv_cache_v_dtype"] != "compute" else "."), "",
          cache_table(result), ""]
  if result.get("platform", "cpu") != "cpu":
    head += [f"## On {result['platform']} (`attnprec.platforms`)", "",
             f"The programs were lowered for {result['platform']} on this machine. What "
             f"each dot's products keep there: `exact`: the arithmetic holds both "
             f"operands' values (f32 operands upcast from bf16 fit one bf16 pass and "
             f"TF32); otherwise the arithmetic the dot's precision selects on "
             f"{result['platform']}. Fewer bits than the phase's einsum_precision / "
             f"matmul_precision promises there: MISMATCH.", "", platform_table(result), ""]
  skipped = not_compiled(result)
  if skipped:
    head += ["## The compiled program", "", skipped, ""]
  # The backend's own programs, each section where a phase read one: (key in the phase,
  # heading, what the table says, the table).
  sections = (
      ("pallas", "Pallas kernel bodies (jaxpr, checked against the contract table)",
       "Lowered for TPU or GPU a Pallas kernel is one custom call; its body is read "
       "from the program's jaxpr (`attnprec.inspect.pallas_check`). What Mosaic or "
       "Triton compiles it into is not visible here.",
       pallas_table),
      ("mosaic", "Mosaic kernel bodies (tpu_custom_call, read back and checked)",
       "Each Pallas call's Mosaic module, opened from the call's backend_config "
       "(`attnprec.inspect.mosaic`): the QK matmul's operand and result types "
       "(`->bf16`: an f32 result truncated right after it), the softmax's exp, max "
       "and sum dtypes, the probabilities into the PV matmul, and what its products "
       "keep on tpu (f32 operands at DEFAULT: one bf16 pass).",
       mosaic_table),
      ("compiled", "What this backend compiled (`lowered.compile().as_text()`), checked",
       "Every dot of the optimized HLO, as the backend made it (an XLA dot, a dot "
       "inside a library fusion, a matmul custom-call). `f32<-bf16`: an operand "
       "converted up from bf16; `-> f32`: the dot's result, i.e. accumulation, type; "
       "`->bf16`: its result rounded right after. A qk dot that accumulates below "
       "f32 or rounds its logits where the contract asks for f32 logits, f32 "
       "probabilities narrowed into the wv dot, a dense dot accumulating below f32, "
       "or an operand narrower than the compute dtype: MISMATCH. `precision` changes "
       "no numbers on CPU, so it is checked in the lowered program above. A "
       "quantized KV cache: `bf16<-s8`, an operand converted from s8 codes; "
       "`(x f32)`, an operand (q, the probabilities) or a result (the logits) "
       "multiplied by a cache scale, in f32. Codes of another type or converted "
       "to another than the rows' operand dtype (or f32), another operand from "
       "codes (a quantized q or probabilities), q or the probabilities narrower "
       "than their rows, a scale multiply missing or narrower than its row: "
       "MISMATCH.",
       compiled_table))
  for key, title, text, table in sections:
    if any(key in ph[p] for p in PHASES):
      head += [f"## {title}", "", text, "", table(result), ""]
  return "\n".join(head)


def _describe(p: dict) -> str:
  return " ".join(f"{k}={v}" for k, v in p.items())


# ----------------------------------------------------------------------------- job
def model_config_for(model: Optional[str]) -> tuple:
  """(ModelConfig, description) for audit.model: None -> the gin `model.*` bindings; a
  recall checkpoint name or train run directory; a real checkpoint (shipped name, HF
  directory, .gguf)."""
  if model is None:
    # The gin-configured ModelConfig; a missing required value raises TypeError, which
    # the runner's call of this configurable reports as a user error.
    from attnprec.config import model_config
    return model_config(), "architecture from model.* (gin)"
  from attnprec.study import models
  # model.* the user set (the runner's own default file includes a model's: not theirs)
  set_here = sorted(checks.bound_args("model", by_user=True))
  if set_here:
    raise UserError(f"audit.model = {model!r} takes the architecture from that model, so "
                    f"the model.* bindings ({', '.join('model.' + a for a in set_here)}) "
                    f"would be ignored. Drop them, or drop audit.model to audit the "
                    f"architecture they describe.")
  m = models.load_model(model, params=False)
  return m.config, m.description


@gin.configurable("audit", denylist=["train_precision", "decode_precision", "run_dir",
                                     "platform"])
@checks.validated("audit", model=checks.optional(checks.string), batch=checks.at_least(1),
                  prompt_len=checks.at_least(1), new_tokens=checks.at_least(1))
def audit_job(*, train_precision: Precision, decode_precision: Precision, run_dir: str,
              model: Optional[str] = None, batch: int = 2, prompt_len: int = 8,
              new_tokens: int = 8, compile: bool = True,
              platform: str = platforms.DEFAULT_PLATFORM) -> dict:
  """`make audit`: writes audit.json and audit.md into run_dir; returns the result
  (result['ok'] is the verdict). `platform` (the runner's --platform): lowered for it."""
  platforms.check(platform)
  for p in (train_precision, decode_precision):
    platforms.check_precision(platform, p)
  runs.ensure_dir(run_dir)
  config, source = model_config_for(model)
  result = run_audit(config, train_precision, decode_precision, batch=batch,
                     prompt_len=prompt_len, new_tokens=new_tokens, compile=compile,
                     model_source=source, platform=platform)
  markdown = to_markdown(result)
  runs.atomic_write(os.path.join(run_dir, "audit.json"),
                    json.dumps(dict(result, provenance=runs.provenance()), indent=1,
                               default=str) + "\n")
  runs.atomic_write(os.path.join(run_dir, "audit.md"), markdown)
  print(f"model: {source}")
  backend = platforms.TABLE[platform].backend     # 'auto' forms as the programs ran them
  print(f"train step:          {train_precision.describe(backend)}")
  print(f"prefill/decode step: {decode_precision.describe(backend)}")
  print(xla_env.describe())
  print(attention_table(result))
  if quantized_cache(result):
    print(cache_table(result))
  if platform != "cpu":
    print(f"On {platform}:")
    print(platform_table(result))
  if any("pallas" in result["phases"][ph] for ph in PHASES):
    print(pallas_table(result))
  if any("mosaic" in result["phases"][ph] for ph in PHASES):
    print(mosaic_table(result))
  if not_compiled(result):
    print(not_compiled(result))
  elif compile:
    print(compiled_table(result))
  print(verdict(result))
  print(f"wrote {os.path.join(run_dir, 'audit.json')} and audit.md")
  return result

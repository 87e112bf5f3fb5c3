"""What precision does my attention actually run in? Ask the program.

    from attnprec.inspect import attention_report
    report = attention_report(my_attention_fn, q, k, v, expect=Precision(dtype="bfloat16"))
    print(report.attention_table()); print(report.verdict())

`attention_report(fn, *args, **kwargs)` lowers `jax.jit(fn).lower(*args, **kwargs)`,
reads its typed StableHLO through the MLIR Python bindings that ship with jaxlib
(`mlir_graph`), finds every attention by its structure (`finder`: a dot whose result
flows into a softmax whose result flows into a second dot; no names needed) and reports,
for each, the qk and wv dots' types and precision, the dtype the softmax runs in, any
down-cast between the QK^T product and the softmax, masks and soft-caps, the gradient
dots, and every dense dot. With `expect=Precision(...)` each is checked against
attnprec's precision contract (`report`). Named scopes and Haiku / Flax module names in
the program's locations label the report.

Arguments may be arrays or `jax.ShapeDtypeStruct`s (nothing is computed), or pytrees
of them. A bad argument (a non-callable `fn`, an `expect` that is not a `Precision`, an
argument that is neither an array nor a shape) raises `attnprec.errors.UserError` naming
it, before anything is lowered.
"""
import numbers
from typing import Optional

import jax
import numpy as np

from attnprec.errors import UserError, shorten

from attnprec.inspect.finder import Attention, DotSite, Findings, find
from attnprec.inspect.mlir_graph import Graph
from attnprec.inspect.report import Report

__all__ = ["attention_report", "inspect_lowered", "lowered_graph", "Attention", "DotSite",
           "Findings", "Report"]


def lowered_graph(lowered) -> Graph:
  """The dataflow graph of a `jax.jit(f).lower(...)` result."""
  return Graph(lowered.compiler_ir("stablehlo"))


def inspect_lowered(lowered, *, expect=None, function: str = "",
                    platform: str = "cpu") -> Report:
  """The report for an already lowered program (lowered for `platform`: its dots are
  also read under that platform's precision semantics, `attnprec.platforms`)."""
  from attnprec.precision import Precision
  if expect is not None and not isinstance(expect, Precision):
    raise UserError(f"Invalid argument expect={shorten(expect)} of inspect_lowered: must be "
                    f"an attnprec.precision.Precision or None (report only).")
  # Kernel custom calls exist only lowered for an accelerator (on cpu a Pallas kernel is
  # interpreted: plain ops the finder reads), so only then is the text searched for them.
  kernels = kernel_calls(lowered.as_text()) if platform != "cpu" else []
  return Report(function=function, findings=find(lowered_graph(lowered)), expect=expect,
                platform=platform, kernels=kernels)


# custom calls that hold a kernel body the dot search cannot open (GPU kernels, cuDNN)
_KERNEL_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "cudnn", "__cudnn")


def kernel_calls(text: str) -> list:
  """Every kernel custom call of a lowered (or compiled) program: a tpu_custom_call's
  Mosaic body read back (`mosaic.read_calls`), or, for a kernel call no reader here
  opens (Triton, Mosaic GPU, cuDNN), an entry saying it is unread. [{'call', 'kernel',
  'body' (a MosaicBody) or 'unread' (why)}]."""
  from attnprec.inspect import mosaic
  out = []
  for call, body in mosaic.read_calls(text):
    if isinstance(body, Exception):
      out.append({"call": call.name, "kernel": call.kernel,
                  "unread": f"its Mosaic body could not be opened ({type(body).__name__}: "
                            f"{str(body).strip()[:200]})"})
    else:
      out.append({"call": call.name, "kernel": body.kernel, "body": body})
  for target in _KERNEL_TARGETS:
    n = text.count(f"@{target}") + text.count(f'custom_call_target="{target}')
    out += [{"call": target, "kernel": target,
             "unread": f"a {target} custom call: no reader here opens its body"}] * n
  return out


def attention_report(fn, *args, expect=None, **kwargs) -> Report:
  """Lowers `jax.jit(fn)` on these arguments and reports every attention in it.

  expect: an `attnprec.precision.Precision` to check the program against (None: report
    only; a down-cast between a QK^T product and its softmax is flagged either way).
    (`expect` is taken by this function, every other keyword goes to fn.)
  """
  _check_arguments(fn, args, kwargs, expect)
  name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
  module = getattr(fn, "__module__", None)
  lowered = jax.jit(fn).lower(*args, **kwargs)
  return inspect_lowered(lowered, expect=expect,
                         function=f"{module}:{name}" if module else name)


# Precision fields that describe how attnprec's own model runs (its kernel, its KV cache,
# its key offset, the weights it prepares), which a function it did not build does not
# state in its program: the report could not check them, so they are not taken.
NOT_IN_A_FUNCTION = ("kernel", "kv_cache_k_dtype", "kv_cache_v_dtype", "kv_cache_k_scale",
                     "kv_cache_v_scale", "key_offset", "carrier_weights", "stored_weights")


def check_expect_readable(expect, what: str) -> None:
  """Refuses an expected Precision whose NOT_IN_A_FUNCTION fields differ from their
  defaults: a PASS would name settings nothing checked."""
  from attnprec.precision import Precision
  default = Precision()
  set_ = [f"{f}={getattr(expect, f)!r}" for f in NOT_IN_A_FUNCTION
          if getattr(expect, f) != getattr(default, f)]
  if set_:
    raise UserError(f"{what} sets {', '.join(set_)}: how attnprec's own model runs (its "
                    f"kernel, KV cache, key offset, prepared weights), which a function's "
                    f"lowered program does not state, so the report could not check it and "
                    f"a PASS would name it unchecked. Leave those fields at their defaults "
                    f"(`make audit` checks them on attnprec's model).")


def _is_input(x) -> bool:
  """What jax.jit can lower a function on: arrays, shapes, and plain numbers."""
  return (isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))
          or isinstance(x, numbers.Number))


def _check_arguments(fn, args, kwargs, expect) -> None:
  from attnprec.precision import Precision
  if not callable(fn):
    raise UserError(f"Invalid argument fn={shorten(fn)} of attention_report: must be a "
                    f"callable (the function whose attention to report), e.g. "
                    f"attnprec.inspect.examples.maxtext_attention.")
  if expect is not None and not isinstance(expect, Precision):
    raise UserError(f"Invalid argument expect={shorten(expect)} of attention_report: must be "
                    f"an attnprec.precision.Precision to check against (e.g. "
                    f"Precision(dtype='bfloat16', float32_logits=True)) or None (report "
                    f"only).")
  if expect is not None:
    check_expect_readable(expect, "attention_report's expect")
  named = [(f"argument {i}", a) for i, a in enumerate(args)] + \
          [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
  for label, value in named:
    bad = [x for x in jax.tree_util.tree_leaves(value) if not _is_input(x)]
    if bad:
      raise UserError(f"Invalid {label} of attention_report: {shorten(value)} holds "
                      f"{shorten(bad[0])} ({type(bad[0]).__name__}); arguments for fn must "
                      f"be arrays, jax.ShapeDtypeStructs or numbers (or pytrees of them).")

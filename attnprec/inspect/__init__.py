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

Arguments may be arrays or `jax.ShapeDtypeStruct`s (nothing is computed).
"""
from typing import Optional

import jax

from attnprec.inspect.finder import Attention, DotSite, Findings, find
from attnprec.inspect.mlir_graph import Graph
from attnprec.inspect.report import Report

__all__ = ["attention_report", "inspect_lowered", "lowered_graph", "Attention", "DotSite",
           "Findings", "Report"]


def lowered_graph(lowered) -> Graph:
  """The dataflow graph of a `jax.jit(f).lower(...)` result."""
  return Graph(lowered.compiler_ir("stablehlo"))


def inspect_lowered(lowered, *, expect=None, function: str = "") -> Report:
  """The report for an already lowered program."""
  return Report(function=function, findings=find(lowered_graph(lowered)), expect=expect)


def attention_report(fn, *args, expect=None, **kwargs) -> Report:
  """Lowers `jax.jit(fn)` on these arguments and reports every attention in it.

  expect: an `attnprec.precision.Precision` to check the program against (None: report
    only; a down-cast between a QK^T product and its softmax is flagged either way).
    (`expect` is taken by this function, every other keyword goes to fn.)
  """
  name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
  module = getattr(fn, "__module__", None)
  lowered = jax.jit(fn).lower(*args, **kwargs)
  return inspect_lowered(lowered, expect=expect,
                         function=f"{module}:{name}" if module else name)

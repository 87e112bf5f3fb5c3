"""The kernel registry and the dispatcher: one list that `Precision`, the model, the
bench, the study and the audit iterate over.

A kernel is one module in this package that declares a `contract.KernelSpec` as `KERNEL`
(its name, its `attend`, what it refuses, its named scopes) and imports only the ground
floor (`attnprec.contract`, `attnprec.errors`). Adding a kernel: write the module (with
its tests against `kernels.dot_product` and `contract.reference_attention_np`) and add it
to `_MODULES` below.
"""
from typing import Dict, Optional, Tuple

from attnprec import contract
from attnprec.errors import UserError, choice_error
from attnprec.kernels import blockwise, dot_product, jax_nn

_MODULES = (dot_product, blockwise, jax_nn)
REGISTRY: Dict[str, contract.KernelSpec] = {m.KERNEL.name: m.KERNEL for m in _MODULES}
NAMES: Tuple[str, ...] = tuple(REGISTRY)      # ('dot_product', 'blockwise', 'jax_nn')


def get(name: str) -> contract.KernelSpec:
  """The registered kernel `name`; an unknown name is a `UserError` listing the valid."""
  if name not in REGISTRY:
    raise choice_error("attention kernel", name, NAMES)
  return REGISTRY[name]


def refusal(precision, *, logits_soft_cap=None) -> Optional[str]:
  """None if `precision.kernel` honours `precision` (and the soft-cap), else why not."""
  return get(precision.kernel).refusal(precision, logits_soft_cap=logits_soft_cap)


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None):
  """Runs the kernel a phase's `Precision` selects, with its attention flags.

  q [B, T, N, H], k/v [B, S, K, H] in the compute dtype; mask: None, a dense bool array
  broadcastable to [B, N, T, S], or a `contract.CausalMask` (positions + sliding window),
  which 'blockwise' uses structurally (skipping hidden blocks) and the other kernels as
  the equivalent dense mask. Returns [B, T, N, H] in q's dtype.
  """
  kernel = get(precision.kernel)
  why = kernel.refusal(precision, logits_soft_cap=logits_soft_cap)
  if why:
    raise UserError(why)
  return kernel.attend(precision, q, k, v, mask=mask, logits_soft_cap=logits_soft_cap,
                       scale=scale)

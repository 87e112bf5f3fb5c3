"""The kernel registry and the dispatcher: one list that `Precision`, the model, the
bench, the study and the audit iterate over.

A kernel is one module in this package that declares a `contract.KernelSpec` as `KERNEL`
(its name, its `attend`, what it refuses, its named scopes) and imports only the ground
floor (`attnprec.contract`, `attnprec.errors`). Adding a kernel: write the module (with
its tests against `kernels.dot_product` and `contract.reference_attention_np`) and add it
to `_MODULES` below.

'auto' is not a kernel but a choice by shape and platform, made from the static shapes
while tracing: for every decode step the platform's choice (`platforms.Platform.
auto_decode`: 'blockwise' on XLA:CPU, which reads the cache as it lies, block by block,
only up to the query's position, where the dense kernel reads it whole; 'dot_product' on a
TPU, where the blockwise decode step was measured 1.6-2.8x slower), the platform's long
kernel (`Platform.auto_long`: 'blockwise' on XLA:CPU, 'flash' on a TPU, where it ran
2.8-6x faster than the dense kernel in prefill and a train step 3.9x faster than
blockwise, as measured) for
a call with at least `AUTO_MIN_QUERIES` queries (a long prefill, where the dense kernel's
[T, S] logits dominate) or at least `AUTO_MIN_KEYS` keys (a short prompt into a long
cache), 'dot_product' otherwise (short prompts into short caches). Where the long kernel
would refuse the phase's precision (flash: a quantized cache, an einsum precision Mosaic
does not take), 'auto' runs 'blockwise' instead, which, like 'dot_product', honours the
whole contract table: the precision is the same whichever runs; `resolve` says which
one a call runs, and the compiled program shows it (`make inspect`: an online softmax in
a loop is blockwise; a Mosaic body is flash).
"""
from typing import Dict, Optional, Tuple

import jax

from attnprec import contract, platforms
from attnprec.errors import UserError, choice_error
from attnprec.kernels import blockwise, dot_product, flash, jax_nn, pallas, splash

_MODULES = (dot_product, blockwise, jax_nn, pallas, flash, splash)
REGISTRY: Dict[str, contract.KernelSpec] = {m.KERNEL.name: m.KERNEL for m in _MODULES}
NAMES: Tuple[str, ...] = tuple(REGISTRY)  # (..., 'pallas', 'flash', 'splash')
AUTO = "auto"
CHOICES: Tuple[str, ...] = NAMES + (AUTO,)    # what `precision.kernel` accepts
# 'auto' runs blockwise for a decode step, and for a prefill from this many queries, or
# keys, up. On SmolLM2-135M (XLA:CPU, docs/performance.md "Short caches"): blockwise
# decode steps took 0.62-1.06x the dense kernel's time over caches of 33-501 positions
# (fp32, bf16, bf16 + flags, int8 cache; batch 1 and 8); blockwise prefill was faster at
# 1000 tokens, and 256 queries is where a causal prefill first skips blocks (shorter
# prefills measured 0.82-0.99x blockwise / dense, but moved `make decode`'s greedy
# continuation off its float32 reference's at one near tie: not adopted without a study).
AUTO_MIN_QUERIES = 256
AUTO_MIN_KEYS = 512
AUTO_KERNELS = ("dot_product", "blockwise")


def get(name: str) -> contract.KernelSpec:
  """The registered kernel `name`; an unknown name is a `UserError` listing the valid."""
  if name not in REGISTRY:
    raise choice_error("attention kernel", name, NAMES)
  return REGISTRY[name]


def resolve(name: str, num_queries: int, num_keys: int = 0,
            platform: Optional[str] = None, precision=None, logits_soft_cap=None) -> str:
  """The kernel a call with `num_queries` queries over `num_keys` keys runs under
  `precision.kernel = name` (one query: a decode step) on `platform` ('cpu', 'tpu',
  'cuda'; None: 'cpu'). A decode step runs the platform's `auto_decode`
  (`platforms.Platform`: blockwise on XLA:CPU, dot_product on a TPU, as measured there);
  a long call its `auto_long` (blockwise on XLA:CPU, flash on a TPU), or blockwise where
  that kernel refuses `precision` (and the soft-cap); None: the long kernel itself."""
  if name not in CHOICES:
    raise choice_error("attention kernel", name, CHOICES)
  if name != AUTO:
    return name
  chosen = platforms.check(platform or "cpu")
  if num_queries == 1:
    return chosen.auto_decode
  if num_queries < AUTO_MIN_QUERIES and num_keys < AUTO_MIN_KEYS:
    return "dot_product"
  return long_kernel(platform, precision, logits_soft_cap)


def long_kernel(platform: Optional[str] = None, precision=None,
                logits_soft_cap=None) -> str:
  """The kernel 'auto' runs for a long call on `platform` (None: 'cpu'): the platform's
  `auto_long`, or blockwise where that kernel refuses `precision` (None: not asked)."""
  long = platforms.check(platform or "cpu").auto_long
  if precision is not None and REGISTRY[long].refusal(precision,
                                                      logits_soft_cap=logits_soft_cap):
    return "blockwise"
  return long


def runs_blockwise(name: str) -> bool:
  """Whether a phase with `precision.kernel = name` can run the blockwise kernel (and so
  reads its block sizes)."""
  return name in ("blockwise", AUTO)


def takes_float32_qk_form(name: str) -> bool:
  """Whether `precision.kernel = name` runs the QK dot in the float32 form where
  `Precision.float32_qk_operands` asks for it ('auto': every kernel it chooses between
  does; `KernelSpec.float32_qk_form`)."""
  names = AUTO_KERNELS if name == AUTO else (name,)
  return all(n in REGISTRY and REGISTRY[n].float32_qk_form for n in names)


def refusal(precision, *, logits_soft_cap=None) -> Optional[str]:
  """None if `precision.kernel` honours `precision` (and the soft-cap), else why not
  ('auto': neither of the kernels it chooses between may refuse)."""
  if precision.kernel not in CHOICES:
    return choice_error("attention kernel", precision.kernel, CHOICES).args[0]
  names = AUTO_KERNELS if precision.kernel == AUTO else (precision.kernel,)
  for name in names:
    why = REGISTRY[name].refusal(precision, logits_soft_cap=logits_soft_cap)
    if why:
      return why
  return None


def reads_stack(precision, num_queries: int, num_keys: int, G: int,
                dense_mask: bool = False, logits_soft_cap=None) -> bool:
  """Whether the kernel a call resolves to reads one layer of a stack of caches in place
  (`KernelSpec.reads_stack`: flash's decode calls), so a scanned model passes it the
  stack and the layer (`attend(kv_layer=)`) instead of the layer's slice."""
  platform = precision.platform() if hasattr(precision, "platform") else None
  spec = get(resolve(precision.kernel, num_queries, num_keys, platform, precision,
                     logits_soft_cap))
  return spec.reads_stack is not None and spec.reads_stack(num_queries, G, dense_mask)


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None,
           kv_scales=None, kv_layer=None):
  """Runs the kernel a phase's `Precision` selects, with its attention flags.

  q [B, T, N, H], k/v [B, S, K, H] in the compute dtype, or, with `kv_scales` (a
  `contract.KVScales`: attention over a quantized cache), k/v as the cache's codes in the
  dtypes of `precision.cache_storage` (`contract.cache_stage_dtypes`); mask: None, a
  dense bool array broadcastable to [B, N, T, S], or a `contract.CausalMask` (positions +
  sliding window), which 'blockwise' uses structurally (skipping hidden blocks) and the
  other kernels as the equivalent dense mask. Returns [B, T, N, H] in q's dtype.
  kv_layer: None, or an int32 scalar: k / v (and the scales' leaves) are then a stack of
  layers' caches with a leading L axis, and the call attends over layer `kv_layer`: read
  in place by a kernel that can (`reads_stack`), else sliced out for it.
  `precision.kernel` may be 'auto' (`resolve`: by the static numbers of queries T and
  keys S).
  """
  platform = precision.platform() if hasattr(precision, "platform") else None
  S = k.shape[-3]
  kernel = get(resolve(precision.kernel, q.shape[1], S, platform, precision,
                       logits_soft_cap))
  why = kernel.refusal(precision, logits_soft_cap=logits_soft_cap)
  if why:
    raise UserError(why)
  if kv_layer is not None:
    G = q.shape[2] // k.shape[-2]
    dense = mask is not None and not isinstance(mask, contract.CausalMask)
    if kernel.reads_stack is not None and kernel.reads_stack(q.shape[1], G, dense):
      return kernel.attend(precision, q, k, v, mask=mask, logits_soft_cap=logits_soft_cap,
                           scale=scale, kv_scales=kv_scales, kv_layer=kv_layer)
    # a kernel that cannot read the stack gets the layer's slice (its scales' too)
    k, v, kv_scales = jax.tree_util.tree_map(
        lambda x: jax.lax.dynamic_index_in_dim(x, kv_layer, 0, keepdims=False),
        (k, v, kv_scales))
  if kv_scales is None:
    return kernel.attend(precision, q, k, v, mask=mask, logits_soft_cap=logits_soft_cap,
                         scale=scale)
  return kernel.attend(precision, q, k, v, mask=mask, logits_soft_cap=logits_soft_cap,
                       scale=scale, kv_scales=kv_scales)

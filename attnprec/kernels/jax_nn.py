"""`jax.nn.dot_product_attention` behind the precision contract, honestly mapped.

Shapes as `attnprec.contract`: q [B, T, N, H], k/v [B, S, K, H] (GQA natively).

`jax.nn.dot_product_attention` has no precision argument. Its 'xla' implementation
always computes the QK dot with a float32 result, runs mask and softmax in float32, and
then casts the probabilities to the input dtype before the wv dot; cuDNN does the same.
So of the contract's knobs it can honour exactly one setting:

  float32_qk_product=True, float32_logits=True, einsum_precision='default'

and this wrapper refuses every other combination, and `logits_soft_cap` (which it has no
way to apply), with a `UserError`. To honour the table's last float32 stage
("probabilities into the wv einsum: f32") the 'xla' path upcasts q, k and v to float32
before the call (the contract allows the f32 QK product "by upcasting q and k first",
and dot_product upcasts v the same way); the output is cast back to the compute dtype c.
With c = float32 nothing is cast.

implementation='cudnn' (GPU only) keeps q, k, v in c (cuDNN takes only bf16/fp16), so
there the probabilities enter the wv dot in c: a documented deviation from the table,
which is why 'xla' is the default.

The query scale is passed on (`scale=`): jax.nn multiplies the float32 logits by it
after the QK dot, which is where the contract puts it with `float32_qk_product` (the only
setting this kernel accepts), as dot_product and blockwise do.

Its two dots sit inside `jax.nn`, so it declares no named scopes (`qk_scope=None`); the
audit recognises them by their einsum equations. `Precision(kernel='jax_nn', ...)` refuses
the unsupported flags when it is constructed (the registry calls `refusal`), and a
quantized KV cache (int8 / float8 codes with scales: it has nowhere to apply the scales);
an unscaled cache (float32 / bfloat16 storage) reaches it as values of c, as always.
"""
import dataclasses
from typing import Optional

import chex
import jax
import jax.numpy as jnp

from attnprec import contract
from attnprec.errors import UserError, choice_error

NAME = "jax_nn"
# The one setting of the knobs it honours; a knob added with its default is refused
# here at any other value until this kernel learns it.
SUPPORTED = contract.AttentionFlags(float32_qk_product=True, float32_logits=True,
                                    einsum_precision="default")
IMPLEMENTATIONS = ("xla", "cudnn")


def refusal(precision, *, logits_soft_cap=None) -> Optional[str]:
  """None if 'jax_nn' honours a `Precision` (its knobs and cache storage) and the
  soft-cap, else the paragraph that names the bad value and the valid ones."""
  storage = precision.cache_storage
  if storage.quantized:
    return (f"The 'jax_nn' attention kernel cannot read a quantized KV cache "
            f"(precision.kv_cache_k_dtype = {storage.k_dtype!r}, "
            f"precision.kv_cache_v_dtype = {storage.v_dtype!r}): "
            f"jax.nn.dot_product_attention takes k and v in one float dtype and has no "
            f"place to apply the cache's scales to the logits and probabilities "
            f"(dequantizing the cache first would add a rounding the contract "
            f"forbids). Valid cache dtypes for 'jax_nn': 'compute', 'float32', "
            f"'bfloat16'. Use kernel 'dot_product' or 'blockwise' for "
            f"{', '.join(repr(d) for d in contract.SCALED_KV_DTYPES)}.")
  return flags_refusal(precision.attention, logits_soft_cap=logits_soft_cap)


def flags_refusal(flags: contract.AttentionFlags, *,
                  logits_soft_cap=None) -> Optional[str]:
  """None if 'jax_nn' honours `flags` and the soft-cap, else why not."""
  # The key offset acts before any kernel (the layer subtracts it): honoured here too.
  knob = flags.differing(dataclasses.replace(SUPPORTED, key_offset=flags.key_offset))
  if knob is not None:
    return _refuse(knob, getattr(flags, knob), (getattr(SUPPORTED, knob),))
  if logits_soft_cap is not None:
    return (f"The 'jax_nn' attention kernel cannot apply logits_soft_cap="
            f"{logits_soft_cap!r} (jax.nn.dot_product_attention has no soft-cap); "
            f"valid: None. Use kernel 'dot_product' or 'blockwise'.")
  return None


def check_supported(flags: contract.AttentionFlags, *, logits_soft_cap=None,
                    implementation="xla"):
  """Raises `UserError` naming the bad value and the valid ones."""
  why = flags_refusal(flags, logits_soft_cap=logits_soft_cap)
  if why:
    raise UserError(why)
  if implementation not in IMPLEMENTATIONS:
    raise choice_error("jax_nn implementation", implementation, IMPLEMENTATIONS)
  if implementation == "cudnn" and jax.default_backend() != "gpu":
    raise UserError(f"jax_nn implementation 'cudnn' needs a GPU; the backend is "
                    f"{jax.default_backend()!r}. Valid here: 'xla'.")


def jax_nn_attention(q, k, v, *, mask=None, flags: contract.AttentionFlags = SUPPORTED,
                     logits_soft_cap=None, scale=None, implementation: str = "xla"):
  """Same signature and contract as `dot_product_attention` for the one flag setting it
  supports (see module docstring); `implementation` is 'xla' (default) or 'cudnn'."""
  check_supported(flags, logits_soft_cap=logits_soft_cap, implementation=implementation)
  prep = contract.prepare(q, k, v, flags, scale=scale)
  B, T, N, H = prep.B, prep.T, prep.N, prep.H
  c, expected = q.dtype, prep.stages
  operand = jnp.float32 if implementation == "xla" else c
  if mask is not None:
    mask = contract.check_bool_mask(mask)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
  out_BxTxNxH = jax.nn.dot_product_attention(
      q.astype(operand), k.astype(operand), v.astype(operand), mask=mask,
      scale=prep.scale, implementation=implementation).astype(c)
  chex.assert_shape(out_BxTxNxH, (B, T, N, H))
  chex.assert_type(out_BxTxNxH, expected["output"])
  return out_BxTxNxH


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None):
  """The registry's entry: a phase's `Precision` flags, a dense mask or a `CausalMask`."""
  return jax_nn_attention(q, k, v, mask=contract.dense_mask(mask),
                          flags=precision.attention, logits_soft_cap=logits_soft_cap,
                          scale=scale)


KERNEL = contract.KernelSpec(name=NAME, attend=attend, refusal=refusal,
                             qk_scope=None, wv_scope=None)


def _refuse(flag: str, value, valid) -> str:
  return (
      f"The 'jax_nn' attention kernel cannot honour {flag}={value!r}: "
      f"jax.nn.dot_product_attention has no precision argument and always computes the "
      f"QK product in float32 and the softmax in float32. Valid {flag} values for "
      f"'jax_nn': {', '.join(repr(v) for v in valid)}. Use kernel 'dot_product' or "
      f"'blockwise' for other settings.")

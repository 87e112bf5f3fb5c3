"""Dot-product attention with explicit, asserted precision (the precision contract).

Shapes:
  B: batch, T: query length, S: key/value length,
  N: query heads, K: key/value heads (N = K * G), G: query heads per kv head,
  H: head dim.

Stage dtypes (compute dtype c = the dtype of q, k, v), as in
`shared/design/precision-contract.md`:

  | stage                         | qk=F,lg=F | qk=F,lg=T | qk=T,lg=F | qk=T,lg=T |
  | q, k, v entering attention    | c         | c         | c         | c         |
  | QK^T logits                   | c         | c         | f32       | f32       |
  | soft-cap, mask, softmax       | c         | f32       | f32       | f32       |
  | probabilities into wv einsum  | c         | f32       | f32       | f32       |
  | attention output (cast)       | c         | c         | c         | c         |

A flag only ever upcasts; nothing is cast back down before the softmax. The float32 QK
product is computed with `preferred_element_type=float32` on the c-typed operands (the
operands are NOT upcast first); the lowered StableHLO therefore shows
`(tensor<..xbf16>, tensor<..xbf16>) -> tensor<..xf32>` for the qk dot. When the
probabilities are float32, v is upcast to float32 for the wv einsum.
Every stage is checked with `chex.assert_type` / `chex.assert_shape` (trace-time checks,
free under jit).
"""
from typing import Dict, Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from attnprec.errors import UserError
from attnprec.precision import parse_precision

STAGES = ("qkv", "logits", "softmax", "probs", "output")
# Named scopes around the two attention dots: the audit finds them in the lowered program.
QK_SCOPE, WV_SCOPE = "attn_qk", "attn_wv"


def stage_dtypes(compute_dtype, *, float32_qk_product: bool,
                 float32_logits: bool) -> Dict[str, jnp.dtype]:
  """The contract table as data: stage name -> dtype for one flag combination."""
  c = jnp.dtype(compute_dtype)
  f32 = jnp.dtype(jnp.float32)
  logits = f32 if float32_qk_product else c
  softmax = f32 if (float32_logits or float32_qk_product) else c
  return {"qkv": c, "logits": logits, "softmax": softmax, "probs": softmax, "output": c}


def check_heads(q, k, v) -> int:
  """Checks q [B, T, N, H] against k, v [B, S, K, H]; returns G = N // K (every kernel)."""
  B, _, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  if N % K:
    raise UserError(f"Number of query heads N={N} is not a multiple of key/value heads "
                    f"K={K}; valid K values for N={N} are: "
                    f"{[d for d in range(1, N + 1) if N % d == 0]}.")
  chex.assert_shape(k, (B, S, K, H))
  chex.assert_shape(v, (B, S, K, H))
  return N // K


def mask_value(dtype) -> float:
  """A large finite negative number valid in `dtype` (never -inf: no NaN on empty rows)."""
  return -0.7 * float(jnp.finfo(dtype).max)


def dot_product_attention(q, k, v, *, mask=None, float32_qk_product=True,
                          float32_logits=True, einsum_precision="default",
                          logits_soft_cap=None, scale=None):
  """Multi-head (GQA/MQA) dot-product attention that honours the precision contract.

  Args:
    q: [B, T, N, H] queries in the compute dtype c.
    k: [B, S, K, H] keys, same dtype as q; N must be a multiple of K.
    v: [B, S, K, H] values, same dtype as q.
    mask: optional bool array broadcastable to [B, N, T, S]; True = attend.
    float32_qk_product: the QK^T dot accumulates and returns float32.
    float32_logits: soft-cap, mask and softmax run in float32.
    einsum_precision: `jax.lax.Precision` name (default/high/highest, any case) or a
      `jax.lax.DotAlgorithmPreset` name; passed to BOTH the qk and the wv einsum.
    logits_soft_cap: if set, logits -> cap * tanh(logits / cap) before masking.
    scale: query scale; defaults to H ** -0.5. Applied to q before the qk dot.

  Returns:
    [B, T, N, H] in q's dtype.
  """
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  c = q.dtype
  G = check_heads(q, k, v)
  expected = stage_dtypes(c, float32_qk_product=float32_qk_product,
                          float32_logits=float32_logits)
  chex.assert_type([q, k, v], [expected["qkv"]] * 3)
  precision = parse_precision(einsum_precision)
  if scale is None:
    scale = H ** -0.5

  q_BxTxKxGxH = (q * jnp.asarray(scale, c)).reshape(B, T, K, G, H)
  with jax.named_scope(QK_SCOPE):
    logits_BxKxGxTxS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k, precision=precision,
        preferred_element_type=jnp.float32 if float32_qk_product else c)
  chex.assert_shape(logits_BxKxGxTxS, (B, K, G, T, S))
  chex.assert_type(logits_BxKxGxTxS, expected["logits"])

  logits_BxKxGxTxS = logits_BxKxGxTxS.astype(expected["softmax"])
  if logits_soft_cap is not None:
    cap = jnp.asarray(logits_soft_cap, expected["softmax"])
    logits_BxKxGxTxS = cap * jnp.tanh(logits_BxKxGxTxS / cap)
  if mask is not None:
    mask_BxKxGxTxS = _group_mask(mask, B, N, K, G, T, S)
    logits_BxKxGxTxS = jnp.where(mask_BxKxGxTxS, logits_BxKxGxTxS,
                                 jnp.asarray(mask_value(expected["softmax"]),
                                             expected["softmax"]))
  probs_BxKxGxTxS = jax.nn.softmax(logits_BxKxGxTxS, axis=-1)
  chex.assert_type(probs_BxKxGxTxS, expected["probs"])

  with jax.named_scope(WV_SCOPE):
    out_BxTxKxGxH = jnp.einsum(
        "BKGTS,BSKH->BTKGH", probs_BxKxGxTxS, v.astype(expected["probs"]),
        precision=precision, preferred_element_type=expected["probs"])
  out_BxTxNxH = out_BxTxKxGxH.reshape(B, T, N, H).astype(c)
  chex.assert_shape(out_BxTxNxH, (B, T, N, H))
  chex.assert_type(out_BxTxNxH, expected["output"])
  return out_BxTxNxH


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None):
  """Runs the kernel a phase's `Precision` selects, with its attention flags.

  mask: a dense bool array broadcastable to [B, N, T, S], or an
    `attnprec.kernels.masks.CausalMask` (positions + sliding window). The 'blockwise'
    kernel uses a CausalMask structurally (skipping fully hidden blocks); the other
    kernels receive it as the equivalent dense mask.

  Kernels (`Precision.kernel`): 'dot_product' (this module), 'blockwise'
  (`attnprec.kernels.blockwise`), 'jax_nn' (`attnprec.kernels.jax_nn`).
  """
  # Imported here: the kernels import this module for the contract table.
  from attnprec.kernels import blockwise, jax_nn
  from attnprec.kernels.masks import CausalMask

  kwargs = dict(logits_soft_cap=logits_soft_cap, scale=scale, **precision.attention_kwargs())
  structured = isinstance(mask, CausalMask)
  if precision.kernel == "blockwise":
    masking = mask.blockwise_kwargs() if structured else dict(mask=mask)
    return blockwise.blockwise_attention(q, k, v, **masking, **kwargs)
  dense = mask.dense() if structured else mask
  if precision.kernel == "jax_nn":
    return jax_nn.jax_nn_attention(q, k, v, mask=dense, **kwargs)
  if precision.kernel == "dot_product":
    return dot_product_attention(q, k, v, mask=dense, **kwargs)
  raise UserError(f"Unknown attention kernel {precision.kernel!r}; valid: "
                  f"'dot_product', 'blockwise', 'jax_nn'.")


def _group_mask(mask, B, N, K, G, T, S):
  """Bool mask broadcastable to [B, N, T, S] -> broadcastable to [B, K, G, T, S]."""
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise UserError(f"mask must be a boolean array (True = attend), got dtype {mask.dtype}.")
  while mask.ndim < 4:
    mask = mask[None]
  if mask.shape[1] == 1:
    return mask[:, :, None]                               # [B|1, 1, 1, T|1, S|1]
  mask = jnp.broadcast_to(mask, (mask.shape[0], N) + mask.shape[2:])
  return mask.reshape(mask.shape[0], K, G, *mask.shape[2:])  # [B|1, K, G, T|1, S|1]


def causal_mask(q_positions_BxT, k_positions_BxS, *, sliding_window: Optional[int] = None):
  """[B, 1, T, S] bool: key position <= query position (and within the window)."""
  q = q_positions_BxT[:, None, :, None]
  kpos = k_positions_BxS[:, None, None, :]
  allowed = kpos <= q
  if sliding_window is not None:
    allowed &= kpos > q - sliding_window
  return allowed


def reference_attention_np(q, k, v, *, mask=None, logits_soft_cap=None, scale=None):
  """float64 NumPy reference (independent of JAX) used by tests and the study."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  k = np.repeat(k, G, axis=2)
  v = np.repeat(v, G, axis=2)
  scale = H ** -0.5 if scale is None else scale
  logits = np.einsum("btnh,bsnh->bnts", q * scale, k)
  if logits_soft_cap is not None:
    logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
  if mask is not None:
    logits = np.where(np.broadcast_to(np.asarray(mask), logits.shape), logits, -1e300)
  logits = logits - logits.max(-1, keepdims=True)
  p = np.exp(logits)
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnh->btnh", p, v)

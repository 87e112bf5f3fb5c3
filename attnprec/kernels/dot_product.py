"""The dense reference kernel: two einsums and a softmax, every stage of the contract
table (`attnprec.contract`) asserted with chex.

Shapes: B batch, T queries, S keys, N query heads, K kv heads, G = N // K, H head dim.
It honours every setting of the table (`refusal` is `honours_everything`); a
`CausalMask` is applied as its dense equivalent.
"""
import chex
import jax
import jax.numpy as jnp

from attnprec import contract

NAME = "dot_product"


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
    scale: query scale; defaults to H ** -0.5. Applied where the contract table says
      (`contract.stage_dtypes(...)['scale']`): to q in c before the qk dot when the
      QK product is in c, to the float32 logits after it with `float32_qk_product`.

  Returns:
    [B, T, N, H] in q's dtype.
  """
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  c = q.dtype
  G = contract.check_heads(q, k, v)
  expected = contract.stage_dtypes(c, float32_qk_product=float32_qk_product,
                                   float32_logits=float32_logits)
  chex.assert_type([q, k, v], [expected["qkv"]] * 3)
  precision = contract.parse_precision(einsum_precision)
  if scale is None:
    scale = H ** -0.5

  q_BxTxKxGxH = contract.scale_queries(q, scale, expected).reshape(B, T, K, G, H)
  with jax.named_scope(contract.QK_SCOPE):
    logits_BxKxGxTxS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k, precision=precision,
        preferred_element_type=jnp.float32 if float32_qk_product else c)
  chex.assert_shape(logits_BxKxGxTxS, (B, K, G, T, S))
  chex.assert_type(logits_BxKxGxTxS, expected["logits"])
  logits_BxKxGxTxS = contract.scale_logits(logits_BxKxGxTxS, scale, expected)

  logits_BxKxGxTxS = logits_BxKxGxTxS.astype(expected["softmax"])
  if logits_soft_cap is not None:
    cap = jnp.asarray(logits_soft_cap, expected["softmax"])
    logits_BxKxGxTxS = cap * jnp.tanh(logits_BxKxGxTxS / cap)
  if mask is not None:
    mask_BxKxGxTxS = contract.group_mask(mask, B, N, K, G, T, S)
    logits_BxKxGxTxS = jnp.where(mask_BxKxGxTxS, logits_BxKxGxTxS,
                                 jnp.asarray(contract.mask_value(expected["softmax"]),
                                             expected["softmax"]))
  probs_BxKxGxTxS = jax.nn.softmax(logits_BxKxGxTxS, axis=-1)
  chex.assert_type(probs_BxKxGxTxS, expected["probs"])

  with jax.named_scope(contract.WV_SCOPE):
    out_BxTxKxGxH = jnp.einsum(
        "BKGTS,BSKH->BTKGH", probs_BxKxGxTxS, v.astype(expected["probs"]),
        precision=precision, preferred_element_type=expected["probs"])
  out_BxTxNxH = out_BxTxKxGxH.reshape(B, T, N, H).astype(c)
  chex.assert_shape(out_BxTxNxH, (B, T, N, H))
  chex.assert_type(out_BxTxNxH, expected["output"])
  return out_BxTxNxH


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None):
  """The registry's entry: a phase's `Precision` flags, a dense mask or a `CausalMask`."""
  return dot_product_attention(q, k, v, mask=contract.dense_mask(mask),
                               logits_soft_cap=logits_soft_cap, scale=scale,
                               **precision.attention_kwargs())


KERNEL = contract.KernelSpec(name=NAME, attend=attend, refusal=contract.honours_everything)

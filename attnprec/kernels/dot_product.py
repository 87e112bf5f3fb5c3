"""The dense reference kernel: two einsums and a softmax, every stage of the contract
table (`attnprec.contract`) asserted with chex.

Shapes: B batch, T queries, S keys, N query heads, K kv heads, G = N // K, H head dim.
It honours every setting of the table (`refusal` is `honours_everything`), the cache
rows included (a quantized cache: `contract.cache_stage_dtypes`); a `CausalMask` is
applied as its dense equivalent.
"""
import chex
import jax
import jax.numpy as jnp

from attnprec import contract

NAME = "dot_product"


def dot_product_attention(q, k, v, *, mask=None,
                          flags: contract.AttentionFlags = contract.AttentionFlags(),
                          logits_soft_cap=None, scale=None,
                          kv_cache: contract.CacheStorage = contract.COMPUTE_CACHE,
                          kv_scales=None, float32_qk_operands: bool = False):
  """Multi-head (GQA/MQA) dot-product attention that honours the precision contract.

  Args:
    q: [B, T, N, H] queries in the compute dtype c.
    k: [B, S, K, H] keys, same dtype as q; N must be a multiple of K.
    v: [B, S, K, H] values, same dtype as q.
    mask: optional bool array broadcastable to [B, N, T, S]; True = attend.
    flags: the contract's knobs (`contract.AttentionFlags`, `Precision.attention`):
      float32_qk_product (the QK^T dot accumulates and returns float32),
      float32_logits (soft-cap, mask and softmax run in float32), einsum_precision
      (passed to BOTH the qk and the wv einsum).
    logits_soft_cap: if set, logits -> cap * tanh(logits / cap) before masking.
    scale: query scale; defaults to H ** -0.5. Applied where the contract table says
      (`contract.stage_dtypes(c, flags)['scale']`): to q in c before the qk dot when
      the QK product is in c, to the float32 logits after it with float32_qk_product.
    kv_cache: the cache's storage (`Precision.cache_storage`); read with `kv_scales`.
    kv_scales: None (k, v in c), or the `contract.KVScales` of a quantized cache: k / v
      are then its codes (`contract.cache_stage_dtypes` rows 'k_cache' / 'v_cache'),
      cast exactly to the dot operand dtypes; a per-token key scale multiplies the
      logits column-wise in the logits dtype (right after the qk dot, before the query
      scale, the soft-cap and the mask), a per-channel key scale multiplies q (in f32
      with `float32_qk_product`, else in c), a value scale multiplies the normalised
      probabilities column-wise in the probs dtype before the wv dot. Nothing is
      dequantized; q and the probabilities are never quantized.
    float32_qk_operands: run the QK dot on q and k cast exactly to float32 (the float32
      form, `Precision.float32_qk_operands`: a CPU without bf16 dots, where XLA:CPU's
      bf16 x bf16 -> float32 dot is slower than a float32 one). The products and the
      float32 accumulation are the c x c dot's; only the summation order may differ.
      Needs the float32 QK product of a 16-bit c, keys of c and a plain einsum_precision
      (`Prepared.check_float32_qk_operands`).

  Returns:
    [B, T, N, H] in q's dtype.
  """
  prep = contract.prepare(q, k, v, flags, scale=scale, kv_cache=kv_cache,
                          kv_scales=kv_scales)
  B, T, N, K, G, H, S = prep.B, prep.T, prep.N, prep.K, prep.G, prep.H, prep.S
  expected, rows = prep.stages, prep.rows

  if float32_qk_operands:
    prep.check_float32_qk_operands(q)
  q_BxTxKxGxH = contract.qk_operand(prep.queries(q), float32_qk_operands)
  k = contract.qk_operand(contract.code_operand(k, rows, "k_into_qk"), float32_qk_operands)
  with jax.named_scope(contract.QK_SCOPE):
    logits_BxKxGxTxS = jnp.einsum(
        "BTKGH,BSKH->BKGTS", q_BxTxKxGxH, k, precision=prep.einsum,
        preferred_element_type=expected["logits"])
  chex.assert_shape(logits_BxKxGxTxS, (B, K, G, T, S))
  chex.assert_type(logits_BxKxGxTxS, expected["logits"])
  if rows and rows["k_scale"] == "token":
    logits_BxKxGxTxS = contract.scale_columns(logits_BxKxGxTxS, kv_scales.k_token_BxKxS,
                                              rows["k_scale_in"])
  logits_BxKxGxTxS = contract.scale_logits(logits_BxKxGxTxS, prep.scale, expected)

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
  if rows and rows["v_scale"] == "token":
    probs_BxKxGxTxS = contract.scale_columns(probs_BxKxGxTxS, kv_scales.v_token_BxKxS,
                                             rows["v_scale_in"])

  with jax.named_scope(contract.WV_SCOPE):
    out_BxTxKxGxH = jnp.einsum(
        "BKGTS,BSKH->BTKGH", probs_BxKxGxTxS,
        contract.code_operand(v, rows, "v_into_wv").astype(expected["probs"]),
        precision=prep.einsum, preferred_element_type=expected["probs"])
  out_BxTxNxH = out_BxTxKxGxH.reshape(B, T, N, H).astype(q.dtype)
  chex.assert_shape(out_BxTxNxH, (B, T, N, H))
  chex.assert_type(out_BxTxNxH, expected["output"])
  return out_BxTxNxH


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None,
           kv_scales=None):
  """The registry's entry: a phase's `Precision` flags (and cache storage), a dense mask
  or a `CausalMask`; kv_scales: those of a quantized cache, or None."""
  return dot_product_attention(q, k, v, mask=contract.dense_mask(mask),
                               logits_soft_cap=logits_soft_cap, scale=scale,
                               flags=precision.attention, kv_cache=precision.cache_storage,
                               kv_scales=kv_scales,
                               float32_qk_operands=precision.float32_qk_operands(
                                   num_queries=q.shape[1]))


KERNEL = contract.KernelSpec(name=NAME, attend=attend, refusal=contract.honours_everything,
                             float32_qk_form=True)

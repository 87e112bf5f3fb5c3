"""Attention written the way other code bases write it, for `make inspect` and its tests.

None of this is attnprec's attention: each function is someone else's style, so the
inspector can be shown (and tested) on programs it knows nothing about.

Shapes: B batch, T queries, S keys, K kv heads, G query heads per kv head, H head dim,
D model width.
"""
import jax
import jax.numpy as jnp

F32 = jnp.float32


def maxtext_attention(query_BxTxKxGxH, key_BxSxKxH, value_BxSxKxH, *,
                      precision=jax.lax.Precision.HIGHEST, float32_qk_product=True,
                      float32_logits=True):
  """MaxText's `AttentionOp.apply_attention_dot` as it was before its precision fixes:
  q and k are upcast with `astype(float32)` before the QK einsum, the softmax is local
  (max, exp, sum; the wv einsum reads the unnormalised exps and the sum divides its
  output), and `precision` is accepted but never reaches the two einsums (MaxText passed
  `matmul_precision` to them only from 2025)."""
  del precision  # the bug this example reproduces: the knob is silently dropped
  if float32_qk_product:
    query_BxTxKxGxH = query_BxTxKxGxH.astype(F32)
    key_BxSxKxH = key_BxSxKxH.astype(F32)
  logits_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", query_BxTxKxGxH, key_BxSxKxH)
  if float32_logits:
    logits_BxKxGxTxS = logits_BxKxGxTxS.astype(F32)
  T, S = logits_BxKxGxTxS.shape[-2:]
  causal_TxS = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T)
  logits_BxKxGxTxS = jnp.where(causal_TxS, logits_BxKxGxTxS,
                               -0.7 * float(jnp.finfo(F32).max))
  max_BxKxGxTx1 = jnp.max(logits_BxKxGxTxS, axis=-1, keepdims=True)
  exps_BxKxGxTxS = jnp.exp(logits_BxKxGxTxS - max_BxKxGxTx1)
  sum_BxKxGxTx1 = jnp.sum(exps_BxKxGxTxS, axis=-1, keepdims=True)
  out_BxTxKxGxH = jnp.einsum("bkgts,bskd->btkgd", exps_BxKxGxTxS, value_BxSxKxH)
  sum_BxTxKxGx1 = jnp.moveaxis(sum_BxKxGxTx1, -2, 1)
  return (out_BxTxKxGxH / sum_BxTxKxGx1).astype(value_BxSxKxH.dtype)


def maxtext_inputs():
  """(args, kwargs) for `maxtext_attention`: bf16, B=1 T=S=16 K=2 G=2 H=32 (shapes only)."""
  q = jax.ShapeDtypeStruct((1, 16, 2, 2, 32), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 16, 2, 32), jnp.bfloat16)
  return (q, kv, kv), {}


def haiku_mha(params, x_BxTxD):
  """Haiku's own `hk.MultiHeadAttention` (4 heads of 16) with a causal mask."""
  return _haiku_mha().apply(params, x_BxTxD)


def _haiku_mha():
  import haiku as hk

  def forward(x_BxTxD):
    T = x_BxTxD.shape[1]
    mha = hk.MultiHeadAttention(num_heads=4, key_size=16,
                                w_init=hk.initializers.VarianceScaling(1.0))
    return mha(x_BxTxD, x_BxTxD, x_BxTxD, mask=jnp.tril(jnp.ones((1, 1, T, T), bool)))

  return hk.without_apply_rng(hk.transform(forward))


def haiku_mha_inputs(dtype=jnp.bfloat16):
  """(args, kwargs) for `haiku_mha`: bf16 x [2, 8, 64] and its parameters (shapes)."""
  x = jax.ShapeDtypeStruct((2, 8, 64), dtype)
  params = jax.eval_shape(lambda: _haiku_mha().init(jax.random.PRNGKey(0),
                                                    jnp.zeros(x.shape, x.dtype)))
  params = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), params)
  return (params, x), {}


def cudnn_attention(query_BxTxNxH, key_BxSxKxH, value_BxSxKxH):
  """`jax.nn.dot_product_attention(implementation='cudnn')`: cuDNN's fused attention, a
  custom call whose dots are invisible to the inspector; it lowers only where cuDNN is
  installed (`make inspect ... --platform=cuda` elsewhere is refused, saying so)."""
  return jax.nn.dot_product_attention(query_BxTxNxH, key_BxSxKxH, value_BxSxKxH,
                                      is_causal=True, implementation="cudnn")


def cudnn_inputs():
  """(args, kwargs) for `cudnn_attention`: bf16 q, k, v of B=1 T=S=16 N=K=4 H=32."""
  x = jax.ShapeDtypeStruct((1, 16, 4, 32), jnp.bfloat16)
  return (x, x, x), {}


# ----------------------------------------------------------------------------- jax's TPU kernels
# jax's own Pallas TPU attention kernels (jax.experimental.pallas.ops.tpu), on small shapes:
# each is one tpu_custom_call whose Mosaic body `make inspect --platform=tpu` reads back
# (`attnprec.inspect.mosaic`), here or on a TPU. Shapes: N query heads, T = S tokens.
_TPU_T, _TPU_H = 256, 128


def splash_attention(q_NxTxH, k_NxSxH, v_NxSxH):
  """jax's splash attention (MaxText's TPU flash path), causal, 4 heads."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)
  n, t = q_NxTxH.shape[0], q_NxTxH.shape[1]
  kernel = splash.make_splash_mha(masks.MultiHeadMask([masks.CausalMask((t, t))] * n),
                                  head_shards=1, q_seq_shards=1)
  return kernel(q_NxTxH, k_NxSxH, v_NxSxH)


def splash_inputs():
  """(args, kwargs) for `splash_attention`: bf16 q, k, v [4, 256, 128]."""
  x = jax.ShapeDtypeStruct((4, _TPU_T, _TPU_H), jnp.bfloat16)
  return (x, x, x), {}


def tpu_flash_attention(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH):
  """jax.experimental.pallas.ops.tpu.flash_attention, causal."""
  from jax.experimental.pallas.ops.tpu import flash_attention
  return flash_attention.flash_attention(q_BxNxTxH, k_BxNxSxH, v_BxNxSxH, causal=True)


def tpu_flash_inputs():
  """(args, kwargs) for `tpu_flash_attention`: bf16 q, k, v [1, 2, 256, 128]."""
  x = jax.ShapeDtypeStruct((1, 2, _TPU_T, _TPU_H), jnp.bfloat16)
  return (x, x, x), {}


def ragged_paged_attention(q_TxNxH, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
  """jax's ragged paged attention (the TPU serving kernel: a paged KV cache, sequences of
  their own lengths), q 8 heads, kv 2 heads stored combined as 4."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel
  return kernel.ragged_paged_attention(q_TxNxH, kv_pages, kv_lens, page_indices,
                                       cu_q_lens, num_seqs, sm_scale=_TPU_H ** -0.5,
                                       num_kv_pages_per_block=4, num_queries_per_block=16)


def ragged_paged_inputs():
  """(args, kwargs) for `ragged_paged_attention`: 2 sequences, 32 query tokens, pages of
  16 tokens, 8 pages per sequence, bf16."""
  pages, page_size, per_seq, seqs = 32, 16, 8, 2
  return (jax.ShapeDtypeStruct((32, 8, _TPU_H), jnp.bfloat16),
          jax.ShapeDtypeStruct((pages, page_size, 4, _TPU_H), jnp.bfloat16),
          jax.ShapeDtypeStruct((seqs,), jnp.int32),
          jax.ShapeDtypeStruct((seqs, per_seq), jnp.int32),
          jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
          jax.ShapeDtypeStruct((1,), jnp.int32)), {}

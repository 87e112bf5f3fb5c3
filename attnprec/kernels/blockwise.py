"""Blockwise (flash-style) attention in pure JAX, under the precision contract.

Shapes (as `attnprec.contract`): B batch, T queries, S keys, N query heads, K kv heads,
G = N // K, H head dim; Tq / Sk the query / key block lengths, nq / nk the block counts.

The kernel loops (`lax.scan`) over query blocks and, inside, over key/value blocks,
keeping an online softmax: a running max m, a running sum l and an output accumulator.
It never materialises the [T, S] logits: its working set is one [Tq, Sk] block per head.

Masking is given in two ways, ANDed:
  * structured: `causal`, `sliding_window` and the absolute positions `q_positions_BxT`,
    `k_positions_BxS` (semantics of `attnprec.contract.causal_mask`). From the positions
    the kernel bounds every block pair and SKIPS (`lax.cond`) those in which no pair is
    visible: causal prefill computes ~half the blocks, a sliding window O(T * w), and a
    decode step at position p over a cache of S computes only the blocks holding keys
    p - w < k_pos <= p. Positions default to k_pos = arange(S) and
    q_pos = arange(T) + S - T (the queries are the last T keys).
  * dense: `mask`, a bool array broadcastable to [B, N, T, S] as for `dot_product`.
    A dense mask is applied inside each computed block but cannot skip any.
A query that sees no key returns 0 (dot_product returns the mean of v there).

Precision: the same contract table as `attnprec.contract.stage_dtypes`, asserted with
chex in every block (the two dots sit in the contract's named scopes `attn_qk` and
`attn_wv`, inside the loop body), with these documented differences (what flash kernels do):
  * the running sum l and the output accumulator are ALWAYS float32, whatever the
    flags (the running max m is held in the softmax dtype: a max of values of that
    dtype, exact there, so the shift exp(logits - m) needs no cast); so the per-block
    wv dot returns float32
    (`preferred_element_type=float32`) on the table's probability dtype;
  * the probabilities into the wv dot are the un-normalised exp(logits - m) (values in
    [0, 1]); normalisation by l happens once, in float32, on the accumulated output.
Hence with both flags off (everything c) blockwise rounds less than dot_product: only
the logits, exp and probabilities are rounded to c, never the sums or the normalised
output (tests check its float64 error is no larger on sharp attention).

Decode (T == 1): one query block and key blocks of ~`decode_kv_block` (a divisor of S
when there is one near it), sliced straight from the cache as it lies ([B, K, S, H]:
the [B, S, K, H] view the model passes is transposed back, which cancels), never copied
or padded: when Sk does not divide S the last block starts at S - Sk, overlapping the one
before, whose keys it masks. 16-bit keys and values and float8 codes are sliced as their
unsigned bits (uint16, uint8) and each block reinterpreted (the model's cache stores them
so: the reinterpretations cancel), each side on its own. Blocks past the query's
position are skipped, so the work is O(position).
The partial (m, l, acc) of each block are combined online (the split-K combine, done
sequentially: on a 2-core CPU there is nothing to gain from parallel splits).

Block sizes are plain static data: a `BlockSizes` passed in (`Precision.block_sizes`,
part of the jit key, so a new value is a new program), never read from gin while
tracing. The runners read `blockwise.q_block` etc. from gin at configuration time, in the
phase's scope (`decode/blockwise.kv_block = 128` is decode only), into that field.

A quantized KV cache (int8 / float8 codes, float32 scales) follows the contract's cache
rows exactly as dot_product does (`contract.cache_stage_dtypes`): the codes enter each
block's dots cast exactly to the operand dtype, per-token scales are sliced per block.

Gradients: the kernel is differentiable (scan + cond), but reverse mode keeps each
computed block's residuals, so training gains no memory over dot_product; the memory
advantage (O(Tq * Sk) per head instead of O(T * S)) is for prefill and decode.
"""
import dataclasses
import math
from typing import Optional

import chex
import gin
import jax
import jax.numpy as jnp

from attnprec import contract
from attnprec.errors import UserError

NAME = "blockwise"
F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """The kernel's block lengths: hashable static data (a field of `Precision`).

  Defaults measured on a 2-core XLA:CPU at B=1 N=8 H=64 (interleaved): prefill S=4096
  with (Tq, Sk) in {256, 512, 1024}^2 is within ~15% for Tq, Sk <= 512 and 1.3-1.7x
  slower with Sk = 1024; decode over a 16384 cache is fastest with Sk = 512-1024 (256
  pays loop overhead, 2048 reads past the position). Re-measured at SmolLM2's shapes
  (docs/performance.md): 2048 is 0.86x in a full cache but up to 1.9x where the cache
  runs past the query, so decode stays at 512."""
  q_block: int = 512          # Tq: query rows per block (prefill)
  kv_block: int = 256         # Sk: keys per block when T > 1
  decode_kv_block: int = 512  # Sk: keys per block when T == 1 (a decode step)

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"Invalid blockwise.{f.name} = {value!r}: must be an integer "
                        f">= 1.")

  def describe(self) -> str:
    return f"q{self.q_block}/kv{self.kv_block}/decode_kv{self.decode_kv_block}"


# The gin root of the block sizes (`blockwise.q_block = 256`), read by the runners in a
# phase's scope into `Precision.block_sizes`; gin wraps a copy, so BlockSizes(...) in code
# reads no gin.
block_sizes = gin.external_configurable(BlockSizes, "blockwise")


def blockwise_attention(q, k, v, *, mask=None,
                        flags: contract.AttentionFlags = contract.AttentionFlags(),
                        logits_soft_cap=None, scale=None, causal: bool = False,
                        q_positions_BxT=None, k_positions_BxS=None,
                        sliding_window: Optional[int] = None,
                        q_block: Optional[int] = None, kv_block: Optional[int] = None,
                        block_sizes: BlockSizes = BlockSizes(),
                        kv_cache: contract.CacheStorage = contract.COMPUTE_CACHE,
                        kv_scales=None, float32_qk_operands: bool = False,
                        return_stats: bool = False):
  """Flash-style attention; same contract and arguments as `dot_product_attention`.

  Extra args:
    causal: hide keys whose position is greater than the query's.
    q_positions_BxT, k_positions_BxS: int absolute positions (defaults above).
    sliding_window: hide keys at position <= q_pos - sliding_window.
    q_block, kv_block: block lengths (default from `block_sizes`; kv uses
      `decode_kv_block` when T == 1). Clipped to T and S.
    block_sizes: a `BlockSizes` (static; `Precision.block_sizes` in the model).
    kv_cache, kv_scales: a quantized cache's storage and scales, as for
      `dot_product_attention` (the same rows, applied in each block: a per-token key
      scale on the block's logits, a value scale on the block's un-normalised
      probabilities before the wv dot; the running sum l is taken before the value
      scale, so the normalisation is that of the probabilities).
    float32_qk_operands: the QK dot on q and each key block cast exactly to float32
      (`Precision.float32_qk_operands`: a CPU without bf16 dots), as for
      `dot_product_attention`.
    return_stats: also return {"blocks_computed": int32 scalar, "blocks_total": int}.

  Returns:
    [B, T, N, H] in q's dtype (and the stats dict if `return_stats`).
  """
  prep = contract.prepare(q, k, v, flags, scale=scale, kv_cache=kv_cache,
                          kv_scales=kv_scales)
  B, T, N, K, G, H, S = prep.B, prep.T, prep.N, prep.K, prep.G, prep.H, prep.S
  c, expected, rows = q.dtype, prep.stages, prep.rows
  sm = expected["softmax"]
  if sliding_window is not None and (not isinstance(sliding_window, int)
                                     or sliding_window <= 0):
    raise UserError(f"sliding_window must be a positive integer or None, "
                    f"got {sliding_window!r}.")

  sizes = block_sizes
  Tq = min(q_block or sizes.q_block, T)
  if T == 1:
    Sk = min(kv_block, S) if kv_block else decode_block_length(S, sizes)
  else:
    Sk = min(kv_block or sizes.kv_block, S)
  nq, nk = math.ceil(T / Tq), math.ceil(S / Sk)
  Tp, Sp = nq * Tq, nk * Sk

  q_positions_BxT, k_positions_BxS = contract.default_positions(
      q_positions_BxT, k_positions_BxS, B, T, S)
  q_pos_BxTp = _pad(q_positions_BxT.astype(jnp.int32), 1, Tp)
  k_pos_BxSp = _pad(k_positions_BxS.astype(jnp.int32), 1, Sp)
  k_valid_Sp = jnp.arange(Sp) < S
  structured = causal or sliding_window is not None
  need_NQxNK = _blocks_needed(q_pos_BxTp, k_pos_BxSp, T, S, Tq, Sk, causal=causal,
                              sliding_window=sliding_window)

  if float32_qk_operands:
    prep.check_float32_qk_operands(q)
  q_BxTxKxGxH = contract.qk_operand(prep.queries(q), float32_qk_operands)
  q_BxKxGxTpxH = _pad(jnp.transpose(q_BxTxKxGxH, (0, 2, 3, 1, 4)), 3, Tp)
  # A quantized cache's per-token scales, [B, K, Sp] (padding scale 0), sliced per block.
  k_tok = v_tok = None
  if rows and rows["k_scale"] == "token":
    k_tok = _pad(kv_scales.k_token_BxKxS, 2, Sp)
  if rows and rows["v_scale"] == "token":
    v_tok = _pad(kv_scales.v_token_BxKxS, 2, Sp)
  # K/V as [B, K, S, H]: each block's dots are plain batched matmuls over (B, K). The
  # model's cache lies so and passes its [B, S, K, H] view, so the transpose back cancels
  # (a caller's own arrays are transposed once). Slicing the view per block, and padding
  # it, cost 68% of a decode step at 8 x 4001 (SmolLM2), so a decode step pads nothing: a
  # last block that Sk does not divide starts at S - Sk (`clamp`); a prefill pads (the
  # overlap measured 1.01-1.02x there). A decode step over 16-bit values or float8 codes
  # also slices their bits and reinterprets each block (`contract.bits_dtype`, each side
  # on its own): the model's cache holds bf16 / f16 as uint16 and float8 as uint8
  # (`attnprec.cache`), so the two reinterpretations cancel, where XLA:CPU copied the
  # reinterpreted whole cache per layer and step (docs/performance.md).
  clamp = T == 1 and Sp != S
  k_src, v_src = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))
  if T == 1:
    k_src, v_src = (contract.reinterpret(x, contract.bits_dtype(x.dtype))
                    for x in (k_src, v_src))
  if not clamp:
    k_src, v_src = _pad(k_src, 2, Sp), _pad(v_src, 2, Sp)    # no copy when Sk divides S

  def block(x_src, s0, dtype):
    """Sk keys (or values) from s0, as `dtype` values (their bits reinterpreted)."""
    return contract.reinterpret(jax.lax.dynamic_slice_in_dim(x_src, s0, Sk, axis=2), dtype)

  def block_start(j):
    """Where key block j's Sk keys start in k_src (and in every [.., Sp] array)."""
    return jnp.minimum(j * Sk, S - Sk) if clamp else j * Sk
  dense_mask = None if mask is None else _pad_mask(
      contract.group_mask(mask, B, N, K, G, T, S), Tp, Sp)  # [B|1,K|1,G|1,Tp|1,Sp|1]

  def kv_step(i, q_BxKxGxTqxH, qpos_BxTq, carry, j):
    """One key/value block j for query block i: the online-softmax update."""
    m_BxKxGxTq, l_BxKxGxTq, acc_BxKxGxTqxH, count = carry
    s0 = block_start(j)
    # Sk keys; a quantized cache's codes cast (exactly) per block, never the whole cache.
    k_blk = contract.code_operand(block(k_src, s0, k.dtype), rows, "k_into_qk")
    v_blk = contract.code_operand(block(v_src, s0, v.dtype), rows, "v_into_wv")
    with jax.named_scope(contract.QK_SCOPE):
      logits_BxKxGxTqxSk = jnp.einsum(
          "BKGTH,BKSH->BKGTS", q_BxKxGxTqxH,
          contract.qk_operand(k_blk, float32_qk_operands), precision=prep.einsum,
          preferred_element_type=expected["logits"])
    chex.assert_shape(logits_BxKxGxTqxSk, (B, K, G, Tq, Sk))
    chex.assert_type(logits_BxKxGxTqxSk, expected["logits"])
    if k_tok is not None:
      logits_BxKxGxTqxSk = contract.scale_columns(
          logits_BxKxGxTqxSk, jax.lax.dynamic_slice_in_dim(k_tok, s0, Sk, axis=2),
          rows["k_scale_in"])
    logits_BxKxGxTqxSk = contract.scale_logits(logits_BxKxGxTqxSk, prep.scale, expected)
    logits_BxKxGxTqxSk = logits_BxKxGxTqxSk.astype(sm)
    if logits_soft_cap is not None:
      cap = jnp.asarray(logits_soft_cap, sm)
      logits_BxKxGxTqxSk = cap * jnp.tanh(logits_BxKxGxTqxSk / cap)

    if clamp:   # a key of the overlapped last block counts once: from j * Sk on
      allowed = (s0 + jnp.arange(Sk) >= j * Sk)[None, None, None, None]
    else:
      allowed = jax.lax.dynamic_slice_in_dim(k_valid_Sp, s0, Sk)[None, None, None, None]
    if structured:
      kpos_BxSk = jax.lax.dynamic_slice_in_dim(k_pos_BxSp, s0, Sk, axis=1)
      allowed = allowed & contract.visible(qpos_BxTq[:, None, None, :, None],
                                  kpos_BxSk[:, None, None, None, :],
                                  causal=causal, sliding_window=sliding_window)
    if dense_mask is not None:
      allowed = allowed & _mask_block(dense_mask, i * Tq, Tq, s0, Sk)
    logits_BxKxGxTqxSk = jnp.where(allowed, logits_BxKxGxTqxSk,
                                   jnp.asarray(contract.mask_value(sm), sm))

    # The running max m is a max of softmax-dtype logits, so it is held in that dtype
    # (exactly: no rounding; and the shift below needs no float32 -> sm cast, which the
    # audit would rightly read as logits cast down). The running sum, the output
    # accumulator and the correction factors are float32 whatever the flags; exp and the
    # probabilities are in the table's dtype.
    m_new = jnp.maximum(m_BxKxGxTq, jnp.max(logits_BxKxGxTqxSk, axis=-1))
    # Masked entries hold the mask value, so exp(mask value - m) = 0 for every row that has
    # seen a visible key. A row that has not (m is still the mask value) is shifted by 0
    # instead of m, so its masked entries also give 0, not exp(0) = 1: no element-wise
    # re-masking of the probabilities is needed (measured ~1.3x faster).
    shift = jnp.where(m_new > 0.5 * contract.mask_value(sm), m_new, jnp.zeros((), sm))
    probs_BxKxGxTqxSk = jnp.exp(logits_BxKxGxTqxSk - shift[..., None])
    chex.assert_type(probs_BxKxGxTqxSk, expected["probs"])
    correction = jnp.exp(m_BxKxGxTq.astype(F32) - m_new.astype(F32))
    l_new = l_BxKxGxTq * correction + jnp.sum(probs_BxKxGxTqxSk, axis=-1, dtype=F32)
    if v_tok is not None:
      probs_BxKxGxTqxSk = contract.scale_columns(
          probs_BxKxGxTqxSk, jax.lax.dynamic_slice_in_dim(v_tok, s0, Sk, axis=2),
          rows["v_scale_in"])
    with jax.named_scope(contract.WV_SCOPE):
      pv_BxKxGxTqxH = jnp.einsum(
          "BKGTS,BKSH->BKGTH", probs_BxKxGxTqxSk, v_blk.astype(expected["probs"]),
          precision=prep.einsum, preferred_element_type=F32)
    acc_new = acc_BxKxGxTqxH * correction[..., None] + pv_BxKxGxTqxH
    return m_new, l_new, acc_new, count + 1

  def q_step(count, i):
    """Query block i against every key/value block it needs."""
    q_BxKxGxTqxH = jax.lax.dynamic_slice_in_dim(q_BxKxGxTpxH, i * Tq, Tq, axis=3)
    qpos_BxTq = jax.lax.dynamic_slice_in_dim(q_pos_BxTp, i * Tq, Tq, axis=1)
    init = (jnp.full((B, K, G, Tq), contract.mask_value(sm), sm),
            jnp.zeros((B, K, G, Tq), F32), jnp.zeros((B, K, G, Tq, H), F32), count)

    def body(carry, j):
      step = lambda cr: kv_step(i, q_BxKxGxTqxH, qpos_BxTq, cr, j)
      return jax.lax.cond(need_NQxNK[i, j], step, lambda cr: cr, carry), None

    (_, l_BxKxGxTq, acc_BxKxGxTqxH, count), _ = jax.lax.scan(body, init, jnp.arange(nk))
    l_safe = jnp.where(l_BxKxGxTq > 0, l_BxKxGxTq, 1.0)      # a row that saw no key -> 0
    out_BxKxGxTqxH = acc_BxKxGxTqxH / l_safe[..., None]
    return count, out_BxKxGxTqxH.astype(c)

  count, out_NQxBxKxGxTqxH = jax.lax.scan(q_step, jnp.zeros((), jnp.int32), jnp.arange(nq))
  out_BxTxNxH = jnp.transpose(out_NQxBxKxGxTqxH, (1, 0, 4, 2, 3, 5)).reshape(
      B, Tp, N, H)[:, :T]
  chex.assert_shape(out_BxTxNxH, (B, T, N, H))
  chex.assert_type(out_BxTxNxH, expected["output"])
  if return_stats:
    return out_BxTxNxH, {"blocks_computed": count, "blocks_total": nq * nk}
  return out_BxTxNxH


# None, a dense bool mask or a CausalMask -> the masking keyword arguments of `blockwise_attention`
mask_kwargs = contract.structural_mask_kwargs


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None,
           kv_scales=None):
  """The registry's entry: a phase's `Precision` flags (and cache storage), a dense mask
  or a `CausalMask`; kv_scales: those of a quantized cache, or None."""
  return blockwise_attention(q, k, v, **mask_kwargs(mask), logits_soft_cap=logits_soft_cap,
                             scale=scale, block_sizes=precision.block_sizes,
                             flags=precision.attention, kv_cache=precision.cache_storage,
                             kv_scales=kv_scales,
                             float32_qk_operands=precision.float32_qk_operands(
                                 num_queries=q.shape[1]))


KERNEL = contract.KernelSpec(name=NAME, attend=attend, refusal=contract.honours_everything,
                             float32_qk_form=True)


def _blocks_needed(q_pos_BxTp, k_pos_BxSp, T, S, Tq, Sk, *, causal, sliding_window):
  """[nq, nk] bool: block pair (i, j) may hold a visible (query, key) pair.

  Bounds each block by the min/max position over its valid (unpadded) rows and the whole
  batch, so it is conservative (never skips a visible pair) for any positions, sorted or
  not. Every computed block applies the element-wise mask. (A third, mask-free branch for
  fully visible blocks was measured: up to 8% faster with the flags on, 2.4x SLOWER with
  them off on XLA:CPU, and a longer compile, so there is none.)
  """
  big = jnp.iinfo(jnp.int32).max // 2
  Tp, Sp = q_pos_BxTp.shape[1], k_pos_BxSp.shape[1]
  q_valid, k_valid = jnp.arange(Tp) < T, jnp.arange(Sp) < S
  qmin = jnp.where(q_valid, q_pos_BxTp, big).reshape(-1, Tp // Tq, Tq).min((0, 2))
  qmax = jnp.where(q_valid, q_pos_BxTp, -big).reshape(-1, Tp // Tq, Tq).max((0, 2))
  kmin = jnp.where(k_valid, k_pos_BxSp, big).reshape(-1, Sp // Sk, Sk).min((0, 2))
  kmax = jnp.where(k_valid, k_pos_BxSp, -big).reshape(-1, Sp // Sk, Sk).max((0, 2))
  need = jnp.ones((Tp // Tq, Sp // Sk), jnp.bool_)
  if causal:
    need &= kmin[None, :] <= qmax[:, None]
  if sliding_window is not None:
    need &= kmax[None, :] > qmin[:, None] - sliding_window
  return need


def decode_block_length(S: int, sizes: BlockSizes = BlockSizes()) -> int:
  """Sk, the keys per block of a decode step over S keys: the largest divisor of S in
  [decode_kv_block / 2, decode_kv_block], else decode_kv_block; at most S."""
  return min(_divisor_near(S, sizes.decode_kv_block), S)


def _divisor_near(S: int, target: int) -> int:
  """The largest divisor of S in [target / 2, target] (so the cache needs no padding),
  else `target`."""
  for d in range(min(target, S), max(target // 2, 1) - 1, -1):
    if S % d == 0:
      return d
  return target


def _pad(x, axis, length):
  """Zero-pads `axis` of x up to `length`."""
  extra = length - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def _pad_mask(mask, Tp, Sp):
  """Pads a grouped mask's T and S axes (when not broadcast) with False."""
  mask = jnp.asarray(mask)
  for axis, length in ((3, Tp), (4, Sp)):
    if mask.shape[axis] != 1:
      mask = _pad(mask, axis, length)
  return mask


def _mask_block(mask, t0, Tq, s0, Sk):
  """The [.., Tq|1, Sk|1] block of a grouped dense mask at (t0, s0)."""
  if mask.shape[3] != 1:
    mask = jax.lax.dynamic_slice_in_dim(mask, t0, Tq, axis=3)
  if mask.shape[4] != 1:
    mask = jax.lax.dynamic_slice_in_dim(mask, s0, Sk, axis=4)
  return mask

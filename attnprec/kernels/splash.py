"""jax's splash attention behind the precision contract, honestly mapped.

Shapes as `attnprec.contract`: q [B, T, N, H], k/v [B, S, K, H] (GQA natively: splash
maps each query head to its kv head, K/V are not repeated).

`jax.experimental.pallas.ops.tpu.splash_attention` is the TPU's library flash kernel
(MaxText's TPU attention). It has no precision argument; its body fixes one row of the
contract table (read from its source, `splash_attention_kernel.py`, jax 0.10.2):

  the QK dot takes q and k in c with a float32 result (`preferred_element_type`); the
  soft-cap, mask, running max m and sum l, exp and the normalisation in float32; the
  probabilities enter the PV dot as float32 against v upcast to float32, at DEFAULT
  precision (on a TPU one bf16 pass: the platform table's DEFAULT, as in 'flash' and
  'dot_product' there; interpreted on XLA:CPU, float32). The backward pass (its own
  dq and dk/dv kernels, logsumexp residuals) rounds dS and P to c before the dq, dk and
  dv dots, which accumulate in float32: `contract.backward_stage_dtypes`' row.

So of the knobs it honours exactly

  float32_qk_product=True, float32_logits=True, einsum_precision='default'

(and the key offset, which the layer applies before any kernel), and refuses every other
setting by name before anything runs: bf16 logits (its QK result is float32 always),
'highest' or 'high' (its dots take no precision), a quantized cache (no place for the
scales), a platform other than a TPU or XLA:CPU (interpreted there).

The query scale: splash applies none, so the caller scales q. The table puts the scale
on the float32 logits when the QK product is float32; scaling q in c first is the same
number exactly when the scale is a power of two (1/8 for H = 64, 1/16 for H = 256) or
c is float32 (where the table scales q itself). Any other scale in a 16-bit c (1/sqrt(128)
for H = 128) would round q * scale to c, a rounding the table does not make: refused,
naming the scale and the valid ones.

Masks: splash takes its mask when the kernel is made (static), so this wrapper takes
only masks it can build without reading positions: none (every key visible), or a
`contract.CausalMask` with `own_positions` (a sequence attending to itself from
position 0: causal by index, with its sliding window as splash's `LocalMask`). A mask of
other positions (a cache, a decode step, positions given by the caller) or a dense mask
is refused by name: use 'flash', 'blockwise' or 'dot_product' there.

Lengths are padded to a multiple of 128 (splash's blocks) at the end: causal rows never
see the padded keys; without a mask, kv segment ids hide them. Blocks: the largest of
1024, 512, 256, 128 that divides the padded length (1024 x 1024 was splash's fastest
setting on a TPU v5e at 2k and 8k in `results/tpu-flash`).

Its dots sit inside the library (no contract scopes: `qk_scope=None`), like 'jax_nn';
the audit reads them from splash's bodies in the jaxpr, each by its place
(`inspect.pallas_check`), and the call sits in the named scope `SCOPE` so that its
interpreted dots are not taken for projections.
"""
import dataclasses
import math
from typing import Optional

import chex
import jax
import jax.numpy as jnp
import numpy as np

from attnprec import contract
from attnprec.errors import UserError

NAME = "splash"
SUPPORTED = contract.AttentionFlags(float32_qk_product=True, float32_logits=True,
                                    einsum_precision="default")
PLATFORMS = ("tpu", "cpu")
LANES = 128                      # splash's blocks are multiples of this
BLOCKS = (1024, 512, 256, 128)
# The named scope around the library call: its dots (interpreted on XLA:CPU, plain HLO)
# are the kernel's, which the audit reads from its bodies (`inspect.pallas_check`).
SCOPE = "attn_splash"


def refusal(precision, *, logits_soft_cap=None) -> Optional[str]:
  """None if 'splash' honours a `Precision` (its knobs, cache storage and platform), else
  the paragraph that names the bad value and the valid ones."""
  del logits_soft_cap             # splash applies it on the float32 logits, as the table
  storage = precision.cache_storage
  if storage.quantized:
    return (f"The 'splash' attention kernel cannot read a quantized KV cache "
            f"(precision.kv_cache_k_dtype = {storage.k_dtype!r}, "
            f"precision.kv_cache_v_dtype = {storage.v_dtype!r}): jax's splash attention "
            f"has no place for the cache's scales. Valid cache dtypes for 'splash': "
            f"'compute', 'float32', 'bfloat16'. Use kernel 'dot_product' or 'blockwise'.")
  platform = precision.platform() if hasattr(precision, "platform") else "cpu"
  if platform not in PLATFORMS:
    return (f"The 'splash' attention kernel runs on a TPU (Mosaic) or interpreted on "
            f"XLA:CPU, not on platform {platform!r}. Valid platforms for 'splash': "
            f"{', '.join(repr(p) for p in PLATFORMS)}. Use kernel 'dot_product' or "
            f"'blockwise'.")
  return flags_refusal(precision.attention)


def flags_refusal(flags: contract.AttentionFlags) -> Optional[str]:
  knob = flags.differing(dataclasses.replace(SUPPORTED, key_offset=flags.key_offset))
  if knob is None:
    return None
  return (f"The 'splash' attention kernel cannot honour {knob}="
          f"{getattr(flags, knob)!r}: jax's splash attention has no precision argument; "
          f"its QK dot returns float32, its softmax runs in float32 and its dots take "
          f"DEFAULT precision. Valid {knob} for 'splash': {getattr(SUPPORTED, knob)!r}. "
          f"Use kernel 'flash' (a TPU), 'dot_product' or 'blockwise' for other settings.")


def _scale_refusal(scale: float, c, H: int) -> Optional[str]:
  exact = jnp.dtype(c) == jnp.float32 or math.frexp(scale)[0] == 0.5
  if exact:
    return None
  return (f"The 'splash' attention kernel cannot apply the query scale {scale!r} (head "
          f"dim {H}) where the contract puts it: splash scales nothing, so q is scaled "
          f"first, in {jnp.dtype(c).name}, and {scale!r} is not a power of two, so "
          f"q * scale would be rounded to {jnp.dtype(c).name} where the table scales the "
          f"float32 logits. Valid for 'splash' in a 16-bit dtype: a power-of-two scale "
          f"(head dim 64 -> 0.125, 256 -> 0.0625, or a model.query_scale that is one). Use "
          f"kernel 'flash' (a TPU), 'dot_product' or 'blockwise' for this model.")


def _splash_mask(mask, T: int, S: int, Tp: int, Sp: int, N: int):
  """(splash's static mask for [N, Tp, Sp], whether padded keys need hiding)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  if mask is None:
    return sm.MultiHeadMask([sm.FullMask((Tp, Sp))] * N), Sp > S
  if isinstance(mask, contract.CausalMask) and mask.own_positions:
    if T != S:
      raise UserError(f"The 'splash' attention kernel got a CausalMask of own positions "
                      f"with {T} queries over {S} keys; own positions mean the keys are "
                      f"the queries (T = S).")
    w = mask.sliding_window
    one = (sm.CausalMask((Tp, Sp)) if w is None else
           sm.LocalMask((Tp, Sp), window_size=(w - 1, 0), offset=0))
    return sm.MultiHeadMask([one] * N), False
  what = ("a dense mask" if not isinstance(mask, contract.CausalMask) else
          "a causal mask of positions other than the sequence's own 0 .. T-1 (a KV "
          "cache, a decode step, or positions given to the model)")
  raise UserError(f"The 'splash' attention kernel cannot take {what}: splash builds its "
                  f"mask when the kernel is made, from shapes alone, so it takes none "
                  f"(every key visible) or the causal mask of a sequence attending to "
                  f"itself from position 0 (a train step, a forward without a cache). "
                  f"Use kernel 'flash' (a TPU), 'blockwise' or 'dot_product' for this "
                  f"call.")


def _block(n: int) -> int:
  return next(b for b in BLOCKS if n % b == 0)


def splash_attention(q, k, v, *, mask=None, flags: contract.AttentionFlags = SUPPORTED,
                     logits_soft_cap=None, scale=None):
  """Same signature and contract as `dot_product_attention` for the one flag setting it
  supports (module docstring). Compiled or interpreted as the lowering platform says
  (`lax.platform_dependent`, as 'flash'): Mosaic on a TPU, interpreted on CPU, so a
  program lowered for CPU on a TPU machine runs the interpreted body."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as sk)
  why = flags_refusal(flags)
  if why:
    raise UserError(why)
  prep = contract.prepare(q, k, v, flags, scale=scale)
  B, T, S, N, H = prep.B, prep.T, prep.S, prep.N, prep.H
  c, expected = q.dtype, prep.stages
  scale = contract.static_number(NAME, "scale", prep.scale)
  why = _scale_refusal(scale, c, H)
  if why:
    raise UserError(why)
  cap = contract.static_number(NAME, "logits_soft_cap", logits_soft_cap)
  Tp, Sp = -(-T // LANES) * LANES, -(-S // LANES) * LANES
  static_mask, hide_padding = _splash_mask(mask, T, S, Tp, Sp, N)
  bq, bk = _block(Tp), _block(Sp)
  sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                        block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq,
                        block_kv_dq=bk)
  made = {interpret: sk.make_splash_mha(static_mask, head_shards=1, q_seq_shards=1,
                                        block_sizes=sizes, attn_logits_soft_cap=cap,
                                        interpret=interpret)
          for interpret in (True, False)}
  # q scaled in c: exact (a power of two, or c = float32: `_scale_refusal`)
  q_scaled = q * jnp.asarray(scale, c)
  heads = [jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, n - x.shape[1]), (0, 0)))
           for x, n in ((q_scaled, Tp), (k, Sp), (v, Sp))]       # [B, heads, Tp|Sp, H]
  segments = None
  if hide_padding:                 # padded keys: another segment than every query
    segments = sk.SegmentIds(q=jnp.zeros((Tp,), jnp.int32),
                             kv=jnp.asarray(np.arange(Sp) >= S, jnp.int32))
  def run(interpret, *qkv):
    return jax.vmap(lambda q1, k1, v1: made[interpret](q1, k1, v1, segment_ids=segments))(
        *qkv)

  with jax.named_scope(SCOPE):      # its dots, read from its bodies, not as projections
    out_BxNxTpxH = jax.lax.platform_dependent(
        *heads, cpu=lambda *a: run(True, *a), tpu=lambda *a: run(False, *a))
  out_BxTxNxH = jnp.swapaxes(out_BxNxTpxH[:, :, :T], 1, 2).astype(c)
  chex.assert_shape(out_BxTxNxH, (B, T, N, H))
  chex.assert_type(out_BxTxNxH, expected["output"])
  return out_BxTxNxH


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None):
  """The registry's entry: a phase's `Precision` flags, no mask or an own-positions
  `CausalMask`."""
  why = refusal(precision, logits_soft_cap=logits_soft_cap)
  if why:
    raise UserError(why)
  return splash_attention(q, k, v, mask=mask, flags=precision.attention,
                          logits_soft_cap=logits_soft_cap, scale=scale)


KERNEL = contract.KernelSpec(name=NAME, attend=attend, refusal=refusal,
                             qk_scope=None, wv_scope=None, trains=True, call_scope=SCOPE)

"""Flash attention as a Pallas kernel, under the precision contract.

Shapes (as `attnprec.contract`): B batch, T queries, S keys, N query heads, K kv heads,
G = N // K, H head dim. Inside the kernel: R = T * G query rows per kv head (row
t * G + g is query t of head k * G + g: GQA puts a kv head's G query heads side by side,
so one key block serves all of them and a decode step has G rows, not 1), Tq rows per
grid step, Sk keys per step of the in-kernel loop; Rp, Sp, Hp the padded R, S, H.

One `pallas_call` with grid (B, K, Rp / Tq): each program holds q [Tq, Hp] and its kv
head's whole k, v [Sp, Hp] and loops (`fori_loop`; straight-line for one block) over key
blocks of Sk with an online softmax, exactly blockwise's (`attnprec.kernels.blockwise`): the running max m in the
softmax dtype, the running sum l, the corrections and the output accumulator in float32
whatever the flags, exp(logits - m) and the probabilities into the wv dot in the table's
dtype, normalisation by l once, in float32, on the accumulated output. Masks: causal and
sliding window from absolute positions (a `CausalMask`; a decode step's query at
position p over a cache reads the keys p - w < k_pos <= p), a dense bool mask (as int32
[B, K, Rp, Sp]), and always the padding (keys past S). A key block in which no row of
the program sees a key is skipped (`lax.cond` on its position bounds); its k / v are
still in the program's memory (they are one block of the call), so the skip saves the
dots, not the reads. A query that sees no key returns 0, as blockwise.

Precision (`contract.stage_dtypes`, chex-asserted in the kernel body at trace time): the
qk dot takes q and k in c (the query scale on q in c, or on the float32 logits, as the
table says: `Prepared.queries` / `contract.scale_logits`) with
`preferred_element_type` = float32, rounded once to c right after the dot where the
logits are c (Mosaic's matmul accumulates in 32 bits only, so the TPU forces this form;
the interpreted and Triton bodies are the same code); soft-cap, mask, max and exp in the
softmax dtype; the wv dot takes the probabilities and v in the probs dtype and returns
float32. On a TPU an f32 operand at DEFAULT is multiplied in one bf16 pass: float32
probabilities enter the MXU rounded to bf16 there (jax's splash attention does the same;
`make inspect` / the audit read it from the Mosaic body, `attnprec.inspect.mosaic`).
The two dots sit in the contract's named scopes. `attnprec.inspect.pallas_check` reads
the kernel body back from the jaxpr and checks every dot, exp, max and sum against the
table (`make audit` does, for kernel 'pallas'). What a backend compiles the body into
(Mosaic on TPU, Triton on GPU) is not visible here: both accumulate a dot in float32
whatever its declared result type (a bf16 logits dot = an f32 accumulation rounded once
to bf16, as XLA's dots on TPU and GPU).

Knobs: float32_qk_product, float32_logits honoured; einsum_precision 'default' and
'highest' honoured (both dots get it; under 'highest' their operands enter as float32,
the only operands Mosaic multiplies at contract_precision<fp32>); 'high' and every
dot-algorithm preset refused by name: Mosaic's lowering of a dot in a Pallas TPU kernel
takes only DEFAULT and HIGHEST.
The key offset acts before any kernel (the layer subtracts it): honoured. An unscaled
cache (float32 / bfloat16 storage) arrives as c: honoured; a quantized cache (int8 /
float8 codes with scales) is refused by name (the scales have no place in this body yet).
Gradients are not defined (a Pallas call has no autodiff rule here): train with
'dot_product' or 'blockwise'; `jax.grad` through it is a UserError naming the kernel.

Compiled or interpreted: the call is `lax.platform_dependent(cpu=interpreted,
tpu=Mosaic, default=Triton)`, so the lowering platform decides (there is no knob to
forget): on CPU the body runs in Pallas' interpreter; lowered for TPU it is a
`tpu_custom_call` holding the Mosaic kernel; for CUDA (or ROCm) a Triton custom call
(`__gpu$xla.gpu.triton`; Pallas' default GPU backend, Mosaic GPU, has no lowering for a
dot_general in a `pallas_call`, so Triton's compiler parameters select Triton).

Block lengths are kernel constants, not the blockwise knobs: Mosaic wants a block's last
two dims divisible by (8, 128) or equal to the array's, Triton wants every block a power
of two with a dot of at least 16 x 16. So Tq = min(Q_BLOCK, next power of two >= R) and
Sk = min(KV_BLOCK, next power of two >= S), both >= MIN_BLOCK, Hp = the next power of
two >= max(H, MIN_BLOCK); the padded rows, keys and head-dim columns are zeros (exact:
they add 0 to every dot) and masked or sliced off.
"""
import dataclasses
import functools
import math
from typing import Optional

import chex
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from attnprec import contract
from attnprec.errors import UserError

NAME = "pallas"
F32 = jnp.float32
Q_BLOCK = 128    # Tq: query rows (T * G) per program
KV_BLOCK = 128   # Sk: keys per step of the in-kernel loop (a lane-dim multiple of 128)
MIN_BLOCK = 16   # Triton's smallest dot; bf16's (16, 128) TPU tile
PRECISIONS = contract.MOSAIC_PRECISIONS   # the einsum_precision values it honours


def refusal(precision, *, logits_soft_cap=None) -> Optional[str]:
  """None if 'pallas' honours a `Precision` (its knobs and cache storage), else the
  paragraph naming the bad value and the valid ones. The soft-cap is honoured."""
  del logits_soft_cap
  return settings_refusal(precision.attention, precision.cache_storage)


def settings_refusal(flags: contract.AttentionFlags,
                     storage: contract.CacheStorage) -> Optional[str]:
  return contract.pallas_settings_refusal(NAME, flags, storage)


@dataclasses.dataclass(frozen=True)
class Geometry:
  """The static sizes of one call (hashable: part of the kernel body's closure)."""
  B: int; K: int; T: int; G: int; S: int; H: int  # noqa: E702
  Tq: int; Sk: int; Rp: int; Sp: int; Hp: int     # noqa: E702

  @property
  def R(self) -> int:
    return self.T * self.G

  @property
  def grid(self):
    return (self.B, self.K, self.Rp // self.Tq)


def geometry(B, K, T, G, S, H) -> Geometry:
  """Block lengths and padded sizes valid for Mosaic (TPU) and Triton (GPU) alike."""
  pow2 = lambda n: 1 << max(n - 1, 0).bit_length()  # noqa: E731
  R = T * G
  Tq = min(Q_BLOCK, max(MIN_BLOCK, pow2(R)))
  Sk = min(KV_BLOCK, max(MIN_BLOCK, pow2(S)))
  return Geometry(B=B, K=K, T=T, G=G, S=S, H=H, Tq=Tq, Sk=Sk, Rp=math.ceil(R / Tq) * Tq,
                  Sp=math.ceil(S / Sk) * Sk, Hp=pow2(max(H, MIN_BLOCK)))


def make_body(geo: Geometry, stages, *, einsum, scale, logits_soft_cap=None,
              causal=False, sliding_window=None, dense_mask=False,
              platform: str = "interpret"):
  """The kernel body for one geometry and one row of the contract table (`stages`):
  body(q_ref [Tq, Hp], k_ref [Sp, Hp], v_ref [Sp, Hp], qpos_ref [Tq, 1],
       kpos_ref [1, Sp], (mask_ref [Tq, Sp] int32,) o_ref [Tq, Hp]).

  platform: 'interpret' (CPU), 'tpu' or 'gpu'. One body for all three: the qk dot returns
  float32 and c logits are that result rounded once to c (Mosaic's matmul accumulates in
  32 bits only, so this is the form the TPU forces; the interpreter computes the same);
  under einsum_precision 'highest' both dots take float32 operands (Mosaic refuses
  contract_precision<fp32> on 16-bit ones). The GPU body alone divides 16-bit logits by
  the soft-cap in float32 and rounds the quotient to their dtype (Triton's lowering has
  no 16-bit division; the result is the 16-bit quotient exactly: float32 has more than
  2 * 8 + 2 bits). Interpreted on XLA:CPU, the rounding of c logits holds only with
  excess precision off (`attnprec.xla_env`, which every runner and test sets): XLA:CPU
  otherwise drops the f32 -> c -> f32 round trip and keeps float32 logits."""
  divide32 = platform == "gpu"
  # 'highest': float32 operands into both matmuls (Mosaic takes contract_precision<fp32>
  # only on f32 operands; 16-bit values are exact in f32, so the products are the same).
  highest = einsum == jax.lax.Precision.HIGHEST
  operand = (lambda x: x.astype(F32)) if highest else (lambda x: x)
  Tq, Sk, S = geo.Tq, geo.Sk, geo.S
  nk = geo.Sp // Sk
  sm, c = stages["softmax"], stages["output"]
  mask_value = contract.mask_value(sm)
  structured = causal or sliding_window is not None

  def body(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, *refs):
    mask_ref, o_ref = refs if dense_mask else (None,) + refs
    q_TqxHp = q_ref[...]
    chex.assert_type(q_TqxHp, stages["qkv"])
    qpos_Tqx1 = qpos_ref[...]

    def kv_step(j, carry):
      m_Tqx1, l_Tqx1, acc_TqxHp = carry
      start = 0 if nk == 1 else pl.multiple_of(j * Sk, Sk)
      keys = pl.ds(start, Sk)
      k_SkxHp, v_SkxHp = k_ref[keys, :], v_ref[keys, :]
      with jax.named_scope(contract.QK_SCOPE):
        # One form on every platform: a float32 result, rounded once to c where the
        # logits are c (Mosaic's matmul accumulates in 32 bits only; so do Triton's and
        # XLA:CPU's, so this is what a c-result dot computes everywhere).
        logits_TqxSk = jnp.einsum(
            "TH,SH->TS", operand(q_TqxHp), operand(k_SkxHp), precision=einsum,
            preferred_element_type=F32)
        logits_TqxSk = logits_TqxSk.astype(stages["logits"])
      chex.assert_shape(logits_TqxSk, (Tq, Sk))
      chex.assert_type(logits_TqxSk, stages["logits"])
      logits_TqxSk = contract.scale_logits(logits_TqxSk, scale, stages).astype(sm)
      if logits_soft_cap is not None:
        cap = jnp.asarray(logits_soft_cap, sm)
        if divide32 and jnp.dtype(sm).itemsize < 4:
          scaled_TqxSk = (logits_TqxSk.astype(F32) / jnp.asarray(cap, F32)).astype(sm)
        else:
          scaled_TqxSk = logits_TqxSk / cap
        logits_TqxSk = cap * jnp.tanh(scaled_TqxSk)
      allowed = start + jax.lax.broadcasted_iota(jnp.int32, (Tq, Sk), 1) < S
      if structured:
        allowed &= contract.visible(qpos_Tqx1, kpos_ref[:, keys], causal=causal,
                                    sliding_window=sliding_window)
      if dense_mask:
        allowed &= mask_ref[:, keys] != 0
      logits_TqxSk = jnp.where(allowed, logits_TqxSk, jnp.asarray(mask_value, sm))
      # The running max m: a max of softmax-dtype logits, exact in that dtype. A row that
      # has seen no key yet (m = mask value) shifts by 0, so its masked entries give 0.
      m_new = jnp.maximum(m_Tqx1, jnp.max(logits_TqxSk, axis=1, keepdims=True))
      shift = jnp.where(m_new > 0.5 * mask_value, m_new, jnp.zeros((), sm))
      probs_TqxSk = jnp.exp(logits_TqxSk - shift)
      chex.assert_type(probs_TqxSk, stages["probs"])
      correction = jnp.exp(m_Tqx1.astype(F32) - m_new.astype(F32))
      l_new = l_Tqx1 * correction + jnp.sum(probs_TqxSk.astype(F32), axis=1,
                                            keepdims=True)
      with jax.named_scope(contract.WV_SCOPE):
        pv_TqxHp = jnp.einsum("TS,SH->TH", operand(probs_TqxSk),
                              operand(v_SkxHp.astype(stages["probs"])),
                              precision=einsum, preferred_element_type=F32)
      return m_new, l_new, acc_TqxHp * correction + pv_TqxHp

    def maybe_step(j, carry):
      if not structured:
        return kv_step(j, carry)
      # Skip a key block no row of this program sees (positions bound it; padding keys
      # repeat the last position, so they widen no bound).
      kpos_1xSk = kpos_ref[:, pl.ds(0 if nk == 1 else pl.multiple_of(j * Sk, Sk), Sk)]
      need = True
      if causal:
        need = jnp.min(kpos_1xSk) <= jnp.max(qpos_Tqx1)
      if sliding_window is not None:
        need = jnp.logical_and(need, jnp.max(kpos_1xSk) > jnp.min(qpos_Tqx1) - sliding_window)
      return jax.lax.cond(need, functools.partial(kv_step, j), lambda cr: cr, carry)

    init = (jnp.full((Tq, 1), mask_value, sm), jnp.zeros((Tq, 1), F32),
            jnp.zeros((Tq, geo.Hp), F32))
    if nk == 1:     # one key block: no loop, no skip (a smaller program to compile)
      _, l_Tqx1, acc_TqxHp = kv_step(0, init)
    else:
      _, l_Tqx1, acc_TqxHp = jax.lax.fori_loop(0, nk, maybe_step, init)
    l_safe = jnp.where(l_Tqx1 > 0, l_Tqx1, 1.0)          # a row that saw no key -> 0
    o_ref[...] = (acc_TqxHp / l_safe).astype(c)

  return body


def call(geo: Geometry, make, dense_mask: bool, platform: str):
  """The `pallas_call` of `body` for 'interpret' (CPU), 'tpu' (Mosaic) or 'gpu' (Triton):
  f(q [B, K, Rp, Hp], k, v [B, K, Sp, Hp], qpos [B, Rp, 1], kpos [B, 1, Sp],
    (mask [B, K, Rp, Sp] int32)) -> [B, K, Rp, Hp]."""
  Tq, Sp, Hp = geo.Tq, geo.Sp, geo.Hp
  sq = pl.squeezed
  in_specs = [pl.BlockSpec((sq, sq, Tq, Hp), lambda b, h, i: (b, h, i, 0)),
              pl.BlockSpec((sq, sq, Sp, Hp), lambda b, h, i: (b, h, 0, 0)),
              pl.BlockSpec((sq, sq, Sp, Hp), lambda b, h, i: (b, h, 0, 0)),
              pl.BlockSpec((sq, Tq, 1), lambda b, h, i: (b, i, 0)),
              pl.BlockSpec((sq, 1, Sp), lambda b, h, i: (b, 0, 0))]
  if dense_mask:
    in_specs.append(pl.BlockSpec((sq, sq, Tq, Sp), lambda b, h, i: (b, h, i, 0)))
  params = {"interpret": None,
            "tpu": pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
            "gpu": pltriton.CompilerParams(num_warps=4, num_stages=2)}[platform]
  def run(q, *rest):
    return pl.pallas_call(
        make(platform=platform), grid=geo.grid, in_specs=in_specs,
        out_specs=pl.BlockSpec((sq, sq, Tq, Hp), lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=platform == "interpret", compiler_params=params, name="attn_pallas",
    )(q, *rest)

  return run


def pallas_attention(q, k, v, *, mask=None,
                     flags: contract.AttentionFlags = contract.AttentionFlags(),
                     logits_soft_cap=None, scale=None, causal: bool = False,
                     q_positions_BxT=None, k_positions_BxS=None,
                     sliding_window: Optional[int] = None,
                     kv_cache: contract.CacheStorage = contract.COMPUTE_CACHE,
                     kv_scales=None, stages=None):
  """Flash attention in Pallas; same contract and arguments as `blockwise_attention`
  (positions default to k_pos = arange(S), q_pos = the last T of them).

  stages: the table row the body is built from; None (always, outside tests) = the
  row for `flags` (`contract.stage_dtypes`). A test passes another row to build a
  variant that the audit (`attnprec.inspect.pallas_check`) must reject.

  Returns [B, T, N, H] in q's dtype."""
  prep = contract.prepare(q, k, v, flags, scale=scale, kv_cache=kv_cache,
                          kv_scales=kv_scales)
  why = settings_refusal(flags, kv_cache)
  if why:
    raise UserError(why)
  B, T, N, K, G, H, S = prep.B, prep.T, prep.N, prep.K, prep.G, prep.H, prep.S
  if sliding_window is not None and (not isinstance(sliding_window, int)
                                     or sliding_window <= 0):
    raise UserError(f"sliding_window must be a positive integer or None, "
                    f"got {sliding_window!r}.")
  stages = prep.stages if stages is None else stages
  # One jitted program (eager calls compile it once per setting, not op by op); the body
  # builder is part of its key, so a test's variant of `make_body` is a new program.
  return _attention(prep.queries(q), k, v, q_positions_BxT, k_positions_BxS, mask,
                    geo=geometry(B, K, T, G, S, H), stages=tuple(stages.items()),
                    einsum=prep.einsum, scale=prep.scale, logits_soft_cap=logits_soft_cap,
                    causal=causal, sliding_window=sliding_window, make_body=make_body)


@functools.partial(jax.jit, static_argnames=(
    "geo", "stages", "einsum", "scale", "logits_soft_cap", "causal", "sliding_window",
    "make_body"))
def _attention(q_BxTxKxGxH, k, v, q_positions_BxT, k_positions_BxS, mask, *, geo, stages,
               einsum, scale, logits_soft_cap, causal, sliding_window, make_body):
  """`pallas_attention` after its checks: layout, padding, the platform's pallas_call."""
  B, K, T, G, S, H = geo.B, geo.K, geo.T, geo.G, geo.S, geo.H
  N, R, Rp, Sp, Hp = K * G, geo.R, geo.Rp, geo.Sp, geo.Hp
  stages = dict(stages)
  q_BxKxRxH = jnp.transpose(q_BxTxKxGxH, (0, 2, 1, 3, 4)).reshape(B, K, R, H)
  q_BxKxRpxHp = _pad(q_BxKxRxH, ((0, Rp - R), (0, Hp - H)))
  k_BxKxSpxHp, v_BxKxSpxHp = (_pad(jnp.transpose(x, (0, 2, 1, 3)), ((0, Sp - S), (0, Hp - H)))
                              for x in (k, v))
  q_positions_BxT, k_positions_BxS = contract.default_positions(
      q_positions_BxT, k_positions_BxS, B, T, S)
  # Row positions (query t of each of the G heads); padding repeats the last position.
  qpos_BxR = jnp.repeat(q_positions_BxT.astype(jnp.int32), G, axis=1)
  qpos_BxRpx1 = jnp.pad(qpos_BxR, ((0, 0), (0, Rp - R)), mode="edge")[:, :, None]
  kpos_Bx1xSp = jnp.pad(k_positions_BxS.astype(jnp.int32), ((0, 0), (0, Sp - S)),
                        mode="edge")[:, None, :]
  operands = [q_BxKxRpxHp, k_BxKxSpxHp, v_BxKxSpxHp, qpos_BxRpx1, kpos_Bx1xSp]
  if mask is not None:
    grouped = jnp.broadcast_to(contract.group_mask(mask, B, N, K, G, T, S), (B, K, G, T, S))
    mask_BxKxRxS = jnp.transpose(grouped, (0, 1, 3, 2, 4)).reshape(B, K, R, S)
    operands.append(_pad(mask_BxKxRxS.astype(jnp.int32), ((0, Rp - R), (0, Sp - S))))

  make = functools.partial(make_body, geo, stages, einsum=einsum, scale=scale,
                           logits_soft_cap=logits_soft_cap, causal=causal,
                           sliding_window=sliding_window, dense_mask=mask is not None)
  branch = lambda platform: call(geo, make, mask is not None, platform)  # noqa: E731
  out_BxKxRpxHp = _no_gradient(lambda *xs: jax.lax.platform_dependent(
      *xs, cpu=branch("interpret"), tpu=branch("tpu"), default=branch("gpu")))(*operands)
  out_BxTxNxH = jnp.transpose(out_BxKxRpxHp[:, :, :R, :H].reshape(B, K, T, G, H),
                              (0, 2, 1, 3, 4)).reshape(B, T, N, H)
  chex.assert_shape(out_BxTxNxH, (B, T, N, H))
  chex.assert_type(out_BxTxNxH, stages["output"])
  return out_BxTxNxH


# None, a dense bool mask or a CausalMask -> the masking keyword arguments of `pallas_attention`
mask_kwargs = contract.structural_mask_kwargs


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None,
           kv_scales=None):
  """The registry's entry: a phase's `Precision` flags (and cache storage), a dense mask
  or a `CausalMask`; kv_scales: those of a quantized cache (refused), or None."""
  return pallas_attention(q, k, v, **mask_kwargs(mask), logits_soft_cap=logits_soft_cap,
                          scale=scale, flags=precision.attention,
                          kv_cache=precision.cache_storage, kv_scales=kv_scales)


KERNEL = contract.KernelSpec(name=NAME, attend=attend, refusal=refusal, trains=False)


def _no_gradient(f):
  """f, whose derivative is a UserError naming the kernel (not a Pallas internal error)."""
  f = jax.custom_jvp(f)

  @f.defjvp
  def _jvp(primals, tangents):
    raise UserError("The 'pallas' attention kernel has no gradient (a Pallas call has no "
                    "differentiation rule here); train with precision.kernel = "
                    "'dot_product' or 'blockwise' (valid kernels for the train phase).")

  return f


def _pad(x, widths):
  """Zero-pads the last two axes of x by `widths` ((before, after) per axis)."""
  if all(w == (0, 0) for w in widths):
    return x
  return jnp.pad(x, ((0, 0),) * (x.ndim - 2) + tuple(widths))

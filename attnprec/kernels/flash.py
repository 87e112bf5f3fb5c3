"""A Pallas TPU flash-attention kernel, forward and backward, under the precision contract.

Shapes (as `attnprec.contract`): B batch, T queries, S keys, N query heads, K kv heads,
G = N // K, H head dim. Inside the kernel: R = T * G query rows per kv head (row
t * G + g is query t of head k * G + g: the G query heads of a kv head are packed into
rows, so one K/V block serves all of them, and K/V are never repeated), Tq rows per
q block, Sk keys per kv block; Rp, Sp, Hp the padded R, S, H.

Forward: one `pallas_call`, grid (B, K, Rp / Tq, Sp / Sk); the kv axis is the last grid
dimension ('arbitrary': sequential), so K/V stream through VMEM block by block while the
q block, the running max m and sum l ([Tq, 1]) and the output accumulator ([Tq, Hp]) stay
in float32 VMEM scratch (an online softmax, exactly blockwise's: `attnprec.kernels.
blockwise`). Masks: causal and sliding window from absolute positions (a `CausalMask`),
a dense bool mask, and always the key padding. Hidden blocks are skipped twice: the
kv index map clamps a hidden block to the nearest visible one (the same block index as
the step before, so Pallas issues no DMA for it), and the body computes nothing there
(`pl.when`). The per-block position bounds come in as scalar-prefetch arrays (SMEM),
computed outside from the positions, so any positions work (a batch of caches at
different lengths); a block every one of whose pairs is visible runs without the mask.

Decode (`decode_geometry`): a call of at most `DECODE_ROWS` rows per kv head run without
a gradient reads its keys in blocks of `Blocks.decode_k`, the cache unpadded (a last
partial block masked, its values and scales zeroed), a 64-wide head keys-minor ([H, S]
blocks: XLA:TPU's own layout of such a cache), and, given a stack of layers' caches and
a layer (`layer=`: a scanned model's cache), that layer in place, its index one more
scalar-prefetch value in the block index maps.

Backward (`jax.custom_vjp`, residuals q, k, v, the output and the float32 logsumexp):
two kernels, dq (grid (B, K, q blocks, kv blocks), the kv axis arbitrary, a float32 dq
accumulator) and dk/dv (grid (B, K, kv blocks, q blocks), the q axis arbitrary, float32
dk and dv accumulators), each recomputing the logits exactly as the forward does.

Precision: the forward is the contract table's row (`contract.stage_dtypes`, chex-asserted
in the body at trace time): the qk dot takes q and k in c with a float32 result, rounded
once to c right after the dot where the logits are c (Mosaic's matmul accumulates in 32
bits only: this is what a c-result dot computes on a TPU); the query scale on q in c or
on the float32 logits as the table says; soft-cap, mask, max and exp in the softmax
dtype (with both flags and no soft-cap in base 2: the logits times scale * log2(e),
exp2 for exp: `Spec.base2`); m, l, the corrections and the accumulator in float32; the probabilities into the
wv dot in the probs dtype with a float32 result; normalisation by l once, in float32. On a
TPU an f32 operand at DEFAULT is multiplied in one bf16 pass (the platform table).
The backward pass (`contract.BACKWARD`): the logits recomputed as the forward's (the
same dtypes), P = exp(logits - logsumexp) in float32, dP = dO V^T and dS = P (dP - delta)
in float32 (delta = rowsum(dO * O) in float32; the soft-cap's derivative and the query
scale on float32 logits applied to dS in float32), then P and dS rounded to c before the
dv = P^T dO, dq = dS K and dk = dS^T Q dots, which accumulate in float32 (jax's splash
attention rounds the same two). With c = float32 nothing is rounded. 'highest': every dot
of both passes takes float32 operands (the only ones Mosaic multiplies at
contract_precision<fp32>; 16-bit values are exact in f32). The two forward dots sit in
the contract's named scopes, the backward's in `contract.GRAD_SCOPE`; `attnprec.inspect.
pallas_check` reads the bodies back from the jaxpr (`make audit`).

Knobs: float32_qk_product, float32_logits, einsum_precision 'default' / 'highest' and the
key offset (applied by the layer before any kernel) honoured; 'high' and dot-algorithm
presets refused by name (Mosaic takes only DEFAULT and HIGHEST); a quantized cache
(int8 / float8 codes with float32 scales) read in the forward body as the contract's
cache rows say (codes cast exactly to the dot's operand dtype, a per-token key scale on
the logits right after the QK dot, a value scale on the probabilities before the PV dot,
a per-channel key scale on q before the call), its gradient refused by name (a cache is
read-only); CUDA refused by name (a TPU
kernel: its grid accumulates in sequential scratch, which Triton has no form for; the
portable kernel is 'pallas').

Compiled or interpreted: `lax.platform_dependent(cpu=interpreted, tpu=Mosaic)`: the
lowering platform decides; on CPU Pallas' interpreter runs the same body.

Block sizes (`Blocks`, defaults measured on a TPU v5e: docs/performance.md): Tq a
multiple of 16 (a bf16 tile's rows), Sk a multiple of 128 (the lane width); a call's
blocks are clipped to its padded sizes (a decode step's G rows run one 16-row block).
Hp = H when H is a multiple of 64, else H padded to a multiple of 128. `vmem_limit_bytes`
is set from the blocks' footprint; blocks that do not fit `VMEM_CAP` are refused before
anything runs.
"""
import dataclasses
import functools
import math
from typing import Optional, Tuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnprec import contract
from attnprec.errors import UserError

NAME = "flash"
F32 = jnp.float32
PRECISIONS = contract.MOSAIC_PRECISIONS
ROW_MULTIPLE, KEY_MULTIPLE = 16, 128
VMEM_CAP = 96 * 2 ** 20       # of a v5e TensorCore's 128 MiB VMEM
BIG = 0.7 * float(jnp.finfo(jnp.float32).max)   # logsumexp of a row that sees no key
PAD_POSITION = -2 ** 30   # a padded query row's position under a causal mask
HIDDEN_POSITION = 2 ** 31 - 1   # a key past S in a masked block: after every query
LOG2E = 1.4426950408889634      # log2(e): exp(x) = exp2(x * LOG2E)


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Rows (q) and keys (k) per block, forward and backward. The defaults were the fastest
  of 7 settings (128-2048) on a TPU v5e at Qwen2-7B's shape, prefill 2k-32k and forward +
  backward 2k and 8k (results/tpu-flash/sweep.md)."""
  q: int = 1024
  k: int = 1024
  q_bwd: int = 1024
  k_bwd: int = 1024
  chunk: int = 512   # keys per step in a block on the mask's edge (`Geometry.chunk`)
  # keys per block of a call with few rows and no gradient (a decode step: `DECODE_ROWS`)
  decode_k: int = 4096
  # rows per q block, both passes, of a call read where the caller holds it
  # (`direct_geometries`): 2048 was the fastest of 1024 and 2048 at Qwen2-7B's shape,
  # every case of results/tpu-flash/sweep4.md
  direct_q: int = 2048

  def describe(self) -> str:
    return (f"fwd {self.q}x{self.k} bwd {self.q_bwd}x{self.k_bwd} chunk {self.chunk} "
            f"decode k {self.decode_k} direct q {self.direct_q}")


DEFAULT_BLOCKS = Blocks()


def refusal(precision, *, logits_soft_cap=None) -> Optional[str]:
  """None if 'flash' honours a `Precision`, else the paragraph naming the bad value."""
  del logits_soft_cap
  platform = precision.platform() if hasattr(precision, "platform") else "cpu"
  if platform not in ("cpu", "tpu"):
    return (f"The 'flash' attention kernel runs on a TPU (Mosaic) or interpreted on CPU, "
            f"not on platform {platform!r}: its grid accumulates in sequential VMEM "
            f"scratch, which the GPU's Triton lowering has no form for. Valid platforms "
            f"for 'flash': 'tpu', 'cpu'. Use kernel 'pallas' (portable) or 'blockwise'.")
  return settings_refusal(precision.attention, precision.cache_storage)


def settings_refusal(flags: contract.AttentionFlags,
                     storage: contract.CacheStorage) -> Optional[str]:
  return contract.pallas_settings_refusal(NAME, flags, storage, reads_scales=True)


# ----------------------------------------------------------------------------- geometry
# A head dim below this many lanes: XLA:TPU lays a [.., S, H] array out with S minor
# (measured on a TPU v5e: bf16[8,2,32768,64]{2,3,1,0:T(8,128)(2,1)}: unpadded), so the
# decode geometry reads keys and values as [H, S] blocks, which that layout is without a
# copy; as [S, H] blocks every step first transposed the whole cache (flash decode at
# 0.26x the dense kernel's speed, results/tpu-decode).
KEYS_MINOR_BELOW = 128
# A call of at most this many query rows per kv head (T * G: a decode step, a few tokens
# of a speculative step) run without a gradient reads its keys in blocks of
# `Blocks.decode_k`, the keys unpadded (`decode_geometry`).
DECODE_ROWS = 128


@dataclasses.dataclass(frozen=True)
class Geometry:
  """The static sizes of one call and one pass (hashable: part of the body's closure)."""
  B: int; K: int; T: int; G: int; S: int; H: int  # noqa: E702
  Tq: int; Sk: int; Rp: int; Sp: int; Hp: int     # noqa: E702
  # keys per step of a block on the mask's edge: such a block runs chunk by chunk,
  # skipping the chunks no row of its q block sees (`Blocks.chunk`, or 128 where it does
  # not divide Sk)
  chunk: int = 128
  # whether k / v (and their scales) are padded to Sp; False: a last key block past S
  # reads what lies beyond the array (Mosaic: unspecified values; interpreted: NaN), which
  # the body masks, values and scales included (`decode_geometry`)
  pad_keys: bool = True
  # whether k / v enter as [B, K, Hp, S] (keys minor: `decode_geometry`), else [B, K, S, Hp]
  keys_minor: bool = False
  # whether k / v (and their scales) are a stack of layers' caches with a leading L axis,
  # the layer read given as one more scalar-prefetch value (`flash_attention(layer=)`)
  stacked: bool = False
  # whether q / o (and dq, dO) enter as the caller's [B, T, N * H] and k / v (dk, dv) as
  # [B, S, K * H], unmoved (`direct_geometries`): a q block is Tt positions of the G query
  # heads of a kv head, gathered in VMEM into Tq = G * Tt rows, head-major (row g * Tt + t
  # is position i * Tt + t of the group's head g); else q is [B, K, Rp, Hp] in rows
  # t * G + g and k / v [B, K, S(p), Hp], moved there by XLA around the call
  direct: bool = False
  Tt: int = 0   # positions per q block (direct)

  @property
  def n_prefetch(self) -> int:
    return N_PREFETCH + (1 if self.stacked else 0)

  @property
  def R(self) -> int:
    return self.T * self.G

  @property
  def nq(self) -> int:
    return self.Rp // self.Tq

  @property
  def nk(self) -> int:
    return self.Sp // self.Sk



def _up(n: int, m: int) -> int:
  return -(-n // m) * m


def padded_head(H: int) -> int:
  return H if H % 64 == 0 else _up(H, 128)


def geometries(B, K, T, G, S, H, blocks: Blocks) -> Tuple[Geometry, Geometry]:
  """The forward's and the backward's geometry for one call. Both passes tile the same
  padded rows and keys (they share the residuals): a call shorter than both passes'
  blocks runs one block of its own (rounded up to the tile), a longer one pads to a
  multiple of both blocks."""
  R = T * G

  def lengths(n, a, b, multiple):
    if n <= min(a, b):
      one = _up(n, multiple)
      return one, one, one
    return a, b, _up(n, math.lcm(a, b))

  Tf, Tb, Rp = lengths(R, blocks.q, blocks.q_bwd, ROW_MULTIPLE)
  Sf, Sb, Sp = lengths(S, blocks.k, blocks.k_bwd, KEY_MULTIPLE)
  make = lambda Tq, Sk: Geometry(  # noqa: E731
      B=B, K=K, T=T, G=G, S=S, H=H, Tq=Tq, Sk=Sk, Rp=Rp, Sp=Sp, Hp=padded_head(H),
      chunk=blocks.chunk if Sk % blocks.chunk == 0 else KEY_MULTIPLE)
  return make(Tf, Sf), make(Tb, Sb)


def direct_geometries(B, K, T, G, S, H, blocks: Blocks
                      ) -> Optional[Tuple[Geometry, Geometry]]:
  """The forward's and the backward's geometry reading q, k, v and writing o, dq, dk, dv
  where the caller holds them (`Geometry.direct`), or None where that cannot tile: a head
  dim that is not a whole number of lanes (128), or lengths the blocks do not divide
  (T by Tt, S by both passes' key blocks). Tt, the positions per q block, is the largest
  power of two with G * Tt within `Blocks.direct_q` rows, at most T; both passes share
  it (the logsumexp residual is in its row order).
  Measured on a TPU v5e (results/tpu-flash/profile_ops-2k.json): around the kernel, the
  copies that pack a kv head's query heads into rows and unpack the output took 0.25 ms
  of a 2k prefill whose kernel took 0.375 ms."""
  if H % KEY_MULTIPLE:
    return None
  Tt = 1
  while 2 * Tt * G <= blocks.direct_q:
    Tt *= 2
  Tt = min(Tt, T)
  if Tt % ROW_MULTIPLE or T % Tt:
    return None
  if S <= min(blocks.k, blocks.k_bwd):
    Sf = Sb = S
  else:
    Sf, Sb = blocks.k, blocks.k_bwd
  if S % KEY_MULTIPLE or S % math.lcm(Sf, Sb):
    return None
  make = lambda Sk: Geometry(  # noqa: E731
      B=B, K=K, T=T, G=G, S=S, H=H, Tq=G * Tt, Sk=Sk, Rp=G * T, Sp=S, Hp=H,
      chunk=blocks.chunk if Sk % blocks.chunk == 0 else KEY_MULTIPLE, direct=True, Tt=Tt)
  return make(Sf), make(Sb)


def decodes(rows: int, blocks: Blocks, dense_mask: bool) -> bool:
  """Whether a call of `rows` query rows per kv head (T x G) runs the decode geometry
  without a gradient (`decode_geometry`): at most `DECODE_ROWS` rows, within one q block
  of either pass (so one block of rows), and no dense mask."""
  return not dense_mask and rows <= min(DECODE_ROWS, blocks.q, blocks.q_bwd)


def decode_geometry(fwd: Geometry, blocks: Blocks, dense_mask: bool) -> Optional[Geometry]:
  """The geometry of the forward run without a gradient (`_primal`) where it differs from
  the forward's (`decodes`): its keys in blocks of `decode_k` (fewer grid steps: each
  costs about as much as reading a 1k-key block of a 64-wide head), nothing padded, so a
  cache whose length the block does not divide is not copied per step. None: use
  `fwd`."""
  if not decodes(fwd.R, blocks, dense_mask):
    return None
  Sk = min(blocks.decode_k, _up(fwd.S, KEY_MULTIPLE))
  chunk = blocks.chunk if Sk % blocks.chunk == 0 else KEY_MULTIPLE
  return dataclasses.replace(fwd, Sk=Sk, Sp=_up(fwd.S, Sk), chunk=chunk, pad_keys=False,
                             keys_minor=fwd.Hp < KEYS_MINOR_BELOW)


def vmem_bytes(Tq: int, Sk: int, Hp: int, itemsize: int, dense_mask: bool,
               backward: bool) -> int:
  """An upper estimate of one program's VMEM: double-buffered blocks, scratch, and a
  few [Tq, Sk] float32 temporaries."""
  blocks = 2 * itemsize * (2 * Tq * Hp + 2 * Sk * Hp) + 2 * 4 * 2 * Tq
  if backward:
    blocks += 2 * itemsize * 2 * Tq * Hp + 2 * itemsize * 2 * Sk * Hp
  if dense_mask:
    blocks += 2 * 4 * Tq * Sk
  scratch = 4 * (Tq * Hp + 2 * Tq * 128) + (4 * 2 * Sk * Hp if backward else 0)
  return blocks + scratch + 4 * 4 * Tq * Sk * (2 if backward else 1)


def check_blocks(blocks: Blocks, H: int, itemsize: int = 2, dense_mask: bool = False,
                 platform: str = "tpu") -> None:
  """A `UserError` naming a block size that Mosaic cannot tile or that does not fit."""
  for name in ("q", "k", "q_bwd", "k_bwd", "chunk", "decode_k", "direct_q"):
    value = getattr(blocks, name)
    multiple = ROW_MULTIPLE if name.startswith("q") or name == "direct_q" else KEY_MULTIPLE
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 \
        or value % multiple:
      raise UserError(
          f"The 'flash' kernel's block size {name}={value!r} cannot be tiled on "
          f"{platform}: {'query-row' if multiple == ROW_MULTIPLE else 'key'} blocks must "
          f"be positive multiples of {multiple} (a {'bf16 tile' if multiple == 16 else 'lane width'}"
          f"). Valid values: {multiple}, {2 * multiple}, ... e.g. 256, 512, 1024.")
  for name in ("k", "k_bwd", "decode_k"):
    if getattr(blocks, name) % blocks.chunk:
      raise UserError(
          f"The 'flash' kernel's chunk={blocks.chunk} does not divide its key block "
          f"{name}={getattr(blocks, name)}: a block on the mask's edge runs in chunks of "
          f"the block (a call shorter than the block uses 128-key chunks). Valid chunks "
          f"for {name}={getattr(blocks, name)}: "
          f"{[c for c in range(KEY_MULTIPLE, getattr(blocks, name) + 1, KEY_MULTIPLE) if getattr(blocks, name) % c == 0]}.")
  Hp = padded_head(H)
  for what, (q, k) in (("forward", (blocks.q, blocks.k)),
                       ("backward", (blocks.q_bwd, blocks.k_bwd)),
                       ("forward, read in place", (blocks.direct_q, blocks.k)),
                       ("backward, read in place", (blocks.direct_q, blocks.k_bwd)),
                       ("decode (up to DECODE_ROWS rows, decode_k keys)",
                        (DECODE_ROWS, blocks.decode_k))):
    fwd = not what.startswith("backward")
    need = vmem_bytes(q, k, Hp, itemsize, dense_mask, backward=not fwd)
    if need > VMEM_CAP:
      raise UserError(
          f"The 'flash' kernel's {what} blocks {q}x{k} (rows x "
          f"keys, head dim {Hp}) need about {need / 2 ** 20:.0f} MiB of VMEM, over the "
          f"{VMEM_CAP // 2 ** 20} MiB it may use on {platform}. Valid: smaller blocks, "
          f"e.g. 512x512 ({vmem_bytes(512, 512, Hp, itemsize, dense_mask, not fwd) / 2 ** 20:.0f} MiB).")


def _vmem_limit(Tq, Sk, Hp, itemsize, dense_mask, backward) -> int:
  need = vmem_bytes(Tq, Sk, Hp, itemsize, dense_mask, backward)
  return int(min(VMEM_CAP, max(32 * 2 ** 20, 2 * need)))


# ----------------------------------------------------------------------------- bounds
def _bounds(qpos_BxRp, kpos_BxSp, geo: Geometry, causal: bool, window: Optional[int]):
  """Per q block: min / max position; per kv block: min / max position; per q block the
  first and last kv block it sees (lo, hi), and per kv block the first and last q block
  that sees it: int32 scalar-prefetch arrays, flattened [B * n]."""
  B, nq, nk = geo.B, geo.nq, geo.nk
  qb = qpos_BxRp.reshape(B, nq, -1)   # a direct call's: [B, T], Tt positions a block
  kb = kpos_BxSp.reshape(B, nk, geo.Sk)
  qmin, qmax = qb.min(-1), qb.max(-1)
  kmin, kmax = kb.min(-1), kb.max(-1)
  need = _need(qmin[:, :, None], qmax[:, :, None], kmin[:, None, :], kmax[:, None, :],
               causal, window)                                          # [B, nq, nk]
  lo, hi = _first_last(need, axis=2)
  qlo, qhi = _first_last(need, axis=1)
  kc = kpos_BxSp.reshape(B, geo.Sp // geo.chunk, geo.chunk)
  flat = lambda x: x.reshape(-1).astype(jnp.int32)  # noqa: E731
  return tuple(map(flat, (qmin, qmax, kmin, kmax, lo, hi, qlo, qhi, kc.min(-1), kc.max(-1))))


def _first_last(need, axis):
  n = need.shape[axis]
  idx = jax.lax.broadcasted_iota(jnp.int32, need.shape, axis)
  first = jnp.min(jnp.where(need, idx, n), axis=axis)
  last = jnp.max(jnp.where(need, idx, -1), axis=axis)
  empty = last < 0
  return jnp.where(empty, 0, first), jnp.where(empty, 0, last)


def _need(qmin, qmax, kmin, kmax, causal, window):
  need = jnp.ones(jnp.broadcast_shapes(jnp.shape(qmin), jnp.shape(kmin)), jnp.bool_)
  if causal:
    need &= kmin <= qmax
  if window is not None:
    need &= kmax > qmin - window
  return need


def _full(qmin, qmax, kmin, kmax, causal, window):
  full = True
  if causal:
    full = jnp.logical_and(full, kmax <= qmin)
  if window is not None:
    full = jnp.logical_and(full, kmin > qmax - window)
  return full


# ----------------------------------------------------------------------------- bodies
@dataclasses.dataclass(frozen=True)
class Spec:
  """One call's static settings (hashable)."""
  geo: Geometry
  stages: Tuple[Tuple[str, object], ...]
  einsum: object
  scale: float
  cap: Optional[float]
  causal: bool
  window: Optional[int]
  dense_mask: bool
  # a quantized cache's rows (`contract.cache_stage_dtypes`, items), or None
  rows: Optional[Tuple[Tuple[str, object], ...]] = None

  @property
  def table(self) -> dict:
    return dict(self.stages)

  @property
  def cache_rows(self) -> Optional[dict]:
    return dict(self.rows) if self.rows else None

  @property
  def base2(self) -> bool:
    """Whether the softmax runs in base 2 (`_logits`): a float32 softmax of float32
    logits that the query scale multiplies (the table's row for both flags) and no
    soft-cap. The logits are multiplied once by scale * log2(e) where they would be by
    the scale, and the exps are exp2: on a TPU the exp costs a multiply by log2(e) before
    the exp2 it runs, so this saves one vector multiply per logit. Mathematically the same
    softmax; the argument of each exp carries one more float32 rounding (2^-24 of it)."""
    st = self.table
    return (self.cap is None and st["scale"] != st["qkv"]
            and jnp.dtype(st["softmax"]) == jnp.dtype(F32)
            and jnp.dtype(st["logits"]) == jnp.dtype(F32))

  def exp(self, x):
    """The softmax's exp: exp2 of base-2 logits (`base2`), else exp."""
    return jnp.exp2(x) if self.base2 else jnp.exp(x)

  def scaled(self, side: str) -> bool:
    """Whether the cache's keys ('k') / values ('v') come with per-token scales."""
    rows = self.cache_rows
    return bool(rows) and rows[f"{side}_scale"] == "token"


def _operand(spec: Spec):
  highest = spec.einsum == jax.lax.Precision.HIGHEST
  return (lambda x: x.astype(F32)) if highest else (lambda x: x)


def _logits(spec: Spec, q, k, qpos_Tqx1, kpos_1xSk, key0, mask_TqxSk, masked: bool,
            k_scale_1xSk=None):
  """The forward's logits for one block, as the table makes them: (logits in the
  softmax dtype, masked; the soft-cap's tanh or None; the visibility mask or None).
  A quantized cache (`Spec.rows`): k holds codes, cast exactly to the dot's operand
  dtype; a per-token key scale multiplies the logits column-wise right after the dot,
  in the table's dtype (the contract's cache rows)."""
  st, op, rows = spec.table, _operand(spec), spec.cache_rows
  sm = st["softmax"]
  Tq, Sk = q.shape[0], k.shape[1 if spec.geo.keys_minor else 0]   # k [Hp, Sk] or [Sk, Hp]
  chex.assert_type(q, rows["q_into_qk"] if rows else st["qkv"])
  k = contract.code_operand(k, rows, "k_into_qk")
  with jax.named_scope(contract.QK_SCOPE):
    s = jnp.einsum("TH,HS->TS" if spec.geo.keys_minor else "TH,SH->TS", op(q), op(k),
                   precision=spec.einsum, preferred_element_type=F32)
    s = s.astype(st["logits"])
  chex.assert_type(s, st["logits"])
  if k_scale_1xSk is not None:
    s = s * k_scale_1xSk.astype(rows["k_scale_in"])
    chex.assert_type(s, rows["k_scale_in"])
  if spec.base2:   # the query scale on the float32 logits, log2(e) folded in
    s = s * jnp.asarray(spec.scale * LOG2E, F32)
  else:
    s = contract.scale_logits(s, spec.scale, st).astype(sm)
  tanh = None
  if spec.cap is not None:
    cap = jnp.asarray(spec.cap, sm)
    tanh = jnp.tanh(s / cap)
    s = cap * tanh
  allowed = None
  if masked:
    allowed = _allowed(spec, qpos_Tqx1, kpos_1xSk, key0, Sk)
    if mask_TqxSk is not None:
      allowed = mask_TqxSk != 0 if allowed is None else allowed & (mask_TqxSk != 0)
    if allowed is not None:
      s = jnp.where(allowed, s, jnp.asarray(contract.mask_value(sm), sm))
  return s, tanh, allowed


def _allowed(spec: Spec, qpos_Tqx1, kpos_1xSk, key0, Sk: int):
  """Which pairs of a masked block (or chunk) are visible, as one [Tq, Sk] compare per
  condition against [1, Sk] key data: a key past S (only where the padded keys run past
  it: `Geometry.Sp` > S) is hidden by giving it a position after every query under a
  causal mask, else by a [1, Sk] flag. None: every pair visible (no condition)."""
  geo = spec.geo
  real_1xSk = None
  if geo.Sp != geo.S:
    real_1xSk = key0 + jax.lax.broadcasted_iota(jnp.int32, (1, Sk), 1) < geo.S
  kp = kpos_1xSk
  if real_1xSk is not None and spec.causal:
    kp = jnp.where(real_1xSk, kp, HIDDEN_POSITION)
    real_1xSk = None
  allowed = None
  if spec.causal:
    allowed = kp <= qpos_Tqx1
  if spec.window is not None:
    inside = kp > qpos_Tqx1 - spec.window
    allowed = inside if allowed is None else allowed & inside
  if real_1xSk is not None:
    allowed = (jnp.broadcast_to(real_1xSk, (qpos_Tqx1.shape[0], Sk)) if allowed is None
               else allowed & real_1xSk)
  return allowed


def _block_state(spec: Spec, qmin, qmax, kmin, kmax, j):
  """(need, full) of block pair: any pair visible; every pair visible (no mask needed)."""
  geo = spec.geo
  need = _need(qmin, qmax, kmin, kmax, spec.causal, spec.window)
  full = _full(qmin, qmax, kmin, kmax, spec.causal, spec.window)
  full = jnp.logical_and(full, (j + 1) * geo.Sk <= geo.S)
  if spec.dense_mask:
    full = jnp.logical_and(full, False)
  return need, full


def _blocks_run(spec: Spec, refs, b, i, j, update):
  """Runs update(keys, masked) over the block pair (q block i, kv block j): nothing where
  no pair is visible; the whole block unmasked where every pair is; else chunk by chunk
  (`Geometry.chunk` keys), masked, skipping the chunks no row sees (the diagonal of a
  causal prefill: about half of its block). (Running an edge block's leading visible
  chunks as one unmasked update measured no faster on a TPU v5e, and slower with many
  chunks a block: results/tpu-flash/sweep3.md.)"""
  geo = spec.geo
  qmin_r, qmax_r, kmin_r, kmax_r, _, _, cmin_r, cmax_r = refs
  bi, bj = b * geo.nq + i, b * geo.nk + j
  qmin, qmax = qmin_r[bi], qmax_r[bi]
  need, full = _block_state(spec, qmin, qmax, kmin_r[bj], kmax_r[bj], j)
  pl.when(jnp.logical_and(need, full))(lambda: update(pl.ds(0, geo.Sk), False))

  @pl.when(jnp.logical_and(need, jnp.logical_not(full)))
  def _masked():
    per = geo.Sk // geo.chunk
    for c in range(per):
      bc = b * (geo.Sp // geo.chunk) + j * per + c
      need_c = _need(qmin, qmax, cmin_r[bc], cmax_r[bc], spec.causal, spec.window)
      need_c = jnp.logical_and(need_c, j * geo.Sk + c * geo.chunk < geo.S)
      pl.when(need_c)(functools.partial(update, pl.ds(c * geo.chunk, geo.chunk), True))


def _gather_rows(geo: Geometry, src_ref, dst_ref):
  """A direct q (or dO) block [Tt, G * H] into rows [G * Tt, H], head-major."""
  for g in range(geo.G):
    dst_ref[pl.ds(g * geo.Tt, geo.Tt), :] = src_ref[:, pl.ds(g * geo.H, geo.H)]


def _gather_positions(geo: Geometry, src_ref, dst_ref):
  """A direct q block's positions [Tt, 1] as its rows' [G * Tt, 1] (`_gather_rows`'s
  order: each head's rows hold the block's Tt positions)."""
  for g in range(geo.G):
    dst_ref[pl.ds(g * geo.Tt, geo.Tt), :] = src_ref[...]


def _gather_delta(geo: Geometry, o_ref, do_ref, dst_ref):
  """A direct call's delta = rowsum(dO * O) in float32, per row of the block
  (`_gather_rows`' order), from its o and dO blocks [Tt, G * H]: what XLA computed
  before the call, [B, T, N] moved to [B, K, Rp, 1], now read from the blocks the
  backward holds (o is read instead of that column)."""
  for g in range(geo.G):
    heads = pl.ds(g * geo.H, geo.H)
    dst_ref[pl.ds(g * geo.Tt, geo.Tt), :] = jnp.sum(
        do_ref[:, heads].astype(F32) * o_ref[:, heads].astype(F32), axis=1, keepdims=True)


def _put_rows(geo: Geometry, value_TqxH, dst_ref):
  """Rows [Tq, H] into their block: a direct one [Tt, G * H] (`_gather_rows` undone),
  else as they are."""
  if not geo.direct:
    dst_ref[...] = value_TqxH
    return
  for g in range(geo.G):
    dst_ref[:, pl.ds(g * geo.H, geo.H)] = value_TqxH[g * geo.Tt:(g + 1) * geo.Tt]


def _fwd_body(spec: Spec, with_lse: bool):
  geo, st, op = spec.geo, spec.table, _operand(spec)
  sm, c = st["softmax"], st["output"]
  mv = contract.mask_value(sm)

  def body(*refs):
    prefetch, refs = refs[:N_PREFETCH], list(refs[geo.n_prefetch:])
    q_ref, k_ref, v_ref, qpos_ref, kpos_ref = refs[:5]
    refs = refs[5:]
    mask_ref = refs.pop(0) if spec.dense_mask else None
    ktok_ref = refs.pop(0) if spec.scaled("k") else None
    vtok_ref = refs.pop(0) if spec.scaled("v") else None
    o_ref = refs.pop(0)
    lse_ref = refs.pop(0) if with_lse else None
    m_sc, l_sc, acc_sc = refs[:3]
    # the q block as rows [Tq, Hp] and their positions [Tq, 1]
    q_rows, qpos_rows = refs[3:5] if geo.direct else (q_ref, qpos_ref)
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    rows = spec.cache_rows

    @pl.when(j == 0)
    def _init():
      m_sc[...] = jnp.full(m_sc.shape, mv, F32)
      l_sc[...] = jnp.zeros(l_sc.shape, F32)
      acc_sc[...] = jnp.zeros(acc_sc.shape, F32)
      if geo.direct:
        _gather_rows(geo, q_ref, q_rows)
        _gather_positions(geo, qpos_ref, qpos_rows)

    def update(keys, masked):
      minor = geo.keys_minor
      v = v_ref[:, keys] if minor else v_ref[keys, :]
      vtok = None if vtok_ref is None else vtok_ref[:, keys]
      if masked and not geo.pad_keys:
        # keys past S in a last block of an unpadded array: values (and their scales)
        # unspecified, so zeroed (their probabilities are 0, but 0 * NaN is not)
        key0 = j * geo.Sk + keys.start
        real_1xC = key0 + jax.lax.broadcasted_iota(jnp.int32, (1, keys.size), 1) < geo.S
        real = real_1xC if minor else (
            key0 + jax.lax.broadcasted_iota(jnp.int32, (keys.size, 1), 0) < geo.S)
        v = jnp.where(real, v, jnp.zeros((), v.dtype))
        if vtok is not None:
          vtok = jnp.where(real_1xC, vtok, 0.0)
      s, _, _ = _logits(spec, q_rows[...], k_ref[:, keys] if minor else k_ref[keys, :],
                        qpos_rows[...],
                        kpos_ref[:, keys], j * geo.Sk + keys.start,
                        mask_ref[:, keys] if spec.dense_mask else None, masked,
                        None if ktok_ref is None else ktok_ref[:, keys])
      m_prev = m_sc[...]
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True).astype(F32))
      # A row that has seen no key yet (m = mask value) shifts by 0: its entries give 0.
      shift = jnp.where(m_next > 0.5 * mv, m_next, 0.0) if masked else m_next
      probs = spec.exp(s - shift.astype(sm))
      chex.assert_type(probs, st["probs"])
      correction = spec.exp(m_prev - m_next)
      l_sc[...] = l_sc[...] * correction + jnp.sum(probs.astype(F32), axis=1,
                                                   keepdims=True)
      m_sc[...] = m_next
      if vtok is not None:     # the value scale, on the probabilities (cache rows)
        probs = probs * vtok.astype(rows["v_scale_in"])
        chex.assert_type(probs, rows["v_scale_in"])
      v = contract.code_operand(v, rows, "v_into_wv") if rows else v.astype(st["probs"])
      with jax.named_scope(contract.WV_SCOPE):
        pv = jnp.einsum("TS,HS->TH" if minor else "TS,SH->TH", op(probs), op(v),
                        precision=spec.einsum, preferred_element_type=F32)
      acc_sc[...] = acc_sc[...] * correction + pv

    _blocks_run(spec, prefetch, b, i, j, update)

    @pl.when(j == geo.nk - 1)
    def _finish():
      l = l_sc[...]
      seen = l > 0                                 # a row that saw no key -> 0
      l_safe = jnp.where(seen, l, 1.0)
      _put_rows(geo, (acc_sc[...] / l_safe).astype(c), o_ref)
      if with_lse:
        # in the logits' units: base 2 where they are (`Spec.base2`; the backward only)
        log_l = jnp.log2(l_safe) if spec.base2 else jnp.log(l_safe)
        lse_ref[...] = jnp.where(seen, m_sc[...] + log_l, BIG)

  return body


def _recompute_p(spec, q, k, qpos, kpos, key0, mask, lse_Tqx1, masked):
  """The backward's P = exp(logits - logsumexp) in float32 (0 where hidden), and the
  soft-cap's tanh (or None)."""
  s, tanh, allowed = _logits(spec, q, k, qpos, kpos, key0, mask, masked)
  p = spec.exp(s.astype(F32) - lse_Tqx1)
  # A hidden pair's logit is the mask value; for a float32 or bfloat16 softmax (-2.4e38)
  # exp(mask value - logsumexp) is 0 exactly, so no select is needed; a float16 mask
  # value (-45852) is within reach of a row's logsumexp, so its pairs are zeroed.
  if allowed is not None and jnp.finfo(spec.table["softmax"]).max < 1e38:
    p = jnp.where(allowed, p, 0.0)
  return p, tanh


def _dlogits(spec, p, dp, delta_Tqx1, tanh):
  """dS (float32) from P, dP, delta: through the soft-cap and the query scale on f32
  logits where the table puts it there."""
  ds = p * (dp - delta_Tqx1)
  if tanh is not None:
    ds = ds * (1.0 - jnp.square(tanh.astype(F32)))
  st = spec.table
  if st["scale"] != st["qkv"]:          # the scale was applied to the f32 logits
    ds = ds * jnp.asarray(spec.scale, F32)
  return ds


def _grad_dot(spec, eq, a, b):
  op = _operand(spec)
  with jax.named_scope(contract.GRAD_SCOPE):
    return jnp.einsum(eq, op(a), op(b), precision=spec.einsum, preferred_element_type=F32)


def _bwd_refs(spec, refs):
  prefetch, refs = refs[:N_PREFETCH], list(refs[N_PREFETCH:])
  q_ref, k_ref, v_ref, qpos_ref, kpos_ref = refs[:5]
  refs = refs[5:]
  mask_ref = refs.pop(0) if spec.dense_mask else None
  return prefetch, (q_ref, k_ref, v_ref, qpos_ref, kpos_ref, mask_ref), refs


def _dq_body(spec: Spec):
  geo, st = spec.geo, spec.table
  c = st["qkv"]

  def body(*refs):
    prefetch, ins, refs = _bwd_refs(spec, refs)
    q_ref, k_ref, v_ref, qpos_ref, kpos_ref, mask_ref = ins
    # a direct call's o block in delta's place (`_gather_delta`)
    lse_ref, delta_ref, do_ref, dq_ref, dq_sc = refs[:5]
    q_rows, do_rows, qpos_rows, delta_rows = (refs[5:] if geo.direct else
                                              (q_ref, do_ref, qpos_ref, delta_ref))
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
      dq_sc[...] = jnp.zeros(dq_sc.shape, F32)
      if geo.direct:
        _gather_rows(geo, q_ref, q_rows)
        _gather_rows(geo, do_ref, do_rows)
        _gather_positions(geo, qpos_ref, qpos_rows)
        _gather_delta(geo, delta_ref, do_ref, delta_rows)

    def update(keys, masked):
      k, v, do = k_ref[keys, :], v_ref[keys, :], do_rows[...]
      p, tanh = _recompute_p(spec, q_rows[...], k, qpos_rows[...], kpos_ref[:, keys],
                             j * geo.Sk + keys.start,
                             mask_ref[:, keys] if spec.dense_mask else None,
                             lse_ref[...], masked)
      dp = _grad_dot(spec, "TH,SH->TS", do, v)
      ds = _dlogits(spec, p, dp, delta_rows[...], tanh)
      dq_sc[...] += _grad_dot(spec, "TS,SH->TH", ds.astype(c), k)

    _blocks_run(spec, prefetch, b, i, j, update)

    @pl.when(j == geo.nk - 1)
    def _finish():
      _put_rows(geo, dq_sc[...].astype(dq_ref.dtype), dq_ref)

  return body


def _dkv_body(spec: Spec):
  geo, st = spec.geo, spec.table
  c = st["qkv"]

  def body(*refs):
    prefetch, ins, refs = _bwd_refs(spec, refs)
    q_ref, k_ref, v_ref, qpos_ref, kpos_ref, mask_ref = ins
    lse_ref, delta_ref, do_ref, dk_ref, dv_ref, dk_sc, dv_sc = refs[:7]
    q_rows, do_rows, qpos_rows, delta_rows = (refs[7:] if geo.direct else
                                              (q_ref, do_ref, qpos_ref, delta_ref))
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _init():
      dk_sc[...] = jnp.zeros(dk_sc.shape, F32)
      dv_sc[...] = jnp.zeros(dv_sc.shape, F32)

    if geo.direct:     # the streamed q block changes every step
      _gather_rows(geo, q_ref, q_rows)
      _gather_rows(geo, do_ref, do_rows)
      _gather_positions(geo, qpos_ref, qpos_rows)
      _gather_delta(geo, delta_ref, do_ref, delta_rows)

    def update(keys, masked):
      q, do = q_rows[...], do_rows[...]
      p, tanh = _recompute_p(spec, q, k_ref[keys, :], qpos_rows[...], kpos_ref[:, keys],
                             j * geo.Sk + keys.start,
                             mask_ref[:, keys] if spec.dense_mask else None,
                             lse_ref[...], masked)
      dv_sc[keys, :] += _grad_dot(spec, "TS,TH->SH", p.astype(c), do)
      dp = _grad_dot(spec, "TH,SH->TS", do, v_ref[keys, :])
      ds = _dlogits(spec, p, dp, delta_rows[...], tanh)
      dk_sc[keys, :] += _grad_dot(spec, "TS,TH->SH", ds.astype(c), q)

    _blocks_run(spec, prefetch, b, i, j, update)

    @pl.when(i == geo.nq - 1)
    def _finish():
      dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
      dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)

  return body


# ----------------------------------------------------------------------------- calls
# qmin, qmax, kmin, kmax, (lo, hi) of the pass's arbitrary axis, and the chunks' kmin, kmax
N_PREFETCH = 8
_sq = pl.squeezed


def _specs(geo: Geometry, dense_mask: bool, kv_major: bool, scales: int = 0):
  """BlockSpecs of q, k, v, qpos, kpos (and the mask) for a grid (B, K, nq, nk) or, with
  kv_major, (B, K, nk, nq). The index map of the streamed axis clamps a block no row
  sees to [lo, hi] of the fixed block: the same index as its neighbour, so no DMA."""
  Tq, Sk, Hp, nq, nk = geo.Tq, geo.Sk, geo.Hp, geo.nq, geo.nk

  if kv_major:      # fixed kv block j, streamed q block i
    def ij(b, x, y, *pf):
      qlo, qhi = pf[4], pf[5]
      return jnp.minimum(jnp.maximum(y, qlo[b * nk + x]), qhi[b * nk + x]), x
  else:             # fixed q block i, streamed kv block j
    def ij(b, x, y, *pf):
      lo, hi = pf[4], pf[5]
      return x, jnp.minimum(jnp.maximum(y, lo[b * nq + x]), hi[b * nq + x])

  def qmap(b, h, x, y, *pf):
    return b, h, ij(b, x, y, *pf)[0], 0

  def kmap(b, h, x, y, *pf):
    return b, h, ij(b, x, y, *pf)[1], 0

  if geo.direct:    # q / o [B, T, N * H], k / v [B, S, K * H]: kv head h's lanes
    qblock = pl.BlockSpec((_sq, geo.Tt, geo.G * geo.H), lambda b, h, x, y, *pf: (
        b, ij(b, x, y, *pf)[0], h))
    kblock = pl.BlockSpec((_sq, Sk, geo.H), lambda b, h, x, y, *pf: (
        b, ij(b, x, y, *pf)[1], h))
    rows = pl.BlockSpec((_sq, _sq, Tq, 1), lambda b, h, x, y, *pf: (
        b, h, ij(b, x, y, *pf)[0], 0))
    specs = [qblock, kblock, kblock,      # positions [B, T, 1]: Tt a block (`_gather_positions`)
             pl.BlockSpec((_sq, geo.Tt, 1), lambda b, h, x, y, *pf: (
                 b, ij(b, x, y, *pf)[0], 0)),
             pl.BlockSpec((_sq, 1, Sk), lambda b, h, x, y, *pf: (b, 0, ij(b, x, y, *pf)[1]))]
    return specs, rows, qblock, kblock

  # a stack's leading layer axis: its index the last scalar-prefetch value
  lead = (_sq,) if geo.stacked else ()
  layer = (lambda pf: (pf[N_PREFETCH][0],)) if geo.stacked else (lambda pf: ())
  kv = (pl.BlockSpec(lead + (_sq, _sq, Hp, Sk), lambda b, h, x, y, *pf: layer(pf) + (
      b, h, 0, ij(b, x, y, *pf)[1])) if geo.keys_minor else
        pl.BlockSpec(lead + (_sq, _sq, Sk, Hp),
                     lambda b, h, x, y, *pf: layer(pf) + kmap(b, h, x, y, *pf)))
  specs = [pl.BlockSpec((_sq, _sq, Tq, Hp), qmap), kv, kv,
           pl.BlockSpec((_sq, Tq, 1), lambda b, h, x, y, *pf: (b, ij(b, x, y, *pf)[0], 0)),
           pl.BlockSpec((_sq, 1, Sk), lambda b, h, x, y, *pf: (b, 0, ij(b, x, y, *pf)[1]))]
  if dense_mask:
    specs.append(pl.BlockSpec((_sq, _sq, Tq, Sk), lambda b, h, x, y, *pf: (
        b, h) + ij(b, x, y, *pf)))
  for _ in range(scales):   # a quantized cache's per-token scales, [(L,) B, K, 1, S]
    specs.append(pl.BlockSpec(lead + (_sq, _sq, 1, Sk), lambda b, h, x, y, *pf: layer(pf) + (
        b, h, 0, ij(b, x, y, *pf)[1])))
  rows = pl.BlockSpec((_sq, _sq, Tq, 1), lambda b, h, x, y, *pf: (b, h, ij(b, x, y, *pf)[0], 0))
  qblock = pl.BlockSpec((_sq, _sq, Tq, Hp), qmap)
  kblock = pl.BlockSpec((_sq, _sq, Sk, Hp), kmap)
  return specs, rows, qblock, kblock


def _row_scratch(geo: Geometry, dtype, n: int):
  """A direct call's q (and dO) blocks gathered into rows (`_gather_rows`), then their
  positions (`_gather_positions`), then in the backward (n = 2) delta
  (`_gather_delta`)."""
  if not geo.direct:
    return []
  return ([pltpu.VMEM((geo.Tq, geo.Hp), dtype) for _ in range(n)]
          + [pltpu.VMEM((geo.Tq, 1), jnp.int32)]
          + ([pltpu.VMEM((geo.Tq, 1), F32)] if n == 2 else []))


def _params(interpret, geo, itemsize, dense_mask, backward):
  if interpret:
    return None
  return pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
      vmem_limit_bytes=_vmem_limit(geo.Tq, geo.Sk, geo.Hp, itemsize, dense_mask, backward))


def _forward_call(spec: Spec, interpret: bool, with_lse: bool, prefetch, operands):
  geo = spec.geo
  specs, rows, qblock, _ = _specs(geo, spec.dense_mask, kv_major=False,
                                  scales=spec.scaled("k") + spec.scaled("v"))
  q = operands[0]
  out_specs = [qblock] + ([rows] if with_lse else [])
  out_shape = [jax.ShapeDtypeStruct(q.shape, spec.table["output"])]
  if with_lse:
    out_shape.append(jax.ShapeDtypeStruct((geo.B, geo.K, geo.Rp, 1), F32))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=geo.n_prefetch, grid=(geo.B, geo.K, geo.nq, geo.nk),
      in_specs=specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((geo.Tq, 1), F32), pltpu.VMEM((geo.Tq, 1), F32),
                      pltpu.VMEM((geo.Tq, geo.Hp), F32)] + _row_scratch(geo, q.dtype, 1))
  outs = pl.pallas_call(
      _fwd_body(spec, with_lse), grid_spec=grid_spec, out_shape=out_shape,
      interpret=interpret, name="attn_flash_fwd",
      compiler_params=_params(interpret, geo, operands[1].dtype.itemsize, spec.dense_mask,
                              False),
  )(*prefetch, *operands)
  return outs if with_lse else (outs[0], None)


def _dq_call(spec: Spec, interpret: bool, prefetch, operands, lse, delta, do):
  geo = spec.geo
  specs, rows, qblock, _ = _specs(geo, spec.dense_mask, kv_major=False)
  q = operands[0]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=N_PREFETCH, grid=(geo.B, geo.K, geo.nq, geo.nk),
      in_specs=specs + [rows, qblock if geo.direct else rows, qblock], out_specs=qblock,
      scratch_shapes=[pltpu.VMEM((geo.Tq, geo.Hp), F32)] + _row_scratch(geo, q.dtype, 2))
  return pl.pallas_call(
      _dq_body(spec), grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      interpret=interpret, name="attn_flash_dq",
      compiler_params=_params(interpret, geo, q.dtype.itemsize, spec.dense_mask, True),
  )(*prefetch, *operands, lse, delta, do)


def _dkv_call(spec: Spec, interpret: bool, prefetch, operands, lse, delta, do):
  geo = spec.geo
  specs, rows, qblock, kblock = _specs(geo, spec.dense_mask, kv_major=True)
  k = operands[1]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=N_PREFETCH, grid=(geo.B, geo.K, geo.nk, geo.nq),
      in_specs=specs + [rows, qblock if geo.direct else rows, qblock],
      out_specs=[kblock, kblock],
      scratch_shapes=[pltpu.VMEM((geo.Sk, geo.Hp), F32), pltpu.VMEM((geo.Sk, geo.Hp), F32)]
      + _row_scratch(geo, operands[0].dtype, 2))
  return pl.pallas_call(
      _dkv_body(spec), grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2,
      interpret=interpret, name="attn_flash_dkv",
      compiler_params=_params(interpret, geo, k.dtype.itemsize, spec.dense_mask, True),
  )(*prefetch, *operands, lse, delta, do)


def _prefetch(bounds, kv_major: bool = False):
  """The scalar-prefetch arrays of a pass, in the bodies' order: the blocks' bounds, the
  streamed axis' range (lo, hi of each q block; qlo, qhi of each kv block with
  kv_major), the chunks' bounds."""
  qmin, qmax, kmin, kmax, lo, hi, qlo, qhi, cmin, cmax = bounds
  return (qmin, qmax, kmin, kmax) + ((qlo, qhi) if kv_major else (lo, hi)) + (cmin, cmax)


def _on_platform(f):
  """f(interpret) run as the lowering platform says: interpreted on CPU, Mosaic on TPU."""
  def run(*xs):
    return jax.lax.platform_dependent(
        *xs, cpu=lambda *a: f(True, *a), tpu=lambda *a: f(False, *a))
  return run


def _keys(geo: Geometry, k, v, kpos_Bx1xS):
  """k, v [B, K, S, Hp] and the key positions as a pass over `geo` reads them: padded to
  Sp (zeros; positions repeat the last) where `geo.pad_keys`, else only the positions
  (the bounds need whole blocks; the arrays' last block is partial)."""
  pad = geo.Sp - geo.S
  kpos = jnp.pad(kpos_Bx1xS, ((0, 0), (0, 0), (0, pad)), mode="edge")
  if geo.keys_minor:     # [B, K, Hp, S]: from the caller's [B, S, K, H] (a cache's view)
    k, v = (jnp.swapaxes(x, -1, -2) for x in (k, v))
  if geo.pad_keys:
    k, v = (_pad(x, ((0, 0), (0, pad)) if geo.keys_minor else ((0, pad), (0, 0)))
            for x in (k, v))
  return k, v, kpos


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(fwd: Spec, bwd: Spec, inf: Spec, q, k, v, qpos, kpos, mask):
  return _primal(inf, q, k, v, qpos, kpos, mask)


def _primal(spec: Spec, q, k, v, qpos, kpos, mask, scales=(), layer=None):
  """The forward without a gradient over `spec` (the decode geometry where it applies);
  scales: a quantized cache's per-token [(L,) B, K, 1, S] scales (keys, values), if any;
  layer: the [1] int32 index into stacked k / v / scales (`Geometry.stacked`)."""
  k, v, kpos = _keys(spec.geo, k, v, kpos)
  prefetch = _prefetch(_bounds(qpos[..., 0], kpos[:, 0], spec.geo, spec.causal,
                               spec.window)) + ((layer,) if spec.geo.stacked else ())
  operands = [q, k, v, qpos, kpos] + ([mask] if mask is not None else []) + list(scales)
  return _on_platform(lambda interp, *xs: _forward_call(spec, interp, False, prefetch,
                                                        list(xs))[0])(*operands)


def _flash_fwd(fwd: Spec, bwd: Spec, inf: Spec, q, k, v, qpos, kpos, mask):
  del inf
  k, v, kpos = _keys(fwd.geo, k, v, kpos)
  prefetch = _prefetch(_bounds(qpos[..., 0], kpos[:, 0], fwd.geo, fwd.causal, fwd.window))
  operands = [q, k, v, qpos, kpos] + ([mask] if mask is not None else [])
  o, lse = _on_platform(lambda interp, *xs: tuple(_forward_call(
      fwd, interp, True, prefetch, list(xs))))(*operands)
  return o, (q, k, v, qpos, kpos, mask, o, lse)


def _flash_bwd(fwd: Spec, bwd: Spec, inf: Spec, res, do):
  del inf
  q, k, v, qpos, kpos, mask, o, lse = res
  geo, S = bwd.geo, bwd.geo.S
  # The forward's padded rows are the backward's (Rp is a multiple of both q blocks).
  if geo.direct:    # o in delta's place: each block's rows computed in VMEM
    delta = o
  else:
    delta = jnp.sum(do.astype(F32) * o.astype(F32), axis=-1, keepdims=True)
  bounds = _bounds(qpos[..., 0], kpos[:, 0], geo, bwd.causal, bwd.window)
  operands = [q, k, v, qpos, kpos] + ([mask] if mask is not None else [])
  dq = _on_platform(lambda interp, *xs: _dq_call(
      bwd, interp, _prefetch(bounds), list(xs[:-3]), *xs[-3:]))(
          *operands, lse, delta, do)
  dk, dv = _on_platform(lambda interp, *xs: tuple(_dkv_call(
      bwd, interp, _prefetch(bounds, kv_major=True), list(xs[:-3]), *xs[-3:])))(
          *operands, lse, delta, do)
  if geo.direct:     # [B, S, K * H], never padded
    return dq, dk, dv, None, None, None
  return dq, dk[:, :, :S], dv[:, :, :S], None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _cached(spec: Spec, q, k, v, qpos, kpos, mask, tokens, layer):
  """Attention over a quantized cache (codes and per-token scales) or a stack of layers'
  caches (`layer`): the forward only."""
  if spec.geo.pad_keys:
    tokens = tuple(_pad(x, ((0, 0), (0, spec.geo.Sp - spec.geo.S))) for x in tokens)
  return _primal(spec, q, k, v, qpos, kpos, mask, tokens, layer)


def _cached_fwd(spec: Spec, *args):
  what = (f"a quantized KV cache ({dict(spec.rows)['k_cache']} keys, "
          f"{dict(spec.rows)['v_cache']} values)" if spec.rows else
          "a stack of layers' caches (layer=)")
  raise UserError(
      f"The 'flash' kernel over {what} has no gradient: a cache is read-only (prefill "
      f"and decode). Train without a cache, or over an unscaled storage ('compute', "
      f"'float32', 'bfloat16') passed per layer.")


_cached.defvjp(_cached_fwd, lambda spec, res, g: None)


# ----------------------------------------------------------------------------- entry
def flash_attention(q, k, v, *, mask=None,
                    flags: contract.AttentionFlags = contract.AttentionFlags(),
                    logits_soft_cap=None, scale=None, causal: bool = False,
                    q_positions_BxT=None, k_positions_BxS=None,
                    sliding_window: Optional[int] = None,
                    kv_cache: contract.CacheStorage = contract.COMPUTE_CACHE,
                    kv_scales=None, blocks: Blocks = DEFAULT_BLOCKS, stages=None,
                    layer=None):
  """Flash attention in Pallas, forward and backward; same contract and arguments as
  `blockwise_attention` (positions default to k_pos = arange(S), q_pos = the last T).

  blocks: the `Blocks` (checked: `check_blocks`). stages: the table row the body is
  built from; None (always, outside tests) = the row for `flags`.
  layer: None, or an int32 scalar (traced or not): k / v are then a stack of layers'
  caches [L, B, S, K, H] (a scanned model's cache, as its [L, B, K, S, H] view) and
  their per-token scales [L, B, K, S] (per-channel [L, B, K, H]), of which the call reads
  layer `layer` in place: the index enters the kernel's block index maps, so the layer's
  cache is never sliced out (a copy a Pallas call's operand would need). A decode call
  only (the decode geometry), without a gradient.
  Returns [B, T, N, H] in q's dtype."""
  if layer is not None:
    if k.ndim != 5:
      raise UserError(f"The 'flash' kernel's layer={layer!r} reads a stack of layers' "
                      f"caches [L, B, S, K, H]; got keys of shape {tuple(k.shape)}. Pass "
                      f"the stack, or layer=None with one layer's cache.")
    if isinstance(layer, (int, np.integer)) and not 0 <= int(layer) < k.shape[0]:
      raise UserError(f"The 'flash' kernel's layer={layer!r} is not a layer of the stack "
                      f"of {k.shape[0]} caches: valid layers 0 .. {k.shape[0] - 1}.")
    k_one, v_one = (jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (k, v))
    stacked_scales, kv_scales = kv_scales, _one_layer(kv_scales, layer)
  else:
    k_one, v_one, stacked_scales = k, v, kv_scales
  prep = contract.prepare(q, k_one, v_one, flags, scale=scale, kv_cache=kv_cache,
                          kv_scales=kv_scales)
  why = settings_refusal(flags, kv_cache)
  if why:
    raise UserError(why)
  if sliding_window is not None and (not isinstance(sliding_window, int)
                                     or sliding_window <= 0):
    raise UserError(f"sliding_window must be a positive integer or None, "
                    f"got {sliding_window!r}.")
  check_blocks(blocks, prep.H, jnp.dtype(q.dtype).itemsize, mask is not None)
  logits_soft_cap = contract.static_number(NAME, "logits_soft_cap", logits_soft_cap)
  stages = prep.stages if stages is None else stages
  B, T, K, G, S, H = prep.B, prep.T, prep.K, prep.G, prep.S, prep.H
  fgeo, bgeo = geometries(B, K, T, G, S, H, blocks)
  rows = prep.rows
  common = dict(stages=tuple(stages.items()), einsum=prep.einsum,
                scale=contract.static_number(NAME, "scale", prep.scale),
                cap=logits_soft_cap, causal=causal, window=sliding_window,
                dense_mask=mask is not None,
                rows=tuple(rows.items()) if rows else None)
  dgeo = decode_geometry(fgeo, blocks, mask is not None)
  if layer is not None:
    if dgeo is None:
      raise UserError(
          f"The 'flash' kernel reads a stack of layers' caches (layer=) only in a decode "
          f"call: at most {DECODE_ROWS} query rows per kv head (T x G = {T * G} here) and "
          f"no dense mask. Pass the layer's own cache for this call.")
    dgeo = dataclasses.replace(dgeo, stacked=True)
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  # 'highest' keeps the row-packed geometry: read in place with 2048-row blocks it ran
  # 1.8-2.2x slower on a TPU v5e (3.11 against 1.73 ms, a 2k prefill at Qwen2-7B's shape:
  # results/tpu-flash/flags.md against flags-2efc43d.md)
  if (dgeo is None and layer is None and not rows and mask is None
          and prep.einsum != jax.lax.Precision.HIGHEST):
    fgeo, bgeo = direct_geometries(B, K, T, G, S, H, blocks) or (fgeo, bgeo)
  fwd = Spec(geo=fgeo, **common)
  q_BxTxKxGxH = prep.queries(q)     # a per-channel key scale applied (`query_operand`)
  tokens = ()
  if rows:     # the per-token scales of a quantized cache, as [(L,) B, K, 1, S]
    tokens = tuple(x[..., None, :] for x in (stacked_scales.k_token_BxKxS,
                                             stacked_scales.v_token_BxKxS) if x is not None)
  return _attention(q_BxTxKxGxH, k, v, q_positions_BxT, k_positions_BxS, mask, tokens,
                    layer, fwd=fwd, bwd=Spec(geo=bgeo, **common),
                    inf=fwd if dgeo is None else Spec(geo=dgeo, **common))


def _one_layer(kv_scales, layer):
  """What `contract.prepare` checks for one layer of a stack's scales: the per-token ones
  as their shapes (the body reads them from the stack), the per-channel key scale as
  the layer's values (q is multiplied by them before the call)."""
  if kv_scales is None:
    return None
  shape = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape[1:], x.dtype)  # noqa: E731
  channel = kv_scales.k_channel_BxKxH
  return contract.KVScales(
      k_token_BxKxS=shape(kv_scales.k_token_BxKxS), v_token_BxKxS=shape(kv_scales.v_token_BxKxS),
      k_channel_BxKxH=None if channel is None else jax.lax.dynamic_index_in_dim(
          channel, layer, 0, keepdims=False))


@functools.partial(jax.jit, static_argnames=("fwd", "bwd", "inf"))
def _attention(q_BxTxKxGxH, k, v, q_positions_BxT, k_positions_BxS, mask, tokens, layer, *,
               fwd, bwd, inf):
  """`flash_attention` after its checks: layout, padding, the custom-vjp call (k / v
  are padded to each pass's keys inside it: `_keys`)."""
  geo = fwd.geo
  B, K, T, G, S, H = geo.B, geo.K, geo.T, geo.G, geo.S, geo.H
  N, R, Rp, Sp, Hp = K * G, geo.R, geo.Rp, geo.Sp, geo.Hp
  if geo.direct:     # q, k, v where the caller holds them; rows ordered per q block
    q_positions_BxT, k_positions_BxS = contract.default_positions(
        q_positions_BxT, k_positions_BxS, B, T, S)
    qpos = q_positions_BxT.astype(jnp.int32)[:, :, None]   # [B, T, 1], not per row
    out = _flash(fwd, bwd, inf, q_BxTxKxGxH.reshape(B, T, N * H), k.reshape(B, S, K * H),
                 v.reshape(B, S, K * H), qpos,
                 k_positions_BxS.astype(jnp.int32)[:, None, :], None)
    out_BxTxNxH = out.reshape(B, T, N, H)
    chex.assert_type(out_BxTxNxH, fwd.table["output"])
    return out_BxTxNxH
  q_BxKxRxH = jnp.transpose(q_BxTxKxGxH, (0, 2, 1, 3, 4)).reshape(B, K, R, H)
  q_BxKxRpxHp = _pad(q_BxKxRxH, ((0, Rp - R), (0, Hp - H)))
  # [(L,) B, S, K, H] -> [(L,) B, K, S, Hp] (a cache's own layout: the transposes cancel)
  k_BxKxSxHp, v_BxKxSxHp = (_pad(jnp.swapaxes(x, -3, -2), ((0, 0), (0, Hp - H)))
                            for x in (k, v))
  q_positions_BxT, k_positions_BxS = contract.default_positions(
      q_positions_BxT, k_positions_BxS, B, T, S)
  qpos_BxR = jnp.repeat(q_positions_BxT.astype(jnp.int32), G, axis=1)
  # Padded rows: under a causal mask a position before every key, so they see nothing
  # and a block of them alone is skipped; else the last row's (computed, then cut off).
  qpos_BxRpx1 = (jnp.pad(qpos_BxR, ((0, 0), (0, Rp - R)), constant_values=PAD_POSITION)
                 if fwd.causal else
                 jnp.pad(qpos_BxR, ((0, 0), (0, Rp - R)), mode="edge"))[:, :, None]
  kpos_Bx1xS = k_positions_BxS.astype(jnp.int32)[:, None, :]
  dense = None
  if mask is not None:
    grouped = jnp.broadcast_to(contract.group_mask(mask, B, N, K, G, T, S), (B, K, G, T, S))
    mask_BxKxRxS = jnp.transpose(grouped, (0, 1, 3, 2, 4)).reshape(B, K, R, S)
    dense = _pad(mask_BxKxRxS.astype(jnp.int32), ((0, Rp - R), (0, Sp - S)))
  if fwd.rows or inf.geo.stacked:
    out = _cached(inf, q_BxKxRpxHp, k_BxKxSxHp, v_BxKxSxHp, qpos_BxRpx1, kpos_Bx1xS,
                  dense, tokens, layer)
  else:
    out = _flash(fwd, bwd, inf, q_BxKxRpxHp, k_BxKxSxHp, v_BxKxSxHp, qpos_BxRpx1,
                 kpos_Bx1xS, dense)
  out_BxTxNxH = jnp.transpose(out[:, :, :R, :H].reshape(B, K, T, G, H),
                              (0, 2, 1, 3, 4)).reshape(B, T, N, H)
  chex.assert_shape(out_BxTxNxH, (B, T, N, H))
  chex.assert_type(out_BxTxNxH, fwd.table["output"])
  return out_BxTxNxH


mask_kwargs = contract.structural_mask_kwargs


def attend(precision, q, k, v, *, mask=None, logits_soft_cap=None, scale=None,
           kv_scales=None, kv_layer=None):
  """The registry's entry: a phase's `Precision` flags (and cache storage), a dense mask
  or a `CausalMask`; kv_scales: those of a quantized cache (read in the body, forward
  only), or None."""
  return flash_attention(q, k, v, **mask_kwargs(mask), logits_soft_cap=logits_soft_cap,
                         scale=scale, flags=precision.attention,
                         kv_cache=precision.cache_storage, kv_scales=kv_scales,
                         layer=kv_layer)


def reads_stack(num_queries: int, G: int, dense_mask: bool) -> bool:
  """Whether a registry call (`attend`: the default blocks) reads one layer of a stack
  in place (`flash_attention(layer=)`): a call of the decode geometry (`decodes`)."""
  return decodes(num_queries * G, DEFAULT_BLOCKS, dense_mask)


KERNEL = contract.KernelSpec(name=NAME, attend=attend, refusal=refusal, trains=True,
                             reads_stack=reads_stack)


def _pad(x, widths):
  """Zero-pads the last two axes of x by `widths` ((before, after) per axis)."""
  if all(w == (0, 0) for w in widths):
    return x
  return jnp.pad(x, ((0, 0),) * (x.ndim - 2) + tuple(widths))

"""The precision contract: what every attention kernel must honour (imports no kernel).

Shapes:
  B: batch, T: query length, S: key/value length,
  N: query heads, K: key/value heads (N = K * G), G: query heads per kv head,
  H: head dim.

Stage dtypes (compute dtype c = the dtype of q, k, v), as in
`shared/design/precision-contract.md`:

  | stage                         | qk=F,lg=F | qk=F,lg=T | qk=T,lg=F | qk=T,lg=T |
  | q, k, v entering attention    | c         | c         | c         | c         |
  | query scale applied to        | q, in c   | q, in c   | logits,f32| logits,f32|
  | QK^T logits                   | c         | c         | f32       | f32       |
  | soft-cap, mask, softmax       | c         | f32       | f32       | f32       |
  | probabilities into wv einsum  | c         | f32       | f32       | f32       |
  | attention output (cast)       | c         | c         | c         | c         |

A flag only ever upcasts; nothing is cast back down before the softmax. The float32 QK
product is computed with `preferred_element_type=float32` on the c-typed operands (the
operands are NOT upcast first); the lowered StableHLO therefore shows
`(tensor<..xbf16>, tensor<..xbf16>) -> tensor<..xf32>` for the qk dot. When the
probabilities are float32, v is upcast to float32 for the wv einsum.
The query scale (H ** -0.5 by default) multiplies q in c before the qk dot when the QK
product is in c (one more rounding of c, as before), but multiplies the float32 logits
after the dot when `float32_qk_product` is set: for H = 128 (1/sqrt(128) is not a power
of two) scaling q in bf16 would add a bf16 rounding of every query that the float32
product exists to avoid. The 'scale' entry of `stage_dtypes` is the dtype it is applied
in.
Every kernel checks every stage with `chex.assert_type` / `chex.assert_shape` against
`stage_dtypes` (trace-time checks, free under jit); the audit reads the same table.

This module is the ground floor: the names of dtypes and dot precisions, the stage table,
the head and mask checks, the mask value, the masks (dense and `CausalMask`), the named
scopes of the two attention dots, what a kernel declares (`KernelSpec`), and the float64
reference every kernel is tested against. Kernels (`attnprec/kernels/`) import it; it
imports none of them.
"""
import dataclasses
import functools
from typing import Callable, Dict, Optional, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np

from attnprec.errors import UserError, choice_error

# ----------------------------------------------------------------------------- names
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LAX_PRECISIONS = {p.name.lower(): p for p in jax.lax.Precision}  # default, high, highest
ALGORITHM_PRESETS = {p.name: p for p in jax.lax.DotAlgorithmPreset if p.name != "DEFAULT"}

PrecisionLike = Union[jax.lax.Precision, jax.lax.DotAlgorithmPreset]


def parse_dtype(name) -> jnp.dtype:
  """'bfloat16' | 'float32' | 'float16' (or a dtype) -> jnp dtype."""
  if not isinstance(name, str):
    try:
      name = jnp.dtype(name).name
    except TypeError:
      raise choice_error("dtype", name, DTYPES) from None
  key = name.lower()
  if key not in DTYPES:
    raise choice_error("dtype", name, DTYPES)
  return jnp.dtype(DTYPES[key])


def parse_precision(name) -> PrecisionLike:
  """A `jax.lax.Precision` name (any case) or a `jax.lax.DotAlgorithmPreset` name.

  Returns the object to pass as `precision=` to `jnp.einsum` / `lax.dot_general`.
  """
  if isinstance(name, (jax.lax.Precision, jax.lax.DotAlgorithmPreset)):
    return name
  if isinstance(name, str):
    if name.lower() in LAX_PRECISIONS:
      return LAX_PRECISIONS[name.lower()]
    if name.upper() in ALGORITHM_PRESETS:
      return ALGORITHM_PRESETS[name.upper()]
  raise choice_error("einsum/matmul precision", name,
                     list(LAX_PRECISIONS) + list(ALGORITHM_PRESETS))


def precision_name(p: PrecisionLike) -> str:
  """The name the lowered StableHLO shows for a precision (DEFAULT, HIGHEST, ...)."""
  return p.name


# ----------------------------------------------------------------------------- stages
STAGES = ("qkv", "scale", "logits", "softmax", "probs", "output")
# Named scopes around the two attention dots: the audit finds them in the lowered program.
QK_SCOPE, WV_SCOPE = "attn_qk", "attn_wv"


def stage_dtypes(compute_dtype, *, float32_qk_product: bool,
                 float32_logits: bool) -> Dict[str, jnp.dtype]:
  """The contract table as data: stage name -> dtype for one flag combination.

  'scale' is the dtype the query scale is applied in: on q in c (before the qk dot)
  when the QK product is in c, on the float32 logits (after the dot) when it is f32."""
  c = jnp.dtype(compute_dtype)
  f32 = jnp.dtype(jnp.float32)
  logits = f32 if float32_qk_product else c
  softmax = f32 if (float32_logits or float32_qk_product) else c
  return {"qkv": c, "scale": logits, "logits": logits, "softmax": softmax,
          "probs": softmax, "output": c}


def scale_queries(q, scale, expected) -> jax.Array:
  """q * scale in c when the contract applies the query scale to q (the QK product in c,
  or c = float32); q unchanged when it applies it to the float32 logits
  (`scale_logits`). Every kernel calls both, so exactly one of them scales."""
  if expected["scale"] != q.dtype:
    return q
  q_scaled = q * jnp.asarray(scale, q.dtype)
  chex.assert_type(q_scaled, expected["scale"])
  return q_scaled


def scale_logits(logits, scale, expected) -> jax.Array:
  """logits * scale in float32 when the contract applies the query scale to the float32
  logits (`float32_qk_product`); logits unchanged when q was scaled (`scale_queries`)."""
  if expected["scale"] == expected["qkv"]:
    return logits   # q was scaled (in c = f32 both places are the same)
  chex.assert_type(logits, expected["scale"])
  return logits * jnp.asarray(scale, logits.dtype)


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


# ----------------------------------------------------------------------------- masks
def check_bool_mask(mask) -> jax.Array:
  """A dense mask as a bool array (True = attend); any other dtype is a `UserError`."""
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise UserError(f"mask must be a boolean array (True = attend), got dtype {mask.dtype}.")
  return mask


def group_mask(mask, B, N, K, G, T, S):
  """Bool mask broadcastable to [B, N, T, S] -> broadcastable to [B, K, G, T, S]."""
  mask = check_bool_mask(mask)
  while mask.ndim < 4:
    mask = mask[None]
  if mask.shape[1] == 1:
    return mask[:, :, None]                               # [B|1, 1, 1, T|1, S|1]
  mask = jnp.broadcast_to(mask, (mask.shape[0], N) + mask.shape[2:])
  return mask.reshape(mask.shape[0], K, G, *mask.shape[2:])  # [B|1, K, G, T|1, S|1]


def visible(q_pos, k_pos, *, causal: bool, sliding_window: Optional[int]):
  """Which keys a query sees, broadcasting q_pos [..., T, 1] against k_pos [..., 1, S]:
  k_pos <= q_pos (if causal) and k_pos > q_pos - sliding_window (if a window is set)."""
  allowed = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), jnp.bool_)
  if causal:
    allowed &= k_pos <= q_pos
  if sliding_window is not None:
    allowed &= k_pos > q_pos - sliding_window
  return allowed


def causal_mask(q_positions_BxT, k_positions_BxS, *, sliding_window: Optional[int] = None):
  """[B, 1, T, S] bool: key position <= query position (and within the window)."""
  return visible(q_positions_BxT[:, None, :, None], k_positions_BxS[:, None, None, :],
                 causal=True, sliding_window=sliding_window)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q_positions_BxT", "k_positions_BxS"],
                   meta_fields=["sliding_window"])
@dataclasses.dataclass(frozen=True, eq=False)
class CausalMask:
  """Causal (sliding-window) mask given by absolute positions, so a kernel can bound each
  block's positions and skip blocks in which no pair attends (a dense mask cannot say
  that without being read). A pytree: the positions are leaves (traced under jit), the
  window is static. Semantics: `causal_mask`."""
  q_positions_BxT: jax.Array          # int, absolute position of each query
  k_positions_BxS: jax.Array          # int, absolute position of each key (cache index)
  sliding_window: Optional[int] = None  # keys more than w-1 positions back are hidden

  def dense(self) -> jax.Array:
    """The same mask as a dense [B, 1, T, S] bool array (for kernels that need one)."""
    return causal_mask(self.q_positions_BxT, self.k_positions_BxS,
                       sliding_window=self.sliding_window)


def dense_mask(mask):
  """None, a dense bool array, or a `CausalMask` -> None or a dense mask."""
  return mask.dense() if isinstance(mask, CausalMask) else mask


# ----------------------------------------------------------------------------- kernels
@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """What a kernel module declares to the registry (`attnprec.kernels`).

  attend(precision, q, k, v, *, mask, logits_soft_cap, scale) -> out [B, T, N, H]
    mask is None, a dense bool array broadcastable to [B, N, T, S], or a `CausalMask`.
  refusal(precision, *, logits_soft_cap=None) -> None if the kernel honours every
    setting, else the one-paragraph reason it refuses (naming the bad value and the
    valid ones). `Precision` calls it when it is constructed, the kernel again at trace.
  qk_scope / wv_scope: the named scopes its two dots sit in (None: the dots sit inside a
    library the kernel calls and cannot be scoped one by one).
  """
  name: str
  attend: Callable
  refusal: Callable[..., Optional[str]]
  qk_scope: Optional[str] = QK_SCOPE
  wv_scope: Optional[str] = WV_SCOPE


def honours_everything(precision, *, logits_soft_cap=None) -> Optional[str]:
  """The `refusal` of a kernel that implements every row of the table."""
  del precision, logits_soft_cap
  return None


# ----------------------------------------------------------------------------- reference
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

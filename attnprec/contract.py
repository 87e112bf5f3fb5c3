"""The precision contract: what every attention kernel must honour (imports no kernel).

Shapes:
  B: batch, T: query length, S: key/value length,
  N: query heads, K: key/value heads (N = K * G), G: query heads per kv head,
  H: head dim.

Stage dtypes (compute dtype c = the dtype of q, k, v), as in
`docs/contract.md`:

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

The cache rows (`cache_stage_dtypes`, for attention over a KV cache whose storage,
`CacheStorage`, is int8 or float8 codes with float32 absmax scales; `attnprec.kvquant`):

  | row                              | qk=F,lg=F | qk=F,lg=T | qk=T,lg=F | qk=T,lg=T |
  | k / v stored as                  | codes (int8, float8_e4m3fn, float8_e5m2)      |
  | scales                           | float32; per (token, kv head), or per (kv     |
  |                                  | head, channel) for keys, fixed at prefill     |
  | codes into the qk / wv dot       | cast exactly to the dot's operand dtype (every|
  |                                  | code is a bf16, f16 and f32 value): qk c (f32 |
  |                                  | with a per-channel scale and qk=T), wv probs  |
  | per-token key scale applied to   | logits, c | logits, c | logits,f32| logits,f32|
  | per-channel key scale applied to | q, in c   | q, in c   | q, in f32 | q, in f32 |
  | value scale applied to           | probs, c  | probs,f32 | probs,f32 | probs,f32 |
  | q, probabilities quantized       | never     | never     | never     | never     |

The key scale multiplies the logits column-wise right after the qk dot (before the query
scale, the soft-cap and the mask); the value scale multiplies the normalised
probabilities column-wise before the wv dot. Nothing is dequantized: no code * scale
product is ever rounded to a dtype. An unscaled cache (float32 / bfloat16 storage) is
read back as c and meets the first table unchanged. `check_cache_operands`,
`query_operand`, `code_operand` and `scale_columns` are the kernels' shared
implementation of these rows, each with its chex asserts.

The knobs of both tables travel as one value, `AttentionFlags` (`Precision.attention`);
`prepare` is every kernel's preamble (the checks, the table for its flags, the dots'
precision, the query scale).

This module is the ground floor: the names of dtypes and dot precisions, the knobs
(`AttentionFlags`), the stage table, the kernels' preamble (`prepare`),
the head and mask checks, the mask value, the masks (dense and `CausalMask`), the named
scopes of the two attention dots, what a kernel declares (`KernelSpec`), and the float64
reference every kernel is tested against. Kernels (`attnprec/kernels/`) import it; it
imports none of them.
"""
import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np

from attnprec import platforms
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


def canonical_dtype(name) -> str:
  """The one spelling of a dtype setting ('BFLOAT16', jnp.bfloat16 -> 'bfloat16'): what
  the precision line and results record, whatever form it was given in."""
  return jnp.dtype(parse_dtype(name)).name


def canonical_precision(name) -> str:
  """The one spelling of a dot precision setting: a lax.Precision's lower-case name
  ('HiGhEsT', lax.Precision.HIGHEST -> 'highest'), a DotAlgorithmPreset's own name."""
  p = parse_precision(name)
  return p.name.lower() if isinstance(p, jax.lax.Precision) else p.name


def precision_name(p: PrecisionLike) -> str:
  """The name the lowered StableHLO shows for a precision (DEFAULT, HIGHEST, ...)."""
  return p.name


# ----------------------------------------------------------------------------- key offset
# The key offset (`Precision.key_offset`, `attnprec.keyoffset`): a vector c per layer and kv
# head subtracted from every rotated key in float32, before the keys' one rounding to c
# (or to the cache's storage type). Exact: each query's logits shift by the constant q . c,
# which the softmax removes, PROVIDED every key a query sees had the same c subtracted.
#
#   | row                         | 'none'            | 'zero' / 'bias' / 'prefill_mean'   |
#   | keys before the rounding    | projection in c,  | projection accumulated in f32, bias|
#   |                             | bias added in c,  | added in f32, RoPE in f32, then    |
#   |                             | RoPE f32 -> c     | k - c in f32, rounded once to c    |
#   | c                           | -                 | f32 [K, H] ('bias') or [B, K, H]   |
#   | decode steps                | -                 | the c the prefill stored (cache)   |
#   | refused                     | -                 | soft-capped logits, sinks with an  |
#   |                             |                   | explicit logit; 'bias' without a   |
#   |                             |                   | key bias or with a key norm;       |
#   |                             |                   | 'prefill_mean' in the train phase  |
#
# The later rows of the table (qk dot, softmax, ...) are unchanged: the kernels receive
# the residual keys in c like any other keys. The audit proves the order from the program
# (`attnprec.inspect.offset_check`): the subtraction is float32 and no rounding to 16 bits
# lies between the key projection and it.
KEY_OFFSETS = ("none", "zero", "bias", "prefill_mean")
KEY_OFFSET_SCOPE = "key_offset"   # the named scope of the subtraction


# ----------------------------------------------------------------------------- stages
STAGES = ("keys", "qkv", "scale", "logits", "softmax", "probs", "output")
# Named scopes around the two attention dots: the audit finds them in the lowered program.
QK_SCOPE, WV_SCOPE = "attn_qk", "attn_wv"
# The named scope of a kernel's own backward dots (dP = dO V^T, dv, dq, dk), where a kernel
# writes its backward pass by hand (the 'flash' kernel; `backward_stage_dtypes`).
GRAD_SCOPE = "attn_grad"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionFlags:
  """The attention knobs of the table, as one value: static, hashable data (a jit key).

  `Precision.attention` builds it from a phase's fields of the same names; every kernel,
  `stage_dtypes`, the cache rows and `prepare` take it whole. A new knob is one field
  here (with its default, the setting kernels had before it), its rows in the table, the
  `Precision` field of the same name, and the kernels' use of it."""
  float32_qk_product: bool = True    # the QK^T dot accumulates and returns float32
  float32_logits: bool = True        # soft-cap, mask and softmax run in float32
  einsum_precision: str = "default"  # precision of BOTH the qk and the wv einsum
  # A vector subtracted from every rotated key in float32 before the keys' one rounding
  # (KEY_OFFSETS, `attnprec.keyoffset`): applied by the layer before any kernel, so every
  # kernel receives the residual keys and honours it.
  key_offset: str = "none"

  def __post_init__(self):
    for flag in ("float32_qk_product", "float32_logits"):
      if not isinstance(getattr(self, flag), bool):
        raise choice_error(flag, getattr(self, flag), (True, False))
    if self.key_offset not in KEY_OFFSETS:
      raise choice_error("key_offset", self.key_offset, KEY_OFFSETS)
    try:
      parse_precision(self.einsum_precision)
    except UserError:
      raise choice_error("einsum_precision", self.einsum_precision,
                         list(LAX_PRECISIONS) + list(ALGORITHM_PRESETS)) from None

  @property
  def einsum(self) -> PrecisionLike:
    """The `precision=` of both attention dots."""
    return parse_precision(self.einsum_precision)

  def settings(self) -> Dict[str, object]:
    """Knob name -> value, in field order."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def differing(self, other: "AttentionFlags") -> Optional[str]:
    """The first knob whose setting differs from `other`'s (einsum precisions compared
    as parsed: 'default' == 'DEFAULT'), or None."""
    for name, value in self.settings().items():
      want = getattr(other, name)
      same = (parse_precision(value) == parse_precision(want)
              if name == "einsum_precision" else value == want)
      if not same:
        return name
    return None

  def describe(self) -> str:
    """The knobs as `name=value`; the key offset only when one is in force."""
    return " ".join(f"{k}={v}" for k, v in self.settings().items()
                    if not (k == "key_offset" and v == "none"))


def stage_dtypes(compute_dtype, flags: AttentionFlags) -> Dict[str, jnp.dtype]:
  """The contract table as data: stage name -> dtype for one flag combination.

  'keys' is the dtype the rotated keys are formed in before their rounding to c: c
  without a key offset (projection rounded to c, bias added in c), float32 with one (the
  offset subtracted in float32, then one rounding: the offset row).

  'scale' is the dtype the query scale is applied in: on q in c (before the qk dot)
  when the QK product is in c, on the float32 logits (after the dot) when it is f32."""
  c = jnp.dtype(compute_dtype)
  f32 = jnp.dtype(jnp.float32)
  logits = f32 if flags.float32_qk_product else c
  softmax = f32 if (flags.float32_logits or flags.float32_qk_product) else c
  keys = c if flags.key_offset == "none" else f32
  return {"keys": keys, "qkv": c, "scale": logits, "logits": logits, "softmax": softmax,
          "probs": softmax, "output": c}


def backward_stage_dtypes(compute_dtype, flags: AttentionFlags) -> Dict[str, jnp.dtype]:
  """What a hand-written backward pass (the 'flash' kernel's) rounds, as data: the logits
  recomputed as the forward's row (`stage_dtypes`), then

    'p'            P = exp(logits - logsumexp), float32
    'ds'           dP = dO V^T and dS = P (dP - delta), float32 (delta = rowsum(dO * O))
    'grad_operand' P and dS are rounded to this before the dv = P^T dO, dq = dS K and
                   dk = dS^T Q dots: c (as jax's splash attention); the dots' other
                   operands (dO, K, Q, V) are c
    'grad_result'  those dots accumulate and return float32

  Under einsum_precision 'highest' a kernel may pass every operand as float32 (exact
  for c values: Mosaic multiplies at fp32 only float32 operands)."""
  c, f32 = jnp.dtype(compute_dtype), jnp.dtype(jnp.float32)
  row = stage_dtypes(c, flags)
  return {"logits": row["logits"], "softmax": row["softmax"], "p": f32, "ds": f32,
          "grad_operand": c, "grad_result": f32}


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


# ----------------------------------------------------------------------------- cache


# The KV cache's storage: per keys and values, a storage dtype and, for the scaled types,
# a scale granularity (`Precision.kv_cache_*`). 'compute' stores the compute dtype c
# (today's cache, the default). float32 / bfloat16 store values of that dtype and are
# read back as c (a cast: exact from float32, and from bfloat16 into float32; a rounding
# of c at the write only for bfloat16 under float32 compute). The scaled types store
# codes and float32 scales: code = clip(round_even(x / scale), -qmax, qmax) for int8,
# clip(x / scale, -qmax, qmax) cast (round to nearest even) for float8, with
# scale = absmax / qmax over the scale's group (`attnprec.kvquant`).
KV_CACHE_DTYPES = ("compute", "float32", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8")
# Scaled storage: name -> (code dtype, qmax = the largest finite code magnitude).
SCALED_KV_DTYPES = {"int8": (jnp.dtype(jnp.int8), 127.0),
                    "float8_e4m3fn": (jnp.dtype(jnp.float8_e4m3fn), 448.0),
                    "float8_e5m2": (jnp.dtype(jnp.float8_e5m2), 57344.0)}
# Scale granularities: 'token' = one scale per (token, kv head) over H; 'channel' = one
# per (kv head, head-dim channel), fixed at the cache's first write (the prompt's keys at
# prefill, as KIVI / KVQuant do). Values take only 'token' (their channels mix in the wv
# dot's sum over S; a per-channel value scale cannot be folded into the probabilities).
KV_SCALE_GRANULARITIES = {"k": ("token", "channel"), "v": ("token",)}


@dataclasses.dataclass(frozen=True)
class CacheStorage:
  """The cache's storage, resolved (`Precision.cache_storage`): static, hashable data.

  k_dtype / v_dtype: a name in KV_CACHE_DTYPES. k_scale / v_scale: None for the unscaled
  dtypes, 'token' or 'channel' (keys only) for the scaled ones."""
  k_dtype: str = "compute"
  v_dtype: str = "compute"
  k_scale: Optional[str] = None
  v_scale: Optional[str] = None
  # The key offset the cache's keys were stored with (KEY_OFFSETS): any but 'none' keeps
  # the offset vector beside the keys, so every decode step subtracts the one its prefill
  # used (a cache filled under another offset is refused, `cache.LayerCache.key_offset`).
  key_offset: str = "none"

  def without_offset(self) -> "CacheStorage":
    """The same storage with key_offset 'none': what the keys and values are stored as."""
    return dataclasses.replace(self, key_offset="none")

  @property
  def quantized(self) -> bool:
    """Whether the kernels see codes and scales (an int8 / float8 side)."""
    return self.k_dtype in SCALED_KV_DTYPES or self.v_dtype in SCALED_KV_DTYPES

  def describe(self) -> str:
    side = lambda d, g: d + (f"/{g}" if g else "")  # noqa: E731
    return f"kv_cache=k:{side(self.k_dtype, self.k_scale)},v:{side(self.v_dtype, self.v_scale)}"


COMPUTE_CACHE = CacheStorage()


def cache_storage_error(compute_dtype, *, k_dtype, v_dtype, k_scale,
                        v_scale) -> Optional[str]:
  """None if the cache setting is valid, else the paragraph naming the bad value and the
  valid ones (`Precision` raises it at construction)."""
  for side, dtype, scale in (("k", k_dtype, k_scale), ("v", v_dtype, v_scale)):
    field = f"precision.kv_cache_{side}_dtype"
    if dtype not in KV_CACHE_DTYPES:
      return (f"Invalid {field} = {dtype!r}; valid values are: "
              f"{', '.join(repr(d) for d in KV_CACHE_DTYPES)}.")
    valid = KV_SCALE_GRANULARITIES[side] if dtype in SCALED_KV_DTYPES else ()
    if scale is not None and scale not in valid:
      what = (f"valid values for {dtype!r}: None (= 'token'), "
              f"{', '.join(repr(g) for g in valid)}" if valid else
              f"{dtype!r} is stored unscaled and takes none; valid: None")
      extra = (" (a per-channel scale is for keys only: values take 'token')"
               if side == "v" and scale == "channel" else "")
      return f"Invalid precision.kv_cache_{side}_scale = {scale!r}{extra}: {what}."
    if dtype == "bfloat16" and jnp.dtype(compute_dtype) == jnp.float16:
      return (f"Invalid {field} = 'bfloat16' under precision.dtype = 'float16': a bfloat16 "
              f"cache cannot hold float16 values exactly nor be read back as float16 "
              f"without rounding; valid here: 'compute', 'float32', "
              f"{', '.join(repr(d) for d in SCALED_KV_DTYPES)}.")
  return None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k_token_BxKxS", "k_channel_BxKxH", "v_token_BxKxS"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True, eq=False)
class KVScales:
  """The float32 scales of a quantized cache, as the kernels take them (None where the
  setting has none): x = code * scale, exactly, in float64 terms."""
  k_token_BxKxS: Optional[jax.Array] = None     # per (token, kv head): on the logits
  k_channel_BxKxH: Optional[jax.Array] = None   # per (kv head, channel): on q
  v_token_BxKxS: Optional[jax.Array] = None     # per (token, kv head): on the probs


def cache_stage_dtypes(compute_dtype, storage: CacheStorage,
                       flags: AttentionFlags) -> Dict[str, object]:
  """The cache rows of the contract table for one flag combination (with `stage_dtypes`).

  | row         | meaning                                                              |
  | k_cache     | dtype the kernel receives keys in: a code dtype (int8, float8_*),    |
  |             | else c (an unscaled cache is read back as c)                         |
  | v_cache     | the same for values                                                  |
  | k_scale     | 'token' | 'channel' | None; the scales are float32 ('scale_dtype')   |
  | k_scale_in  | per-token: multiplies the QK^T logits column-wise, in the logits     |
  |             | dtype; per-channel: multiplies q before the dot, in f32 with         |
  |             | float32_qk_product (else in c)                                       |
  | v_scale_in  | folded into the probabilities before the wv dot, in the probs dtype  |
  | q_into_qk   | q's dtype at the qk dot: c, or f32 (per-channel key scale, qk=T)     |
  | k_into_qk   | the codes' dtype at the qk dot: q_into_qk (codes cast exactly: every |
  |             | int8 / float8 code is a bfloat16, float16 and float32 value)         |
  | v_into_wv   | the codes' dtype at the wv dot: the probs dtype                      |
  q and the probabilities are never quantized: 'q_into_qk' and 'probs' are never a code
  dtype (the audit checks the compiled program for that)."""
  base = stage_dtypes(compute_dtype, flags)
  c, f32 = base["qkv"], jnp.dtype(jnp.float32)
  code = lambda d: SCALED_KV_DTYPES[d][0] if d in SCALED_KV_DTYPES else c  # noqa: E731
  channel = storage.k_scale == "channel"
  q_in = f32 if (channel and flags.float32_qk_product) else c
  return {"k_cache": code(storage.k_dtype), "v_cache": code(storage.v_dtype),
          "k_scale": storage.k_scale, "v_scale": storage.v_scale, "scale_dtype": f32,
          "k_scale_in": (None if storage.k_scale is None else
                         base["logits"] if storage.k_scale == "token" else q_in),
          "v_scale_in": None if storage.v_scale is None else base["probs"],
          "q_into_qk": q_in, "k_into_qk": q_in, "v_into_wv": base["probs"]}


def check_cache_operands(q, k, v, storage: CacheStorage, kv_scales,
                         flags: AttentionFlags):
  """The kernels' check of their inputs against the table: with kv_scales None, q, k, v
  in c (returns None); with a `KVScales`, k / v in the cache rows' code dtypes and each
  scale float32 of its shape, present exactly where `storage` has one (returns the rows,
  `cache_stage_dtypes`). Trace-time chex asserts; a mismatch between the setting and
  the scales is a UserError."""
  c = q.dtype
  expected = stage_dtypes(c, flags)
  if kv_scales is None:
    chex.assert_type([q, k, v], [expected["qkv"]] * 3)
    return None
  if not storage.quantized:
    raise UserError(f"Cache scales were given but the cache storage is unscaled "
                    f"({storage.describe()}); scaled dtypes: "
                    f"{', '.join(repr(d) for d in SCALED_KV_DTYPES)}.")
  rows = cache_stage_dtypes(c, storage, flags)
  chex.assert_type([q, k, v], [expected["qkv"], rows["k_cache"], rows["v_cache"]])
  B, S, K, H = k.shape
  want = {"k_token_BxKxS": (B, K, S) if rows["k_scale"] == "token" else None,
          "k_channel_BxKxH": (B, K, H) if rows["k_scale"] == "channel" else None,
          "v_token_BxKxS": (B, K, S) if rows["v_scale"] == "token" else None}
  for name, shape in want.items():
    got = getattr(kv_scales, name)
    if (got is None) != (shape is None):
      raise UserError(f"The cache storage {storage.describe()} needs KVScales.{name} "
                      f"{'of shape ' + str(shape) if shape else 'to be None'}.")
    if got is not None:
      chex.assert_shape(got, shape)
      chex.assert_type(got, rows["scale_dtype"])
  return rows


def query_operand(q_BxTxKxGxH, rows, kv_scales):
  """q as the qk dot takes it: unchanged without a quantized cache (rows None); else
  times the per-channel key scale (if any) in the 'k_scale_in' dtype."""
  if rows is None:
    return q_BxTxKxGxH
  if rows["k_scale"] == "channel":
    dt = rows["k_scale_in"]
    scale_Bx1xKx1xH = kv_scales.k_channel_BxKxH[:, None, :, None, :].astype(dt)
    q_BxTxKxGxH = q_BxTxKxGxH.astype(dt) * scale_Bx1xKx1xH
  chex.assert_type(q_BxTxKxGxH, rows["q_into_qk"])
  return q_BxTxKxGxH


def code_operand(x, rows, row: str):
  """Cache keys / values (row 'k_into_qk' / 'v_into_wv') cast to the dot's operand dtype:
  exact for codes (every int8 / float8 code is a bf16, f16 and f32 value); x unchanged
  without a quantized cache (rows None)."""
  if rows is None:
    return x
  x = x.astype(rows[row])
  chex.assert_type(x, rows[row])
  return x


def scale_columns(x_BxKxGxTxS, scale_BxKxS, dtype) -> jax.Array:
  """x times a per-(token, kv head) cache scale, column s of every row (the QK^T logits
  for a key scale, the probabilities for a value scale), in `dtype` (the table's)."""
  chex.assert_type(x_BxKxGxTxS, dtype)
  out = x_BxKxGxTxS * scale_BxKxS[:, :, None, None, :].astype(dtype)
  chex.assert_type(out, dtype)
  return out


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


# ----------------------------------------------------------------------------- preamble
@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
  """What `prepare` hands a kernel: q, k, v checked against the table for its flags, and
  what every kernel reads before its first dot (static data, plus the cache's scales)."""
  # q [B, T, N, H], k / v [B, S, K, H], G = N // K query heads per kv head
  B: int; T: int; S: int; N: int; K: int; G: int; H: int  # noqa: E702
  flags: AttentionFlags
  stages: Dict[str, jnp.dtype]           # stage_dtypes(c, flags), c = q's dtype
  rows: Optional[Dict[str, object]]      # cache_stage_dtypes (quantized cache), or None
  einsum: PrecisionLike                  # `precision=` of both attention dots
  scale: float                           # the query scale: H ** -0.5 unless given
  kv_scales: Optional[KVScales] = None   # a quantized cache's scales, or None

  def queries(self, q_BxTxNxH) -> jax.Array:
    """q as the qk dot takes it, [B, T, K, G, H]: scaled in c where the table puts the
    query scale on q (`scale_queries`), times a per-channel key scale if any
    (`query_operand`)."""
    q_BxTxKxGxH = scale_queries(q_BxTxNxH, self.scale, self.stages).reshape(
        self.B, self.T, self.K, self.G, self.H)
    return query_operand(q_BxTxKxGxH, self.rows, self.kv_scales)

  def check_float32_qk_operands(self, q) -> None:
    """Refuses the QK dot's float32 form (`float32_qk_operands`) where it cannot apply
    (`float32_qk_form_problems`)."""
    k_codes = (str(self.rows["k_cache"]) if self.rows is not None
               and self.rows["k_scale"] is not None else None)
    why = float32_qk_form_problems(q.dtype, self.flags, k_codes=k_codes)
    if why:
      raise UserError("float32_qk_operands=True runs the QK dot on q and k cast to "
                      "float32, which needs " + "; and ".join(why) + ". Pass "
                      "float32_qk_operands=False, or change the setting named.")


def float32_qk_form_problems(compute_dtype, flags: AttentionFlags, *,
                             k_codes: Optional[str] = None) -> List[str]:
  """Why the QK dot's float32 form (q and k cast exactly to float32 for a dot whose
  product the table makes float32 anyway) would change a stage or not be used: it needs
  the float32 QK product of a 16-bit c, keys of c (not a quantized cache's codes,
  `k_codes`) and an einsum precision that does not name its own operand types (a
  dot-algorithm preset). [] where it applies; `Precision.float32_qk_operands` and the
  kernels' check both ask this."""
  why = []
  if stage_dtypes(compute_dtype, flags)["logits"] != jnp.float32 or \
      jnp.dtype(compute_dtype) == jnp.float32:
    why.append(f"a float32 QK product of a 16-bit compute dtype (got "
               f"{jnp.dtype(compute_dtype)}, float32_qk_product={flags.float32_qk_product})")
  if k_codes is not None:
    why.append(f"keys of the compute dtype (got {k_codes} cache codes)")
  if isinstance(flags.einsum, jax.lax.DotAlgorithmPreset):
    why.append(f"a plain einsum_precision (got the preset {flags.einsum.name})")
  return why


def bits_dtype(dtype) -> jnp.dtype:
  """The unsigned integers that hold a float of 8 or 16 bits as its raw bits (uint8,
  uint16); any other dtype itself. The KV cache stores such values so (`attnprec.cache`:
  XLA:CPU writes integer buffers in place) and the blockwise kernel slices them so."""
  d = jnp.dtype(dtype)
  if d.itemsize >= 4 or not jnp.issubdtype(d, jnp.floating):
    return d
  return jnp.dtype(f"uint{8 * d.itemsize}")


def reinterpret(x, dtype) -> jax.Array:
  """x's bits as `dtype` (a bitcast of the same width); x itself when it is one already."""
  return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def qk_operand(x, float32_operands: bool):
  """A QK dot operand as the dot takes it: x, or x cast (exactly) to float32 in the
  float32 form (`Precision.float32_qk_operands`; checked by `check_float32_qk_operands`)."""
  return x.astype(jnp.float32) if float32_operands else x


def prepare(q, k, v, flags: AttentionFlags, *, scale=None,
            kv_cache: CacheStorage = COMPUTE_CACHE, kv_scales=None) -> Prepared:
  """Every kernel's preamble: checks the heads (`check_heads`) and q, k, v (and a
  quantized cache's codes and scales, `check_cache_operands`) against the table for
  `flags`, and resolves the stage dtypes, the cache rows, the dots' precision and the
  query scale. q [B, T, N, H], k / v [B, S, K, H]."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = check_heads(q, k, v)
  # A precision the platform traced for does not honour is refused here, in every
  # kernel, not run as something else (a TPU runs no F32_F32_F32 dot).
  platforms.check_traced(flags.einsum_precision, "einsum_precision")
  stages = stage_dtypes(q.dtype, flags)
  rows = check_cache_operands(q, k, v, kv_cache, kv_scales, flags)
  return Prepared(B=B, T=T, S=S, N=N, K=K, G=G, H=H, flags=flags, stages=stages,
                  rows=rows, einsum=flags.einsum,
                  scale=H ** -0.5 if scale is None else scale, kv_scales=kv_scales)


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
                   meta_fields=["sliding_window", "own_positions"])
@dataclasses.dataclass(frozen=True, eq=False)
class CausalMask:
  """Causal (sliding-window) mask given by absolute positions, so a kernel can bound each
  block's positions and skip blocks in which no pair attends (a dense mask cannot say
  that without being read). A pytree: the positions are leaves (traced under jit), the
  window is static. Semantics: `causal_mask`.

  own_positions (static): the keys are the queries' own tokens at positions 0 .. T-1 in
  order (a sequence attending to itself from its first token: a train step, a forward
  without a cache; set by the model, which made the positions). The mask is then the
  causal mask of indices, which a kernel that takes its mask statically (splash) can
  build without reading the positions."""
  q_positions_BxT: jax.Array          # int, absolute position of each query
  k_positions_BxS: jax.Array          # int, absolute position of each key (cache index)
  sliding_window: Optional[int] = None  # keys more than w-1 positions back are hidden
  own_positions: bool = False

  def dense(self) -> jax.Array:
    """The same mask as a dense [B, 1, T, S] bool array (for kernels that need one)."""
    return causal_mask(self.q_positions_BxT, self.k_positions_BxS,
                       sliding_window=self.sliding_window)


def dense_mask(mask):
  """None, a dense bool array, or a `CausalMask` -> None or a dense mask."""
  return mask.dense() if isinstance(mask, CausalMask) else mask


def default_positions(q_positions_BxT, k_positions_BxS, B: int, T: int, S: int):
  """The positions a kernel assumes when given none: keys 0 .. S-1, the T queries the last
  T of them (a prefill or a decode step at the cache's end); both checked [B, T] / [B, S]."""
  if k_positions_BxS is None:
    k_positions_BxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  if q_positions_BxT is None:
    q_positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + (S - T), (B, T))
  chex.assert_shape(q_positions_BxT, (B, T))
  chex.assert_shape(k_positions_BxS, (B, S))
  return q_positions_BxT, k_positions_BxS


def structural_mask_kwargs(mask) -> dict:
  """None, a dense bool mask or a `CausalMask` -> the masking keyword arguments of a
  kernel that uses a CausalMask structurally (blockwise, pallas: to skip hidden blocks):
  causal, q_positions_BxT, k_positions_BxS, sliding_window; else mask."""
  if isinstance(mask, CausalMask):
    return dict(causal=True, q_positions_BxT=mask.q_positions_BxT,
                k_positions_BxS=mask.k_positions_BxS, sliding_window=mask.sliding_window)
  return dict(mask=mask)


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
  trains: whether it has a gradient (the train phase refuses a kernel without one before
    anything runs).
  call_scope: the named scope around a library call whose dots the audit reads from the
    kernel's bodies (splash), not as projections.
  reads_stack: whether a call takes a stack of layers' caches and reads one in place.
  float32_qk_form: whether its `attend` runs the QK dot in the float32 form where
    `Precision.float32_qk_operands` asks for it (q and k cast to float32); a kernel whose
    dots sit in a library has no say in their operands.
  """
  name: str
  attend: Callable
  refusal: Callable[..., Optional[str]]
  qk_scope: Optional[str] = QK_SCOPE
  wv_scope: Optional[str] = WV_SCOPE
  trains: bool = True
  float32_qk_form: bool = False
  # The named scope around a library kernel's call whose dots the audit reads from its
  # bodies (`inspect.pallas_check`): interpreted, they are plain HLO dots in this scope,
  # not projections. None: no such call.
  call_scope: Optional[str] = None
  # reads_stack(num_queries, G, dense_mask) -> whether `attend` takes a stack of layers'
  # caches and the layer (`kv_layer`), reading that layer in place (a scanned model's
  # decode step); None: never (the layer is sliced out for it, `kernels.attend`).
  reads_stack: Optional[Callable[..., bool]] = None


# The einsum precisions Mosaic's lowering of a dot inside a Pallas TPU kernel takes.
MOSAIC_PRECISIONS = ("default", "highest")


def pallas_settings_refusal(kernel: str, flags: AttentionFlags,
                            storage: CacheStorage, reads_scales: bool = False
                            ) -> Optional[str]:
  """The refusal of a Pallas attention kernel (`pallas`, `flash`): a quantized KV cache
  where its body has no place for the scales (`reads_scales` False) or an einsum
  precision Mosaic does not take (only DEFAULT and HIGHEST); None if it honours them."""
  if storage.quantized and not reads_scales:
    return (f"The {kernel!r} attention kernel cannot read a quantized KV cache "
            f"(precision.kv_cache_k_dtype = {storage.k_dtype!r}, "
            f"precision.kv_cache_v_dtype = {storage.v_dtype!r}): its body has no place "
            f"for the cache's scales. Valid cache dtypes for {kernel!r}: 'compute', "
            f"'float32', 'bfloat16'. Use kernel 'dot_product' or 'blockwise' for "
            f"{', '.join(repr(d) for d in SCALED_KV_DTYPES)}.")
  if flags.einsum not in (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST):
    return (f"The {kernel!r} attention kernel cannot honour einsum_precision="
            f"{flags.einsum_precision!r}: Mosaic's lowering of a dot inside a Pallas TPU "
            f"kernel takes only jax.lax.Precision DEFAULT or HIGHEST (no HIGH, no "
            f"dot-algorithm preset). Valid einsum_precision values for {kernel!r}: "
            f"{', '.join(repr(p) for p in MOSAIC_PRECISIONS)}. Use kernel 'dot_product' or "
            f"'blockwise' for other settings.")
  return None


def static_number(kernel: str, name: str, x) -> Optional[float]:
  """A Python float (or None) for a kernel built from numbers (a Pallas body's closure,
  splash's construction): a concrete JAX / NumPy scalar is read once; a traced one cannot
  be baked into a kernel and is refused naming `kernel` and `name`."""
  if x is None or isinstance(x, (int, float)):
    return None if x is None else float(x)
  try:
    return float(x)
  except (TypeError, jax.errors.ConcretizationTypeError):
    raise UserError(f"The {kernel!r} kernel's {name} must be a number known when the "
                    f"kernel is built (a Python float or a concrete scalar), got a traced "
                    f"{type(x).__name__}; valid: a float, e.g. {name}=0.125.") from None


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

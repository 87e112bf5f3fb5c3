"""Quantization of the KV cache: codes and float32 absmax scales, done right.

Shapes: B batch, T tokens written by one call, K kv heads, H head dim.

For a scaled storage dtype (`contract.SCALED_KV_DTYPES`: int8, float8_e4m3fn,
float8_e5m2) with qmax its largest finite code magnitude (127, 448, 57344):

  scale = absmax / qmax                  float32, over the scale's group:
                                           'token':   the H channels of one (token, kv head)
                                           'channel': the T tokens of one (kv head, channel)
  code  = clip(x / scale, -qmax, qmax)   float32 division (correctly rounded), clipped
                                           BEFORE the cast, so an absmax element (x / scale
                                           may round to 127.00001) never overflows (to +128
                                           or, in float8_e4m3fn, to NaN)
          then rounded to nearest even: `jnp.round` for int8, the float8 cast itself.
  x    ~= code * scale                   exactly representable in float64; the kernels
                                           never form this product: they take the codes
                                           (exact in bf16 / f16 / f32) and apply the scale
                                           to the logits, q or the probabilities
                                           (`contract.cache_stage_dtypes`).

Edge cases:
  * an all-zero group has absmax 0: its scale is 0 and its codes are 0 (the division is by
    1 there, never by 0), so it dequantizes to exact zeros;
  * a group holding a NaN or an Inf is NOT stored as a finite code: its scale is set to
    NaN (its codes to 0). The NaN reaches the logits (or q) and the probabilities of
    every query that sees it, so the model's logits become non-finite and the existing
    checks report it (`decoding.generate`'s `finite_B`, `checkpoints.logits`'
    NonFiniteError) as they do for a non-finite value in an unquantized cache. The
    `finite` helpers below give the same verdict as data.

Round-trip error per element (relative to the group's absmax, from the code grids):
int8 <= 0.5 / 127; float8_e4m3fn <= 2^-4 relative to |x| (3 mantissa bits) down to
absmax * 2^-6 / 448 * 2^-3 (subnormals); float8_e5m2 <= 2^-3 relative (2 mantissa bits).
"""
from typing import Tuple

import jax
import jax.numpy as jnp

from attnprec.contract import SCALED_KV_DTYPES
from attnprec.errors import choice_error

F32 = jnp.float32


def code_dtype(name: str) -> jnp.dtype:
  """The code dtype of a scaled storage dtype name."""
  if name not in SCALED_KV_DTYPES:
    raise choice_error("scaled KV cache dtype", name, SCALED_KV_DTYPES)
  return SCALED_KV_DTYPES[name][0]


def qmax(name: str) -> float:
  """The largest finite code magnitude of a scaled storage dtype."""
  code_dtype(name)
  return SCALED_KV_DTYPES[name][1]


def encode(x, scale, name: str) -> jax.Array:
  """Codes of x (any float dtype) for a float32 `scale` broadcastable to it: the division
  in float32, non-finite quotients to 0, clip to [-qmax, qmax], round to nearest even,
  cast. A zero (or non-finite) scale divides by 1 (the caller marks non-finite groups)."""
  x32 = x.astype(F32)
  scale = scale.astype(F32)
  usable = jnp.isfinite(scale) & (scale > 0)
  y = x32 / jnp.where(usable, scale, 1.0)
  y = jnp.where(jnp.isfinite(y), y, 0.0)
  m = qmax(name)
  y = jnp.clip(y, -m, m)
  if name == "int8":
    y = jnp.round(y)                   # half to even; exact integers in [-127, 127]
  return y.astype(code_dtype(name))    # float8: XLA's convert rounds to nearest even


def absmax_scale(x, axis, name: str) -> jax.Array:
  """float32 absmax / qmax over `axis`; NaN where the group holds a non-finite value."""
  x32 = x.astype(F32)
  absmax = jnp.max(jnp.abs(jnp.where(jnp.isfinite(x32), x32, 0.0)), axis=axis)
  scale = absmax / jnp.asarray(qmax(name), F32)
  return jnp.where(jnp.all(jnp.isfinite(x32), axis=axis), scale, jnp.nan)


def quantize_token(x_BxTxKxH, name: str) -> Tuple[jax.Array, jax.Array]:
  """Per-(token, kv head) quantization: (codes [B, T, K, H], scale [B, T, K] float32)."""
  scale_BxTxK = absmax_scale(x_BxTxKxH, -1, name)
  codes_BxTxKxH = encode(x_BxTxKxH, scale_BxTxK[..., None], name)
  return codes_BxTxKxH, scale_BxTxK


def channel_scale(x_BxTxKxH, name: str) -> jax.Array:
  """Per-(kv head, channel) scale over the T tokens: [B, K, H] float32 (NaN where a
  channel holds a non-finite value)."""
  return absmax_scale(x_BxTxKxH, 1, name)


def quantize_channel(x_BxTxKxH, scale_BxKxH, name: str) -> Tuple[jax.Array, jax.Array]:
  """Codes of x under fixed per-channel scales [B, K, H] (values past the scale's range
  clip to +-qmax); returns (codes [B, T, K, H], the scale with NaN wherever x holds a
  non-finite value in that channel: the channel is then reported, not silently stored)."""
  codes_BxTxKxH = encode(x_BxTxKxH, scale_BxKxH[:, None], name)
  bad_BxKxH = ~jnp.all(jnp.isfinite(x_BxTxKxH.astype(F32)), axis=1)
  return codes_BxTxKxH, jnp.where(bad_BxKxH, jnp.nan, scale_BxKxH)


def dequantize(codes, scale) -> jax.Array:
  """codes * scale in float32 (one rounding; for tests and the study, never the kernels)."""
  return codes.astype(F32) * scale.astype(F32)


def finite(scale) -> jax.Array:
  """Whether every group of a scale array was finite when quantized (bool scalar)."""
  return jnp.all(~jnp.isnan(scale))

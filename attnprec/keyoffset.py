"""The key offset: one vector c subtracted from every key a query sees, exactly.

Shapes: B batch, T tokens of this call, K kv heads, H head dim, L the model's context.

Why it is exact: every logit of a query q is q . k_s; with a vector c subtracted from every
key it becomes q . k_s - q . c, the same constant for the whole row, which the softmax
removes (softmax(x - a) = softmax(x)). So ANY c leaves the attention output unchanged in
exact arithmetic, provided every key the query sees had the SAME c subtracted (the
contract's offset row; `tests/test_key_offset.py` breaks it on purpose and catches it).

Why it helps: Qwen2's key biases put a large shared component on every key (layer 0 of the
0.5B: |b| up to 158); in bf16 a key of that size is rounded to a grid of 0.5-1 and its logits
(~150-220) to whole units. Subtracting c in float32 BEFORE the keys' one rounding to the
compute dtype (or to the cache's storage type) makes every rounding and every
quantization see the small residual k - c, never the offset.

The choices (`Precision.key_offset`, `contract.KEY_OFFSETS`):

  'none'          today's keys, bit for bit (the projection rounded to c, the bias added
                  in c, RoPE in float32 rounded to c).
  'zero'          the float32 key path of the other choices with c = 0: one rounding of
                  the rotated keys instead of three. A control: what the single rounding
                  alone buys, apart from the offset.
  'bias'          c = E_p[R(p)] b per layer and kv head: the model's key bias b rotated by
                  RoPE and averaged over the positions p = 0 .. L-1 of the model's context
                  (`bias_offset`). The key at position p carries R(p) b; no fixed vector
                  equals it at every p, and this c is the one closest to it on average
                  (least squares over the positions). In a RoPE pair whose rotation over
                  the context is negligible (L * theta << 1) c keeps the bias's component
                  whole; in a pair that turns many times it is ~0 (the rotated bias
                  averages out there and cannot be removed by any fixed vector). The
                  residual it leaves at position p is |R(p) b - c| <= |b_i| *
                  max_p |exp(i p theta_i) - m_i| per pair i (m_i = the pair's mean
                  rotation), which `bias_residual` computes. Derived from the loaded
                  parameters in every call (K x H float32 multiply-adds, the rotation
                  means are float64 constants of the architecture). Refused for a model
                  without a key bias, and with a key norm (the bias passes through it).
  'prefill_mean'  c = the mean of the prompt's rotated float32 keys, per sequence and kv
                  head, over its real tokens (not the padding), computed by the prefill and
                  frozen into the cache: every decode step subtracts the same c (as
                  SageAttention's "smooth K" does per block). A cacheless forward (the
                  study's teacher-forced rows) takes the mean over its own tokens.
                  Refused in the train phase (training has no prefill).

Refused wherever a per-row constant changes the result: a soft-capped attention logit
(Gemma 2: tanh(x - a) is not tanh(x) - a), or an attention sink with an explicit logit
(a constant added beside the keys' logits; no kernel here has one).
"""
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnprec.config import ModelConfig
from attnprec.contract import KEY_OFFSETS
from attnprec.errors import UserError

F32 = jnp.float32


def refusal(config: ModelConfig, key_offset: str, *, phase: Optional[str] = None
            ) -> Optional[str]:
  """None if `key_offset` is exact and meaningful for `config` (in `phase`), else the
  one-paragraph reason, naming the value and the valid ones."""
  valid = ", ".join(repr(k) for k in KEY_OFFSETS)
  if key_offset not in KEY_OFFSETS:
    return f"Unknown key offset {key_offset!r}; valid: {valid}."
  if key_offset == "none":
    return None
  if config.attn_logit_soft_cap is not None:
    return (f"precision.key_offset = {key_offset!r} is not exact with a soft-capped "
            f"attention logit (model.attn_logit_soft_cap = {config.attn_logit_soft_cap}): "
            f"tanh does not pass a constant shift of a row, so the offset would change the "
            f"attention. Use precision.key_offset = 'none' for this model (valid: {valid}).")
  if key_offset == "bias":
    if not config.qkv_bias:
      return (f"precision.key_offset = 'bias' derives the offset from the model's key "
              f"bias, and this model has none (model.qkv_bias = False). Use 'none', or the "
              f"data-driven 'prefill_mean' (valid: {valid}).")
    if config.qk_norm:
      return (f"precision.key_offset = 'bias' needs the key bias to reach the rotated keys "
              f"unchanged, but this model normalises its keys after the bias "
              f"(model.qk_norm = True). Use 'prefill_mean' or 'none' (valid: {valid}).")
  if key_offset == "prefill_mean" and phase == "train":
    return (f"precision.key_offset = 'prefill_mean' takes the offset from a prompt's keys "
            f"at prefill, and the train phase has no prefill; bind it in the decode phase "
            f"(decode/precision.key_offset), or use 'bias' / 'zero' / 'none' for training "
            f"(valid: {valid}).")
  return None


def check(config: ModelConfig, key_offset: str, *, phase: Optional[str] = None) -> None:
  """Raises the `refusal` as a UserError (exit 2), before any work."""
  why = refusal(config, key_offset, phase=phase)
  if why:
    raise UserError(why)


def rotation_means(config: ModelConfig, layer: int) -> np.ndarray:
  """m_i = mean over p = 0 .. L-1 of exp(i p theta_i) for each RoPE pair i of `layer`
  (complex128 [H/2], L = config.max_seq_len), in closed form (a geometric series)."""
  H = config.head_dim
  base, pos_scale = config.rope(layer)
  theta = (1.0 / (base ** (np.arange(0, H, 2, dtype=np.float64) / H))) / pos_scale
  L = config.max_seq_len
  z = np.exp(1j * theta)
  with np.errstate(divide="ignore", invalid="ignore"):
    m = (1 - z ** L) / (L * (1 - z))
  return np.where(np.abs(1 - z) < 1e-12, 1.0 + 0j, m)


def bias_offset(bias_KxH, config: ModelConfig, layer: int) -> jax.Array:
  """c = E_p[R(p)] b: the key bias (float32 [K, H], "rotate half" layout as `layers.rope`)
  rotated and averaged over the context's positions; float32 [K, H]."""
  m = rotation_means(config, layer)
  mc, ms = jnp.asarray(m.real, F32), jnp.asarray(m.imag, F32)
  b = bias_KxH.astype(F32)
  half = config.head_dim // 2
  b1, b2 = b[..., :half], b[..., half:]
  return jnp.concatenate([b1 * mc - b2 * ms, b2 * mc + b1 * ms], axis=-1)


def bias_residual(bias_KxH, config: ModelConfig, layer: int) -> np.ndarray:
  """The largest |R(p) b - c| over p = 0 .. L-1 per kv head and RoPE pair (float64
  [K, H/2]): the part of the key bias the 'bias' offset cannot remove (an upper bound
  on what is left of it in any key, by `rotation_means`' argument)."""
  m = rotation_means(config, layer)
  b = np.asarray(bias_KxH, np.float64)
  half = config.head_dim // 2
  amp = np.hypot(b[..., :half], b[..., half:])          # |b_i| per pair
  H = config.head_dim
  base, pos_scale = config.rope(layer)
  theta = (1.0 / (base ** (np.arange(0, H, 2, dtype=np.float64) / H))) / pos_scale
  p = np.arange(config.max_seq_len, dtype=np.float64)
  worst = np.zeros(half)
  for i in range(half):   # max over p of |exp(i p theta) - m|, chunked per pair
    worst[i] = np.abs(np.exp(1j * p * theta[i]) - m[i]).max()
  return amp * worst


def token_mean(k_BxTxKxH, valid_BxT=None) -> jax.Array:
  """The mean of float32 keys over the valid tokens of each sequence: [B, K, H] float32
  (a sequence without a valid token gets 0)."""
  k = k_BxTxKxH.astype(F32)
  if valid_BxT is None:
    return jnp.mean(k, axis=1)
  w_BxT = valid_BxT.astype(F32)
  n_B = jnp.maximum(jnp.sum(w_BxT, axis=1), 1.0)
  # An elementwise product and a sum, not a dot: float32 throughout on every backend.
  return jnp.sum(k * w_BxT[:, :, None, None], axis=1) / n_B[:, None, None]

"""Building blocks: RMSNorm, RoPE (a pure function), dense layers, gated MLP, Attention.

Shapes: B batch, T query length, S key length (cache length when decoding), D model
width, N query heads, K kv heads, H head dim, F MLP hidden width.

Parameters are created in float32 and cast to the phase's compute dtype at use; the
phase's `Precision` is passed in explicitly (plain data), never read from globals.
"""
import dataclasses
from typing import Optional

import chex
import haiku as hk
import jax
import jax.numpy as jnp

from attnprec import kernels, keyoffset
from attnprec.cache import LayerCache
from attnprec.config import ModelConfig
from attnprec.contract import KEY_OFFSET_SCOPE, stage_dtypes
from attnprec.precision import Precision


def rms_norm(x, scale, *, eps: float, plus_one: bool):
  """RMSNorm computed in float32, returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  scale = scale.astype(jnp.float32)
  y = y * (1.0 + scale if plus_one else scale)
  return y.astype(x.dtype)


class RMSNorm(hk.Module):
  """RMSNorm over the last axis; `scale` param of shape [last axis]."""

  def __init__(self, eps: float, plus_one: bool, name: Optional[str] = None):
    super().__init__(name=name)
    self.eps, self.plus_one = eps, plus_one

  def __call__(self, x):
    init = jnp.zeros if self.plus_one else jnp.ones
    scale = hk.get_parameter("scale", (x.shape[-1],), jnp.float32,
                             init=lambda s, d: init(s, d))
    return rms_norm(x, scale, eps=self.eps, plus_one=self.plus_one)


def rope(x_BxTxNxH, positions_BxT, *, base: float, scale: float = 1.0):
  """Rotary embedding, "rotate half" layout (as HF Llama/Gemma), computed in float32."""
  H = x_BxTxNxH.shape[-1]
  inv_freq_Hh = 1.0 / (base ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  angles_BxTxHh = (positions_BxT.astype(jnp.float32) / scale)[..., None] * inv_freq_Hh
  sin = jnp.sin(angles_BxTxHh)[:, :, None, :]  # [B, T, 1, H/2]
  cos = jnp.cos(angles_BxTxHh)[:, :, None, :]
  x = x_BxTxNxH.astype(jnp.float32)
  x1, x2 = x[..., : H // 2], x[..., H // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxH.dtype)


# Below this many rows (x's elements over its last axis: any decode step, a prefill's
# last-position unembedding) a 16-bit projection on float32-held weights runs as a float32
# dot on their values of c instead of casting them to c at the use: XLA:CPU's bf16
# matrix-vector path is slow (docs/performance.md, "The measurements behind the projection forms").
MIN_ROWS_C_DOT = 128


def project(x, w, spec: str, *, precision, carrier: bool = False, out_dtype=None,
            form: str = "by_rows"):
  """einsum(spec, x, w) for x in the compute dtype c and a weight w (float32, or already
  in c: `decoding.compute_params`); the result in `out_dtype` (default c).

  c float32: a float32 dot. c 16-bit (bf16, f16): a c x c dot with
  `preferred_element_type=float32` (exact products of c values, float32 accumulation),
  rounded once to `out_dtype` (the fastest form on XLA:CPU for a prefill: docs/performance.md).
  Where w is float32 and x has fewer than MIN_ROWS_C_DOT rows (a
  decode step), the same products as a float32 dot on w's values of c (carrier:
  w already holds them, `decoding.for_serving`): the same numbers up to float32
  summation order.

  Float32 weights (carried, or raw in a train step) are cast to c at the use: XLA:CPU
  still compiles a bf16 x bf16 -> f32 dot on them (the same compiled dot forms as
  bf16-stored weights).

  form (`Precision.projection()`, resolved for the platform and CPU): 'by_rows' as
  above; 'compute_dtype_dot' the c x c dot for every row count; 'float32_dot' the float32
  dot on the values of c for every row count (a CPU without a bf16 dot instruction). The
  forms differ only in float32 summation order: at most 1 ulp of c after the rounding.

  A dot-algorithm preset as `precision` names its own operand and accumulation types,
  so it gets a plain c x c dot (f32 result only for an f32 out)."""
  c = x.dtype
  out_dtype = c if out_dtype is None else out_dtype
  if c == jnp.float32:
    return jnp.einsum(spec, x, w.astype(c), precision=precision,
                      preferred_element_type=jnp.float32).astype(out_dtype)
  if isinstance(precision, jax.lax.DotAlgorithmPreset):
    preferred = jnp.float32 if out_dtype == jnp.float32 else None
    return jnp.einsum(spec, x, w.astype(c), precision=precision,
                      preferred_element_type=preferred)
  rows = x.size // x.shape[-1]
  if form not in ("by_rows", "compute_dtype_dot", "float32_dot"):
    raise ValueError(f"project: unknown form {form!r}")
  if w.dtype == jnp.float32 and (form == "float32_dot" or
                                 (form == "by_rows" and rows < MIN_ROWS_C_DOT)):
    w32 = w if carrier else w.astype(c).astype(jnp.float32)
    y = jnp.einsum(spec, x.astype(jnp.float32), w32, precision=precision,
                   preferred_element_type=jnp.float32)
    return y.astype(out_dtype)
  y = jnp.einsum(spec, x, w.astype(c), precision=precision,
                 preferred_element_type=jnp.float32)
  return y.astype(out_dtype)


def projection_form(prec: Precision) -> str:
  """The form `project` takes: `Precision.projection()` ('float32' / 'preset' need none)."""
  form = prec.projection()
  return "by_rows" if form in ("float32", "preset") else form


class Dense(hk.Module):
  """y = x @ w (+ b); w [in, out] float32 (or in x's dtype), the dot in the form `project`
  picks; matmul precision explicit. carrier: w already holds values of x's dtype
  (`Precision.carrier_weights`)."""

  def __init__(self, out: int, *, precision, with_bias: bool = False, carrier: bool = False,
               out_dtype=None, form: str = "by_rows", name: Optional[str] = None):
    super().__init__(name=name)
    self.out, self.precision, self.with_bias = out, precision, with_bias
    self.carrier, self.out_dtype, self.form = carrier, out_dtype, form

  def __call__(self, x):
    """y in x's dtype (the default) or in `out_dtype` (float32: the projection's float32
    accumulation unrounded, the bias added in float32)."""
    d_in = x.shape[-1]
    w = hk.get_parameter("w", (d_in, self.out), jnp.float32,
                         init=hk.initializers.VarianceScaling(1.0, "fan_in", "normal"))
    y = project(x, w, "...i,io->...o", precision=self.precision, carrier=self.carrier,
                out_dtype=self.out_dtype, form=self.form)
    if self.with_bias:
      y = y + self.bias().astype(y.dtype)
    return y

  def bias(self) -> jax.Array:
    """The bias parameter, float32 [out] (only with `with_bias`)."""
    return hk.get_parameter("b", (self.out,), jnp.float32, init=jnp.zeros)


@dataclasses.dataclass
class MLP(hk.Module):
  """Gated MLP: down(act(gate(x)) * up(x)). SwiGLU (silu) or GeGLU (gelu_tanh)."""
  config: ModelConfig       # architecture
  precision: Precision      # this phase's numerics
  name: Optional[str] = None

  def __call__(self, x_BxTxD):
    cfg, p = self.config, self.precision.matmul
    cw, form = self.precision.carrier_weights, projection_form(self.precision)
    # 'float32' (`Precision.mlp_form`: set, or 'auto' on a CPU without bf16 dots): the
    # gate and up projections' float32 accumulations unrounded, the activation and the
    # product in float32, one rounding to the compute dtype into the down projection.
    wide = self.precision.mlp_form() == "float32"
    hidden = jnp.float32 if wide else None
    gate_BxTxF = Dense(cfg.mlp_hidden, precision=p, carrier=cw, form=form, out_dtype=hidden,
                       name="gate")(x_BxTxD)
    up_BxTxF = Dense(cfg.mlp_hidden, precision=p, carrier=cw, form=form, out_dtype=hidden,
                     name="up")(x_BxTxD)
    if wide:
      chex.assert_type([gate_BxTxF, up_BxTxF], jnp.float32)
    if cfg.activation == "silu":
      act = jax.nn.silu(gate_BxTxF)
    elif cfg.activation == "gelu_tanh":
      act = jax.nn.gelu(gate_BxTxF, approximate=True)
    else:
      act = jax.nn.gelu(gate_BxTxF, approximate=False)
    hidden_BxTxF = act * up_BxTxF
    if wide:
      hidden_BxTxF = hidden_BxTxF.astype(x_BxTxD.dtype)   # the one rounding to c
    return Dense(cfg.d_model, precision=p, carrier=cw, form=form,
                 name="down")(hidden_BxTxF)


@dataclasses.dataclass
class Attention(hk.Module):
  """q/k/v/o projections, optional QK-norm, RoPE, KV cache update, then the kernel."""
  config: ModelConfig       # architecture
  precision: Precision      # this phase's numerics (attention flags included)
  layer: int                # index: picks the window and RoPE base of this layer
  scanned: bool = False     # the body of a scan over all layers (model.scan_layers)
  name: Optional[str] = None

  def __call__(self, x_BxTxD, positions_BxT, mask, cache: Optional[LayerCache] = None,
               lengths_B=None):
    """mask: a `CausalMask` (or a dense bool [B, 1, T, S]), passed on to `attend`.

    cache: this layer's `LayerCache` (S positions), or None (then S = T).
    lengths_B: each sequence's real tokens in this call (a right-padded prompt), or None
    (all T): read only by the 'prefill_mean' key offset.

    Returns (out_BxTxD, the updated LayerCache or None).
    """
    cfg, prec = self.config, self.precision
    B, T, _ = x_BxTxD.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mp, cw, form = prec.matmul, prec.carrier_weights, projection_form(prec)
    offset = prec.key_offset
    keyoffset.check(cfg, offset)
    q_BxTxNxH = Dense(N * H, precision=mp, with_bias=cfg.qkv_bias, carrier=cw,
                      form=form, name="q")(x_BxTxD)
    # With a key offset the keys stay float32 (the projection's accumulation, the bias,
    # RoPE) until the offset is subtracted: one rounding, of the residual (contract row).
    k_proj = Dense(K * H, precision=mp, with_bias=cfg.qkv_bias, carrier=cw, form=form,
                   out_dtype=None if offset == "none" else jnp.float32, name="k")
    k_BxTxKxH = k_proj(x_BxTxD)
    v_BxTxKxH = Dense(K * H, precision=mp, with_bias=cfg.qkv_bias, carrier=cw,
                      form=form, name="v")(x_BxTxD)
    q_BxTxNxH = q_BxTxNxH.reshape(B, T, N, H)
    k_BxTxKxH = k_BxTxKxH.reshape(B, T, K, H)
    v_BxTxKxH = v_BxTxKxH.reshape(B, T, K, H)
    if cfg.qk_norm:
      q_BxTxNxH = RMSNorm(cfg.norm_eps, cfg.norm_plus_one, name="q_norm")(q_BxTxNxH)
      k_BxTxKxH = RMSNorm(cfg.norm_eps, cfg.norm_plus_one, name="k_norm")(k_BxTxKxH)
    base, pos_scale = cfg.rope(self.layer)
    q_BxTxNxH = rope(q_BxTxNxH, positions_BxT, base=base, scale=pos_scale)
    k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, base=base, scale=pos_scale)
    if offset != "none":
      k_BxTxKxH, cache = self._subtract_offset(k_BxTxKxH, k_proj, positions_BxT, cache,
                                               lengths_B, q_BxTxNxH.dtype)
    elif cache is not None:
      cache.check_offset(offset)

    scales = None
    if cache is not None:
      # Write this step's keys/values at their absolute positions (in place under jit),
      # stored as `precision.cache_storage` says, then attend over the layer's whole
      # cache as stored: prefill too attends to the keys/values it reads back (the
      # quantized ones for an int8 / float8 cache), so a prefill's logits are those a
      # token-by-token decode gives. The mask hides positions not yet written (key pos >
      # query pos). The cache lies [B, K, S, H]: the kernel's [B, S, K, H] view is a
      # transpose XLA folds into the dots (no copy). Without a cache (training, full
      # forwards) attention sees the exact keys/values.
      storage = prec.cache_storage
      cache = cache.write(k_BxTxKxH, v_BxTxKxH, positions_BxT, storage)
      # A scanned model's decode step under a kernel that reads one layer of the stack
      # in place (flash: `kernels.reads_stack`) gets the whole stack and the layer: a
      # Pallas call given the layer's slice would copy it out every step.
      whole = cache.layer is not None and kernels.reads_stack(
          prec, T, cache.length, N // K, logits_soft_cap=cfg.attn_logit_soft_cap)
      k_BxKxSxH, v_BxKxSxH = cache.read(q_BxTxNxH.dtype, storage, whole_stack=whole)
      scales = cache.scales(storage, whole_stack=whole)
      layer = cache.layer if whole else None
      # [(L,) B, K, S, H] -> the kernels' [(L,) B, S, K, H] view
      k_BxSxKxH, v_BxSxKxH = (jnp.swapaxes(x, -3, -2) for x in (k_BxKxSxH, v_BxKxSxH))
    else:
      k_BxSxKxH, v_BxSxKxH = k_BxTxKxH, v_BxTxKxH
      layer = None

    kernel = AttentionKernel(cfg, prec, self.layer, self.scanned, name="kernel")
    extra = {} if layer is None else dict(kv_layer=layer)
    out_BxTxNxH = (kernel(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask, **extra) if scales is None
                   else kernel(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask, kv_scales=scales,
                               **extra))
    chex.assert_shape(out_BxTxNxH, (B, T, N, H))
    out_BxTxD = Dense(cfg.d_model, precision=mp, carrier=cw, form=form, name="o")(
        out_BxTxNxH.reshape(B, T, N * H))
    return out_BxTxD, cache

  def _subtract_offset(self, k32_BxTxKxH, k_proj: Dense, positions_BxT, cache, lengths_B,
                       c):
    """(k - c rounded once to the compute dtype `c`, the cache holding c): the
    contract's offset row (`attnprec.keyoffset`)."""
    cfg, name = self.config, self.precision.key_offset
    B, T, K, H = k32_BxTxKxH.shape
    # the table's 'keys' row: formed in float32 until the offset is off
    chex.assert_type(k32_BxTxKxH, stage_dtypes(c, self.precision.attention)["keys"])
    with jax.named_scope(KEY_OFFSET_SCOPE):
      if name == "zero":
        fresh_BxKxH = jnp.zeros((B, K, H), jnp.float32)
      elif name == "bias":
        c_KxH = keyoffset.bias_offset(k_proj.bias().reshape(K, H), cfg, self.layer)
        fresh_BxKxH = jnp.broadcast_to(c_KxH, (B, K, H))
      else:  # 'prefill_mean': this call's real tokens (a prefill's prompt)
        valid_BxT = (None if lengths_B is None else
                     jnp.arange(T)[None, :] < lengths_B[:, None])
        fresh_BxKxH = keyoffset.token_mean(k32_BxTxKxH, valid_BxT)
      if cache is None:
        c_BxKxH = fresh_BxKxH
      else:
        c_BxKxH, cache = cache.offset_for(name, fresh_BxKxH, positions_BxT)
      chex.assert_type(c_BxKxH, jnp.float32)
      k_BxTxKxH = (k32_BxTxKxH - c_BxKxH[:, None]).astype(c)
    return k_BxTxKxH, cache


@dataclasses.dataclass
class AttentionKernel(hk.Module):
  """The attention kernel the phase's `Precision` selects: queries after RoPE (unscaled),
  keys/values of every visible position -> [B, T, N, H] before the o projection.

  A module of its own (no parameters) so that code outside the model can observe or
  alter exactly this step with `hk.experimental.intercept_methods`: the precision study
  records the kernel outputs and queries here and adds its key bias
  (`attnprec.study.probes`); the model itself returns only what a model returns."""
  config: ModelConfig       # architecture (soft-cap, query scale)
  precision: Precision      # this phase's numerics (kernel and attention flags)
  layer: int                # the layer it belongs to
  # In the body of a scan over all layers (model.scan_layers): ONE call stands for every
  # layer, `layer` is only a representative, and what it sees are values of the scan's
  # body, not of any one layer (the probes refuse it: `attnprec.study.probes`).
  scanned: bool = False
  name: Optional[str] = None

  def __call__(self, q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask, kv_scales=None, kv_layer=None):
    """kv_scales: the `contract.KVScales` of a quantized cache (k, v are then its codes),
    or None (k, v in the compute dtype). kv_layer: a scanned model's layer index when k,
    v (and the scales) are the whole stack (`kernels.attend(kv_layer=)`): an interceptor
    of this call then sees [L, B, S, K, H] keys and values and `kv_layer` in its kwargs
    (a scanned model's prefill or decode step under a kernel that reads the stack)."""
    extra = {} if kv_layer is None else dict(kv_layer=kv_layer)
    return kernels.attend(self.precision, q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask,
                          logits_soft_cap=self.config.attn_logit_soft_cap,
                          scale=self.config.query_scale, kv_scales=kv_scales, **extra)

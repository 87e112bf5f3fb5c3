"""The decoder: embed -> L pre-norm blocks -> final norm -> logits.

Shapes: B batch, T tokens in this call, S key length (T without a cache, the cache length
with one), D model width, V vocabulary, L layers, N/K/H heads, kv heads, head dim.

Parameters: one row each in the parameter layout table, `attnprec.layout` (module path,
shape rule, when the architecture has it, sharding role, HF and GGUF names); print it with
`python -m attnprec.layout`. `param_shapes(config)` is what importers must produce, and
tests check that it equals the table's `layout.shapes(config)`.
Norm scales hold exactly the parameter the formula uses: y * w, or y * (1 + w) when
`norm_plus_one` (Gemma's convention, as in HF checkpoints).

Two program forms, the same numbers (tests/test_scan_layers.py checks them bit for bit):
unrolled (the default: one `Block` per layer, params `decoder/layer_{i}/...`), or, with
`model.scan_layers`, one `Block` body run by `hk.layer_stack` as a `lax.scan` over the
layers (params stacked on a leading L axis under `layout.STACKED`; the KV cache a
`cache.StackedKVCache`, carried through the scan). `layout.stack` / `layout.unstack` convert the
params between the two; the loader does (`attnprec.checkpoints.load`).
Why `hk.layer_stack`: it creates the stacked params at init and hands each layer its slice
inside the scan, with `Block` unchanged, and carries the stacked cache. Its
`transparent` mode would keep the unrolled params but stack them inside every call (a copy
of every weight per decode step); `hk.scan` over hand-stacked params would redo what it does.
"""
import dataclasses
import functools
import warnings
from typing import NamedTuple, Optional

import chex
import haiku as hk
import jax
import jax.numpy as jnp

from attnprec import layout, platforms, xla_env
from attnprec.cache import KVCache, LayerCache, StackedKVCache
from attnprec.config import ModelConfig
from attnprec.contract import CausalMask
from attnprec.errors import UserError
from attnprec.layers import MLP, Attention, RMSNorm, project, projection_form
from attnprec.precision import Precision


# What a train step recomputes in its backward pass instead of keeping (`train.remat`):
# nothing; each layer's attention (its [T, S] logits and probabilities, the dense
# kernels' largest residuals); each whole block (only the residual stream between blocks
# is kept). Recomputation runs the same program, so the same precision.
REMAT = ("none", "attention", "block")


def check_remat(remat: str) -> str:
  if remat not in REMAT:
    raise UserError(f"train.remat = {remat!r} is not a rematerialisation choice; valid: "
                    f"{', '.join(map(repr, REMAT))} ('none': keep every residual; "
                    "'attention': recompute each layer's attention in the backward pass; "
                    "'block': recompute each whole block, keeping only the residual stream).")
  return remat


def _remat(fn, remat: str, level: str, scanned: bool):
  """fn wrapped in `hk.remat` where `remat` names this level ('attention' or 'block').
  Outside a scan the recomputation is kept from being merged back into the forward pass
  (prevent_cse); inside one the scan already keeps them apart (jax.checkpoint's advice)."""
  return hk.remat(fn, prevent_cse=not scanned) if remat == level else fn


class Output(NamedTuple):
  logits: Optional[jax.Array]       # [B, T, V] float32 (None when `hidden_only`)
  cache: Optional[KVCache]          # updated cache (None without one); a StackedKVCache
                                    # with model.scan_layers
  hidden: Optional[jax.Array] = None  # [B, T, D] after the final norm, when `hidden_only`


def unembed(x_BxTxD, w_DxV, config: ModelConfig, precision: Precision) -> jax.Array:
  """The logits [B, T, V] float32 of final-norm outputs: the one unembedding every caller
  runs (the decoder's own, and a loss that unembeds a chunk of tokens at a time)."""
  logits_BxTxV = project(x_BxTxD, w_DxV, "BTD,DV->BTV", precision=precision.matmul,
                         carrier=precision.carrier_weights, out_dtype=jnp.float32,
                         form=projection_form(precision))
  if config.final_logit_soft_cap is not None:
    cap = config.final_logit_soft_cap
    logits_BxTxV = cap * jnp.tanh(logits_BxTxV / cap)
  chex.assert_type(logits_BxTxV, jnp.float32)
  return logits_BxTxV


def unembedding(params, config: ModelConfig) -> jax.Array:
  """The unembedding matrix [D, V] float32 in `params` (the embedding's transpose when
  tied)."""
  if config.tie_embeddings:
    return params["decoder/embed"]["embeddings"].T
  return params["decoder/unembed"]["w"]


@dataclasses.dataclass
class Block(hk.Module):
  config: ModelConfig
  precision: Precision
  layer: int               # the layer (scanned: any layer of the one kind, e.g. 0)
  scanned: bool = False     # the body of a scan over all layers
  remat: str = "none"       # `REMAT`: 'attention' recomputes the attention in backward
  name: Optional[str] = None

  def __call__(self, x_BxTxD, positions_BxT, mask, cache: Optional[LayerCache] = None,
               lengths_B=None):
    """Returns (x_BxTxD, this layer's updated cache or None)."""
    cfg = self.config
    norm = functools.partial(RMSNorm, cfg.norm_eps, cfg.norm_plus_one)
    h_BxTxD = norm(name="pre_attn_norm")(x_BxTxD)
    attn = Attention(cfg, self.precision, self.layer, self.scanned, name="attn")
    if cache is None:   # training: what the backward pass keeps is the remat's choice
      h_BxTxD = _remat(lambda h: attn(h, positions_BxT, mask, None, lengths_B)[0],
                       self.remat, "attention", self.scanned)(h_BxTxD)
    else:
      h_BxTxD, cache = attn(h_BxTxD, positions_BxT, mask, cache, lengths_B)
    if cfg.post_attn_norm:
      h_BxTxD = norm(name="post_attn_norm")(h_BxTxD)
    x_BxTxD = x_BxTxD + h_BxTxD
    h_BxTxD = norm(name="pre_mlp_norm")(x_BxTxD)
    h_BxTxD = MLP(cfg, self.precision, name="mlp")(h_BxTxD)
    if cfg.post_mlp_norm:
      h_BxTxD = norm(name="post_mlp_norm")(h_BxTxD)
    return x_BxTxD + h_BxTxD, cache


@dataclasses.dataclass
class Decoder(hk.Module):
  config: ModelConfig       # architecture
  precision: Precision      # this phase's numerics
  remat: str = "none"       # `REMAT`, read without a cache (a train step's forward)
  name: Optional[str] = "decoder"

  def __call__(self, tokens_BxT, positions_BxT=None, cache: Optional[KVCache] = None,
               logits_at_B: Optional[jax.Array] = None, lengths_B=None,
               hidden_only: bool = False) -> Output:
    """lengths_B: each sequence's real tokens (a right-padded prompt; None: all T), read
    only by the 'prefill_mean' key offset (`attnprec.keyoffset`).

    logits_at_B: if given, the index (0..T-1) of the one token per sequence whose
    logits are computed (logits [B, 1, V]); prefill needs only each prompt's last token,
    and the unembedding of all T tokens is the costliest single product of a long
    prefill (T x D x V). None: logits of every token."""
    cfg, prec = self.config, self.precision
    # the dense dots' precision, refused like the attention einsums' (contract.prepare)
    platforms.check_traced(prec.matmul_precision, "matmul_precision")
    c = prec.compute_dtype
    B, T = tokens_BxT.shape
    own_positions = positions_BxT is None and cache is None   # 0 .. T-1, keys = queries
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    with hk.name_scope("embed"):
      embed_VxD = hk.get_parameter("embeddings", (cfg.vocab_size, cfg.d_model), jnp.float32,
                                   init=hk.initializers.TruncatedNormal(cfg.d_model ** -0.5))
    x_BxTxD = jnp.take(embed_VxD, tokens_BxT, axis=0).astype(c)
    if cfg.embed_scale:
      x_BxTxD = x_BxTxD * jnp.asarray(cfg.d_model ** 0.5, c)
    chex.assert_type(x_BxTxD, c)

    # Absolute key positions: the cache index, or the tokens' own positions.
    k_positions_BxS = (jnp.broadcast_to(jnp.arange(cache.length, dtype=jnp.int32),
                                        (B, cache.length))
                       if cache is not None else positions_BxT)
    # Structured (positions + window), so the blockwise kernel can skip hidden blocks.
    masks = {w: CausalMask(positions_BxT, k_positions_BxS, sliding_window=w,
                           own_positions=own_positions)
             for w in {cfg.window(i) for i in range(cfg.num_layers)}}

    if cfg.scan_layers:
      x_BxTxD, new_cache = self._scanned(x_BxTxD, positions_BxT, masks[cfg.window(0)],
                                         cache, lengths_B)
    else:
      if isinstance(cache, StackedKVCache):
        raise UserError("A stacked KV cache (cache.StackedKVCache, made by init_cache for "
                        "model.scan_layers = True) was passed to the unrolled model; make "
                        "the cache with the config that runs it.")
      new_layers = []
      for i in range(cfg.num_layers):
        block = Block(cfg, prec, i, remat=self.remat, name=f"layer_{i}")
        if cache is None:
          x_BxTxD = _remat(lambda x, b=block, m=masks[cfg.window(i)]: b(
              x, positions_BxT, m, None, lengths_B)[0], self.remat, "block", False)(x_BxTxD)
          layer_cache = None
        else:
          x_BxTxD, layer_cache = block(x_BxTxD, positions_BxT, masks[cfg.window(i)],
                                       cache.layers[i], lengths_B)
        chex.assert_type(x_BxTxD, c)
        new_layers.append(layer_cache)
      new_cache = KVCache(layers=tuple(new_layers)) if cache is not None else None

    if logits_at_B is not None:
      x_BxTxD = jnp.take_along_axis(x_BxTxD, logits_at_B[:, None, None], axis=1)  # [B, 1, D]
      T = 1
    x_BxTxD = RMSNorm(cfg.norm_eps, cfg.norm_plus_one, name="final_norm")(x_BxTxD)
    if cfg.tie_embeddings:
      w_DxV = embed_VxD.T
    else:
      with hk.name_scope("unembed"):
        w_DxV = hk.get_parameter("w", (cfg.d_model, cfg.vocab_size), jnp.float32,
                                 init=hk.initializers.VarianceScaling(1.0, "fan_in", "normal"))
    if hidden_only:
      return Output(None, new_cache, x_BxTxD)
    logits_BxTxV = unembed(x_BxTxD, w_DxV, cfg, prec)
    chex.assert_shape(logits_BxTxV, (B, T, cfg.vocab_size))
    return Output(logits_BxTxV, new_cache)

  @hk.transparent
  def _scanned(self, x_BxTxD, positions_BxT, mask, cache, lengths_B):
    """The L blocks as one `lax.scan` (`hk.layer_stack`): params [L, ...] under
    `layout.STACKED`, the stacked cache carried, each layer's rows written in place.
    Every layer has the same kind (`ModelConfig` refuses a mixed pattern), so one mask,
    window and RoPE base serve all; the body is layer 0's."""
    cfg, prec = self.config, self.precision
    if cache is not None and not isinstance(cache, StackedKVCache):
      raise UserError("model.scan_layers = True needs a stacked KV cache "
                      "(cache.StackedKVCache: init_cache with this config, or "
                      "cache.stack_cache of a per-layer one), got a per-layer KVCache.")
    c = x_BxTxD.dtype

    def block(carry, layer):
      # The whole stacked cache rides in the carry; the block sees layer `layer` of it
      # through a view that writes its new rows in place (`cache.LayerCache.layer`).
      x_BxTxD, stack = carry
      view = None if stack is None else stack.replace(layer=layer)
      x_BxTxD, view = Block(cfg, prec, 0, scanned=True, remat=self.remat,
                            name=layout.STACKED_BLOCK)(
          x_BxTxD, positions_BxT, mask, view, lengths_B)
      chex.assert_type(x_BxTxD, c)
      return (x_BxTxD, None if view is None else view.replace(layer=None)), None

    if cache is None:
      block = _remat(block, self.remat, "block", True)
    scan = hk.layer_stack(cfg.num_layers, with_per_layer_inputs=True,
                          name=layout.STACKED_SCAN)
    (x_BxTxD, stack), _ = scan(block)(
        (x_BxTxD, None if cache is None else cache.stack),
        jnp.arange(cfg.num_layers, dtype=jnp.int32))
    return x_BxTxD, (None if cache is None else StackedKVCache(stack=stack))


def check_jax_numerics(precision: Precision) -> None:
  """At every trace of the model: jax's process-wide default matmul precision (set by
  JAX_DEFAULT_MATMUL_PRECISION, `jax.config.update` or the `jax.default_matmul_precision`
  context) would set every dot the precision leaves at 'default' (and splash's dots,
  which take no precision) without the precision line naming it: a UserError, as the
  runners refuse the variable. A reduced-precision model traced on XLA:CPU with excess
  precision on is warned about once (`xla_env.excess_precision_note`)."""
  default = jax.config.jax_default_matmul_precision     # the context's value too
  if default is not None:
    raise UserError(
        f"jax's default matmul precision is set to {default!r} (JAX_DEFAULT_MATMUL_PRECISION, "
        f"jax.config.update('jax_default_matmul_precision', ...) or the "
        f"jax.default_matmul_precision context): it would set every dot that "
        f"precision.matmul_precision / einsum_precision leave at 'default', unnamed on the "
        f"precision line. Unset it and give Precision(matmul_precision=..., "
        f"einsum_precision=...) instead.")
  note = xla_env.excess_precision_note(jax.default_backend(), precision.dtype)
  if note:
    warnings.warn(note, stacklevel=3)


def transformed(config: ModelConfig, remat: str = "none") -> hk.Transformed:
  """Pure init/apply for `config`; apply(params, tokens, positions=None, cache=None, *,
  precision, logits_at_B=None, lengths_B=None, hidden_only=False) -> Output. `precision` is a static,
  per-phase value; `remat` (`REMAT`) what a gradient of a cache-less call recomputes."""
  check_remat(remat)

  def fn(tokens_BxT, positions_BxT=None, cache=None, *, precision: Precision,
         logits_at_B=None, lengths_B=None, hidden_only=False):
    check_jax_numerics(precision)
    return Decoder(config, precision, remat)(tokens_BxT, positions_BxT, cache, logits_at_B,
                                             lengths_B, hidden_only)

  return hk.without_apply_rng(hk.transform(fn))


def init_params(config: ModelConfig, rng) -> hk.Params:
  """float32 params for `config` (compute dtype is irrelevant at init)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return transformed(config).init(rng, tokens, precision=Precision())


def param_shapes(config: ModelConfig) -> dict:
  """{module: {name: ShapeDtypeStruct}} without allocating: what importers must produce
  (traced once per config; each caller gets its own dicts)."""
  return {m: dict(d) for m, d in _param_shapes(config).items()}


@functools.lru_cache(maxsize=32)
def _param_shapes(config: ModelConfig) -> dict:
  return jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))


def check_params(config: ModelConfig, params, source: str) -> None:
  """Raises UserError naming each missing/unexpected/mis-shaped tensor of `params`."""
  expected = param_shapes(config)
  problems = []
  for module in sorted(set(expected) | set(params)):
    want, got = expected.get(module, {}), params.get(module, {})
    for name in sorted(set(want) | set(got)):
      if name not in got:
        problems.append(f"{module}/{name} missing (expected shape {want[name].shape})")
      elif name not in want:
        problems.append(f"{module}/{name} unexpected")
      elif tuple(got[name].shape) != tuple(want[name].shape):
        problems.append(f"{module}/{name} has shape {tuple(got[name].shape)}, expected "
                        f"{tuple(want[name].shape)}")
  if problems:
    listed = "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
    raise UserError(f"Parameters from {source} do not match the architecture "
                    f"({len(problems)} problem(s)): {listed}.")

"""KV cache as plain data, passed in and returned (no hidden state): one entry per layer.

Shapes: L layers, B batch, S cache length (prompt + new tokens), K kv heads, H head dim,
T tokens written by one call.
Positions are absolute: sequence b's token at position p is stored at index p.

Three choices, each measured on XLA:CPU (SmolLM2-135M, batch 8, 1000-token prompt):
  * One (k, v) pair per layer, threaded through the layers (each layer takes its own
    cache and returns the updated one, as in Gemma's reference). A single stacked
    [L, B, S, K, H] array made every layer slice and re-assemble the whole stack.
  * Layout [B, K, S, H]: the attention dots batch over (B, K) and contract H or S, so XLA
    reads the cache as it lies; [B, S, K, H] cost a transpose copy of every layer's cache
    per step (37% of an fp32 decode step).
  * bfloat16 / float16 values are stored as their raw bits (uint16) and reinterpreted on
    read. XLA:CPU runs a scatter or an update slice on a 16-bit float buffer by
    converting the WHOLE buffer to float32 and back, on every write (1.2 s per decode
    step); on uint16 it writes the T new rows in place. Bits in, bits out: nothing rounds.
The storage is the phase's `Precision.cache_storage` (`contract.CacheStorage`), per keys
and values: 'compute' (the default: exactly the cache above), float32 or bfloat16 values
(read back as the compute dtype), or int8 / float8 codes with float32 scales, quantized
at the write (`attnprec.kvquant`) and read as codes plus `contract.KVScales` for the
kernels, which apply the scales without dequantizing (the contract's cache rows).
float8 codes are stored as their bits (uint8), like the 16-bit floats. Scales lie
[B, K, S] (per token) or [B, K, H] (per channel, keys only).
With `model.scan_layers` the cache is a `StackedKVCache`: one `LayerCache` whose leaves
carry a leading L axis ([L, B, K, S, H], the key offset's [L, B, K, H]), carried through
the scan whole; the body sees layer i through a view (`LayerCache.layer` = i) that writes
its new rows into the stack in place and reads layer i's slice. (Passing each layer's
slice in as a scan input and the updated one out made the compiled step copy the whole
stack several times: a SmolLM2-shaped decode step ran 3-4x slower than unrolled.)
`stack_cache` / `unstack_cache` convert between the two forms exactly.
Under `jax.jit` with the cache donated (or carried by a loop), every write is in place:
tests/test_cache.py checks the compiled decode step for cache-sized copies (the scanned
one: tests/test_scan_layers.py).
"""
import math
from typing import Optional, Tuple

import chex
import jax
import jax.numpy as jnp

from attnprec import kvquant, platforms
from attnprec.config import ModelConfig
from attnprec.contract import (COMPUTE_CACHE, KEY_OFFSETS, SCALED_KV_DTYPES, CacheStorage,
                               KVScales, bits_dtype, reinterpret)
from attnprec.errors import UserError


@chex.dataclass(frozen=True)
class LayerCache:
  """One layer's keys and values (and, for a scaled storage dtype, their scales).

  Which storage a cache holds is static data (`contract.CacheStorage`, from the phase's
  `Precision.cache_storage`), passed to `read` and `write`, never inferred from dtypes."""
  k: chex.Array  # [B, K, S, H] in `side_dtype(storage.k_dtype, compute dtype)`
  v: chex.Array  # [B, K, S, H]
  # float32: [B, K, S] per token, [B, K, H] per channel (keys only); None when unscaled.
  # Unwritten positions hold scale 0 and code 0 (they read as zeros). A NaN scale marks a
  # group that held a non-finite value (`attnprec.kvquant`).
  k_scale: Optional[chex.Array] = None
  v_scale: Optional[chex.Array] = None
  # The key offset its keys were stored with: {name: float32 [B, K, H]} for a
  # `CacheStorage.key_offset` other than 'none' (the name is pytree structure, so a step
  # that would subtract another offset is refused while tracing: `offset_for`), else None.
  key_offset: Optional[dict] = None
  # A scanned model's view of one layer (`StackedKVCache`): every leaf above carries a
  # leading L axis and this int32 scalar (the scan's layer index) picks the layer that
  # `read`, `scales`, `write` and the offset calls see; writes scatter the new rows into
  # the stack in place. None: the leaves are this layer's alone.
  layer: Optional[chex.Array] = None

  @property
  def length(self) -> int:
    return self.k.shape[-2]

  def _at(self, x, whole_stack: bool = False):
    """This layer's part of a leaf (the leaf itself unless a view of a stack; the whole
    stack with `whole_stack`, for a kernel that reads the layer in place)."""
    return x if x is None or self.layer is None or whole_stack else x[self.layer]

  def _set(self, stored, x):
    """`stored` (a leaf) with this layer's part replaced by `x`."""
    return x if self.layer is None else stored.at[self.layer].set(x)

  def read(self, dtype, storage: CacheStorage = COMPUTE_CACHE, whole_stack: bool = False
           ) -> Tuple[jax.Array, jax.Array]:
    """(k, v) as [B, K, S, H] arrays as the kernels take them ([L, B, K, S, H]: the whole
    stack of a scanned model's view, with `whole_stack`, for `kernels.attend(kv_layer=)`).

    'compute': a reinterpretation of the stored bits as the compute dtype `dtype` (no
    rounding); 'float32' / 'bfloat16': the stored values cast to `dtype` (exact, see
    `contract.cache_storage_error`); a scaled dtype: the codes in their code dtype
    (float8 bits reinterpreted), to be read with `scales`."""
    return (_read(self._at(self.k, whole_stack), storage.k_dtype, dtype),
            _read(self._at(self.v, whole_stack), storage.v_dtype, dtype))

  def scales(self, storage: CacheStorage = COMPUTE_CACHE, whole_stack: bool = False
             ) -> Optional[KVScales]:
    """None when neither side is scaled, else the `KVScales` the kernels apply to the
    codes `read` returns (`contract.cache_stage_dtypes`; the stack's with `whole_stack`)."""
    if not storage.quantized:
      return None
    k_scale, v_scale = (self._at(self.k_scale, whole_stack),
                        self._at(self.v_scale, whole_stack))
    return KVScales(
        k_token_BxKxS=k_scale if storage.k_scale == "token" else None,
        k_channel_BxKxH=k_scale if storage.k_scale == "channel" else None,
        v_token_BxKxS=v_scale if storage.v_scale == "token" else None)

  def write(self, k_BxTxKxH, v_BxTxKxH, positions_BxT,
            storage: CacheStorage = COMPUTE_CACHE) -> "LayerCache":
    """Stores the T new keys/values of each sequence at their absolute positions (values
    of the compute dtype; positions outside the cache are dropped), quantized as
    `storage` says (`attnprec.kvquant`): per token from the T new rows alone; per
    channel with the scale fixed by the first write (the prompt at prefill: a channel
    whose scale is still 0 takes this write's absmax over its T rows, a right-padded
    prompt's padding tokens included; later keys past that range clip to +-qmax, the
    price of a fixed scale; a NaN scale, a non-finite key, stays NaN)."""
    B = positions_BxT.shape[0]
    b_Bx1 = jnp.arange(B)[:, None]
    at = () if self.layer is None else (self.layer,)   # a stack's layer, in place

    def put(cache_BxKxS_, x_BxTxK_, codes: bool = False):
      x_BxTxK_ = reinterpret(x_BxTxK_, cache_BxKxS_.dtype)
      if positions_BxT.shape[1] == 1 and decode_write_form(codes) == "slices":
        return _put_rows(cache_BxKxS_, x_BxTxK_, positions_BxT[:, 0], at)
      # Indices (b, pos) on axes 0 and 2 with the K slice between them: the update rows
      # are [B, T, K(, H)], the new keys (or their scales) as they come.
      return cache_BxKxS_.at[at + (b_Bx1, slice(None), positions_BxT)].set(
          x_BxTxK_, mode="drop")

    k, k_scale = self.k, self.k_scale
    if storage.k_scale == "token":
      codes, scale_BxTxK = kvquant.quantize_token(k_BxTxKxH, storage.k_dtype)
      k, k_scale = put(k, codes, True), put(k_scale, scale_BxTxK, True)
    elif storage.k_scale == "channel":
      held_BxKxH = self._at(k_scale)
      kept_BxKxH = jnp.isnan(held_BxKxH) | (held_BxKxH > 0)
      fresh_BxKxH = kvquant.channel_scale(k_BxTxKxH, storage.k_dtype)
      codes, scale_BxKxH = kvquant.quantize_channel(
          k_BxTxKxH, jnp.where(kept_BxKxH, held_BxKxH, fresh_BxKxH), storage.k_dtype)
      k, k_scale = put(k, codes, True), self._set(k_scale, scale_BxKxH)
    else:
      k = put(k, _stored_values(k_BxTxKxH, storage.k_dtype))
    v, v_scale = self.v, self.v_scale
    if storage.v_scale == "token":
      codes, scale_BxTxK = kvquant.quantize_token(v_BxTxKxH, storage.v_dtype)
      v, v_scale = put(v, codes, True), put(v_scale, scale_BxTxK, True)
    else:
      v = put(v, _stored_values(v_BxTxKxH, storage.v_dtype))
    return LayerCache(k=k, v=v, k_scale=k_scale, v_scale=v_scale,
                      key_offset=self.key_offset, layer=self.layer)

  def offset_for(self, name: str, fresh_BxKxH, positions_BxT) -> Tuple[jax.Array, "LayerCache"]:
    """(c [B, K, H] float32, the cache holding it) for a call writing `positions_BxT`
    under key offset `name`: a sequence whose write starts at position 0 (its prefill)
    takes `fresh_BxKxH` and stores it; every later write (a decode step) gets the stored
    one, so all keys of a sequence carry the same c. A cache filled under another offset
    is refused (`UserError`, while tracing): its keys carry another c."""
    _refuse_mixed(self, name)
    stored_BxKxH = self._at(self.key_offset[name])
    first_B = positions_BxT[:, 0] == 0
    c_BxKxH = jnp.where(first_B[:, None, None], fresh_BxKxH.astype(jnp.float32), stored_BxKxH)
    return c_BxKxH, self.replace(key_offset={name: self._set(self.key_offset[name],
                                                             c_BxKxH)})

  def check_offset(self, name: str) -> None:
    """Refuses (`UserError`, while tracing) a step under key offset `name` over a cache
    whose keys were stored with another."""
    _refuse_mixed(self, name)


# How a decode step (one new row per sequence) writes its rows: 'scatter' (one scatter of B
# rows, as every other write) or 'slices' (B update slices, `_put_rows`): the same bits.
# None (the default): the form of the platform traced for (`platforms.Platform.decode_write`
# for values, `decode_write_codes` for int8 / float8 codes and their scales: the scatter
# on XLA:CPU; on a TPU the slices for values, the scatter for codes, as measured there for
# bf16 values and int8 codes); a name forces it for every side (results/tpu-model/
# decode_write.py, the tests). Read while tracing: a step function already traced and
# cached (`decoding.step_fn`) keeps the form it was traced with.
DECODE_WRITES = None
WRITE_FORMS = ("scatter", "slices")


def decode_write_form(codes: bool = False) -> str:
  """'scatter' or 'slices': how a decode step writes its rows (of `codes` and their scales,
  or of values) in the program traced now."""
  if DECODE_WRITES is not None:
    if DECODE_WRITES not in WRITE_FORMS:
      raise UserError(f"cache.DECODE_WRITES = {DECODE_WRITES!r} is not a write form; valid: "
                      f"None (the platform's), {', '.join(map(repr, WRITE_FORMS))}.")
    return DECODE_WRITES
  name = platforms.local_platform(platforms.TRACED_FOR.get() or jax.default_backend())
  row = platforms.TABLE[name or "cpu"]
  return row.decode_write_codes if codes else row.decode_write


def _put_rows(cache_BxKxS_, x_Bx1xK_, positions_B, at: tuple):
  """A decode step's write (one new row per sequence) as B slice updates, sequence b's
  [K(, H)] row at its position, with the scatter's semantics (`mode='drop'`: a position
  outside the cache writes nothing; a negative one counts from the end, as indexing
  does). The same values as the scatter, as update slices: a TPU's form
  (`platforms.Platform.decode_write`), where the scatter of 8 rows made the compiled
  step relayout the stacked cache and copy each layer out (4.7x the floor at 8 x 32k,
  0.85x with these; results/tpu-model/decode_write/)."""
  S = cache_BxKxS_.shape[len(at) + 2]
  pos_B = jnp.where(positions_B < 0, positions_B + S, positions_B)
  valid_B = (pos_B >= 0) & (pos_B < S)
  pos_B = jnp.clip(pos_B, 0, S - 1)
  zeros = (0,) * (x_Bx1xK_.ndim - 3)      # the H axis of keys and values; none for scales
  for b in range(x_Bx1xK_.shape[0]):
    # [1, K(, H)] -> [(1,) 1, K, 1(, H)]: the cache's axes, one sequence and one position
    row = jnp.swapaxes(x_Bx1xK_[b], 0, 1)[None, :, :]
    row = row.reshape((1,) * len(at) + row.shape)
    start = tuple(at) + (b, 0, pos_B[b]) + zeros
    held = jax.lax.dynamic_slice(cache_BxKxS_, start, row.shape)
    cache_BxKxS_ = jax.lax.dynamic_update_slice(
        cache_BxKxS_, jnp.where(valid_B[b], row, held), start)
  return cache_BxKxS_


def _refuse_mixed(cache: LayerCache, name: str) -> None:
  held = next(iter(cache.key_offset)) if cache.key_offset else "none"
  if held != name:
    raise UserError(
        f"This KV cache's keys were stored with key offset {held!r}, but the step "
        f"reading it runs precision.key_offset = {name!r}: the softmax removes an offset "
        f"only when every key a query sees carries the same one. Use one key_offset for "
        f"the prefill that fills a cache and the decode steps that read it (valid: "
        f"{', '.join(repr(k) for k in KEY_OFFSETS)}).")


@chex.dataclass(frozen=True)
class KVCache:
  layers: Tuple[LayerCache, ...]  # one per layer

  @property
  def length(self) -> int:
    return self.layers[0].length

  @property
  def nbytes(self) -> int:
    """Bytes held: codes or values, and scales."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))


@chex.dataclass(frozen=True)
class StackedKVCache:
  """The cache of a scanned model (`model.scan_layers`): every layer's `LayerCache` as
  one, each leaf with a leading L axis (k, v [L, B, K, S, H])."""
  stack: LayerCache

  @property
  def length(self) -> int:
    return self.stack.k.shape[3]

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))


def stack_cache(cache: KVCache) -> StackedKVCache:
  """A per-layer cache as the scanned model's (the same values, stacked on axis 0)."""
  return StackedKVCache(stack=jax.tree_util.tree_map(lambda *xs: jnp.stack(xs),
                                                     *cache.layers))


def unstack_cache(cache: StackedKVCache) -> KVCache:
  """A stacked cache as the unrolled model's: one `LayerCache` per layer."""
  L = cache.stack.k.shape[0]
  return KVCache(layers=tuple(jax.tree_util.tree_map(lambda x: x[i], cache.stack)
                              for i in range(L)))


def init_cache(config: ModelConfig, batch: int, length: int, dtype,
               storage: CacheStorage = COMPUTE_CACHE):
  """An empty cache of `length` positions for values of the compute dtype `dtype`, stored
  as `storage` says (default: the compute dtype, as `storage_dtype`): a `KVCache`, or a
  `StackedKVCache` for `config.scan_layers`."""
  B, K, S, H = batch, config.num_kv_heads, length, config.head_dim
  scale_shape = {"token": (B, K, S), "channel": (B, K, H), None: None}

  def one():
    k = jnp.zeros((B, K, S, H), side_dtype(storage.k_dtype, dtype))
    v = jnp.zeros((B, K, S, H), side_dtype(storage.v_dtype, dtype))
    ks, vs = scale_shape[storage.k_scale], scale_shape[storage.v_scale]
    offset = (None if storage.key_offset == "none" else
              {storage.key_offset: jnp.zeros((B, K, H), jnp.float32)})
    return LayerCache(k=k, v=v, k_scale=None if ks is None else jnp.zeros(ks, jnp.float32),
                      v_scale=None if vs is None else jnp.zeros(vs, jnp.float32),
                      key_offset=offset)

  if config.scan_layers:
    L = config.num_layers
    return StackedKVCache(stack=jax.tree_util.tree_map(
        lambda x: jnp.zeros((L,) + x.shape, x.dtype), one()))
  return KVCache(layers=tuple(one() for _ in range(config.num_layers)))


def forward_cache(config: ModelConfig, batch: int, length: int,
                  precision):
  """The cache a full forward of `length` tokens under `precision` must run through:
  None when the precision stores its KV cache in the compute dtype (the plain forward,
  the same numbers), else a fresh cache of `length` positions stored as it says, so the
  forward runs as a prefill into it and attends to the quantized or re-typed keys and
  values it stores (`layers.Attention`), not the exact ones. The study's forward rows
  and `checkpoints.finite.first_nonfinite_stage` use it."""
  # The key offset alone needs no cache: a cacheless forward subtracts the same c.
  if precision.cache_storage.without_offset() == COMPUTE_CACHE:
    return None
  return init_cache(config, batch, length, precision.compute_dtype, precision.cache_storage)


def cache_bytes(config: ModelConfig, batch: int, length: int, dtype,
                storage: CacheStorage = COMPUTE_CACHE) -> int:
  """The bytes `init_cache(config, batch, length, dtype, storage)` would hold (codes or
  values, and scales), from the shapes alone: nothing is allocated."""
  shapes = jax.eval_shape(lambda: init_cache(config, batch, length, dtype, storage))
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(shapes))


def storage_dtype(compute_dtype) -> jnp.dtype:
  """What a cache of `compute_dtype` values holds: float32 as it is; bfloat16 and float16
  as their raw bits, uint16 (see the module docstring)."""
  return bits_dtype(compute_dtype)


def side_dtype(name: str, compute_dtype) -> jnp.dtype:
  """The buffer dtype of one side (k or v) of a cache with storage dtype `name`: 'compute'
  -> `storage_dtype(compute_dtype)`; float32; bfloat16 as uint16 bits; int8; float8 as
  uint8 bits (XLA:CPU scatters into 8-bit integer buffers in place; the bits are
  reinterpreted on read, nothing rounds)."""
  if name == "compute":
    return storage_dtype(compute_dtype)
  if name in SCALED_KV_DTYPES:
    return bits_dtype(SCALED_KV_DTYPES[name][0])
  return storage_dtype(name)


def _stored_values(x, name: str):
  """Values of the compute dtype as an unscaled side stores them: 'compute' as they are,
  else cast (round to nearest even) to that dtype."""
  return x if name == "compute" else x.astype(name)


def _read(stored, name: str, dtype):
  """One side as the kernels take it (see `LayerCache.read`)."""
  if name == "compute":
    return _as(stored, dtype)
  if name in SCALED_KV_DTYPES:
    return reinterpret(stored, SCALED_KV_DTYPES[name][0])
  return _as(stored, name).astype(dtype)


def _as(stored, dtype):
  dtype = jnp.dtype(dtype)
  if stored.dtype != dtype and storage_dtype(dtype) != stored.dtype:
    raise ValueError(f"A cache stored as {stored.dtype} cannot be read as {dtype}.")
  return reinterpret(stored, dtype)

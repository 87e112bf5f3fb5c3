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
Under `jax.jit` with the cache donated (or carried by a loop), every write is in place:
tests/test_cache.py checks the compiled decode step for cache-sized copies.
"""
from typing import Tuple

import chex
import jax
import jax.numpy as jnp

from attnprec.config import ModelConfig


@chex.dataclass(frozen=True)
class LayerCache:
  """One layer's keys and values."""
  k: chex.Array  # [B, K, S, H] in `storage_dtype(compute dtype)`
  v: chex.Array  # [B, K, S, H]

  @property
  def length(self) -> int:
    return self.k.shape[2]

  def read(self, dtype) -> Tuple[jax.Array, jax.Array]:
    """(k, v) as [B, K, S, H] arrays of the compute dtype `dtype` (a reinterpretation of
    the stored bits, no rounding)."""
    return _as(self.k, dtype), _as(self.v, dtype)

  def write(self, k_BxTxKxH, v_BxTxKxH, positions_BxT) -> "LayerCache":
    """Stores the T new keys/values of each sequence at their absolute positions (values
    of the compute dtype; positions outside the cache are dropped)."""
    B = positions_BxT.shape[0]
    b_Bx1 = jnp.arange(B)[:, None]

    def put(cache_BxKxSxH, x_BxTxKxH):
      # Indices (b, pos) on axes 0 and 2 with the K slice between them: the update rows
      # are [B, T, K, H], the new keys as they come.
      return cache_BxKxSxH.at[b_Bx1, :, positions_BxT].set(
          _bits(x_BxTxKxH, cache_BxKxSxH.dtype), mode="drop")

    return LayerCache(k=put(self.k, k_BxTxKxH), v=put(self.v, v_BxTxKxH))


@chex.dataclass(frozen=True)
class KVCache:
  layers: Tuple[LayerCache, ...]  # one per layer

  @property
  def length(self) -> int:
    return self.layers[0].length

  @property
  def nbytes(self) -> int:
    return sum(c.k.nbytes + c.v.nbytes for c in self.layers)


def init_cache(config: ModelConfig, batch: int, length: int, dtype) -> KVCache:
  """An empty cache of `length` positions for values of the compute dtype `dtype`."""
  shape = (batch, config.num_kv_heads, length, config.head_dim)
  store = storage_dtype(dtype)
  return KVCache(layers=tuple(LayerCache(k=jnp.zeros(shape, store), v=jnp.zeros(shape, store))
                              for _ in range(config.num_layers)))


def storage_dtype(compute_dtype) -> jnp.dtype:
  """What a cache of `compute_dtype` values holds: float32 as it is; bfloat16 and float16
  as their raw bits, uint16 (see the module docstring)."""
  c = jnp.dtype(compute_dtype)
  return c if c.itemsize == 4 else jnp.dtype(jnp.uint16)


def _bits(x, store):
  """Values of the compute dtype as the cache stores them."""
  return x if x.dtype == store else jax.lax.bitcast_convert_type(x, store)


def _as(stored, dtype):
  dtype = jnp.dtype(dtype)
  if stored.dtype == dtype:
    return stored
  if storage_dtype(dtype) != stored.dtype:
    raise ValueError(f"A cache stored as {stored.dtype} cannot be read as {dtype}.")
  return jax.lax.bitcast_convert_type(stored, dtype)

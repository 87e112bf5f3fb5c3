"""KV cache as plain data, passed in and returned (no hidden state).

Shapes: L layers, B batch, S cache length (prompt + new tokens), K kv heads, H head dim.
Positions are absolute: sequence b's token at position p is stored at index p.
"""
import chex
import jax.numpy as jnp

from attnprec.config import ModelConfig


@chex.dataclass(frozen=True)
class KVCache:
  k: chex.Array  # [L, B, S, K, H] in the phase's compute dtype
  v: chex.Array  # [L, B, S, K, H]

  @property
  def length(self) -> int:
    return self.k.shape[2]


def init_cache(config: ModelConfig, batch: int, length: int, dtype) -> KVCache:
  shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

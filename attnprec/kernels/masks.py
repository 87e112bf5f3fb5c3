"""Structured attention masks: what a kernel needs to know to skip work.

A dense boolean mask [B, 1|N, T, S] says which (query, key) pairs attend, but a kernel
cannot skip a block of it without reading it. `CausalMask` says the same thing for the
model's masks (causal by absolute position, optionally within a sliding window) as
positions, so a blockwise kernel can bound each block's positions and never compute a
block in which no pair attends.

Semantics (identical to `attnprec.attention.causal_mask`): key s is visible to query t
iff k_pos[b, s] <= q_pos[b, t] and, with a window w, k_pos[b, s] > q_pos[b, t] - w.
"""
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from attnprec import attention as attention_lib


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["q_positions_BxT", "k_positions_BxS"],
                   meta_fields=["sliding_window"])
@dataclasses.dataclass(frozen=True, eq=False)
class CausalMask:
  """Causal (sliding-window) mask given by absolute positions. A pytree: the positions
  are leaves (traced under jit), the window is static."""
  q_positions_BxT: jax.Array          # int, absolute position of each query
  k_positions_BxS: jax.Array          # int, absolute position of each key (cache index)
  sliding_window: Optional[int] = None  # keys more than w-1 positions back are hidden

  def dense(self) -> jax.Array:
    """The same mask as a dense [B, 1, T, S] bool array (for kernels that need one)."""
    return attention_lib.causal_mask(self.q_positions_BxT, self.k_positions_BxS,
                                     sliding_window=self.sliding_window)

  def blockwise_kwargs(self) -> dict:
    """Keyword arguments for `attnprec.kernels.blockwise.blockwise_attention`."""
    return dict(causal=True, q_positions_BxT=self.q_positions_BxT,
                k_positions_BxS=self.k_positions_BxS, sliding_window=self.sliding_window)


def visible(q_pos, k_pos, *, causal: bool, sliding_window: Optional[int]):
  """Broadcasting rule shared by all kernels: q_pos [..., T, 1], k_pos [..., 1, S]."""
  allowed = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), jnp.bool_)
  if causal:
    allowed &= k_pos <= q_pos
  if sliding_window is not None:
    allowed &= k_pos > q_pos - sliding_window
  return allowed

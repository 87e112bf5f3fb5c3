"""The study's probes, attached to the model from outside.

The model returns what a model returns (logits, cache). The study needs more from each
layer: the attention kernel's output (what it compares with a reference) and the queries
after RoPE (what the key-offset calibration reads); and the offset study adds a key bias.
All three happen at one point, the `attnprec.layers.AttentionKernel` module of each layer
(`decoder/layer_{i}/attn/kernel`: queries after RoPE, keys and values of every visible
position -> kernel output), which Haiku lets us intercept
(`hk.experimental.intercept_methods`) without the model knowing.

    with probes.attached(params) as record:
      out = model_lib.transformed(config).apply(params, tokens, precision=prec)
    record.attn      # per layer [B, T, N, H] kernel outputs, in the layer order
    record.queries   # per layer [B, T, N, H] queries after RoPE (unscaled)

The key bias (`attnprec.study.offsets`) is a parameter the study injects: when `params`
carry `decoder/layer_{i}/attn/kernel/k_offset` [K, H], every key the kernel sees gets it added
(in the compute dtype), in prefill and in every decode step alike. Whether a call carries
offsets is a property of the params' structure, so a jitted program traced with offsets
is never reused for params without them (and vice versa).
"""
import contextlib
import dataclasses
from typing import List

import haiku as hk
import jax.numpy as jnp

from attnprec.errors import UserError
from attnprec.layers import AttentionKernel

OFFSET = "k_offset"   # the injected parameter, in each layer's kernel module


def offset_module(layer: int) -> str:
  """The module whose `k_offset` holds layer `layer`'s key bias."""
  return f"decoder/layer_{layer}/attn/kernel"


def has_offsets(params) -> bool:
  return any(OFFSET in names for names in params.values())


@dataclasses.dataclass
class Record:
  """What the probes saw, one entry per layer call in the order the layers ran."""
  attn: List = dataclasses.field(default_factory=list)
  queries: List = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def attached(params, *, record: bool = True):
  """Attaches the probes (and, if `params` carry key offsets, the bias) to every
  `AttentionKernel` called inside the block; yields the `Record` (or None)."""
  rec = Record() if record else None
  key_offset = has_offsets(params)

  def interceptor(next_f, args, kwargs, context):
    if not (isinstance(context.module, AttentionKernel) and context.method_name == "__call__"):
      return next_f(*args, **kwargs)
    if context.module.scanned:
      raise UserError(
          "The study's probes record each layer's attention and add each layer's key "
          "bias, but with model.scan_layers = True one kernel call inside a lax.scan "
          "stands for every layer (no layer of its own to record or bias). Run the "
          "study with model.scan_layers = False (the default; the scanned model computes "
          "the same numbers).")
    q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask = args
    if key_offset:
      # Runs inside the kernel module: this reads decoder/layer_{i}/attn/kernel/k_offset.
      K, H = k_BxSxKxH.shape[2:]
      b_KxH = hk.get_parameter(OFFSET, (K, H), jnp.float32, init=jnp.zeros)
      k_BxSxKxH = k_BxSxKxH + b_KxH.astype(k_BxSxKxH.dtype)
    out_BxTxNxH = next_f(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask, **kwargs)
    if rec is not None:
      rec.queries.append(q_BxTxNxH)
      rec.attn.append(out_BxTxNxH)
    return out_BxTxNxH

  with hk.experimental.intercept_methods(interceptor):
    yield rec

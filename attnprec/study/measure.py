"""The study's measurements for one model under one `Precision`: jitted programs (cached
per configuration and shape) and the error metrics that compare them with a reference.

Shapes: B batch, L sequence length, D teacher-forced decode steps, P logit positions kept,
V vocabulary, M generated tokens, Ly layers, N heads, H head dim.
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import decoding
from attnprec.cache import forward_cache
from attnprec import model as model_lib
from attnprec.checkpoints import finite
from attnprec.config import ModelConfig
from attnprec.precision import Precision
from attnprec.study import probes


def collect(config: ModelConfig, params, tokens_BxT, precision: Precision):
  """(logits [B, T, V], per-layer attention outputs, per-layer queries after RoPE) of one
  full forward pass with the probes attached (not jitted: for tests and small inputs)."""
  with probes.attached(params) as rec:
    out = model_lib.transformed(config).apply(params, tokens_BxT, precision=precision)
  return out.logits, tuple(rec.attn), tuple(rec.queries)


@functools.lru_cache(maxsize=64)
def forward_fn(config: ModelConfig, precision: Precision, keep_positions: int):
  """(params, tokens_BxL) -> (nll_BxL' of tokens[1:], logits of the last P positions
  [B, P, V], attention outputs [Ly, B, L, N, H] float32).

  A preset that stores the KV cache otherwise than in the compute dtype (a quantized or
  re-typed cache) runs this forward as a prefill into such a cache (fresh, L positions):
  prefill attends to what it stores (`layers.Attention`), so the rows of this forward
  (prefill error, NLL, logits) measure the cache setting too. A forward without a cache
  would see the exact keys and values and silently ignore it. Every other preset runs
  the plain forward, as before."""
  apply = model_lib.transformed(config).apply

  def fn(params, tokens_BxL):
    cache = forward_cache(config, *tokens_BxL.shape, precision)
    with probes.attached(params) as rec:
      out = apply(params, tokens_BxL, None, cache, precision=precision)
    logp_BxLxV = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    nll_BxL = -jnp.take_along_axis(logp_BxLxV, tokens_BxL[:, 1:, None], axis=-1)[..., 0]
    attn = jnp.stack([a.astype(jnp.float32) for a in rec.attn])
    return nll_BxL, out.logits[:, -keep_positions:], attn

  return jax.jit(fn)


@functools.lru_cache(maxsize=64)
def decode_fn(config: ModelConfig, precision: Precision, prefix: int):
  """Teacher-forced decoding: prefill tokens[:, :prefix] into a cache of L positions, then
  feed tokens[:, prefix:] one single-token decode step at a time (as in serving).
  (params, tokens_BxL) -> (logits [D, B, V], attention outputs [D, Ly, B, N, H])."""
  apply = model_lib.transformed(config).apply

  def fn(params, tokens_BxL):
    B, L = tokens_BxL.shape
    with probes.attached(params, record=False):
      state = decoding.prefill(params, tokens_BxL[:, :prefix],
                               jnp.full((B,), prefix, jnp.int32), config=config,
                               precision=precision, cache_length=L)

    def body(cache, t):
      token_Bx1 = jax.lax.dynamic_slice_in_dim(tokens_BxL, t, 1, axis=1)
      with probes.attached(params) as rec:
        out = apply(params, token_Bx1, jnp.full((B, 1), t, jnp.int32), cache,
                    precision=precision)
      attn = jnp.stack([a[:, 0].astype(jnp.float32) for a in rec.attn])
      return out.cache, (out.logits[:, 0], attn)

    _, (logits_DxBxV, attn) = jax.lax.scan(body, state.cache, jnp.arange(prefix, L))
    return logits_DxBxV, attn

  return jax.jit(fn)


def generate(params, prompts_BxP, config, precision, new_tokens: int):
  """(greedy tokens [B, M] after each prompt, finite_B: whether the logits that chose
  them were finite), from `decoding.generate` (cached prefill + decode steps)."""
  B, P = prompts_BxP.shape
  with probes.attached(params, record=False):   # the key bias, if params carry one
    out = decoding.generate(params, jnp.asarray(prompts_BxP), jnp.full((B,), P, jnp.int32),
                            jax.random.PRNGKey(0), config=config, precision=precision,
                            max_new_tokens=new_tokens, return_logits=False)
  return np.asarray(out.tokens_BxM), np.asarray(out.finite_B)


def decode_template(params, prompts_BxP, template_BxM, config, precision):
  """Recall episodes: (tokens_BxM, answered_BxM, finite_BxM) of
  `decoding.decode_with_template`'s decode, with the finite flag of each slot's logits
  (`checkpoints.finite.decode_with_template`)."""
  B, P = prompts_BxP.shape
  with probes.attached(params, record=False):   # the key bias, if params carry one
    tokens, answered, ok = finite.decode_with_template(
        params, jnp.asarray(prompts_BxP), jnp.full((B,), P, jnp.int32),
        jnp.asarray(template_BxM), config=config, precision=precision,
        cache_length=P + template_BxM.shape[1])
  return np.asarray(tokens), np.asarray(answered), np.asarray(ok)


def first_nonfinite_stage(config, params, tokens_BxT, precision):
  """`checkpoints.finite.first_nonfinite_stage` with the study's key bias attached."""
  with probes.attached(params, record=False):
    return finite.first_nonfinite_stage(config, params, tokens_BxT, precision)


def timed(fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------- metrics
def rel_l2(a, ref) -> float:
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-300))


def max_abs(a, ref) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(ref, np.float64))))


def per_layer(attn, ref, layer_axis: int):
  """([rel L2 per layer], [max abs per layer])."""
  a, r = np.moveaxis(np.asarray(attn), layer_axis, 0), np.moveaxis(np.asarray(ref),
                                                                     layer_axis, 0)
  return [rel_l2(x, y) for x, y in zip(a, r)], [max_abs(x, y) for x, y in zip(a, r)]


def log_softmax64(logits):
  x = np.asarray(logits, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def kl(ref_logits, logits) -> float:
  """Mean over positions of KL(p_ref || p), in nats."""
  lr, lp = log_softmax64(ref_logits), log_softmax64(logits)
  return float(np.mean(np.sum(np.exp(lr) * (lr - lp), axis=-1)))


def top1_agreement(logits, ref_logits) -> float:
  """Fraction of positions whose most likely token is the reference's."""
  return float(np.mean(np.argmax(logits, -1) == np.argmax(ref_logits, -1)))


def greedy_agreement(tokens_BxM, ref_BxM, counted_BxM=None) -> dict:
  """Agreement of decoded tokens with the reference's over the counted slots (default:
  all), and the first slot (index among the counted ones) where a sequence diverges."""
  same = np.asarray(tokens_BxM) == np.asarray(ref_BxM)
  counted = (np.ones_like(same) if counted_BxM is None else np.asarray(counted_BxM, bool))
  rows = [s[c] for s, c in zip(same, counted)]
  M = min(len(r) for r in rows)
  first = np.array([M if r.all() else int(np.argmin(r)) for r in rows])
  return {"agreement": float(same[counted].mean()),
          "identical": float(np.mean([r.all() for r in rows])),
          "first_divergence_mean": float(first.mean()),
          "first_divergence_min": int(first.min()), "steps": int(M)}

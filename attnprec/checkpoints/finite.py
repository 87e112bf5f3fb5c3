"""NaN and Inf: found, counted, located, and never compared.

* `require_finite(what, array)`: the array, or a `NonFiniteError` counting its NaN / Inf
  (the one-off timing scripts under results/ check every output with it).
* `check_params(params, origin)`: every weight finite, else a `UserError` naming each
  tensor (module/name) and how many of its values are NaN / Inf. `checkpoints.load` runs
  it on every model it loads (GGUF, HF directory, train run), after the params are
  converted to their dtype (a float32 value beyond float16's range becomes Inf there).
* `first_nonfinite_stage(config, params, tokens_BxT, precision)`: runs one full forward
  pass of `tokens_BxT` under `precision` (on the params the decode programs run,
  `decoding.for_serving`; as a prefill into a fresh cache of T positions when the
  precision stores its KV cache otherwise than in the compute dtype, so that the
  quantized or re-typed cache the failing program read is the one searched, not the
  exact keys and values) with every Haiku module call intercepted, and names the first
  stage whose output is not finite: the embedding, a layer's attention (its q/k/v
  projection, norm, kernel or o projection) or MLP, the residual stream after a layer,
  the final norm or the unembedding. Used by the error paths only (it costs a compile).
* `nonfinite_error(what, precision, ...)`: the `NonFiniteError` every path raises, one
  paragraph: what was not finite, where, the stage, and what to try.
* `decode_with_template`: `decoding.decode_with_template` plus a per-slot finite flag
  (for the recall eval and the study; `decoding.generate` has its own `finite_B`).
"""
import functools
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

from attnprec.errors import NonFiniteError, UserError

_CHUNK = 1 << 22          # values checked at a time (bounded temporary memory)


def count_nonfinite(array) -> Tuple[int, int]:
  """(NaN count, +-Inf count) of a numpy-convertible float array (bfloat16 included)."""
  flat = np.asarray(array).reshape(-1)
  nan = inf = 0
  for start in range(0, flat.size, _CHUNK):
    part = np.asarray(flat[start:start + _CHUNK], np.float32)
    if np.isfinite(part).all():
      continue
    nan += int(np.isnan(part).sum())
    inf += int(np.isinf(part).sum())
  return nan, inf


def require_finite(what: str, array):
  """`array` if every value is finite, else a NonFiniteError naming `what` and counting its
  NaN and Inf values: what a timing or comparison script calls on each output before it
  reports a time or a difference for it (a broken run's figures look like a clean one's)."""
  nan, inf = count_nonfinite(array)
  if nan or inf:
    raise NonFiniteError(f"{what[:1].upper()}{what[1:]} is not finite ({nan} NaN and {inf} "
                         f"Inf of {np.size(array)} values); no time or difference is "
                         f"reported for it.")
  return array


def check_params(params, origin: str) -> None:
  """Raises a UserError naming every weight tensor that holds NaN or Inf."""
  bad = []
  for module in sorted(params):
    for name in sorted(params[module]):
      array = params[module][name]
      nan, inf = count_nonfinite(array)
      if nan or inf:
        bad.append(f"{module}/{name} ({nan} NaN and {inf} Inf of {np.size(array)} values)")
  if bad:
    shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more tensors" if len(bad) > 5
                                  else "")
    raise UserError(f"{origin} holds weights that are not finite: {shown}. A model with NaN "
                    f"or Inf weights produces garbage under every precision; the file is "
                    f"corrupt, or the training run that wrote it diverged (retrain, or load "
                    f"an earlier checkpoint). Converting to a 16-bit param_dtype also turns "
                    f"values beyond that dtype's range into Inf.")


# ----------------------------------------------------------------------------- stages
def _stage_name(path: str) -> str:
  """'decoder/~/layer_3/~/attn/~/q' -> 'layer 3 attention (q projection)'."""
  parts = [p for p in path.replace("/~/", "/").split("/") if p and p != "decoder"]
  if not parts:
    return path
  if parts[0] == "final_norm":
    return "the final norm"
  if not parts[0].startswith("layer_"):
    return path
  layer = parts[0][len("layer_"):]
  rest = parts[1:]
  if not rest:
    return f"layer {layer}: the residual stream (the sum of the layer's input and outputs)"
  part = {"attn": "attention", "mlp": "MLP", "pre_attn_norm": "pre-attention norm",
          "post_attn_norm": "post-attention norm", "pre_mlp_norm": "pre-MLP norm",
          "post_mlp_norm": "post-MLP norm"}.get(rest[0], rest[0])
  sub = {"q": "q projection", "k": "k projection", "v": "v projection",
         "o": "o projection", "kernel": "attention kernel: QK^T, softmax, weighted values",
         "q_norm": "q norm", "k_norm": "k norm", "gate": "gate projection",
         "up": "up projection", "down": "down projection"}
  if len(rest) > 1:
    return f"layer {layer} {part} ({sub.get(rest[1], '/'.join(rest[1:]))})"
  return f"layer {layer} {part} (its output)"


def _finite_leaves(out):
  import jax
  import jax.numpy as jnp
  if isinstance(out, tuple) and out:
    out = out[0]               # Attention / Block return (output, cache)
  leaves = [x for x in jax.tree_util.tree_leaves(out)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
  if not leaves:
    return None
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def first_nonfinite_stage(config, params, tokens_BxT, precision) -> Optional[str]:
  """The first stage of a forward pass of `tokens_BxT` whose output is not finite (see
  the module docstring), or None when the whole forward pass is finite."""
  import haiku as hk
  import jax
  import jax.numpy as jnp

  import dataclasses

  from attnprec import decoding, layout
  from attnprec import model as model_lib
  from attnprec.cache import forward_cache

  if config.scan_layers:   # per-layer stages need per-layer modules: the unrolled model,
    # the same numbers (tests/test_scan_layers.py), on the same params unstacked
    config = dataclasses.replace(config, scan_layers=False)
    params = layout.unstack(params)
  serving, prec = decoding.for_serving(params, precision)
  names: List[str] = []
  apply = model_lib.transformed(config).apply

  def fn(params, tokens):
    flags = []
    cache = forward_cache(config, *tokens.shape, prec)

    def interceptor(next_f, args, kwargs, context):
      if context.method_name != "__call__":
        return next_f(*args, **kwargs)
      path = context.module.module_name
      if isinstance(context.module, model_lib.Block) and path.endswith("layer_0"):
        names.append("the embedding (the token embeddings in the compute dtype)")
        flags.append(jnp.all(jnp.isfinite(args[0])))
      out = next_f(*args, **kwargs)
      ok = _finite_leaves(out)
      if ok is not None:
        names.append(_stage_name(path))
        flags.append(ok)
      return out

    with hk.experimental.intercept_methods(interceptor):
      logits = apply(params, tokens, None, cache, precision=prec).logits
    names.append("the unembedding (the logits)")
    flags.append(jnp.all(jnp.isfinite(logits)))
    return jnp.stack(flags)

  flags = np.asarray(jax.jit(fn)(serving, jnp.asarray(tokens_BxT, jnp.int32)))
  bad = np.nonzero(~flags)[0]
  return names[int(bad[0])] if bad.size else None


def logits_problem(logits) -> "Tuple[int, int, Tuple[int, ...]]":
  """(NaN count, Inf count, index of the first non-finite value) of a logits array
  (on device or host); the index is () when every value is finite."""
  shape = np.shape(logits)
  nan, inf, first = (int(v) for v in _nonfinite_stats()(logits))
  if not (nan or inf):
    return 0, 0, ()
  return nan, inf, tuple(int(i) for i in np.unravel_index(first, shape))


@functools.lru_cache(maxsize=None)
def _nonfinite_stats():
  """One jitted program (NaN count, Inf count, flat index of the first non-finite value),
  compiled once per shape, where five eager ops compiled five (jax imported on first
  use, as the rest of this module does)."""
  import jax
  import jax.numpy as jnp

  def stats(x):
    flat = jnp.asarray(x).reshape(-1)
    return jnp.isnan(flat).sum(), jnp.isinf(flat).sum(), jnp.argmax(~jnp.isfinite(flat))
  return jax.jit(stats)


class Where(NamedTuple):
  """Where the first non-finite logits of a decode or forward pass were."""
  kind: str                 # 'NaN' or 'Inf' (of the first non-finite value), or '' unknown
  detail: str               # 'at step 3', 'at position 7 of sequence 0', ...


def nonfinite_error(what: str, precision, where: Where, stage: Optional[str],
                    advice: str = "") -> NonFiniteError:
  """The one-paragraph NonFiniteError: `what` (e.g. 'the logits of the decode'), the
  first NaN/Inf, the stage that produced it, and what to try."""
  dtype = getattr(precision, "dtype", None)
  first = (f" ({where.kind} {where.detail})" if where.kind
           else f" ({where.detail})" if where.detail else "")
  if stage is None:
    located = ("; a full forward pass of the same tokens is finite, so the non-finite "
               "values arise in the cached decode steps")
  else:
    located = f"; the first stage whose output is not finite: {stage}"
  hint = ""
  if dtype == "float16":
    hint = (" float16 holds values up to 65504 only: an activation beyond that becomes Inf "
            "(and Inf - Inf NaN); this model's activations exceed it. Use bfloat16 "
            "(float32's range) or float32.")
  elif dtype is not None:
    hint = (" With finite weights (checkpoints.load checks them) the values overflowed "
            "or were undefined (0/0, Inf - Inf) in the computation; try float32, or the "
            "float32 attention flags (float32_qk_product, float32_logits).")
  desc = precision.describe() if hasattr(precision, "describe") else str(precision)
  return NonFiniteError(f"{what[:1].upper()}{what[1:]} were not finite{first} under "
                        f"{desc}{located}. No agreement or accuracy is reported for a result "
                        f"that is not finite.{hint}{advice}", stage=stage)


# ----------------------------------------------------------------------------- decodes
def _template_decode(params, prompt_BxP, lengths_B, template_BxM, *, config, precision,
                     cache_length):
  import jax
  import jax.numpy as jnp

  from attnprec import decoding
  params, precision = decoding.for_serving(params, precision)   # once, before the loop
  state = decoding.prefill(decoding.prefill_params(params, precision, prompt_BxP.size),
                           prompt_BxP, lengths_B, config=config, precision=precision,
                           cache_length=cache_length)

  def body(state, given_B):
    ok_B = jnp.all(jnp.isfinite(state.last_BxV), axis=-1)
    token_B = jnp.where(given_B >= 0, given_B, decoding.Greedy()(state.last_BxV, None))
    state = decoding.decode_step(params, state, token_B, config=config, precision=precision)
    return state, (token_B, ok_B)

  _, (tokens_MxB, ok_MxB) = jax.lax.scan(body, state, template_BxM.T)
  return tokens_MxB.T, template_BxM < 0, ok_MxB.T


_TEMPLATE_JIT = None


def decode_with_template(params, prompt_BxP, lengths_B, template_BxM, *, config, precision,
                         cache_length):
  """`decoding.decode_with_template` (the same prefill, decode steps and greedy choice)
  that also returns finite_BxM: whether the logits slot m was decoded from were finite.
  Returns (tokens_BxM, answered_BxM, finite_BxM)."""
  global _TEMPLATE_JIT
  import jax
  if _TEMPLATE_JIT is None:
    _TEMPLATE_JIT = jax.jit(_template_decode,
                            static_argnames=("config", "precision", "cache_length"))
  return _TEMPLATE_JIT(params, prompt_BxP, lengths_B, template_BxM, config=config,
                       precision=precision, cache_length=cache_length)


def first_bad(finite_BxM) -> "Tuple[int, int] | None":
  """(sequence, step) of the first False in a [B, M] finite mask (by step, then
  sequence), or None when all are True."""
  ok = np.asarray(finite_BxM, bool)
  if ok.all():
    return None
  b, m = np.nonzero(~ok)
  order = np.lexsort((b, m))[0]
  return int(b[order]), int(m[order])

"""Decoding: prefill a padded prompt batch into a KV cache, then single-token steps.

Prefill and every decode step go through the same model and the same attention kernel
with the decode phase's `Precision`; there is no inference-only code path that could
drop the attention flags (the failure this project exists to prevent).

Shapes: B batch, P padded prompt length, S cache length (P + new tokens), V vocabulary,
M new tokens.

Prompts are right-padded: sequence b's real tokens sit at positions 0..len_b-1 and the
first new token goes to position len_b. Causal masking by absolute position hides the
padding from every real query, and decode steps overwrite it.
"""
import dataclasses
import functools
from typing import NamedTuple, Optional

import gin
import jax
import jax.numpy as jnp
import numpy as np

from attnprec import checks, layers, layout
from attnprec import model as model_lib
from attnprec.cache import KVCache, init_cache
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import ALGORITHM_PRESETS, Precision


# ----------------------------------------------------------------------------- samplers
@gin.configurable
@checks.validated("Greedy")
@dataclasses.dataclass(frozen=True)
class Greedy:
  """argmax."""

  def __call__(self, logits_BxV, rng):
    del rng
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)


# A sampling temperature divides float32 logits: below this the quotient heads for
# float32's overflow (a temperature of 1e-46 is 0 in float32: inf logits, NaN in the
# sampler's softmax while the run would report finite logits). For the most likely
# token, use Greedy().
MIN_TEMPERATURE = 1e-6
# ... and above this it is not a float32 at all (1e308 becomes inf: every logit 0 or NaN).
MAX_TEMPERATURE = float(np.finfo(np.float32).max)
_POSITIVE = checks.number(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE)


@gin.configurable
@checks.validated("Temperature", temperature=_POSITIVE)
@dataclasses.dataclass(frozen=True)
class Temperature:
  """Sample from softmax(logits / temperature)."""
  temperature: float = 1.0

  def __call__(self, logits_BxV, rng):
    return jax.random.categorical(rng, logits_BxV / self.temperature).astype(jnp.int32)


@gin.configurable
@checks.validated("TopK", k=checks.at_least(1), temperature=_POSITIVE)
@dataclasses.dataclass(frozen=True)
class TopK:
  """Sample among the k most likely tokens."""
  k: int = 40
  temperature: float = 1.0

  def __call__(self, logits_BxV, rng):
    kth_Bx1 = jax.lax.top_k(logits_BxV, self.k)[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    return jax.random.categorical(rng, logits_BxV / self.temperature).astype(jnp.int32)


@gin.configurable
@checks.validated("TopP", p=checks.number(gt=0, le=1), temperature=_POSITIVE)
@dataclasses.dataclass(frozen=True)
class TopP:
  """Nucleus sampling: the smallest set of tokens whose probability reaches p."""
  p: float = 0.9
  temperature: float = 1.0

  def __call__(self, logits_BxV, rng):
    logits_BxV = logits_BxV / self.temperature
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    cum_BxV = jnp.cumsum(jax.nn.softmax(sorted_BxV, axis=-1), axis=-1)
    # Keep tokens whose preceding cumulative mass is < p, and the top token always (a p
    # that float32 rounds to 0, or a top token whose mass rounds to above 0 before it,
    # would otherwise keep none: every logit -inf, and token 0 drawn).
    keep_BxV = (cum_BxV - jax.nn.softmax(sorted_BxV, axis=-1)) < self.p
    keep_BxV = keep_BxV.at[:, 0].set(True)
    cutoff_Bx1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    logits_BxV = jnp.where(logits_BxV < cutoff_Bx1, -jnp.inf, logits_BxV)
    return jax.random.categorical(rng, logits_BxV).astype(jnp.int32)


SAMPLERS = (Greedy, Temperature, TopK, TopP)
SAMPLER_NAMES = "@Greedy(), @Temperature(), @TopK() or @TopP()"


# ----------------------------------------------------------------------------- weights
def _map_matrices(params, fn, layers_only: bool = False):
  """params with `fn` applied to every float32 array a matmul reads whole (the dense
  weights and the embedding table: `layout.read_as_matrix`; with `layers_only`, only the
  blocks' own, not the embedding or unembedding), the rest as it is."""
  def one(module, name, x):
    if layers_only and not getattr(layout.lookup(module, name), "per_layer", False):
      return x
    return fn(x) if layout.read_as_matrix(module, name) and x.dtype == jnp.float32 else x

  return {m: {n: one(m, n, x) for n, x in group.items()} for m, group in params.items()}


def compute_params(params, precision: Precision):
  """params with every matrix (dense weights, embeddings) stored in the phase's compute
  dtype, norm scales and biases left as they are: the values the model would cast them to
  at each use, cast once (bit-identical results, half the bytes held for bfloat16).

  With `layers.project`'s bf16 x bf16 -> float32 dots this is the fastest prefill on
  XLA:CPU but not the fastest decode (its bf16 matrix-vector path is slow:
  docs/performance.md). So `for_serving`
  keeps the float32-carried weights; this is for callers that want half the bytes held."""
  c = precision.compute_dtype
  return _map_matrices(params, lambda x: x.astype(c))


def serving_precision(precision: Precision, backend: Optional[str] = None) -> Precision:
  """The Precision the decode programs run under `for_serving`: with a 16-bit compute
  dtype and a plain `matmul_precision` (a dot-algorithm preset names its own operand
  types, so it keeps the cast at use), `carrier_weights` on XLA:CPU and `stored_weights`
  elsewhere (a TPU, a GPU: weights read from memory at every decode step, in half the
  bytes)."""
  backend = backend or jax.default_backend()
  if (precision.compute_dtype == jnp.float32 or
      precision.matmul_precision.upper() in ALGORITHM_PRESETS):
    return dataclasses.replace(precision, carrier_weights=False, stored_weights=False)
  cpu = backend == "cpu"
  return dataclasses.replace(precision, carrier_weights=cpu, stored_weights=not cpu)


def for_serving(params, precision: Precision, backend: Optional[str] = None):
  """(params, precision) as the decode programs run them.

  On XLA:CPU with a 16-bit compute dtype, the weight matrices are rounded once to values
  of that dtype, held in float32, and `precision.carrier_weights` is set. `layers.project`
  then runs a projection of fewer than `layers.MIN_ROWS_C_DOT` rows (a decode step) as a
  float32 dot on those values, and one of more rows (a prefill) as a bf16 x bf16 ->
  float32 dot on them cast to bf16 (exact): the same products, float32 accumulation, one
  rounding to the compute dtype either way. A prefill program is given `prefill_params`
  (those casts made once) instead. Float32-held rather than bf16-stored
  (`compute_params`): the decode step is faster (docs/performance.md). The attention kernels and
  their precision contract are untouched. On a TPU or GPU with a 16-bit compute dtype the
  matrices are stored in that dtype instead (`compute_params`, `stored_weights`): the
  same values, and a decode step, which reads every weight, reads half the bytes. Float32
  compute or a dot-algorithm `matmul_precision`: the params as given, neither set.
  Rounding is idempotent; call it outside any loop (`generate` does, before its loop)."""
  serving = serving_precision(precision, backend)
  if serving.stored_weights:
    return compute_params(params, precision), serving
  if not serving.carrier_weights:
    return params, serving
  c = precision.compute_dtype
  return _map_matrices(params, lambda x: x.astype(c).astype(jnp.float32)), serving


def prefill_params(params, serving: Precision, rows: int):
  """The weights a prefill program of `rows` tokens (B x P) reads under `serving` (the
  Precision `for_serving` returned), given `for_serving`'s params.

  With float32-carried weights and a projection form that runs the blocks' projections
  as c x c dots at that many rows ('by_rows' from `layers.MIN_ROWS_C_DOT`,
  'compute_dtype_dot'), the blocks' weight matrices stored in c: the values the prefill
  would cast the carried ones to at every use, cast once, so every dot has the same
  operands and the prefill the same numbers bit for bit (tests/test_decoding.py), while
  it reads 2 bytes per weight instead of 4 and writes no bf16 copy per use (0.85x the
  prefill time on Qwen2.5-Coder-0.5B at 1 x 1000: docs/performance.md). The embedding
  table stays as given: the prefill's last-position unembedding (B rows) is a float32
  dot on the carried values, as in a decode step. Elsewhere params are returned as given.
  Holding both this and the decode steps' carried copy costs half the carried bytes again;
  a caller that prefills once and decodes can drop it after the prefill."""
  if not serving.carrier_weights:
    return params
  form = layers.projection_form(serving)
  if form == "float32_dot" or (form == "by_rows" and rows < layers.MIN_ROWS_C_DOT):
    return params
  c = serving.compute_dtype
  return _map_matrices(params, lambda x: x.astype(c), layers_only=True)


# ----------------------------------------------------------------------------- steps
class DecodeState(NamedTuple):
  cache: KVCache
  last_BxV: jax.Array    # logits that predict the next token (float32)
  positions_B: jax.Array  # position the next token is written to


def prefill(params, prompt_BxP, lengths_B, *, config: ModelConfig, precision: Precision,
            cache_length: int) -> DecodeState:
  """Runs the prompt through the model, filling a fresh cache of `cache_length`."""
  B, P = prompt_BxP.shape
  if P > cache_length:
    raise UserError(f"Prompt of {P} tokens is longer than the KV cache ({cache_length} "
                    f"positions); raise the cache length or shorten the prompt.")
  # Stored as the phase's cache setting says (`Precision.cache_storage`; default: the
  # compute dtype). Prefill attends to what it stores (`layers.Attention`).
  cache = init_cache(config, B, cache_length, precision.compute_dtype,
                     precision.cache_storage)
  # Logits of each prompt's last real token only (not of all P positions).
  out = model_lib.transformed(config).apply(params, prompt_BxP, None, cache,
                                            precision=precision,
                                            logits_at_B=(lengths_B - 1).astype(jnp.int32),
                                            lengths_B=lengths_B)
  last_BxV = out.logits[:, 0]
  return DecodeState(out.cache, last_BxV, lengths_B.astype(jnp.int32))


def decode_step(params, state: DecodeState, tokens_B, *, config: ModelConfig,
                precision: Precision) -> DecodeState:
  """Appends one token per sequence at its own position; returns the next logits."""
  out = model_lib.transformed(config).apply(params, tokens_B[:, None],
                                            state.positions_B[:, None], state.cache,
                                            precision=precision)
  return DecodeState(out.cache, out.logits[:, 0], state.positions_B + 1)


@functools.lru_cache(maxsize=32)
def step_fn(config: ModelConfig, precision: Precision):
  """`decode_step` jitted for a serving loop, (params, state, tokens_B) -> state, with the
  state DONATED: the cache is updated in place (the state passed in is consumed; use
  the one returned). `generate` needs no donation: its loop carries the cache.
  Pass the (params, precision) of `for_serving`, made once: with raw float32 weights and
  bf16 compute, every call casts each weight matrix again."""
  return jax.jit(functools.partial(decode_step, config=config, precision=precision),
                 donate_argnums=(1,))


class Generated(NamedTuple):
  """What `generate` returns (a NamedTuple: index or unpack it)."""
  tokens_BxM: jax.Array     # int32; after a sequence's end token, the (first) end token
  logits_BxMxV: Optional[jax.Array]  # float32 logits that produced each token (zeros for
                            # steps never run); None with return_logits=False
  finite_B: jax.Array       # bool: every logits row that chose one of b's tokens (up to
                            # and including its end token) was finite
  steps: jax.Array          # int32 scalar: tokens produced per sequence before the whole
                            # batch had ended (<= max_new_tokens): the work actually done


@functools.partial(jax.jit, static_argnames=("config", "precision", "sampler",
                                             "max_new_tokens", "cache_length",
                                             "return_logits"))
def generate(params, prompt_BxP, lengths_B, rng, *, config: ModelConfig, precision: Precision,
             sampler=Greedy(), max_new_tokens: int, cache_length: Optional[int] = None,
             eos_id: int = -1, return_logits: bool = True) -> Generated:
  """Prefill + up to `max_new_tokens` decode steps in one jitted program.

  The decode loop is a `lax.while_loop` that stops as soon as every sequence of the batch
  has emitted `eos_id` (most answers end long before `max_new_tokens`); the tokens it
  returns are those of a fixed-length loop: after a sequence emits `eos_id` it keeps
  emitting `eos_id` (tests/test_decoding.py checks both against each other). `eos_id` may
  also be a 1-D int array of end tokens (any of them ends a sequence, which then keeps
  emitting the first), or a 2-D int array [E, L] of end sequences, right-aligned and
  padded with -1 (any token): a sequence ends when its last L tokens match a row, then
  keeps emitting row 0's last token; e.g. the chat end token and the token pairs that
  close a code block (a fence often spans two tokens: "``" + "`\n\n").
  Each step checks the logits it samples from for NaN/Inf (`finite_B`): a decode whose
  logits were not finite is reported, never compared. return_logits=False keeps no
  [B, M, V] buffer (what an eval over a large vocabulary wants).
  """
  P = prompt_BxP.shape[1]
  B, M = prompt_BxP.shape[0], max_new_tokens
  if max_new_tokens < 1:
    raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
  cache_length = cache_length or P + max_new_tokens
  params, precision = for_serving(params, precision)   # once, before the loop
  state = prefill(prefill_params(params, precision, prompt_BxP.size), prompt_BxP, lengths_B,
                  config=config, precision=precision, cache_length=cache_length)

  def finite(logits_BxV):
    return jnp.all(jnp.isfinite(logits_BxV), axis=-1)

  ends_ExL = jnp.asarray(eos_id, jnp.int32)
  if ends_ExL.ndim < 2:      # single end tokens: -1 is "none" here, never "any token"
    ends_ExL = ends_ExL.reshape(-1, 1)
    eos = ends_ExL[0, -1]
    ends_ExL = jnp.where(ends_ExL < 0, -3, ends_ExL)   # matches nothing
  else:
    eos = ends_ExL[0, -1]                               # what an ended sequence emits
  L = ends_ExL.shape[1]

  def ended(recent_BxL):
    """Whether each sequence's last L tokens match an end row (-1 matches any)."""
    hit_BxExL = (ends_ExL[None] == -1) | (recent_BxL[:, None, :] == ends_ExL[None])
    return jnp.any(jnp.all(hit_BxExL, axis=-1), axis=-1)

  def push(recent_BxL, token_B):
    return jnp.concatenate([recent_BxL[:, 1:], token_B[:, None]], axis=1)

  rng0, rng = jax.random.split(rng)
  first_B = sampler(state.last_BxV, rng0)
  recent_BxL = push(jnp.full((B, L), -2, jnp.int32), first_B)   # -2: before the answer
  done_B = ended(recent_BxL)
  tokens_BxM = jnp.full((B, M), eos, jnp.int32).at[:, 0].set(first_B)
  logits_BxMxV = None
  if return_logits:
    V = state.last_BxV.shape[-1]
    logits_BxMxV = jnp.zeros((B, M, V), jnp.float32).at[:, 0].set(state.last_BxV)
  rngs = jax.random.split(rng, max(M - 1, 1))          # as many keys as a fixed loop

  def cond(carry):
    t, _, _, done_B, _, _, _, _ = carry
    return (t < M) & ~jnp.all(done_B)

  def body(carry):
    t, state, token_B, done_B, recent_BxL, tokens_BxM, logits_BxMxV, finite_B = carry
    state = decode_step(params, state, token_B, config=config, precision=precision)
    next_B = jnp.where(done_B, eos, sampler(state.last_BxV, rngs[t - 1]))
    recent_BxL = push(recent_BxL, next_B)
    finite_B = finite_B & (done_B | finite(state.last_BxV))
    tokens_BxM = jax.lax.dynamic_update_slice(tokens_BxM, next_B[:, None], (0, t))
    if logits_BxMxV is not None:
      logits_BxMxV = jax.lax.dynamic_update_slice(logits_BxMxV, state.last_BxV[:, None],
                                                  (0, t, 0))
    return (t + 1, state, next_B, done_B | ended(recent_BxL), recent_BxL, tokens_BxM,
            logits_BxMxV, finite_B)

  carry = (jnp.int32(1), state, first_B, done_B, recent_BxL, tokens_BxM, logits_BxMxV,
           finite(state.last_BxV))
  steps, _, _, _, _, tokens_BxM, logits_BxMxV, finite_B = jax.lax.while_loop(cond, body,
                                                                            carry)
  return Generated(tokens_BxM, logits_BxMxV, finite_B, steps)


@functools.partial(jax.jit, static_argnames=("config", "precision", "cache_length"))
def decode_with_template(params, prompt_BxP, lengths_B, template_BxM, *, config: ModelConfig,
                         precision: Precision, cache_length: int):
  """Greedy decode where some tokens are given: slot m takes `template[:, m]` when it is
  >= 0, else the model's own greedy prediction; every slot goes through a single-token
  decode step. Used when inputs keep arriving between answers (e.g. one query after
  another), so each answer is decoded from the cache, as in serving.

  Returns (tokens_BxM with the model's answers filled in, answered_BxM bool).
  """
  params, precision = for_serving(params, precision)   # once, before the loop
  state = prefill(prefill_params(params, precision, prompt_BxP.size), prompt_BxP, lengths_B,
                  config=config, precision=precision, cache_length=cache_length)

  def body(state, given_B):
    token_B = jnp.where(given_B >= 0, given_B, Greedy()(state.last_BxV, None))
    return decode_step(params, state, token_B, config=config, precision=precision), token_B

  _, tokens_MxB = jax.lax.scan(body, state, template_BxM.T)
  return tokens_MxB.T, template_BxM < 0


# Prompt-length buckets: powers of two and 1.5x powers of two (at most a third padding).
BUCKETS = tuple(sorted({m * 2 ** e for e in range(4, 17) for m in (2, 3)}))


def bucket_length(n: int) -> int:
  """The smallest bucket >= n (32, 48, 64, 96, 128, 192, ...): prompts padded to it share
  one compiled program."""
  for b in BUCKETS:
    if b >= n:
      return b
  return n


def pad_prompts(prompts, pad_id: int = 0, *, bucket: bool = False):
  """List of token lists -> (prompt_BxP int32 right-padded, lengths_B int32).

  bucket: pad P up to `bucket_length(longest prompt)` instead of the longest prompt, so
  prompts of other lengths reuse the same compiled `generate` (the causal mask hides the
  padding and decode steps overwrite it; results are the same as unbucketed)."""
  lengths = [len(p) for p in prompts]
  if not lengths or min(lengths) == 0:
    raise UserError("Empty prompt: every prompt needs at least one token.")
  P = bucket_length(max(lengths)) if bucket else max(lengths)
  rows = [list(p) + [pad_id] * (P - len(p)) for p in prompts]
  return jnp.asarray(rows, jnp.int32), jnp.asarray(lengths, jnp.int32)

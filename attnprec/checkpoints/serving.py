"""One generation front end: `plan` says what a batched `decoding.generate` will do, `run`
does it, `nonfinite_error` is the error of a run whose logits were not finite.

The decode job (`jobs/generate_text.py`), the evals (`evals/common.Generator`) and the
Python API (`checkpoints.generate`) all go through these three:

    p = serving.plan(config, precision, [[1, 2, 3], [4, 5]], max_new_tokens=16, ends=eos)
    p.padded_length, p.cache_length, p.prefill_kernel, p.step_kernel, p.serving, p.cache
    out = serving.run(p, params)          # out.tokens[b]: b's new tokens, cut at its end
    if not all(out.finite):
      raise serving.nonfinite_error(p, params, out, what="the logits of the decode")

A `Plan` is plain frozen data, made before anything is compiled: the prompts and how they
are padded (a length bucket, `decoding.bucket_length`, so prompts of other lengths reuse
one program; the longest prompt when the bucket would pass the model's context), the
batch (the prompts, then the first repeated up to a fixed size), the end rows and how
tokens are cut at them, and what the program will run: the serving precision
(`decoding.serving_precision`), the attention kernel of the prefill and of the decode
steps (`kernels.resolve` on the static shapes the model's attention sees) and its KV
cache. Shapes: B batch, P padded prompt length, M new tokens, S = P + M cache length.
"""
import collections
import dataclasses
import time
from typing import List, NamedTuple, Optional, Sequence, Tuple

import jax
import numpy as np

from attnprec import compilation, decoding, kernels, keyoffset
from attnprec.cache import cache_bytes
from attnprec.checkpoints import finite
from attnprec.checkpoints.forward import logits as full_logits
from attnprec.config import ModelConfig
from attnprec.contract import COMPUTE_CACHE
from attnprec.errors import NonFiniteError, UserError
from attnprec.precision import Precision


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `run` does (plain data; see the module docstring)."""
  config: ModelConfig
  precision: Precision        # as asked: what `decoding.generate` is given
  serving: Precision          # what its prefill and decode steps run (`for_serving`)
  prompts: Tuple[Tuple[int, ...], ...]   # the real prompts, in order
  batch: int                  # B rows run: the prompts, then prompts[0] repeated
  padded_length: int          # P: every row right-padded to it
  bucketed: bool              # P is `decoding.bucket_length` of the longest prompt
  max_new_tokens: int         # M
  cache_length: int           # S = P + M: the KV cache `generate` makes
  ends: Tuple[Tuple[int, ...], ...]  # [E, L] end rows, right-aligned, -1: any token
                              # (`decoding.generate`'s eos_id); () never ends early
  keep_end: bool              # the tokens returned include the end (else stop before it)
  sampler: object
  return_logits: bool         # keep the [B, M, V] logits (the error names the step)
  prefill_kernel: str         # the attention kernel of the prefill (P queries, S keys)
  step_kernel: str            # ... of each decode step (1 query, S keys)
  cache: str                  # the KV cache: storage, shape, bytes (`cache_line`)

  @property
  def eos_id(self):
    """`decoding.generate`'s eos_id: -1 (none), one end token, or the [E, L] rows."""
    if not self.ends:
      return -1
    if len(self.ends) == 1 and len(self.ends[0]) == 1 and self.ends[0][0] >= 0:
      return self.ends[0][0]
    return np.asarray(self.ends, np.int32)

  def kernel_line(self) -> str:
    """'attention kernel: prefill (P tokens) X, decode steps (cache of S) Y'."""
    auto = self.precision.kernel == kernels.AUTO
    platform = self.serving.platform()
    return (f"attention kernel: prefill ({self.padded_length} tokens) {self.prefill_kernel}, "
            f"decode steps (cache of {self.cache_length}) {self.step_kernel}" + (
                f" (kernel=auto on {platform}: {kernels.resolve('auto', 1, 0, platform)} for "
                f"decode steps, "
                f"{kernels.long_kernel(platform, self.precision)}"
                f" from {kernels.AUTO_MIN_QUERIES} queries or "
                f"{kernels.AUTO_MIN_KEYS} keys)" if auto else ""))

  def padded(self):
    """(prompt_BxP int32, lengths_B int32): the rows the program runs."""
    rows = list(self.prompts) + [self.prompts[0]] * (self.batch - len(self.prompts))
    lengths = [len(p) for p in rows]
    rows = [list(p) + [0] * (self.padded_length - len(p)) for p in rows]
    return np.asarray(rows, np.int32), np.asarray(lengths, np.int32)

  def program_key(self):
    """What the compiled program depends on (not the prompts' tokens)."""
    return (self.config, self.precision, self.sampler, self.max_new_tokens,
            self.return_logits, self.batch, self.padded_length, np.shape(self.eos_id))


def _ends(ends) -> Tuple[Tuple[int, ...], ...]:
  """None / an end token (-1: none) / [E, L] end rows -> the plan's end rows."""
  if ends is None:
    return ()
  arr = np.asarray(ends)
  if arr.ndim == 0:
    return () if int(arr) < 0 else ((int(arr),),)
  if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"ends: an end token or [E, L] int end rows, got {ends!r:.200}")
  return tuple(tuple(int(t) for t in row) for row in arr)


def plan(config: ModelConfig, precision: Precision, prompts: Sequence[Sequence[int]], *,
         max_new_tokens: int, ends=None, batch: Optional[int] = None, bucket: bool = True,
         keep_end: bool = True, sampler=decoding.Greedy(), return_logits: bool = False,
         setting: str = "max_new_tokens", backend: Optional[str] = None) -> Plan:
  """The plan of one batched decode of `prompts` (token lists) under `precision`.

  ends: None or -1 (never stop early), an end token, or [E, L] end rows (see
  `decoding.generate`). batch: rows run (default: one per prompt). bucket: pad to the
  prompt-length bucket (falls back to the longest prompt where bucket + max_new_tokens
  would pass the model's context). setting: how messages name max_new_tokens.
  A prompt that does not fit the context with max_new_tokens is a UserError."""
  keyoffset.check(config, precision.key_offset)   # an offset this model cannot take
  prompts = tuple(tuple(int(t) for t in p) for p in prompts)
  batch = len(prompts) if batch is None else batch
  if not 1 <= len(prompts) <= batch:
    raise ValueError(f"1..{batch} prompts per plan, got {len(prompts)}")
  if min(len(p) for p in prompts) == 0:
    raise UserError("Empty prompt: every prompt needs at least one token.")
  if max_new_tokens < 1:
    raise UserError(f"{setting} must be at least 1, got {max_new_tokens}.")
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens > config.max_seq_len:
    which = "Prompt" if len(prompts) == 1 else "The longest prompt"
    raise UserError(f"{which} ({longest} tokens) + {setting} ({max_new_tokens}) exceed the "
                    f"model's context ({config.max_seq_len} tokens).")
  P = decoding.bucket_length(longest) if bucket else longest
  if P + max_new_tokens > config.max_seq_len:
    P = longest
  S = P + max_new_tokens
  serving = decoding.serving_precision(precision, backend)
  return Plan(config=config, precision=precision, serving=serving, prompts=prompts,
              batch=batch, padded_length=P,
              bucketed=bucket and P == decoding.bucket_length(longest),
              max_new_tokens=max_new_tokens, cache_length=S, ends=_ends(ends),
              keep_end=keep_end, sampler=sampler, return_logits=return_logits,
              prefill_kernel=kernels.resolve(precision.kernel, P, S, serving.platform(backend),
                                             precision),
              step_kernel=kernels.resolve(precision.kernel, 1, S, serving.platform(backend),
                                          precision),
              cache=cache_line(config, serving, S, batch))


def cache_line(config, precision, length: int, batch: int = 1) -> str:
  """The KV cache `generate` makes under `precision`: its storage and its bytes, beside
  those of a cache stored in the compute dtype."""
  mib = lambda n: f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"  # noqa
  held = cache_bytes(config, batch, length, precision.compute_dtype,
                     precision.cache_storage)
  line = (f"KV cache: {precision.cache_storage.describe()}, {batch} x {length} positions "
          f"x {config.num_layers} layers: {mib(held)}")
  if precision.cache_storage != COMPUTE_CACHE:
    plain = cache_bytes(config, batch, length, precision.compute_dtype)
    line += f" ({held / plain:.2f}x the {mib(plain)} of a compute-dtype cache)"
  return line


def end_index(tokens: Sequence[int], ends_ExL) -> Optional[int]:
  """Index of the token that ended `tokens` (its last L tokens match an end row; -1 in a
  row matches any token), or None (also with no end rows)."""
  rows = [list(r) for r in ends_ExL]
  if not rows:
    return None
  L = len(rows[0])
  padded = [-2] * (L - 1) + list(tokens)
  for m in range(len(tokens)):
    tail = padded[m:m + L]
    if any(all(e == -1 or e == t for e, t in zip(r, tail)) for r in rows):
      return m
  return None


# ----------------------------------------------------------------------------- running
class Decoded(NamedTuple):
  """What `run` returns, one entry per real prompt."""
  tokens: List[List[int]]     # new tokens, cut at the end (through it with keep_end)
  stopped: List[bool]         # it reached an end row (else max_new_tokens)
  finite: List[bool]          # every logits row that chose its tokens was finite
  steps: int                  # tokens per row the batch ran (<= max_new_tokens)
  seconds: float              # the run, compile excluded
  compiled: "Optional[compilation.Compiled]"   # None: the program was in `programs`
  out: decoding.Generated     # the program's own output (all B rows)

  @property
  def compile_seconds(self) -> float:
    return self.compiled.seconds if self.compiled is not None else 0.0


class Programs:
  """Compiled programs by what they depend on, the `size` most recently used."""

  def __init__(self, size: int = 8):
    self.size, self._d = size, collections.OrderedDict()

  def get(self, key):
    if key in self._d:
      self._d.move_to_end(key)
    return self._d.get(key)

  def put(self, key, program) -> None:
    self._d[key] = program
    while len(self._d) > self.size:
      self._d.popitem(last=False)


def _avals(tree):
  return tuple((str(p), x.shape, str(x.dtype))
               for p, x in jax.tree_util.tree_flatten_with_path(tree)[0])


def run(plan_: Plan, params, rng=None, *, programs: Optional[Programs] = None) -> Decoded:
  """Runs `plan_` on `params`: compiled once (`compilation.compile_lowerable`, timed
  apart; with `programs`, reused from there when it holds the same program), then the
  jitted prefill + decode, timed to its tokens. rng: the sampler's key (default
  PRNGKey(0), which Greedy never reads). Never raises on non-finite logits: see
  `Decoded.finite` and `nonfinite_error`."""
  rng = jax.random.PRNGKey(0) if rng is None else rng
  prompt_BxP, lengths_B = plan_.padded()
  args = (params, prompt_BxP, lengths_B, rng)
  eos_id = plan_.eos_id
  key = (plan_.program_key(), _avals(params), _avals(rng))
  program = programs.get(key) if programs is not None else None
  compiled = None
  if program is None:
    compiled = compilation.compile_lowerable(
        decoding.generate, *args, eos_id=eos_id, config=plan_.config,
        precision=plan_.precision, sampler=plan_.sampler,
        max_new_tokens=plan_.max_new_tokens, return_logits=plan_.return_logits)
    program = compiled.program
    if programs is not None:
      programs.put(key, program)
  t0 = time.perf_counter()
  out = program(*args, eos_id=eos_id)
  tokens_BxM = np.asarray(jax.block_until_ready(out.tokens_BxM))
  seconds = time.perf_counter() - t0
  n = len(plan_.prompts)
  new, stopped = [], []
  for row in tokens_BxM[:n].tolist():
    stop = end_index(row, plan_.ends)
    new.append(row if stop is None else row[:stop + 1] if plan_.keep_end else row[:stop])
    stopped.append(stop is not None)
  return Decoded(new, stopped, np.asarray(out.finite_B)[:n].tolist(), int(out.steps),
                 seconds, compiled, out)


# ----------------------------------------------------------------------------- errors
def nonfinite_error(plan_: Plan, params, decoded: Decoded, *, what: str,
                    step: str = "at step {step}", advice: str = "") -> NonFiniteError:
  """The NonFiniteError of a run whose logits were not finite, for its first flagged
  prompt b: the first decode step k whose logits held NaN or Inf (from the program's
  logits when the plan kept them, else from a full forward pass of b's tokens), and the
  first model stage that is not finite in a forward pass of the tokens up to step k
  (`checkpoints.finite`). `what` names the logits ('the logits of the fp16 decode');
  `step` words the place ('{step}' and '{prompt}' filled in)."""
  config, precision = plan_.config, plan_.precision
  b = decoded.finite.index(False)
  prompt = list(plan_.prompts[b])
  row = np.asarray(decoded.out.tokens_BxM[b]).tolist()
  if decoded.out.logits_BxMxV is not None:
    logits_MxV = np.asarray(decoded.out.logits_BxMxV[b, :max(decoded.steps, 1)])
  else:
    seq = np.asarray([(prompt + row)[:config.max_seq_len]], np.int32)
    forward = full_logits((config, params), seq, precision=precision, check_finite=False)
    logits_MxV = np.asarray(forward[0, len(prompt) - 1:])   # row m chose new token m
  bad_M = ~np.isfinite(logits_MxV).all(-1)
  if bad_M.any():
    k = int(np.argmax(bad_M))
    kind = "NaN" if np.isnan(logits_MxV[k]).any() else "Inf"
    where = finite.Where(kind, step.format(step=k, prompt=b))
    seq = prompt + row[:k]                 # the logits of step k: its last position's
  else:
    where = finite.Where("", f"prompt {b}")
    seq = (prompt + row)[:config.max_seq_len]
  stage = finite.first_nonfinite_stage(config, params, np.asarray([seq]), precision)
  return finite.nonfinite_error(what, precision, where, stage, advice)

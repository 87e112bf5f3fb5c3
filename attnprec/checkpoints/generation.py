"""`checkpoints.generate`: text (or token ids) in, text and token ids out.

    from attnprec import checkpoints
    from attnprec.precision import REFERENCE
    ckpt = checkpoints.load("smollm2-135m")
    out = checkpoints.generate(ckpt, ["The capital of France is"], precision=REFERENCE,
                               max_new_tokens=16)
    out.texts[0], out.tokens[0]

Built on `serving.plan` and `serving.run` (one jitted prefill + decode loop,
`decoding.generate`, under the given `Precision`): prompts are right-padded to the longest
into one batch, and each sequence stops at the tokenizer's end token (the end token
itself is not returned).

Non-finite logits: `decoding.generate` flags each sequence whose tokens were chosen from
logits holding NaN or Inf (`finite_B`). By default (`check_finite=True`) `generate`
raises `attnprec.errors.NonFiniteError` if any sequence is flagged
(`serving.nonfinite_error`), naming the prompt, the first decode step whose logits were
not finite (when a full forward pass of the same tokens shows it) and the first model
stage whose output was not finite. With
`check_finite=False` it returns every sequence and `Generation.finite[b]` says which ones
are meaningful. Arguments are checked before anything is compiled (UserError naming the
argument, the bad value shortened, and what is valid).
"""
import numbers
from typing import List, NamedTuple, Optional, Sequence, Union

import jax
import numpy as np

from attnprec import checks, decoding
from attnprec.checkpoints import serving
from attnprec.checkpoints.forward import Checkpoint
from attnprec.errors import UserError, shorten
from attnprec.precision import Precision

Prompts = Union[str, Sequence[str], Sequence[Sequence[int]]]
_PROGRAMS = []       # [serving.Programs]: compiled once per shape, sampler and precision


def _programs():
  if not _PROGRAMS:                   # made on first use (`serving` imports this package)
    _PROGRAMS.append(serving.Programs(size=8))
  return _PROGRAMS[0]


class Generation(NamedTuple):
  texts: Optional[List[str]]   # the new text of each prompt (None without a tokenizer)
  tokens: List[List[int]]      # the new token ids of each prompt, before the end token
  stopped: List[bool]          # whether each prompt reached the end token
  finite: List[bool]           # whether every logits row that chose its tokens was finite
                               # (False: the tokens are meaningless; see check_finite)


def _token_prompts(ckpt, prompts: Prompts, chat: bool) -> List[List[int]]:
  """Texts (encoded with the checkpoint's tokenizer) or token lists -> token lists."""
  if isinstance(prompts, str):
    prompts = [prompts]
  prompts = list(prompts)
  if not prompts:
    raise UserError("generate needs at least one prompt (a text or a list of token ids).")
  if prompts and all(_is_int(p) for p in prompts):
    raise UserError(f"Invalid argument prompts={shorten(prompts)} of checkpoints.generate: "
                    f"a flat list of token ids; wrap one prompt in a list: [[id, id, ...]].")
  if all(isinstance(p, str) for p in prompts):
    tok = ckpt.tokenizer
    if tok is None:
      raise UserError(f"{ckpt.source} has no tokenizer, so text prompts cannot be "
                      f"encoded; pass token id lists instead.")
    if chat:
      return [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    return [tok.encode(p) for p in prompts]
  if chat:
    raise UserError("chat=True needs text prompts (the chat template renders text); got "
                    "token id lists.")
  out = []
  for k, p in enumerate(prompts):
    try:
      ids = np.asarray(p)
    except (ValueError, TypeError):
      ids = np.asarray([None], dtype=object)
    if not isinstance(p, (str, bytes)) and ids.ndim == 1 and ids.size == 0:
      raise UserError(f"Prompt {k} of checkpoints.generate is empty (no tokens); every "
                      f"prompt needs at least one token.")
    if (isinstance(p, (str, bytes)) or ids.ndim != 1 or ids.dtype == np.bool_
        or not np.issubdtype(ids.dtype, np.integer)):
      raise UserError(f"Invalid prompt {k} of checkpoints.generate: {shorten(p)}; a prompt "
                      f"must be a text or a list of integer token ids (texts and token lists "
                      f"cannot be mixed).")
    out.append([int(t) for t in ids])
  return out


def _is_int(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_arguments(ckpt, prompts, precision, max_new_tokens, sampler, rng, chat, eos_id,
                     check_finite):
  """Every argument of `generate`, before anything is compiled."""
  fn = "checkpoints.generate"
  if not isinstance(ckpt, Checkpoint):
    raise UserError(f"Invalid argument ckpt={shorten(ckpt)} of {fn}: must be a "
                    f"checkpoints.Checkpoint (from checkpoints.load).")
  if not isinstance(prompts, (str, list, tuple, np.ndarray)):
    raise UserError(f"Invalid argument prompts={shorten(prompts)} of {fn}: must be a text, "
                    f"a list of texts or a list of token id lists.")
  if not _is_int(max_new_tokens) or max_new_tokens < 1:
    raise UserError(f"max_new_tokens must be a positive integer, got "
                    f"{shorten(max_new_tokens)}.")
  if not isinstance(precision, Precision):
    raise UserError(f"Invalid argument precision={shorten(precision)} of {fn}: must be an "
                    f"attnprec.precision.Precision, e.g. Precision(dtype='bfloat16') or "
                    f"precision.REFERENCE.")
  if not isinstance(sampler, decoding.SAMPLERS):
    raise UserError(f"Invalid argument sampler={shorten(sampler)} of {fn}: must be one of "
                    f"decoding.Greedy(), Temperature(...), TopK(...), TopP(...) (an "
                    f"instance, not the class).")
  k = getattr(sampler, "k", None)
  if k is not None and k > ckpt.config.vocab_size:
    raise UserError(f"Invalid argument sampler={shorten(sampler)} of {fn}: TopK.k = {k} "
                    f"exceeds the model's vocabulary ({ckpt.config.vocab_size} tokens).")
  if rng is not None and isinstance(sampler, decoding.Greedy):
    raise UserError(f"Invalid argument rng={shorten(rng)} of {fn}: the sampler "
                    f"decoding.Greedy() draws no random numbers, so the key would not be "
                    f"read. Pass rng only with Temperature(...), TopK(...) or TopP(...), "
                    f"or leave it out.")
  if rng is not None:
    import jax.numpy as jnp
    ok = isinstance(rng, (jax.Array, np.ndarray)) and (
        jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ()
        or rng.dtype == np.uint32 and rng.shape == (2,))
    if not ok:
      raise UserError(f"Invalid argument rng={shorten(rng)} of {fn}: must be one key, "
                      f"jax.random.PRNGKey(seed) (or jax.random.key(seed)).")
  checks.check_argument(fn, "chat", chat, checks.boolean)
  checks.check_argument(fn, "check_finite", check_finite, checks.boolean)
  V = ckpt.config.vocab_size
  if eos_id is not None and (not _is_int(eos_id) or not (eos_id == -1 or 0 <= eos_id < V)):
    raise UserError(f"Invalid argument eos_id={shorten(eos_id)} of {fn}: must be a token id "
                    f"in [0, {V}) (the model's vocabulary), -1 (never stop early) or None "
                    f"(the tokenizer's end token).")


def generate(ckpt, prompts: Prompts, *, precision: Precision = Precision(),
             max_new_tokens: int = 32, sampler=decoding.Greedy(), rng=None,
             chat: bool = False, eos_id: Optional[int] = None,
             check_finite: bool = True) -> Generation:
  """Continues each prompt with up to `max_new_tokens` tokens.

  Args:
    ckpt: a `checkpoints.Checkpoint` (config, params, tokenizer).
    prompts: a text, a list of texts, or a list of token id lists.
    precision: the decode phase's numerics (e.g. `precision.REFERENCE`, the fp32
      reference, or `Precision(dtype="bfloat16")`).
    sampler: `decoding.Greedy()` (no rng needed), `Temperature`, `TopK`, `TopP`.
    rng: a `jax.random.PRNGKey`, required by every sampler but `Greedy`.
    chat: wrap each text prompt as one user message in the model's chat template.
    eos_id: the end token, in [0, vocab); default the tokenizer's (none, or -1: never
      stops early).
    check_finite: raise `attnprec.errors.NonFiniteError` if any sequence's tokens were
      chosen from logits holding NaN or Inf; False returns them, flagged in `finite`.

  Returns `Generation(texts, tokens, stopped, finite)`, one entry per prompt.
  """
  _check_arguments(ckpt, prompts, precision, max_new_tokens, sampler, rng, chat, eos_id,
                   check_finite)
  if rng is None:
    if not isinstance(sampler, decoding.Greedy):
      raise UserError(f"The sampler {sampler!r} draws random numbers: pass "
                      f"rng=jax.random.PRNGKey(seed). Only decoding.Greedy() needs none.")
    rng = jax.random.PRNGKey(0)               # never read by Greedy
  config = ckpt.config
  ids = _token_prompts(ckpt, prompts, chat)
  for k, p in enumerate(ids):
    if not p:
      raise UserError(f"Prompt {k} of checkpoints.generate is empty (no tokens); every "
                      f"prompt needs at least one token.")
    if min(p) < 0 or max(p) >= config.vocab_size:
      raise UserError(f"Token ids must lie in [0, {config.vocab_size}); a prompt holds "
                      f"{min(p)}..{max(p)}.")
  tok = ckpt.tokenizer
  if eos_id is None and tok is not None:
    eos_id = tok.eos_id
  plan = serving.plan(config, precision, ids, max_new_tokens=max_new_tokens, ends=eos_id,
                      bucket=False, keep_end=False, sampler=sampler)   # checks the context
  out = serving.run(plan, ckpt.params, rng, programs=_programs())
  if check_finite and not all(out.finite):
    raise serving.nonfinite_error(
        plan, ckpt.params, out,
        what=f"the logits of checkpoints.generate ({out.finite.count(False)} of "
             f"{len(out.finite)} sequences)",
        step="at decode step {step} of prompt {prompt}",
        advice=" Pass check_finite=False to get the tokens anyway (Generation.finite flags "
               "them).")
  texts = [tok.decode(t) for t in out.tokens] if tok is not None else None
  return Generation(texts, out.tokens, out.stopped, out.finite)

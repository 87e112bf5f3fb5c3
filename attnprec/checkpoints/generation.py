"""`checkpoints.generate`: text (or token ids) in, text and token ids out.

    from attnprec import checkpoints
    from attnprec.precision import REFERENCE
    ckpt = checkpoints.load("smollm2-135m")
    out = checkpoints.generate(ckpt, ["The capital of France is"], precision=REFERENCE,
                               max_new_tokens=16)
    out.texts[0], out.tokens[0]

Built on `decoding.pad_prompts` and `decoding.generate` (one jitted prefill + decode loop
under the given `Precision`): prompts are right-padded into one batch, and each sequence
stops at the tokenizer's end token (the end token itself is not returned).
"""
from typing import List, NamedTuple, Optional, Sequence, Union

import jax
import numpy as np

from attnprec import decoding
from attnprec.errors import UserError
from attnprec.precision import Precision

Prompts = Union[str, Sequence[str], Sequence[Sequence[int]]]


class Generation(NamedTuple):
  texts: Optional[List[str]]   # the new text of each prompt (None without a tokenizer)
  tokens: List[List[int]]      # the new token ids of each prompt, before the end token
  stopped: List[bool]          # whether each prompt reached the end token


def _token_prompts(ckpt, prompts: Prompts, chat: bool) -> List[List[int]]:
  """Texts (encoded with the checkpoint's tokenizer) or token lists -> token lists."""
  if isinstance(prompts, str):
    prompts = [prompts]
  prompts = list(prompts)
  if not prompts:
    raise UserError("generate needs at least one prompt (a text or a list of token ids).")
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
  for p in prompts:
    ids = np.asarray(p)
    if isinstance(p, str) or ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
      raise UserError(f"A prompt must be a text or a list of integer token ids, got "
                      f"{p!r:.80} (texts and token lists cannot be mixed).")
    out.append([int(t) for t in ids])
  return out


def generate(ckpt, prompts: Prompts, *, precision: Precision = Precision(),
             max_new_tokens: int = 32, sampler=decoding.Greedy(), rng=None,
             chat: bool = False, eos_id: Optional[int] = None) -> Generation:
  """Continues each prompt with up to `max_new_tokens` tokens.

  Args:
    ckpt: a `checkpoints.Checkpoint` (config, params, tokenizer).
    prompts: a text, a list of texts, or a list of token id lists.
    precision: the decode phase's numerics (e.g. `precision.REFERENCE`, the fp32
      reference, or `Precision(dtype="bfloat16")`).
    sampler: `decoding.Greedy()` (no rng needed), `Temperature`, `TopK`, `TopP`.
    rng: a `jax.random.PRNGKey`, required by every sampler but `Greedy`.
    chat: wrap each text prompt as one user message in the model's chat template.
    eos_id: the end token; default the tokenizer's (none: never stops early).

  Returns `Generation(texts, tokens, stopped)`, one entry per prompt.
  """
  if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) \
      or max_new_tokens < 1:
    raise UserError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
  if not isinstance(precision, Precision):
    raise UserError(f"precision must be an attnprec.precision.Precision, got "
                    f"{precision!r:.80}.")
  if rng is None:
    if not isinstance(sampler, decoding.Greedy):
      raise UserError(f"The sampler {sampler!r} draws random numbers: pass "
                      f"rng=jax.random.PRNGKey(seed). Only decoding.Greedy() needs none.")
    rng = jax.random.PRNGKey(0)               # never read by Greedy
  config = ckpt.config
  ids = _token_prompts(ckpt, prompts, chat)
  for p in ids:
    if p and (min(p) < 0 or max(p) >= config.vocab_size):
      raise UserError(f"Token ids must lie in [0, {config.vocab_size}); a prompt holds "
                      f"{min(p)}..{max(p)}.")
  longest = max(len(p) for p in ids)
  if longest + max_new_tokens > config.max_seq_len:
    raise UserError(f"The longest prompt ({longest} tokens) + max_new_tokens "
                    f"({max_new_tokens}) exceed the model's context ({config.max_seq_len} "
                    f"tokens).")
  tok = ckpt.tokenizer
  if eos_id is None and tok is not None:
    eos_id = tok.eos_id
  eos = -1 if eos_id is None else int(eos_id)
  prompt_BxP, lengths_B = decoding.pad_prompts(ids)
  tokens_BxM, _, *_ = decoding.generate(ckpt.params, prompt_BxP, lengths_B, rng, config=config,
                                    precision=precision, sampler=sampler,
                                    max_new_tokens=max_new_tokens, eos_id=eos)
  new, stopped = [], []
  for row in np.asarray(tokens_BxM).tolist():
    stop = eos in row
    new.append(row[:row.index(eos)] if stop else row)
    stopped.append(stop)
  texts = [tok.decode(t) for t in new] if tok is not None else None
  return Generation(texts, new, stopped)

"""Long-context key-value retrieval: the task itself (items and their tokens), no model.

A synthetic task generated from a seed, nothing downloaded, in the format of the
key-value retrieval of Liu et al. 2023 ("Lost in the Middle"): an instruction line, a JSON
object of random UUID keys -> UUID values, then a question asking for one key's value,
as raw text (no chat template) led by `first_token` ('endoftext': the tokenizer's
BOS id, `<|endoftext|>` for Qwen2.5-Coder, the leading token whose large logits offset
made the 0.5B's bf16 error 14x larger, see docs/study.md; 'none': the text alone):

    <|endoftext|>Extract the value corresponding to the specified key in the JSON object below.

    JSON data:
    {
     "0c6c2c0e-...": "9f4d1b8a-...",
     ...
    }

    Key: "<key>"
    Corresponding value: "<value>"

Prefix and questions. The instruction and the JSON object (through the blank line after
it) are the context's prefix; a context is asked several questions. The prefix's tokens
are encoded once and each question's tokens separately, so an item's token sequence is,
by construction, `prefix_ids + question_ids + value_ids + close_ids` whether it is run
whole or as the prefix's KV cache extended by the rest (same tokens, same positions): the
prefill of a prefix is reused exactly. `value_ids` are the value's tokens encoded on
their own and `close_ids` the closing quote's. `correct` looks at `value_ids` only: what
follows the value is reported apart and never scored, because the model ends the string
with whatever token its tokenizer merges there (Qwen2.5-Coder predicts `"\n\n`, one
token, after the value far more often than a bare `"`): the job records `close_ok` (the
bare quote token is the argmax) and `closed` (the argmax token's text starts with `"`).

Determinism. Every UUID is `uuid.UUID(int=rng.getrandbits(128), version=4)` from
`random.Random(f"{seed}:{length}:{context}:pairs")` (a str seed: the same on every
machine and Python run, independent of PYTHONHASHSEED); the asked keys come from a
second generator ("...:questions"). All keys and values of a context are distinct, so the
asked key occurs exactly once in the prompt.

Lengths. `length` is the target token count of a whole item (prefix + question + value
+ closing quote). The number of pairs N is the largest whose every item fits within
`length`, found from the measured tokens per pair and then checked against the actual
encoding, so an item is never longer than `length` and at most about one pair (~68
tokens for Qwen2.5-Coder) shorter: within 7% at 1k tokens, 1% at 8k.

Positions. A context with N pairs asks q = min(questions, N) distinct keys, one drawn
uniformly from each of q equal strata of the object, so the asked positions cover it
evenly; each item records its index, its relative position idx / (N - 1) in [0, 1] and
`where`: 'start' (relative position < 0.1), 'end' (> 0.9) or 'middle'. When N <
`questions` (short lengths), more contexts are drawn so that every length still has
`contexts * questions` items (the last context asks the remainder).
"""
import dataclasses
import json
import random
import uuid
from typing import List, Sequence, Tuple

from attnprec.errors import UserError

FIRST_TOKENS = ("endoftext", "none")
INSTRUCTION = ("Extract the value corresponding to the specified key in the JSON object "
               "below.")
FORMAT = "kv-uuid-v1"   # bump when the text format changes (results files record it)


@dataclasses.dataclass(frozen=True)
class Item:
  """One question about one context, with its tokens."""
  id: str                    # 'L4096/c3/q7'
  length: int                # the target length of the items of its context
  context: int
  question: int
  key: str
  value: str
  index: int                 # the asked pair's index in the object, 0..pairs-1
  pairs: int                 # pairs in the object
  relative: float            # index / (pairs - 1), in [0, 1]
  where: str                 # 'start' | 'middle' | 'end'
  question_ids: Tuple[int, ...]
  value_ids: Tuple[int, ...]
  close_ids: Tuple[int, ...]

  @property
  def suffix_ids(self) -> Tuple[int, ...]:
    """What follows the prefix: the question, the value, the closing quote."""
    return self.question_ids + self.value_ids + self.close_ids


@dataclasses.dataclass(frozen=True)
class Context:
  """An instruction + JSON object (the prefix) and the items asked about it."""
  length: int
  index: int
  pairs: Tuple[Tuple[str, str], ...]
  prefix_text: str
  prefix_ids: Tuple[int, ...]
  items: Tuple[Item, ...]

  def tokens(self, item: Item) -> List[int]:
    """The whole item, as the model reads it: prefix_ids + question + value + quote."""
    return list(self.prefix_ids) + list(item.suffix_ids)


def prefix_text(pairs: Sequence[Tuple[str, str]]) -> str:
  return f"{INSTRUCTION}\n\nJSON data:\n{json.dumps(dict(pairs), indent=1)}\n\n"


def question_text(key: str) -> str:
  return f'Key: "{key}"\nCorresponding value: "'


def where(index: int, pairs: int) -> str:
  """'start' when the relative position index / (pairs - 1) is below 0.1, 'end' when it
  is above 0.9, else 'middle' (symmetric at either end of the object)."""
  rel = index / (pairs - 1) if pairs > 1 else 0.0
  if rel < 0.1:
    return "start"
  if rel > 0.9:
    return "end"
  return "middle"


def lead_ids(tokenizer, first_token: str) -> List[int]:
  """The token ids an item starts with: [BOS] for 'endoftext', [] for 'none'."""
  if first_token not in FIRST_TOKENS:
    raise UserError(f"Invalid first_token {first_token!r:.200}; valid values are: "
                    f"{', '.join(repr(f) for f in FIRST_TOKENS)}.")
  if first_token == "none":
    return []
  if tokenizer.bos_id is None:
    raise UserError("first_token = 'endoftext' needs the tokenizer's BOS / <|endoftext|> "
                    "token, and this tokenizer has none; use first_token = 'none'.")
  return [int(tokenizer.bos_id)]


class _Pairs:
  """The context's (key, value) stream: the first n pairs never depend on how many were
  drawn, and every UUID of the stream is distinct."""

  def __init__(self, rng: random.Random):
    self.rng, self.pairs, self.seen = rng, [], set()

  def _uuid(self) -> str:
    while True:
      u = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
      if u not in self.seen:
        self.seen.add(u)
        return u

  def first(self, n: int) -> List[Tuple[str, str]]:
    while len(self.pairs) < n:
      self.pairs.append((self._uuid(), self._uuid()))
    return self.pairs[:n]


def _asked(seed_text: str, n_pairs: int, q: int) -> List[int]:
  """q distinct indices of 0..n_pairs-1, one uniformly from each of q equal strata."""
  rng = random.Random(seed_text)
  out = []
  for j in range(q):
    lo, hi = (j * n_pairs) // q, ((j + 1) * n_pairs) // q
    out.append(rng.randrange(lo, hi))
  return out


def _encode(tokenizer, text: str) -> Tuple[int, ...]:
  return tuple(int(i) for i in tokenizer.encode(text, add_bos=False))


def _build(tokenizer, lead, pairs, asked, *, length, ctx, q_offset=0):
  prefix = prefix_text(pairs)
  prefix_ids = tuple(lead) + _encode(tokenizer, prefix)
  close = _encode(tokenizer, '"')
  items = []
  for j, idx in enumerate(asked):
    key, value = pairs[idx]
    n = len(pairs)
    items.append(Item(
        id=f"L{length}/c{ctx}/q{j + q_offset}", length=length, context=ctx,
        question=j + q_offset, key=key, value=value, index=idx, pairs=n,
        relative=idx / (n - 1) if n > 1 else 0.0, where=where(idx, n),
        question_ids=_encode(tokenizer, question_text(key)),
        value_ids=_encode(tokenizer, value), close_ids=close))
  return prefix, prefix_ids, items


def _longest(prefix_ids, items) -> int:
  return len(prefix_ids) + max(len(i.suffix_ids) for i in items)


def make_context(tokenizer, *, length: int, index: int, questions: int, seed: int,
                 first_token: str = "endoftext") -> Context:
  """Context `index` of `length` with min(questions, pairs) items (see the module doc)."""
  lead = lead_ids(tokenizer, first_token)
  stream = _Pairs(random.Random(f"{seed}:{length}:{index}:pairs"))
  q_seed = f"{seed}:{length}:{index}:questions"

  def attempt(n):
    pairs = stream.first(n)
    asked = _asked(q_seed, n, min(questions, n))
    prefix, prefix_ids, items = _build(tokenizer, lead, pairs, asked, length=length,
                                       ctx=index)
    return (_longest(prefix_ids, items) <= length), (pairs, prefix, prefix_ids, items)

  fits, built = attempt(1)
  if not fits:
    raise UserError(f"Invalid retrieval length {length}: it cannot hold one key-value pair "
                    f"(the shortest item is {_longest(built[2], built[3])} tokens with "
                    f"this tokenizer); use lengths of at least "
                    f"{_longest(built[2], built[3])} tokens.")
  # Tokens per pair, measured on this context's own first pairs, gives the first guess.
  probe = min(8, max(1, length // 128))
  _, probe_built = attempt(probe)
  per_pair = max(1.0, (len(probe_built[2]) - len(built[2])) / max(probe - 1, 1))
  n = max(1, int((length - _longest(built[2], built[3])) / per_pair) + 1)
  fits, got = attempt(n)
  while fits:                            # grow while the next pair still fits
    more_fits, more = attempt(n + 1)
    if not more_fits:
      break
    n, got = n + 1, more
  while not fits:                        # shrink until it fits (n = 1 always does)
    n -= 1
    fits, got = attempt(n)
  pairs, prefix, prefix_ids, items = got
  return Context(length=length, index=index, pairs=tuple(pairs), prefix_text=prefix,
                 prefix_ids=prefix_ids, items=tuple(items))


def make_contexts(tokenizer, *, length: int, contexts: int, questions: int, seed: int,
                  first_token: str = "endoftext") -> List[Context]:
  """The contexts of one length: `contexts * questions` items in all (more contexts when
  one holds fewer than `questions` pairs; the last then asks only the remainder)."""
  for name, v in (("length", length), ("contexts", contexts), ("questions", questions)):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise UserError(f"Invalid retrieval {name} {v!r:.200}: must be an integer >= 1.")
  total, out = contexts * questions, []
  while sum(len(c.items) for c in out) < total:
    ctx = make_context(tokenizer, length=length, index=len(out), questions=questions,
                       seed=seed, first_token=first_token)
    left = total - sum(len(c.items) for c in out)
    if len(ctx.items) > left:
      ctx = dataclasses.replace(ctx, items=ctx.items[:left])
    out.append(ctx)
  return out


def score_positions(item: Item) -> Tuple[int, int]:
  """(first, stop): the suffix positions whose logits predict the value tokens, then the
  closing quote: position s predicts suffix token s + 1, so value token j is predicted at
  len(question) - 1 + j; the closing quote at len(question) + len(value) - 1."""
  first = len(item.question_ids) - 1
  return first, first + len(item.value_ids) + len(item.close_ids)


def judge(item: Item, argmax: Sequence[int], gold_logit: Sequence[float],
          best_other: Sequence[float]) -> dict:
  """Teacher-forced verdict from the per-position argmax / logits at the scored positions
  (`score_positions`, in order: the value tokens, then the closing quote).

  correct: every value token is the argmax at its position; by induction over the value's
  tokens, exactly when greedy decoding from prefix + question reproduces the value.
  close_ok: the closing quote is the argmax after the value too (reported, not scored).
  margin: min over the value tokens of (gold logit - best other logit): > 0 iff correct
  (up to ties, which argmax breaks toward the lower id)."""
  n = len(item.value_ids)
  gold = list(item.value_ids) + list(item.close_ids)
  argmax = [int(a) for a in argmax]
  margins = [float(g) - float(o) for g, o in zip(gold_logit, best_other)]
  return {"correct": all(a == g for a, g in zip(argmax[:n], gold[:n])),
          "close_ok": all(a == g for a, g in zip(argmax[n:], gold[n:])),
          "argmax": argmax[:n], "gold": gold[:n], "argmax_close": argmax[n:],
          "margin": min(margins[:n]), "first_wrong": next(
              (j for j, (a, g) in enumerate(zip(argmax[:n], gold[:n])) if a != g), None)}


def longest_item(contexts: Sequence[Context]) -> int:
  return max(_longest(c.prefix_ids, c.items) for c in contexts)


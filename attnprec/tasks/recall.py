"""Associative recall: the project's downstream eval in miniature.

A sequence lists P key -> value pairs, then asks for keys one after another; each answer
is the key's value. At evaluation the context is prefilled and the queries arrive one
token at a time, so every answer after the first is decoded by a single-token decode step
from the KV cache: the phase where the precision bug hid.

Token layout (vocabulary V = 2 + num_keys + value_vocab):
  0 PAD, 1 BOS, [2, 2 + num_keys) keys, then value tokens.
Training sequence: BOS, P x (key, v_1..v_L), Q x (key, v_1..v_L) with Q queries drawn
from the P keys; the loss covers the value tokens of the queries only.
Eval: prompt = BOS, P x (key, v_1..v_L), first query key; then the model decodes each
answer, and the next query key is fed after it (`decoding.decode_with_template`).
"""
import dataclasses

import gin
import numpy as np

from attnprec import checks
from attnprec.errors import UserError

PAD, BOS = 0, 1


@checks.validated("recall", num_keys=checks.at_least(1), value_vocab=checks.at_least(1),
                  value_len=checks.at_least(1), num_pairs=checks.at_least(1),
                  num_queries=checks.at_least(1))
@dataclasses.dataclass(frozen=True, kw_only=True)
class RecallTask:
  num_keys: int = 48         # distinct key tokens (>= the most pairs ever asked for)
  value_vocab: int = 64      # distinct value tokens (>= num_keys)
  value_len: int = 1         # tokens per value
  num_pairs: int = 16        # pairs per training sequence
  num_queries: int = 16      # queries per training sequence
  shared_vocab: bool = False  # keys and value tokens: all distinct, from one shared pool

  def __post_init__(self):
    if self.value_vocab < self.num_keys:
      raise UserError(f"recall.value_vocab={self.value_vocab} must be >= recall.num_keys="
                      f"{self.num_keys} (first value tokens are distinct per sequence).")
    if self.num_pairs > self.num_keys and not self.shared_vocab:
      raise UserError(f"recall.num_pairs={self.num_pairs} exceeds recall.num_keys="
                      f"{self.num_keys}: keys must be distinct within a sequence.")

  @property
  def max_pairs(self) -> int:
    """The most pairs one sequence can hold."""
    if self.shared_vocab:
      return (self.num_keys + self.value_vocab) // (1 + self.value_len)
    return self.num_keys

  @property
  def vocab_size(self) -> int:
    return 2 + self.num_keys + self.value_vocab

  def _pairs(self, rng: np.random.Generator, batch: int, num_pairs: int):
    if self.shared_vocab:
      return self._shared_pairs(rng, batch, num_pairs)
    if num_pairs > self.num_keys and not self.shared_vocab:
      raise UserError(f"{num_pairs} pairs need at least that many keys; recall.num_keys="
                      f"{self.num_keys}. Valid pair counts: 1..{self.num_keys}.")
    keys_BxP = np.stack([rng.choice(self.num_keys, num_pairs, replace=False)
                         for _ in range(batch)]) + 2
    # The first value token is distinct within a sequence (like the keys), so each later
    # value token is found by the same one-token lookup ("induction") as the first.
    first_BxPx1 = np.stack([rng.choice(self.value_vocab, num_pairs, replace=False)
                            for _ in range(batch)])[..., None]
    rest_BxPxR = rng.integers(0, self.value_vocab, (batch, num_pairs, self.value_len - 1))
    values_BxPxL = np.concatenate([first_BxPx1, rest_BxPxR], axis=-1) + (2 + self.num_keys)
    return keys_BxP, values_BxPxL

  def _shared_pairs(self, rng: np.random.Generator, batch: int, num_pairs: int):
    """Every key and value token of a sequence distinct, drawn from one pool: finding a
    value token's successor is then the same one-token lookup as finding a key's value."""
    pool = self.num_keys + self.value_vocab
    need = num_pairs * (1 + self.value_len)
    if need > pool:
      raise UserError(f"{num_pairs} pairs need {need} distinct symbols; the pool has {pool} "
                      f"(recall.num_keys + recall.value_vocab). Valid pair counts: "
                      f"1..{pool // (1 + self.value_len)}.")
    sym_BxPx1L = np.stack([rng.choice(pool, need, replace=False) for _ in range(batch)]
                          ).reshape(batch, num_pairs, 1 + self.value_len) + 2
    return sym_BxPx1L[..., 0], sym_BxPx1L[..., 1:]

  def _interleave(self, keys_BxP, values_BxPxL):
    return np.concatenate([keys_BxP[..., None], values_BxPxL], axis=-1).reshape(
        keys_BxP.shape[0], -1)

  def train_batch(self, rng: np.random.Generator, batch: int):
    """(tokens_BxT int32, loss_mask_BxT float32) where T = seq_len; targets = tokens[1:]."""
    keys_BxP, values_BxPxL = self._pairs(rng, batch, self.num_pairs)
    q_idx_BxQ = rng.integers(0, self.num_pairs, (batch, self.num_queries))
    qkeys_BxQ = np.take_along_axis(keys_BxP, q_idx_BxQ, axis=1)
    qvals_BxQxL = np.take_along_axis(values_BxPxL, q_idx_BxQ[..., None], axis=1)
    bos_Bx1 = np.full((batch, 1), BOS)
    context = self._interleave(keys_BxP, values_BxPxL)
    queries = self._interleave(qkeys_BxQ, qvals_BxQxL)
    tokens_BxT = np.concatenate([bos_Bx1, context, queries], axis=1).astype(np.int32)
    is_value_1xL1 = np.array([0] + [1] * self.value_len, np.float32)
    mask_queries = np.tile(is_value_1xL1, self.num_queries)[None].repeat(batch, 0)
    loss_mask_BxT = np.concatenate(
        [np.zeros((batch, 1 + context.shape[1]), np.float32), mask_queries], axis=1)
    return tokens_BxT, loss_mask_BxT

  @property
  def seq_len(self) -> int:
    return 1 + (self.num_pairs + self.num_queries) * (1 + self.value_len)

  def eval_episode(self, rng: np.random.Generator, batch: int, num_pairs: int,
                   num_queries: int):
    """One evaluation episode per row.

    Returns (prompt_BxP, template_BxM, answers_BxM): the prompt ends with the first
    query key; the template holds the later query keys and -1 where the model answers;
    answers holds the true token at every slot.
    """
    keys_BxP, values_BxPxL = self._pairs(rng, batch, num_pairs)
    q_idx_BxQ = rng.integers(0, num_pairs, (batch, num_queries))
    qkeys_BxQ = np.take_along_axis(keys_BxP, q_idx_BxQ, axis=1)
    qvals_BxQxL = np.take_along_axis(values_BxPxL, q_idx_BxQ[..., None], axis=1)
    context = self._interleave(keys_BxP, values_BxPxL)
    queries = self._interleave(qkeys_BxQ, qvals_BxQxL)      # k v.. k v..
    prompt = np.concatenate([np.full((batch, 1), BOS), context, queries[:, :1]], axis=1)
    answers = queries[:, 1:]
    is_answer = np.tile(np.array([0] + [1] * self.value_len), num_queries)[1:]
    template = np.where(is_answer[None].astype(bool), -1, answers)
    return prompt.astype(np.int32), template.astype(np.int32), answers.astype(np.int32)

  def context_len(self, num_pairs: int, num_queries: int) -> int:
    """Tokens in an evaluation episode: BOS, the pairs and the queries with answers."""
    return 1 + (num_pairs + num_queries) * (1 + self.value_len)


# gin root (`recall.num_pairs = 16`); wraps a copy, so RecallTask(...) in code reads no gin.
recall_task = gin.external_configurable(RecallTask, "recall")


def score(tokens_BxM, answers_BxM, answered_BxM) -> float:
  """Fraction of answered slots where the decoded token is the true value token."""
  answered_BxM = np.asarray(answered_BxM)
  correct = (np.asarray(tokens_BxM) == answers_BxM) & answered_BxM
  return float(correct.sum() / answered_BxM.sum())

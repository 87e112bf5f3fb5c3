"""Associative recall: the project's downstream eval in miniature.

A sequence lists P key -> value pairs, then asks for keys; the answer is the key's value.
Values are `value_len` tokens long, so answering exercises prefill (first value token)
AND single-token decode steps (the rest): the phase where the precision bug hid.

Token layout (vocabulary V = 2 + num_keys + value_vocab):
  0 PAD, 1 BOS, [2, 2 + num_keys) keys, then value tokens.
Training sequence: BOS, P x (key, v_1..v_L), Q x (key, v_1..v_L) with Q queries drawn
from the P keys; the loss covers the value tokens of the queries only.
Eval prompt: BOS, P x (key, v_1..v_L), key; the model must decode v_1..v_L.
"""
import dataclasses

import gin
import numpy as np

from attnprec.errors import UserError

PAD, BOS = 0, 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecallTask:
  num_keys: int = 48         # distinct key tokens (>= the most pairs ever asked for)
  value_vocab: int = 64      # distinct value tokens (>= num_keys)
  value_len: int = 2         # tokens per value (>= 2 exercises decode steps)
  num_pairs: int = 16        # pairs per training sequence
  num_queries: int = 16      # queries per training sequence

  def __post_init__(self):
    if self.value_vocab < self.num_keys:
      raise UserError(f"recall.value_vocab={self.value_vocab} must be >= recall.num_keys="
                      f"{self.num_keys} (first value tokens are distinct per sequence).")
    if self.num_pairs > self.num_keys:
      raise UserError(f"recall.num_pairs={self.num_pairs} exceeds recall.num_keys="
                      f"{self.num_keys}: keys must be distinct within a sequence.")

  @property
  def vocab_size(self) -> int:
    return 2 + self.num_keys + self.value_vocab

  def _pairs(self, rng: np.random.Generator, batch: int, num_pairs: int):
    if num_pairs > self.num_keys:
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

  def eval_prompts(self, rng: np.random.Generator, batch: int, num_pairs: int):
    """(prompt_BxP int32, answers_BxL int32) with the queried key last in each prompt."""
    keys_BxP, values_BxPxL = self._pairs(rng, batch, num_pairs)
    q_B = rng.integers(0, num_pairs, batch)
    context = self._interleave(keys_BxP, values_BxPxL)
    prompt = np.concatenate([np.full((batch, 1), BOS), context,
                             keys_BxP[np.arange(batch), q_B][:, None]], axis=1)
    return prompt.astype(np.int32), values_BxPxL[np.arange(batch), q_B].astype(np.int32)

  def prompt_len(self, num_pairs: int) -> int:
    return 2 + num_pairs * (1 + self.value_len)


# gin root (`recall.num_pairs = 16`); wraps a copy, so RecallTask(...) in code reads no gin.
recall_task = gin.external_configurable(RecallTask, "recall")


def score(decoded_BxL, answers_BxL) -> float:
  """Fraction of prompts whose whole value was decoded exactly."""
  decoded_BxL = np.asarray(decoded_BxL)[:, : answers_BxL.shape[1]]
  return float(np.mean(np.all(decoded_BxL == answers_BxL, axis=1)))

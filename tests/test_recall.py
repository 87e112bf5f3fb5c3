"""The recall task's data and the template decode used to evaluate it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import decoding
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.model import init_params, transformed
from attnprec.precision import Precision
from attnprec.tasks.recall import BOS, RecallTask, score


def test_train_batch_layout_and_answers():
  task = RecallTask(num_keys=8, value_vocab=8, num_pairs=4, num_queries=3)
  tokens, mask = task.train_batch(np.random.default_rng(0), 5)
  assert tokens.shape == mask.shape == (5, task.seq_len)
  assert (tokens[:, 0] == BOS).all()
  for row, m in zip(tokens, mask):
    pairs = dict(zip(row[1:9:2], row[2:9:2]))
    assert len(pairs) == 4                                 # keys distinct
    queries = row[9:]
    for k, v in zip(queries[0::2], queries[1::2]):
      assert pairs[k] == v                                 # every answer is right
    assert m.sum() == 3 and (m[9:][1::2] == 1).all()       # loss only on the answers


def test_eval_episode_template():
  task = RecallTask(num_keys=8, value_vocab=8, num_pairs=4)
  prompt, template, answers = task.eval_episode(np.random.default_rng(1), 2, 4, 3)
  assert prompt.shape == (2, 1 + 8 + 1) and template.shape == answers.shape == (2, 5)
  assert (template[:, 0::2] == -1).all()                   # answers to fill
  assert (template[:, 1::2] == answers[:, 1::2]).all()     # later query keys are given
  assert task.context_len(4, 3) == prompt.shape[1] + template.shape[1]


def test_score_counts_only_answer_slots():
  answers = np.array([[5, 2, 6]])
  answered = np.array([[True, False, True]])
  assert score(np.array([[5, 9, 0]]), answers, answered) == 0.5


def test_bad_pair_counts():
  with pytest.raises(UserError, match="exceeds recall.num_keys"):
    RecallTask(num_keys=4, value_vocab=4, num_pairs=5)
  task = RecallTask(num_keys=4, value_vocab=4, num_pairs=2)
  with pytest.raises(UserError, match="Valid pair counts: 1..4"):
    task.eval_episode(np.random.default_rng(0), 1, 9, 1)


def test_template_decode_equals_step_by_step_full_forward():
  """decode_with_template (cache) vs an independent loop of full forward passes."""
  config = ModelConfig(vocab_size=12, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_hidden=32)
  params = init_params(config, jax.random.PRNGKey(3))
  prompt = jnp.array([[1, 4, 5, 6]], jnp.int32)
  template = jnp.array([[-1, 7, -1, 3, -1]], jnp.int32)
  tokens, answered = decoding.decode_with_template(
      params, prompt, jnp.array([4]), template, config=config, precision=Precision(),
      cache_length=9)
  seq = [1, 4, 5, 6]
  # One program for every prefix: padded after its end, which a causal model's logits at
  # the positions before cannot see.
  full_T = 9
  forward = jax.jit(lambda p, t: transformed(config).apply(p, t, precision=Precision()).logits)
  for given in [-1, 7, -1, 3, -1]:
    if given >= 0:
      seq.append(given)
    else:
      padded = jnp.array([seq + [0] * (full_T - len(seq))])
      seq.append(int(jnp.argmax(forward(params, padded)[0, len(seq) - 1])))
  assert list(np.asarray(tokens[0])) == seq[4:]
  assert list(np.asarray(answered[0])) == [True, False, True, False, True]

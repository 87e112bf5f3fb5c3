"""Decoding with a KV cache equals the full forward pass; causality by gradients."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import decoding
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.model import init_params, transformed
from attnprec.precision import Precision

CONFIG = ModelConfig(vocab_size=17, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=64, qk_norm=True, sliding_window=4,
                     layer_pattern=("local", "global"), attn_logit_soft_cap=20.0,
                     post_attn_norm=True, post_mlp_norm=True)
PARAMS = init_params(CONFIG, jax.random.PRNGKey(0))
FP32 = Precision()


def _greedy_full_forward(prompt, steps):
  """Independent greedy loop: full forward pass over the whole sequence at every step."""
  apply = jax.jit(transformed(CONFIG).apply, static_argnames=("precision",))
  seq, logits = list(prompt), []
  for _ in range(steps):
    out = apply(PARAMS, jnp.asarray([seq]), precision=FP32).logits[0, -1]
    logits.append(np.asarray(out))
    seq.append(int(np.argmax(out)))
  return seq[len(prompt):], np.stack(logits)


def test_cached_decode_equals_full_forward_batched_padded():
  prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 4], [5, 1, 9, 2]]   # lengths 7, 2, 4 (padded)
  tokens, lengths = decoding.pad_prompts(prompts)
  out, logits = decoding.generate(PARAMS, tokens, lengths, jax.random.PRNGKey(0),
                                  config=CONFIG, precision=FP32, max_new_tokens=8)
  chex.assert_shape(out, (3, 8))
  for b, prompt in enumerate(prompts):
    want_tokens, want_logits = _greedy_full_forward(prompt, 8)
    assert list(np.asarray(out[b])) == want_tokens
    # Same float32 math in a different order (cache vs full sequence).
    np.testing.assert_allclose(logits[b], want_logits, atol=2e-4, rtol=1e-4)


def test_causality_by_gradients():
  """d logits[t] / d input at s is zero for every s > t (untied, so the unembedding does
  not read the embedding table)."""
  config = ModelConfig(vocab_size=17, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_hidden=64, tie_embeddings=False)
  params = init_params(config, jax.random.PRNGKey(1))
  apply = transformed(config).apply
  T = 8
  tokens = jnp.arange(1, T + 1)[None]

  def logit(t, delta_TxD):
    p = dict(params)
    table = params["decoder/embed"]["embeddings"]
    p["decoder/embed"] = {"embeddings": table.at[tokens[0]].add(delta_TxD)}
    return apply(p, tokens, precision=FP32).logits[0, t].sum()

  for t in range(T):
    g_TxD = np.asarray(jax.grad(lambda d: logit(t, d))(jnp.zeros((T, 32))))
    assert np.abs(g_TxD[: t + 1]).max() > 0
    assert np.all(g_TxD[t + 1:] == 0), f"logits at {t} depend on a later position"


@pytest.mark.parametrize("sampler", [decoding.Greedy(), decoding.Temperature(0.7),
                                     decoding.TopK(3), decoding.TopP(0.8)])
def test_samplers_pick_allowed_tokens(sampler):
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05, 0.0]]).repeat(64, 0) + 1e-9)
  picks = np.asarray(jax.vmap(lambda r: sampler(logits, r))(
      jax.random.split(jax.random.PRNGKey(0), 50)))
  allowed = {decoding.Greedy: {0}, decoding.Temperature: {0, 1, 2, 3},
             decoding.TopK: {0, 1, 2}, decoding.TopP: {0, 1}}[type(sampler)]
  assert set(np.unique(picks)) <= allowed
  if not isinstance(sampler, decoding.Greedy):
    assert len(set(np.unique(picks))) > 1   # it does sample


def test_prompt_longer_than_cache_is_a_clear_error():
  tokens, lengths = decoding.pad_prompts([[1] * 10])
  with pytest.raises(UserError, match="Prompt of 10 tokens is longer than the KV cache"):
    decoding.generate(PARAMS, tokens, lengths, jax.random.PRNGKey(0), config=CONFIG,
                      precision=FP32, max_new_tokens=2, cache_length=8)

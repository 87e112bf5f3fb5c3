"""Decoding with a KV cache equals the full forward pass; causality by gradients."""
import dataclasses

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
PARAMS = jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.PRNGKey(0))
FP32 = Precision()


# One program for every prefix: a sequence is padded to this length after its end, which a
# causal model's logits at the positions before cannot see.
_FULL_T = 21
# The batched decodes below share one shape: 3 prompts padded to 9 tokens, 12 new tokens
# (padding after a prompt's end is what pad_prompts adds; the causal mask hides it).
_P, _M = 9, 12


def _padded(prompts):
  tokens, lengths = decoding.pad_prompts(prompts)
  tokens = np.pad(np.asarray(tokens), ((0, 0), (0, _P - tokens.shape[1])))
  return jnp.asarray(tokens), lengths
_full_forward = jax.jit(lambda params, tokens: transformed(CONFIG).apply(
    params, tokens, precision=FP32).logits)


def _greedy_full_forward(prompt, steps):
  """Independent greedy loop: full forward pass over the whole sequence at every step."""
  assert len(prompt) + steps <= _FULL_T
  seq, logits = list(prompt), []
  for _ in range(steps):
    padded = jnp.asarray([seq + [0] * (_FULL_T - len(seq))])
    out = np.asarray(_full_forward(PARAMS, padded))[0, len(seq) - 1]
    logits.append(out)
    seq.append(int(np.argmax(out)))
  return seq[len(prompt):], np.stack(logits)


def test_cached_decode_equals_full_forward_batched_padded():
  prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 4], [5, 1, 9, 2]]   # lengths 7, 2, 4 (padded to 9)
  tokens, lengths = _padded(prompts)
  out, logits, *_ = decoding.generate(PARAMS, tokens, lengths, jax.random.PRNGKey(0),
                                  config=CONFIG, precision=FP32, max_new_tokens=_M)
  chex.assert_shape(out, (3, _M))
  for b, prompt in enumerate(prompts):
    want_tokens, want_logits = _greedy_full_forward(prompt, _M)
    assert list(np.asarray(out[b])) == want_tokens
    # Same float32 math in a different order (cache vs full sequence).
    np.testing.assert_allclose(logits[b], want_logits, atol=2e-4, rtol=1e-4)


def test_causality_by_gradients():
  """d logits[t] / d input at s is zero for every s > t (untied, so the unembedding does
  not read the embedding table)."""
  config = ModelConfig(vocab_size=17, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_hidden=64, tie_embeddings=False)
  params = jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(1))
  apply = transformed(config).apply
  T = 8
  tokens = jnp.arange(1, T + 1)[None]

  def logits_T(delta_TxD):
    """The sum of each position's logits, the inputs' embeddings moved by delta."""
    p = dict(params)
    table = params["decoder/embed"]["embeddings"]
    p["decoder/embed"] = {"embeddings": table.at[tokens[0]].add(delta_TxD)}
    return apply(p, tokens, precision=FP32).logits[0].sum(-1)

  # d logits[t] / d delta for every t at once ([T, T, D]), in one program
  g_TxTxD = np.asarray(jax.jit(jax.jacrev(logits_T))(jnp.zeros((T, 32))))
  for t in range(T):
    g_TxD = g_TxTxD[t]
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


def test_a_nucleus_float32_rounds_to_nothing_still_keeps_the_top_token():
  """TopP with a p that float32 rounds to 0 (1e-45) is greedy: the top token is always
  kept (else no token was, every logit -inf, and token 0 was drawn); a temperature float32
  cannot hold is refused by its rule, naming the largest it takes."""
  logits = jnp.log(jnp.array([[0.05, 0.3, 0.5, 0.15]]).repeat(8, 0))
  picks = decoding.TopP(p=1e-45)(logits, jax.random.PRNGKey(0))
  assert set(np.asarray(picks).tolist()) == {2}
  for sampler in (decoding.TopK, decoding.TopP, decoding.Temperature):
    with pytest.raises(UserError, match=r"temperature.*1e\+308"):
      sampler(temperature=1e308)


def test_prompt_longer_than_cache_is_a_clear_error():
  tokens, lengths = decoding.pad_prompts([[1] * 10])
  with pytest.raises(UserError, match="Prompt of 10 tokens is longer than the KV cache"):
    decoding.generate(PARAMS, tokens, lengths, jax.random.PRNGKey(0), config=CONFIG,
                      precision=FP32, max_new_tokens=2, cache_length=8)


BF16_FLAGS = Precision(dtype="bfloat16", float32_qk_product=True, float32_logits=True)


def test_for_serving_carries_bf16_weight_values_in_float32():
  """On CPU with bf16 compute, `for_serving` rounds the weight matrices to bf16 values
  (held in float32: exactly representable, so casting them to bf16 loses nothing) and
  leaves norm scales and biases alone; float32 compute is untouched, and other backends
  store the matrices in bf16 instead (`stored_weights`)."""
  params, prec = decoding.for_serving(PARAMS, BF16_FLAGS, backend="cpu")
  assert prec.carrier_weights and not BF16_FLAGS.carrier_weights
  for (mod, name), x in ((k, v) for mod in params for k, v in
                         (((mod, n), a) for n, a in params[mod].items())):
    raw = PARAMS[mod][name]
    assert x.dtype == jnp.float32
    if name in ("w", "embeddings"):
      np.testing.assert_array_equal(x, raw.astype(jnp.bfloat16).astype(jnp.float32))
      assert not np.array_equal(x, raw)
    else:
      np.testing.assert_array_equal(x, raw)
  again, prec2 = decoding.for_serving(params, prec, backend="cpu")   # idempotent
  assert prec2 == prec
  jax.tree_util.tree_map(np.testing.assert_array_equal, again, params)
  assert decoding.for_serving(PARAMS, FP32, backend="cpu") == (PARAMS, FP32)
  stored, on_gpu = decoding.for_serving(PARAMS, BF16_FLAGS, backend="gpu")
  assert on_gpu == dataclasses.replace(BF16_FLAGS, stored_weights=True)
  assert stored["decoder/embed"]["embeddings"].dtype == jnp.bfloat16
  preset = Precision(dtype="bfloat16", matmul_precision="BF16_BF16_F32")
  assert decoding.for_serving(PARAMS, preset, backend="cpu") == (PARAMS, preset)


def test_carried_weights_compute_what_bf16_weights_compute():
  """The carried path (float32 dots on bf16 values) against the cast-at-use path (bf16
  dots), the same bf16 + flags decode: logits equal within bf16 rounding of the dense
  outputs (accumulation order may differ) and the same greedy tokens; and both against
  the float32 model, the independent reference: equally far from it."""
  prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 4], [5, 1, 9, 2]]
  tokens, lengths = _padded(prompts)     # the fp32 prefill is the early-stopping test's
  carried, prec = decoding.for_serving(PARAMS, BF16_FLAGS, backend="cpu")
  prefill = jax.jit(decoding.prefill, static_argnames=("config", "precision", "cache_length"))
  runs = {}
  for name, (p, pr) in {"cast": (PARAMS, BF16_FLAGS), "carried": (carried, prec),
                        "fp32": (PARAMS, FP32)}.items():
    runs[name] = np.asarray(prefill(p, tokens, lengths, config=CONFIG, precision=pr,
                                    cache_length=_P + _M).last_BxV)
  # bf16's spacing near logits of O(1) is 2^-8: a few ulps of the last dense rounding.
  np.testing.assert_allclose(runs["carried"], runs["cast"], atol=2e-2, rtol=2e-2)
  assert (runs["carried"].argmax(-1) == runs["cast"].argmax(-1)).all()
  err = {k: np.abs(runs[k] - runs["fp32"]).max() for k in ("cast", "carried")}
  assert 0 < err["carried"] < 2 * err["cast"] + 1e-3, err
  # generate applies for_serving itself: its first logits are the carried prefill's.
  _, logits, *_ = decoding.generate(PARAMS, tokens, lengths, jax.random.PRNGKey(0),
                                config=CONFIG, precision=BF16_FLAGS, max_new_tokens=4)
  np.testing.assert_allclose(logits[:, 0], runs["carried"], atol=1e-5, rtol=1e-5)


def _fixed_length_loop(prompt_BxP, lengths_B, steps, eos_id):
  """Independent reference: the old fixed-length decode (every step runs, a python loop of
  jitted single-token steps); a sequence ends when its last tokens match a row of end
  tokens (-1: any token) and then keeps emitting row 0's last token."""
  params, prec = decoding.for_serving(PARAMS, FP32)
  state = jax.jit(decoding.prefill, static_argnames=("config", "precision", "cache_length"))(
      params, prompt_BxP, lengths_B, config=CONFIG, precision=prec,
      cache_length=prompt_BxP.shape[1] + steps)
  step = jax.jit(decoding.decode_step, static_argnames=("config", "precision"))
  ends = np.asarray(eos_id)
  ends = ends.reshape(-1, 1) if ends.ndim < 2 else ends
  L = ends.shape[1]

  def ended(history):
    tail = ([-2] * L + history)[-L:]
    return any(all(e == -1 or e == t for e, t in zip(row, tail)) for row in ends.tolist())

  token_B = np.asarray(state.last_BxV).argmax(-1)
  hist = [[int(t)] for t in token_B]
  done_B = np.array([ended(h) for h in hist])
  out = [token_B]
  for _ in range(steps - 1):
    state = step(params, state, jnp.asarray(token_B, jnp.int32), config=CONFIG, precision=prec)
    token_B = np.where(done_B, ends[0, -1], np.asarray(state.last_BxV).argmax(-1))
    for h, t in zip(hist, token_B):
      h.append(int(t))
    done_B |= np.array([ended(h) for h in hist])
    out.append(token_B)
  return np.stack(out, 1)


def test_early_stopping_gives_the_fixed_length_loops_tokens():
  """The while loop stops once every sequence has ended, with the tokens of a loop that
  runs all max_new_tokens steps; `steps` says how many it ran. Every batch has one shape
  (_padded), so each form of end token compiles one program."""
  M = _M
  def run(prompts, eos=-1):
    tokens, lengths = _padded(prompts)
    out = decoding.generate(PARAMS, tokens, lengths, jax.random.PRNGKey(0), config=CONFIG,
                            precision=FP32, max_new_tokens=M, eos_id=eos)
    return tokens, lengths, out

  base = [1, 2, 3, 4, 5, 6, 7]
  first = [base, [3, 4], [5, 1, 9, 2]]                     # different continuations
  free0 = np.asarray(run(first)[2].tokens_BxM)[0].tolist()   # base's greedy continuation
  batches = [first,
             [base, base + free0[:1], base + free0[:2]]]   # shifted: they share tokens
  steps = []
  for prompts in batches:
    tokens, lengths, free = run(prompts)
    assert int(free.steps) == M              # without an end token every step runs
    free = np.asarray(free.tokens_BxM)
    # End tokens some sequences emit, and those every sequence emits before the last step.
    ends = {int(free[b, -4]) for b in range(len(prompts))}
    ends |= set.intersection(*(set(row[:M - 1].tolist()) for row in free))
    for eos in sorted(ends):
      _, _, out = run(prompts, eos)
      want = _fixed_length_loop(tokens, lengths, M, eos)
      np.testing.assert_array_equal(np.asarray(out.tokens_BxM), want)
      last_needed = max(int(np.argmax(r == eos)) if (r == eos).any() else M - 1
                        for r in want) + 1
      assert int(out.steps) == last_needed, (eos, int(out.steps), want)
      assert bool(np.asarray(out.finite_B).all())
      steps.append(int(out.steps))
  assert min(steps) < M, steps          # the case the while loop exists for was exercised
  # Several end tokens: any of them ends a sequence, which then repeats the first.
  prompts = batches[0]
  tokens, lengths, free = run(prompts)
  free = np.asarray(free.tokens_BxM)
  two = np.array([int(free[0, 5]), int(free[1, 3])], np.int32)
  _, _, out = run(prompts, two)
  np.testing.assert_array_equal(np.asarray(out.tokens_BxM),
                                _fixed_length_loop(tokens, lengths, M, two))
  # End sequences: a pair a sequence emits in a row, and a single token (-1 = any).
  pairs = np.array([[-1, int(free[2, 6])], [int(free[0, 2]), int(free[0, 3])]], np.int32)
  _, _, out = run(prompts, pairs)
  want = _fixed_length_loop(tokens, lengths, M, pairs)
  np.testing.assert_array_equal(np.asarray(out.tokens_BxM), want)
  assert (want[0, 4:] == pairs[0, -1]).all()       # row 0 ended on the pair, then repeats


def test_non_finite_logits_are_flagged_per_sequence():
  """A NaN in the weights reaches every logit: finite_B is False, and return_logits=False
  keeps no [B, M, V] buffer."""
  bad = jax.tree_util.tree_map(lambda x: x, PARAMS)
  name = next(m for m in bad if "mlp" in m)
  leaf = next(iter(bad[name]))
  bad[name] = dict(bad[name], **{leaf: bad[name][leaf].at[0, 0].set(jnp.nan)})
  tokens, lengths = decoding.pad_prompts([[1, 2, 3], [4, 5]])
  out = decoding.generate(bad, tokens, lengths, jax.random.PRNGKey(0), config=CONFIG,
                          precision=FP32, max_new_tokens=3, return_logits=False)
  assert out.logits_BxMxV is None
  assert not np.asarray(out.finite_B).any()
  good = decoding.generate(PARAMS, tokens, lengths, jax.random.PRNGKey(0), config=CONFIG,
                           precision=FP32, max_new_tokens=3, return_logits=False)
  assert np.asarray(good.finite_B).all()

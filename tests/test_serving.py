"""The generation front end (`attnprec.checkpoints.serving`): what a plan says (padding bucket, end
handling, serving precision, attention kernels, cache) is what the program it runs does."""
import jax
import numpy as np
import pytest

from attnprec import decoding, kernels
from attnprec.checkpoints import serving
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.inspect import inspect_lowered
from attnprec.model import init_params
from attnprec.precision import Precision

CONFIG = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=8, mlp_hidden=32, max_seq_len=1024)
PARAMS = init_params(CONFIG, jax.random.PRNGKey(0))
BF16 = Precision(dtype="bfloat16")


def _raw(plan, rng=None):
  """The same decode through `decoding.generate` itself (no plan, no runner)."""
  prompt_BxP, lengths_B = plan.padded()
  return decoding.generate(PARAMS, prompt_BxP, lengths_B,
                           jax.random.PRNGKey(0) if rng is None else rng,
                           config=CONFIG, precision=plan.precision, sampler=plan.sampler,
                           max_new_tokens=plan.max_new_tokens, eos_id=plan.eos_id,
                           return_logits=plan.return_logits)


def test_padding_bucket_batch_and_its_fallback():
  p = serving.plan(CONFIG, BF16, [[1] * 20, [2] * 5], max_new_tokens=4, batch=3)
  assert (p.padded_length, p.bucketed, p.cache_length, p.batch) == (32, True, 36, 3)
  prompt_BxP, lengths_B = p.padded()
  assert prompt_BxP.shape == (3, 32) and lengths_B.tolist() == [20, 5, 20]  # row 0 again
  assert prompt_BxP[2].tolist() == prompt_BxP[0].tolist()
  assert prompt_BxP[1].tolist() == [2] * 5 + [0] * 27
  assert p.padded_length == decoding.bucket_length(20)
  # unbucketed: the longest prompt
  q = serving.plan(CONFIG, BF16, [[1] * 20, [2] * 5], max_new_tokens=4, bucket=False)
  assert (q.padded_length, q.bucketed, q.cache_length) == (20, False, 24)
  # the bucket (768) + max_new_tokens would pass the context (1024): the longest prompt
  r = serving.plan(CONFIG, BF16, [[1] * 600], max_new_tokens=300)
  assert decoding.bucket_length(600) == 768
  assert (r.padded_length, r.bucketed, r.cache_length) == (600, False, 900)
  # one prompt that does not fit at all, or no room for a token: refused before compiling
  with pytest.raises(UserError, match=r"Prompt \(1000 tokens\) \+ generate_text.max_new_"
                                      r"tokens \(30\) exceed the model's context \(1024"):
    serving.plan(CONFIG, BF16, [[1] * 1000], max_new_tokens=30,
                 setting="generate_text.max_new_tokens")
  with pytest.raises(UserError, match=r"The longest prompt \(1000 tokens\)"):
    serving.plan(CONFIG, BF16, [[1], [1] * 1000], max_new_tokens=30)
  with pytest.raises(UserError, match="Empty prompt"):
    serving.plan(CONFIG, BF16, [[1], []], max_new_tokens=3)
  with pytest.raises(ValueError, match="1..2 prompts"):
    serving.plan(CONFIG, BF16, [[1]] * 3, max_new_tokens=3, batch=2)


def test_serving_precision_and_cache_are_the_programs():
  p = serving.plan(CONFIG, BF16, [[1, 2, 3]], max_new_tokens=5, backend="cpu")
  assert p.serving == decoding.for_serving(PARAMS, BF16, "cpu")[1]
  assert p.serving.carrier_weights and not p.precision.carrier_weights
  assert p.cache == serving.cache_line(CONFIG, p.serving, 37, batch=1)
  assert p.cache.startswith("KV cache: kv_cache=k:compute,v:compute, 1 x 37 positions")
  gpu = serving.plan(CONFIG, BF16, [[1, 2, 3]], max_new_tokens=5, backend="gpu")
  assert not gpu.serving.carrier_weights


@pytest.mark.parametrize("length,new,prefill,step", [
    (5, 4, "dot_product", "blockwise"),       # P 32, S 36: a decode step is blockwise
    (300, 4, "blockwise", "blockwise"),       # P 384 queries, S 388 keys
    (8, 500, "blockwise", "blockwise"),       # P 32, S 532 keys: both read the long cache
])
def test_resolved_kernels_are_what_the_program_runs(length, new, prefill, step):
  """kernel=auto: the plan's kernels are those the lowered `generate` holds, found by
  structure (`attnprec.inspect`: an online softmax is blockwise): the prefill's attention
  has the P queries, the decode step's one."""
  prec = Precision(dtype="bfloat16", kernel=kernels.AUTO)
  p = serving.plan(CONFIG, prec, [[1] * length], max_new_tokens=new)
  assert (p.prefill_kernel, p.step_kernel) == (prefill, step)
  assert p.kernel_line() == (
      f"attention kernel: prefill ({p.padded_length} tokens) {prefill}, decode steps (cache "
      f"of {p.cache_length}) {step} (kernel=auto on cpu: blockwise for decode steps, "
      f"blockwise from 256 queries or 512 keys)")
  prompt_BxP, lengths_B = p.padded()
  lowered = decoding.generate.lower(PARAMS, prompt_BxP, lengths_B, jax.random.PRNGKey(0),
                                    config=CONFIG, precision=p.precision, sampler=p.sampler,
                                    max_new_tokens=new, eos_id=p.eos_id,
                                    return_logits=False)
  found = inspect_lowered(lowered).attentions
  assert len(found) == 2 * CONFIG.num_layers
  ran = {}
  for a in found:
    phase = "prefill" if p.padded_length in a.qk.result_shape else "step"
    ran.setdefault(phase, set()).add("blockwise" if a.online else "dot_product")
  assert ran == {"prefill": {prefill}, "step": {step}}


def test_end_handling_cuts_what_generate_returns():
  prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
  free = serving.run(serving.plan(CONFIG, BF16, prompts, max_new_tokens=8), PARAMS)
  assert free.stopped == [False] * 3 and all(len(t) == 8 for t in free.tokens)
  first = free.tokens[0]
  end = first[2]                                  # row 0 ends at its third token
  for keep in (True, False):
    p = serving.plan(CONFIG, BF16, prompts, max_new_tokens=8, ends=end, keep_end=keep)
    assert p.ends == ((end,),) and p.eos_id == end   # one end token: generate's int form
    out = serving.run(p, PARAMS)
    raw = np.asarray(_raw(p).tokens_BxM).tolist()
    assert np.asarray(out.out.tokens_BxM).tolist() == raw     # the program's own tokens
    for row, got, stopped in zip(raw, out.tokens, out.stopped):
      cut = row.index(end) if end in row else None
      assert stopped == (cut is not None)
      want = row if cut is None else row[:cut + 1] if keep else row[:cut]
      assert got == want
    assert out.stopped[0]                       # greedy: row 0 reaches `end` again
  for none in (None, -1):
    p = serving.plan(CONFIG, BF16, prompts, max_new_tokens=8, ends=none)
    assert p.ends == () and p.eos_id == -1
  # [E, L] end rows (-1: any token): the pair (first[1], first[2]) ends row 0
  rows = [[first[1], first[2]], [-1, 31]]
  p = serving.plan(CONFIG, BF16, prompts, max_new_tokens=8, ends=rows)
  assert p.ends == tuple(map(tuple, rows)) and np.asarray(p.eos_id).shape == (2, 2)
  out = serving.run(p, PARAMS)
  cut = serving.end_index(first, p.ends)
  assert cut is not None and cut <= 2
  assert out.tokens[0] == first[:cut + 1] and out.stopped[0]
  ends = ((3, 4), (-1, 31))
  assert serving.end_index([7, 3, 4, 3, 4], ends) == 2
  assert serving.end_index([7, 31], ends) == 1 and serving.end_index([3, 5, 4], ends) is None
  assert serving.end_index([1, 2], ()) is None


def test_run_matches_generate_and_reuses_programs():
  """Bit-identical to `decoding.generate` called directly (a sampler with its rng, batch
  rows beyond the prompts dropped); a `Programs` store compiles each program once."""
  p = serving.plan(CONFIG, BF16, [[3, 1, 4], [1, 5]], max_new_tokens=6, batch=4,
                   sampler=decoding.TopK(k=4), return_logits=True)
  rng = jax.random.PRNGKey(7)
  store = serving.Programs(size=2)
  out = serving.run(p, PARAMS, rng, programs=store)
  want = _raw(p, rng)
  np.testing.assert_array_equal(np.asarray(out.out.tokens_BxM), np.asarray(want.tokens_BxM))
  np.testing.assert_array_equal(np.asarray(out.out.logits_BxMxV),
                                np.asarray(want.logits_BxMxV))
  assert out.tokens == np.asarray(want.tokens_BxM)[:2].tolist() and len(out.finite) == 2
  assert out.compiled is not None and out.compile_seconds > 0
  other = serving.plan(CONFIG, BF16, [[2, 7, 1, 8]], max_new_tokens=6, batch=4,
                       sampler=decoding.TopK(k=4), return_logits=True)
  again = serving.run(other, PARAMS, rng, programs=store)   # same bucket, batch: reused
  assert again.compiled is None and again.compile_seconds == 0.0
  assert np.asarray(again.out.tokens_BxM).tolist() == np.asarray(
      _raw(other, rng).tokens_BxM).tolist()

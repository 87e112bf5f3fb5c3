"""`train.remat`: what the backward pass recomputes ('none', 'attention', 'block'), and
`train.loss_chunk`: the loss's unembedding a chunk of tokens at a time.

Recomputation runs the same forward program: float32 gradients are bit for bit those
without remat, bf16 ones within one bf16 rounding of them (the recomputed forward lands
in other fusions, so gradient sums may round in another order), and the lowered program
has no dot of a kind the one without remat lacks (operand and result types, precision).
What it buys is memory: the compiled train step's temporaries shrink from 'none' to
'attention' to 'block' (XLA:CPU's memory analysis, scanned layers: the form the large
models train in). A chunked loss computes the same per-token products: the loss and
gradients within float32 sums in another order, its compiled step smaller."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import train
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.model import REMAT, init_params, transformed
from attnprec.precision import Precision

T = 64    # long enough that the attention's [T, S] logits matter


def _config(scan: bool) -> ModelConfig:
  return ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=64, max_seq_len=T + 1, scan_layers=scan)


def _grad_fn(config, dtype, remat, loss_chunk=0, aux=False):
  """The loss's gradient under `remat`, jitted, dense kernel (its logits are kept)."""
  prec = Precision(dtype=dtype, kernel="dot_product")
  def loss(p, t, m):
    value, metrics = train.loss_fn(p, t, m, config=config, precision=prec, remat=remat,
                                   loss_chunk=loss_chunk)
    return (value, metrics) if aux else value
  return jax.jit(jax.grad(loss, has_aux=aux))


def _batch():
  tokens = np.random.default_rng(0).integers(0, 64, (2, T + 1))
  return jnp.asarray(tokens, jnp.int32), jnp.ones((2, T + 1), jnp.float32)


def _dot_kinds(text: str) -> set:
  """(operand and result element types, precision) of every dot_general in StableHLO."""
  kinds = set()
  for line in text.splitlines():
    if "stablehlo.dot_general" not in line:
      continue
    sig = line.rsplit(" : ", 1)[1]
    types = tuple(re.findall(r"x([a-z]+\d*)>", sig))
    prec = re.search(r"precision = \[([^\]]*)\]", line)
    kinds.add((types, prec.group(1) if prec else ""))
  return kinds


@pytest.mark.parametrize("scan,dtype", [(False, "float32"), (True, "bfloat16")],
                         ids=["unrolled-float32", "scanned-bfloat16"])
def test_remat_recomputes_the_same_numbers_in_less_memory(scan, dtype):
  config = _config(scan)
  params = init_params(config, jax.random.PRNGKey(0))
  args = (params,) + _batch()
  programs = {r: _grad_fn(config, dtype, r).lower(*args) for r in REMAT}
  kinds = {r: _dot_kinds(p.as_text()) for r, p in programs.items()}
  compiled = {r: p.compile() for r, p in programs.items()}
  assert kinds["none"], "no dot_general read: the comparison below would check nothing"
  want = jax.tree.leaves(compiled["none"](*args))
  for remat in ("attention", "block"):
    assert kinds[remat] == kinds["none"], remat
    for g, w in zip(jax.tree.leaves(compiled[remat](*args)), want):
      if dtype == "float32":
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
      else:   # float32 sums of bf16 products, in other fusions: one bf16 rounding
        scale = float(np.abs(np.asarray(w)).max())
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0,
                                   atol=2.0 ** -8 * max(scale, 1e-30))
  if scan and jax.default_backend() == "cpu":
    # A TPU's analysis of a program this small reports no temporaries at all (0 for each,
    # measured on a v5e); there the memory is measured at Qwen2.5-0.5B's size instead
    # (`make device-check ARGS=--parts=train`, results/tpu-device-check).
    temp = {r: c.memory_analysis().temp_size_in_bytes for r, c in compiled.items()}
    assert temp["block"] < temp["attention"] < temp["none"], temp


def test_a_remat_choice_that_is_not_one_is_refused():
  with pytest.raises(UserError, match=r"train.remat = 'blocks'.*'none', 'attention', 'block'"):
    transformed(_config(False), "blocks")


def test_a_chunked_loss_is_the_same_loss_in_less_memory():
  """Chunks of 48 of the batch's tokens (chunks that cross from one sequence into the
  next; the last one padded), float32, against the whole loss:
  the same per-token products, so the loss and gradients agree within float32 sums in
  another order (3 chunks: a few float32 ulps of the largest term; bound 1e-5 relative
  to each gradient's largest entry), accuracy exactly."""
  config = dataclasses.replace(_config(True), vocab_size=1024)   # tied, as Qwen2.5-0.5B
  params = init_params(config, jax.random.PRNGKey(0))
  tokens, mask = _batch()
  mask = mask.at[1, -7:].set(0.0)      # a masked tail: counted by neither form
  args = (params, tokens, mask)
  whole, chunked = (_grad_fn(config, "float32", "none", c, aux=True)
                    .lower(*args).compile() for c in (0, 48))
  # a chunk longer than the sequence is one chunk, not a padded array of 2^31 tokens
  # (the forward pass alone: that is where the chunks are cut)
  huge = jax.jit(functools.partial(train.loss_fn, config=config, loss_chunk=2 ** 31 - 1,
                                   precision=Precision(dtype="float32", kernel="dot_product")))
  np.testing.assert_allclose(float(huge(*args)[1]["loss"]), float(whole(*args)[1]["loss"]),
                             rtol=1e-6)
  (g0, m0), (g1, m1) = whole(*args), chunked(*args)
  np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]), rtol=1e-6)
  assert float(m1["accuracy"]) == float(m0["accuracy"])
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    scale = float(np.abs(np.asarray(b)).max())
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale)
  if jax.default_backend() == "cpu":   # see above: the TPU's is measured at full size
    assert (chunked.memory_analysis().temp_size_in_bytes
            < whole.memory_analysis().temp_size_in_bytes)


def test_the_chunked_loss_unembeds_with_the_models_own_matrix():
  """`model.unembedding`: the tied embedding's transpose, or the untied head (the
  chunked loss's numbers are tested above, tied)."""
  from attnprec.model import unembedding
  for tied in (True, False):
    config = dataclasses.replace(_config(False), tie_embeddings=tied)
    params = init_params(config, jax.random.PRNGKey(0))
    want = params["decoder/embed"]["embeddings"].T if tied else params["decoder/unembed"]["w"]
    np.testing.assert_array_equal(np.asarray(unembedding(params, config)), np.asarray(want))
    assert want.shape == (config.d_model, config.vocab_size)

"""model.scan_layers: the blocks as one lax.scan over stacked params, the same numbers.

The reference is an independent program: the unrolled model (one Block per layer, its own
params), on the same weights converted with `layout.unstack`; float32 on CPU, compared bit
for bit (`np.testing.assert_array_equal`), prefill, decode steps through the cache, and a
train step's loss and gradients. On a TPU (`make test-tpu`) the prefill and decode steps
are equal bit for bit too; the train step's gradients are not (the two programs tile the
gradient dots differently: 'highest' is six bf16 passes summed in float32, in another
order), and are compared within the bound of a reordered float32 sum (`_reordered`).
"""
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gin
from jax.sharding import PartitionSpec as P

from attnprec import checkpoints, decoding, layout, platforms, sharding, train
from attnprec import model as model_lib
from attnprec.cache import (KVCache, StackedKVCache, init_cache, stack_cache,
                            unstack_cache)
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import Precision
from attnprec.inspect.report import compiled_text  # noqa: E402

# qkv_bias: the 'bias' key offset reads each layer's own key bias inside the scan.
UNROLLED = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=4, mlp_hidden=32, qkv_bias=True, max_seq_len=64)
SCANNED = dataclasses.replace(UNROLLED, scan_layers=True)
F32 = Precision(dtype="float32", matmul_precision="highest", einsum_precision="highest")
BIAS_INT8 = dataclasses.replace(F32, key_offset="bias", kv_cache_k_dtype="int8",
                                kv_cache_v_dtype="int8", kv_cache_k_scale="channel",
                                kv_cache_v_scale="token")


@pytest.fixture(scope="module")
def params():
  """Unrolled params (random normal values, distinct per tensor and layer: a non-zero
  key bias in every layer), and the same values stacked."""
  rng = np.random.default_rng(0)
  p = {m: {n: jnp.asarray(rng.normal(0, 0.3, s.shape), jnp.float32) for n, s in g.items()}
       for m, g in model_lib.param_shapes(UNROLLED).items()}
  return p, layout.stack(p, UNROLLED.num_layers)


def _greedy(config, p, precision, steps: int, inspect=None):
  """(the logits of a prefill of two prompts (lengths 5 and 3) and `steps` greedy decode
  steps, stacked; the final cache). inspect(step, p, state, token): called before each
  step with the step's function and arguments."""
  prompt_BxP = jnp.array([[3, 5, 7, 9, 2], [4, 4, 1, 0, 0]], jnp.int32)
  state = jax.jit(lambda p, t, n: decoding.prefill(
      p, t, n, config=config, precision=precision, cache_length=8))(
          p, prompt_BxP, jnp.array([5, 3], jnp.int32))
  step = lambda p, s, t: decoding.decode_step(p, s, t, config=config,  # noqa: E731
                                              precision=precision)
  jitted, logits = jax.jit(step), [state.last_BxV]
  for _ in range(steps):
    token = jnp.argmax(state.last_BxV, -1).astype(jnp.int32)
    if inspect is not None:
      inspect(step, p, state, token)
    state = jitted(p, state, token)
    logits.append(state.last_BxV)
  return np.stack(logits), state.cache


def _equal(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)


def _reordered(a, b, n: int):
  """Each leaf of `a` within the bound of a float32 sum of `n` terms summed in another
  order: |a - b| <= 2 gamma_n sum|terms|, gamma_n = n u / (1 - n u), u = 2^-24, taking
  sum|terms| <= n max|b| (no term larger than the leaf's largest element, which holds for
  these random weights with no large cancelling terms: a stated assumption, not a proof).
  The same structure, and equal bit for bit where the platform keeps the order (XLA:CPU)."""
  u = 2.0 ** -24
  gamma = n * u / (1 - n * u)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    np.testing.assert_array_less(np.abs(x - y), 2 * gamma * n * np.abs(y).max() + 1e-300)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)


def test_params_convert_both_ways_exactly(params):
  unrolled, stacked = params
  assert layout.is_stacked(stacked) and not layout.is_stacked(unrolled)
  assert (jax.tree_util.tree_map(np.shape, stacked) ==
          jax.tree_util.tree_map(lambda s: s.shape, model_lib.param_shapes(SCANNED)))
  assert layout.shapes(SCANNED) == jax.tree_util.tree_map(np.shape, stacked)
  _equal(layout.unstack(stacked), unrolled)
  _equal(layout.as_layout(unrolled, SCANNED), stacked)
  _equal(layout.as_layout(stacked, UNROLLED), unrolled)
  host = jax.tree_util.tree_map(np.asarray, unrolled)       # numpy in, numpy out
  assert all(isinstance(x, np.ndarray)
             for x in jax.tree_util.tree_leaves(layout.stack(host, 2)))
  # the sharding role and the 'matrix' reading see through the stack
  assert layout.role(f"{layout.STACKED}/attn/q", "w") == "columns"
  assert layout.read_as_matrix(f"{layout.STACKED}/mlp/down", "w")
  mesh = jax.make_mesh((1, 1), sharding.AXES)   # the layer axis stays whole
  assert sharding.param_spec(f"{layout.STACKED}/attn/q", "w", SCANNED, mesh) == \
      P(None, None, "model")
  assert sharding.param_spec(f"{layout.STACKED}/mlp/down", "w", SCANNED, mesh) == \
      P(None, "model", None)
  missing = {m: g for m, g in unrolled.items() if not m.startswith("decoder/layer_1/")}
  with pytest.raises(UserError, match="layer"):
    layout.stack(missing, 2)


def test_prefill_and_decode_steps_equal_the_unrolled_model(params):
  """Under the 'bias' key offset each layer's offset comes from its own key bias, a slice
  of the stacked params inside the scan, and is stored in the cache; the cache holds int8
  codes with per-channel key scales (fixed by the prefill) and per-token value scales:
  every leaf of the stacked cache is written through the scan's per-layer view."""
  unrolled, stacked = params
  run = {c.scan_layers: _greedy(c, p, BIAS_INT8, steps=3)
         for c, p in ((UNROLLED, unrolled), (SCANNED, stacked))}
  assert isinstance(run[True][1], StackedKVCache) and isinstance(run[False][1], KVCache)
  np.testing.assert_array_equal(run[True][0], run[False][0])
  _equal(unstack_cache(run[True][1]), run[False][1])      # the key offset's entries too
  c_LxBxKxH = run[True][1].stack.key_offset["bias"]
  assert not np.array_equal(c_LxBxKxH[0], c_LxBxKxH[1])  # per-layer vectors
  _equal(stack_cache(run[False][1]), run[True][1])


def test_a_train_step_equals_the_unrolled_model(params):
  """The full forward (no cache, key offset 'none'): the loss and every gradient."""
  unrolled, stacked = params
  tokens_BxT = jax.random.randint(jax.random.PRNGKey(2), (2, 6), 0, 32)
  mask_BxT = jnp.ones((2, 6), jnp.float32)
  out = {}
  for config, p in ((UNROLLED, unrolled), (SCANNED, stacked)):
    grads, metrics = jax.jit(jax.grad(lambda p, c=config: train.loss_fn(
        p, tokens_BxT, mask_BxT, config=c, precision=F32), has_aux=True))(p)
    out[config.scan_layers] = (metrics["loss"], grads)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(out[True][0], out[False][0])
    _equal(layout.unstack(out[True][1]), out[False][1])
  else:     # the longest sum any gradient element takes: the vocabulary, mlp_hidden or B x T
    n = max(UNROLLED.vocab_size, UNROLLED.mlp_hidden, tokens_BxT.size)
    _reordered(out[True][0], out[False][0], n)
    _reordered(layout.unstack(out[True][1]), out[False][1], n)


def test_scan_layers_refuses_what_it_cannot_do(params):
  with pytest.raises(UserError, match="layer_pattern"):
    ModelConfig(vocab_size=32, d_model=16, num_layers=4, num_heads=2, num_kv_heads=1,
                head_dim=8, mlp_hidden=32, layer_pattern=("local", "global"),
                sliding_window=4, scan_layers=True)
  # one kind only (all local) is fine: one mask serves every layer
  ModelConfig(vocab_size=32, d_model=16, num_layers=4, num_heads=2, num_kv_heads=1,
              head_dim=8, mlp_hidden=32, layer_pattern=("local",), sliding_window=4,
              scan_layers=True)
  # the study's probes need one kernel call per layer
  from attnprec.study import probes
  unrolled, stacked = params
  tokens_BxT = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(UserError, match="scan_layers"):
    with probes.attached(stacked):
      model_lib.transformed(SCANNED).apply(stacked, tokens_BxT, precision=F32)
  # a cache of the other form
  with pytest.raises(UserError, match="stacked KV cache"):
    model_lib.transformed(SCANNED).apply(stacked, tokens_BxT, None,
                                         init_cache(UNROLLED, 1, 8, jnp.float32),
                                         precision=F32)


def test_the_loader_gives_a_checkpoint_the_bound_layout():
  """--gin.model.scan_layers=True with a checkpoint written unrolled (the shipped recall
  model): the config says so and the params come stacked, the same values."""
  plain = checkpoints.load("recall-tiny")
  gin.parse_config("model.scan_layers = True")
  scanned = checkpoints.load("recall-tiny")
  assert scanned.config == dataclasses.replace(plain.config, scan_layers=True)
  assert layout.is_stacked(scanned.params) and not layout.is_stacked(plain.params)
  assert (jax.tree_util.tree_map(np.shape, scanned.params) ==
          jax.tree_util.tree_map(lambda s: s.shape, model_lib.param_shapes(scanned.config)))
  _equal(layout.unstack(scanned.params), plain.params)


@pytest.mark.parametrize("bf16_dots", [True, False])
def test_the_audit_finds_one_scanned_attention_per_program(bf16_dots, monkeypatch):
  """The lowered programs of a scanned model: one attention in the scan's body, attributed
  to every layer, its dots checked against the contract (bf16 compute, both flags), and
  each dense dot named by the module whose stacked params it reads. On a CPU without bf16
  dots (a TPU machine's host: `make test-tpu` found it) the gate and up projections' f32
  results are the contract's ('float32' MLP activation): the audit can tell them only by
  their module."""
  from attnprec import audit, cpu_features
  if not bf16_dots:
    monkeypatch.setattr(cpu_features, "bf16_features", lambda *a, **k: ())
  bf16 = Precision(dtype="bfloat16")
  result = audit.run_audit(SCANNED, bf16, bf16, batch=1, prompt_len=4, new_tokens=2,
                           compile=False, platform="cpu")
  assert result["ok"], result["problems"]
  modules = [r["module"] for r in result["phases"]["decode"]["dense"]]
  assert modules == ["attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up",
                     "mlp/down", "unembed"], modules
  for phase, sites in (("train", ["qk", "wv", "dp", "dv", "dk", "dq"]),
                       ("prefill", ["qk", "wv"]), ("decode", ["qk", "wv"])):
    rows = result["phases"][phase]["attention"]
    assert [r["site"] for r in rows] == sites
    assert {r["layer"] for r in rows} == {"0-1 (scanned)"}
    # the dense projections inside the scan are found and checked too (7 per block)
    assert len(result["phases"][phase]["dense"]) >= 8


def _stack_sized(text: str, dims: str):
  """(name, op, line) of each instruction of a compiled program whose result is an array
  of shape [dims] (the whole stacked cache), less parameters, tuples and bitcasts."""
  found = re.findall(rf"^\s*(?:ROOT )?%([\w.\-]+) = \w+\[{dims}\](\S*) ([\w\-]+)\((.*)$",
                     text, re.M)
  return [(name, op, layout + " " + rest) for name, layout, op, rest in found
          if op not in ("parameter", "get-tuple-element", "tuple", "bitcast")]


def _not_in_place(text: str, dims: str, form: str):
  """The stack-sized instructions other than the rows' writes (`form`: 'scatter' or
  'slices') and a TPU's asynchronous moves of the stack between memory spaces (a
  copy-start whose destination and source layouts differ only in the memory space `S(n)`,
  and its copy-done: a small stack staged in VMEM; a relayout changes the layout itself)."""
  op_name = {"scatter": "scatter", "slices": "dynamic-update-slice"}[form]
  moves = set()        # copy-starts of the stack that keep its layout
  for name, dst, src in re.findall(
      rf"^\s*%([\w.\-]+) = \(\w+\[{dims}\](\{{[^}}]*\}}), \w+\[{dims}\](\{{[^}}]*\}}), "
      rf".*?\) copy-start\(", text, re.M):
    if re.sub(r"S\(\d+\)", "", dst) == re.sub(r"S\(\d+\)", "", src):
      moves.add(name)
  bad = []
  for name, op, line in _stack_sized(text, dims):
    if op_name in op or op_name in name:
      continue
    started = re.match(r"\S* %([\w.\-]+)\)", line)     # copy-done(%its-copy-start)
    if op == "copy-done" and started and started.group(1) in moves:
      continue
    bad.append((name, op))
  return bad


def test_the_scanned_decode_step_writes_the_stacked_cache_in_place(params):
  """The compiled (donated) decode step: the only instructions the size of the whole
  stacked cache are the writes of the new rows, scatters on XLA:CPU, update slices on a
  TPU (`platforms.Platform.decode_write`) (no copy, no fresh stack: passing each layer's
  cache in and out of the scan instead made XLA copy the stack several times; on a TPU
  the scatter made it relayout the stack and copy each layer out)."""
  _, stacked = params
  bf16 = Precision(dtype="bfloat16")
  B, S = 2, 64
  state = decoding.DecodeState(init_cache(SCANNED, B, S, bf16.compute_dtype),
                               jnp.zeros((B, SCANNED.vocab_size)),
                               jnp.array([3, 7], jnp.int32))
  step = decoding.step_fn(SCANNED, bf16)
  text = compiled_text(step.lower(stacked, state, jnp.zeros((B,), jnp.int32)))
  dims = f"{SCANNED.num_layers},{B},{SCANNED.num_kv_heads},{S},{SCANNED.head_dim}"
  write = platforms.TABLE[platforms.local_platform(jax.default_backend())].decode_write
  assert _stack_sized(text, dims)
  assert not _not_in_place(text, dims, write), _not_in_place(text, dims, write)


TPU_PROGRAMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "results", "tpu-model", "decode_write")


def test_the_tpu_s_compiled_decode_steps_write_in_place_as_slices_and_not_as_a_scatter():
  """What the TPU compiled (its HLO kept; CPU CI reads it). This test's own decode step
  compiled on a TPU v5e (`make test-tpu` ran it there): the rows written as update
  slices, the stack staged in VMEM and back (the same layout), nothing else the stack's
  size. The whole model's decode loop of Qwen2.5-0.5B's shape at 8 x 32k: as update
  slices nothing but the writes (7.03 ms a step); as one scatter the stack relayouted and
  each layer copied out (39.1 ms), which this check finds. (Only the slices' 1 x 8k
  program of that run came back from the machine: the 8 x 32k slices figure is the
  run's log's, results/tpu-model/decode_write/decode_write.log.)"""
  import gzip
  with gzip.open(os.path.join(TPU_PROGRAMS, "scanned-decode-step-2x64-f334349.hlo.txt.gz"),
                 "rt") as f:
    text = f.read()
  dims = f"{SCANNED.num_layers},2,{SCANNED.num_kv_heads},64,{SCANNED.head_dim}"
  ops = _stack_sized(text, dims)
  assert {op for _, op, _ in ops} >= {"dynamic-update-slice", "copy-done"}
  assert not _not_in_place(text, dims, "slices")
  assert not any("scatter" in op or "scatter" in n for n, op, _ in ops)   # no scatter left
  with gzip.open(os.path.join(TPU_PROGRAMS, "decode-scatter-bf16_flags-8x32768.hlo.txt.gz"),
                 "rt") as f:
    scatter = f.read()
  layer = "1,8,2,32768,64"                      # one layer's cache, copied out every step
  copies = [(n, op) for n, op, _ in _stack_sized(scatter, layer) if op == "copy"]
  assert len(copies) == 2, copies                            # keys and values
  bad = _not_in_place(scatter, "24,8,2,32768,64", "scatter")
  assert ("copy" in {op for _, op in bad}), bad         # the stack relayouted once a call


def test_the_compile_bench_measures_both_layouts():
  """`make bench ARGS=--suite=compile` on the smallest depths: one row per (depth,
  program, layout); the scanned program's size does not grow with depth."""
  from attnprec.bench import compile_time
  result = compile_time.run(depths=(1, 3), programs=("decode",), log=lambda m: None)
  rows = {(r["depth"], r["layout"]): r for r in result["rows"]}
  assert sorted(rows) == [(1, "scanned"), (1, "unrolled"), (3, "scanned"), (3, "unrolled")]
  assert rows[(3, "unrolled")]["stablehlo_ops"] > rows[(1, "unrolled")]["stablehlo_ops"]
  assert rows[(3, "scanned")]["stablehlo_ops"] == rows[(1, "scanned")]["stablehlo_ops"]
  assert all(r["compile_s"] > 0 and r["hlo_instructions"] > 0 for r in rows.values())
  assert "| decode | 3 | scanned |" in compile_time.to_markdown(result)
  assert set(compile_time.ratios(result)["decode"]) == {"unrolled", "scanned"}


def test_flash_reads_the_layer_in_the_stack_and_equals_the_unrolled_model(params):
  """kernel='flash' (interpreted here): a scanned model's prefill and decode steps give
  the flash kernel the whole stacked cache and the scan's layer index
  (`kernels.reads_stack`, `flash_attention(layer=)`), int8 codes and scales and the
  'bias' key offset included, and equal the unrolled model, whose layers pass their own
  caches, bit for bit; the decode step's Pallas call takes the [L, ...] stack."""
  from attnprec.inspect import pallas_check
  unrolled, stacked = params
  precision = dataclasses.replace(BIAS_INT8, kernel="flash")
  seen = []

  def k_ranks(step, *args):     # the rank of each flash call's k operand
    seen.extend(e.invars[_k_operand(e)].aval.ndim
                for e in pallas_check.kernel_bodies(jax.make_jaxpr(step)(*args)))
  run = {False: _greedy(UNROLLED, unrolled, precision, steps=2),
         True: _greedy(SCANNED, stacked, precision, steps=2, inspect=k_ranks)}
  assert seen and set(seen) == {5}, seen                  # k: [L, B, K, H, S]
  np.testing.assert_array_equal(run[True][0], run[False][0])
  _equal(unstack_cache(run[True][1]), run[False][1])


def _k_operand(eqn) -> int:
  """The index of a flash forward call's k operand among its inputs (after the scalar
  prefetch arrays: the grid spec's num_scalar_prefetch)."""
  return eqn.params["grid_mapping"].num_index_operands + 1

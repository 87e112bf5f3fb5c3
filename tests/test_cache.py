"""The KV cache is written in place and read without copies, in every dtype.

Checked in the compiled program (XLA:CPU, `compile().as_text()`): every instruction whose
result has the shape of one layer's cache is listed with its opcode and where it comes
from. The cache write must be an in-place scatter on the donated (aliased) buffer, never a
copy or a conversion of the whole buffer (what a bfloat16 scatter on XLA:CPU does: it
converts the buffer to float32 and back); and in float32 nothing else may produce a
cache-sized buffer at all (no transpose copy for the kernel's view). In bfloat16 XLA:CPU
materialises the uint16 -> bfloat16 reinterpretation of each layer's keys before the qk
dot (one read-side copy per layer and step, allowed here for the dot_product kernel and
reported in docs/performance.md; the blockwise kernel's decode step reinterprets per block);
the values feed the float32 wv dot through the contract's upcast. Values: bits in, bits
out (bfloat16 stored as uint16), compared with the values written.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import decoding
from attnprec.cache import init_cache, storage_dtype
from attnprec.config import ModelConfig
from attnprec.model import init_params
from attnprec.precision import Precision
from attnprec.inspect.report import compiled_text  # noqa: E402

CONFIG = ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, mlp_hidden=32)
PARAMS = init_params(CONFIG, jax.random.PRNGKey(0))
B, S = 2, 256
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = (?P<type>\w+)\[(?P<dims>[\d,]*)\]\S* "
                    r"(?P<op>[\w\-]+)\((?P<rest>.*)$")


def cache_sized(text, *, skip_entry=False, shapes=None):
  """[(dtype, opcode, op_name)] of the instructions whose result is one layer's cache in
  either layout ([B, K, S, H] or [B, S, K, H]; or `shapes`, as "d0,d1,..."), parameters
  and tuple plumbing excluded; `skip_entry`: only those in called computations (loop
  bodies, fusions), not the ones the entry computation runs once per call."""
  shapes = shapes or {f"{B},{CONFIG.num_kv_heads},{S},{CONFIG.head_dim}",
                      f"{B},{S},{CONFIG.num_kv_heads},{CONFIG.head_dim}"}
  out, in_entry = [], False
  for line in text.splitlines():
    if line and not line.startswith(" "):
      in_entry = line.startswith("ENTRY")
    m = None if (skip_entry and in_entry) else _INSTR.match(line)
    if m and m["dims"] in shapes and m["op"] not in ("parameter", "get-tuple-element",
                                                      "tuple", "bitcast"):
      name = re.search(r'op_name="([^"]*)"', m["rest"])
      out.append((m["type"], m["op"], name.group(1) if name else ""))
  return out


def compiled_step(precision):
  state = decoding.DecodeState(init_cache(CONFIG, B, S, precision.compute_dtype),
                               jnp.zeros((B, CONFIG.vocab_size)),
                               jnp.array([3, 7], jnp.int32))
  step = decoding.step_fn(CONFIG, precision)
  return step.lower(PARAMS, state, jnp.zeros((B,), jnp.int32)).compile(), state


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_writes_the_cache_in_place(dtype):
  compiled, state = compiled_step(Precision(dtype=dtype))
  text = compiled.as_text()
  # Every cache buffer is donated: aliased to an output, not copied into a new one.
  aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", text).group(1)
  assert aliases.count("may-alias") >= 2 * CONFIG.num_layers
  ops = cache_sized(text)
  write = [o for o in ops if "/attn/kernel/" not in o[2]]
  # Per layer, k and v: one scatter each, in the stored dtype, and nothing else.
  store = {"float32": "f32", "bfloat16": "u16"}[dtype]
  scatters = [o for o in write if o[1] in ("scatter", "fusion") and o[0] == store
              and "scatter" in o[2]]
  assert len(scatters) >= 2 * CONFIG.num_layers, ops
  converts_or_copies = [o for o in write if o[1] in ("convert", "copy", "transpose")
                        or (o[1] == "fusion" and "scatter" not in o[2]
                            and "bitcast_convert" not in o[2])]
  assert not converts_or_copies, converts_or_copies
  if dtype == "float32":
    # Nothing at all makes a cache-sized buffer besides the in-place writes (the
    # kernel reads the [B, K, S, H] cache as it lies), and the step needs less scratch
    # memory than one layer's cache.
    assert all(o in scatters or o[1] == "scatter" for o in ops), ops
    layer_bytes = state.cache.layers[0].k.nbytes
    assert compiled.memory_analysis().temp_size_in_bytes < layer_bytes


# (compute dtype, cache storage): float32 (nothing to reinterpret: the control), bf16, a
# float8 cache (codes stored as uint8 bits) and caches with one side quantized, whose
# other side is bf16 bits.
_NO_COPY_CACHES = [
    ("float32", {}), ("bfloat16", {}),
    ("bfloat16", dict(kv_cache_k_dtype="float8_e4m3fn", kv_cache_v_dtype="float8_e4m3fn",
                      kv_cache_k_scale="token", kv_cache_v_scale="token")),
    ("bfloat16", dict(kv_cache_k_dtype="int8", kv_cache_k_scale="token")),
    ("bfloat16", dict(kv_cache_v_dtype="float8_e5m2", kv_cache_v_scale="token")),
]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype,storage", _NO_COPY_CACHES,
                         ids=["f32", "bf16", "fp8", "k_int8_v_bf16", "k_bf16_v_fp8"])
def test_blockwise_decode_step_reads_the_cache_without_a_copy(batch, dtype, storage):
  """The blockwise kernel's decode step slices a 16-bit side's uint16 bits, or a float8
  side's uint8 bits, per block and reinterprets each block (`contract.bits_dtype`): no
  instruction makes a cache-sized buffer besides the in-place writes, where reading the
  reinterpreted whole cache made XLA:CPU copy it per layer and step (102 ms of a SmolLM2
  bf16 step at 8 x 4000). The control: the same step on a float32 cache (nothing to
  reinterpret) is as clean; the values are checked against dot_product in
  tests/test_kernels.py. A cache of 1001 positions: blocks of 512 keys, the last one
  overlapping (a block is never cache-sized)."""
  length = 1001
  prec = Precision(dtype=dtype, kernel="blockwise", float32_qk_product=True,
                   float32_logits=True, **storage)
  state = decoding.DecodeState(
      init_cache(CONFIG, batch, length, prec.compute_dtype, prec.cache_storage),
      jnp.zeros((batch, CONFIG.vocab_size)), jnp.array([3, 7][:batch], jnp.int32))
  step = decoding.step_fn(CONFIG, prec)
  text = compiled_text(step.lower(PARAMS, state, jnp.zeros((batch,), jnp.int32)))
  shapes = {f"{batch},{CONFIG.num_kv_heads},{length},{CONFIG.head_dim}",
            f"{batch},{length},{CONFIG.num_kv_heads},{CONFIG.head_dim}"}
  ops = [o for o in cache_sized(text, shapes=shapes) if "scatter" not in o[2]
         and o[1] not in ("scatter", "dynamic-update-slice")]
  assert not ops, (dtype, storage, ops)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_loop_does_not_copy_the_cache(dtype):
  """In `generate` the cache is created inside the program and carried by the loop: the
  only cache-sized copies are the zero-filled initial buffers, once per call."""
  prec = Precision(dtype=dtype)
  tokens = jnp.ones((B, 8), jnp.int32)
  lowered = decoding.generate.lower(PARAMS, tokens, jnp.array([8, 5], jnp.int32),
                                    jax.random.PRNGKey(0), config=CONFIG, precision=prec,
                                    max_new_tokens=S - 8)
  text = compiled_text(lowered)
  assert [o for o in cache_sized(text) if o[1] == "copy"]          # the check sees them
  ops = cache_sized(text, skip_entry=True)
  assert [o for o in ops if "scatter" in o[2]], ops                  # the loop's writes
  assert not [o for o in ops if o[1] in ("copy", "convert", "transpose")
              and "/attn/kernel/" not in o[2]], ops          # (the kernel's own upcast of v)
  if dtype == "float32":
    assert not [o for o in ops if o[1] in ("copy", "convert", "transpose")], ops


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_write_then_read_returns_the_values_written(dtype):
  cache = init_cache(CONFIG, B, 16, dtype).layers[0]
  assert cache.k.dtype == storage_dtype(dtype)
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.standard_normal((B, 3, 2, 16)), dtype)
  v = jnp.asarray(rng.standard_normal((B, 3, 2, 16)), dtype)
  pos = jnp.array([[0, 1, 2], [5, 6, 7]])
  got_k, got_v = jax.jit(lambda c: c.write(k, v, pos).read(dtype))(cache)
  for got, want in ((got_k, k), (got_v, v)):
    assert got.dtype == jnp.dtype(dtype)
    got = np.asarray(got.astype(jnp.float32))
    want = np.asarray(want.astype(jnp.float32))
    np.testing.assert_array_equal(got[0, :, :3], want[0].transpose(1, 0, 2))
    np.testing.assert_array_equal(got[1, :, 5:8], want[1].transpose(1, 0, 2))
    assert not got[0, :, 3:].any() and not got[1, :, :5].any() and not got[1, :, 8:].any()


def test_donated_step_decodes_like_generate():
  """A serving loop of donated steps gives generate's tokens and logits."""
  prec = Precision()
  prompts, lengths = decoding.pad_prompts([[1, 2, 3, 4], [5, 6]])
  want_tokens, want_logits, *_ = decoding.generate(PARAMS, prompts, lengths, jax.random.PRNGKey(0),
                                               config=CONFIG, precision=prec, max_new_tokens=5)
  state = jax.jit(functools.partial(decoding.prefill, config=CONFIG, precision=prec,
                                    cache_length=9))(PARAMS, prompts, lengths)
  step = decoding.step_fn(CONFIG, prec)
  tokens, logits = [], []
  for _ in range(5):
    logits.append(np.asarray(state.last_BxV))
    tokens.append(np.asarray(jnp.argmax(state.last_BxV, -1)))
    state = step(PARAMS, state, jnp.asarray(tokens[-1], jnp.int32))
  np.testing.assert_array_equal(np.stack(tokens, 1), np.asarray(want_tokens))
  np.testing.assert_allclose(np.stack(logits, 1), np.asarray(want_logits), rtol=1e-5,
                             atol=1e-5)


def _loop_computations(text):
  """{name: lines} of the computations a while loop runs each iteration: every loop's
  body and condition, and all they call (fusions, nested loops, branches)."""
  comps, name = {}, None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line) if line and not line.startswith(" ") \
        else None
    if head:
      name = head.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  callees = lambda lines: set(re.findall(  # noqa: E731
      r"(?:calls|body|condition|to_apply)=%([\w.\-]+)", "\n".join(lines))) | set(
      n for group in re.findall(r"branch_computations=\{([^}]*)\}", "\n".join(lines))
      for n in re.findall(r"%([\w.\-]+)", group))
  todo = set(re.findall(r"(?:body|condition)=%([\w.\-]+)", text))
  seen = set()
  while todo:
    n = todo.pop()
    if n in seen or n not in comps:
      continue
    seen.add(n)
    todo |= callees(comps[n])
  return {n: comps[n] for n in seen}


def _weight_dtypes_in_loops(text):
  """The dtypes of every weight-shaped value a loop iteration touches (its own
  instructions, parameters and fusion operands included): 'bf16' there means a bf16
  weight that XLA:CPU converts to float32 for a dot inside the loop."""
  shapes = {",".join(map(str, x.shape)) for x in jax.tree_util.tree_leaves(PARAMS)
            if x.ndim == 2}
  found = set()
  for lines in _loop_computations(text).values():
    for line in lines:
      for dtype, dims in re.findall(r"\b(\w+)\[([\d,]+)\]", line):
        if dims in shapes:
          found.add(dtype)
  return found


def test_bf16_decode_loop_does_not_convert_the_weights():
  """bf16 compute on XLA:CPU: `generate` runs its loop on `for_serving`'s float32-carried
  bf16 weight values, so its loop touches weights only as float32 (the control: the same
  loop on weights stored in bf16, `decoding.compute_params`, feeds bf16 weights to its
  dots)."""
  prec = Precision(dtype="bfloat16")
  tokens = jnp.ones((B, 8), jnp.int32)
  lowered = decoding.generate.lower(PARAMS, tokens, jnp.array([8, 5], jnp.int32),
                                    jax.random.PRNGKey(0), config=CONFIG, precision=prec,
                                    max_new_tokens=16)
  assert _weight_dtypes_in_loops(compiled_text(lowered)) == {"f32"}

  def cast_at_use(params, state, token_B):
    def body(_, carry):
      state, token_B = carry
      state = decoding.decode_step(params, state, token_B, config=CONFIG, precision=prec)
      return state, jnp.argmax(state.last_BxV, -1).astype(jnp.int32)
    return jax.lax.fori_loop(0, 16, body, (state, token_B))

  state = decoding.DecodeState(init_cache(CONFIG, B, S, prec.compute_dtype),
                               jnp.zeros((B, CONFIG.vocab_size)), jnp.array([3, 7], jnp.int32))
  text = jax.jit(cast_at_use).lower(decoding.compute_params(PARAMS, prec), state,
                                   jnp.zeros((B,), jnp.int32)).compile()
  assert "bf16" in _weight_dtypes_in_loops(text.as_text())          # the check sees them


@pytest.mark.parametrize("prec", [
    Precision(dtype="bfloat16"), Precision(),
    Precision(dtype="bfloat16", kv_cache_k_dtype="int8", kv_cache_v_dtype="int8",
              kv_cache_k_scale="token", kv_cache_v_scale="token"),
    Precision(dtype="bfloat16", kv_cache_k_dtype="float8_e4m3fn", kv_cache_k_scale="channel",
              kv_cache_v_dtype="float32"),
], ids=["bf16", "f32", "int8-token", "fp8-channel-k-f32-v"])
def test_cache_bytes_is_what_init_cache_holds(prec):
  """cache_bytes (from shapes, nothing allocated) against the bytes of a real cache."""
  from attnprec.cache import cache_bytes
  real = init_cache(CONFIG, B, S, prec.compute_dtype, prec.cache_storage).nbytes
  assert cache_bytes(CONFIG, B, S, prec.compute_dtype, prec.cache_storage) == real


def test_the_decode_line_gives_the_cache_setting_and_bytes():
  from attnprec.checkpoints.serving import cache_line
  bf16 = cache_line(CONFIG, Precision(dtype="bfloat16"), S, batch=B)
  # 2 layers x (k + v) x B 2 x K 2 x S 256 x H 16 x 2 bytes = 128 KiB
  assert bf16 == ("KV cache: kv_cache=k:compute,v:compute, 2 x 256 positions x 2 layers: "
                  "128.0 KiB"), bf16
  int8 = Precision(dtype="bfloat16", kv_cache_k_dtype="int8", kv_cache_v_dtype="int8",
                   kv_cache_k_scale="token", kv_cache_v_scale="token")
  line = cache_line(CONFIG, int8, S, batch=B)
  # codes: half the bytes (64 KiB); scales: one float32 per (token, kv head), per side and
  # layer 2 x 2 x 256 x 4 bytes = 4 KiB, 16 KiB in all -> 80 / 128 KiB = 0.625x.
  assert line == ("KV cache: kv_cache=k:int8/token,v:int8/token, 2 x 256 positions x 2 layers: "
                       "80.0 KiB (0.62x the 128.0 KiB of a compute-dtype cache)"), line


@pytest.mark.parametrize("stacked", [False, True])
def test_a_decode_write_as_row_slices_is_the_scatter_s(stacked):
  """A decode step's rows written as B update slices (`cache.DECODE_WRITES`: a TPU's
  form, `platforms.Platform.decode_write`) give the bits the scatter (XLA:CPU's) gives,
  keys and values, per-token scales and bf16 bits alike, with the scatter's edge cases:
  a position past the cache writes nothing, a negative one counts from the end; a layer
  of a stack is written and no other. The form follows the platform traced for
  (`precision.target_backend`): the scatter for 'cpu'; for 'tpu' the slices for values,
  the scatter for int8 codes, each measured there."""
  from attnprec.errors import UserError
  from attnprec.precision import target_backend
  from attnprec import cache as cache_lib
  from attnprec.contract import CacheStorage
  int8 = CacheStorage("int8", "int8", "token", "token")
  rng = np.random.default_rng(0)
  K, H, S_, B_ = 2, 8, 16, 5
  k = jnp.asarray(rng.standard_normal((B_, 1, K, H)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((B_, 1, K, H)), jnp.bfloat16)
  # inside, the last position, past the end, -1 (the last, counted from the end), and
  # -17 (past the start even counted from the end: dropped)
  positions = jnp.array([[3], [15], [16], [-1], [-17]], jnp.int32)
  config = ModelConfig(vocab_size=32, d_model=16, num_layers=3, num_heads=2, num_kv_heads=K,
                       head_dim=H, mlp_hidden=32, scan_layers=stacked)
  for storage in (cache_lib.COMPUTE_CACHE, int8):
    fresh = init_cache(config, B_, S_, jnp.bfloat16, storage)
    fresh = jax.tree_util.tree_map(                       # something to overwrite
        lambda x: jnp.asarray(rng.integers(1, 100, x.shape)).astype(x.dtype), fresh)
    view = fresh.stack.replace(layer=jnp.int32(1)) if stacked else fresh.layers[1]
    written = {}
    for rows in (True, False):
      cache_lib.DECODE_WRITES = "slices" if rows else "scatter"
      try:
        write = jax.jit(lambda c: c.write(k, v, positions, storage))
        jaxpr = str(jax.make_jaxpr(lambda c: c.write(k, v, positions, storage))(view))
        written[rows] = write(view)
      finally:
        cache_lib.DECODE_WRITES = None
      # each form is the one asked for: slices only, or scatters only
      assert ("scatter" in jaxpr) != rows and ("dynamic_update_slice" in jaxpr) == rows
    # the platform's own form: the scatter on XLA:CPU; on a TPU the slices for values,
    # the scatter for int8 codes (and their scales)
    for backend, rows in (("cpu", False), ("tpu", not storage.quantized)):
      with target_backend(backend):
        jaxpr = str(jax.make_jaxpr(lambda c: c.write(k, v, positions, storage))(view))
      assert ("scatter" in jaxpr) != rows and ("dynamic_update_slice" in jaxpr) == rows
    # mixed sides on a TPU: int8 keys (codes and per-channel scales) as the scatter,
    # compute-dtype values as slices
    mixed = CacheStorage("int8", "compute", "channel", None)
    mixed_view = (init_cache(config, B_, S_, jnp.bfloat16, mixed).stack.replace(
        layer=jnp.int32(1)) if stacked else init_cache(config, B_, S_, jnp.bfloat16,
                                                       mixed).layers[1])
    with target_backend("tpu"):
      jaxpr = str(jax.make_jaxpr(lambda c: c.write(k, v, positions, mixed))(mixed_view))
    assert "scatter" in jaxpr and "dynamic_update_slice" in jaxpr
    # a form that does not exist is refused by name
    cache_lib.DECODE_WRITES = "rows"
    try:
      with pytest.raises(UserError, match="'rows'.*'scatter', 'slices'"):
        jax.make_jaxpr(lambda c: c.write(k, v, positions, storage))(view)
    finally:
      cache_lib.DECODE_WRITES = None
    # a prefill (T > 1 rows per sequence) scatters on every platform
    with target_backend("tpu"):
      jaxpr = str(jax.make_jaxpr(lambda c: c.write(
          jnp.concatenate([k, k], 1), jnp.concatenate([v, v], 1),
          jnp.concatenate([positions, positions], 1), storage))(view))
    assert "scatter" in jaxpr
    for a, b in zip(jax.tree_util.tree_leaves(written[True]),
                    jax.tree_util.tree_leaves(written[False])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    new = written[True]
    held = view.k[1] if stacked else view.k
    got = new.k[1] if stacked else new.k
    assert not np.array_equal(np.asarray(got[0, :, 3]), np.asarray(held[0, :, 3]))
    for b in (2, 4):                                                          # dropped
      np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(held[b]))
    assert not np.array_equal(np.asarray(got[3, :, 15]), np.asarray(held[3, :, 15]))
    if stacked:          # the other layers as they were
      for layer in (0, 2):
        np.testing.assert_array_equal(np.asarray(new.k[layer]), np.asarray(view.k[layer]))

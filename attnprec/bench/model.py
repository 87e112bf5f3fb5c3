"""Whole-model benchmark (`make bench`): decode and prefill of a real model under the
fp32 and the bf16 + attention-flags presets, beside transformers on the same weights.

Shapes: B batch, P prompt length, S cache length (P + new tokens), M decode steps timed.

Method
  * attnprec: the model's `decoding.prefill` jitted per (preset, B, P), and a decode
    program: M greedy `decoding.decode_step`s in one `lax.fori_loop` with the state
    donated (the cache updated in place, as `generate` runs it), started from a copy of
    the prefilled state made before the clock starts. Params and precision go through
    `decoding.for_serving`, as `generate` runs them (on XLA:CPU with bf16 compute: the
    weight matrices rounded to bf16 values once, held in float32); preset
    `bf16_flags_cast` skips it (each weight cast to bf16 at every use) and
    `bf16_flags_bf16w` stores them in bf16 (`decoding.compute_params`).
    Compile time is measured apart (`compile_s`; the persistent compilation cache, if
    enabled, turns it into a load).
  * transformers (torch CPU, fp32, sdpa): the same GGUF file loaded by transformers'
    own loader; prefill = one forward over the prompt with a cache; decode = M greedy
    single-token forwards with its cache, under `torch.inference_mode`. Its fp32 is the
    precision transformers serves on CPU (bf16 matmuls there are slower on CPUs without
    bf16 units).
  * transformers in bf16 too (`torch_dtypes`, `--torch_dtypes=float32,bfloat16`): row
    `transformers_bf16`; `prefill_vs_best_transformers` divides by the faster of the two.
  * Long cases (`LONG_CASES`, `--cases=long`): prefill and decode at 4000 and 8000
    tokens, batch 1 and 8 (minutes per case: for an idle machine).
  * Prefill against the matmul peak: `projection_flops` (the dense projections of a
    prefill) over its time, over the peak of a jitted dot of the configuration's dtype
    at SmolLM2's MLP shape measured in the same run (`matmul_peak`: f32, and
    bf16 x bf16 -> f32 as `layers.project` runs it); attention is in the time too, so it
    is a lower bound on the projections' own fraction.
  * Interleaved rounds: in every round each configuration of a (B, P) case runs once, so
    drift on a shared machine hits all alike; medians over the rounds. Ratios are taken
    between configurations measured side by side.
  * Roofline: per decode step the weights are read once and the whole cache once (the
    dense kernel reads all S positions; masked ones too). bytes / read bandwidth (a
    jitted float32 matrix-vector product over a matrix larger than the caches, the
    access pattern of a decode step's weights, measured in the same run at the start and
    the end) is the floor; `of_roofline` = floor / measured step time (1 = at the floor).
  * Flag cost per phase: bf16 compute with both flags vs without (the `bf16` preset), in
    the full model: a train step, a prefill and a decode step, interleaved.
  * KV cache: `bf16_flags_kv_int8` / `bf16_flags_kv_fp8` store the cache as int8 /
    float8_e4m3fn codes with float32 per-token scales (`--presets=bf16_flags,
    bf16_flags_kv_int8,bf16_flags_kv_fp8 --cases=long`: the decode step against the
    bf16 cache's in the same run); `kv_bytes` is the cache as each configuration stores
    it (`cache.cache_bytes`: codes and scales), so the roofline counts the smaller reads.
  * Kernels: the presets fp32, bf16_flags and bf16 use `precision.kernel = 'auto'`, what
    `make decode` runs; `*_dense` keep the dense kernel in prefill, for the comparison.
"""
import dataclasses
import functools
import os
import statistics
import time
from typing import Dict, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import compilation, cpu_features, decoding, layers, plotting, train
from attnprec.bench.cases import LONG_CASES  # noqa: F401  (`--cases=long`)
from attnprec.cache import cache_bytes
from attnprec.errors import UserError
from attnprec.precision import Precision
from attnprec.presets import variant

# fp32 / bf16_flags / bf16 run what `make decode` runs: kernel 'auto' (`kernels.resolve`:
# blockwise for a prefill of >= kernels.AUTO_MIN_QUERIES tokens, the platform's choice
# for a decode step). Each is a `presets.variant` of a gin preset (gin/precision/): the
# precision comes from its file, a variant sets only what the file leaves unbound.
_AUTO = dict(kernel="auto")
PRESETS: Dict[str, Precision] = {
    "fp32": variant("fp32", **_AUTO),
    "bf16_flags": variant("fp32_attention", **_AUTO),
    "bf16": variant("bf16", **_AUTO),
    # the dense kernel in prefill too
    "fp32_dense": variant("fp32", kernel="dot_product"),
    "bf16_flags_dense": variant("fp32_attention", kernel="dot_product"),
    # the blockwise (flash-style) kernel in prefill and decode steps
    "bf16_flags_blockwise": variant("fp32_attention", kernel="blockwise"),
    # bf16 + flags with the weights STORED in bfloat16 (`decoding.compute_params`)
    "bf16_flags_bf16w": variant("fp32_attention", **_AUTO),
    # bf16 + flags with float32 weights cast to bf16 at every use (no `for_serving`)
    "bf16_flags_cast": variant("fp32_attention", **_AUTO),
    # bf16 + flags with the prefill on the float32-carried weights too, cast to bf16 at
    # every use (the form `decoding.prefill_params` replaced: the same numbers)
    "bf16_flags_carried_prefill": variant("fp32_attention", **_AUTO),
    # bf16 + flags with a quantized KV cache (codes + float32 per-token scales): the
    # cache rows of the contract; against bf16_flags, the same flags with a bf16 cache
    "bf16_flags_kv_int8": variant("kv_int8", **_AUTO),
    "bf16_flags_kv_fp8": variant("kv_fp8", **_AUTO),
    # the key offset (`attnprec.keyoffset`): its cost against bf16 / bf16_flags (one float32
    # subtraction per key; the key projection left in float32 until it). 'bias' needs a
    # model with a key bias (Qwen2); 'prefill_mean' runs on any.
    "bf16_offset": variant("bf16", key_offset="bias", **_AUTO),
    "bf16_offset_mean": variant("bf16", key_offset="prefill_mean", **_AUTO),
    "bf16_flags_offset": variant("fp32_attention", key_offset="bias", **_AUTO),
    # the projection form forced (`precision.projection_form`; 'auto' picks by the CPU):
    # float32 dots on bf16 values, what 'auto' runs on a CPU without a bf16 dot
    # instruction; and bf16 dots at every row count
    "bf16_flags_f32dot": variant("fp32_attention", projection_form="float32_dot", **_AUTO),
    "bf16_f32dot": variant("bf16", projection_form="float32_dot", **_AUTO),
    "bf16_flags_c_dot": variant("fp32_attention", projection_form="compute_dtype_dot",
                                **_AUTO),
    # the MLP's activation in float32 (`precision.mlp_activation`), with each form
    "bf16_flags_f32act": variant("fp32_attention", mlp_activation="float32", **_AUTO),
    "bf16_f32act": variant("bf16", mlp_activation="float32", **_AUTO),
    "bf16_flags_f32dot_f32act": variant("fp32_attention", projection_form="float32_dot",
                                        mlp_activation="float32", **_AUTO),
    "bf16_f32dot_f32act": variant("bf16", projection_form="float32_dot",
                                  mlp_activation="float32", **_AUTO),
}
BF16_WEIGHTS = ("bf16_flags_bf16w",)
# the prefill on the float32-carried weights, cast at each use (before `prefill_params`)
CARRIED_PREFILL = ("bf16_flags_carried_prefill",)
CAST_AT_USE = ("bf16_flags_cast",) + BF16_WEIGHTS
DEFAULT_CASES: Tuple[Tuple[int, int], ...] = ((1, 32), (1, 1000), (8, 32), (8, 1000))
QUICK_CASES: Tuple[Tuple[int, int], ...] = ((1, 32), (8, 32))
TORCH = "transformers"           # fp32
TORCH_DTYPES = {"float32": TORCH, "bfloat16": "transformers_bf16"}
# The matmul peak prefill projections are held against: SmolLM2's MLP up at 1000 rows.
PEAK_SHAPE = (1000, 576, 1536)


# ----------------------------------------------------------------------------- programs
def _decode_loop(params, state, token_B, *, config, precision, steps):
  """`steps` greedy decode steps (state donated by the caller's jit)."""
  def body(_, carry):
    state, token_B = carry
    state = decoding.decode_step(params, state, token_B, config=config, precision=precision)
    return state, jnp.argmax(state.last_BxV, axis=-1).astype(jnp.int32)

  return jax.lax.fori_loop(0, steps, body, (state, token_B))


@functools.lru_cache(maxsize=None)
def _programs(config, precision, steps, cache_length):
  prefill = jax.jit(functools.partial(decoding.prefill, config=config, precision=precision,
                                      cache_length=cache_length))
  decode = jax.jit(functools.partial(_decode_loop, config=config, precision=precision,
                                     steps=steps), donate_argnums=(1,))
  return prefill, decode


def _check_finite(label: str, what: str, logits, config, params, precision, prompt) -> None:
  """The runners' NonFiniteError (`checkpoints.finite.nonfinite_error`: the first stage
  whose output is not finite, from one more forward pass of `prompt`) naming `label`,
  unless `logits` are all finite: a broken program's timings would read like any other's."""
  logits = np.asarray(logits)
  if np.isfinite(logits).all():
    return
  from attnprec.checkpoints import finite
  where = finite.Where("NaN" if np.isnan(logits).any() else "Inf",
                       f"in {int((~np.isfinite(logits)).sum())} of {logits.size} logits")
  stage = finite.first_nonfinite_stage(config, params, prompt, precision)
  raise finite.nonfinite_error(f"the logits of the {what} of bench case {label}", precision,
                               where, stage, advice=" Not timed.")


def serving_params(carried: dict, params, precision):
  """(params, precision, key) as `decoding.for_serving` gives them for `precision`. The
  serving params depend only on the compute dtype and whether they are carried: `carried`
  ({key: params}, one per bench run) lets presets and cases share one copy (a 1.5B
  model's carried weights are 6 GB); `key` names it."""
  serving = decoding.serving_precision(precision)
  key = (jnp.dtype(precision.compute_dtype).name, serving.carrier_weights)
  if key not in carried:
    carried[key], _ = decoding.for_serving(params, precision)
  return carried[key], serving, key


class _AttnprecCase:
  """Compiled prefill + decode of one (preset, B, P); `prefill()` / `decode()` time one
  call each. Every suite's timings come from here, so here the programs are checked:
  the prefill's logits when it is built, the decode loop's on its first run
  (`check_decode`); non-finite logits are the runners' NonFiniteError, naming `label`."""

  def __init__(self, config, params, precision, prompt_BxP, steps, weights="serving",
               carried=None, carried_prefill=False, label: Optional[str] = None):
    B, P = prompt_BxP.shape
    self.label = label or f"{B}x{P}"
    # what a non-finite result's diagnosis runs (`_check_finite`)
    self._diagnose = (config, params, precision, prompt_BxP)
    self.steps = steps
    self.weights = weights
    if weights == "serving":
      carried = {} if carried is None else carried
      self.params, precision, key = serving_params(carried, params, precision)
      self.weights = ("carried" if precision.carrier_weights else
                      f"{jnp.dtype(precision.compute_dtype).name}-stored"
                      if precision.stored_weights else "float32")
    else:   # "cast": float32, cast at each use; "stored": in the compute dtype
      self.params = decoding.compute_params(params, precision) if weights == "stored" else \
          params
    self.precision = precision          # as the programs run it (serving: its weights)
    self.prompt = jnp.asarray(prompt_BxP)
    self.lengths = jnp.full((B,), P, jnp.int32)
    # the prefill reads what `generate` gives it (`decoding.prefill_params`: with carried
    # weights, the blocks' matrices stored in c), the decode steps the serving params
    self.prefill_params = self.params
    if weights == "serving" and not carried_prefill:
      # one copy per (dtype, form, rows >= 128), shared as `carried` is
      pkey = key + (layers.projection_form(precision), B * P >= layers.MIN_ROWS_C_DOT)
      if pkey not in carried:
        carried[pkey] = decoding.prefill_params(self.params, precision, B * P)
      self.prefill_params = carried[pkey]
      if self.prefill_params is not self.params:
        self.weights += ", prefill stored"     # decode steps on the carried ones
    prefill, decode = _programs(config, precision, steps, P + steps)
    c1 = compilation.compile_lowerable(prefill, self.prefill_params, self.prompt,
                                       self.lengths)
    self._prefill = c1.program
    self.state0 = jax.block_until_ready(self._prefill(self.prefill_params, self.prompt,
                                                      self.lengths))
    _check_finite(self.label, "prefill", self.state0.last_BxV, *self._diagnose)
    self.first = jnp.argmax(self.state0.last_BxV, axis=-1).astype(jnp.int32)
    self._decode_checked = False
    c2 = compilation.compile_lowerable(decode, self.params, self.state0, self.first)
    self._decode = c2.program
    self.compile_s = {"prefill": c1.seconds, "decode": c2.seconds}

  def run_prefill(self):
    """One prefill on the params it was compiled for (the state it returns)."""
    return self._prefill(self.prefill_params, self.prompt, self.lengths)

  def prefill(self) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(self.run_prefill())
    return time.perf_counter() - t0

  def decode(self) -> float:
    state = jax.tree_util.tree_map(jnp.copy, self.state0)   # donated below: a fresh copy
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    out = jax.block_until_ready(self._decode(self.params, state, self.first))
    seconds = time.perf_counter() - t0
    self.check_decode(out)
    return seconds

  def check_decode(self, out=None) -> None:
    """Checks the decode loop's logits once: those of `out` (a run's output), or of a run
    made here."""
    if self._decode_checked:
      return
    if out is None:
      out = self._decode(self.params, jax.tree_util.tree_map(jnp.copy, self.state0),
                         self.first)
    _check_finite(self.label, "decode steps", out[0].last_BxV, *self._diagnose)
    self._decode_checked = True


class _TorchCase:
  """transformers' prefill + greedy decode loop with its cache, on the same prompt."""

  def __init__(self, model, prompt_BxP, steps):
    import torch
    self.torch, self.model, self.steps = torch, model, steps
    self.ids = torch.tensor(np.asarray(prompt_BxP), dtype=torch.long)

  def _prefill(self):
    with self.torch.inference_mode():
      out = self.model(input_ids=self.ids, use_cache=True)
    return out

  def prefill(self) -> float:
    t0 = time.perf_counter()
    self._prefill()
    return time.perf_counter() - t0

  def decode(self) -> float:
    out = self._prefill()
    torch = self.torch
    with torch.inference_mode():
      past = out.past_key_values
      token = out.logits[:, -1].argmax(-1, keepdim=True)
      t0 = time.perf_counter()
      for _ in range(self.steps):
        out = self.model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
      return time.perf_counter() - t0


def weight_bytes(params, dtype=None) -> int:
  """Bytes of the weights one decode step reads: every matrix (the tied embedding table
  counts once: the unembedding reads it whole), in `dtype` if given."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(params):
    size = jnp.dtype(dtype).itemsize if dtype is not None and leaf.ndim == 2 else \
        leaf.dtype.itemsize
    total += leaf.size * size
  return total


def projection_flops(params, config, B: int, P: int) -> float:
  """FLOPs of a prefill's dense projections: 2 x rows x every layer matrix, plus the
  unembedding for each sequence's last position (prefill computes only those logits)."""
  dense = sum(x.size for module, group in params.items() for n, x in group.items()
              if x.ndim == 2 and "embed" not in module)
  return 2.0 * B * P * dense + 2.0 * B * config.d_model * config.vocab_size


def matmul_peak(shape=PEAK_SHAPE, reps: int = 5) -> Dict[str, float]:
  """FLOP/s of a jitted f32 dot and a bf16 x bf16 -> f32 dot (what `layers.project` runs)
  at `shape` (m, k, n), min of `reps`: the peaks prefill projections are held against."""
  m, k, n = shape
  out = {}
  for key, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16)):
    x, w = jnp.ones((m, k), dtype), jnp.full((k, n), 1e-3, dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(x, w))
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(f(x, w))
      times.append(time.perf_counter() - t0)
    out[key] = 2.0 * m * k * n / min(times)
  return out


def read_bandwidth(mbytes: int = 256, reps: int = 5) -> float:
  """Bytes/s a jitted float32 matrix-vector product reads from a `mbytes` MB matrix
  (each weight read once, as in a decode step), median of `reps`."""
  n = int((mbytes * 2 ** 20 // 4) ** 0.5)
  w = jnp.full((n, n), 1e-3, jnp.float32)
  x = jnp.ones((1, n), jnp.float32)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(x, w))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x, w))
    times.append(time.perf_counter() - t0)
  return w.nbytes / statistics.median(times)


def ab_cases(cases, presets, forms, *, model: str = "smollm2-135m"):
  """For each (batch, prompt) of `cases`, (B, P, {(preset, form): case}): every preset
  (names in PRESETS) under every form (name -> a function of its Precision), each an
  `_AttnprecCase` of one decode step on one random prompt (checked for finite logits),
  the carried weights shared; the checkpoint loaded once. What the one-off A/B scripts
  under results/ time, interleaved."""
  from attnprec import checkpoints
  ckpt = checkpoints.load(model)
  for B, P in cases:
    prompt = np.random.default_rng(0).integers(0, ckpt.config.vocab_size, (B, P))
    carried, out = {}, {}
    for preset in presets:
      for form, change in forms.items():
        out[(preset, form)] = _AttnprecCase(
            ckpt.config, ckpt.params, change(PRESETS[preset]), prompt.astype(np.int32), 1,
            carried=carried, label=f"{B}x{P} {preset} {form}")
        out[(preset, form)].check_decode()
    yield B, P, out


def round_robin(calls: Dict[str, callable], rounds: int) -> Dict[str, list]:
  for call in calls.values():
    call()                                   # untimed warm-up (also the ordering bias)
  times = {k: [] for k in calls}
  for _ in range(rounds):
    for k, call in calls.items():
      times[k].append(call())
  return times


# ----------------------------------------------------------------------------- the bench
def load_torch_model(name: str, dtype: str = "float32"):
  """transformers' model for a shipped name or a .gguf path, in `dtype` ('float32' or
  'bfloat16': torch runs bf16 matmuls through oneDNN, on avx512_bf16 at the bf16 rate),
  sdpa (None: no torch)."""
  try:
    import torch
    import transformers
  except ImportError:
    return None
  from attnprec import checkpoints
  path = checkpoints.shipped_path(name) if name in checkpoints.SHIPPED else None
  if path is None:
    import pathlib
    path = pathlib.Path(name)
    if path.suffix != ".gguf":
      return None
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype),
      attn_implementation="sdpa").eval()
  return model


def run_model_bench(*, model: str = "smollm2-135m", config=None, params=None,
                    cases: Sequence[Tuple[int, int]] = DEFAULT_CASES,
                    presets: Sequence[str] = ("fp32", "bf16_flags"), steps: int = 32,
                    rounds: int = 3, include_torch: bool = True, torch_threads: int = 0,
                    torch_dtypes: Sequence[str] = ("float32",),
                    flag_phases: bool = True, flag_case: Tuple[int, int] = (1, 1000),
                    train_tokens: int = 256, bandwidth_mbytes: int = 256, seed: int = 0,
                    progress: bool = True, on_case=None) -> dict:
  """Runs the bench; returns plain data (see the module docstring).

  model: a shipped name or checkpoint path (or pass `config` and `params` directly).
  cases: (batch, prompt length) pairs. steps: decode steps timed per round.
  torch_threads: torch's intra-op threads (0: all cores).
  torch_dtypes: transformers in these dtypes ('float32' -> row 'transformers',
    'bfloat16' -> 'transformers_bf16'); ratios 'vs best transformers' take the faster.
  flag_phases: also time bf16 with and without the flags (train step, prefill, decode)
    at `flag_case` (batch, tokens; the train step uses `train_tokens` tokens).
  on_case: called with the result so far after each case (so a long run that is
    interrupted still leaves the cases it finished).
  """
  for name in presets:
    if name not in PRESETS:
      raise UserError(f"Unknown bench preset {name!r}; valid: {list(PRESETS)}.")
  for B, P in cases:
    if B < 1 or P < 1:
      raise UserError(f"Bench case (batch={B}, prompt={P}) must have batch >= 1 and "
                      f"prompt >= 1.")
  if steps < 1 or rounds < 1:
    raise UserError(f"steps and rounds must be >= 1, got steps={steps}, rounds={rounds}.")
  log = print if progress else (lambda *a, **k: None)
  t_start = time.perf_counter()
  if config is None:
    from attnprec import checkpoints
    ckpt = checkpoints.load(model)
    config, params = ckpt.config, ckpt.params
  torch_models = {}
  for dtype in (torch_dtypes if include_torch else ()):
    if dtype not in TORCH_DTYPES:
      raise UserError(f"Unknown transformers dtype {dtype!r}; valid: {list(TORCH_DTYPES)}.")
    m = load_torch_model(model, dtype)
    if m is not None:
      torch_models[TORCH_DTYPES[dtype]] = m
  torch_model = next(iter(torch_models.values()), None)
  result = dict(config=dict(model=model, cases=[list(c) for c in cases], presets={
      p: dataclasses.asdict(PRESETS[p]) for p in presets}, steps=steps, rounds=rounds,
      jax=jax.__version__, devices=str(jax.devices()), cpu_count=os.cpu_count(),
      cpu=cpu_features.describe(),
      projection_forms={p: PRESETS[p].describe_projection().strip() for p in presets},
      xla_flags=os.environ.get("XLA_FLAGS", "")), rows=[], flags=None)
  if torch_model is not None:
    import torch
    import transformers
    torch.set_num_threads(torch_threads or os.cpu_count())
    result["config"].update(torch=torch.__version__, transformers=transformers.__version__,
                            torch_threads=torch.get_num_threads(),
                            torch_dtypes=list(torch_dtypes))
  result["read_bandwidth"] = read_bandwidth(bandwidth_mbytes)
  result["matmul_peak"] = matmul_peak()
  rng = np.random.default_rng(seed)

  carried = {}   # one copy of the carried weights per compute dtype, for every case
  for B, P in cases:
    if P + steps > config.max_seq_len:
      raise UserError(f"Bench case prompt={P} + steps={steps} exceeds the model's "
                      f"max_seq_len {config.max_seq_len}.")
    prompt = rng.integers(0, config.vocab_size, (B, P)).astype(np.int32)
    runners = {}
    for name in presets:
      log(f"compiling {name} B={B} P={P} ...", flush=True)
      runners[name] = _AttnprecCase(
          config, params, PRESETS[name], prompt, steps,
          weights="stored" if name in BF16_WEIGHTS else
          "cast" if name in CAST_AT_USE else "serving", carried=carried,
          carried_prefill=name in CARRIED_PREFILL)
    for row_name, m in torch_models.items():
      runners[row_name] = _TorchCase(m, prompt, steps)
    log(f"timing B={B} P={P} ({rounds} rounds) ...", flush=True)
    pre = round_robin({k: r.prefill for k, r in runners.items()}, rounds)
    dec = round_robin({k: r.decode for k, r in runners.items()}, rounds)
    for name, r in runners.items():
      step_s = statistics.median(dec[name]) / steps
      dtype = PRESETS[name].compute_dtype if name in PRESETS else \
          jnp.bfloat16 if name == TORCH_DTYPES["bfloat16"] else jnp.float32
      # the cache as this configuration stores it (codes and scales for a quantized one);
      # transformers' cache grows, so on average it reads half the decoded steps
      kv = cache_bytes(config, B, P + steps, dtype, PRESETS[name].cache_storage) \
          if name in PRESETS else cache_bytes(config, B, 1, dtype) * (P + steps / 2)
      # the floor: the weights as this configuration holds them (bf16-stored: 2 bytes;
      # float32, cast at use or carried: 4), read once
      weights = getattr(r, "weights", "stored" if dtype == jnp.bfloat16 else "float32")
      wb = weight_bytes(params, dtype if weights == "stored" else jnp.float32)
      row = dict(name=name, batch=B, prompt=P, prefill_s=statistics.median(pre[name]),
                 prefill_times_s=pre[name], step_s=step_s,
                 step_times_s=[t / steps for t in dec[name]], tokens_per_s=B / step_s,
                 weight_bytes=wb, kv_bytes=int(kv),
                 roofline_step_s=(wb + kv) / result["read_bandwidth"])
      row["of_roofline"] = row["roofline_step_s"] / step_s
      row["weights"] = weights
      # prefill against the matmul peak of its compute dtype, measured in this run: the
      # dense projections' FLOPs over the whole prefill's time (attention included, so a
      # lower bound on the projections' own fraction)
      row["prefill_matmul_flops"] = projection_flops(params, config, B, P)
      peak = result["matmul_peak"]["bf16" if dtype == jnp.bfloat16 else "f32"]
      row["of_matmul_peak"] = row["prefill_matmul_flops"] / row["prefill_s"] / peak
      if name in PRESETS:
        row["compile_s"] = r.compile_s
      result["rows"].append(row)
    _add_ratios(result["rows"], B, P)
    result["wall_s"] = time.perf_counter() - t_start
    if on_case is not None:
      on_case(result)

  if flag_phases:
    result["flags"] = flag_cost(config, params, flag_case, train_tokens, rounds, log, rng,
                                carried)
  result["read_bandwidth_end"] = read_bandwidth(bandwidth_mbytes)
  result["wall_s"] = time.perf_counter() - t_start
  return result


def _add_ratios(rows, B, P):
  case = {r["name"]: r for r in rows if r["batch"] == B and r["prompt"] == P}
  fp32, torch_row = case.get("fp32"), case.get(TORCH)
  peers = [case[n] for n in TORCH_DTYPES.values() if n in case]
  best = min(peers, key=lambda r: r["prefill_s"]) if peers else None
  for r in case.values():
    if best is not None:
      r["prefill_vs_best_transformers"] = r["prefill_s"] / best["prefill_s"]
      r["best_transformers"] = best["name"]
    if fp32 is not None:
      r["step_vs_fp32"] = r["step_s"] / fp32["step_s"]
    if torch_row is not None:
      r["tokens_per_s_vs_transformers"] = r["tokens_per_s"] / torch_row["tokens_per_s"]
      r["prefill_vs_transformers"] = r["prefill_s"] / torch_row["prefill_s"]


def flag_cost(config, params, case, train_tokens, rounds, log, rng, carried=None) -> dict:
  """bf16 with both flags / without, per phase, in the full model, interleaved."""
  B, P = case
  steps = 8
  prompt = rng.integers(0, config.vocab_size, (B, P)).astype(np.int32)
  calls, compile_s = {}, {}
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, train_tokens)), jnp.int32)
  mask = jnp.ones((1, train_tokens), jnp.float32)
  optimizer = train.make_optimizer(total_steps=10)
  for name in ("bf16", "bf16_flags"):
    prec = PRESETS[name]
    log(f"compiling the flag-cost programs ({name}) ...", flush=True)
    r = _AttnprecCase(config, params, prec, prompt, steps, carried=carried)
    calls[f"prefill/{name}"] = r.prefill
    calls[f"decode/{name}"] = lambda r=r: r.decode() / r.steps
    state = train.TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32),
                             jax.random.PRNGKey(0))
    # the train phase runs its own default kernel (gin/runs/train.gin sets none)
    update = train.make_update(config, dataclasses.replace(prec, kernel=Precision().kernel),
                               optimizer)
    c = compilation.compile_lowerable(update, state, tokens, mask)
    compile_s[name] = dict(r.compile_s, train=c.seconds)
    check_train_step(f"the train step ({name})", c.program(state, tokens, mask)[1])

    def train_call(program=c.program, state=state):
      t0 = time.perf_counter()
      jax.block_until_ready(program(state, tokens, mask))
      return time.perf_counter() - t0

    calls[f"train/{name}"] = train_call
  log("timing the flag cost ...", flush=True)
  times = round_robin(calls, rounds)
  med = {k: statistics.median(v) for k, v in times.items()}
  return {"batch": B, "prompt": P, "train_tokens": train_tokens, "median_s": med,
          "times_s": times, "compile_s": compile_s,
          "flags_over_no_flags": {ph: med[f"{ph}/bf16_flags"] / med[f"{ph}/bf16"]
                                  for ph in ("train", "prefill", "decode")}}


def check_train_step(label: str, metrics: dict) -> None:
  """A NonFiniteError unless a train step's loss, gradient norm and updated params'
  norm are finite (`train.make_update`'s metrics): a broken step's time would read like a
  working one's."""
  from attnprec.checkpoints.finite import require_finite
  for key in ("loss", "grad_norm", "param_norm"):
    require_finite(f"{key} of {label}", np.asarray(metrics[key]))


# ----------------------------------------------------------------------------- output
def to_markdown(result: dict) -> str:
  cfg = result["config"]
  torch_note = (f"transformers {cfg['transformers']} (torch {cfg['torch']}, "
                f"{'/'.join(cfg.get('torch_dtypes', ['float32']))}, sdpa, "
                f"{cfg['torch_threads']} threads)" if "torch" in cfg else "no transformers")
  peak = result.get("matmul_peak")
  peak_note = (f"; matmul peak at {'x'.join(map(str, PEAK_SHAPE))}: f32 "
               f"{peak['f32'] / 1e9:.0f}, bf16 x bf16 -> f32 {peak['bf16'] / 1e9:.0f} GFLOP/s"
               if peak else "")
  cpu = f"CPU bf16 features: {cfg['cpu']}; " if "cpu" in cfg else ""
  lines = [f"{cpu}Model {cfg['model']}; {cfg['steps']} greedy decode steps timed per round, "
           f"{cfg['rounds']} interleaved rounds, medians; {torch_note}; read bandwidth "
           f"(matrix-vector) {result['read_bandwidth'] / 1e9:.1f} GB/s (end of run "
           f"{result.get('read_bandwidth_end', float('nan')) / 1e9:.1f}){peak_note}.", "",
           "| batch, prompt | config | weights | decode ms/step | tokens/s | vs fp32 step "
           "| vs transformers tok/s | of roofline | prefill s | prefill vs transformers "
           "| prefill vs best transformers | prefill of matmul peak "
           "| compile s (prefill + decode) |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in result["rows"]:
    comp = r.get("compile_s")
    comp = "" if comp is None else f"{comp['prefill']:.0f} + {comp['decode']:.0f}"
    lines.append(
        f"| {r['batch']}, {r['prompt']} | {r['name']} | {r.get('weights', '')} "
        f"| {r['step_s'] * 1e3:.1f} "
        f"| {r['tokens_per_s']:.1f} | {_f(r.get('step_vs_fp32'))} "
        f"| {_f(r.get('tokens_per_s_vs_transformers'))} | {r['of_roofline']:.2f} "
        f"| {r['prefill_s']:.2f} | {_f(r.get('prefill_vs_transformers'))} "
        f"| {_f(r.get('prefill_vs_best_transformers'))} | {_f(r.get('of_matmul_peak'))} "
        f"| {comp} |")
  flags = result.get("flags")
  if flags:
    lines += ["", f"Cost of the attention flags (bf16 compute, both flags / none) in the "
              f"full model: train step on {flags['train_tokens']} tokens, prefill and "
              f"decode step at batch {flags['batch']}, prompt {flags['prompt']}", "",
              "| phase | bf16 s | bf16 + flags s | ratio |", "|---|---:|---:|---:|"]
    for ph, ratio in flags["flags_over_no_flags"].items():
      lines.append(f"| {ph} | {flags['median_s'][f'{ph}/bf16']:.4f} "
                   f"| {flags['median_s'][f'{ph}/bf16_flags']:.4f} | {ratio:.2f} |")
  lines.append(f"\nwall time {result['wall_s']:.0f} s")
  return "\n".join(lines) + "\n"


def _f(x: Optional[float]) -> str:
  return "" if x is None else f"{x:.2f}"


def plot(result: dict, path: str) -> None:
  """Decode tokens/s and prefill time per case and configuration."""
  plt = plotting.pyplot()
  cases = [tuple(c) for c in result["config"]["cases"]]
  names = list(dict.fromkeys(r["name"] for r in result["rows"]))
  by = {(r["name"], r["batch"], r["prompt"]): r for r in result["rows"]}
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  width = 0.8 / max(len(names), 1)
  for i, name in enumerate(names):
    xs = [j + i * width for j in range(len(cases))]
    tok = [by[(name, B, P)]["tokens_per_s"] if (name, B, P) in by else 0 for B, P in cases]
    pre = [by[(name, B, P)]["prefill_s"] if (name, B, P) in by else 0 for B, P in cases]
    axes[0].bar(xs, tok, width, label=name, color=f"C{i}")
    axes[1].bar(xs, pre, width, label=name, color=f"C{i}")
  for ax, title in zip(axes, ("decode tokens/s (higher is better)",
                              "prefill seconds (lower is better)")):
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(cases))])
    ax.set_xticklabels([f"B{B} P{P}" for B, P in cases])
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
  axes[1].set_yscale("log")
  plotting.save_figure(fig, path)

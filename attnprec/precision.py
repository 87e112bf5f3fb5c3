"""Precision settings: plain, hashable data that lives beside the model, not inside it.

A `Precision` holds everything one phase (train, prefill/decode) needs to know about
numerics: the compute dtype of activations, the precision of the dense projections, and
the attention knobs of the precision contract (`float32_qk_product`, `float32_logits`,
`einsum_precision`: the fields of `contract.AttentionFlags`, which `Precision.attention`
hands the kernels as one value). It is registered with gin as `precision`, so a phase
scope chooses it: `decode/precision.float32_logits = True`.

Strings are used for dtypes and precisions (simpler for users and gin files); they are
validated here, once, with errors that name the valid values.
"""
import contextlib
import dataclasses
from typing import Optional

import gin
import jax
import jax.numpy as jnp

from attnprec import checks, cpu_features, kernels, platforms
# The names of dtypes and dot precisions live on the ground floor (the kernels use them);
# re-exported here, where users look for them.
from attnprec.contract import (ALGORITHM_PRESETS, DTYPES, KEY_OFFSETS,  # noqa: F401
                               KV_CACHE_DTYPES, LAX_PRECISIONS, SCALED_KV_DTYPES,
                               AttentionFlags, CacheStorage, PrecisionLike,
                               cache_storage_error, canonical_dtype,
                               canonical_precision, float32_qk_form_problems,
                               parse_dtype, parse_precision, precision_name)
from attnprec.errors import UserError, choice_error
from attnprec.kernels.blockwise import BlockSizes, block_sizes


_PRECISION_NAMES = list(LAX_PRECISIONS) + list(ALGORITHM_PRESETS)
# How a 16-bit projection's dot runs (`layers.project`); the products and the float32
# accumulation are the same in both forms, only the summation order may differ (the
# results differ by at most 1 ulp of the compute dtype after its one rounding):
#   'compute_dtype_dot'  c x c dot with a float32 result (the hardware's bf16 dot);
#   'float32_dot'        a float32 dot on the operands' values of c;
#   'auto'               chosen by the platform: on XLA:CPU by the CPU's features
#                        (`attnprec.cpu_features`), the c dot where it has a bf16 dot
#                        instruction, for projections of >= layers.MIN_ROWS_C_DOT rows.
PROJECTION_FORMS = ("auto", "compute_dtype_dot", "float32_dot")
# Where a 16-bit gated MLP rounds (`layers.MLP`):
#   'compute'  the gate and up projections rounded to c, the activation and the gating
#              product in c (each op rounds to c): the compute dtype throughout;
#   'float32'  the gate and up projections' float32 accumulations kept, the activation
#              and the product in float32, one rounding to c into the down projection
#              (fewer roundings, and faster on XLA:CPU: docs/performance.md);
#   'auto'     'float32' on XLA:CPU where the projection form in force is 'float32_dot'
#              (a CPU without bf16 dots: the gate and up projections are float32 dots
#              there, and the c activation's roundings are what made bf16 slower than
#              float32), 'compute' everywhere else (`Precision.mlp_form`).
MLP_ACTIVATIONS = ("auto", "compute", "float32")


@checks.validated(
    "precision", dtype=lambda v: checks.parsed_by(parse_dtype, DTYPES)(v),
    matmul_precision=lambda v: checks.parsed_by(parse_precision, _PRECISION_NAMES)(v),
    einsum_precision=lambda v: checks.parsed_by(parse_precision, _PRECISION_NAMES)(v),
    float32_qk_product=checks.boolean, float32_logits=checks.boolean,
    kernel=lambda v: checks.one_of(*kernels.CHOICES)(v),
    block_sizes=checks.instance_of(BlockSizes, "a BlockSizes (gin: blockwise.*)"),
    carrier_weights=checks.boolean, stored_weights=checks.boolean,
    kv_cache_k_dtype=checks.one_of(*KV_CACHE_DTYPES),
    kv_cache_v_dtype=checks.one_of(*KV_CACHE_DTYPES),
    kv_cache_k_scale=checks.optional(checks.one_of("token", "channel")),
    kv_cache_v_scale=checks.optional(checks.one_of("token", "channel")),
    key_offset=checks.one_of(*KEY_OFFSETS),
    projection_form=checks.one_of(*PROJECTION_FORMS),
    mlp_activation=checks.one_of(*MLP_ACTIVATIONS))
@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
  """Numerics of one phase. Hashable, so it can be a static argument of jit."""
  dtype: str = "float32"               # compute dtype of activations (params stay float32)
  matmul_precision: str = "default"    # dense projections: q/k/v/o, MLP, unembedding
  # The attention knobs: the fields of `contract.AttentionFlags` (same names, same
  # defaults), handed to the kernels together as `self.attention`.
  float32_qk_product: bool = True      # QK^T dot accumulates and returns float32
  float32_logits: bool = True          # soft-cap, mask and softmax run in float32
  einsum_precision: str = "default"    # passed to BOTH the qk and the wv einsum
  kernel: str = "dot_product"          # attention kernel: a name in attnprec.kernels.NAMES,
                                       # or 'auto' (blockwise for long T or S)
  # The blockwise kernel's block lengths (gin: blockwise.*, read with the phase's scope by
  # `phase_precision`): static data in the jit key, never read while tracing.
  block_sizes: BlockSizes = BlockSizes()
  # Set by `decoding.for_serving`, never by gin: the float32 weight matrices already hold
  # values of the compute dtype, so the dense projections run as float32 dots on them
  # (the products a bf16 dot forms, float32 accumulation, output rounded to the compute
  # dtype) with no cast at each use. For XLA:CPU, which has no bf16 dot units and would
  # convert bf16 weights to float32 again in every decode step.
  carrier_weights: bool = False
  # Set by `decoding.for_serving` on a TPU or GPU, never by gin: the weight matrices are
  # stored in the (16-bit) compute dtype while serving, the values every projection would
  # cast them to at each use, cast once: the same products (float32 sums may differ in
  # order), half the bytes each decode step reads (on XLA:CPU the float32-carried form is
  # faster: `carrier_weights`).
  stored_weights: bool = False
  # The KV cache's storage (read by prefill, which writes it, and by every decode step),
  # separately for keys and values (`attnprec.kvquant`, the contract's cache rows):
  #   'compute' (default): values of the compute dtype, exactly today's cache;
  #   'float32' / 'bfloat16': values of that dtype, read back as the compute dtype;
  #   'int8' / 'float8_e4m3fn' / 'float8_e5m2': codes with float32 absmax scales; the
  #   codes enter the attention dots exactly, the scales are applied to the logits
  #   (or q) and the probabilities, never by dequantizing the cache.
  kv_cache_k_dtype: str = "compute"
  kv_cache_v_dtype: str = "compute"
  # Scale granularity of a scaled dtype: 'token' (one scale per token and kv head, over
  # the head dim; what None means) or, for keys only, 'channel' (one per kv head and
  # head-dim channel, fixed at prefill from the prompt's keys). Unscaled dtypes: None.
  kv_cache_k_scale: Optional[str] = None
  kv_cache_v_scale: Optional[str] = None
  # A vector subtracted from every rotated key in float32 before the keys' one rounding
  # (`attnprec.keyoffset`, the contract's offset row): 'none' (today's keys, bit for bit),
  # 'zero' (the float32 key path, c = 0: a control), 'bias' (from the model's key bias),
  # 'prefill_mean' (the prompt's mean key, frozen into the cache).
  key_offset: str = "none"
  # The form of a 16-bit projection's dot (PROJECTION_FORMS above); float32 compute and
  # a dot-algorithm matmul_precision have one form only, so they take 'auto' alone.
  projection_form: str = "auto"
  # Where a 16-bit MLP's activation runs (MLP_ACTIVATIONS above); float32 compute has one
  # way only, so it takes 'auto' or 'compute' alone.
  mlp_activation: str = "auto"

  def __post_init__(self):
    # Validate eagerly so a bad gin value fails at configuration time, not mid-trace; one
    # spelling per value (what the precision line and results record, and what compares
    # equal): 'BFLOAT16' or jnp.bfloat16 is 'bfloat16', lax.Precision.HIGHEST 'highest'.
    object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
    for name in ("matmul_precision", "einsum_precision"):
      object.__setattr__(self, name, canonical_precision(getattr(self, name)))
    self.attention   # the attention knobs validate themselves (`AttentionFlags`)
    for name in ("carrier_weights", "stored_weights"):
      if not isinstance(getattr(self, name), bool):
        raise choice_error(name, getattr(self, name), (True, False))
    if self.mlp_activation == "float32" and self.compute_dtype == jnp.float32:
      raise UserError(f"precision.mlp_activation={self.mlp_activation!r} keeps a 16-bit "
                      f"MLP's activation in float32, but dtype='float32' computes every "
                      f"activation in float32 already: the setting would not be used. "
                      f"Remove it, or use a 16-bit dtype (valid values: "
                      f"{', '.join(repr(m) for m in MLP_ACTIVATIONS)}).")
    if self.projection_form != "auto" and (
        self.compute_dtype == jnp.float32 or
        self.matmul_precision.upper() in ALGORITHM_PRESETS):
      why = ("dtype='float32' runs every projection as a float32 dot"
             if self.compute_dtype == jnp.float32 else
             f"matmul_precision={self.matmul_precision!r} names its own operand types")
      raise UserError(f"precision.projection_form={self.projection_form!r} chooses the "
                      f"form of a 16-bit projection's dot, but {why}: the setting would "
                      f"not be used. Remove it (or keep 'auto'), or use a 16-bit dtype "
                      f"with a plain matmul_precision.")
    why = cache_storage_error(self.compute_dtype, k_dtype=self.kv_cache_k_dtype,
                              v_dtype=self.kv_cache_v_dtype, k_scale=self.kv_cache_k_scale,
                              v_scale=self.kv_cache_v_scale)
    if why:
      raise UserError(why)
    # The registry knows the kernels and what each refuses (e.g. 'jax_nn' has no
    # float32_qk_product=False): an unusable combination fails here, not while tracing.
    why = kernels.refusal(self)
    if why:
      raise UserError(why)

  @property
  def compute_dtype(self) -> jnp.dtype:
    return parse_dtype(self.dtype)

  @property
  def cache_storage(self) -> CacheStorage:
    """The KV cache setting, resolved: a scaled dtype's None granularity is 'token'."""
    scale = lambda d, g: (g or "token") if d in SCALED_KV_DTYPES else None  # noqa: E731
    return CacheStorage(k_dtype=self.kv_cache_k_dtype, v_dtype=self.kv_cache_v_dtype,
                        k_scale=scale(self.kv_cache_k_dtype, self.kv_cache_k_scale),
                        v_scale=scale(self.kv_cache_v_dtype, self.kv_cache_v_scale),
                        key_offset=self.key_offset)

  @property
  def matmul(self) -> PrecisionLike:
    return parse_precision(self.matmul_precision)

  @property
  def attention(self) -> AttentionFlags:
    """The attention knobs as one static value: what every kernel, the stage table
    (`contract.stage_dtypes`) and the audit take."""
    return AttentionFlags(**{name: getattr(self, name) for name in ATTENTION_FIELDS})

  def projection(self, backend: Optional[str] = None) -> str:
    """The projection form in force on `backend` (default: JAX's): 'float32' (float32
    compute, or a dot-algorithm preset's own dot), 'compute_dtype_dot', 'float32_dot', or
    'by_rows' (the c dot for >= layers.MIN_ROWS_C_DOT rows, a float32 dot on the
    operands' values of c below: decode steps, where XLA:CPU's bf16 matrix-vector path
    is slow)."""
    if self.compute_dtype == jnp.float32 or self.matmul_precision.upper() in ALGORITHM_PRESETS:
      return "float32" if self.compute_dtype == jnp.float32 else "preset"
    if self.projection_form != "auto":
      return self.projection_form
    backend = backend or _target_backend()
    if backend == "cpu" and cpu_features.bf16_features() == ():
      return "float32_dot"
    return "by_rows"

  def float32_qk_operands(self, backend: Optional[str] = None,
                          num_queries: Optional[int] = None) -> bool:
    """Whether the attention's QK dot runs in the float32 form too: on q and k cast
    (exactly) to float32. Only on XLA:CPU (`backend`, default: the one traced for), where
    it is what a CPU without bf16 dots runs fastest; elsewhere a float32 dot at DEFAULT
    precision may multiply in fewer bits than c holds (one bf16 pass on tpu, TF32 on
    cuda). Only where the projection form in force is 'float32_dot' (a CPU without bf16
    dots under 'auto', or forced), the kernel takes the form
    (`kernels.takes_float32_qk_form`), and the contract allows it
    (`contract.float32_qk_form_problems`: the float32 QK product of a 16-bit c, keys of c,
    no dot-algorithm einsum_precision). Only for calls of more than one query
    (`num_queries`, None: any): a decode step, or a one-token prefill, keeps the
    c x c -> float32 dot, which measured as fast or faster there (docs/performance.md).
    The products and the float32 accumulation are those of the c x c -> float32 dot;
    only the summation order may differ."""
    k_codes = self.kv_cache_k_dtype if self.kv_cache_k_dtype in SCALED_KV_DTYPES else None
    return (self._float32_dots_on_cpu(backend)
            and kernels.takes_float32_qk_form(self.kernel) and num_queries != 1
            and not float32_qk_form_problems(self.compute_dtype, self.attention,
                                             k_codes=k_codes))

  def mlp_form(self, backend: Optional[str] = None) -> str:
    """Where a gated MLP rounds on `backend` (default: the one traced for): 'compute' or
    'float32' (MLP_ACTIVATIONS). 'auto' is 'float32' only on XLA:CPU where the projection
    form in force is 'float32_dot' (the gate and up projections are float32 dots there:
    their sums are kept instead of rounded, as the explicit 'float32' does). Float32
    compute: 'compute' (one way only)."""
    if self.mlp_activation != "auto":
      return self.mlp_activation
    if self.compute_dtype == jnp.float32:
      return "compute"
    return "float32" if self._float32_dots_on_cpu(backend) else "compute"

  def _float32_dots_on_cpu(self, backend: Optional[str] = None) -> bool:
    """Whether `backend` (default: the one traced for) is XLA:CPU and the projection form
    in force there is 'float32_dot': where the QK dot's float32 form and the 'auto' MLP
    activation follow the projections."""
    backend = backend or _target_backend()
    return backend == "cpu" and self.projection(backend) == "float32_dot"

  def _mlp(self, backend: Optional[str] = None) -> str:
    """' mlp_activation=float32' (set), ' mlp_activation=auto:float32' (resolved so), or ''."""
    form = self.mlp_form(backend)
    if form == "compute":
      return ""
    return f" mlp_activation={'auto:' if self.mlp_activation == 'auto' else ''}{form}"

  def describe_projection(self, backend: Optional[str] = None) -> str:
    """'' for float32 compute, else ' projections=FORM' (with why, for 'auto')."""
    form = self.projection(backend)
    if form in ("float32", "preset"):
      return ""
    if self.projection_form != "auto":
      return f" projections={form}" + self._qk_form(backend)
    backend = backend or _target_backend()
    why = (cpu_features.describe() if backend == "cpu"
           else backend)
    return f" projections=auto:{form}({why})" + self._qk_form(backend)

  def _qk_form(self, backend: Optional[str] = None) -> str:
    return " qk_dot=float32_dot(queries>1)" if self.float32_qk_operands(backend) else ""

  def platform(self, backend: Optional[str] = None) -> str:
    """The `platforms` name of the backend traced for ('cpu', 'tpu', 'cuda'): where
    'auto' choices resolve (`kernels.resolve`)."""
    return platforms.local_platform(backend or _target_backend()) or "cpu"

  def describe(self, backend: Optional[str] = None) -> str:
    """The precision line; 'auto' forms resolved for `backend` (default: the one traced
    for, `target_backend`, else this machine's)."""
    return (f"dtype={self.dtype} {self.attention.describe()} "
            f"matmul_precision={self.matmul_precision} kernel={self.kernel}"
            + self._blocks() + self.describe_projection(backend)
            + self._mlp(backend)
            + (" weights=float32-carried" if self.carrier_weights else "")
            + (f" weights={self.dtype}-stored" if self.stored_weights else "")
            + f" {self.cache_storage.describe()}")

  def _blocks(self) -> str:
    return f" blocks={self.block_sizes.describe()}" if kernels.runs_blockwise(self.kernel) \
        else ""


# The backend a program is traced for, when not the one this process runs on (the audit
# and inspect lowering for tpu / cuda from a CPU machine): 'auto' forms resolve for it.
# The variable lives on the ground floor (`platforms.TRACED_FOR`): the kernels read it too.
_TARGET = platforms.TRACED_FOR


def _target_backend() -> str:
  return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def target_backend(backend: Optional[str]):
  """While tracing inside this block, `Precision.projection()` resolves 'auto' for
  `backend` (a JAX backend name: 'cpu', 'tpu', 'gpu'; None: the local one)."""
  token = _TARGET.set(backend)
  try:
    yield
  finally:
    _TARGET.reset(token)


# Precision's fields that make up its `attention` value (tests/test_stage_dtypes.py
# checks that Precision has each, with AttentionFlags' default).
ATTENTION_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionFlags))

REFERENCE = Precision(dtype="float32", matmul_precision="highest", float32_qk_product=True,
                      float32_logits=True, einsum_precision="highest")


# The gin root of a phase's numerics (`precision.*`); gin wraps a copy of the class, so
# constructing `Precision` directly in code never reads gin bindings. block_sizes is not
# bound directly: `phase_precision` fills it from `blockwise.*`.
# Filled in by code, never bound: block_sizes from `blockwise.*` (phase_precision),
# carrier_weights and stored_weights by `decoding.for_serving`.
NOT_BINDABLE = ("block_sizes", "carrier_weights", "stored_weights")
precision_root = gin.external_configurable(Precision, "precision", denylist=list(NOT_BINDABLE))


def phase_precision() -> Precision:
  """The Precision of the current gin scope (call it under `gin.config_scope(phase)`):
  `precision.*` and the blockwise kernel's `blockwise.*`, both read in that scope, now,
  into plain static data (so `decode/blockwise.kv_block = 128` is decode only, and a new
  value is a new jit key)."""
  return dataclasses.replace(precision_root(), block_sizes=block_sizes())

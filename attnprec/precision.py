"""Precision settings: plain, hashable data that lives beside the model, not inside it.

A `Precision` holds everything one phase (train, prefill/decode) needs to know about
numerics: the compute dtype of activations, the precision of the dense projections, and
the three attention knobs of the precision contract (`float32_qk_product`,
`float32_logits`, `einsum_precision`). It is registered with gin as `precision`, so a
phase scope chooses it: `decode/precision.float32_logits = True`.

Strings are used for dtypes and precisions (simpler for users and gin files); they are
validated here, once, with errors that name the valid values.
"""
import dataclasses
from typing import Union

import gin
import jax
import jax.numpy as jnp

from attnprec import checks
from attnprec.errors import choice_error

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
LAX_PRECISIONS = {p.name.lower(): p for p in jax.lax.Precision}  # default, high, highest
ALGORITHM_PRESETS = {p.name: p for p in jax.lax.DotAlgorithmPreset if p.name != "DEFAULT"}
KERNELS = ("dot_product", "blockwise", "jax_nn")  # see attnprec.attention.attend

PrecisionLike = Union[jax.lax.Precision, jax.lax.DotAlgorithmPreset]


def parse_dtype(name) -> jnp.dtype:
  """'bfloat16' | 'float32' | 'float16' (or a dtype) -> jnp dtype."""
  if not isinstance(name, str):
    try:
      name = jnp.dtype(name).name
    except TypeError:
      raise choice_error("dtype", name, DTYPES) from None
  key = name.lower()
  if key not in DTYPES:
    raise choice_error("dtype", name, DTYPES)
  return jnp.dtype(DTYPES[key])


def parse_precision(name) -> PrecisionLike:
  """A `jax.lax.Precision` name (any case) or a `jax.lax.DotAlgorithmPreset` name.

  Returns the object to pass as `precision=` to `jnp.einsum` / `lax.dot_general`.
  """
  if isinstance(name, (jax.lax.Precision, jax.lax.DotAlgorithmPreset)):
    return name
  if isinstance(name, str):
    if name.lower() in LAX_PRECISIONS:
      return LAX_PRECISIONS[name.lower()]
    if name.upper() in ALGORITHM_PRESETS:
      return ALGORITHM_PRESETS[name.upper()]
  raise choice_error("einsum/matmul precision", name,
                     list(LAX_PRECISIONS) + list(ALGORITHM_PRESETS))


def precision_name(p: PrecisionLike) -> str:
  """The name the lowered StableHLO shows for a precision (DEFAULT, HIGHEST, ...)."""
  return p.name


_PRECISION_NAMES = list(LAX_PRECISIONS) + list(ALGORITHM_PRESETS)


@checks.validated(
    "precision", dtype=lambda v: checks.parsed_by(parse_dtype, DTYPES)(v),
    matmul_precision=lambda v: checks.parsed_by(parse_precision, _PRECISION_NAMES)(v),
    einsum_precision=lambda v: checks.parsed_by(parse_precision, _PRECISION_NAMES)(v),
    float32_qk_product=checks.boolean, float32_logits=checks.boolean,
    kernel=lambda v: checks.one_of(*KERNELS)(v))
@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
  """Numerics of one phase. Hashable, so it can be a static argument of jit."""
  dtype: str = "float32"               # compute dtype of activations (params stay float32)
  matmul_precision: str = "default"    # dense projections: q/k/v/o, MLP, unembedding
  float32_qk_product: bool = True      # QK^T dot accumulates and returns float32
  float32_logits: bool = True          # soft-cap, mask and softmax run in float32
  einsum_precision: str = "default"    # passed to BOTH the qk and the wv einsum
  kernel: str = "dot_product"          # attention kernel (see attnprec.attention)

  def __post_init__(self):
    # Validate eagerly so a bad gin value fails at configuration time, not mid-trace.
    parse_dtype(self.dtype)
    parse_precision(self.matmul_precision)
    parse_precision(self.einsum_precision)
    for flag in ("float32_qk_product", "float32_logits"):
      if not isinstance(getattr(self, flag), bool):
        raise choice_error(flag, getattr(self, flag), (True, False))
    if self.kernel not in KERNELS:
      raise choice_error("attention kernel", self.kernel, KERNELS)

  @property
  def compute_dtype(self) -> jnp.dtype:
    return parse_dtype(self.dtype)

  @property
  def matmul(self) -> PrecisionLike:
    return parse_precision(self.matmul_precision)

  def attention_kwargs(self) -> dict:
    """Keyword arguments for `attnprec.attention.dot_product_attention`."""
    return dict(float32_qk_product=self.float32_qk_product,
                float32_logits=self.float32_logits,
                einsum_precision=self.einsum_precision)

  def describe(self) -> str:
    return (f"dtype={self.dtype} float32_qk_product={self.float32_qk_product} "
            f"float32_logits={self.float32_logits} einsum_precision={self.einsum_precision} "
            f"matmul_precision={self.matmul_precision} kernel={self.kernel}")


REFERENCE = Precision(dtype="float32", matmul_precision="highest", float32_qk_product=True,
                      float32_logits=True, einsum_precision="highest")


# The gin root for a phase's numerics; call it under `gin.config_scope(phase)`. gin wraps a
# copy of the class, so constructing `Precision` directly in code never reads gin bindings.
phase_precision = gin.external_configurable(Precision, "precision")

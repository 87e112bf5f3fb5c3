"""Architecture config: what a `gin/models/*.gin` file binds. No precision here.

Precision (dtypes, matmul precision, attention flags) is per phase and lives in
`attnprec.precision.Precision`, never in the architecture.
"""
import dataclasses
import json
from typing import Optional, Tuple

import gin

from attnprec import checks
from attnprec.errors import UserError, choice_error

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
LAYER_KINDS = ("global", "local")


@checks.validated(
    "model", norm_eps=checks.number(gt=0), query_scale=checks.optional(checks.number(gt=0)),
    attn_logit_soft_cap=checks.optional(checks.number(gt=0)), final_logit_soft_cap=checks.optional(checks.number(gt=0)),
    rope_base=checks.number(gt=0), rope_base_local=checks.optional(checks.number(gt=0)),
    rope_scale=checks.number(gt=0), sliding_window=checks.optional(checks.at_least(1)),
    max_seq_len=checks.at_least(1),
    layer_pattern=checks.sequence_of(checks.one_of(*LAYER_KINDS)))
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """A decoder-only transformer. Covers Llama, Qwen2, Gemma, Gemma 2 and Gemma 3."""
  vocab_size: int                       # V
  d_model: int                          # D
  num_layers: int                       # L
  num_heads: int                        # N
  num_kv_heads: int                     # K (N % K == 0; K == 1 is MQA)
  head_dim: int                         # H
  mlp_hidden: int                       # F, hidden width of the gated MLP
  activation: str = "silu"              # gate activation: silu (SwiGLU) / gelu_tanh (GeGLU)
  norm_eps: float = 1e-6                # RMSNorm epsilon
  norm_plus_one: bool = False           # RMSNorm scales by (1 + w) (Gemma)
  embed_scale: bool = False             # multiply embeddings by sqrt(D) (Gemma)
  tie_embeddings: bool = True           # unembedding = embedding^T
  qkv_bias: bool = False                # bias on q/k/v projections (Qwen2)
  qk_norm: bool = False                 # RMSNorm on q and k per head (Gemma 3)
  post_attn_norm: bool = False          # norm after attention, before residual (Gemma 2/3)
  post_mlp_norm: bool = False           # norm after the MLP, before residual (Gemma 2/3)
  query_scale: Optional[float] = None   # None -> H ** -0.5
  attn_logit_soft_cap: Optional[float] = None   # Gemma 2
  final_logit_soft_cap: Optional[float] = None  # Gemma 2
  rope_base: float = 10_000.0           # RoPE base of global layers
  rope_base_local: Optional[float] = None  # RoPE base of local layers (None -> rope_base)
  rope_scale: float = 1.0               # linear RoPE position scaling of global layers
  sliding_window: Optional[int] = None  # window of "local" layers
  layer_pattern: Tuple[str, ...] = ("global",)  # repeated cyclically over the layers
  max_seq_len: int = 8192               # longest context the model is meant for
  # Not architecture but the program's form: run the blocks as one `lax.scan` over
  # stacked parameters (`attnprec.model`, `layout.stack`) instead of unrolled; the same
  # numbers, a program (and compile time) that does not grow with L.
  scan_layers: bool = False

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_hidden"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise UserError(f"model.{name} must be a positive integer, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      divisors = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
      raise UserError(
          f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads="
          f"{self.num_kv_heads}; valid num_kv_heads values are: {divisors}.")
    if self.activation not in ACTIVATIONS:
      raise choice_error("model.activation", self.activation, ACTIVATIONS)
    object.__setattr__(self, "layer_pattern", tuple(self.layer_pattern))
    for kind in self.layer_pattern:
      if kind not in LAYER_KINDS:
        raise choice_error("model.layer_pattern entry", kind, LAYER_KINDS)
    if self.scan_layers and len({self.layer_kind(i) for i in range(self.num_layers)}) > 1:
      raise UserError(
          f"model.scan_layers = True runs one block body for every layer, but "
          f"model.layer_pattern = {self.layer_pattern} mixes layer kinds (their windows "
          f"and RoPE bases differ, and each needs its own attention mask); set "
          f"model.scan_layers = False for this model (valid with scan_layers: a pattern "
          f"of one kind, {LAYER_KINDS[0]!r} or {LAYER_KINDS[1]!r}).")
    if "local" in self.layer_pattern and not self.sliding_window:
      raise UserError("model.layer_pattern has 'local' layers but model.sliding_window is "
                      "not set; set it to a positive window length.")

  @property
  def effective_query_scale(self) -> float:
    """The query scale the attention applies: query_scale, or H ** -0.5 when unset."""
    return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

  def layer_kind(self, i: int) -> str:
    return self.layer_pattern[i % len(self.layer_pattern)]

  def window(self, i: int) -> Optional[int]:
    return self.sliding_window if self.layer_kind(i) == "local" else None

  def rope(self, i: int) -> Tuple[float, float]:
    """(base, position scale) of layer i."""
    if self.layer_kind(i) == "local":
      return (self.rope_base_local or self.rope_base), 1.0
    return self.rope_base, self.rope_scale

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), indent=1)

  @classmethod
  def from_dict(cls, d: dict, origin: str = "model config") -> "ModelConfig":
    """From a model.json object; unknown or missing required fields are UserErrors."""
    if not isinstance(d, dict):
      raise UserError(f"{origin} holds a JSON {type(d).__name__}, not an object with the "
                      f"model.* fields.")
    fields = dataclasses.fields(cls)
    known = {f.name for f in fields}
    if d.get("key_offset") is False:   # written by older versions; it meant "none"
      d = {k: v for k, v in d.items() if k != "key_offset"}
    unknown = sorted(set(d) - known)
    if unknown:
      raise UserError(f"Unknown field(s) {unknown} in {origin}; valid: {sorted(known)}.")
    missing = sorted(f.name for f in fields if f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING and f.name not in d)
    if missing:
      raise UserError(f"{origin} lacks the required field(s) {missing}.")
    try:
      return cls(**d)
    except UserError as e:     # a field's own check: say which file holds the value
      raise UserError(f"{origin}: {e}") from None


# The gin root for the architecture (`gin/models/*.gin` bind `model.*`). gin wraps a copy
# of the class, so constructing `ModelConfig` directly in code never reads gin bindings.
model_config = gin.external_configurable(ModelConfig, "model")


def bound_scan_layers() -> Optional[bool]:
  """The gin binding `model.scan_layers` (None when none is bound): the program form the
  loader gives a checkpoint, whose architecture comes from its own files
  (`attnprec.checkpoints.load`)."""
  try:
    value = gin.query_parameter("model.scan_layers")
  except ValueError:
    return None
  if not isinstance(value, bool):
    raise UserError(f"model.scan_layers must be True or False, got {value!r}.")
  return value


# The one `model.*` parameter a runner that loads a checkpoint reads (its architecture
# comes from the checkpoint's files): `ginutils.calls` follows the loader to this function
# and lets `--gin.model.scan_layers` through, while `--gin.model.num_layers=3` given to
# such a runner stays refused (it would be ignored).
bound_scan_layers.gin_reads = ("model.scan_layers",)

"""The precision contract per platform: what each knob means on XLA:CPU, TPU and NVIDIA GPUs.

The contract's types (`contract.stage_dtypes`: operand and result dtypes of the two
attention dots, the softmax dtype) mean the same everywhere. Its `precision` knobs
(`einsum_precision`, `matmul_precision`: a `jax.lax.Precision` or a
`jax.lax.DotAlgorithmPreset`) do not: they say how the matmul unit multiplies float32
operands, and that is the backend's business:

  | platform | f32 x f32 at DEFAULT | HIGH          | HIGHEST        | bf16 x bf16 (any) | f16 x f16: DEFAULT / HIGH / HIGHEST |
  | cpu      | f32                  | f32           | f32            | exact products    | exact products                      |
  | tpu      | 1 bf16 pass          | 3 bf16 passes | 6 bf16 passes  | exact products    | 1 bf16 pass / 3 / 3 bf16 passes     |
  | cuda     | TF32 (Ampere+)       | TF32          | f32            | exact products    | exact products                      |

(`TABLE`, rendered by `markdown_table` into docs/contract.md). A float32 operand that
only holds bf16 values (q and k upcast from bf16 for the float32 QK product) loses nothing
to any of these: its values already fit a bf16 pass or TF32. float16 values do not fit a
bf16 pass: on TPU a dot of float16 operands, or of float32 operands upcast from float16
(XLA folds the upcast), multiplies in one bf16 pass at DEFAULT and in 3 passes at HIGH,
at HIGHEST and under the 6-pass preset (`Platform.f16_products`, `f16_max`; measured on a
TPU v5e with jax 0.10.2, results/tpu-f16/f16_products.py and its output).

Which dot-algorithm presets each backend accepts (`Platform.presets`); jax lowers most
presets for any platform and the backend's compiler refuses the rest, after the program
was built (XLA:CPU's are refused by jax's lowering itself). Sources:
  cpu   jax/_src/lax/lax.py `_dot_general_lower` (jax 0.10.2): "is not supported by
        dot_general on CPU" for every preset outside its set;
  tpu   jax/tests/lax_test.py `testDotAlgorithm` (the TPU set) and
        `testDotAlgorithmCasting` ("F32_F32_F32 is not supported on TPU"); the TPU compiler
        itself is not public;
  cuda  XLA xla/service/algorithm_util.cc `IsSupportedDotAlgorithmOnGpu` (compute
        capability 8.0+, Ampere; the float8 presets need 8.9+ and float8 operands).
A preset the target platform does not accept is refused before anything is lowered
(`refusal`, `check_precision`), naming the platform; the float8 presets are refused
everywhere: attnprec's dots never take float8 operands (a quantized cache's codes enter
its dots converted to c).

This module is the ground floor: plain data and string checks, no jax.
"""
import contextvars
import dataclasses
from typing import Dict, FrozenSet, Optional

from attnprec.errors import UserError

PLATFORMS = ("cpu", "tpu", "cuda")     # jax's lowering platform names
DEFAULT_PLATFORM = "cpu"
LAX_PRECISIONS = ("DEFAULT", "HIGH", "HIGHEST")

# How a dot multiplies: the significand bits each operand keeps (implicit bit counted).
# A multi-pass emulation keeps about as many bits as its passes add up to.
ARITHMETIC_BITS = {"bf16": 8, "f16": 11, "tf32": 11, "bf16_3x": 16, "tf32_3x": 22,
                   "bf16_6x": 24, "bf16_9x": 24, "f32": 24, "f64": 53}
ARITHMETIC_TEXT = {"bf16": "one bf16 pass", "f16": "f16", "tf32": "TF32",
                   "bf16_3x": "3 bf16 passes", "tf32_3x": "3 TF32 passes",
                   "bf16_6x": "6 bf16 passes (~f32)", "bf16_9x": "9 bf16 passes (~f32)",
                   "f32": "f32", "f64": "f64"}
# The significand bits an operand's values have, by the type they were made in (an f32
# operand upcast from bf16 holds bf16 values); 8-bit codes are exact in bf16.
VALUE_BITS = {"bf16": 8, "f16": 11, "f32": 24, "f64": 53, "i8": 8, "f8E4M3FN": 4,
              "f8E5M2": 3}

_F8 = ("ANY_F8_ANY_F8_F32", "ANY_F8_ANY_F8_F32_FAST_ACCUM", "ANY_F8_ANY_F8_ANY",
       "ANY_F8_ANY_F8_ANY_FAST_ACCUM")


@dataclasses.dataclass(frozen=True)
class Platform:
  """One row of the table: what the precision knobs mean on a backend."""
  name: str                        # lowering platform ('cpu', 'tpu', 'cuda')
  backend: str                     # jax.default_backend() on such a machine
  hardware: str
  f32_products: Dict[str, str]     # lax Precision -> how f32 x f32 dots multiply
  bf16: str                        # what a bf16 x bf16 dot does
  presets: FrozenSet[str]          # DotAlgorithmPreset names the backend accepts
  presets_source: str
  # lax Precision -> how a dot multiplies operands that hold float16 values (float16
  # operands, or float32 ones upcast from float16); 'f16': exact products
  f16_products: Dict[str, str] = dataclasses.field(
      default_factory=lambda: dict.fromkeys(LAX_PRECISIONS, "f16"))
  # the most a dot on float16 values keeps there under any dot algorithm (None: what
  # the algorithm says)
  f16_max: Optional[str] = None
  f16_source: str = ""
  # What a compiled dot's result type is there: 'accumulation' (XLA:CPU, XLA:GPU: the
  # type the products are summed in; a rounding after it is a separate convert) or
  # 'storage' (TPU: the MXU sums in f32 whatever the HLO says; a `convolution`'s result
  # type is what that f32 sum is rounded to and stored as).
  dot_result: str = "accumulation"
  # lax Precision -> the type the arithmetic takes f32 operands as (TPU at DEFAULT: one
  # bf16 pass). The compiler may store a dot's operand, or a result that only such dots
  # read, in that type: it rounds where the dot would round anyway, nothing is lost
  # (`report.platform_rewrite` names each such rewrite).
  operand_rounding: Dict[str, str] = dataclasses.field(default_factory=dict)
  compiled_source: str = ""
  # The kernel `precision.kernel = 'auto'` runs for a decode step there (one query over
  # the cache), and the measurement it rests on.
  auto_decode: str = "blockwise"
  auto_source: str = ""
  # The kernel 'auto' runs for a long call (a prefill of many queries, or a short one into
  # a long cache: `kernels.AUTO_MIN_QUERIES` / `AUTO_MIN_KEYS`), where a precision it
  # honours ('blockwise' otherwise: it honours every one), and the measurement.
  auto_long: str = "blockwise"
  auto_long_source: str = ""
  # How a decode step (one new row per sequence) writes its rows into the KV cache there
  # (`cache.decode_write_form`): 'scatter' (one scatter of B rows, as every other write) or
  # 'slices' (B update slices); the same bits either way. `decode_write` for a side
  # stored as values (the compute dtype, float32, bfloat16), `decode_write_codes` for a
  # side stored as int8 / float8 codes (the codes and their scales); the measurement.
  decode_write: str = "scatter"
  decode_write_codes: str = "scatter"
  decode_write_source: str = ""
  # Compiler options for a program compiled only to read what the backend made of it (the
  # optimized HLO text the audit and `inspect` check; never one that runs): options that
  # change the machine code and not that text, so it compiles faster; and the evidence.
  text_compile_options: Dict[str, object] = dataclasses.field(default_factory=dict)
  text_compile_source: str = ""

  def arithmetic(self, precision: str) -> str:
    """'tf32', 'bf16', ... for a lax Precision name on f32 operands."""
    return self.f32_products[precision.upper()]

  def f16_arithmetic(self, precision: Optional[str] = None,
                     algorithm: Optional[str] = None) -> str:
    """How a dot on operands holding float16 values multiplies: at a lax Precision name,
    or under an algorithm's arithmetic ('bf16_3x', ...; capped at `f16_max`)."""
    if algorithm is None:
      return self.f16_products[precision.upper()]
    if self.f16_max and ARITHMETIC_BITS[algorithm] > ARITHMETIC_BITS[self.f16_max]:
      return self.f16_max
    return algorithm


TABLE: Dict[str, Platform] = {
    "cpu": Platform(
        name="cpu", backend="cpu", hardware="XLA:CPU",
        f32_products={"DEFAULT": "f32", "HIGH": "f32", "HIGHEST": "f32"},
        bf16="exact products, f32 accumulation (a bf16 result rounded once)",
        presets=frozenset({"F16_F16_F16", "F32_F32_F32", "F64_F64_F64", "BF16_BF16_F32",
                           "BF16_BF16_F32_X3", "BF16_BF16_F32_X6"}),
        presets_source="jax/_src/lax/lax.py `_dot_general_lower`, which refuses the "
                       "others when lowering",
        auto_decode="blockwise",
        auto_source="SmolLM2-135M on XLA:CPU: blockwise decode steps took 0.62-1.06x the "
                    "dense kernel's time over caches of 33-501 positions "
                    "(docs/performance.md, 'Short caches')",
        auto_long="blockwise",
        auto_long_source="SmolLM2-135M on XLA:CPU: blockwise prefill was faster than the "
                         "dense kernel at 1000 tokens (docs/performance.md); the Pallas "
                         "kernels run interpreted there",
        decode_write="scatter",
        decode_write_source="XLA:CPU writes a scatter into a uint16 / uint8 buffer in "
                            "place; as update slices it fused the last one into the "
                            "kernel's read and copied each layer's cache per step "
                            "(tests/test_cache.py checks the compiled step for copies)",
        text_compile_options={"xla_backend_optimization_level": 0},
        text_compile_source="XLA:CPU's backend optimization level is LLVM's: at 0 the "
                            "optimized HLO is the same text (tests/test_audit.py compares "
                            "a train step, prefill and decode step compiled both ways), "
                            "in about half the compile time"),
    "tpu": Platform(
        name="tpu", backend="tpu", hardware="TPU, MXU",
        f32_products={"DEFAULT": "bf16", "HIGH": "bf16_3x", "HIGHEST": "bf16_6x"},
        bf16="exact products, f32 accumulation in the MXU",
        presets=frozenset({"BF16_BF16_F32", "BF16_BF16_F32_X3", "BF16_BF16_F32_X6"}),
        presets_source="jax/tests/lax_test.py `testDotAlgorithm` and "
                       "`testDotAlgorithmCasting`; the TPU compiler refuses the others",
        f16_products={"DEFAULT": "bf16", "HIGH": "bf16_3x", "HIGHEST": "bf16_3x"},
        f16_max="bf16_3x",
        f16_source="measured on a TPU v5e with jax 0.10.2, float16 operands and float32 "
                   "ones upcast from float16 alike: results/tpu-f16",
        dot_result="storage", operand_rounding={"DEFAULT": "bf16"},
        auto_long="flash",
        auto_long_source="a TPU v5e, one run each: attention alone at Qwen2-7B's shape "
                         "with both flags, flash 0.77 / 6.13 ms against the dense "
                         "kernel's 2.16 / 37.1 ms at 2k / 8k (results/tpu-flash/"
                         "flags.json); a train step of Qwen2.5-0.5B's shape at 1 x 4096, "
                         "flash 268 ms, dot_product 605, blockwise 1039 (results/"
                         "tpu-device-check/device_check-train.json)",
        auto_decode="dot_product",
        auto_source="a TPU v5e: attention alone at batch 8, caches of 8k and 32k, the "
                    "blockwise decode step took 1.6-2.8x the dense kernel's time, the "
                    "flash kernel's (reading the layer in place) 1.40x / 1.73x, while "
                    "the dense kernel read the 32k cache at 0.99 of the measured HBM "
                    "bandwidth (results/tpu-decode/stacked_loop.json); a whole decode "
                    "step of Qwen2.5-0.5B's shape at batch 1 (cache ~4k) took ~6x its "
                    "time under blockwise",
        decode_write="slices", decode_write_codes="scatter",
        decode_write_source="a TPU v5e, the whole decode loop of Qwen2.5-0.5B's shape "
                            "(scanned, both flags) timed both ways in one run: batch 8, "
                            "bf16 caches of 32k / 8k, 7.03 / 3.78 ms a step as update "
                            "slices (0.85x / 1.07x the HBM floor), 39.1 / 8.37 ms as one "
                            "scatter, which made XLA relayout the stack and copy each "
                            "layer's cache out every step; batch 1, 8k: 1.94 / 2.05 ms "
                            "(results/tpu-model/decode_write/decode_write.log); with a "
                            "1k cache at batch 8 / 32, 2.74 / 6.16 ms against the "
                            "scatter's 2.50 / 5.38 in an earlier run (results/tpu-model/"
                            "tpu_model.json, tpu_model-0da162b.json). An int8 cache as "
                            "slices: 12.1 ms at 8 x 8k against 7.6 as one scatter "
                            "(tpu_model-0da162b.json), and out of memory at 8 x 32k "
                            "(tpu_model-a5efcf9.json); float8 codes follow int8's form, "
                            "not measured",
        compiled_source="the TPU compiler's optimized HLO on a TPU v5e, jax 0.10.2 "
                        "(tests/fixtures/tpu): every dot a `convolution`, its result "
                        "type the stored type; in the float32 model at DEFAULT the wv "
                        "dot's result is stored as bf16 and read only by the "
                        "o-projection, a DEFAULT dot (one bf16 pass)"),
    "cuda": Platform(
        name="cuda", backend="gpu", hardware="NVIDIA GPU, sm_80+ (Ampere)",
        f32_products={"DEFAULT": "tf32", "HIGH": "tf32", "HIGHEST": "f32"},
        bf16="exact products, f32 accumulation (cuBLAS / Triton)",
        presets=frozenset({"F16_F16_F32", "BF16_BF16_F32", "BF16_BF16_F32_X3",
                           "BF16_BF16_F32_X6", "BF16_BF16_F32_X9", "TF32_TF32_F32",
                           "TF32_TF32_F32_X3", "F32_F32_F32", "F64_F64_F64"}),
        presets_source="XLA xla/service/algorithm_util.cc `IsSupportedDotAlgorithmOnGpu`; "
                       "the GPU compiler refuses the others"),
}


def f32_rounding_unit(platform: str, precision: str = "DEFAULT") -> float:
  """2^-b, b the significand bits (implicit bit counted) a dot at `precision` keeps of
  f32 operands on `platform`: 2^-24 for f32 arithmetic, 2^-8 for one bf16 pass (a TPU at
  DEFAULT), 2^-11 for TF32. The unit a float32 computation's error is bounded in
  (tests/platform_bounds.py)."""
  return 2.0 ** -ARITHMETIC_BITS[check(platform).arithmetic(precision)]


def stored_for_one_pass(platform: str, precisions, stored: str) -> bool:
  """Whether values stored as `stored` lose nothing to the dots that read them on
  `platform`, each multiplying at one of `precisions` (lax names, any case): every such
  dot takes f32 operands as that type there (`Platform.operand_rounding`)."""
  row = check(platform)
  names = [str(p).upper() for p in precisions]
  return bool(names) and all(row.operand_rounding.get(n) == stored for n in names)


# The JAX backend a program is traced for, when not the one this process runs on (the
# audit and inspect lowering for tpu / cuda from a CPU machine; `precision.target_backend`
# sets it): 'auto' choices resolve for it, and a kernel refuses a precision it refuses.
TRACED_FOR = contextvars.ContextVar("attnprec_target_backend", default=None)


def check(platform) -> Platform:
  """The table's row for a platform name; anything else is a UserError listing them."""
  if platform not in TABLE:
    raise UserError(
        f"Invalid platform {platform!r}: the precision contract is defined for "
        f"{', '.join(repr(p) for p in PLATFORMS)} (jax's lowering platform names; an "
        f"NVIDIA GPU is 'cuda', not 'gpu'). 'cpu' checks what runs here; 'tpu' and "
        f"'cuda' lower the programs for that backend on this machine and read them "
        f"under its precision semantics.")
  return TABLE[platform]


def local_platform(backend: str, platform_version: str = "") -> Optional[str]:
  """The table's name for the backend this process runs on (jax.default_backend() and
  the device client's platform_version), None where the table has no row (ROCm)."""
  if backend == "gpu":
    return None if "rocm" in platform_version.lower() else "cuda"
  return backend if backend in TABLE else None


def refusal(platform: str, precision_name: str, *, knob: str = "einsum_precision"
            ) -> Optional[str]:
  """None if `platform` honours the precision name (a lax Precision or a preset), else
  the paragraph that names the platform, the value and the ones it accepts."""
  row = check(platform)
  name = str(precision_name)
  if name.upper() in LAX_PRECISIONS:
    return None
  preset = name.upper()
  if preset in row.presets:
    return None
  accepted = sorted(row.presets)
  if preset in _F8:
    why = ("it needs float8 operands and attnprec's attention and dense dots never take "
           "them (a quantized KV cache's codes enter the dots converted to the compute "
           "dtype)")
  else:
    why = f"{row.hardware} does not accept it (source: {row.presets_source})"
  return (f"Platform {platform!r} cannot honour {knob}={name!r}: {why}. Valid on "
          f"{platform!r}: 'default', 'high', 'highest' or one of the dot-algorithm "
          f"presets {', '.join(repr(p) for p in accepted)}.")


def check_traced(precision_name: str, knob: str) -> None:
  """Raises the `refusal` UserError if the platform being traced for (`TRACED_FOR`, else
  this process's backend) cannot honour the precision name: called while tracing, by
  every attention kernel (einsum_precision) and the model (matmul_precision), so a
  setting the platform would not run is refused, not run as something else."""
  import jax
  traced = local_platform(TRACED_FOR.get() or jax.default_backend())
  why = traced and refusal(traced, precision_name, knob=knob)
  if why:
    raise UserError(why)


def check_precision(platform: str, precision) -> None:
  """Raises a UserError if `platform` cannot honour a Precision's einsum_precision or
  matmul_precision (before anything is lowered)."""
  for knob in ("einsum_precision", "matmul_precision"):
    why = refusal(platform, getattr(precision, knob), knob=knob)
    if why:
      raise UserError(why)


# ----------------------------------------------------------------------------- semantics
def algorithm_arithmetic(fields: Dict[str, str]) -> str:
  """How a dot with this algorithm multiplies ('bf16_3x', 'tf32', 'f32', ...), from the
  lowered attribute's fields (lhs_precision_type, num_primitive_operations)."""
  kind = fields.get("lhs_precision_type", "f32")
  passes = int(fields.get("num_primitive_operations", "1") or 1)
  label = kind if passes == 1 else f"{kind}_{passes}x"
  return label if label in ARITHMETIC_BITS else kind


def preset_arithmetic(preset: str) -> str:
  """'BF16_BF16_F32_X3' -> 'bf16_3x', 'TF32_TF32_F32' -> 'tf32', 'F32_F32_F32' -> 'f32'."""
  parts = preset.upper().split("_")
  passes = parts[-1][1:] if parts[-1].startswith("X") else "1"
  return algorithm_arithmetic({"lhs_precision_type": parts[0].lower(),
                               "num_primitive_operations": passes})


def product_bits(arithmetic: str, lhs_values: str, rhs_values: str) -> float:
  """The significand bits a dot's products keep: inf where each pass takes both
  operands' values unrounded (bf16 values in a bf16 pass or TF32, f32 values in f32),
  else the arithmetic's bits."""
  one_pass = ARITHMETIC_BITS.get(arithmetic.split("_")[0], 24)
  values = [VALUE_BITS.get(t, 24) for t in (lhs_values, rhs_values)]
  return float("inf") if max(values) <= one_pass else \
      float(ARITHMETIC_BITS.get(arithmetic, 24))


def describe_products(arithmetic: str, lhs_values: str, rhs_values: str) -> str:
  """'TF32', 'one bf16 pass', 'f32', 'exact (bf16 x bf16 values)' (operands holding
  16-bit values that the arithmetic takes unrounded): what the products keep."""
  exact = product_bits(arithmetic, lhs_values, rhs_values) == float("inf")
  if exact and max(VALUE_BITS.get(t, 24) for t in (lhs_values, rhs_values)) <= 11:
    return f"exact ({lhs_values} x {rhs_values} values)"   # 16-bit values, unrounded
  return ARITHMETIC_TEXT.get(arithmetic, arithmetic)


def markdown_table() -> str:
  """The per-platform table of docs/contract.md, from `TABLE` (a test compares them)."""
  lines = ["| platform | f32 x f32 at DEFAULT | HIGH | HIGHEST | bf16 x bf16 | f16 x f16 at "
           "DEFAULT / HIGH / HIGHEST | presets accepted | source |",
           "|---|---|---|---|---|---|---|---|"]
  for p in TABLE.values():
    f = [ARITHMETIC_TEXT[p.arithmetic(x)] for x in LAX_PRECISIONS]
    f16 = [p.f16_arithmetic(x) for x in LAX_PRECISIONS]
    f16 = ("exact products" if set(f16) == {"f16"} else
           " / ".join(ARITHMETIC_TEXT[a] for a in f16) + f" ({p.f16_source})")
    lines.append(f"| {p.name}: {p.hardware} | {f[0]} | {f[1]} | {f[2]} | {p.bf16} | {f16} | "
                 f"{', '.join(sorted(p.presets))} | {p.presets_source} |")
  return "\n".join(lines)

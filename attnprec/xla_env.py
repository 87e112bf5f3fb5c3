"""XLA flags the project's numerics depend on; import this before jax.

By default XLA:CPU may silently drop f32->bf16->f32 roundings ("excess precision"),
depending on shape, which hides exactly the effect the attention flags control. Every
runner calls `disable_excess_precision()` before anything imports jax. This module must
not import jax itself.
"""
import os
import re
import subprocess
import sys
from typing import Optional

FLAG = "--xla_allow_excess_precision=false"

# XLA:CPU library paths for dots (process-wide, read when jax starts; off by default).
# Not set by the project. With jax/jaxlib 0.10.2 both flags are accepted but change
# nothing here: the compiled HLO of a 1000 x 576 x 1536 and a 1 x 576 x 1536 bf16 x bf16
# -> f32 dot, and of the audited train/prefill/decode programs, is byte-identical under
# default, onednn and xnnpack (XLA:CPU already puts such dots in its YNNPACK fusions,
# `__ynn_fusion`, except the 1-row one). The timings per setting (one interleaved run each,
# loaded machine; the bf16 x bf16 -> f32 form over the float32-carried form at 1000 rows:
# 0.23-0.52 default, 0.23-0.54 onednn, 0.23-0.47 xnnpack) differ by noise only.
# `make bench ARGS="--suite=projections --xla_settings=default,onednn,xnnpack"` measures.
SETTINGS = {"default": (), "onednn": ("--xla_cpu_use_onednn=true",),
            "xnnpack": ("--xla_cpu_use_xnnpack=true",)}
_LIBRARY_FLAGS = ("--xla_cpu_use_onednn", "--xla_cpu_use_xnnpack")


def disable_excess_precision() -> None:
  """Adds FLAG to XLA_FLAGS unless the variable already sets excess precision."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_allow_excess_precision" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()


# XLA_FLAGS as they were when `import attnprec` found JAX's backend already started (XLA
# read its flags then, before the package could add FLAG); None when the package set
# them first.
_FLAGS_AT_IMPORT = None


def note_backend_started_before_import() -> None:
  global _FLAGS_AT_IMPORT
  _FLAGS_AT_IMPORT = os.environ.get("XLA_FLAGS", "")


def _excess_precision_value(flags: str) -> Optional[str]:
  """The last --xla_allow_excess_precision value in `flags`, lower case (a bare boolean
  flag means true, as XLA reads it); None when not set."""
  values = [f.split("=", 1)[1].lower() if "=" in f else "true" for f in flags.split()
            if f.startswith("--xla_allow_excess_precision")]
  return values[-1] if values else None


def excess_precision_allowed(flags=None) -> bool:
  """Whether XLA_FLAGS (or `flags`) leave XLA:CPU's excess precision on (no setting is
  XLA's default, on)."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  return _excess_precision_value(flags) not in ("false", "0")


_WARNED = []


def excess_precision_note(backend: str, compute_dtype: str) -> Optional[str]:
  """A warning, once per process, for a reduced-precision (non-float32) model traced on
  XLA:CPU while excess precision is on (XLA_FLAGS chose it, or JAX started before
  `import attnprec` could turn it off): its bf16 roundings may be dropped. None
  otherwise."""
  if backend != "cpu" or compute_dtype == "float32" or _WARNED:
    return None
  flags = os.environ.get("XLA_FLAGS", "") if _FLAGS_AT_IMPORT is None else _FLAGS_AT_IMPORT
  if not excess_precision_allowed(flags):
    return None
  _WARNED.append(True)
  why = ("JAX started its backend before attnprec was imported" if _FLAGS_AT_IMPORT is
         not None and FLAG not in flags else "XLA_FLAGS allow it")
  return (f"XLA:CPU excess precision is on in this process ({why}): XLA may drop the "
          f"{compute_dtype} roundings the precision flags control, so these numbers are "
          f"not those of a {compute_dtype} model. Import attnprec before running anything "
          f"in jax, or start Python with XLA_FLAGS={FLAG} (docs/precision.md).")


def flags_for(setting: str, flags: str = "") -> str:
  """`flags` with the library flags of `setting` (one of SETTINGS) in place of any."""
  kept = [f for f in flags.split() if not f.startswith(_LIBRARY_FLAGS)]
  return " ".join(kept + list(SETTINGS[setting]))


def in_force(flags=None) -> str:
  """The XLA:CPU dot setting XLA_FLAGS (or `flags`) selects, in words."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  on = [f.split("=")[0][len("--xla_cpu_use_"):] for f in flags.split()
        if f.startswith(_LIBRARY_FLAGS) and f.split("=", 1)[-1].lower() in ("true", "1")]
  return "+".join(on) or "default"


# XLA:CPU flags that can change a number the contract and the tests pin down (what XLA
# computes, in which order, or which library runs it), beyond the two above: fast math
# (reassociation, approximate functions, NaN / inf assumptions), a max that may drop
# NaNs (the softmax's max), flushed denormals, the library fusions that run dots and
# element-wise work outside XLA's own code, and the ISA / vector width the element-wise
# code is compiled for (the order of a vectorised sum). The project never sets them; a
# user's own setting is run as given and named on the precision line (`describe`).
NUMERICS_FLAGS = ("--xla_cpu_enable_fast_math", "--xla_cpu_fast_math_honor_",
                  "--xla_cpu_enable_fast_min_max", "--xla_cpu_ftz",
                  "--xla_cpu_enable_platform_dependent_math", "--xla_cpu_strict_dot_conv_math",
                  "--xla_cpu_experimental_ynn_fusion_type",
                  "--xla_cpu_experimental_xnn_fusion_type",
                  "--xla_cpu_experimental_xnn_graph_fusion_mode",
                  "--xla_cpu_experimental_onednn_fusion_type",
                  "--xla_cpu_experimental_onednn_custom_call", "--xla_cpu_use_acl",
                  "--xla_cpu_max_isa", "--xla_cpu_prefer_vector_width")


def numerics_flags(flags=None) -> list:
  """The flags in XLA_FLAGS (or `flags`) that NUMERICS_FLAGS names, and a dot-library flag
  set to anything but true (`in_force` names only those turned on), as written."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  return [f for f in flags.split() if f.startswith(NUMERICS_FLAGS) or (
      f.startswith(_LIBRARY_FLAGS) and f.split("=", 1)[-1].lower() not in ("true", "1"))]


def describe(flags=None) -> str:
  """The XLA settings in force, for a runner's precision line: excess precision (and
  whether the user's XLA_FLAGS chose it), the dot library setting, and every flag of
  NUMERICS_FLAGS the user set (run as given, outside what the project measured)."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  value = _excess_precision_value(flags)
  if value is None:
    excess = "excess precision allowed (XLA's default: some bf16 roundings may be dropped)"
  elif value in ("false", "0"):
    excess = "excess precision disabled"
  else:
    excess = ("excess precision ALLOWED by your XLA_FLAGS (--xla_allow_excess_precision="
              f"{value}): XLA:CPU may drop bf16 roundings the precision flags control")
  line = f"XLA: {excess}; dot library: {in_force(flags)}"
  other = numerics_flags(flags)
  if other:
    line += (f"; also set by your XLA_FLAGS: {' '.join(other)} (may change XLA:CPU's "
             f"numerics; the project's tests and measurements ran without it)")
  return line


def user_flags(flags=None) -> list:
  """The flags in XLA_FLAGS (or `flags`) other than the one the project adds (FLAG)."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  return [f for f in flags.split() if f != FLAG]


def flag_problems(flags=None) -> list:
  """What XLA refuses in XLA_FLAGS (or `flags`), in its words: flags it does not know,
  values it cannot interpret. XLA reads XLA_FLAGS when JAX starts its first backend and
  ends the process there on either (no exception to catch), so a runner asks a child
  process first; only when the user set flags of their own (the project's FLAG alone
  needs no question)."""
  flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
  if not user_flags(flags):
    return []
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  try:
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, text=True, timeout=300)
  except subprocess.TimeoutExpired:
    return ["JAX did not start within 300 s with these flags"]
  if probe.returncode == 0:
    return []
  said = re.findall(r"\] (Unknown flags? in XLA_FLAGS: .*|Couldn't interpret value .*)",
                    probe.stderr)
  said = [line.rstrip(". ") for line in said]
  return said or [f"JAX could not start with these flags (exit {probe.returncode}): "
                  + (probe.stderr.strip().splitlines() or ["no message"])[-1]]


# jax settings read from the environment that change numbers: the default precision of
# every dot left at 'default' (the precision line would not name it), and 64-bit types.
NUMERICS_ENV = {
    "JAX_DEFAULT_MATMUL_PRECISION": "sets the precision of every dot the precision "
                                    "leaves at 'default', which the precision line would "
                                    "not name; set precision.matmul_precision and "
                                    "precision.einsum_precision (per phase) instead",
    "JAX_ENABLE_X64": "turns on jax's 64-bit types, which the project's programs, tests "
                      "and measurements never use",
    "JAX_DEFAULT_PRNG_IMPL": "replaces the random number generator behind every seed "
                             "(parameters, batches, sampling): a seed would no longer give "
                             "the numbers it gives everywhere else, and a checkpoint written "
                             "under one generator would not resume under the other",
    "JAX_THREEFRY_PARTITIONABLE": "changes the random bits jax's threefry generator draws "
                                  "for a seed (parameters, batches, sampling)",
}


# Runners that may run under JAX_ENABLE_X64: `inspect` lowers a user's function, whose
# f64 / i64 inputs need it (its shapes are refused without it).
X64_RUNNERS = ("inspect",)


def check_environment(environ=None, prog: str = "") -> None:
  """Refuses (errors.UserError), before a runner writes anything: XLA_FLAGS naming a flag
  file (its flags would change numbers unnamed on the precision line), the jax settings
  of NUMERICS_ENV (JAX_ENABLE_X64 but for X64_RUNNERS), and flags XLA would refuse
  (`check_known_flags`)."""
  from attnprec.errors import UserError
  environ = os.environ if environ is None else environ
  flags = environ.get("XLA_FLAGS", "")
  first = flags.split()[0] if flags.split() else ""
  if first and not first.startswith("-"):
    raise UserError(f"XLA_FLAGS={flags!r} names a flag file ({first!r}); attnprec reads "
                    f"the flags that change numbers from XLA_FLAGS itself to name them on "
                    f"the precision line, so put the flags in XLA_FLAGS (e.g. "
                    f"XLA_FLAGS='--xla_cpu_enable_fast_math=false').")
  for name, why in NUMERICS_ENV.items():
    value = environ.get(name, "")
    if name == "JAX_ENABLE_X64" and (value.lower() in ("0", "false") or
                                     prog in X64_RUNNERS):
      continue
    if value:
      raise UserError(f"{name}={value!r} is set: it {why}. Unset it (nothing was run or "
                      f"written).")
  check_known_flags(flags)


def check_known_flags(flags=None) -> None:
  """Refuses (errors.UserError) XLA_FLAGS that XLA would refuse, before a runner writes
  anything: XLA would end the process at start-up, leaving what the runner had begun (a
  run directory) behind."""
  problems = flag_problems(flags)
  if problems:
    from attnprec.errors import UserError
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    raise UserError(
        f"XLA_FLAGS={flags!r} is not what XLA accepts: {'; '.join(problems)}. XLA would "
        f"end the process when JAX starts. Remove or correct it; the XLA flags the "
        f"project reads and names on the precision line are {FLAG.split('=')[0]}, "
        f"{', '.join(_LIBRARY_FLAGS)} and "
        f"{', '.join(f + '*' if f.endswith('_') else f for f in NUMERICS_FLAGS)} (XLA's own list: "
        f"its flags' help, printed when it refuses a value). Nothing was run or written.")

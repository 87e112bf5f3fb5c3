"""The host CPU's bf16 matrix features: which form of a 16-bit projection XLA:CPU runs
fastest there (`Precision.projection_form = 'auto'`, `layers.project`).

Measured on 2-core machines of this project's kind (docs/performance.md): with
avx512_bf16, a bf16 x bf16 -> float32 dot runs at about twice the float32 rate (1401 vs
253 GFLOP/s at 2048^3); without it, at 0.58x (100 vs 172), and a bf16 prefill took 1.64x
the float32 prefill's time. So a CPU with a bf16 dot instruction (x86 avx512_bf16 or
amx_bf16, Arm's bf16 extension) gets the bf16 dot; one without gets a float32 dot on the
same bf16 values (the same exact products, float32 accumulation).

Read from /proc/cpuinfo ('flags' on x86, 'Features' on Arm), once per process. Where that
file is missing or names no features (not Linux), the features are unknown and 'auto'
keeps the bf16 dot, as before this choice existed; the precision line says so.
"""
import functools
from typing import Optional, Tuple

X86_BF16 = ("amx_bf16", "avx512_bf16")   # /proc/cpuinfo 'flags'
ARM_BF16 = ("bf16",)                     # /proc/cpuinfo 'Features' (Armv8.6 BF16)
CPUINFO = "/proc/cpuinfo"


def parse_bf16_features(cpuinfo: str) -> Optional[Tuple[str, ...]]:
  """The bf16 matrix features named in a /proc/cpuinfo text (sorted; empty: none), or
  None when the text has no 'flags' / 'Features' line (unknown)."""
  found, seen = set(), False
  for line in cpuinfo.splitlines():
    key, sep, value = line.partition(":")
    key = key.strip().lower()
    if not sep or key not in ("flags", "features"):
      continue
    seen = True
    words = set(value.split())
    found |= words & set(X86_BF16 if key == "flags" else ARM_BF16)
  return tuple(sorted(found)) if seen else None


@functools.lru_cache(maxsize=None)
def bf16_features(path: str = CPUINFO) -> Optional[Tuple[str, ...]]:
  """This machine's bf16 matrix features (cached per process); None when unknown."""
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return parse_bf16_features(f.read())
  except OSError:
    return None


_THIS_MACHINE = object()


def describe(features=_THIS_MACHINE) -> str:
  """Features (a `bf16_features()` value; default: this machine's) as the precision line
  and the benches name them."""
  if features is _THIS_MACHINE:
    features = bf16_features()
  if features is None:
    return "cpu features unknown"
  return "+".join(features) if features else "cpu without avx512_bf16/amx_bf16/bf16"

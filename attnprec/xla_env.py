"""XLA flags the project's numerics depend on; import this before jax.

By default XLA:CPU may silently drop f32->bf16->f32 roundings ("excess precision"),
depending on shape, which hides exactly the effect the attention flags control. Every
runner calls `disable_excess_precision()` before anything imports jax. This module must
not import jax itself.
"""
import os

FLAG = "--xla_allow_excess_precision=false"

# XLA:CPU library paths for dots (process-wide, read when jax starts; off by default).
SETTINGS = {"default": (), "onednn": ("--xla_cpu_use_onednn=true",),
            "xnnpack": ("--xla_cpu_use_xnnpack=true",)}
_LIBRARY_FLAGS = ("--xla_cpu_use_onednn", "--xla_cpu_use_xnnpack")


def disable_excess_precision() -> None:
  """Adds FLAG to XLA_FLAGS unless the variable already sets excess precision."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_allow_excess_precision" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()


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

"""XLA flags the project's numerics depend on; import this before jax.

By default XLA:CPU may silently drop f32->bf16->f32 roundings ("excess precision"),
depending on shape, which hides exactly the effect the attention flags control. Every
runner calls `disable_excess_precision()` before anything imports jax. This module must
not import jax itself.
"""
import os

FLAG = "--xla_allow_excess_precision=false"


def disable_excess_precision() -> None:
  """Adds FLAG to XLA_FLAGS unless the variable already sets excess precision."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_allow_excess_precision" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()

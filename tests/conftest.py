"""Test setup. XLA_FLAGS must be set before jax is imported anywhere.

By default XLA:CPU may silently drop f32->bf16->f32 roundings (excess precision),
depending on shape, which hides exactly the effect the precision flags control.
"""
from attnprec.xla_env import disable_excess_precision

disable_excess_precision()

import gin  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _clear_gin():
  """gin bindings never leak between tests."""
  gin.clear_config()
  yield
  gin.clear_config()

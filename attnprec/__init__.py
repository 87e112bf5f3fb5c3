"""attnprec: attention precision made explicit, per phase, asserted and audited.

Importing the package turns XLA:CPU's excess precision off for this process
(`xla_env.disable_excess_precision`: a value set in XLA_FLAGS wins) when JAX has not
started its backend yet, so a script that imports attnprec before it runs anything in
jax keeps the bf16 roundings the precision flags control, as the runners do. When JAX
had already started (XLA reads XLA_FLAGS once, then), the model warns on its first
reduced-precision trace on XLA:CPU (`xla_env.excess_precision_note`)."""
import sys as _sys

from attnprec import xla_env as _xla_env

__version__ = "0.1.0"


def _backend_started() -> bool:
  bridge = _sys.modules.get("jax._src.xla_bridge")       # no jax import here
  return bool(bridge is not None and bridge.backends_are_initialized())


if _backend_started():
  _xla_env.note_backend_started_before_import()
else:
  _xla_env.disable_excess_precision()

"""The phase scopes: `decode/precision.dtype = ...` applies to the decode phase only."""
import contextlib

import gin

from attnprec.errors import UserError

PHASES = ("train", "decode")
# The configurables the runners call inside a phase scope (`phase`): the only ones a
# scoped binding (`decode/precision.dtype = ...`) can reach.
PHASE_CONFIGURABLES = ("precision", "blockwise")


@contextlib.contextmanager
def phase(name: str):
  """Enter a gin scope for one phase (`train` or `decode`), so `decode/precision.x = ...`
  applies to inference only. Raises a UserError for an unknown phase."""
  if name not in PHASES:
    raise UserError(f"Unknown phase {name!r}; valid phases: {', '.join(PHASES)}.")
  with gin.config_scope(name):
    yield

"""The phase scopes: `decode/precision.dtype = ...` applies to the decode phase only."""
import contextlib

import gin

from attnprec.errors import UserError

PHASES = ("train", "decode")
# The configurables the runners call inside a phase scope (`phase`): the only ones a
# scoped binding (`decode/precision.dtype = ...`) can reach.
PHASE_CONFIGURABLES = ("precision", "blockwise")
# Fields a phase never reads, whatever its kernel: the train step keeps no KV cache and
# runs no single-token decode step. A binding scoped to that phase is refused.
PHASE_UNREAD = {
    ("train", "precision"): ("kv_cache_k_dtype", "kv_cache_v_dtype", "kv_cache_k_scale",
                             "kv_cache_v_scale"),
    ("train", "blockwise"): ("decode_kv_block",),
}


@contextlib.contextmanager
def phase(name: str):
  """Enter a gin scope for one phase (`train` or `decode`), so `decode/precision.x = ...`
  applies to inference only. Raises a UserError for an unknown phase."""
  if name not in PHASES:
    raise UserError(f"Unknown phase {name!r}; valid phases: {', '.join(PHASES)}.")
  with gin.config_scope(name):
    yield

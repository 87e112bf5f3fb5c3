"""Compile once: JAX's persistent compilation cache in the run cache directory.

`enable()` points JAX's persistent cache at `$ATTNPREC_CACHE/jax-compilation` (default
`~/.cache/attnprec/jax-compilation`), so a program compiled by one run (`make decode`,
`make bench`) is loaded, not compiled, by the next one with the same shapes, dtypes,
XLA flags and jax version. Together with bucketed prompt lengths
(`attnprec.decoding.bucket_length`), a second `make decode` with a different prompt
compiles nothing new. `Compiled` reports what one compile cost and whether it came from
the cache (new entries written = compiled here).
"""
import dataclasses
import os
import time

import jax

from attnprec.checkpoints.cache import cache_dir

SUBDIR = "jax-compilation"


def enable() -> str:
  """Turns the persistent compilation cache on (every program, however fast it compiled);
  returns its directory. A directory already chosen with $JAX_COMPILATION_CACHE_DIR is
  kept."""
  path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(cache_dir(SUBDIR))
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path


def entries() -> int:
  """Files in the persistent cache now (0 when it is not enabled)."""
  path = jax.config.jax_compilation_cache_dir
  if not path or not os.path.isdir(path):
    return 0
  return sum(len(files) for _, _, files in os.walk(path))


@dataclasses.dataclass
class Compiled:
  """A compiled program and what compiling it took."""
  program: object      # jax.stages.Compiled
  seconds: float       # lower + compile (or load from the persistent cache)
  new_entries: int     # programs written to the persistent cache (0: all were cached)

  @property
  def cached(self) -> bool:
    return self.new_entries == 0


def compile_lowerable(jitted, *args, **kwargs) -> Compiled:
  """`jitted.lower(*args, **kwargs).compile()`, timed, with the cache entries it added."""
  before = entries()
  t0 = time.perf_counter()
  program = jitted.lower(*args, **kwargs).compile()
  return Compiled(program, time.perf_counter() - t0, entries() - before)

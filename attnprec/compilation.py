"""Compile once: JAX's persistent compilation cache in the run cache directory.

`enable()` points JAX's persistent cache at `$ATTNPREC_CACHE/jax-compilation` (default
`~/.cache/attnprec/jax-compilation`), so a program compiled by one run (`make decode`,
`make bench`) is loaded, not compiled, by the next one with the same shapes, dtypes,
XLA flags and jax version. Together with bucketed prompt lengths
(`attnprec.decoding.bucket_length`), a second `make decode` with a different prompt
compiles nothing new. `Compiled` reports what one compile cost and whether it came from
the cache.

What "loaded from the compilation cache" means, exactly: JAX asked the persistent cache
for every program of the compile and every answer was a hit (JAX's own
`/jax/compilation_cache/*` monitoring events, counted around the compile), not merely
that no file was added. A corrupt entry (a truncated file from a killed run, a damaged
disk) makes JAX warn, compile afresh and keep the corrupt file, since it never
overwrites an entry; `compile_lowerable` then removes that entry and compiles once more
so that the fresh program is written in its place, and reports the compile as compiled,
with the entries it replaced. JAX writes entries directly (no temporary files), so a
killed write can only leave such a truncated entry, which the next compile replaces;
`enable()` also removes, at start, entries that are empty or not compressed data at all
(also those of the small helper programs jax compiles outside `compile_lowerable`).

An entry is also checked against the SHA-256 recorded when `compile_lowerable` wrote it
(`DIGESTS`, beside the cache): another program's entry copied under its key is valid
cache data that JAX would load, silently, as this program; it is removed and compiled
afresh like a corrupt one.
"""
import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
import warnings
from typing import Optional

import jax

from attnprec.diskcache import cache_dir

SUBDIR = "jax-compilation"
_ENTRY_SUFFIX = "-cache"        # jax's file cache: <key>-cache (and <key>-atime)
_READ_ERROR = "Error reading persistent compilation cache entry"


def enable() -> str:
  """Turns the persistent compilation cache on (every program, however fast it compiled);
  returns its directory. A directory already chosen with $JAX_COMPILATION_CACHE_DIR is
  kept."""
  path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(cache_dir(SUBDIR))
  remove_unreadable_entries(path)
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


# zstd and zlib streams (how jax compresses an entry) start with these bytes.
_MAGICS = (b"\x28\xb5\x2f\xfd", b"\x78\x01", b"\x78\x5e", b"\x78\x9c", b"\x78\xda")


def remove_unreadable_entries(path: str) -> int:
  """Removes cache entries that cannot be one (empty, or not a zstd/zlib stream): a
  write killed before its first bytes, a damaged file. Reads 4 bytes per entry; an entry
  damaged further in is found when it is read (`compile_lowerable`)."""
  removed = 0
  try:
    names = [n for n in os.listdir(path) if n.endswith(_ENTRY_SUFFIX)]
  except OSError:
    return 0
  for name in names:
    entry = os.path.join(path, name)
    try:
      with open(entry, "rb") as f:
        head = f.read(4)
      if not any(head.startswith(m) for m in _MAGICS):
        os.unlink(entry)
        removed += 1
    except OSError:
      continue
  return removed


# ----------------------------------------------------------------------------- watching
_COUNTS = {"requests": 0, "hits": 0}
_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
           "/jax/compilation_cache/cache_hits": "hits"}
_LOCK = threading.Lock()
_LISTENING = False


def _on_event(event, **kwargs):
  name = _EVENTS.get(event)
  if name is not None:
    with _LOCK:
      _COUNTS[name] += 1


def _listen() -> None:
  global _LISTENING
  if not _LISTENING:
    jax.monitoring.register_event_listener(_on_event)
    _LISTENING = True


class _MissKeys(logging.Handler):
  """Collects the cache keys JAX logs for its persistent-cache misses and hits."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.keys = []
    self.hit_keys = []

  def emit(self, record):
    msg = str(record.msg)
    if len(record.args or ()) < 2:
      return
    if "PERSISTENT COMPILATION CACHE MISS" in msg:
      self.keys.append(str(record.args[1]))
    elif "Persistent compilation cache hit" in msg:
      self.hit_keys.append(str(record.args[1]))


@dataclasses.dataclass
class _Watch:
  requests: int = 0
  hits: int = 0
  read_errors: int = 0
  miss_keys: list = dataclasses.field(default_factory=list)
  hit_keys: list = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def _watched():
  """Counts cache requests and hits, read errors and the keys that missed, in the block."""
  _listen()
  watch = _Watch()
  logger = logging.getLogger("jax._src.compiler")
  handler = _MissKeys()
  level, propagate = logger.level, logger.propagate
  with _LOCK:
    start = dict(_COUNTS)
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  logger.propagate = False           # the debug records go to our handler only
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      yield watch
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
    logger.propagate = propagate
    with _LOCK:
      watch.requests = _COUNTS["requests"] - start["requests"]
      watch.hits = _COUNTS["hits"] - start["hits"]
    watch.miss_keys = handler.keys
    watch.hit_keys = handler.hit_keys
    for w in caught:
      if _READ_ERROR in str(w.message):
        watch.read_errors += 1
      else:                          # not ours to swallow
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _remove_entries(keys) -> int:
  """Removes the cache files of `keys` (the entries JAX could not read); returns how many
  it removed."""
  path = jax.config.jax_compilation_cache_dir
  removed = 0
  for key in keys:
    for suffix in (_ENTRY_SUFFIX, "-atime"):
      entry = os.path.join(path, key + suffix)
      try:
        os.unlink(entry)
        removed += suffix == _ENTRY_SUFFIX
      except FileNotFoundError:
        pass
      except OSError:
        pass                        # a read-only cache: compiled anyway, nothing replaced
  return removed


# ----------------------------------------------------------------------------- compiling
@dataclasses.dataclass
class Compiled:
  """A compiled program and what compiling it took."""
  program: object      # jax.stages.Compiled
  seconds: float       # lower + compile (or load from the persistent cache)
  new_entries: int     # files the compile added to the persistent cache
  cache_requests: int = 0   # programs JAX looked up in the persistent cache
  cache_hits: int = 0       # ... and found (and could read)
  replaced: int = 0         # corrupt entries removed and written again

  @property
  def cached(self) -> bool:
    """Every program came from the persistent cache (nothing was compiled)."""
    return self.cache_requests > 0 and self.cache_hits == self.cache_requests

  def describe(self) -> str:
    """'loaded from the compilation cache' / '... compiled, N new program(s) written to
    the compilation cache' / '... (K corrupt cache entries replaced)'."""
    if self.cached:
      return f"compile {self.seconds:.1f} s, loaded from the compilation cache"
    if self.cache_requests == 0:
      if not jax.config.jax_compilation_cache_dir:
        return f"compile {self.seconds:.1f} s, compiled (the compilation cache is off)"
      return f"compile {self.seconds:.1f} s, reused (compiled earlier in this process)"
    note = f"compile {self.seconds:.1f} s, compiled"
    if self.replaced:
      return note + (f": {self.replaced} corrupt compilation-cache entr"
                     f"{'y' if self.replaced == 1 else 'ies'} found and replaced")
    return note + f", {self.new_entries} new program(s) written to the compilation cache"


# ----------------------------------------------------------------------------- digests
DIGESTS = "jax-compilation-digests"


def _digest_path(key: str) -> Optional[str]:
  return str(cache_dir(DIGESTS) / key) if jax.config.jax_compilation_cache_dir else None


def _entry_sha256(key: str) -> Optional[str]:
  entry = os.path.join(jax.config.jax_compilation_cache_dir or "", key + _ENTRY_SUFFIX)
  try:
    with open(entry, "rb") as f:
      return hashlib.sha256(f.read()).hexdigest()
  except OSError:
    return None


def record_digests(keys) -> None:
  """Writes the SHA-256 of each new entry beside the cache (`DIGESTS`): what a later
  hit must still read."""
  for key in keys:
    path, digest = _digest_path(key), _entry_sha256(key)
    if path and digest:
      with contextlib.suppress(OSError):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
          f.write(digest)
        os.replace(tmp, path)


def replaced_entries(keys) -> list:
  """The keys among `keys` (cache hits) whose entry is no longer the one written for it:
  another program's bytes put under its name. An entry without a recorded digest (written
  before digests were kept, or by another program) gets one now."""
  swapped = []
  for key in keys:
    path, digest = _digest_path(key), _entry_sha256(key)
    if not path or digest is None:
      continue
    try:
      with open(path) as f:
        recorded = f.read().strip()
    except OSError:
      record_digests([key])
      continue
    if recorded != digest:
      swapped.append(key)
  return swapped


def compile_lowerable(jitted, *args, **kwargs) -> Compiled:
  """`jitted.lower(*args, **kwargs).compile()`, timed, with what the persistent cache did:
  requests, hits, entries added; a corrupt entry is replaced (see the module docstring),
  and so is an entry whose bytes are not those written for its key (its SHA-256 is kept
  beside the cache when it is written: another program's entry copied over it would
  otherwise be loaded, silently, as this program)."""
  before = entries()
  t0 = time.perf_counter()
  with _watched() as watch:
    program = jitted.lower(*args, **kwargs).compile()
  replaced = 0
  swapped = replaced_entries(watch.hit_keys)
  if swapped:
    for key in swapped:
      with contextlib.suppress(OSError):
        os.unlink(_digest_path(key))
    watch.miss_keys = list(watch.miss_keys) + swapped
    watch.read_errors += len(swapped)
  if watch.read_errors and watch.miss_keys:
    replaced = _remove_entries(watch.miss_keys)
    if replaced:
      # Compile once more, past JAX's in-memory cache, so that JAX writes the fresh
      # program into the freed slot (JAX never overwrites an entry). Rare: only after a
      # corrupt entry; later calls retrace once.
      jax.clear_caches()
      with _watched():
        program = jitted.lower(*args, **kwargs).compile()
  record_digests(watch.miss_keys)
  hits = watch.hits - len(swapped)
  return Compiled(program, time.perf_counter() - t0, entries() - before,
                  watch.requests, hits, replaced)

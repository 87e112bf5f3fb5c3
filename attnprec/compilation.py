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

Every entry is also checked against the SHA-256 recorded when it was written (beside
the cache, `<cache>-digests/<key>`), on every hit of every program, not only those of
`compile_lowerable`: `enable()` wraps the cache's own read and write (`_guard`). Another
program's entry copied under a key is valid cache data that JAX would load, silently, as
this program; it is removed and the program compiled afresh, and the fresh entry written
in its place. An entry that has no recorded digest (written before digests were kept) is
given one when it is first read, once it is settled (`_SETTLED_S`: JAX writes entries in
place, and another process may still be writing it).
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
  _guard()
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
_SWAPPED = [0]       # entries found not to be the bytes written for their key
_SETTLED_S = 60.0    # an entry without a digest older than this is pinned on its first read


def _digest_path(cache_path, key: str) -> str:
  return os.path.join(f"{os.fspath(cache_path).rstrip(os.sep)}-digests", key)


def _record(cache_path, key: str, data: bytes) -> None:
  path = _digest_path(cache_path, key)
  with contextlib.suppress(OSError):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
      f.write(hashlib.sha256(data).hexdigest())
    os.replace(tmp, path)


def _guard() -> None:
  """Wraps JAX's file cache (`jax._src.lru_cache.LRUCache`) once per process: a write
  records its entry's SHA-256 (of the file as it lies, after JAX wrote it), a read
  compares the entry with it. A mismatch (another program's bytes under this key) is a
  miss: the entry and its digest are removed, so JAX compiles the program and writes the
  fresh entry in its place."""
  from jax._src import lru_cache
  cls = lru_cache.LRUCache
  if getattr(cls, "_attnprec_guarded", False):
    return
  get, put = cls.get, cls.put

  def checked_get(self, key):
    value = get(self, key)
    if value is None:
      return None
    try:
      with open(_digest_path(self.path, key)) as f:
        recorded = f.read().strip()
    except OSError:
      # No digest: an entry from before digests were kept, pinned now if it is settled,
      # or one another process is still writing (JAX writes in place; its writer records
      # the digest once the write is done): not pinned to what may be half a file.
      with contextlib.suppress(OSError):
        entry = os.path.join(self.path, f"{key}{_ENTRY_SUFFIX}")
        if time.time() - os.path.getmtime(entry) > _SETTLED_S:
          _record(self.path, key, value)
      return value
    if recorded == hashlib.sha256(value).hexdigest():
      return value
    _SWAPPED[0] += 1
    for name in (f"{key}{_ENTRY_SUFFIX}", f"{key}-atime"):
      with contextlib.suppress(OSError):
        os.unlink(os.path.join(self.path, name))
    with contextlib.suppress(OSError):
      os.unlink(_digest_path(self.path, key))
    return None

  def recorded_put(self, key, value):
    # JAX writes only a new entry: the digest is of the bytes this process wrote, recorded
    # after the write (an entry another process wrote first is its writer's to record)
    fresh = not os.path.exists(os.path.join(self.path, f"{key}{_ENTRY_SUFFIX}"))
    put(self, key, value)
    if fresh:
      _record(self.path, key, value)

  cls.get, cls.put, cls._attnprec_guarded = checked_get, recorded_put, True


def compile_lowerable(jitted, *args, **kwargs) -> Compiled:
  """`jitted.lower(*args, **kwargs).compile()`, timed, with what the persistent cache did:
  requests, hits, entries added; a corrupt entry is replaced (see the module docstring),
  and so is an entry whose bytes are not those written for its key (its SHA-256 is kept
  beside the cache when it is written: another program's entry copied over it would
  otherwise be loaded, silently, as this program)."""
  before = entries()
  t0 = time.perf_counter()
  _guard()
  swapped_before = _SWAPPED[0]
  with _watched() as watch:
    program = jitted.lower(*args, **kwargs).compile()
  replaced = _SWAPPED[0] - swapped_before     # written afresh by this compile (`_guard`)
  if watch.read_errors and watch.miss_keys:
    removed = _remove_entries(watch.miss_keys)
    replaced += removed
    if removed:
      # Compile once more, past JAX's in-memory cache, so that JAX writes the fresh
      # program into the freed slot (JAX never overwrites an entry). Rare: only after a
      # corrupt entry; later calls retrace once.
      jax.clear_caches()
      with _watched():
        program = jitted.lower(*args, **kwargs).compile()
  return Compiled(program, time.perf_counter() - t0, entries() - before,
                  watch.requests, watch.hits, replaced)

"""Caches tell the truth and clean up: the compilation-cache report ("loaded from the
compilation cache" only when every program was a cache hit; a corrupt entry is compiled,
reported and replaced), and the temporaries of killed writes are removed on the next
start only when they are old and unlocked."""
import fcntl
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import pytest
from jax._src import compilation_cache as jax_cache

from attnprec import compilation
from attnprec import diskcache as cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  """A fresh persistent compilation cache in tmp_path; jax's setting restored after."""
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path))
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  before = jax.config.jax_compilation_cache_dir
  jax_cache.reset_cache()
  path = pathlib.Path(compilation.enable())
  yield path
  jax.config.update("jax_compilation_cache_dir", before)
  jax_cache.reset_cache()


def _program(scale):
  # A new function object per call: nothing is reused from jax's in-memory caches.
  return jax.jit(lambda x: jnp.tanh(x) * scale + 1.0)


def test_cache_report_is_true_and_a_corrupt_entry_is_replaced(cache_dir):
  x = jax.ShapeDtypeStruct((3,), jnp.float32)
  first = compilation.compile_lowerable(_program(3.0), x)
  assert not first.cached and first.new_entries >= 1
  assert "compiled" in first.describe() and "written to the compilation cache" in \
      first.describe()
  jax.clear_caches()
  second = compilation.compile_lowerable(_program(3.0), x)
  assert second.cached and second.describe().endswith("loaded from the compilation cache")

  entries = [p for p in cache_dir.iterdir() if p.name.endswith("-cache")]
  assert entries
  for p in entries:                       # a killed write / damaged disk
    p.write_bytes(b"not a cache entry")
  jax.clear_caches()
  third = compilation.compile_lowerable(_program(3.0), x)
  assert not third.cached and third.replaced >= 1
  assert "corrupt compilation-cache entr" in third.describe() and "replaced" in \
      third.describe()
  assert jnp.allclose(third.program(jnp.zeros(3)), 1.0)
  jax.clear_caches()
  fourth = compilation.compile_lowerable(_program(3.0), x)   # the replacement is good
  assert fourth.cached and fourth.replaced == 0


def _age(path: pathlib.Path, seconds: float):
  t = time.time() - seconds
  for root, dirs, files in os.walk(path) if path.is_dir() else [(None, [], [])]:
    for name in dirs + files:
      os.utime(os.path.join(root, name), (t, t))
  os.utime(path, (t, t))


def test_stale_temporaries_are_removed_only_when_old_and_unlocked(tmp_path):
  old = cache.STALE_AFTER_S + 60
  stale_file = tmp_path / "model.gguf.tmp-abc123"
  stale_file.write_bytes(b"partial")
  stale_dir = tmp_path / "entry.params.tmp-xyz"
  stale_dir.mkdir()
  (stale_dir / "w.npy").write_bytes(b"x")
  download = tmp_path / "download-q1w2"
  download.mkdir()
  (download / "part.whl").write_bytes(b"x")
  fresh = tmp_path / "other.tmp-fresh"
  fresh.write_bytes(b"being written")
  locked = tmp_path / "big.gguf.tmp-locked"
  locked.write_bytes(b"being written slowly")
  keep = tmp_path / "model.gguf"
  keep.write_bytes(b"a finished entry")
  for p in (stale_file, stale_dir, download, locked, keep):
    _age(p, old)
  # a writer still holds this one (another process in real life: flock is per open file)
  fd = os.open(locked, os.O_RDONLY)
  fcntl.flock(fd, fcntl.LOCK_EX)
  try:
    removed = cache.remove_stale_temporaries(tmp_path)
  finally:
    os.close(fd)
  assert sorted(p.name for p in removed) == sorted(
      [stale_file.name, stale_dir.name, download.name])
  assert fresh.exists() and locked.exists() and keep.exists()
  assert not stale_file.exists() and not stale_dir.exists() and not download.exists()


def test_atomic_path_holds_its_lock_and_the_next_start_sweeps(tmp_path, monkeypatch):
  """A write in progress is never removed, however old its file looks; once the writer
  is gone, the first cache_dir() of the next start removes what it left."""
  target = tmp_path / "shipped" / "model.gguf"
  with cache.atomic_path(target) as tmp:
    tmp.write_bytes(b"half")
    _age(tmp, cache.STALE_AFTER_S + 60)
    assert cache.remove_stale_temporaries(target.parent) == []
    assert tmp.exists()
  assert target.read_bytes() == b"half"
  left = target.parent / "model.gguf.tmp-killed"     # what a killed writer leaves
  left.write_bytes(b"half")
  _age(left, cache.STALE_AFTER_S + 60)
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path))
  monkeypatch.setattr(cache, "_SWEPT", set())        # a new process
  assert cache.cache_dir("shipped") == target.parent
  assert not left.exists() and target.exists()


def test_enable_removes_entries_that_are_not_compressed_data(cache_dir):
  junk = cache_dir / "jit_stage-0123-cache"
  junk.write_bytes(b"")                  # a write killed before its first bytes
  other = cache_dir / "jit_other-4567-cache"
  other.write_bytes(b"garbage")
  good = cache_dir / "jit_good-89ab-cache"
  good.write_bytes(b"\x78\x9c" + b"\0" * 8)
  compilation.enable()
  assert not junk.exists() and not other.exists() and good.exists()


def test_an_entry_replaced_by_another_programs_is_not_loaded(cache_dir):
  """Another program of the same signature copied over an entry (its bytes are valid
  cache data, so nothing else would notice): the SHA-256 kept when the entry was written
  no longer matches, so the entry is compiled afresh and replaced, not loaded."""
  x = jax.ShapeDtypeStruct((3,), jnp.float32)
  compilation.compile_lowerable(_program(3.0), x)
  mine = {p.name for p in cache_dir.iterdir() if p.name.endswith("-cache")}
  compilation.compile_lowerable(_program(5.0), x)
  other = [p for p in cache_dir.iterdir() if p.name.endswith("-cache") and p.name not in mine]
  assert len(mine) == 1 and len(other) == 1
  (cache_dir / mine.pop()).write_bytes(other[0].read_bytes())   # same signature, other math
  jax.clear_caches()
  again = compilation.compile_lowerable(_program(3.0), x)
  assert not again.cached and again.replaced == 1, again
  assert jnp.allclose(again.program(jnp.ones(3)), 3.0 * jnp.tanh(1.0) + 1.0)
  jax.clear_caches()
  assert compilation.compile_lowerable(_program(3.0), x).cached   # the fresh entry is good


def test_every_program_s_entry_is_checked_not_only_compile_lowerable_s(cache_dir):
  """A plain `jax.jit` call (how most of a run's programs compile) reads the cache through
  the same guard: another program's entry copied under its key is compiled afresh, and
  the result is this program's."""
  compilation.enable()
  f3 = jax.jit(lambda x: 3.0 * jnp.tanh(x) + 1.0)
  f5 = jax.jit(lambda x: 5.0 * jnp.tanh(x) + 1.0)
  x = jnp.ones(3)
  jax.block_until_ready(x)
  ours = lambda: {p.name for p in cache_dir.iterdir()                    # noqa: E731
                  if p.name.startswith("jit__lambda") and p.name.endswith("-cache")}
  f3(x)
  mine = ours()
  f5(x)
  other = [cache_dir / name for name in ours() - mine]
  assert len(mine) == 1 and len(other) == 1
  digests = pathlib.Path(f"{cache_dir}-digests")
  assert (digests / mine.copy().pop().removesuffix("-cache")).exists()
  (cache_dir / mine.pop()).write_bytes(other[0].read_bytes())   # same signature, other math
  jax.clear_caches()
  again = jax.jit(lambda x: 3.0 * jnp.tanh(x) + 1.0)(x)
  assert jnp.allclose(again, 3.0 * jnp.tanh(1.0) + 1.0)

"""The checkpoint cache directory and atomic writes into it.

Everything a load derives once and reuses (an assembled GGUF file, a GGUF's parsed config
and tokenizer) lives under `cache_dir()`: `$ATTNPREC_CACHE` if set, else
`~/.cache/attnprec`. Every entry is written to a temporary path in the same directory and
renamed into place, so a reader never sees a half-written file, and an interrupted write
leaves only a `*.tmp-*` file behind (never a partial entry).

Leftovers of killed writes are removed on the next start: the first `cache_dir(...)` of a
process sweeps that directory (`remove_stale_temporaries`). The rule, safe while another
process is still writing: a temporary (a name holding `.tmp-`, or starting with
`download-`) is removed only if nothing in it was modified for `STALE_AFTER_S` (15
minutes) AND no process holds its lock: `atomic_path` and `locked_temporary_dir` hold an
exclusive `flock` on their temporary for as long as they write it, and the sweeper skips
anything it cannot lock itself. (A writer that holds no lock, like pip downloading into
a `download-*` directory, is protected by the age rule alone: its files keep changing.)
"""
import contextlib
import fcntl
import os
import pathlib
import shutil
import tempfile
import time
from typing import List

from attnprec.errors import UserError

ENV_VAR = "ATTNPREC_CACHE"


def cache_dir(*parts: str) -> pathlib.Path:
  """`$ATTNPREC_CACHE/<parts>` (default `~/.cache/attnprec/<parts>`), created if needed."""
  root = os.environ.get(ENV_VAR)
  if not root:
    home = os.path.expanduser("~")
    if not os.path.isdir(home):
      # a daemon user's HOME (/nonexistent): creating it would put a cache at the root
      raise UserError(f"The home directory {home!r} (HOME) does not exist, so the cache "
                      f"(~/.cache/attnprec: checkpoints, compiled programs) has no place; "
                      f"set ${ENV_VAR} to a writable directory, or HOME to an existing one.")
    root = os.path.join(home, ".cache", "attnprec")
  path = pathlib.Path(root, *parts)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"Cannot create the cache directory {path} ({e}); set "
                    f"${ENV_VAR} to a writable directory.") from None
  if str(path) not in _SWEPT:
    _SWEPT.add(str(path))
    remove_stale_temporaries(path)
  return path


# ----------------------------------------------------------------------------- leftovers
STALE_AFTER_S = 15 * 60
TEMPORARY_MARKERS = (".tmp-",)          # atomic_path, locked_temporary_dir, gguf entries
TEMPORARY_PREFIXES = ("download-",)     # wheel_parts' pip download directories
_SWEPT = set()


def _is_temporary(name: str) -> bool:
  return any(m in name for m in TEMPORARY_MARKERS) or name.startswith(TEMPORARY_PREFIXES)


def _newest_mtime(path: pathlib.Path) -> float:
  """The latest modification time of `path` or anything below it."""
  newest = path.lstat().st_mtime
  if path.is_dir() and not path.is_symlink():
    for root, dirs, files in os.walk(path):
      for name in dirs + files:
        try:
          newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
        except OSError:
          pass
  return newest


@contextlib.contextmanager
def _try_lock(path: pathlib.Path):
  """Yields True holding an exclusive flock on `path` if nobody else holds one."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    yield False
    return
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      yield False
      return
    yield True
  finally:
    os.close(fd)


def remove_stale_temporaries(directory: os.PathLike, *, older_than_s: float = STALE_AFTER_S
                             ) -> List[pathlib.Path]:
  """Removes the temporaries of killed writes directly in `directory` (the rule: see the
  module docstring); returns what it removed. Never raises for a file it cannot remove."""
  directory = pathlib.Path(directory)
  removed = []
  try:
    names = os.listdir(directory)
  except OSError:
    return removed
  now = time.time()
  for name in names:
    if not _is_temporary(name):
      continue
    path = directory / name
    try:
      if now - _newest_mtime(path) < older_than_s:
        continue
      with _try_lock(path) as free:
        if not free:
          continue                    # a writer holds it
        if path.is_dir() and not path.is_symlink():
          shutil.rmtree(path)
        else:
          path.unlink()
      removed.append(path)
    except OSError:
      continue
  return removed


@contextlib.contextmanager
def atomic_path(target: os.PathLike):
  """Yields a temporary path next to `target`; renames it onto `target` on success.

  On any exception the temporary file is removed and `target` is left untouched.
  """
  target = pathlib.Path(target)
  target.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=target.name + ".tmp-", dir=target.parent)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)     # held while writing: the sweeper leaves it alone
    yield pathlib.Path(tmp)
    os.replace(tmp, target)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise
  finally:
    os.close(fd)


@contextlib.contextmanager
def locked_temporary_dir(prefix: str, directory: os.PathLike):
  """`tempfile.mkdtemp(prefix, dir)` holding an exclusive flock on it until the block
  ends (the caller renames it into place or it is removed): `remove_stale_temporaries`
  never removes it from under a live writer. Yields the path."""
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=directory))
  fd = os.open(tmp, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield tmp
  finally:
    os.close(fd)
    shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(target: os.PathLike, text: str) -> None:
  with atomic_path(target) as tmp:
    tmp.write_text(text, encoding="utf-8")

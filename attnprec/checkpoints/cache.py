"""The checkpoint cache directory and atomic writes into it.

Everything a load derives once and reuses (an assembled GGUF file, a GGUF's parsed config
and tokenizer) lives under `cache_dir()`: `$ATTNPREC_CACHE` if set, else
`~/.cache/attnprec`. Every entry is written to a temporary path in the same directory and
renamed into place, so a reader never sees a half-written file, and an interrupted write
leaves only a `*.tmp-*` file behind (never a partial entry).
"""
import contextlib
import os
import pathlib
import tempfile

from attnprec.errors import UserError

ENV_VAR = "ATTNPREC_CACHE"


def cache_dir(*parts: str) -> pathlib.Path:
  """`$ATTNPREC_CACHE/<parts>` (default `~/.cache/attnprec/<parts>`), created if needed."""
  root = os.environ.get(ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "attnprec")
  path = pathlib.Path(root, *parts)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f"Cannot create the checkpoint cache directory {path} ({e}); set "
                    f"${ENV_VAR} to a writable directory.") from None
  return path


@contextlib.contextmanager
def atomic_path(target: os.PathLike):
  """Yields a temporary path next to `target`; renames it onto `target` on success.

  On any exception the temporary file is removed and `target` is left untouched.
  """
  target = pathlib.Path(target)
  target.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=target.name + ".tmp-", dir=target.parent)
  os.close(fd)
  try:
    yield pathlib.Path(tmp)
    os.replace(tmp, target)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)
    raise


def write_text_atomic(target: os.PathLike, text: str) -> None:
  with atomic_path(target) as tmp:
    tmp.write_text(text, encoding="utf-8")

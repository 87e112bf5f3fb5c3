"""Where the repository's own files are (for library code: the gin/ directory holds the
precision presets the study reads)."""
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_GIN_DIR = os.path.join(REPO_ROOT, "gin")


def unreachable(path) -> str:
  """Why `path` names nothing that can be read: 'does not exist', or, where it names a
  symbolic link or passes through one, that the link cannot be followed (it loops, or
  points at nothing) or a directory on the way cannot be entered."""
  import errno
  path = os.fspath(path)
  try:
    os.stat(path)
  except OSError as e:
    if e.errno == errno.ELOOP:
      return "cannot be followed: its symbolic links loop"
    if e.errno == errno.ENOENT and os.path.islink(path):
      return f"is a symbolic link to {os.readlink(path)!r}, which does not exist"
    if e.errno not in (errno.ENOENT, errno.ENOTDIR):
      return f"cannot be reached ({e.strerror})"
  return "does not exist"

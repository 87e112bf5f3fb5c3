"""Files the project ships and pins by SHA-256 (a frozen text, a frozen corpus): read
whole, decompressed by their suffix (.gz, .xz), and refused by name unless they are
exactly the pinned content, so a result made on them can be made again byte for byte."""
import gzip
import hashlib
import lzma

from attnprec.errors import UserError

_OPENERS = {".gz": gzip.open, ".xz": lzma.open}


def read(path: str, sha256: str, *, what: str, remedy: str) -> bytes:
  """The decompressed content of `path` when its SHA-256 is `sha256`; else a UserError
  naming `what` and the file, ending with `remedy` (what the user can do)."""
  opener = next((o for suffix, o in _OPENERS.items() if path.endswith(suffix)), open)
  try:
    with opener(path, "rb") as f:
      data = f.read()
  except (OSError, EOFError, lzma.LZMAError) as e:
    raise UserError(f"{what} {path} cannot be read ({e}); {remedy}") from None
  got = hashlib.sha256(data).hexdigest()
  if got != sha256:
    raise UserError(f"{what} {path} has SHA-256 {got[:16]}..., not the pinned "
                    f"{sha256[:16]}...: it is not the content results were made on; "
                    f"{remedy}")
  return data

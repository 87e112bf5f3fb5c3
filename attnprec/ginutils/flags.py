"""Command-line flags -> gin files and bindings (T5X-style, repeatable):

  --gin_file=PATH          a gin file (relative paths also resolve against the repo's gin/)
  --gin_bindings='A.b=1'   a raw binding
  --gin.A.b=VALUE          rewritten into the binding `A.b = VALUE`; a VALUE that is not a
                           gin/Python literal (e.g. runs/recall) is taken as a string.
"""
import ast
import os
from typing import List, Sequence, Tuple

from attnprec import paths, readback
from attnprec.errors import UserError
from attnprec.paths import REPO_GIN_DIR


def split_flags(argv: Sequence[str]) -> Tuple[List[str], List[str], List[str]]:
  """argv -> (gin files, bindings, remaining args). Accepts --x=v and --x v forms."""
  files, bindings, rest = [], [], []
  args = list(argv)
  i = 0
  while i < len(args):
    arg = args[i]
    if arg.startswith("--gin."):
      name_value = arg[len("--gin."):]
      if "=" not in name_value:
        raise UserError(f"Flag {arg!r} needs a value: --gin.NAME=VALUE, e.g. "
                        f"--gin.decode/precision.float32_logits=True.")
      name, value = name_value.split("=", 1)
      bindings.append(f"{name} = {_as_gin_value(value)}")
    elif arg in ("--gin_file", "--gin_bindings") or arg.startswith(("--gin_file=",
                                                                       "--gin_bindings=")):
      if "=" in arg:
        flag, value = arg.split("=", 1)
      else:
        if i + 1 >= len(args):
          raise UserError(f"Flag {arg} needs a value.")
        flag, value = arg, args[i + 1]
        i += 1
      for v in filter(None, value.split() if flag == "--gin_file" else [value]):
        (files if flag == "--gin_file" else bindings).append(v)
    else:
      rest.append(arg)
    i += 1
  return files, bindings, rest


def _as_gin_value(value: str) -> str:
  value = value.strip()
  if value.startswith(("@", "%", "'", '"', "(", "[", "{")) or value in ("None",):
    return value
  try:
    ast.literal_eval(value)
    return value
  except (ValueError, SyntaxError):
    return repr(value)


def resolve_file(path: str) -> str:
  """The gin file a --gin_file names: as given, or relative to the repository's gin/."""
  if os.path.exists(path) and not os.path.isfile(path):
    kind = "a directory" if os.path.isdir(path) else "not a regular file (a FIFO, a device)"
    raise UserError(f"Gin file {path!r} is {kind}; --gin_file takes a gin file, e.g. "
                    f"gin/precision/fp32_attention.gin.")
  for candidate in (path, os.path.join(REPO_GIN_DIR, path),
                    os.path.join(REPO_GIN_DIR, os.path.relpath(path, "gin"))
                    if path.startswith("gin" + os.sep) else None):
    if candidate and os.path.isfile(candidate):
      readback.check_text_file(candidate, "Gin file")
      return os.path.abspath(candidate)
  available = sorted(os.path.relpath(os.path.join(d, f), os.path.dirname(REPO_GIN_DIR))
                     for d, _, fs in os.walk(REPO_GIN_DIR) for f in fs if f.endswith(".gin"))
  why = paths.unreachable(path)
  why = "not found" if why == "does not exist" else why
  raise UserError(f"Gin file {path!r} {why}. Available gin files: {', '.join(available)}.")

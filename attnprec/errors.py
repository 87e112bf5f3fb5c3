"""User-facing errors: one clear paragraph, no traceback, exit code 2 from the runners."""

# Bad values are echoed in messages at most this long (a 10 MB string or array passed by
# mistake must not become a 10 MB error message).
ECHO_LIMIT = 200


class UserError(ValueError):
  """A problem with the user's input (a config value, a file, a flag).

  Runners catch it, print its message as one paragraph and exit with code 2.
  """


class NonFiniteError(UserError):
  """Logits (or weights) that hold NaN or Inf: a result that must not be compared or
  used. Raised by `checkpoints.logits` / `checkpoints.generate` (unless called with
  `check_finite=False`) and by every runner that decodes; the message says where the
  first non-finite value appeared and, when it can tell, which stage of the model
  produced it (`stage`: e.g. 'layer 1 MLP', None if unknown)."""

  def __init__(self, message: str, *, stage=None):
    super().__init__(message)
    self.stage = stage


def shorten(value, limit: int = ECHO_LIMIT) -> str:
  """`repr(value)` on one line (whitespace runs collapsed: a numpy array's repr spans
  lines), cut to `limit` characters (the cut marked with the full length)."""
  try:
    text = " ".join(repr(value).split())
  except Exception:  # noqa: BLE001 -- a broken __repr__ must not hide the real error
    text = f"<{type(value).__name__} object>"
  if len(text) <= limit:
    return text
  return f"{text[:limit - 30]}... ({len(text)} characters)"


def choice_error(what: str, value, valid) -> UserError:
  """Builds the standard 'bad value, here are the valid ones' error."""
  valid_list = ", ".join(repr(v) for v in valid)
  return UserError(f"Invalid {what} {shorten(value)}; valid values are: {valid_list}.")

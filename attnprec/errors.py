"""User-facing errors: one clear paragraph, no traceback, exit code 2 from the runners."""


class UserError(ValueError):
  """A problem with the user's input (a config value, a file, a flag).

  Runners catch it, print its message as one paragraph and exit with code 2.
  """


def choice_error(what: str, value, valid) -> UserError:
  """Builds the standard 'bad value, here are the valid ones' error."""
  valid_list = ", ".join(repr(v) for v in valid)
  return UserError(f"Invalid {what} {value!r}; valid values are: {valid_list}.")

"""A runner's first line: Ctrl-C or SIGTERM before its run starts ends it at once.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread is; during the
first seconds of a runner (importing jax and the project) that can be inside a callback
that swallows it (jax's garbage-collection hook: "Exception ignored in ..."), and the
runner then goes on, writes its results and exits 0, or inside an import, which ends in
a traceback. `begin(prog)` installs handlers that end the process with the runner's one
line and its exit code (130 / 143 / 129) until `cli.run` takes the signals over: nothing
has been written before then. It also makes standard output safe to lose (a closed pipe,
a full disk, an encoding that cannot show a path). Imports nothing heavy (it runs before
jax is imported).
"""
import os
import signal
import sys

_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


def begin(prog: str, module_name: str) -> None:
  """Until `cli.run` installs its own handlers: SIGINT / SIGTERM / SIGHUP print
  `PROG: interrupted by SIGNAL before the run started; nothing was written` and exit
  130 / 143 / 129 at once. Only in a runner run as a program (`module_name` its `__name__`:
  '__main__'); a runner imported (the tests drive `main(argv)` in-process) leaves the
  process's handlers alone."""
  if module_name != "__main__":
    return

  def stop(signum, frame):
    del frame
    name = signal.Signals(signum).name
    try:
      sys.stderr.write(f"{prog}: interrupted by {name} before the run started; nothing "
                       f"was written\n")
      sys.stderr.flush()
    finally:
      os._exit(_CODES[signum])

  for signum in _CODES:
    signal.signal(signum, stop)
  # A name the terminal's encoding cannot show (a run directory 'dé' under an ASCII
  # locale) is escaped, not a crash after the results were written.
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.reconfigure(errors="backslashreplace")
    except (AttributeError, ValueError):
      pass
  sys.stdout = _StdoutThatMayClose(sys.stdout, prog)


class _StdoutThatMayClose:
  """Standard output whose reader may go away (`| head -1`) or whose disk may fill
  (`> /dev/full`): the first failed write says so once on stderr, points file
  descriptor 1 at /dev/null (so Python's own flush at exit is quiet too) and drops the
  rest. The run goes on and writes its files; its exit code is its own."""

  def __init__(self, stream, prog: str):
    self._stream, self._prog, self._gone = stream, prog, False

  def _close(self, e: OSError) -> None:
    self._gone = True
    try:
      devnull = os.open(os.devnull, os.O_WRONLY)
      os.dup2(devnull, self._stream.fileno())
      os.close(devnull)
      sys.stderr.write(f"{self._prog}: note: standard output failed ({e.strerror or e}); "
                       f"the run goes on and writes its files, but prints no more\n")
    except (OSError, ValueError):
      pass

  def write(self, text):
    if not self._gone:
      try:
        return self._stream.write(text)
      except OSError as e:
        self._close(e)
    return len(text)

  def flush(self):
    if not self._gone:
      try:
        self._stream.flush()
      except OSError as e:
        self._close(e)

  def __getattr__(self, name):
    return getattr(self._stream, name)

"""A runner's first line: Ctrl-C or SIGTERM before its run starts ends it at once.

Python turns SIGINT into a KeyboardInterrupt wherever the main thread is; during the
first seconds of a runner (importing jax and the project) that can be inside a callback
that swallows it (jax's garbage-collection hook: "Exception ignored in ..."), and the
runner then goes on, writes its results and exits 0, or inside an import, which ends in
a traceback. `begin(prog)` installs handlers that end the process with the runner's one
line and its exit code (130 / 143) until `cli.run` takes the signals over: nothing has
been written before then. Imports nothing heavy (it runs before jax is imported).
"""
import os
import signal
import sys

_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def begin(prog: str, module_name: str) -> None:
  """Until `cli.run` installs its own handlers: SIGINT / SIGTERM print
  `PROG: interrupted by SIGNAL before the run started; nothing was written` and exit
  130 / 143 at once. Only in a runner run as a program (`module_name` its `__name__`:
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

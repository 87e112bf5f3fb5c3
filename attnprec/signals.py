"""SIGINT, SIGTERM and SIGHUP, handled alike: one exception, and a way to defer them.

`Interrupted` (a KeyboardInterrupt, so cleanup written for Ctrl-C runs) carries the
signal; the runners (`attnprec.cli`) exit with 128 + its number (130, 143, 129: a
closed terminal hangs up its jobs).
`deferred_signals` lets a loop finish what it is doing (training: the step in flight and
its checkpoint) before it raises. Library code (`attnprec.train`) uses it, so it sits
below the runner layer.
"""
import contextlib
import signal
import threading
from typing import Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
  """SIGINT or SIGTERM arrived (a KeyboardInterrupt, so cleanup written for Ctrl-C runs).
  `note` (optional) says what was saved; runners exit with 128 + signum."""

  def __init__(self, signum: int, note: str = ""):
    super().__init__(signum, note)
    self.signum, self.note = int(signum), note

  @property
  def exit_code(self) -> int:
    return 128 + self.signum

  @property
  def signal_name(self) -> str:
    return signal.Signals(self.signum).name


def _raise_interrupted(signum, frame):
  raise Interrupted(signum)


@contextlib.contextmanager
def _handled_signals(handler):
  """Installs `handler` for SIGINT and SIGTERM while the block runs (main thread only:
  elsewhere Python cannot install handlers, and the block runs unchanged)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {s: signal.signal(s, handler) for s in SIGNALS}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


class deferred_signals:  # noqa: N801 -- used as a context manager, like a function
  """While active, SIGINT and SIGTERM only record themselves (`signum`), so the caller can
  finish what it is doing, save, and then `raise_pending(note)`. A second signal raises
  Interrupted at once (the user insists; atomic saves keep the last good state).

      with signals.deferred_signals() as pending:
        for step in ...:
          ...one step...
          if pending.signum:
            save(); pending.raise_pending(f"saved a checkpoint at step {n} in ...")
  """

  def __init__(self):
    self.signum: Optional[int] = None
    self._handled = None

  def _handler(self, signum, frame):
    if self.signum is not None:
      raise Interrupted(signum, "a second signal: stopped without waiting for the save")
    self.signum = signum

  def raise_pending(self, note: str = "") -> None:
    if self.signum is not None:
      raise Interrupted(self.signum, note)

  def __enter__(self) -> "deferred_signals":
    self._handled = _handled_signals(self._handler)
    self._handled.__enter__()
    return self

  def __exit__(self, *exc) -> None:
    self._handled.__exit__(*exc)

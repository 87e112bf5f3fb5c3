"""Test-only fault injection for the train loop (gin `fault_injection`).

The shipped gin files never bind it; tests do, to prove that training survives faults:
a non-finite loss or gradient at a given step, and a process killed at a known point
(after a step, or in the middle of writing a checkpoint). With nothing bound the train
step is the production program: no injected code is traced at all.

Pauses write `marker` (a file path) first, so a test knows the process is now waiting
there and can SIGKILL it.
"""
import dataclasses
import os
import time
from typing import Optional

import gin

from attnprec.errors import choice_error

NONFINITE_METRICS = ("loss", "grad_norm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Faults:
  nonfinite_at_step: Optional[int] = None   # make the update of this step (1-based) non-finite
  nonfinite_metric: str = "loss"            # "loss" (loss and gradients) or "grad_norm" only
  pause_after_step: Optional[int] = None    # sleep after this step's update (and its save)
  pause_in_save_at_step: Optional[int] = None  # sleep inside the checkpoint save of this step
  pause_s: float = 600.0                    # how long a pause lasts
  marker: str = ""                          # file written when a pause begins

  def __post_init__(self):
    if self.nonfinite_metric not in NONFINITE_METRICS:
      raise choice_error("fault_injection.nonfinite_metric", self.nonfinite_metric,
                         NONFINITE_METRICS)

  def pause(self, where: str) -> None:
    """Announces the pause through `marker`, then sleeps (the test kills us here)."""
    announce(self.marker, where)
    time.sleep(self.pause_s)


def announce(marker: str, where: str) -> None:
  if marker:
    with open(marker, "w") as f:
      f.write(f"{where} pid={os.getpid()}\n")


# gin root; wraps a copy, so Faults(...) in code reads no gin.
fault_injection = gin.external_configurable(Faults, "fault_injection")

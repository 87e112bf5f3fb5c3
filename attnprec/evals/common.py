"""What every task evaluation shares: the presets it decodes, batched greedy generation
(`serving`) with compile time kept apart, and the checks made before any model is loaded.

Presets are the files of gin/precision/ read as `Precision`s of the decode phase
(`attnprec.presets`, the one way the study and the evals pick them); `reference`
names the one every other preset is compared with and is run first.
"""
import dataclasses
from typing import List, Sequence, Tuple

import numpy as np

from attnprec import kernels
from attnprec.checkpoints import serving
from attnprec.errors import UserError
from attnprec.precision import Precision
from attnprec import presets as preset_lib


def pick_presets(names: Sequence[str], reference: str) -> List[Tuple[str, Precision]]:
  """[(name, Precision)], the reference first; unknown names fail with the valid ones."""
  if isinstance(names, str) or not names:
    raise UserError(f"presets must be a non-empty list of preset names, got {names!r:.200}; "
                    f"valid presets: {', '.join(preset_lib.available())}.")
  sweep = preset_lib.load_sweep([reference] + [n for n in names if n != reference])
  return sweep


def with_kernel(sweep: List[Tuple[str, Precision]], kernel, setting: str
                ) -> List[Tuple[str, Precision]]:
  """The sweep with every preset's attention kernel replaced by `kernel` (flags kept);
  a name that is not a kernel, or one that refuses a preset's settings, is a UserError
  naming `setting`."""
  if not isinstance(kernel, str) or kernel not in kernels.CHOICES:
    raise UserError(f"{setting} = {kernel!r:.200} is not an attention kernel; valid "
                    f"kernels: {', '.join(kernels.CHOICES)} (or None for each preset's "
                    f"own).")
  out = []
  for name, precision in sweep:
    try:
      out.append((name, dataclasses.replace(precision, kernel=kernel)))
    except (UserError, ValueError) as e:
      raise UserError(f"{setting} = {kernel!r} cannot run preset {name!r}: {e}") from None
  return out


def positive(name: str, value) -> int:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise UserError(f"{name} must be a positive integer, got {value!r:.200}.")
  return value


@dataclasses.dataclass
class BatchOut:
  tokens: List[List[int]]   # new tokens of each real row, through its end token
  stopped: List[bool]       # it reached an end row (else max_new_tokens)
  finite: List[bool]        # its logits were finite
  steps: int                # decode steps the batch ran (<= max_new_tokens)
  seconds: float            # the run (compile excluded)
  compile_seconds: float    # 0 when the program was compiled before in this process


class Generator:
  """Greedy batched decoding under one Precision (`serving.plan` / `serving.run`): prompts
  padded to a length bucket and the batch to a fixed size (rows repeated, results
  dropped), so a few programs serve a whole eval; each program is compiled once (or
  loaded from the persistent cache) and timed apart from its runs."""

  def __init__(self, ckpt, precision: Precision, *, batch: int, max_new_tokens: int,
               ends_ExL):
    self.ckpt, self.precision = ckpt, precision
    self.batch, self.max_new_tokens = batch, max_new_tokens
    self.ends_ExL = np.asarray(ends_ExL, np.int32)   # `decoding.generate`'s end rows
    if self.ends_ExL.ndim != 2:
      raise ValueError("ends_ExL: [E, L] end rows (-1: any token)")
    self._programs = serving.Programs(size=64)

  def __call__(self, prompts: Sequence[Sequence[int]]) -> BatchOut:
    plan = serving.plan(self.ckpt.config, self.precision, prompts, batch=self.batch,
                        max_new_tokens=self.max_new_tokens, ends=self.ends_ExL)
    out = serving.run(plan, self.ckpt.params, programs=self._programs)
    return BatchOut(out.tokens, out.stopped, out.finite, out.steps, out.seconds,
                    out.compile_seconds)

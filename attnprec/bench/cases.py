"""Bench cases (batch x prompt) as the bench options and the one-off A/B scripts under
results/ write them. Imports nothing heavy (those scripts also run on machines with only
the model's own dependencies)."""
from typing import Tuple

from attnprec.errors import UserError

# `--cases=long`: prefill and decode at about 4k and 8k tokens, batch 1 and 8
LONG_CASES: Tuple[Tuple[int, int], ...] = ((1, 4000), (8, 4000), (1, 8000), (8, 8000))


def repeated(values) -> list:
  """The values a list option names more than once, sorted (each would be measured
  once, or twice: neither is what was asked)."""
  return sorted({v for v in values if list(values).count(v) > 1})


def parse_cases(text: str) -> Tuple[Tuple[int, int], ...]:
  """'1x32,8x1000' -> ((1, 32), (8, 1000)); 'long': LONG_CASES. A malformed case, a
  batch or prompt below 1, or a case given twice is a UserError naming it."""
  if text.strip() == "long":
    return LONG_CASES
  out = []
  for part in text.split(","):
    try:
      B, P = part.lower().split("x")
      out.append((int(B), int(P)))
    except ValueError:
      raise UserError(f"bad case {part!r}: expected BATCHxPROMPT, e.g. 1x32,8x1000") \
          from None
    if out[-1][0] < 1 or out[-1][1] < 1:
      raise UserError(f"bad case {part!r}: batch and prompt length must be >= 1, e.g. 1x32")
  twice = repeated(out)
  if twice:
    raise UserError(f"case {', '.join(f'{b}x{p}' for b, p in twice)} given more than once "
                    f"in {text!r}: each case is measured once, so give each once")
  return tuple(out)

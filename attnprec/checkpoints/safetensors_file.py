"""Reading `.safetensors` files (the HF weight format) with the `safetensors` library.

`safetensors.safe_open(path, framework="numpy")` validates the header when the file is
opened (a truncated or corrupt file raises there), reads each tensor only when asked, and
returns bfloat16 tensors as `ml_dtypes.bfloat16` arrays. This wrapper turns its errors into
one clear `UserError` naming the file.
"""
from typing import Tuple

import numpy as np
import safetensors

from attnprec import paths
from attnprec.errors import UserError

_TRUNCATED = ("not fully covered", "too small", "invalid header length")


class SafetensorsFile:
  """`keys()`, `shape(name)`, `get(name) -> np.ndarray` over one open file."""

  def __init__(self, path):
    self.path = str(path)
    try:
      self._file = safetensors.safe_open(self.path, framework="numpy")
    except FileNotFoundError:
      raise UserError(f"Weights file {self.path} {paths.unreachable(self.path)}.") from None
    except (safetensors.SafetensorError, OSError, ValueError) as e:
      raise self._corrupt(e) from None
    self._keys = tuple(self._file.keys())

  def _corrupt(self, e: BaseException) -> UserError:
    text = " ".join(str(e).split())
    why = (f"it is truncated (shorter than its header says: {text})"
           if any(t in text for t in _TRUNCATED) else f"its header cannot be read ({text})")
    return UserError(f"Weights file {self.path} is not a valid .safetensors file: {why}. "
                     f"Re-download or re-save the checkpoint.")

  def keys(self):
    return self._keys

  def shape(self, name: str) -> Tuple[int, ...]:
    return tuple(self._file.get_slice(name).get_shape())

  def get(self, name: str) -> np.ndarray:
    try:
      return self._file.get_tensor(name)
    except (safetensors.SafetensorError, OSError, ValueError, TypeError) as e:
      raise self._corrupt(e) from None
